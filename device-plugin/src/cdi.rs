//! The node's CDI spec: which device nodes and driver files a container gets for each GPU and
//! MIG device, written to one file (`gpupool-nvidia.yaml`) in the spec directory.
//!
//! Split as everywhere in the agent: [`discover_host_files`] and [`read_mig_minors`] read the
//! host, [`cdi_spec`] is pure (inventory + host files in, spec out), [`write_spec`] writes.
//! Spec types, version rules and validation come from the `container-device-interface` crate.
//!
//! The driver's libraries are found through the driver root's `etc/ld.so.cache` (see
//! [`ldcache`]): the entries for this host's architecture whose names are driver libraries, each
//! resolved inside the root and kept when the file it leads to is `<stem>.so.<driver version>`.
//! When the cache is missing, unreadable, or names no library of this driver version, the known
//! library directories are scanned instead; [`HostFiles::library_source`] says which was used.
//! The `vdpau/` subdirectories, which ldconfig does not index, are scanned either way.
//!
//! Stock images find the libraries without hooks and without touching their environment: each
//! library is mounted at its host path and, under its soname (the cache entry's name, else the
//! file's `DT_SONAME` read by [`elf`], else [`KNOWN_SONAMES`]), in [`NVIDIA_LIB_DIR`] (on the
//! `LD_LIBRARY_PATH` of NVIDIA's CUDA images) and in glibc's default directories
//! `/usr/lib/<multiarch>` and `/usr/lib64` ([`library_aliases`], [`container_mounts`]).
//!
//! Security rules (from the container toolkit's CVE-2024-0132, CVE-2025-23266 and
//! CVE-2025-23267): nothing is read from a container image; every host path is canonical and
//! inside the driver root (device nodes: inside its `dev/`); a symlink whose target leaves the
//! driver root is not followed and its file is left out; the spec has no hooks; the CDI kind and
//! the driver version are validated before they are used in names or paths.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use container_device_interface::specs::config::Spec as CdiSpec;
use gpupool_crds::policy::CdiDeviceNameStrategy;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::inventory::Inventory;
use crate::plugin::CdiKind;

pub mod elf;
pub mod ldcache;
pub mod root;

use ldcache::{CacheFlags, LdCache};
pub use root::{DriverRoot, find_nvml_library};

/// File name of the spec gpupool writes.
pub const SPEC_FILE_NAME: &str = "gpupool-nvidia.yaml";

/// Mount options of every driver file (read-only, no setuid, no device files, private).
pub const MOUNT_OPTIONS: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// Control device nodes every container with a GPU needs (those present are used).
pub const CONTROL_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// Directories (relative to the driver root) scanned for the driver's user-space libraries when
/// the ld.so.cache cannot be used.
const LIBRARY_DIRS: [&str; 7] = [
    "usr/lib/x86_64-linux-gnu",
    "lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
];

/// Driver binaries mounted when present (executables only). Not `nvidia-cuda-mps-control`,
/// which nvidia-ctk mounts: with it a tenant running as root could quit or reconfigure the
/// MPS daemon its co-tenants use (docs/security.md); MPS clients need only the pipe the
/// allocation mounts.
const BINARIES: [&str; 6] = [
    "usr/bin/nvidia-smi",
    "usr/bin/nvidia-debugdump",
    "usr/bin/nvidia-persistenced",
    "usr/bin/nvidia-cuda-mps-server",
    "usr/bin/nvidia-imex",
    "usr/bin/nvidia-imex-ctl",
];

/// IPC sockets of the driver's daemons, mounted when present.
const IPC_SOCKETS: [&str; 2] = [
    "run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
];

// No directory is mounted whole. The host's `/tmp/nvidia-mps` (the pipe directory of an MPS
// daemon started by hand) is not: anyone who can write the host's `/tmp` could put a link or a
// fake control socket there. The MPS pipes clients get come with the allocation, from the
// per-GPU directories the agent created and owns (`agent::mps`).

