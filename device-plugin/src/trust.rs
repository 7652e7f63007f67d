//! What the node trusts, whatever the API says (docs/security.md). The agent runs the driver's
//! binaries as root and mounts the driver's libraries into every GPU container, so the driver
//! root a GpuNode names is used only when it is one of the node's own allowed roots, reached
//! without a symbolic link; and a program under it runs only when nobody but root (or the
//! agent's own user) can have written it. The API may choose among trusted roots; it cannot
//! add one.

use std::fmt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use gpupool_crds::node::{CheckName, CheckResult};

/// The roots a node trusts unless told otherwise: a driver installed on the host, and the one
/// NVIDIA's driver container mounts.
pub const DEFAULT_ALLOWED_DRIVER_ROOTS: &str = "/,/run/nvidia/driver";

/// Why a driver root (or a program under it) is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not an absolute path in its plain form.
    #[error(
        "driver root {root:?} is refused: write it as a plain absolute path (no '.', '..' or \
         empty components, no trailing '/'), e.g. /run/nvidia/driver"
    )]
    NotPlain {
        /// The root as asked for.
        root: String,
    },
    /// Not on the node's list.
    #[error(
        "driver root {root} is refused: this node trusts only {allowed}; name one of those in \
         the pool's cdi.driverRoot, or add it on the node (chart value agent.allowedDriverRoots, \
         agent flag --allowed-driver-roots)"
    )]
    NotAllowed {
        /// The root as asked for.
        root: String,
        /// The node's list, comma-separated.
        allowed: String,
    },
    /// A component of the root is a symbolic link, which could lead anywhere on the host.
    #[error(
        "driver root {root} is refused: {link} is a symbolic link (the agent follows none on \
         the way to a driver root); mount the driver there instead"
    )]
    Symlink {
        /// The root as asked for.
        root: String,
        /// The component that is a link, host terms.
        link: String,
    },
}

/// A driver root this node trusts, in host terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedRoot(PathBuf);

impl TrustedRoot {
    /// A root the node's own configuration names (the admin's `--driver-root`), trusted as it is.
    pub fn configured(path: PathBuf) -> TrustedRoot {
        TrustedRoot(path)
    }

    /// The root, host terms.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl fmt::Display for TrustedRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.display().fmt(f)
    }
}

/// The driver roots a node allows (`--allowed-driver-roots`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedRoots(Vec<String>);

impl AllowedRoots {
    /// A comma-separated list of plain absolute paths.
    pub fn parse(list: &str) -> Result<AllowedRoots, Refusal> {
        let roots: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(str::to_owned)
            .collect();
        if roots.is_empty() {
            return Err(Refusal::NotPlain { root: list.into() });
        }
        if let Some(bad) = roots.iter().find(|r| !is_plain(r)) {
            return Err(Refusal::NotPlain { root: bad.clone() });
        }
        Ok(AllowedRoots(roots))
    }

    /// The allowed roots, `/` (a driver installed on the host) last.
    pub fn containerized_first(&self) -> impl Iterator<Item = &str> {
        let (host, others): (Vec<&String>, Vec<&String>) =
            self.0.iter().partition(|r| r.as_str() == "/");
        others.into_iter().chain(host).map(String::as_str)
    }

