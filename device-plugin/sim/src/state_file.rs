//! The state file: the fake library's persistence (one JSON file per fixture, shared by every
//! process that loads the library, under an advisory lock), and how tests drive the fake.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{SimError, SimResult};
use crate::node::Node;
use crate::state::SimState;

/// A state file shared by every process that loads the fake library for the same fixture.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
    lock_path: PathBuf,
}

impl StateFile {
    /// The state file for a fixture: `<fixture>.state.json` next to it.
    pub fn for_fixture(fixture: &Path) -> StateFile {
        let mut name = fixture.as_os_str().to_owned();
        name.push(".state.json");
        StateFile::at(PathBuf::from(name))
    }

    /// A state file at an explicit path.
    pub fn at(path: PathBuf) -> StateFile {
        let mut lock = path.as_os_str().to_owned();
        lock.push(".lock");
        StateFile {
            path,
            lock_path: PathBuf::from(lock),
        }
    }

    /// Where the state lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> SimResult<File> {
        // Read-only once it exists: closing a file opened for writing is an inotify
        // IN_CLOSE_WRITE in the state file's directory, which every event waiter of every
        // process would wake for on every read.
        let file = match File::open(&self.lock_path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&self.lock_path),
            other => other,
        }
        .map_err(|e| {
            SimError::Fixture(format!("opening lock {}: {e}", self.lock_path.display()))
        })?;
        file.lock()
            .map_err(|e| SimError::Fixture(format!("locking {}: {e}", self.lock_path.display())))?;
        Ok(file)
    }

    /// The state's text; `None` when the file does not exist yet.
    fn text_unlocked(&self) -> SimResult<Option<String>> {
        match fs::read_to_string(&self.path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(SimError::Fixture(format!(
                "reading state {}: {e}",
                self.path.display()
            ))),
        }
    }

    fn parse(&self, node: &Node, text: &str) -> SimResult<SimState> {
        let state: SimState = serde_json::from_str(text).map_err(|e| {
            SimError::Fixture(format!("parsing state {}: {e}", self.path.display()))
        })?;
        if state.gpus.len() != node.gpus.len() {
            return Err(SimError::Fixture(format!(
                "state {} is for {} GPUs; the fixture has {}",
                self.path.display(),
                state.gpus.len(),
                node.gpus.len()
            )));
        }
        Ok(state)
    }

    fn read_unlocked(&self, node: &Node) -> SimResult<SimState> {
        match self.text_unlocked()? {
            Some(text) => self.parse(node, &text),
            None => Ok(SimState::boot(node)),
        }
    }

    /// Reads the state (the boot state when the file does not exist yet).
    pub fn read(&self, node: &Node) -> SimResult<SimState> {
        let _lock = self.lock()?;
        self.read_unlocked(node)
    }

    /// [`StateFile::read`], parsing only when the text differs from the last read through
    /// `cache`: the file is still read on every call (under the lock, so a change is never
    /// missed), but a caller that reads an unchanged state many times (every NVML call of the
    /// fake library, every event waiter woken by another's change) pays for one parse.
    pub fn read_cached(&self, node: &Node, cache: &StateCache) -> SimResult<Arc<SimState>> {
        let text = {
            let _lock = self.lock()?;
            self.text_unlocked()?
        };
        let Some(text) = text else {
            return Ok(Arc::new(SimState::boot(node)));
        };
        if let Some((last, state)) = cache.lock().as_ref()
            && *last == text
        {
            return Ok(Arc::clone(state));
        }
        let state = Arc::new(self.parse(node, &text)?);
        *cache.lock() = Some((text, Arc::clone(&state)));
        Ok(state)
    }

    /// Read-modify-write under the lock; the file is replaced atomically, and only when the
    /// state changed.
    pub fn update<T>(
        &self,
        node: &Node,
        change: impl FnOnce(&mut SimState) -> SimResult<T>,
    ) -> SimResult<T> {
        let (staged, out) = self.stage(node, change)?;
        staged.commit()?;
        Ok(out)
    }

    /// The first half of [`StateFile::update`]: the changed state is written beside the file,
    /// under the lock, and readers see it only when [`Staged::commit`] renames it into place.
    /// A test that times what readers do with a change (a fault's delivery) starts its clock
    /// at the commit, so the read, encode and write of the change are not in its figure.
    pub fn stage<T>(
        &self,
        node: &Node,
        change: impl FnOnce(&mut SimState) -> SimResult<T>,
    ) -> SimResult<(Staged, T)> {
        let lock = self.lock()?;
        let before = self.read_unlocked(node)?;
        let mut state = before.clone();
        let out = change(&mut state)?;
        let mut staged = Staged {
            _lock: lock,
            tmp: None,
            path: self.path.clone(),
        };
        if state != before {
            let text = serde_json::to_string_pretty(&state)
                .map_err(|e| SimError::Fixture(format!("encoding state: {e}")))?;
            let mut tmp = self.path.as_os_str().to_owned();
            tmp.push(".tmp");
            let tmp = PathBuf::from(tmp);
            // No fsync: the rename keeps a reader from ever seeing half a state, and what this
            // file stands for (MIG instances, injected faults) would not survive a power cut on
            // a real GPU either. A sync here sat between a fault's injection and every
            // reader's wake-up.
            File::create(&tmp)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|e| SimError::Fixture(format!("writing state {}: {e}", tmp.display())))?;
            staged.tmp = Some(tmp);
        }
        Ok((staged, out))
    }
}