/// Configuration files of the graphics and compute loaders (glvnd EGL, EGL external platforms,
/// Vulkan, OpenCL, OptiX): where each is looked for under the driver root, first found wins, and
/// where the container sees it. Vulkan's go to `/etc/vulkan`, a directory every Vulkan loader
/// reads, as nvidia-ctk places them; the others keep their host path.
const CONFIG_FILES: [(&[&str], Option<&str>); 9] = [
    (
        &[
            "etc/glvnd/egl_vendor.d/10_nvidia.json",
            "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        ],
        None,
    ),
    (
        &[
            "etc/egl/egl_external_platform.d/15_nvidia_gbm.json",
            "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        ],
        None,
    ),
    (
        &[
            "etc/egl/egl_external_platform.d/10_nvidia_wayland.json",
            "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
        ],
        None,
    ),
    (
        &["etc/nvidia/nvoptix.bin", "usr/share/nvidia/nvoptix.bin"],
        None,
    ),
    (
        &[
            "etc/vulkan/icd.d/nvidia_icd.json",
            "usr/share/vulkan/icd.d/nvidia_icd.json",
        ],
        Some("/etc/vulkan/icd.d/nvidia_icd.json"),
    ),
    (
        &[
            "etc/vulkan/icd.d/nvidia_layers.json",
            "usr/share/vulkan/icd.d/nvidia_layers.json",
        ],
        Some("/etc/vulkan/icd.d/nvidia_layers.json"),
    ),
    (
        &[
            "etc/vulkan/implicit_layer.d/nvidia_layers.json",
            "usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
        ],
        Some("/etc/vulkan/implicit_layer.d/nvidia_layers.json"),
    ),
    (&["etc/OpenCL/vendors/nvidia.icd"], None),
    (
        // Xorg reads both directories; the container gets it where nvidia-ctk puts it.
        &[
            "etc/X11/xorg.conf.d/10-nvidia.conf",
            "usr/share/X11/xorg.conf.d/10-nvidia.conf",
        ],
        Some("/usr/share/X11/xorg.conf.d/10-nvidia.conf"),
    ),
];

/// Library name stems that belong to the driver (`<stem>.so.<driver version>`); a stem ending
/// in `-` is a prefix.
const LIBRARY_STEMS: [&str; 10] = [
    "libcuda",
    "libcudadebugger",
    "libnvcuvid",
    "libnvoptix",
    "libnvidia-",
    "libGLX_nvidia",
    "libEGL_nvidia",
    "libGLESv2_nvidia",
    "libGLESv1_CM_nvidia",
    "libvdpau_nvidia",
];

/// Driver libraries not named by the driver version: `<prefix><number>` (the NVVM of CUDA
/// 11, which nvidia-ctk also mounts).
const LEGACY_LIBRARIES: [&str; 1] = ["libnvidia-nvvm70.so."];

/// Sonames of the driver's libraries, used when neither the ld.so.cache nor the file's
/// `DT_SONAME` gives one.
pub const KNOWN_SONAMES: [(&str, &str); 20] = [
    ("libcuda", "libcuda.so.1"),
    ("libcudadebugger", "libcudadebugger.so.1"),
    ("libnvidia-ml", "libnvidia-ml.so.1"),
    ("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-nvvm", "libnvidia-nvvm.so.4"),
    ("libnvidia-opencl", "libnvidia-opencl.so.1"),
    ("libnvidia-cfg", "libnvidia-cfg.so.1"),
    ("libnvidia-allocator", "libnvidia-allocator.so.1"),
    ("libnvidia-fbc", "libnvidia-fbc.so.1"),
    ("libnvcuvid", "libnvcuvid.so.1"),
    ("libnvidia-encode", "libnvidia-encode.so.1"),
    ("libnvidia-opticalflow", "libnvidia-opticalflow.so.1"),
    ("libnvoptix", "libnvoptix.so.1"),
    ("libGLX_nvidia", "libGLX_nvidia.so.0"),
    ("libEGL_nvidia", "libEGL_nvidia.so.0"),
    ("libGLESv2_nvidia", "libGLESv2_nvidia.so.2"),
    ("libGLESv1_CM_nvidia", "libGLESv1_CM_nvidia.so.1"),
    ("libvdpau_nvidia", "libvdpau_nvidia.so.1"),
    ("libnvidia-nvvm70", "libnvidia-nvvm70.so.4"),
    ("libnvidia-vksc-core", "libnvidia-vksc-core.so.1"),
];

/// Driver libraries whose soname is their own versioned file name (`<stem>.so.<version>`):
/// other driver libraries ask for them by that name.
pub const SELF_NAMED_STEMS: [&str; 11] = [
    "libnvidia-glcore",
    "libnvidia-tls",
    "libnvidia-glsi",
    "libnvidia-eglcore",
    "libnvidia-glvkspirv",
    "libnvidia-rtcore",
    "libnvidia-gpucomp",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-cbl",
    "libnvidia-compiler",
];

/// The directory NVIDIA's CUDA images (and images built on them, such as pytorch's) list in
/// `LD_LIBRARY_PATH` and in `/etc/ld.so.conf.d/nvidia.conf`; every driver library is also
/// mounted here under its file name and soname.
pub const NVIDIA_LIB_DIR: &str = "/usr/local/nvidia/lib64";

/// Libraries that also get their unversioned development name (`<stem>.so`) wherever their
/// soname goes: programs that link against them at run time (Triton's `-lcuda`) or dlopen the
/// bare name need it.
const DEV_NAMES: [&str; 2] = ["libcuda", "libnvidia-opticalflow"];

/// Environment the spec sets. `LD_LIBRARY_PATH` is deliberately not among it: CDI replaces a
/// variable the image already sets, which would drop the image's own entries.
/// `TRITON_LIBCUDA_PATH` is read only by Triton (torch.compile), which otherwise looks for
/// libcuda through `ldconfig -p` (the image's cache, which has no driver) and `LD_LIBRARY_PATH`.
pub const TRITON_LIBCUDA_ENV: &str = "TRITON_LIBCUDA_PATH";

/// What can go wrong making or writing the spec.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The driver root cannot be resolved.
    #[error("driver root {path}: {source}")]
    DriverRoot {
        /// The configured path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A configured value that is not allowed.
    #[error("invalid {what} {value:?}: {reason}")]
    Invalid {
        /// What it is.
        what: &'static str,
        /// The value.
        value: String,
        /// Why.
        reason: String,
    },
    /// The generated spec does not validate (a bug, reported with the validator's words).
    #[error("generated CDI spec does not validate: {0}")]
    Validation(String),
    /// Encoding the spec.
    #[error("encoding the CDI spec: {0}")]
    Encode(String),
    /// File I/O.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CdiError {
    let path = path.to_path_buf();
    move |source| CdiError::Io { op, path, source }
}

/// How the spec is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiOptions {
    /// CDI kind, `vendor/class`.
    pub kind: CdiKind,
    /// Which names each device gets.
    pub naming: Vec<CdiDeviceNameStrategy>,
}

impl CdiOptions {
    /// Options from the GpuNode's CDI policy, validating the kind.
    pub fn from_policy(policy: &gpupool_crds::policy::CdiPolicy) -> Result<CdiOptions, CdiError> {
        let kind = policy
            .kind
            .parse::<CdiKind>()
            .map_err(|e| CdiError::Invalid {
                what: "CDI kind",
                value: policy.kind.clone(),
                reason: e.to_string(),
            })?;
        let naming = if policy.device_name_strategies.is_empty() {
            CdiDeviceNameStrategy::all()
        } else {
            policy.device_name_strategies.clone()
        };
        Ok(CdiOptions { kind, naming })
    }
}

/// `gpuN/giG/access` and `gpuN/giG/ciC/access` → capability device minor, from the driver's
/// `mig-minors` file.
pub type MigMinors = BTreeMap<String, u32>;

/// Path of the `mig-minors` file under a driver root.
pub fn mig_minors_path(driver_root: &Path) -> PathBuf {
    driver_root.join("proc/driver/nvidia-caps/mig-minors")
}

/// Parses the `mig-minors` file (`<capability> <minor>` per line); bad lines are skipped.
pub fn parse_mig_minors(text: &str) -> MigMinors {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let key = words.next()?;
            let minor = words.next()?.parse().ok()?;
            Some((key.to_owned(), minor))
        })
        .collect()
}