    /// Whether `root` (from the API, host terms) may be used: plain, on the list, and with no
    /// component a symbolic link, read under `host_root` (where the host's `/` is mounted here;
    /// `None`: it is ours). A component that does not exist ends the walk: nothing can be read
    /// under it, and the checks that look for the driver's files say what is missing.
    pub fn check(&self, root: &str, host_root: Option<&Path>) -> Result<TrustedRoot, Refusal> {
        if !is_plain(root) {
            return Err(Refusal::NotPlain { root: root.into() });
        }
        if !self.0.iter().any(|r| r == root) {
            return Err(Refusal::NotAllowed {
                root: root.into(),
                allowed: self.0.join(", "),
            });
        }
        let mut host_path = PathBuf::from("/");
        for part in Path::new(root).components().skip(1) {
            host_path.push(part);
            let local = match host_root {
                Some(h) => h.join(host_path.strip_prefix("/").unwrap_or(&host_path)),
                None => host_path.clone(),
            };
            match std::fs::symlink_metadata(&local) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    return Err(Refusal::Symlink {
                        root: root.into(),
                        link: host_path.display().to_string(),
                    });
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        Ok(TrustedRoot(PathBuf::from(root)))
    }
}

/// Whether `path` is an absolute path in its one plain spelling: `/`, or `/` followed by
/// components none of which is empty, `.` or `..` (so `//proc`, `/./proc` and `/run/` are not).
pub fn is_plain(path: &str) -> bool {
    path == "/"
        || (path.starts_with('/')
            && path[1..]
                .split('/')
                .all(|c| !c.is_empty() && c != "." && c != ".."))
}

/// The check the GpuNode status carries for the driver root in use.
pub fn root_check(
    decision: &Result<TrustedRoot, Refusal>,
    in_use: Option<&TrustedRoot>,
) -> CheckResult {
    let (passed, message) = match (decision, in_use) {
        (Ok(root), _) => (true, format!("driver root {root} is trusted on this node")),
        (Err(why), Some(kept)) => (
            false,
            format!("{why}; still using {kept}, the last trusted root"),
        ),
        (Err(why), None) => (
            false,
            format!(
                "{why}; no driver root is in use: no CDI spec is written and no driver program runs"
            ),
        ),
    };
    CheckResult {
        name: CheckName::DriverRootTrusted,
        passed,
        message,
    }
}

/// Whether the program `program` (as this process reads it) under the driver root `root` (the
/// same terms) may be run as root: it and every directory from `root` down to it are not
/// symbolic links, are owned by root or by this process's user (who could have written it
/// anyway), and are writable by nobody else (no group or other write bit).
pub fn check_program(root: &Path, program: &Path) -> Result<(), String> {
    let rel = program.strip_prefix(root).map_err(|_| {
        format!(
            "{} is not under the driver root {}",
            program.display(),
            root.display()
        )
    })?;
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!("{} is not a plain path", program.display()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut path = root.to_path_buf();
    let mut chain = vec![path.clone()];
    for part in rel.components() {
        path.push(part);
        chain.push(path.clone());
    }
    for (i, step) in chain.iter().enumerate() {
        let meta =
            std::fs::symlink_metadata(step).map_err(|e| format!("{}: {e}", step.display()))?;
        let what = if i + 1 == chain.len() {
            "the program"
        } else {
            "a directory on its path"
        };
        if meta.file_type().is_symlink() {
            return Err(format!(
                "{what} {} is a symbolic link: not run",
                step.display()
            ));
        }
        if meta.uid() != 0 && meta.uid() != me {
            return Err(format!(
                "{what} {} is owned by uid {}, not root: not run",
                step.display(),
                meta.uid()
            ));
        }
        if meta.permissions().mode() & 0o022 != 0 {
            return Err(format!(
                "{what} {} is writable by its group or others (mode {:o}): not run",
                step.display(),
                meta.permissions().mode() & 0o7777
            ));
        }
    }
    Ok(())
}

/// Whether `dir` (as this process reads it) is a directory of the agent's own: a real
/// directory, not a symbolic link, owned by root or this process's user. What is mounted into
/// tenants' containers (the MPS pipe and shared memory) comes only from such directories.
pub fn check_own_dir(dir: &Path) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.file_type().is_symlink() {
        return Err(format!(
            "{} is a symbolic link, not a directory of the agent's",
            dir.display()
        ));
    }
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    if meta.uid() != 0 && meta.uid() != me {
        return Err(format!(
            "{} is owned by uid {}, not by root or the agent",
            dir.display(),
            meta.uid()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn plain_paths() {
        for (path, plain) in [
            ("/", true),
            ("/run/nvidia/driver", true),
            ("", false),
            ("run/nvidia/driver", false),
            ("//run/nvidia/driver", false),
            ("/run//nvidia", false),
            ("/run/./nvidia", false),
            ("/run/../etc", false),
            ("/run/nvidia/", false),
            ("/.", false),
        ] {
            assert_eq!(is_plain(path), plain, "{path:?}");
        }
    }

    #[test]
    fn only_listed_plain_roots_are_trusted() {
        let allowed = AllowedRoots::parse(DEFAULT_ALLOWED_DRIVER_ROOTS).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let host = Some(tmp.path());
        assert_eq!(allowed.check("/", host).unwrap().path(), Path::new("/"));
        assert!(allowed.check("/run/nvidia/driver", host).is_ok());
        for (root, refusal) in [
            ("/tmp/x", "this node trusts only /, /run/nvidia/driver"),
            (
                "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs",
                "trusts only",
            ),
            ("//run/nvidia/driver", "plain absolute path"),
            ("/run/nvidia/driver/", "plain absolute path"),
            ("/run/nvidia/../../tmp", "plain absolute path"),
        ] {
            let err = allowed.check(root, host).unwrap_err().to_string();
            assert!(err.contains(refusal), "{root}: {err}");
            assert!(err.contains("refused"), "{root}: {err}");
        }
        assert_eq!(
            allowed.containerized_first().collect::<Vec<_>>(),
            ["/run/nvidia/driver", "/"]
        );
        let custom = AllowedRoots::parse("/opt/nvidia, /").unwrap();
        assert!(custom.check("/opt/nvidia", host).is_ok());
        assert!(custom.check("/run/nvidia/driver", host).is_err());
        assert!(AllowedRoots::parse("/opt//nvidia").is_err());
        assert!(AllowedRoots::parse(" , ").is_err());
    }

    #[test]
    fn a_symlink_on_the_way_to_an_allowed_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path();
        std::fs::create_dir_all(host.join("var/lib/kubelet")).unwrap();
        std::fs::create_dir_all(host.join("run")).unwrap();
        symlink("../var/lib/kubelet", host.join("run/nvidia")).unwrap();
        let err = AllowedRoots::parse(DEFAULT_ALLOWED_DRIVER_ROOTS)
            .unwrap()
            .check("/run/nvidia/driver", Some(host))
            .unwrap_err();
        assert_eq!(
            err,
            Refusal::Symlink {
                root: "/run/nvidia/driver".into(),
                link: "/run/nvidia".into()
            }
        );
        // A real directory there is trusted.
        std::fs::remove_file(host.join("run/nvidia")).unwrap();
        std::fs::create_dir_all(host.join("run/nvidia/driver")).unwrap();
        assert!(
            AllowedRoots::parse(DEFAULT_ALLOWED_DRIVER_ROOTS)
                .unwrap()
                .check("/run/nvidia/driver", Some(host))
                .is_ok()
        );
    }

    #[test]
    fn own_directories_are_real_directories_of_root_or_the_agent() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("pipe");
        std::fs::create_dir(&real).unwrap();
        check_own_dir(&real).unwrap();
        let link = tmp.path().join("link");
        symlink(&real, &link).unwrap();
        assert!(check_own_dir(&link).unwrap_err().contains("symbolic link"));
        let file = tmp.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(
            check_own_dir(&file)
                .unwrap_err()
                .contains("not a directory")
        );
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&real, Some(4321), None).unwrap();
            assert!(
                check_own_dir(&real)
                    .unwrap_err()
                    .contains("owned by uid 4321")
            );
        }
    }

