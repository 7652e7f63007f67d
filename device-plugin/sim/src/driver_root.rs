//! A fake driver root: what an NVIDIA driver install leaves on a host, for the tests,
//! benchmarks and demo that run the node agent's validator and CDI generator without a GPU,
//! and (with [`BuildOptions`]) for the end-to-end layer that starts real containers from it.
//! The one builder of it: the device-plugin tests, the e2e harness and `demo.sh` (through
//! `gpupool-fake-driver-root`) all call [`build`] or [`build_with`].
//!
//! What it makes, relative to the root:
//! - the control nodes ([`CONTROL_NODES`]) and one `dev/nvidiaN` per GPU;
//! - `dev/nvidia-caps/nvidia-capN` for the config and monitor capabilities (minors 1 and 2) and
//!   for every GPU instance and compute instance the driver could create on each GPU, listed
//!   in `proc/driver/nvidia-caps/mig-minors` as the kernel module lists them;
//! - `proc/driver/nvidia/version`, as the kernel module writes it;
//! - the driver's libraries ([`LIBRARIES`]: compute, video, graphics) as
//!   `<name>.so.<driver version>` under [`LIB_DIR`] (`libvdpau_nvidia` under its `vdpau/`),
//!   the legacy `libnvidia-nvvm70.so.4`, and `libnvidia-ml.so.1.0.0`, a library of another
//!   version that a CDI generator must leave out;
//! - the loaders' configuration files ([`CONFIG_FILES`]), the driver's executables
//!   ([`BINARIES`], mode 0755), GSP firmware under `lib/firmware/nvidia/<driver version>/`,
//!   the MPS pipe directory `tmp/nvidia-mps` and the daemons' sockets ([`SOCKETS`]).
//!
//! By default device nodes are plain files and libraries empty files, so tests run fast and
//! unprivileged. [`BuildOptions`] asks for what a real runtime needs instead: character device
//! nodes (`mknod`, root), real ELF shared objects carrying their soname (`cc`), given files
//! installed as `libnvidia-ml` and `libcuda`, and the soname links plus an `etc/ld.so.cache`
//! made by `ldconfig -r` (root).

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The control device nodes every driver install has, relative to the root, with their
/// device numbers.
pub const CONTROL_NODES: [&str; 4] = [
    "dev/nvidiactl",
    "dev/nvidia-uvm",
    "dev/nvidia-uvm-tools",
    "dev/nvidia-modeset",
];

/// `(major, minor)` of each of [`CONTROL_NODES`], in the same order.
const CONTROL_NUMBERS: [(u32, u32); 4] = [(195, 255), (510, 0), (510, 1), (195, 254)];
/// Major number of `/dev/nvidiaN` (minor N).
const GPU_MAJOR: u32 = 195;
/// Major number of the `nvidia-caps` nodes (dynamic on real hosts; this is a common value).
const CAPS_MAJOR: u32 = 236;

/// Where the driver's user-space libraries go, relative to the root (Debian's x86_64 layout).
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The driver libraries the root holds: `(name, soname, subdirectory of LIB_DIR)`. Each file is
/// `<name>.so.<driver version>`; a soname of `None` is the file name itself (those libraries
/// are asked for by their versioned name).
pub const LIBRARIES: [(&str, Option<&str>, &str); 27] = [
    // compute
    ("libcuda", Some("libcuda.so.1"), ""),
    ("libcudadebugger", Some("libcudadebugger.so.1"), ""),
    ("libnvidia-ml", Some("libnvidia-ml.so.1"), ""),
    (
        "libnvidia-ptxjitcompiler",
        Some("libnvidia-ptxjitcompiler.so.1"),
        "",
    ),
    ("libnvidia-nvvm", Some("libnvidia-nvvm.so.4"), ""),
    ("libnvidia-opencl", Some("libnvidia-opencl.so.1"), ""),
    ("libnvidia-cfg", Some("libnvidia-cfg.so.1"), ""),
    ("libnvidia-gpucomp", None, ""),
    ("libnvidia-allocator", Some("libnvidia-allocator.so.1"), ""),
    ("libnvidia-pkcs11", None, ""),
    ("libnvidia-pkcs11-openssl3", None, ""),
    // video
    ("libnvcuvid", Some("libnvcuvid.so.1"), ""),
    ("libnvidia-encode", Some("libnvidia-encode.so.1"), ""),
    (
        "libnvidia-opticalflow",
        Some("libnvidia-opticalflow.so.1"),
        "",
    ),
    // graphics
    ("libGLX_nvidia", Some("libGLX_nvidia.so.0"), ""),
    ("libEGL_nvidia", Some("libEGL_nvidia.so.0"), ""),
    ("libGLESv2_nvidia", Some("libGLESv2_nvidia.so.2"), ""),
    ("libGLESv1_CM_nvidia", Some("libGLESv1_CM_nvidia.so.1"), ""),
    ("libnvidia-glcore", None, ""),
    ("libnvidia-tls", None, ""),
    ("libnvidia-glsi", None, ""),
    ("libnvidia-eglcore", None, ""),
    ("libnvidia-glvkspirv", None, ""),
    ("libnvidia-rtcore", None, ""),
    ("libnvoptix", Some("libnvoptix.so.1"), ""),
    ("libnvidia-fbc", Some("libnvidia-fbc.so.1"), ""),
    ("libvdpau_nvidia", Some("libvdpau_nvidia.so.1"), "vdpau"),
];

