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
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::inventory::Inventory;
use crate::plugin::CdiKind;

pub mod ldcache;

use ldcache::{CacheFlags, LdCache};

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

/// Driver binaries mounted when present.
const BINARIES: [&str; 5] = [
    "usr/bin/nvidia-smi",
    "usr/bin/nvidia-debugdump",
    "usr/bin/nvidia-persistenced",
    "usr/bin/nvidia-cuda-mps-control",
    "usr/bin/nvidia-cuda-mps-server",
];

/// IPC sockets of the driver's daemons, mounted when present.
const IPC_SOCKETS: [&str; 2] = [
    "run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
];

/// Library name stems that belong to the driver (`<stem>.so.<driver version>`).
const LIBRARY_STEMS: [&str; 6] = [
    "libcuda",
    "libcudadebugger",
    "libnvcuvid",
    "libnvoptix",
    "libnvidia-",
    "libnvidia-ml",
];

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
    /// Driver files to mount, sorted by container path.
    pub mounts: Vec<MountEdit>,
    /// Paths left out because they resolve outside the driver root.
    pub rejected: Vec<String>,
    /// Where the libraries among `mounts` were found.
    pub library_source: LibrarySource,
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

/// A driver library file of this driver version: `<stem>.so.<version>`.
fn is_driver_library(name: &str, version: &str) -> bool {
    name.strip_suffix(&format!(".so.{version}"))
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
    let mut add = |files: &mut HostFiles, rel: String| match resolve(&root, &rel, &root) {
        Resolved::Inside(real) if real.is_file() || is_socket(&real) => {
            mounts.insert(format!("/{rel}"), real.to_string_lossy().into_owned());
        }
        Resolved::Outside(real) => reject(files, &rel, &real.to_string_lossy()),
        _ => {}
    };
    for rel in find_libraries(&root, driver_version, arch, &mut files) {
        add(&mut files, rel);
    }
    for bin in BINARIES {
        add(&mut files, bin.to_owned());
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
            add(&mut files, format!("{firmware}/{name}"));
        }
    }
    for socket in IPC_SOCKETS {
        add(&mut files, socket.to_owned());
    }
    files.mounts = mounts
        .into_iter()
        .map(|(container_path, host_path)| MountEdit {
            host_path,
            container_path,
        })
        .collect();
    Ok(files)
}

/// The driver libraries to mount, as paths relative to the canonical `root`: from the
/// ld.so.cache when it can be used, else from the directory scan. Sets `files.library_source`.
fn find_libraries(
    root: &Path,
    version: &str,
    arch: Option<CacheFlags>,
    files: &mut HostFiles,
) -> Vec<String> {
    let reason = match arch {
        None => ScanReason::UnknownArchitecture,
        Some(flags) => match libraries_from_ldcache(root, version, flags, files) {
            Ok(libraries) => {
                tracing::debug!(
                    libraries = libraries.len(),
                    "driver libraries found through ld.so.cache"
                );
                files.library_source = LibrarySource::LdCache;
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
    scan_library_dirs(root, version, arch)
}

/// The library files of this driver version that the root's ld.so.cache leads to, for
/// libraries of `flags`. Each entry's path is taken relative to the root; one that climbs out
/// with `..` or resolves outside the root is rejected, one that leads to a file not named
/// `<stem>.so.<version>` (another driver's) is skipped.
fn libraries_from_ldcache(
    root: &Path,
    version: &str,
    flags: CacheFlags,
    files: &mut HostFiles,
) -> Result<Vec<String>, ScanReason> {
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
    let mut libraries = BTreeSet::new();
    for entry in cache.for_flags(flags) {
        if !entry.name_str().is_some_and(is_driver_library_name) {
            continue;
        }
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
                    libraries.insert(rel.to_owned());
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
        Ok(libraries.into_iter().collect())
    }
}

/// The library files of this driver version in the known library directories, as paths
/// relative to `root`. With a known `arch`, the multiarch directory of the other architecture
/// is left out: a container could not load those libraries.
fn scan_library_dirs(root: &Path, version: &str, arch: Option<CacheFlags>) -> Vec<String> {
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
        let Ok(entries) = fs::read_dir(root.join(dir)) else {
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

/// The generated spec and what it names.
#[derive(Debug, Clone)]
pub struct GeneratedSpec {
    /// The spec, as the CDI crate's type.
    pub spec: CdiSpec,
    /// Unqualified device names, in spec order.
    pub device_names: Vec<String>,
    /// Devices left out, and why (missing device node or capability minor).
    pub skipped: Vec<String>,
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
    let mounts: Vec<serde_json::Value> = host
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
        // Keeps a legacy nvidia-container-runtime hook from injecting devices a second time.
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
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
    let spec: CdiSpec =
        serde_json::from_value(raw.clone()).map_err(|e| CdiError::Encode(e.to_string()))?;
    // The lowest version whose rules the content needs, as the CDI crate computes it.
    let version = container_device_interface::version::minimum_required_version(&spec)
        .map_err(|e| CdiError::Validation(e.to_string()))?;
    raw["cdiVersion"] = json!(version.to_string());
    let spec: CdiSpec = serde_json::from_value(raw).map_err(|e| CdiError::Encode(e.to_string()))?;
    Ok(GeneratedSpec {
        spec,
        device_names: names,
        skipped,
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
    if fs::read(&path).is_ok_and(|old| old == content.as_bytes()) {
        return Ok(Written {
            path,
            digest,
            changed: false,
        });
    }
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

/// Discovers host files, builds, validates and writes the spec.
pub fn generate_and_write(
    inventory: &Inventory,
    driver_root: &Path,
    spec_dir: &Path,
    options: &CdiOptions,
) -> Result<SpecOutcome, CdiError> {
    let minors = read_mig_minors(driver_root)?;
    let wanted = wanted_device_nodes(inventory, &minors);
    let host = discover_host_files(driver_root, &inventory.driver.driver_version, &wanted)?;
    let generated = cdi_spec(inventory, &minors, &host, options)?;
    let path = spec_dir.join(SPEC_FILE_NAME);
    validate_spec(&generated.spec, &path)?;
    let content = render(&generated.spec)?;
    let written = write_spec(spec_dir, &content)?;
    if written.changed {
        tracing::info!(source = %host.library_source, "driver libraries for the CDI spec found");
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