    #[test]
    fn the_check_says_what_is_kept() {
        let refused = AllowedRoots::parse(DEFAULT_ALLOWED_DRIVER_ROOTS)
            .unwrap()
            .check("/tmp/x", None);
        let kept = TrustedRoot::configured("/".into());
        let check = root_check(&refused, Some(&kept));
        assert!(!check.passed);
        assert_eq!(check.name, CheckName::DriverRootTrusted);
        assert!(check.message.contains("still using /"), "{}", check.message);
        let check = root_check(&refused, None);
        assert!(
            check.message.contains("no CDI spec is written"),
            "{}",
            check.message
        );
        let ok = root_check(&Ok(kept.clone()), Some(&kept));
        assert!(ok.passed);
    }

    #[test]
    fn a_program_runs_only_when_nobody_else_can_have_written_it() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("driver");
        let bin = root.join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        for dir in [&root, &root.join("usr"), &bin] {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let program = bin.join("nvidia-cuda-mps-control");
        std::fs::write(&program, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_program(&root, &program).unwrap();

        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o775)).unwrap();
        let err = check_program(&root, &program).unwrap_err();
        assert!(
            err.contains("writable by its group or others (mode 775)"),
            "{err}"
        );
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();

        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = check_program(&root, &program).unwrap_err();
        assert!(err.contains("a directory on its path"), "{err}");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();

        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&program, Some(1234), None).unwrap();
            let err = check_program(&root, &program).unwrap_err();
            assert!(err.contains("owned by uid 1234, not root"), "{err}");
            std::os::unix::fs::chown(&program, Some(0), None).unwrap();
            check_program(&root, &program).unwrap();
        } else {
            gpupool_sim::testbed::skip("a program owned by another user needs root to chown");
        }

        let elsewhere = tmp.path().join("elsewhere");
        std::fs::write(&elsewhere, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::remove_file(&program).unwrap();
        symlink(&elsewhere, &program).unwrap();
        let err = check_program(&root, &program).unwrap_err();
        assert!(err.contains("is a symbolic link"), "{err}");

        assert!(
            check_program(&root, &elsewhere).is_err(),
            "outside the root"
        );
    }
}
