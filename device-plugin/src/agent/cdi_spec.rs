//! The node's CDI spec as a job of the agent: written (atomically, only when its content
//! changes) from the inventory and the GpuNode's CDI policy, or removed when the policy turns it
//! off; and checked on every pass, because the runtime resolves devices from the file as it is
//! now, not as the agent wrote it. A spec deleted, edited, made unreadable or shadowed by another
//! file's devices leaves pods stuck in ContainerCreating; the check says which ([`assess`],
//! pure) so status, an Event and `/metrics` can, and the next write heals all but a conflict.

use std::fs;
use std::path::{Path, PathBuf};

use gpupool_crds::node::CdiStatus;
use gpupool_crds::policy::CdiPolicy;

use crate::cdi::{self, CdiOptions, DriverRoot};
use crate::inventory::Inventory;

/// The CDI spec as last written, and why it last failed.
#[derive(Debug, Default)]
pub struct CdiJob {
    /// What status reports: the spec's path, digest and device count.
    pub status: Option<CdiStatus>,
    /// Spec files written (content changes).
    pub writes: u64,
    /// Why the spec was last not written; `None` once it is.
    pub last_error: Option<String>,
    /// What was last written, to check the file against.
    written: Option<WrittenSpec>,
    /// What the last check found: `None` before the first write or with CDI off.
    check: Option<Result<(), SpecProblem>>,
    /// The spec last validated and rendered, reused while nothing changes.
    memo: cdi::SpecMemo,
}

/// What the agent wrote, as the check compares the file with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenSpec {
    /// The spec file.
    pub path: PathBuf,
    /// `sha256:<hex>` of the content written.
    pub digest: String,
    /// The CDI kind it defines.
    pub kind: String,
    /// The device names it defines.
    pub devices: Vec<String>,
}

/// What is wrong with the spec the runtime reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    /// The file is gone.
    Missing,
    /// The file is a valid spec of our kind, but not what the agent wrote.
    Modified,
    /// The file is not a CDI spec of our kind (not YAML, no kind, another kind) or unreadable.
    Invalid,
    /// Another spec file the runtime reads defines some of our devices under our kind.
    Conflict,
}

impl ProblemKind {
    /// The `CdiSpecReady` condition's reason.
    pub fn reason(self) -> &'static str {
        match self {
            ProblemKind::Missing => "SpecMissing",
            ProblemKind::Modified => "SpecModified",
            ProblemKind::Invalid => "SpecInvalid",
            ProblemKind::Conflict => "SpecConflict",
        }
    }

    /// The Warning Event's reason.
    pub fn event_reason(self) -> &'static str {
        match self {
            ProblemKind::Missing => "CdiSpecMissing",
            ProblemKind::Modified => "CdiSpecModified",
            ProblemKind::Invalid => "CdiSpecInvalid",
            ProblemKind::Conflict => "CdiSpecConflict",
        }
    }

    /// Whether rewriting our file fixes it (a conflict is in another tool's file, which the
    /// agent leaves alone).
    pub fn heals(self) -> bool {
        self != ProblemKind::Conflict
    }
}

/// A problem with the spec, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecProblem {
    /// Which problem.
    pub kind: ProblemKind,
    /// What was found and what to fix, for status and the Event.
    pub message: String,
}

/// Another spec file the runtime reads, as found.
#[derive(Debug, Clone)]
pub struct OtherSpec {
    /// Where it is.
    pub path: PathBuf,
    /// Its content.
    pub content: Vec<u8>,
}