/// Reads the `mig-minors` file under the driver root; a missing file is an empty map (no MIG).
pub fn read_mig_minors(driver_root: &Path) -> Result<MigMinors, CdiError> {
    let path = mig_minors_path(driver_root);
    match fs::read_to_string(&path) {
        Ok(text) => Ok(parse_mig_minors(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(MigMinors::new()),
        Err(e) => Err(io("reading", &path)(e)),
    }
}

fn gi_key(gpu_minor: u32, gi: u32) -> String {
    format!("gpu{gpu_minor}/gi{gi}/access")
}

fn ci_key(gpu_minor: u32, gi: u32, ci: u32) -> String {
    format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access")
}

fn cap_node(minor: u32) -> String {
    format!("/dev/nvidia-caps/nvidia-cap{minor}")
}

/// Container paths of every device node the inventory needs: control nodes, `/dev/nvidiaN`
/// per GPU and the two capability nodes per MIG device.
pub fn wanted_device_nodes(inventory: &Inventory, minors: &MigMinors) -> Vec<String> {
    let mut nodes: BTreeSet<String> = CONTROL_NODES.iter().map(|s| (*s).to_owned()).collect();
    for gpu in &inventory.gpus {
        let minor = gpu.device.minor_number;
        nodes.insert(format!("/dev/nvidia{minor}"));
        for mig in &gpu.mig_devices {
            let (gi, ci) = (mig.gpu_instance.0, mig.compute_instance.0);
            for key in [gi_key(minor, gi), ci_key(minor, gi, ci)] {
                if let Some(m) = minors.get(&key) {
                    nodes.insert(cap_node(*m));
                }
            }
        }
    }
    nodes.into_iter().collect()
}

/// A driver file to bind-mount.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MountEdit {
    /// Canonical path on the host, inside the driver root.
    pub host_path: String,
    /// Where the container sees it.
    pub container_path: String,
}

/// What was found on the host under the driver root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFiles {
    /// Container path (`/dev/…`) → canonical host path, for device nodes that exist.
    pub nodes: BTreeMap<String, String>,
    /// Driver files other than libraries to mount (binaries, firmware, configuration files,
    /// IPC sockets and directories), sorted by container path.
    pub mounts: Vec<MountEdit>,
    /// The driver's libraries, sorted by host path; [`container_mounts`] gives each its
    /// container paths.
    pub libraries: Vec<DriverLibrary>,
    /// Paths left out because they resolve outside the driver root.
    pub rejected: Vec<String>,
    /// Where the libraries were found.
    pub library_source: LibrarySource,
}

/// One driver library file and the names the container's loader will ask for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverLibrary {
    /// Canonical path on the host, inside the driver root.
    pub host_path: String,
    /// The same path as seen from the driver root (`/usr/lib/x86_64-linux-gnu/libcuda.so.V`).
    pub root_path: String,
    /// Its soname, when one is known (see [`SonameSource`]).
    pub soname: Option<String>,
    /// Where the soname came from.
    pub soname_source: SonameSource,
    /// Its architecture, which picks the multiarch directory; `None` when unknown.
    pub arch: Option<LibArch>,
}

/// Where a library's soname came from, in the order they are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SonameSource {
    /// The name of the ld.so.cache entry that leads to the file.
    LdCache,
    /// The file's `DT_SONAME`.
    Elf,
    /// [`KNOWN_SONAMES`] or [`SELF_NAMED_STEMS`].
    KnownTable,
    /// None of them: the library is mounted under its file name only.
    Unknown,
}

/// Architecture of a driver library, for the Debian multiarch directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LibArch {
    /// x86-64.
    X86_64,
    /// AArch64.
    Aarch64,
}

impl LibArch {
    /// The multiarch triple (`/usr/lib/<triple>`).
    pub fn triple(self) -> &'static str {
        match self {
            LibArch::X86_64 => "x86_64-linux-gnu",
            LibArch::Aarch64 => "aarch64-linux-gnu",
        }
    }

    fn from_machine(machine: u16) -> Option<LibArch> {
        match machine {
            elf::EM_X86_64 => Some(LibArch::X86_64),
            elf::EM_AARCH64 => Some(LibArch::Aarch64),
            _ => None,
        }
    }

    fn from_flags(flags: CacheFlags) -> Option<LibArch> {
        match flags {
            CacheFlags::X86_64_LIBC6 => Some(LibArch::X86_64),
            CacheFlags::AARCH64_LIBC6 => Some(LibArch::Aarch64),
            _ => None,
        }
    }

    fn from_path(path: &str) -> Option<LibArch> {
        [LibArch::X86_64, LibArch::Aarch64]
            .into_iter()
            .find(|a| path.split('/').any(|c| c == a.triple()))
    }
}

/// Where the driver's user-space libraries were found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LibrarySource {
    /// Not looked up (host files made by hand).
    #[default]
    NotLookedUp,
    /// The driver root's `etc/ld.so.cache`.
    LdCache,
    /// The scan of the known library directories, and why the cache was not used.
    DirectoryScan(ScanReason),
}

/// Why the library directories were scanned instead of using the ld.so.cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanReason {
    /// The driver root has no `etc/ld.so.cache`.
    CacheMissing,
    /// The cache is a symlink that leads outside the driver root.
    CacheOutsideRoot,
    /// The cache could not be read or parsed.
    CacheUnreadable(String),
    /// No ld.so.cache flags are known for this agent's architecture.
    UnknownArchitecture,
    /// The cache names no library file of this driver version (ldconfig not run since the
    /// driver was installed, or the driver is not in the linker's path).
    NoDriverLibraries,
}

impl std::fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LibrarySource::NotLookedUp => f.write_str("not looked up"),
            LibrarySource::LdCache => f.write_str("ld.so.cache"),
            LibrarySource::DirectoryScan(reason) => write!(f, "directory scan ({reason})"),
        }
    }
}

impl std::fmt::Display for ScanReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScanReason::CacheMissing => f.write_str("no ld.so.cache under the driver root"),
            ScanReason::CacheOutsideRoot => {
                f.write_str("ld.so.cache resolves outside the driver root")
            }
            ScanReason::CacheUnreadable(why) => write!(f, "ld.so.cache unusable: {why}"),
            ScanReason::UnknownArchitecture => {
                f.write_str("no ld.so.cache flags known for this architecture")
            }
            ScanReason::NoDriverLibraries => {
                f.write_str("ld.so.cache names no library of this driver version")
            }
        }
    }
}

/// Checks a driver version before it is used in file names: dot-separated numbers.
pub fn check_driver_version(version: &str) -> Result<(), CdiError> {
    let ok = !version.is_empty()
        && version
            .split('.')
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(CdiError::Invalid {
            what: "driver version",
            value: version.to_owned(),
            reason: "expected dot-separated numbers such as 550.54.15".to_owned(),
        })
    }
}

/// Where `rel` (relative to the canonical root `root`) really is, if it exists and stays inside
/// `within` (itself inside root). Symlinks are resolved; one that leaves `within` is rejected.
enum Resolved {
    Inside(PathBuf),
    Missing,
    Outside(PathBuf),
}

fn resolve(root: &Path, rel: &str, within: &Path) -> Resolved {
    let path = root.join(rel.trim_start_matches('/'));
    if fs::symlink_metadata(&path).is_err() {
        return Resolved::Missing;
    }
    match fs::canonicalize(&path) {
        Ok(real) if real.starts_with(within) => Resolved::Inside(real),
        Ok(real) => Resolved::Outside(real),
        // A dangling symlink.
        Err(_) => Resolved::Missing,
    }
}

fn is_driver_stem(stem: &str) -> bool {
    LIBRARY_STEMS.iter().any(|s| {
        if s.ends_with('-') {
            stem.starts_with(s)
        } else {
            stem == *s
        }
    })
}