/// CUDA 11's NVVM, named by its soname rather than the driver version.
pub const LEGACY_NVVM_LIBRARY: &str = "libnvidia-nvvm70.so.4";

/// A library of another driver version, which a CDI generator must leave out.
pub const OTHER_VERSION_LIBRARY: &str = "libnvidia-ml.so.1.0.0";

/// The fake `nvidia-cuda-mps-control` (POSIX shell, run with the host's `/bin/sh`). With `-f`
/// it is the daemon: it makes the control pipe `control` in `$CUDA_MPS_PIPE_DIRECTORY`, records
/// its start (`start devices=<CUDA_VISIBLE_DEVICES>`) and then every command it receives, one
/// per line, in `$CUDA_MPS_LOG_DIRECTORY/control.log`, leaves a `gpupool-fake-mps` file in its
/// `/dev/shm` (so a test can see which directory that was), and ends on `quit`. Without
/// arguments it is the client: it passes its input to the daemon's control pipe, and fails
/// when there is none, as the real one does.
pub const FAKE_MPS_CONTROL: &str = r#"#!/bin/sh
pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
log=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
case "${1:-}" in
-f | -d)
    mkdir -p "$pipe" "$log" || exit 1
    rm -f "$pipe/control"
    mkfifo "$pipe/control" || exit 1
    : > /dev/shm/gpupool-fake-mps
    echo "start devices=${CUDA_VISIBLE_DEVICES:-}" >> "$log/control.log"
    trap 'rm -f "$pipe/control"; exit 0' TERM INT
    while :; do
        while IFS= read -r line; do
            echo "$line" >> "$log/control.log"
            if [ "$line" = quit ]; then
                rm -f "$pipe/control"
                exit 0
            fi
        done < "$pipe/control"
    done
    ;;
"")
    if [ ! -p "$pipe/control" ]; then
        echo "Cannot find MPS control daemon process" >&2
        exit 1
    fi
    cat > "$pipe/control"
    ;;
*)
    echo "fake $0: unsupported arguments: $*" >&2
    exit 2
    ;;
esac
"#;

/// The driver's executables, relative to the root.
pub const BINARIES: [&str; 7] = [
    "usr/bin/nvidia-smi",
    "usr/bin/nvidia-debugdump",
    "usr/bin/nvidia-persistenced",
    "usr/bin/nvidia-cuda-mps-control",
    "usr/bin/nvidia-cuda-mps-server",
    "usr/bin/nvidia-imex",
    "usr/bin/nvidia-imex-ctl",
];

/// The loaders' configuration files a driver install writes, relative to the root.
pub const CONFIG_FILES: [&str; 8] = [
    "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
    "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
    "usr/share/vulkan/icd.d/nvidia_icd.json",
    "usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    "usr/share/nvidia/nvoptix.bin",
    "etc/OpenCL/vendors/nvidia.icd",
    "etc/X11/xorg.conf.d/10-nvidia.conf",
];

/// The driver daemons' IPC sockets, relative to the root.
pub const SOCKETS: [&str; 2] = [
    "run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
];

/// The MPS control daemon's pipe directory, relative to the root.
pub const MPS_PIPE_DIR: &str = "tmp/nvidia-mps";

