//! The driver root as the agent reads it and as the host names it.
//!
//! In its container the agent never runs on the host's `/usr` or `/lib` (the host's loader and
//! glibc are not the image's, and need not even exist under the names the image's binary
//! asks for). The chart mounts the host's `/` at a path of its own (`/host`), so a driver
//! root `/run/nvidia/driver` is read at `/host/run/nvidia/driver`. The CDI spec, read by the
//! container runtime on the host, must still name `/run/nvidia/driver/...`:
//! [`DriverRoot::to_host`] maps each path found back.

use std::fs;
use std::path::{Component, Path, PathBuf};

use super::ldcache::{self, CacheFlags, LdCache};
use super::{CdiError, HostFiles, LIBRARY_DIRS};

/// The soname NVML is loaded by.
pub const NVML_SONAME: &str = "libnvidia-ml.so.1";

/// A driver root: where this process reads it, and the host's mount namespace root as this
/// process sees it (so that paths found can be given back in the host's terms).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRoot {
    /// Where the driver root is read (`/host/run/nvidia/driver`, or `/` on the host).
    local: PathBuf,
    /// Where the host's `/` is mounted here; `None` when this process sees the host's
    /// filesystem at its own `/` (a process on the host, or a container that mounts the
    /// driver root at the path the host knows it by).
    host_root: Option<PathBuf>,
}

impl DriverRoot {
    /// A driver root read at the path the host knows it by.
    pub fn direct(path: impl Into<PathBuf>) -> DriverRoot {
        DriverRoot {
            local: path.into(),
            host_root: None,
        }
    }

    /// The host's driver root `driver_root` (absolute, in the host's terms), read through
    /// `host_root`, the host's `/` mounted here (`None`: the host's `/` is ours).
    pub fn new(host_root: Option<&Path>, driver_root: &Path) -> Result<DriverRoot, CdiError> {
        let Some(host_root) = host_root else {
            return Ok(DriverRoot::direct(driver_root));
        };
        if !driver_root.is_absolute()
            || driver_root
                .components()
                .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(CdiError::Invalid {
                what: "driver root",
                value: driver_root.display().to_string(),
                reason: "must be an absolute path without '..'".into(),
            });
        }
        // The host's `/` as found here, canonical, so that canonical paths found under the
        // driver root start with it.
        let host_root = fs::canonicalize(host_root).map_err(|source| CdiError::DriverRoot {
            path: host_root.to_path_buf(),
            source,
        })?;
        let relative = driver_root.strip_prefix("/").unwrap_or(driver_root);
        Ok(DriverRoot {
            local: host_root.join(relative),
            host_root: Some(host_root),
        })
    }

    /// Where this process reads the driver root.
    pub fn local(&self) -> &Path {
        &self.local
    }

    /// `path`, found here (canonical), as the host names it: the host root's prefix taken off.
    /// A path outside the host root (which discovery never returns) is given back unchanged.
    pub fn to_host(&self, path: &str) -> String {
        let Some(host_root) = &self.host_root else {
            return path.to_owned();
        };
        match Path::new(path).strip_prefix(host_root) {
            Ok(rest) => Path::new("/").join(rest).to_string_lossy().into_owned(),
            Err(_) => path.to_owned(),
        }
    }

    /// `files`, found under [`Self::local`], with every host path in the host's terms.
    pub fn relocate(&self, mut files: HostFiles) -> HostFiles {
        if self.host_root.is_none() {
            return files;
        }
        for real in files.nodes.values_mut() {
            *real = self.to_host(real);
        }
        for mount in &mut files.mounts {
            mount.host_path = self.to_host(&mount.host_path);
        }
        for library in &mut files.libraries {
            library.host_path = self.to_host(&library.host_path);
        }
        files.libraries.sort();
        files
    }
}