/// A driver library file of this driver version (`<stem>.so.<version>`) or a legacy one
/// ([`LEGACY_LIBRARIES`]).
fn is_driver_library(name: &str, version: &str) -> bool {
    let legacy = LEGACY_LIBRARIES.iter().any(|prefix| {
        name.strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    legacy
        || name
            .strip_suffix(&format!(".so.{version}"))
            .is_some_and(is_driver_stem)
}

/// A name a driver library may be asked for, of any version: `<stem>.so` or `<stem>.so.<…>`.
fn is_driver_library_name(name: &str) -> bool {
    name.split_once(".so").is_some_and(|(stem, rest)| {
        (rest.is_empty() || rest.starts_with('.')) && is_driver_stem(stem)
    })
}

fn reject(files: &mut HostFiles, path: &str, why: &str) {
    tracing::warn!(
        path,
        why,
        "left out of the CDI spec: resolves outside the driver root"
    );
    if !files.rejected.iter().any(|r| r == path) {
        files.rejected.push(path.to_owned());
    }
}

/// Finds the driver's files under `driver_root`: the device nodes in `wanted_nodes` (container
/// paths under `/dev`), user-space libraries `*.so.<driver_version>` (from the root's
/// ld.so.cache, else from a scan of the library directories), binaries, GSP firmware and IPC
/// sockets. Only canonical paths inside the root are returned.
pub fn discover_host_files(
    driver_root: &Path,
    driver_version: &str,
    wanted_nodes: &[String],
) -> Result<HostFiles, CdiError> {
    discover_host_files_for_arch(
        driver_root,
        driver_version,
        wanted_nodes,
        CacheFlags::host(),
    )
}

/// [`discover_host_files`] taking from the ld.so.cache only the libraries whose flags are
/// `arch` (`None`: the cache is not used).
pub fn discover_host_files_for_arch(
    driver_root: &Path,
    driver_version: &str,
    wanted_nodes: &[String],
    arch: Option<CacheFlags>,
) -> Result<HostFiles, CdiError> {
    check_driver_version(driver_version)?;
    let root = fs::canonicalize(driver_root).map_err(|source| CdiError::DriverRoot {
        path: driver_root.to_path_buf(),
        source,
    })?;
    let dev = root.join("dev");
    let mut files = HostFiles::default();

    for node in wanted_nodes {
        if !node.starts_with("/dev/") || node.contains("..") {
            continue;
        }
        match resolve(&root, node, &dev) {
            Resolved::Inside(real) => {
                files
                    .nodes
                    .insert(node.clone(), real.to_string_lossy().into_owned());
            }
            Resolved::Outside(real) => reject(&mut files, node, &real.to_string_lossy()),
            Resolved::Missing => {}
        }
    }

    let mut mounts: BTreeMap<String, String> = BTreeMap::new();
    let mut add = |files: &mut HostFiles, rel: &str, container: Option<&str>| match resolve(
        &root, rel, &root,
    ) {
        Resolved::Inside(real) if real.is_file() || is_socket(&real) => {
            let container = container.map_or_else(|| format!("/{rel}"), str::to_owned);
            mounts.insert(container, real.to_string_lossy().into_owned());
            true
        }
        Resolved::Outside(real) => {
            reject(files, rel, &real.to_string_lossy());
            false
        }
        _ => false,
    };
    for bin in BINARIES {
        if resolve(&root, bin, &root).is_executable() {
            add(&mut files, bin, None);
        } else {
            add_if_outside(&root, &mut files, bin);
        }
    }
    let firmware = format!("lib/firmware/nvidia/{driver_version}");
    if let Ok(entries) = fs::read_dir(root.join(&firmware)) {
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("gsp") && n.ends_with(".bin"))
            .collect();
        names.sort();
        for name in names {
            add(&mut files, &format!("{firmware}/{name}"), None);
        }
    }
    for (candidates, container) in CONFIG_FILES {
        for rel in candidates {
            if add(&mut files, rel, container) {
                break;
            }
        }
    }
    for socket in IPC_SOCKETS {
        add(&mut files, socket, None);
    }
    files.mounts = mounts
        .into_iter()
        .map(|(container_path, host_path)| MountEdit {
            host_path,
            container_path,
        })
        .collect();
    let found = find_libraries(&root, driver_version, arch, &mut files);
    for (rel, cache_name) in found {
        match resolve(&root, &rel, &root) {
            Resolved::Inside(real) if real.is_file() => {
                let library = describe_library(&rel, &real, cache_name, arch);
                files.libraries.push(library);
            }
            Resolved::Outside(real) => reject(&mut files, &rel, &real.to_string_lossy()),
            _ => {}
        }
    }
    files.libraries.sort();
    Ok(files)
}

impl Resolved {
    fn is_executable(&self) -> bool {
        use std::os::unix::fs::PermissionsExt;
        matches!(self, Resolved::Inside(real)
            if fs::metadata(real).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
    }
}

/// Records `rel` as rejected when it resolves outside the root (a binary that is not mounted
/// because it is not executable is otherwise simply absent).
fn add_if_outside(root: &Path, files: &mut HostFiles, rel: &str) {
    if let Resolved::Outside(real) = resolve(root, rel, root) {
        reject(files, rel, &real.to_string_lossy());
    }
}

/// A library found under the root (`rel`, with the ld.so.cache entry name that led to it, if
/// any), with its soname and architecture.
fn describe_library(
    rel: &str,
    real: &Path,
    cache_name: Option<String>,
    arch: Option<CacheFlags>,
) -> DriverLibrary {
    let file_name = rel.rsplit('/').next().unwrap_or(rel);
    let elf = match elf::read(real) {
        Ok(info) => Some(info),
        Err(e) => {
            tracing::debug!(error = %e, "driver library not readable as ELF");
            None
        }
    };
    let usable = |name: &String| {
        let ok = is_soname_of(name, file_name);
        if !ok {
            tracing::warn!(library = rel, soname = %name, "soname does not name this library; ignored");
        }
        ok
    };
    // A cache entry named like the file itself says only that no other name leads to it (an
    // object without DT_SONAME is listed that way); the file and the table may know more.
    let cache_name = cache_name.filter(|n| n != file_name);
    let (soname, soname_source) = if let Some(name) = cache_name.filter(usable) {
        (Some(name), SonameSource::LdCache)
    } else if let Some(name) = elf.as_ref().and_then(|e| e.soname.clone()).filter(usable) {
        (Some(name), SonameSource::Elf)
    } else if let Some(name) = known_soname(file_name) {
        (Some(name), SonameSource::KnownTable)
    } else {
        tracing::info!(
            library = rel,
            "no soname known: mounted under its file name only"
        );
        (None, SonameSource::Unknown)
    };
    let arch = elf
        .and_then(|e| LibArch::from_machine(e.machine))
        .or_else(|| LibArch::from_path(rel))
        .or_else(|| arch.and_then(LibArch::from_flags));
    DriverLibrary {
        host_path: real.to_string_lossy().into_owned(),
        root_path: format!("/{rel}"),
        soname,
        soname_source,
        arch,
    }
}

/// The library's stem: `libcuda` for `libcuda.so.550.54.15`.
fn library_stem(file_name: &str) -> Option<&str> {
    file_name.split_once(".so").map(|(stem, _)| stem)
}

/// Whether `soname` may stand for the library file `file_name`: a plain file name of the same
/// stem (`libcuda.so.1` for `libcuda.so.550.54.15`). The name comes from files under the
/// driver root and is joined into container paths, so nothing else is accepted.
fn is_soname_of(soname: &str, file_name: &str) -> bool {
    let plain = !soname.is_empty()
        && soname.len() <= 255
        && !soname.contains(['/', '\0'])
        && soname != "."
        && soname != "..";
    plain
        && library_stem(file_name).is_some_and(|stem| {
            soname
                .strip_prefix(stem)
                .and_then(|rest| rest.strip_prefix(".so"))
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
}

/// The soname [`KNOWN_SONAMES`] or [`SELF_NAMED_STEMS`] give a library file.
fn known_soname(file_name: &str) -> Option<String> {
    let stem = library_stem(file_name)?;
    if let Some((_, soname)) = KNOWN_SONAMES.iter().find(|(s, _)| *s == stem) {
        return Some((*soname).to_owned());
    }
    SELF_NAMED_STEMS
        .contains(&stem)
        .then(|| file_name.to_owned())
}

/// The driver libraries to mount, as paths relative to the canonical `root`, each with the
/// name of the ld.so.cache entry that led to it: from the ld.so.cache when it can be used, else
/// from the directory scan; then the `vdpau/` subdirectories, which ldconfig does not index.
/// Sets `files.library_source`.
fn find_libraries(
    root: &Path,
    version: &str,
    arch: Option<CacheFlags>,
    files: &mut HostFiles,
) -> BTreeMap<String, Option<String>> {
    let reason = match arch {
        None => ScanReason::UnknownArchitecture,
        Some(flags) => match libraries_from_ldcache(root, version, flags, files) {
            Ok(libraries) => {
                tracing::debug!(
                    libraries = libraries.len(),
                    "driver libraries found through ld.so.cache"
                );
                files.library_source = LibrarySource::LdCache;
                let mut libraries = libraries;
                for rel in scan_library_dirs(root, version, arch, "/vdpau") {
                    libraries.entry(rel).or_insert(None);
                }
                return libraries;
            }
            Err(reason) => reason,
        },
    };
    match &reason {
        ScanReason::CacheOutsideRoot | ScanReason::CacheUnreadable(_) => {
            tracing::warn!(reason = %reason, "scanning library directories instead of ld.so.cache");
        }
        _ => tracing::debug!(reason = %reason, "scanning library directories"),
    }
    files.library_source = LibrarySource::DirectoryScan(reason);
    scan_library_dirs(root, version, arch, "")
        .into_iter()
        .chain(scan_library_dirs(root, version, arch, "/vdpau"))
        .map(|rel| (rel, None))
        .collect()
}

/// The library files of this driver version that the root's ld.so.cache leads to, for
/// libraries of `flags`, each with the name of the first cache entry (in ldconfig's order)
/// that leads to it. Each entry's path is taken relative to the root; one that climbs out with
/// `..` or resolves outside the root is rejected, one that leads to a file not named
/// `<stem>.so.<version>` (another driver's) is skipped.
fn libraries_from_ldcache(
    root: &Path,
    version: &str,
    flags: CacheFlags,
    files: &mut HostFiles,
) -> Result<BTreeMap<String, Option<String>>, ScanReason> {
    let real = match resolve(root, ldcache::CACHE_PATH, root) {
        Resolved::Missing => return Err(ScanReason::CacheMissing),
        Resolved::Outside(real) => {
            reject(files, ldcache::CACHE_PATH, &real.to_string_lossy());
            return Err(ScanReason::CacheOutsideRoot);
        }
        Resolved::Inside(real) => real,
    };
    if !real.is_file() {
        return Err(ScanReason::CacheUnreadable(format!(
            "{} is not a regular file",
            real.display()
        )));
    }
    let cache = LdCache::read(&real).map_err(|e| ScanReason::CacheUnreadable(e.to_string()))?;
    let mut libraries = BTreeMap::new();
    for entry in cache.for_flags(flags) {
        let Some(name) = entry.name_str().filter(|n| is_driver_library_name(n)) else {
            continue;
        };
        let shown = entry.path.to_string_lossy();
        let Some(path) = entry
            .path
            .to_str()
            .filter(|_| entry.path.is_absolute())
            .filter(|_| {
                !entry
                    .path
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
            })
        else {
            reject(
                files,
                &shown,
                "ld.so.cache path not absolute, not UTF-8 or with '..'",
            );
            continue;
        };
        match resolve(root, path, root) {
            Resolved::Inside(real) => {
                let wanted = real
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| is_driver_library(n, version));
                // `real` is inside `root` (checked by resolve), so the prefix always strips.
                let rel = real.strip_prefix(root).ok().and_then(|r| r.to_str());
                if let (true, Some(rel)) = (wanted && real.is_file(), rel) {
                    libraries
                        .entry(rel.to_owned())
                        .or_insert_with(|| Some(name.to_owned()));
                }
            }
            Resolved::Outside(real) => reject(files, path, &real.to_string_lossy()),
            // Listed but gone: a cache older than the last driver change.
            Resolved::Missing => {}
        }
    }
    if libraries.is_empty() {
        Err(ScanReason::NoDriverLibraries)
    } else {
        Ok(libraries)
    }
}

/// The library files of this driver version in the known library directories (each with
/// `suffix` appended, e.g. `/vdpau`), as paths relative to `root`. With a known `arch`, the
/// multiarch directory of the other architecture is left out: a container could not load those
/// libraries.
fn scan_library_dirs(
    root: &Path,
    version: &str,
    arch: Option<CacheFlags>,
    suffix: &str,
) -> Vec<String> {
    let foreign = match arch {
        Some(CacheFlags::X86_64_LIBC6) => Some("aarch64-linux-gnu"),
        Some(CacheFlags::AARCH64_LIBC6) => Some("x86_64-linux-gnu"),
        _ => None,
    };
    let mut found = Vec::new();
    for dir in LIBRARY_DIRS {
        if foreign.is_some_and(|triple| dir.ends_with(triple)) {
            continue;
        }
        let dir = format!("{dir}{suffix}");
        // Each file found is resolved inside the root before it is used.
        let Ok(entries) = fs::read_dir(root.join(&dir)) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_driver_library(n, version))
            .collect();
        names.sort();
        found.extend(names.into_iter().map(|name| format!("{dir}/{name}")));
    }
    found
}

fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// The container paths of a driver library besides its host path: its file name in
/// [`NVIDIA_LIB_DIR`], and its soname (plus `<stem>.so` for [`DEV_NAMES`]) there and in the
/// default directories of glibc's loader, `/usr/lib/<multiarch>` and `/usr/lib64`. A library in a
/// `vdpau/` directory (loaded by libvdpau from its module directory, not by the loader's
/// search) gets its soname in the `vdpau/` subdirectory of those two instead.
pub fn library_aliases(library: &DriverLibrary) -> Vec<String> {
    let Some((dir, file_name)) = library.root_path.rsplit_once('/') else {
        return Vec::new();
    };
    let mut paths = Vec::new();
    let vdpau = dir.ends_with("/vdpau");
    if !vdpau {
        paths.push(format!("{NVIDIA_LIB_DIR}/{file_name}"));
    }
    let Some(soname) = &library.soname else {
        return paths;
    };
    let sub = if vdpau { "/vdpau" } else { "" };
    // A driver install leaves `libcuda.so` beside `libcuda.so.1`; programs that dlopen or link
    // the unversioned name find it wherever they find the soname.
    let dev_name = library_stem(file_name)
        .filter(|s| !vdpau && DEV_NAMES.contains(s))
        .map(|stem| format!("{stem}.so"));
    let mut names = vec![soname.clone()];
    names.extend(dev_name);
    for name in &names {
        if !vdpau {
            paths.push(format!("{NVIDIA_LIB_DIR}/{name}"));
        }
        if let Some(arch) = library.arch {
            paths.push(format!("/usr/lib/{}{sub}/{name}", arch.triple()));
        }
        paths.push(format!("/usr/lib64{sub}/{name}"));
    }
    paths
}

/// Every mount of the spec, and the container paths two host files competed for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountPlan {
    /// Mounts, sorted by container path; no container path twice.
    pub mounts: Vec<MountEdit>,
    /// `<container path>: <host path kept> over <host path left out>`, one per conflict.
    pub conflicts: Vec<String>,
}

/// The spec's mounts from the host files: every file at its host path, then each library's
/// [`library_aliases`]. A container path is claimed once: host paths first (a real file is
/// never shadowed by another library's alias), then aliases in library order (sorted by host
/// path), so the same host files always give the same winner. Pure.
pub fn container_mounts(host: &HostFiles) -> MountPlan {
    let mut claimed: BTreeMap<String, String> = BTreeMap::new();
    let mut conflicts = Vec::new();
    let mut claim = |container: &str, host_path: &str| match claimed.get(container) {
        Some(kept) if kept != host_path => {
            conflicts.push(format!("{container}: {kept} over {host_path}"));
        }
        Some(_) => {}
        None => {
            claimed.insert(container.to_owned(), host_path.to_owned());
        }
    };
    for m in &host.mounts {
        claim(&m.container_path, &m.host_path);
    }
    for library in &host.libraries {
        claim(&library.root_path, &library.host_path);
    }
    for library in &host.libraries {
        for alias in library_aliases(library) {
            claim(&alias, &library.host_path);
        }
    }
    MountPlan {
        mounts: claimed
            .into_iter()
            .map(|(container_path, host_path)| MountEdit {
                host_path,
                container_path,
            })
            .collect(),
        conflicts,
    }
}

/// The generated spec and what it names.
#[derive(Debug, Clone)]
pub struct GeneratedSpec {
    /// The spec, as the CDI crate's type.
    pub spec: CdiSpec,
    /// Unqualified device names, in spec order.
    pub device_names: Vec<String>,
    /// Devices left out, and why (missing device node or capability minor).
    pub skipped: Vec<String>,
    /// Container paths two host files competed for (see [`MountPlan::conflicts`]).
    pub mount_conflicts: Vec<String>,
}

fn node_edit(container: &str, host: &str) -> serde_json::Value {
    if container == host {
        json!({ "path": container, "permissions": "rw" })
    } else {
        json!({ "path": container, "hostPath": host, "permissions": "rw" })
    }
}

/// Builds the spec for `inventory`. Pure: host facts come in `host` and `minors`.
pub fn cdi_spec(
    inventory: &Inventory,
    minors: &MigMinors,
    host: &HostFiles,
    options: &CdiOptions,
) -> Result<GeneratedSpec, CdiError> {
    let by_index = options.naming.contains(&CdiDeviceNameStrategy::Index);
    let by_uuid = options.naming.contains(&CdiDeviceNameStrategy::Uuid);
    let mut devices = Vec::new();
    let mut names = Vec::new();
    let mut skipped = Vec::new();
    let mut all_nodes: BTreeSet<String> = BTreeSet::new();
    let mut push = |names: &mut Vec<String>, name: String, nodes: &[String]| {
        let edits: Vec<serde_json::Value> = nodes
            .iter()
            .filter_map(|n| host.nodes.get(n).map(|h| node_edit(n, h)))
            .collect();
        devices.push(json!({ "name": name, "containerEdits": { "deviceNodes": edits } }));
        names.push(name);
    };
    for gpu in &inventory.gpus {
        let minor = gpu.device.minor_number;
        let node = format!("/dev/nvidia{minor}");
        if !host.nodes.contains_key(&node) {
            skipped.push(format!(
                "GPU {}: {node} not found under the driver root",
                gpu.device.index
            ));
            continue;
        }
        let nodes = vec![node.clone()];
        all_nodes.insert(node.clone());
        if by_index {
            push(&mut names, gpu.device.index.to_string(), &nodes);
        }
        if by_uuid {
            push(&mut names, gpu.device.uuid.to_string(), &nodes);
        }
        for (j, mig) in gpu.mig_devices.iter().enumerate() {
            let (gi, ci) = (mig.gpu_instance.0, mig.compute_instance.0);
            let caps: Option<Vec<String>> = [gi_key(minor, gi), ci_key(minor, gi, ci)]
                .iter()
                .map(|k| minors.get(k).map(|m| cap_node(*m)))
                .collect();
            let Some(caps) = caps.filter(|c| c.iter().all(|n| host.nodes.contains_key(n))) else {
                skipped.push(format!(
                    "MIG device {} (GPU {} GI {gi} CI {ci}): capability device nodes not found",
                    mig.uuid, gpu.device.index
                ));
                continue;
            };
            let mut nodes = vec![node.clone()];
            nodes.extend(caps);
            all_nodes.extend(nodes.iter().cloned());
            if by_index {
                push(&mut names, format!("{}:{j}", gpu.device.index), &nodes);
            }
            if by_uuid {
                push(&mut names, mig.uuid.to_string(), &nodes);
            }
        }
    }
    if !all_nodes.is_empty() {
        let nodes: Vec<String> = all_nodes.into_iter().collect();
        push(&mut names, "all".to_owned(), &nodes);
    }

    let control: Vec<serde_json::Value> = CONTROL_NODES
        .iter()
        .filter_map(|n| host.nodes.get(*n).map(|h| node_edit(n, h)))
        .collect();
    let plan = container_mounts(host);
    let libcuda_dev_name = format!("{NVIDIA_LIB_DIR}/libcuda.so");
    let mut env = vec![
        // Keeps a legacy nvidia-container-runtime hook from injecting devices a second time.
        "NVIDIA_VISIBLE_DEVICES=void".to_owned(),
    ];
    if plan
        .mounts
        .iter()
        .any(|m| m.container_path == libcuda_dev_name)
    {
        env.push(format!("{TRITON_LIBCUDA_ENV}={NVIDIA_LIB_DIR}"));
    }
    let mounts: Vec<serde_json::Value> = plan
        .mounts
        .iter()
        .map(|m| {
            json!({
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": MOUNT_OPTIONS,
            })
        })
        .collect();
    let mut edits = json!({
        "env": env,
        "deviceNodes": control,
    });
    if !mounts.is_empty() {
        edits["mounts"] = json!(mounts);
    }
    let mut raw = json!({
        "cdiVersion": container_device_interface::specs::config::CURRENT_VERSION,
        "kind": options.kind.as_str(),
        "devices": devices,
        "containerEdits": edits,
    });
    let spec = CdiSpec::deserialize(&raw).map_err(|e| CdiError::Encode(e.to_string()))?;
    // The lowest version whose rules the content needs, as the CDI crate computes it.
    let version = container_device_interface::version::minimum_required_version(&spec)
        .map_err(|e| CdiError::Validation(e.to_string()))?;
    raw["cdiVersion"] = json!(version.to_string());
    let spec: CdiSpec = serde_json::from_value(raw).map_err(|e| CdiError::Encode(e.to_string()))?;
    Ok(GeneratedSpec {
        spec,
        device_names: names,
        skipped,
        mount_conflicts: plan.conflicts,
    })
}

/// Validates a spec with the CDI crate (schema, names, edits, version), as if loaded from
/// `path`.
pub fn validate_spec(spec: &CdiSpec, path: &Path) -> Result<(), CdiError> {
    container_device_interface::spec::new_spec(spec, &path.to_path_buf(), 0)
        .map(|_| ())
        .map_err(|e| CdiError::Validation(format!("{e:#}")))
}

/// The spec as YAML, with a header saying who wrote it.
pub fn render(spec: &CdiSpec) -> Result<String, CdiError> {
    let body = serde_yaml::to_string(spec).map_err(|e| CdiError::Encode(e.to_string()))?;
    Ok(format!(
        "# Written by the gpupool node agent; regenerated on driver and MIG changes. Do not edit.\n{body}"
    ))
}

/// `sha256:<hex>` of some content.
pub fn digest(content: &[u8]) -> String {
    let sum = Sha256::digest(content);
    let hex: String = sum.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// What [`write_spec`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The spec file.
    pub path: PathBuf,
    /// Digest of its content.
    pub digest: String,
    /// Whether the file was (re)written; false when it already had this content.
    pub changed: bool,
    /// Whether a file was there before this write (with this content or another).
    pub existed: bool,
}

/// Checks a spec directory from configuration: absolute, no `..`.
pub fn check_spec_dir(dir: &Path) -> Result<(), CdiError> {
    let ok = dir.is_absolute()
        && !dir
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir));
    if ok {
        Ok(())
    } else {
        Err(CdiError::Invalid {
            what: "CDI spec directory",
            value: dir.display().to_string(),
            reason: "must be an absolute path without '..'".to_owned(),
        })
    }
}