/// GSP firmware files, under `lib/firmware/nvidia/<driver version>/`.
pub const FIRMWARE: [&str; 2] = ["gsp_ga10x.bin", "gsp_tu10x.bin"];

/// GPU instance IDs per GPU that `mig-minors` covers (the driver lists every ID it could
/// hand out, not only those in use).
const GPU_INSTANCES: u32 = 15;
/// Compute instance IDs per GPU instance that `mig-minors` covers.
const COMPUTE_INSTANCES: u32 = 8;

/// How device nodes are made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeviceNodes {
    /// Empty regular files (no privileges needed; enough for the validator and the CDI
    /// generator, not for a container runtime).
    #[default]
    PlainFiles,
    /// Character devices with the driver's numbers, made with `mknod` (needs root or
    /// CAP_MKNOD): 195:N for `nvidiaN`, 195:255 `nvidiactl`, 195:254 `nvidia-modeset`, 510:0
    /// and 510:1 for the UVM nodes, 236:M for `nvidia-caps/nvidia-capM`.
    CharDevices,
}

/// What [`build_with`] makes beyond the defaults of [`build`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildOptions {
    /// Make each library a real ELF shared object with its soname (`cc -shared`), instead of
    /// an empty file.
    pub elf_libraries: bool,
    /// How device nodes are made.
    pub device_nodes: DeviceNodes,
    /// A file installed as `libnvidia-ml.so.<driver version>` (e.g. the fake NVML).
    pub nvml: Option<PathBuf>,
    /// A file installed as `libcuda.so.<driver version>` (e.g. a fake libcuda).
    pub cuda: Option<PathBuf>,
    /// An executable installed as `usr/bin/nvidia-smi` (e.g. one that lists NVML's GPUs)
    /// instead of the placeholder script.
    pub nvidia_smi: Option<PathBuf>,
    /// Make the soname links (`libcuda.so.1` → `libcuda.so.<driver version>`) and run
    /// `ldconfig -r <root>` to write `etc/ld.so.cache` (needs root: ldconfig chroots).
    pub ldconfig: bool,
}

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
    /// A tool the options need could not be run or failed.
    #[error("{what}: {detail}")]
    Tool {
        /// What was being done (`cc building <file>`, `mknod <path>`, `ldconfig -r <root>`).
        what: String,
        /// Why it failed (the tool's error output, or why it could not start).
        detail: String,
    },
}

/// Builds a fake driver root at `root` (created if missing; existing files are overwritten)
/// for driver `driver_version` with `gpus` GPUs, with plain files for device nodes and
/// libraries. See the module docs for what it holds.
pub fn build(root: &Path, driver_version: &str, gpus: u32) -> Result<(), DriverRootError> {
    build_with(root, driver_version, gpus, &BuildOptions::default())
}

fn write_error(path: &Path) -> impl FnOnce(io::Error) -> DriverRootError {
    let path = path.to_path_buf();
    move |source| DriverRootError::Write { path, source }
}

/// Creates the parent directories of `path`.
fn parent_dirs(path: &Path) -> Result<(), DriverRootError> {
    match path.parent() {
        Some(parent) => fs::create_dir_all(parent).map_err(write_error(parent)),
        None => Ok(()),
    }
}

/// Removes whatever is at `path` (a file, link, node or socket), so it can be made anew.
fn clear(path: &Path) -> Result<(), DriverRootError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(write_error(path)(e)),
    }
}

/// Runs `command`, turning a failure to start or a non-zero exit into [`DriverRootError::Tool`].
fn run(command: &mut Command, what: impl FnOnce() -> String) -> Result<(), DriverRootError> {
    match command.output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(DriverRootError::Tool {
            what: what(),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }),
        Err(e) => Err(DriverRootError::Tool {
            what: what(),
            detail: format!("cannot run {:?}: {e}", command.get_program()),
        }),
    }
}