/// The last state [`StateFile::read_cached`] parsed, with its text. One per process that
/// shares it among threads.
#[derive(Debug, Default)]
pub struct StateCache(Mutex<Option<(String, Arc<SimState>)>>);

impl StateCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(String, Arc<SimState>)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A changed state written beside the state file, not yet seen by readers; the lock is held
/// until it is committed or dropped (dropped, the change is discarded).
#[derive(Debug)]
#[must_use = "a staged change is discarded unless committed"]
pub struct Staged {
    _lock: File,
    /// `None` when the change left the state as it was: nothing to rename.
    tmp: Option<PathBuf>,
    path: PathBuf,
}

impl Staged {
    /// Renames the staged state into place (one atomic step readers can see) and releases the
    /// lock.
    pub fn commit(mut self) -> SimResult<()> {
        match self.tmp.take() {
            Some(tmp) => fs::rename(&tmp, &self.path).map_err(|e| {
                SimError::Fixture(format!("writing state {}: {e}", self.path.display()))
            }),
            None => Ok(()),
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Node {
        Node::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/faults.yaml")).unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpupool-sim-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A staged change is invisible to readers until committed, and a dropped one is gone.
    #[test]
    fn staged_changes_are_seen_only_once_committed() {
        let node = node();
        let dir = scratch("stage");
        let file = StateFile::at(dir.join("state.json"));
        file.update(&node, |s| {
            s.clock_s = Some(1.0);
            Ok(())
        })
        .unwrap();

        let (staged, out) = file
            .stage(&node, |s| {
                s.clock_s = Some(2.0);
                Ok(7)
            })
            .unwrap();
        assert_eq!(out, 7);
        let on_disk: SimState =
            serde_json::from_str(&fs::read_to_string(file.path()).unwrap()).unwrap();
        assert_eq!(on_disk.clock_s, Some(1.0), "seen before the commit");
        staged.commit().unwrap();
        assert_eq!(file.read(&node).unwrap().clock_s, Some(2.0));

        let (staged, ()) = file
            .stage(&node, |s| {
                s.clock_s = Some(3.0);
                Ok(())
            })
            .unwrap();
        drop(staged);
        assert_eq!(
            file.read(&node).unwrap().clock_s,
            Some(2.0),
            "dropped, yet applied"
        );
        let left: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "temp files left: {left:?}");

        // No change: nothing staged, and the commit is a no-op.
        let (staged, ()) = file.stage(&node, |_| Ok(())).unwrap();
        staged.commit().unwrap();
        assert_eq!(file.read(&node).unwrap().clock_s, Some(2.0));
        fs::remove_dir_all(dir).unwrap();
    }

    /// A cached read parses once per text: an unchanged state comes back as the same value,
    /// and any change, even one that keeps the file's size, is seen by the next read.
    #[test]
    fn cached_reads_parse_once_per_change() {
        let node = node();
        let dir = scratch("cache");
        let file = StateFile::at(dir.join("state.json"));
        let cache = StateCache::default();
        assert_eq!(
            *file.read_cached(&node, &cache).unwrap(),
            SimState::boot(&node),
            "no file yet: the boot state"
        );
        let set_clock = |at: f64| {
            file.update(&node, |s| {
                s.clock_s = Some(at);
                Ok(())
            })
            .unwrap();
        };
        set_clock(1.0);
        let first = file.read_cached(&node, &cache).unwrap();
        let again = file.read_cached(&node, &cache).unwrap();
        assert_eq!(first.clock_s, Some(1.0));
        assert!(Arc::ptr_eq(&first, &again), "unchanged, yet parsed again");
        let size = fs::metadata(file.path()).unwrap().len();
        set_clock(2.0);
        assert_eq!(fs::metadata(file.path()).unwrap().len(), size);
        let changed = file.read_cached(&node, &cache).unwrap();
        assert_eq!(changed.clock_s, Some(2.0), "a same-size change was missed");
        assert_eq!(*changed, file.read(&node).unwrap());
        fs::remove_dir_all(dir).unwrap();
    }
}