/// Writes `content` to `<dir>/gpupool-nvidia.yaml` unless it already holds exactly that:
/// a temp file in the same directory, fsync, mode 0644, rename over, fsync the directory.
pub fn write_spec(dir: &Path, content: &str) -> Result<Written, CdiError> {
    use std::os::unix::fs::PermissionsExt;
    check_spec_dir(dir)?;
    let path = dir.join(SPEC_FILE_NAME);
    let digest = digest(content.as_bytes());
    let old = fs::read(&path);
    if old.as_ref().is_ok_and(|old| old == content.as_bytes()) {
        return Ok(Written {
            path,
            digest,
            changed: false,
            existed: true,
        });
    }
    let existed = old.is_ok();
    fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let tmp = dir.join(format!(".{SPEC_FILE_NAME}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = fs::File::create(&tmp).map_err(io("creating", &tmp))?;
        file.write_all(content.as_bytes())
            .map_err(io("writing", &tmp))?;
        file.set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(io("setting the mode of", &tmp))?;
        file.sync_all().map_err(io("syncing", &tmp))?;
        fs::rename(&tmp, &path).map_err(io("renaming onto", &path))?;
        if let Ok(d) = fs::File::open(dir) {
            // Makes the rename durable; a failure here leaves a correct file, so it is not fatal.
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| Written {
        path,
        digest,
        changed: true,
        existed,
    })
}

/// Removes gpupool's spec from `dir` (CDI disabled). Returns whether a file was removed.
pub fn remove_spec(dir: &Path) -> Result<bool, CdiError> {
    let path = dir.join(SPEC_FILE_NAME);
    match fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io("removing", &path)(e)),
    }
}