/// Builds a fake driver root as [`build`] does, with what `options` asks for on top.
pub fn build_with(
    root: &Path,
    driver_version: &str,
    gpus: u32,
    options: &BuildOptions,
) -> Result<(), DriverRootError> {
    let well_formed = !driver_version.is_empty()
        && driver_version
            .split('.')
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()));
    if !well_formed {
        return Err(DriverRootError::Version(driver_version.to_owned()));
    }
    let write = |rel: &str, content: &str| -> Result<(), DriverRootError> {
        let path = root.join(rel);
        parent_dirs(&path)?;
        clear(&path)?;
        fs::write(&path, content).map_err(write_error(&path))
    };
    let node = |rel: &str, major: u32, minor: u32| -> Result<(), DriverRootError> {
        match options.device_nodes {
            DeviceNodes::PlainFiles => write(rel, ""),
            DeviceNodes::CharDevices => {
                let path = root.join(rel);
                parent_dirs(&path)?;
                clear(&path)?;
                run(
                    Command::new("mknod").args(["-m", "0666"]).arg(&path).args([
                        "c",
                        &major.to_string(),
                        &minor.to_string(),
                    ]),
                    || format!("mknod {} (needs root or CAP_MKNOD)", path.display()),
                )
            }
        }
    };
    let cap = |minor: u32| format!("dev/nvidia-caps/nvidia-cap{minor}");

    for (rel, (major, minor)) in CONTROL_NODES.iter().zip(CONTROL_NUMBERS) {
        node(rel, major, minor)?;
    }
    let mut minors = String::from("config 1\nmonitor 2\n");
    node(&cap(1), CAPS_MAJOR, 1)?;
    node(&cap(2), CAPS_MAJOR, 2)?;
    let mut next = 3;
    for gpu in 0..gpus {
        node(&format!("dev/nvidia{gpu}"), GPU_MAJOR, gpu)?;
        for gi in 0..GPU_INSTANCES {
            // Writing to a String cannot fail.
            let _ = writeln!(minors, "gpu{gpu}/gi{gi}/access {next}");
            node(&cap(next), CAPS_MAJOR, next)?;
            next += 1;
            for ci in 0..COMPUTE_INSTANCES {
                let _ = writeln!(minors, "gpu{gpu}/gi{gi}/ci{ci}/access {next}");
                node(&cap(next), CAPS_MAJOR, next)?;
                next += 1;
            }
        }
    }
    write("proc/driver/nvidia-caps/mig-minors", &minors)?;
    write(
        "proc/driver/nvidia/version",
        &format!("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver_version}\n"),
    )?;

    let libraries = libraries(driver_version);
    let elf = if options.elf_libraries {
        Some(ElfSource::new(root)?)
    } else {
        None
    };
    for lib in &libraries {
        let path = root.join(&lib.rel);
        if let Some(source) = &elf {
            parent_dirs(&path)?;
            clear(&path)?;
            source.compile(&path, &lib.soname)?;
        } else {
            write(&lib.rel, "")?;
        }
    }
    if let Some(source) = elf {
        source.remove();
    }
    for (given, name) in [(&options.nvml, "libnvidia-ml"), (&options.cuda, "libcuda")] {
        if let Some(given) = given {
            let path = root.join(format!("{LIB_DIR}/{name}.so.{driver_version}"));
            clear(&path)?;
            fs::copy(given, &path).map_err(|source| DriverRootError::Write {
                path: path.clone(),
                source: io::Error::new(
                    source.kind(),
                    format!("copying {}: {source}", given.display()),
                ),
            })?;
        }
    }
    write(&format!("{LIB_DIR}/{OTHER_VERSION_LIBRARY}"), "")?;

    for rel in BINARIES {
        let path = root.join(rel);
        match (&options.nvidia_smi, rel) {
            (Some(given), "usr/bin/nvidia-smi") => {
                parent_dirs(&path)?;
                clear(&path)?;
                fs::copy(given, &path).map_err(write_error(&path))?;
            }
            (_, "usr/bin/nvidia-cuda-mps-control") => write(rel, FAKE_MPS_CONTROL)?,
            _ => write(rel, "#!/bin/sh\nexit 0\n")?,
        }
        fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(write_error(&path))?;
    }
    for rel in CONFIG_FILES {
        write(rel, "{}\n")?;
    }
    for name in FIRMWARE {
        write(&format!("lib/firmware/nvidia/{driver_version}/{name}"), "")?;
    }
    let mps = root.join(MPS_PIPE_DIR);
    fs::create_dir_all(&mps).map_err(write_error(&mps))?;
    for rel in SOCKETS {
        make_socket(root, rel)?;
    }
    if options.ldconfig {
        for lib in &libraries {
            if let Some((dir, file)) = lib.rel.rsplit_once('/')
                && lib.soname != file
            {
                let link = root.join(dir).join(&lib.soname);
                clear(&link)?;
                std::os::unix::fs::symlink(file, &link).map_err(write_error(&link))?;
            }
        }
        write("etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n")?;
        write(
            "etc/ld.so.conf.d/x86_64-linux-gnu.conf",
            &format!("/{LIB_DIR}\n"),
        )?;
        run(Command::new("ldconfig").arg("-r").arg(root), || {
            format!("ldconfig -r {} (needs root: it chroots)", root.display())
        })?;
    }
    Ok(())
}

