//! The state file: the fake library's persistence (one JSON file per fixture, shared by every
//! process that loads the library, under an advisory lock), and how tests drive the fake.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

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
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock_path)
            .map_err(|e| {
                SimError::Fixture(format!("opening lock {}: {e}", self.lock_path.display()))
            })?;
        file.lock()
            .map_err(|e| SimError::Fixture(format!("locking {}: {e}", self.lock_path.display())))?;
        Ok(file)
    }

    fn read_unlocked(&self, node: &Node) -> SimResult<SimState> {
        match fs::read_to_string(&self.path) {
            Ok(text) => {
                let state: SimState = serde_json::from_str(&text).map_err(|e| {
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
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(SimState::boot(node)),
            Err(e) => Err(SimError::Fixture(format!(
                "reading state {}: {e}",
                self.path.display()
            ))),
        }
    }

    /// Reads the state (the boot state when the file does not exist yet).
    pub fn read(&self, node: &Node) -> SimResult<SimState> {
        let _lock = self.lock()?;
        self.read_unlocked(node)
    }

    /// Read-modify-write under the lock; the file is replaced atomically, and only when the
    /// state changed.
    pub fn update<T>(
        &self,
        node: &Node,
        change: impl FnOnce(&mut SimState) -> SimResult<T>,
    ) -> SimResult<T> {
        let _lock = self.lock()?;
        let before = self.read_unlocked(node)?;
        let mut state = before.clone();
        let out = change(&mut state)?;
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
            let write = |p: &Path| -> std::io::Result<()> {
                let mut f = File::create(p)?;
                f.write_all(text.as_bytes())
            };
            write(&tmp)
                .and_then(|()| fs::rename(&tmp, &self.path))
                .map_err(|e| {
                    SimError::Fixture(format!("writing state {}: {e}", self.path.display()))
                })?;
        }
        Ok(out)
    }
}
