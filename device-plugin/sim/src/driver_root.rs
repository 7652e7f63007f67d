//! A fake driver root: what an NVIDIA driver install leaves on a host, with device nodes as
//! plain files, for the tests, benchmarks and demo that run the node agent's validator and CDI
//! generator without a GPU. The one builder of it: the device-plugin tests, the e2e harness and
//! `demo.sh` (through `gpupool-fake-driver-root`) all call [`build`].
//!
//! What it makes, relative to the root:
//! - the control nodes ([`CONTROL_NODES`]) and one `dev/nvidiaN` per GPU;
//! - `dev/nvidia-caps/nvidia-capN` for the config and monitor capabilities (minors 1 and 2) and
//!   for every GPU instance and compute instance the driver could create on each GPU, listed
//!   in `proc/driver/nvidia-caps/mig-minors` as the kernel module lists them;
//! - `proc/driver/nvidia/version`, as the kernel module writes it;
//! - the driver's libraries ([`LIBRARIES`]) as `<name>.so.<driver version>` under [`LIB_DIR`],
//!   plus `libnvidia-ml.so.1.0.0`, a library of another version that a CDI generator must leave
//!   out;
//! - `usr/bin/nvidia-smi` and GSP firmware under `lib/firmware/nvidia/<driver version>/`.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The control device nodes every driver install has, relative to the root.
pub const CONTROL_NODES: [&str; 4] = [
    "dev/nvidiactl",
    "dev/nvidia-uvm",
    "dev/nvidia-uvm-tools",
    "dev/nvidia-modeset",
];

/// Where the driver's user-space libraries go, relative to the root (Debian's x86_64 layout).
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The driver libraries the root holds, each as `<name>.so.<driver version>`.
pub const LIBRARIES: [&str; 4] = [
    "libcuda",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
];

/// A library of another driver version, which a CDI generator must leave out.
pub const OTHER_VERSION_LIBRARY: &str = "libnvidia-ml.so.1.0.0";

/// GPU instance IDs per GPU that `mig-minors` covers (the driver lists every ID it could
/// hand out, not only those in use).
const GPU_INSTANCES: u32 = 15;
/// Compute instance IDs per GPU instance that `mig-minors` covers.
const COMPUTE_INSTANCES: u32 = 8;

/// Why a fake driver root could not be built.
#[derive(Debug, thiserror::Error)]
pub enum DriverRootError {
    /// The version would not make a file name (it is joined into paths under the root).
    #[error("driver version {0:?} is not a dotted version such as 550.54.15")]
    Version(String),
    /// A directory or file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// What the file system said.
        source: io::Error,
    },
}