/// A library the root holds: its path relative to the root and its soname.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeLibrary {
    /// Path relative to the root.
    pub rel: String,
    /// The soname its ELF file carries (and its link, with [`BuildOptions::ldconfig`]).
    pub soname: String,
}

/// Every library [`build`] makes for `driver_version`, except [`OTHER_VERSION_LIBRARY`].
pub fn libraries(driver_version: &str) -> Vec<FakeLibrary> {
    let mut all: Vec<FakeLibrary> = LIBRARIES
        .iter()
        .map(|(name, soname, sub)| {
            let file = format!("{name}.so.{driver_version}");
            let dir = if sub.is_empty() {
                LIB_DIR.to_owned()
            } else {
                format!("{LIB_DIR}/{sub}")
            };
            FakeLibrary {
                rel: format!("{dir}/{file}"),
                soname: soname.map_or(file, str::to_owned),
            }
        })
        .collect();
    all.push(FakeLibrary {
        rel: format!("{LIB_DIR}/{LEGACY_NVVM_LIBRARY}"),
        soname: LEGACY_NVVM_LIBRARY.to_owned(),
    });
    all
}

/// The C file the ELF libraries are compiled from, written once per build.
struct ElfSource(PathBuf);

impl ElfSource {
    fn new(root: &Path) -> Result<ElfSource, DriverRootError> {
        let path = root.join(".gpupool-fake-library.c");
        parent_dirs(&path)?;
        fs::write(&path, "int gpupool_fake_driver_library;\n").map_err(write_error(&path))?;
        Ok(ElfSource(path))
    }

    /// `cc -shared -fPIC -Wl,-soname,<soname> -o <path>`.
    fn compile(&self, path: &Path, soname: &str) -> Result<(), DriverRootError> {
        run(
            Command::new("cc")
                .args(["-shared", "-fPIC", "-nostdlib"])
                .arg(format!("-Wl,-soname,{soname}"))
                .arg("-o")
                .arg(path)
                .arg(&self.0),
            || {
                format!(
                    "cc building {} (a C compiler is needed for ELF libraries)",
                    path.display()
                )
            },
        )
    }

    fn remove(self) {
        // A leftover source file does no harm; the root is a fixture.
        let _ = fs::remove_file(&self.0);
    }
}