/// The kind and device names a spec file defines; `Err` says why it is not a CDI spec.
fn kind_and_devices(content: &[u8]) -> Result<(String, Vec<String>), String> {
    let doc: serde_yaml::Value =
        serde_yaml::from_slice(content).map_err(|e| format!("is not YAML or JSON ({e})"))?;
    let kind = doc
        .get("kind")
        .and_then(serde_yaml::Value::as_str)
        .ok_or("has no CDI kind")?
        .to_owned();
    let devices = doc
        .get("devices")
        .and_then(serde_yaml::Value::as_sequence)
        .map(|devices| {
            devices
                .iter()
                .filter_map(|d| d.get("name")?.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    Ok((kind, devices))
}

/// What is wrong with the spec the runtime would read now, given what the agent last wrote,
/// the file's content (`None`: it does not exist) and the other spec files the runtime reads.
/// `None` when nothing is. A file problem comes before a conflict: it is the one a rewrite
/// fixes, and the conflict is still there to find on the next pass.
pub fn assess(
    written: &WrittenSpec,
    ours: Option<&[u8]>,
    others: &[OtherSpec],
) -> Option<SpecProblem> {
    let path = written.path.display();
    let kind = &written.kind;
    let Some(ours) = ours else {
        return Some(SpecProblem {
            kind: ProblemKind::Missing,
            message: format!(
                "{path} was deleted, so containers asking for {kind} devices cannot start; the \
                 agent rewrites it. If it keeps disappearing, find what cleans the CDI directory"
            ),
        });
    };
    if cdi::digest(ours) != written.digest {
        let (problem, what) = match kind_and_devices(ours) {
            Err(why) => (ProblemKind::Invalid, why),
            Ok((found, _)) if &found != kind => (
                ProblemKind::Invalid,
                format!("defines kind {found}, not {kind}"),
            ),
            Ok(_) => (
                ProblemKind::Modified,
                "was changed by something other than the agent".to_owned(),
            ),
        };
        return Some(SpecProblem {
            kind: problem,
            message: format!(
                "{path} {what}; the agent rewrites it. The file is generated: change the \
                 GpuPool's cdi policy instead of editing it"
            ),
        });
    }
    let mut devices: Vec<&str> = Vec::new();
    let mut files: Vec<String> = Vec::new();
    for other in others {
        let Ok((other_kind, names)) = kind_and_devices(&other.content) else {
            continue;
        };
        if &other_kind != kind {
            continue;
        }
        let shared: Vec<&str> = written
            .devices
            .iter()
            .filter(|d| names.contains(d))
            .map(String::as_str)
            .collect();
        if !shared.is_empty() {
            devices.extend(shared);
            files.push(other.path.display().to_string());
        }
    }
    if files.is_empty() {
        return None;
    }
    devices.sort_unstable();
    devices.dedup();
    Some(SpecProblem {
        kind: ProblemKind::Conflict,
        message: format!(
            "{} also define{} {kind} device{} {}, and the runtime refuses a device defined \
             twice: remove {} from {}, or set the GpuPool's cdi.kind to another kind",
            files.join(", "),
            if files.len() == 1 { "s" } else { "" },
            if devices.len() == 1 { "" } else { "s" },
            devices.join(", "),
            if devices.len() == 1 { "it" } else { "them" },
            if files.len() == 1 {
                "that file"
            } else {
                "those files"
            },
        ),
    })
}

/// The directories the runtime reads specs from, given ours: ours, and when it is one of the
/// two standard ones (`/etc/cdi`, `/var/run/cdi`; containerd and CRI-O read both), the other.
pub fn runtime_dirs(spec_dir: &Path) -> Vec<PathBuf> {
    let etc = Path::new("/etc/cdi");
    let run = [Path::new("/var/run/cdi"), Path::new("/run/cdi")];
    let mut dirs = vec![spec_dir.to_path_buf()];
    if spec_dir == etc {
        dirs.push(run[0].to_path_buf());
    } else if run.contains(&spec_dir) {
        dirs.push(etc.to_path_buf());
    }
    dirs
}

/// Spec files larger than this are not read (no spec is; it keeps a pass cheap).
const MAX_SPEC_BYTES: u64 = 4 << 20;

/// The other spec files in `dirs` (`.yaml`, `.yml`, `.json`, not hidden), skipping `ours` and
/// whatever cannot be read: the check is about our devices, not other tools' files.
fn other_specs(dirs: &[PathBuf], ours: &Path) -> Vec<OtherSpec> {
    let mut found = Vec::new();
    for dir in dirs {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let spec_like = [".yaml", ".yml", ".json"].iter().any(|e| name.ends_with(e));
            if !spec_like || name.starts_with('.') || path == ours {
                continue;
            }
            let small = fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() <= MAX_SPEC_BYTES);
            if let (true, Ok(content)) = (small, fs::read(&path)) {
                found.push(OtherSpec { path, content });
            }
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found
}

/// Reads what [`assess`] needs from the file system and assesses it.
pub fn inspect(written: &WrittenSpec) -> Option<SpecProblem> {
    let ours = match fs::read(&written.path) {
        Ok(content) => Some(content),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Some(SpecProblem {
                kind: ProblemKind::Invalid,
                message: format!(
                    "{} cannot be read ({e}); the agent rewrites it",
                    written.path.display()
                ),
            });
        }
    };
    let dir = written.path.parent().unwrap_or(Path::new("/"));
    let others = other_specs(&runtime_dirs(dir), &written.path);
    assess(written, ours.as_deref(), &others)
}

/// The problem a write reveals when it had to put back the very content last written: the
/// file was deleted (nothing was there) or changed by something else, even if that happened
/// after this pass's check. `None` when the write was a real change, or no write.
pub fn rewrite_problem(last: Option<&WrittenSpec>, write: &cdi::Written) -> Option<SpecProblem> {
    let last = last?;
    let rewritten = write.changed && write.path == last.path && write.digest == last.digest;
    rewritten.then(|| changed_under_us(last, write.existed))
}

fn changed_under_us(last: &WrittenSpec, existed: bool) -> SpecProblem {
    if existed {
        SpecProblem {
            kind: ProblemKind::Modified,
            message: format!(
                "{} was changed by something other than the agent; the agent rewrote it",
                last.path.display()
            ),
        }
    } else {
        assess(last, None, &[]).unwrap_or(SpecProblem {
            kind: ProblemKind::Missing,
            message: format!("{} was deleted; the agent rewrote it", last.path.display()),
        })
    }
}

/// The state of the spec as the `CdiSpecReady` condition tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecState {
    /// The file is what the agent wrote and nothing else claims its devices.
    Ready {
        /// The spec file.
        path: String,
    },
    /// The check found a problem.
    Problem(SpecProblem),
    /// The spec could not be written.
    WriteFailed(String),
}

/// Where the driver is: its root in the host's terms (`None`: the policy's), and where the
/// host's `/` is mounted in this process (`None`: at `/`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Roots<'a> {
    /// The driver root in use, one the node trusts ([`crate::trust`]); `None`: the policy's.
    pub driver_root: Option<&'a Path>,
    /// The agent's `--host-root`.
    pub host_root: Option<&'a Path>,
}