/// Builds a fake driver root at `root` (created if missing; existing files are overwritten)
/// for driver `driver_version` with `gpus` GPUs. See the module docs for what it holds.
pub fn build(root: &Path, driver_version: &str, gpus: u32) -> Result<(), DriverRootError> {
    let well_formed = !driver_version.is_empty()
        && driver_version
            .split('.')
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()));
    if !well_formed {
        return Err(DriverRootError::Version(driver_version.to_owned()));
    }
    let write = |rel: &str, content: &str| -> Result<(), DriverRootError> {
        let path = root.join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|source| DriverRootError::Write {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        fs::write(&path, content).map_err(|source| DriverRootError::Write { path, source })
    };
    let cap = |minor: u32| format!("dev/nvidia-caps/nvidia-cap{minor}");

    for node in CONTROL_NODES {
        write(node, "")?;
    }
    let mut minors = String::from("config 1\nmonitor 2\n");
    write(&cap(1), "")?;
    write(&cap(2), "")?;
    let mut next = 3;
    for gpu in 0..gpus {
        write(&format!("dev/nvidia{gpu}"), "")?;
        for gi in 0..GPU_INSTANCES {
            // Writing to a String cannot fail.
            let _ = writeln!(minors, "gpu{gpu}/gi{gi}/access {next}");
            write(&cap(next), "")?;
            next += 1;
            for ci in 0..COMPUTE_INSTANCES {
                let _ = writeln!(minors, "gpu{gpu}/gi{gi}/ci{ci}/access {next}");
                write(&cap(next), "")?;
                next += 1;
            }
        }
    }
    write("proc/driver/nvidia-caps/mig-minors", &minors)?;
    write(
        "proc/driver/nvidia/version",
        &format!("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver_version}\n"),
    )?;
    for lib in LIBRARIES {
        write(&format!("{LIB_DIR}/{lib}.so.{driver_version}"), "")?;
    }
    write(&format!("{LIB_DIR}/{OTHER_VERSION_LIBRARY}"), "")?;
    write("usr/bin/nvidia-smi", "")?;
    write(
        &format!("lib/firmware/nvidia/{driver_version}/gsp_ga10x.bin"),
        "",
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test, removed when dropped.
    struct TempRoot(PathBuf);

    impl TempRoot {
        fn new(name: &str) -> TempRoot {
            let dir = std::env::temp_dir().join(format!(
                "gpupool-sim-driver-root-{name}-{}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&dir);
            TempRoot(dir)
        }
    }

    impl Drop for TempRoot {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn fake_driver_root_has_nodes_minors_and_versioned_libraries() {
        let tmp = TempRoot::new("nodes");
        let dir = &tmp.0;
        build(dir, "550.54.15", 2).expect("driver root");
        for path in [
            "dev/nvidiactl",
            "dev/nvidia1",
            "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
        ] {
            assert!(dir.join(path).exists(), "{path}");
        }
        assert!(!dir.join("dev/nvidia2").exists());
        let minors =
            fs::read_to_string(dir.join("proc/driver/nvidia-caps/mig-minors")).expect("minors");
        // 2 GPUs × 15 GPU instances × (1 + 8 compute instances) capability nodes, after config/monitor.
        assert_eq!(minors.lines().count(), 2 + 2 * 15 * 9);
        assert!(minors.contains("gpu1/gi14/ci7/access 272\n"), "{minors}");
        assert!(dir.join("dev/nvidia-caps/nvidia-cap272").exists());
    }

    #[test]
    fn fake_driver_root_has_what_every_former_copy_made() {
        let tmp = TempRoot::new("superset");
        let dir = &tmp.0;
        build(dir, "535.104.05", 1).expect("driver root");
        for path in [
            "dev/nvidiactl",
            "dev/nvidia-uvm",
            "dev/nvidia-uvm-tools",
            "dev/nvidia-modeset",
            "dev/nvidia0",
            "dev/nvidia-caps/nvidia-cap1",
            "dev/nvidia-caps/nvidia-cap2",
            "dev/nvidia-caps/nvidia-cap3",
            "dev/nvidia-caps/nvidia-cap137",
            "usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05",
            "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.104.05",
            "usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.535.104.05",
            "usr/lib/x86_64-linux-gnu/libnvidia-nvvm.so.535.104.05",
            "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1.0.0",
            "usr/bin/nvidia-smi",
            "lib/firmware/nvidia/535.104.05/gsp_ga10x.bin",
        ] {
            assert!(dir.join(path).is_file(), "{path}");
        }
        assert!(!dir.join("dev/nvidia-caps/nvidia-cap138").exists());
        let minors =
            fs::read_to_string(dir.join("proc/driver/nvidia-caps/mig-minors")).expect("minors");
        assert!(minors.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\n"));
        assert!(minors.ends_with("gpu0/gi14/ci7/access 137\n"), "{minors}");
        assert_eq!(
            fs::read_to_string(dir.join("proc/driver/nvidia/version")).expect("version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05\n"
        );
    }

    #[test]
    fn versions_that_are_not_dotted_numbers_are_refused() {
        let tmp = TempRoot::new("versions");
        for bad in ["", "550..1", "../550", "550.54.15/x", "a.b", ".550"] {
            let err = build(&tmp.0, bad, 1).expect_err(bad);
            assert!(matches!(err, DriverRootError::Version(_)), "{bad:?}: {err}");
        }
        assert!(!tmp.0.exists(), "nothing is written for a bad version");
    }
}