/// Everything needed to (re)generate and write the spec from an inventory.
#[derive(Debug, Clone)]
pub struct SpecOutcome {
    /// The write.
    pub written: Written,
    /// Device names in the spec.
    pub device_names: Vec<String>,
    /// Devices left out.
    pub skipped: Vec<String>,
    /// Where the driver libraries in the spec were found.
    pub library_source: LibrarySource,
}

/// The last spec this process validated and rendered, so that a pass producing the same spec
/// again (the steady state: nothing on the node changed) neither validates nor serializes it.
/// Validation and YAML rendering are most of a pass's cost; discovery still runs every pass,
/// so a driver change is seen.
#[derive(Debug, Default)]
pub struct SpecMemo {
    /// SHA-256 of the spec's JSON form and its path.
    key: Option<[u8; 32]>,
    /// The rendered YAML of that spec.
    content: String,
}

impl SpecMemo {
    /// The memo key of `spec` written at `path`.
    fn key(spec: &CdiSpec, path: &Path) -> Result<[u8; 32], CdiError> {
        let json = serde_json::to_vec(spec).map_err(|e| CdiError::Encode(e.to_string()))?;
        let mut hasher = Sha256::new();
        hasher.update(path.as_os_str().as_encoded_bytes());
        hasher.update([0]);
        hasher.update(&json);
        Ok(hasher.finalize().into())
    }
}