impl CdiJob {
    /// Makes the spec under `spec_dir` (else the policy's) match `inventory`, with the driver
    /// under `roots.driver_root` (else the policy's), read through `roots.host_root`. First
    /// checks the file against what was last written; the write then heals a missing,
    /// modified or invalid file.
    pub fn sync(
        &mut self,
        spec_dir: Option<&Path>,
        roots: Roots<'_>,
        policy: &CdiPolicy,
        inventory: &Inventory,
    ) {
        let dir = spec_dir
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(&policy.spec_dir));
        if !policy.enabled {
            match cdi::remove_spec(&dir) {
                Ok(true) => tracing::info!(dir = %dir.display(), "CDI disabled: spec removed"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "removing the CDI spec"),
            }
            self.status = None;
            self.written = None;
            self.check = None;
            return;
        }
        let before = self
            .written
            .as_ref()
            .filter(|w| w.path.parent() == Some(dir.as_path()) && w.kind == policy.kind)
            .and_then(inspect);
        if let Some(p) = &before {
            tracing::warn!(reason = p.kind.reason(), message = %p.message, "CDI spec problem");
        }
        let root = roots
            .driver_root
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(&policy.driver_root));
        let result = CdiOptions::from_policy(policy).and_then(|opts| {
            let root = DriverRoot::new(roots.host_root, &root)?;
            let kind = opts.kind.as_str().to_owned();
            cdi::generate_and_write_memo(inventory, &root, &dir, &opts, &mut self.memo)
                .map(|o| (o, kind))
        });
        match result {
            Ok((outcome, kind)) => {
                // Rewriting the very content last written means something else deleted or
                // edited the file, even when that happened after this pass's check.
                let before = before.or_else(|| {
                    let p = rewrite_problem(self.written.as_ref(), &outcome.written)?;
                    tracing::warn!(reason = p.kind.reason(), message = %p.message, "CDI spec problem");
                    Some(p)
                });
                if outcome.written.changed {
                    self.writes += 1;
                    tracing::info!(path = %outcome.written.path.display(), digest = %outcome.written.digest, devices = outcome.device_names.len(), "CDI spec written");
                }
                for s in &outcome.skipped {
                    tracing::warn!(skipped = %s, "CDI device left out");
                }
                self.status = Some(CdiStatus {
                    path: outcome.written.path.display().to_string(),
                    digest: outcome.written.digest.clone(),
                    devices: outcome.device_names.len() as u32,
                });
                let written = WrittenSpec {
                    path: outcome.written.path,
                    digest: outcome.written.digest,
                    kind,
                    devices: outcome.device_names,
                };
                // A problem the write just healed is still this pass's news; otherwise look
                // again at the file as written (a conflict shows from the first write on).
                self.check = Some(match before.filter(|p| p.kind.heals()) {
                    Some(healed) => Err(healed),
                    None => inspect(&written).map_or(Ok(()), Err),
                });
                self.written = Some(written);
                self.last_error = None;
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::warn!(error = %msg, "CDI spec not written");
                self.last_error = Some(msg);
                if let Some(p) = before {
                    self.check = Some(Err(p));
                }
            }
        }
    }

    /// What the last check found (`None` before the first write or with CDI off).
    pub fn check(&self) -> Option<&Result<(), SpecProblem>> {
        self.check.as_ref()
    }

    /// The spec's state for the `CdiSpecReady` condition: `None` with CDI off or before the
    /// first attempt.
    pub fn state(&self) -> Option<SpecState> {
        if let Some(e) = &self.last_error {
            return Some(SpecState::WriteFailed(e.clone()));
        }
        match (&self.check, &self.written) {
            (Some(Err(p)), _) => Some(SpecState::Problem(p.clone())),
            (Some(Ok(())), Some(w)) => Some(SpecState::Ready {
                path: w.path.display().to_string(),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewrite_of_the_same_content_is_a_deletion_or_an_edit() {
        let last = WrittenSpec {
            path: PathBuf::from("/var/run/cdi/gpupool-nvidia.yaml"),
            digest: "sha256:aa".into(),
            kind: "gpupool.io/gpu".into(),
            devices: vec!["0".into()],
        };
        let write = |changed, existed, digest: &str| cdi::Written {
            path: last.path.clone(),
            digest: digest.into(),
            changed,
            existed,
        };
        let kind = |w: cdi::Written| rewrite_problem(Some(&last), &w).map(|p| p.kind);
        assert_eq!(
            kind(write(true, false, "sha256:aa")),
            Some(ProblemKind::Missing)
        );
        assert_eq!(
            kind(write(true, true, "sha256:aa")),
            Some(ProblemKind::Modified)
        );
        // A new spec (the hardware or the policy changed) is no problem; nor is no write.
        assert_eq!(kind(write(true, true, "sha256:bb")), None);
        assert_eq!(kind(write(false, true, "sha256:aa")), None);
        assert_eq!(
            rewrite_problem(None, &write(true, false, "sha256:aa")),
            None
        );
    }

    const KIND: &str = "gpupool.io/gpu";
    const OURS: &str =
        "cdiVersion: 0.5.0\nkind: gpupool.io/gpu\ndevices:\n- name: '0'\n- name: all\n";

    fn written() -> WrittenSpec {
        WrittenSpec {
            path: PathBuf::from("/var/run/cdi/gpupool-nvidia.yaml"),
            digest: cdi::digest(OURS.as_bytes()),
            kind: KIND.to_owned(),
            devices: vec!["0".into(), "all".into()],
        }
    }

    fn other(path: &str, content: &str) -> OtherSpec {
        OtherSpec {
            path: PathBuf::from(path),
            content: content.as_bytes().to_vec(),
        }
    }

    #[test]
    fn assess_table() {
        let nvidia = "kind: nvidia.com/gpu\ndevices:\n- name: '0'\n- name: all\n";
        let clash =
            "{\"kind\": \"gpupool.io/gpu\", \"devices\": [{\"name\": \"all\"}, {\"name\": \"9\"}]}";
        // name, our file's content, the other files, the problem, words its message has
        type Case<'a> = (
            &'a str,
            Option<&'a str>,
            Vec<OtherSpec>,
            Option<ProblemKind>,
            &'a str,
        );
        let cases: Vec<Case<'_>> = vec![
            ("as written, alone", Some(OURS), vec![], None, ""),
            (
                "another tool's kind in the same dir is fine",
                Some(OURS),
                vec![other("/var/run/cdi/nvidia.yaml", nvidia)],
                None,
                "",
            ),
            (
                "unparseable others are not ours to judge",
                Some(OURS),
                vec![other("/etc/cdi/broken.yaml", "kind: [")],
                None,
                "",
            ),
            (
                "deleted",
                None,
                vec![],
                Some(ProblemKind::Missing),
                "was deleted",
            ),
            (
                "edited, still our kind",
                Some("kind: gpupool.io/gpu\ndevices: []\n"),
                vec![],
                Some(ProblemKind::Modified),
                "changed by something other than the agent",
            ),
            (
                "not YAML",
                Some("kind: [\n"),
                vec![],
                Some(ProblemKind::Invalid),
                "is not YAML",
            ),
            (
                "no kind",
                Some("devices: []\n"),
                vec![],
                Some(ProblemKind::Invalid),
                "has no CDI kind",
            ),
            (
                "another kind",
                Some(nvidia),
                vec![],
                Some(ProblemKind::Invalid),
                "defines kind nvidia.com/gpu, not gpupool.io/gpu",
            ),
            (
                "our kind and a device of ours in another file",
                Some(OURS),
                vec![other("/etc/cdi/extra.json", clash)],
                Some(ProblemKind::Conflict),
                "/etc/cdi/extra.json also defines gpupool.io/gpu device all, and the runtime \
                 refuses a device defined twice: remove it from that file",
            ),
            (
                "a file problem comes before a conflict",
                None,
                vec![other("/etc/cdi/extra.json", clash)],
                Some(ProblemKind::Missing),
                "was deleted",
            ),
        ];
        for (name, ours, others, want, says) in cases {
            let got = assess(&written(), ours.map(str::as_bytes), &others);
            assert_eq!(got.as_ref().map(|p| p.kind), want, "{name}: {got:?}");
            if let Some(p) = got {
                assert!(p.message.contains(says), "{name}: {}", p.message);
            }
        }
    }

    #[test]
    fn runtime_dirs_pair_the_standard_ones() {
        let cases = [
            ("/var/run/cdi", vec!["/var/run/cdi", "/etc/cdi"]),
            ("/run/cdi", vec!["/run/cdi", "/etc/cdi"]),
            ("/etc/cdi", vec!["/etc/cdi", "/var/run/cdi"]),
            ("/tmp/x/cdi", vec!["/tmp/x/cdi"]),
        ];
        for (dir, want) in cases {
            let want: Vec<PathBuf> = want.into_iter().map(PathBuf::from).collect();
            assert_eq!(runtime_dirs(Path::new(dir)), want, "{dir}");
        }
    }

    /// The job against a real directory: the spec is checked on every sync, reported when it
    /// was deleted, edited or shadowed, and rewritten unless another tool's file is at fault.
    #[test]
    fn sync_reports_and_heals_a_deleted_or_edited_spec() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("driver");
        gpupool_sim::driver_root::build(&root, "550.54.15", 2).unwrap();
        let dir = tmp.path().join("cdi");
        let policy = CdiPolicy {
            kind: KIND.to_owned(),
            ..CdiPolicy::default()
        };
        let inv = crate::agent::testing::inventory();
        let mut job = CdiJob::default();
        let sync = |job: &mut CdiJob| {
            job.sync(
                Some(&dir),
                Roots {
                    driver_root: Some(&root),
                    host_root: None,
                },
                &policy,
                &inv,
            )
        };
        let spec = dir.join(cdi::SPEC_FILE_NAME);

        sync(&mut job);
        assert_eq!(job.check(), Some(&Ok(())));
        assert!(matches!(job.state(), Some(SpecState::Ready { .. })));
        let content = fs::read(&spec).unwrap();
        assert_eq!(job.writes, 1);

        fs::remove_file(&spec).unwrap();
        sync(&mut job);
        let problem = |job: &CdiJob| match job.check() {
            Some(Err(p)) => Some(p.kind),
            _ => None,
        };
        assert_eq!(problem(&job), Some(ProblemKind::Missing));
        assert_eq!(fs::read(&spec).unwrap(), content, "rewritten");
        assert_eq!(job.writes, 2);
        sync(&mut job);
        assert_eq!(job.check(), Some(&Ok(())));

        fs::write(&spec, b"kind: [").unwrap();
        sync(&mut job);
        assert_eq!(problem(&job), Some(ProblemKind::Invalid));
        assert_eq!(fs::read(&spec).unwrap(), content, "rewritten");

        // Another tool's file claiming our devices: reported on every pass, never touched.
        let theirs = dir.join("other-tool.yaml");
        let clash = "cdiVersion: 0.5.0\nkind: gpupool.io/gpu\ndevices:\n- name: all\n";
        fs::write(&theirs, clash).unwrap();
        sync(&mut job);
        sync(&mut job);
        assert_eq!(problem(&job), Some(ProblemKind::Conflict));
        assert!(matches!(
            job.state(),
            Some(SpecState::Problem(SpecProblem {
                kind: ProblemKind::Conflict,
                ..
            }))
        ));
        assert_eq!(fs::read_to_string(&theirs).unwrap(), clash);
        fs::remove_file(&theirs).unwrap();
        sync(&mut job);
        assert_eq!(job.check(), Some(&Ok(())));

        // CDI off: no check, no state.
        let off = CdiPolicy {
            enabled: false,
            ..policy.clone()
        };
        job.sync(
            Some(&dir),
            Roots {
                driver_root: Some(&root),
                host_root: None,
            },
            &off,
            &inv,
        );
        assert_eq!((job.check(), job.state()), (None, None));
    }
}