/// A listening socket's file at `rel` (the listener is closed, the file stays, as after a
/// daemon's restart); a plain file where the path is too long for a socket address.
fn make_socket(root: &Path, rel: &str) -> Result<(), DriverRootError> {
    let path = root.join(rel);
    parent_dirs(&path)?;
    clear(&path)?;
    match std::os::unix::net::UnixListener::bind(&path) {
        Ok(_listener) => Ok(()),
        Err(_) => fs::write(&path, "").map_err(write_error(&path)),
    }
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
    fn fake_driver_root_has_a_full_install() {
        let tmp = TempRoot::new("full");
        let dir = &tmp.0;
        build(dir, "550.54.15", 1).expect("driver root");
        for lib in libraries("550.54.15") {
            assert!(dir.join(&lib.rel).is_file(), "{}", lib.rel);
        }
        assert!(
            dir.join("usr/lib/x86_64-linux-gnu/vdpau/libvdpau_nvidia.so.550.54.15")
                .is_file()
        );
        for rel in BINARIES {
            let mode = fs::metadata(dir.join(rel)).expect(rel).permissions();
            assert_eq!(
                std::os::unix::fs::PermissionsExt::mode(&mode) & 0o111,
                0o111,
                "{rel}"
            );
        }
        for rel in CONFIG_FILES {
            assert!(dir.join(rel).is_file(), "{rel}");
        }
        assert!(dir.join(MPS_PIPE_DIR).is_dir());
        assert!(
            dir.join("lib/firmware/nvidia/550.54.15/gsp_tu10x.bin")
                .is_file()
        );
        for rel in SOCKETS {
            assert!(dir.join(rel).exists(), "{rel}");
        }
        // Building again over an existing root works (sockets and files are replaced).
        build(dir, "550.54.15", 1).expect("second build");
    }

    fn have_cc() -> bool {
        Command::new("cc").arg("--version").output().is_ok()
    }

    #[test]
    fn elf_libraries_carry_their_soname() {
        if !have_cc() {
            crate::testbed::skip("no C compiler (cc) on this machine");
            return;
        }
        let tmp = TempRoot::new("elf");
        let dir = &tmp.0;
        let options = BuildOptions {
            elf_libraries: true,
            ..BuildOptions::default()
        };
        build_with(dir, "550.54.15", 1, &options).expect("driver root");
        let cuda = fs::read(dir.join("usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")).unwrap();
        assert_eq!(&cuda[..4], b"\x7fELF");
        assert!(
            cuda.windows(b"libcuda.so.1\0".len())
                .any(|w| w == b"libcuda.so.1\0"),
            "soname string in the file"
        );
        assert!(!dir.join(".gpupool-fake-library.c").exists());
    }

    #[test]
    fn a_given_nvidia_smi_replaces_the_placeholder_executable() {
        let tmp = TempRoot::new("smi");
        let dir = &tmp.0;
        fs::create_dir_all(dir).unwrap();
        let smi = dir.join("smi");
        fs::write(&smi, "fake smi").unwrap();
        let options = BuildOptions {
            nvidia_smi: Some(smi),
            ..BuildOptions::default()
        };
        build_with(&dir.join("root"), "550.54.15", 1, &options).unwrap();
        let installed = dir.join("root/usr/bin/nvidia-smi");
        assert_eq!(fs::read_to_string(&installed).unwrap(), "fake smi");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&installed).unwrap().permissions().mode() & 0o777,
            0o755
        );
        // The other executables keep the placeholder.
        assert!(
            fs::read_to_string(dir.join("root/usr/bin/nvidia-debugdump"))
                .unwrap()
                .starts_with("#!/bin/sh")
        );
    }

    #[test]
    fn given_libraries_are_installed() {
        let tmp = TempRoot::new("given");
        let dir = &tmp.0;
        fs::create_dir_all(dir).unwrap();
        let nvml = dir.join("fake-nvml.so");
        fs::write(&nvml, "fake nvml").unwrap();
        let options = BuildOptions {
            nvml: Some(nvml),
            cuda: Some(dir.join("missing.so")),
            ..BuildOptions::default()
        };
        let err = build_with(&dir.join("root"), "550.54.15", 1, &options).unwrap_err();
        assert!(err.to_string().contains("missing.so"), "{err}");
        let options = BuildOptions {
            cuda: None,
            ..options
        };
        build_with(&dir.join("root"), "550.54.15", 1, &options).unwrap();
        assert_eq!(
            fs::read_to_string(dir.join("root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15"))
                .unwrap(),
            "fake nvml"
        );
    }

    /// Character devices and ldconfig need root; elsewhere the test says so and stops.
    #[test]
    fn char_devices_and_ld_cache_as_root() {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let is_root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        if !is_root || !have_cc() {
            crate::testbed::skip("needs root (mknod, ldconfig -r) and cc");
            return;
        }
        let tmp = TempRoot::new("root");
        let dir = &tmp.0;
        let options = BuildOptions {
            elf_libraries: true,
            device_nodes: DeviceNodes::CharDevices,
            ldconfig: true,
            ..BuildOptions::default()
        };
        build_with(dir, "550.54.15", 1, &options).expect("driver root");
        let ctl = fs::metadata(dir.join("dev/nvidiactl")).unwrap();
        assert!(ctl.file_type().is_char_device());
        assert_eq!(ctl.rdev(), (195 << 8) | 255);
        assert!(
            fs::metadata(dir.join("dev/nvidia-caps/nvidia-cap3"))
                .unwrap()
                .file_type()
                .is_char_device()
        );
        assert_eq!(
            fs::read_link(dir.join("usr/lib/x86_64-linux-gnu/libcuda.so.1")).unwrap(),
            Path::new("libcuda.so.550.54.15")
        );
        let cache = fs::read(dir.join("etc/ld.so.cache")).unwrap();
        assert!(
            cache
                .windows(b"libnvidia-ml.so.1\0".len())
                .any(|w| w == b"libnvidia-ml.so.1\0")
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