/// Discovers host files, builds, validates and writes the spec.
pub fn generate_and_write(
    inventory: &Inventory,
    driver_root: &DriverRoot,
    spec_dir: &Path,
    options: &CdiOptions,
) -> Result<SpecOutcome, CdiError> {
    generate_and_write_memo(
        inventory,
        driver_root,
        spec_dir,
        options,
        &mut SpecMemo::default(),
    )
}

/// [`generate_and_write`], skipping validation and rendering when the spec equals the one in
/// `memo`. Validation is also skipped when the spec file already holds exactly the rendered
/// content: it is not rewritten, and it was validated when it was written.
pub fn generate_and_write_memo(
    inventory: &Inventory,
    driver_root: &DriverRoot,
    spec_dir: &Path,
    options: &CdiOptions,
    memo: &mut SpecMemo,
) -> Result<SpecOutcome, CdiError> {
    let local = driver_root.local();
    let minors = read_mig_minors(local)?;
    let wanted = wanted_device_nodes(inventory, &minors);
    let found = discover_host_files(local, &inventory.driver.driver_version, &wanted)?;
    // Found where this process reads the root; the spec names them as the host does.
    let host = driver_root.relocate(found);
    let generated = cdi_spec(inventory, &minors, &host, options)?;
    let path = spec_dir.join(SPEC_FILE_NAME);
    let key = SpecMemo::key(&generated.spec, &path)?;
    if memo.key != Some(key) {
        memo.key = None;
        let content = render(&generated.spec)?;
        let on_disk = fs::read(&path).is_ok_and(|old| old == content.as_bytes());
        if !on_disk {
            validate_spec(&generated.spec, &path)?;
        }
        memo.content = content;
        memo.key = Some(key);
    }
    let written = write_spec(spec_dir, &memo.content)?;
    if written.changed {
        let without_soname = host.libraries.iter().filter(|l| l.soname.is_none()).count();
        tracing::info!(
            source = %host.library_source,
            libraries = host.libraries.len(),
            without_soname,
            "driver libraries for the CDI spec found"
        );
        for conflict in &generated.mount_conflicts {
            tracing::warn!(conflict = %conflict, "two driver files for one container path; the first kept");
        }
    }
    Ok(SpecOutcome {
        written,
        device_names: generated.device_names,
        skipped: generated.skipped,
        library_source: host.library_source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mig_minors() {
        let m = parse_mig_minors(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\nbad\n",
        );
        assert_eq!(m.get("gpu0/gi1/access"), Some(&12));
        assert_eq!(m.get("gpu0/gi1/ci0/access"), Some(&13));
        assert_eq!(m.len(), 4);
    }

    #[test]
    fn driver_library_names() {
        let v = "550.54.15";
        for (name, ok) in [
            ("libcuda.so.550.54.15", true),
            ("libnvidia-ml.so.550.54.15", true),
            ("libnvidia-ptxjitcompiler.so.550.54.15", true),
            ("libnvidia-ml.so.1", false),
            ("libcuda.so.535.104.05", false),
            ("libcudart.so.550.54.15", false),
            ("libfoo.so.550.54.15", false),
        ] {
            assert_eq!(is_driver_library(name, v), ok, "{name}");
        }
    }

    #[test]
    fn driver_library_names_of_any_version() {
        for (name, ok) in [
            ("libcuda.so.1", true),
            ("libcuda.so", true),
            ("libnvidia-ml.so.1", true),
            ("libnvidia-glcore.so.550.54.15", true),
            ("libcudart.so.12", false),
            ("libcuda.sox", false),
            ("libc.so.6", false),
            ("libnvidia", false),
        ] {
            assert_eq!(is_driver_library_name(name), ok, "{name}");
        }
    }

    #[test]
    fn sonames_must_name_the_same_library() {
        let file = "libcuda.so.550.54.15";
        for (soname, ok) in [
            ("libcuda.so.1", true),
            ("libcuda.so", true),
            ("libcuda.so.550.54.15", true),
            ("libc.so.6", false),
            ("libcudadebugger.so.1", false),
            ("libcuda.so1", false),
            ("../libcuda.so.1", false),
            ("libcuda.so.1/x", false),
            ("", false),
        ] {
            assert_eq!(is_soname_of(soname, file), ok, "{soname}");
        }
        assert_eq!(
            known_soname("libnvidia-glcore.so.550.54.15").as_deref(),
            Some("libnvidia-glcore.so.550.54.15")
        );
        assert_eq!(known_soname("libnvidia-new.so.550.54.15"), None);
        assert!(is_driver_library("libnvidia-nvvm70.so.4", "550.54.15"));
        assert!(!is_driver_library("libnvidia-nvvm70.so.", "550.54.15"));
        assert!(is_driver_library("libGLX_nvidia.so.550.54.15", "550.54.15"));
    }

    #[test]
    fn aliases_per_directory() {
        let lib = |root_path: &str, soname: Option<&str>, arch| DriverLibrary {
            host_path: format!("/host{root_path}"),
            root_path: root_path.to_owned(),
            soname: soname.map(str::to_owned),
            soname_source: SonameSource::KnownTable,
            arch,
        };
        assert_eq!(
            library_aliases(&lib(
                "/usr/lib64/libcuda.so.1.2",
                Some("libcuda.so.1"),
                Some(LibArch::Aarch64)
            )),
            [
                "/usr/local/nvidia/lib64/libcuda.so.1.2",
                "/usr/local/nvidia/lib64/libcuda.so.1",
                "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
                "/usr/lib64/libcuda.so.1",
                // The development name, wherever the soname goes.
                "/usr/local/nvidia/lib64/libcuda.so",
                "/usr/lib/aarch64-linux-gnu/libcuda.so",
                "/usr/lib64/libcuda.so",
            ]
        );
        // Architecture unknown: no multiarch directory.
        assert_eq!(
            library_aliases(&lib(
                "/opt/lib/libnvidia-ml.so.1.2",
                Some("libnvidia-ml.so.1"),
                None
            )),
            [
                "/usr/local/nvidia/lib64/libnvidia-ml.so.1.2",
                "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
                "/usr/lib64/libnvidia-ml.so.1",
            ]
        );
        assert_eq!(
            library_aliases(&lib("/usr/lib64/libnvidia-x.so.1.2", None, None)),
            ["/usr/local/nvidia/lib64/libnvidia-x.so.1.2"]
        );
    }

    #[test]
    fn driver_versions_are_checked() {
        assert!(check_driver_version("550.54.15").is_ok());
        for bad in ["", "550..1", "550/../x", "a.b", "550.54.15 "] {
            assert!(check_driver_version(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn spec_dirs_are_checked() {
        assert!(check_spec_dir(Path::new("/var/run/cdi")).is_ok());
        assert!(check_spec_dir(Path::new("var/run/cdi")).is_err());
        assert!(check_spec_dir(Path::new("/var/run/../cdi")).is_err());
    }
}