/// Finds the driver's NVML library under `root` (a driver root as this process reads it), so
/// that it is loaded by full path rather than through this process's own loader path: first
/// through the root's ld.so.cache (entries named [`NVML_SONAME`] for this architecture), then
/// in the usual library directories. Only paths that resolve inside the root count.
pub fn find_nvml_library(root: &Path) -> Option<PathBuf> {
    let root = fs::canonicalize(root).ok()?;
    let inside = |rel: &Path| -> Option<PathBuf> {
        if rel.components().any(|c| matches!(c, Component::ParentDir)) {
            return None;
        }
        let rel = rel.strip_prefix("/").unwrap_or(rel);
        let real = fs::canonicalize(root.join(rel)).ok()?;
        (real.starts_with(&root) && real.is_file()).then_some(real)
    };
    let from_cache = CacheFlags::host().and_then(|flags| {
        let cache = LdCache::read(&root.join(ldcache::CACHE_PATH)).ok()?;
        cache
            .for_flags(flags)
            .filter(|e| e.name_str() == Some(NVML_SONAME))
            .find_map(|e| inside(&e.path))
    });
    from_cache.or_else(|| {
        LIBRARY_DIRS
            .iter()
            .find_map(|dir| inside(&Path::new(dir).join(NVML_SONAME)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::{DriverLibrary, MountEdit, SonameSource};

    #[test]
    fn direct_root_keeps_paths() {
        let root = DriverRoot::direct("/");
        assert_eq!(root.local(), Path::new("/"));
        assert_eq!(
            root.to_host("/usr/lib/libcuda.so.1"),
            "/usr/lib/libcuda.so.1"
        );
    }

    #[test]
    fn host_root_maps_both_ways() {
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path().join("host");
        fs::create_dir_all(host.join("run/nvidia/driver")).unwrap();
        let root = DriverRoot::new(Some(&host), Path::new("/run/nvidia/driver")).unwrap();
        let canonical = fs::canonicalize(&host).unwrap();
        assert_eq!(root.local(), canonical.join("run/nvidia/driver"));
        let found = canonical.join("run/nvidia/driver/usr/lib/libcuda.so.550.54.15");
        assert_eq!(
            root.to_host(&found.to_string_lossy()),
            "/run/nvidia/driver/usr/lib/libcuda.so.550.54.15"
        );
        // `/` itself, read through the host root.
        let slash = DriverRoot::new(Some(&host), Path::new("/")).unwrap();
        assert_eq!(slash.local(), canonical);
        assert_eq!(
            slash.to_host(&canonical.join("dev/nvidia0").to_string_lossy()),
            "/dev/nvidia0"
        );
        assert_eq!(slash.to_host(&canonical.to_string_lossy()), "/");
    }

    #[test]
    fn relative_or_climbing_driver_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        for bad in ["run/nvidia/driver", "/run/../etc"] {
            let err = DriverRoot::new(Some(tmp.path()), Path::new(bad)).unwrap_err();
            assert!(err.to_string().contains("absolute path"), "{bad}: {err}");
        }
    }

    #[test]
    fn relocate_rewrites_every_host_path() {
        let tmp = tempfile::tempdir().unwrap();
        let host = fs::canonicalize(tmp.path()).unwrap();
        let root = DriverRoot::new(Some(&host), Path::new("/")).unwrap();
        let at = |p: &str| host.join(p).to_string_lossy().into_owned();
        let files = HostFiles {
            nodes: [("/dev/nvidia0".to_owned(), at("dev/nvidia0"))].into(),
            mounts: vec![MountEdit {
                host_path: at("usr/bin/nvidia-smi"),
                container_path: "/usr/bin/nvidia-smi".into(),
            }],
            libraries: vec![DriverLibrary {
                host_path: at("usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"),
                root_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15".into(),
                soname: Some("libcuda.so.1".into()),
                soname_source: SonameSource::Elf,
                arch: None,
            }],
            ..HostFiles::default()
        };
        let moved = root.relocate(files);
        assert_eq!(moved.nodes["/dev/nvidia0"], "/dev/nvidia0");
        assert_eq!(moved.mounts[0].host_path, "/usr/bin/nvidia-smi");
        assert_eq!(
            moved.libraries[0].host_path,
            "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
        );
    }

    #[test]
    fn nvml_found_by_directory_scan_inside_the_root_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let dir = root.join("usr/lib64");
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(find_nvml_library(&root), None);
        // A link that leaves the root does not count.
        let outside = tmp.path().join("libnvidia-ml.so.550.54.15");
        fs::write(&outside, b"elf").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join(NVML_SONAME)).unwrap();
        assert_eq!(find_nvml_library(&root), None);
        fs::remove_file(dir.join(NVML_SONAME)).unwrap();
        fs::write(dir.join("libnvidia-ml.so.550.54.15"), b"elf").unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.550.54.15", dir.join(NVML_SONAME)).unwrap();
        assert_eq!(
            find_nvml_library(&root),
            Some(fs::canonicalize(dir.join("libnvidia-ml.so.550.54.15")).unwrap())
        );
    }
}
