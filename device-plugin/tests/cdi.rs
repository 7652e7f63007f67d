//! The CDI spec writer against fake driver roots: golden files per fixture, validation and
//! resolution with the CDI crate, symlink safety, atomic writes, and library discovery through
//! an ld.so.cache written here (new and compatible layouts) with its fallback to the scan.
//!
//! Regenerate the golden files with `GPUPOOL_UPDATE_GOLDEN=1 cargo test -p gpupool-device-plugin --test cdi`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use container_device_interface::cache::{new_cache, with_auto_refresh};
use container_device_interface::spec_dirs::with_spec_dirs;
use gpupool_crds::node::GpuMigSpec;
use gpupool_crds::policy::{CdiDeviceNameStrategy, CdiPolicy};
use gpupool_device_plugin::backend::{GpuBackend, ManualSimClock, SimBackend};
use gpupool_device_plugin::cdi::ldcache::{CacheFlags, LdCache};
use gpupool_device_plugin::cdi::{
    self, CdiOptions, HostFiles, LibrarySource, MountEdit, ScanReason, SonameSource,
};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::mig;
use gpupool_sim::driver_root;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn sim(fixture: &Path) -> SimBackend {
    SimBackend::from_file(fixture, Arc::new(ManualSimClock::new())).expect("fixture loads")
}

/// Applies a MIG layout through the planner, as the agent would.
fn apply_layout(backend: &dyn GpuBackend, wanted: &[GpuMigSpec]) {
    for _ in 0..64 {
        let inv = Inventory::read(backend).unwrap();
        let ops = mig::plan_mig(&mig::current_from_inventory(&inv), wanted).unwrap();
        let Some(op) = ops.first() else { return };
        mig::apply_op(backend, op).unwrap();
    }
    panic!("layout did not converge");
}

fn options() -> CdiOptions {
    CdiOptions::from_policy(&CdiPolicy::default()).unwrap()
}

/// Generates the spec for `inv` under a fresh fake driver root; returns (yaml with the root
/// replaced by `/DRIVER_ROOT`, device names, the spec dir).
fn generate(inv: &Inventory, tmp: &Path) -> (String, Vec<String>, PathBuf) {
    let root = tmp.join("driver");
    driver_root::build(&root, &inv.driver.driver_version, inv.gpus.len() as u32).unwrap();
    let spec_dir = tmp.join("cdi");
    let outcome =
        cdi::generate_and_write(inv, &cdi::DriverRoot::direct(&root), &spec_dir, &options())
            .unwrap();
    assert!(outcome.skipped.is_empty(), "{:?}", outcome.skipped);
    let text = fs::read_to_string(&outcome.written.path).unwrap();
    let canonical_root = fs::canonicalize(&root).unwrap();
    (
        text.replace(&canonical_root.display().to_string(), "/DRIVER_ROOT"),
        outcome.device_names,
        spec_dir,
    )
}

/// The CDI crate's cache finds every device by its qualified name.
fn assert_resolves(spec_dir: &Path, names: &[String]) {
    let dir = spec_dir.display().to_string();
    let cache = new_cache(vec![
        with_spec_dirs(&[dir.as_str()]),
        with_auto_refresh(false),
    ]);
    let mut cache = cache.lock().unwrap();
    cache.refresh().unwrap();
    for name in names {
        let qualified = format!("gpupool.io/gpu={name}");
        assert!(
            cache.get_device(&qualified).is_some(),
            "{qualified} does not resolve; have {:?}",
            cache.list_devices()
        );
    }
}

/// Compares with the golden file; false when there is none yet (a fixture added after the
/// goldens were made: the spec is still validated and resolved, and the count is checked).
fn check_golden(name: &str, text: &str) -> bool {
    let path = golden_dir().join(format!("{name}.yaml"));
    if std::env::var("GPUPOOL_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        fs::create_dir_all(golden_dir()).unwrap();
        fs::write(&path, text).unwrap();
        return true;
    }
    let Ok(want) = fs::read_to_string(&path) else {
        eprintln!(
            "no golden file {}: set GPUPOOL_UPDATE_GOLDEN=1 to create it",
            path.display()
        );
        return false;
    };
    assert_eq!(
        text,
        want,
        "{} differs from the generated spec",
        path.display()
    );
    true
}

#[test]
fn golden_spec_per_fixture_validates_and_resolves() {
    let mut fixtures: Vec<PathBuf> = fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    fixtures.sort();
    assert!(fixtures.len() >= 5);
    let mut compared = 0;
    for fixture in fixtures {
        let stem = fixture.file_stem().unwrap().to_string_lossy().into_owned();
        let backend = sim(&fixture);
        let inv = Inventory::read(&backend).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (text, names, dir) = generate(&inv, tmp.path());
        assert!(names.contains(&"all".to_owned()), "{stem}");
        assert!(
            text.contains("cdiVersion: 0.5.0"),
            "{stem}: digit names need 0.5.0\n{text}"
        );
        assert!(!text.contains("hooks"), "{stem}: no hooks");
        assert_resolves(&dir, &names);
        compared += usize::from(check_golden(&stem, &text));
    }
    assert!(compared >= 9, "only {compared} golden files compared");
}

#[test]
fn mig_devices_get_parent_and_capability_nodes() {
    let backend = sim(&fixtures_dir().join("h100-8x.yaml"));
    let wanted = vec![GpuMigSpec {
        index: 1,
        enabled: true,
        profiles: BTreeMap::from([("3g.40gb".to_owned(), 1), ("1g.10gb".to_owned(), 4)]),
    }];
    apply_layout(&backend, &wanted);
    let inv = Inventory::read(&backend).unwrap();
    assert_eq!(inv.gpus[1].mig_devices.len(), 5);
    let tmp = tempfile::tempdir().unwrap();
    let (text, names, dir) = generate(&inv, tmp.path());
    for j in 0..5 {
        assert!(names.contains(&format!("1:{j}")), "{names:?}");
    }
    for m in &inv.gpus[1].mig_devices {
        assert!(names.contains(&m.uuid.to_string()));
    }
    assert_resolves(&dir, &names);
    let spec: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let dev = spec["devices"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "1:0")
        .unwrap();
    let nodes: Vec<&str> = dev["containerEdits"]["deviceNodes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    assert_eq!(nodes[0], "/dev/nvidia1");
    assert!(
        nodes[1..]
            .iter()
            .all(|n| n.starts_with("/dev/nvidia-caps/nvidia-cap"))
    );
    assert!(check_golden("h100-8x-mig", &text));
}

#[test]
fn fake_driver_root_has_every_control_node_the_spec_names() {
    // The builder lives in gpupool-sim, which cannot see this crate's list; keep them in step.
    let mut built: Vec<String> = driver_root::CONTROL_NODES
        .iter()
        .map(|n| format!("/{n}"))
        .collect();
    let mut named: Vec<String> = cdi::CONTROL_NODES.iter().map(|n| (*n).to_owned()).collect();
    built.sort();
    named.sort();
    assert_eq!(built, named);
}

#[test]
fn symlinks_out_of_the_driver_root_are_not_followed() {
    let backend = sim(&fixtures_dir().join("rtx4090.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    let version = inv.driver.driver_version.clone();
    driver_root::build(&root, &version, 1).unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("secret"), "host file").unwrap();
    // A library name that points at a host file outside the root.
    symlink(
        outside.join("secret"),
        root.join(format!(
            "usr/lib/x86_64-linux-gnu/libnvidia-evil.so.{version}"
        )),
    )
    .unwrap();
    // A whole library directory that leads outside.
    fs::create_dir_all(outside.join("lib64")).unwrap();
    fs::write(outside.join(format!("lib64/libcuda.so.{version}")), "").unwrap();
    symlink(outside.join("lib64"), root.join("usr/lib64")).unwrap();
    // nvidia-smi swapped for a link out.
    fs::remove_file(root.join("usr/bin/nvidia-smi")).unwrap();
    symlink(outside.join("secret"), root.join("usr/bin/nvidia-smi")).unwrap();
    // A link inside the root is fine.
    symlink(
        root.join(format!("usr/lib/x86_64-linux-gnu/libcuda.so.{version}")),
        root.join(format!(
            "usr/lib/x86_64-linux-gnu/libnvidia-inside.so.{version}"
        )),
    )
    .unwrap();

    let spec_dir = tmp.path().join("cdi");
    let outcome =
        cdi::generate_and_write(&inv, &cdi::DriverRoot::direct(&root), &spec_dir, &options())
            .unwrap();
    let text = fs::read_to_string(&outcome.written.path).unwrap();
    let outside_canon = fs::canonicalize(&outside).unwrap().display().to_string();
    assert!(
        !text.contains(&outside_canon),
        "a path outside the driver root leaked:\n{text}"
    );
    assert!(!text.contains("libnvidia-evil"), "{text}");
    assert!(!text.contains("nvidia-smi"), "{text}");
    assert!(text.contains("libnvidia-inside"), "{text}");
    let host = cdi::discover_host_files(&root, &version, &[]).unwrap();
    assert_eq!(host.rejected.len(), 3, "{:?}", host.rejected);
    let root_canon = fs::canonicalize(&root).unwrap();
    for m in &host.mounts {
        assert!(Path::new(&m.host_path).starts_with(&root_canon), "{m:?}");
    }
}

#[test]
fn device_node_symlinked_outside_dev_is_left_out() {
    let backend = sim(&fixtures_dir().join("l4-4x.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    driver_root::build(&root, &inv.driver.driver_version, 4).unwrap();
    fs::remove_file(root.join("dev/nvidia2")).unwrap();
    symlink(root.join("usr/bin/nvidia-smi"), root.join("dev/nvidia2")).unwrap();
    let outcome = cdi::generate_and_write(
        &inv,
        &cdi::DriverRoot::direct(&root),
        &tmp.path().join("cdi"),
        &options(),
    )
    .unwrap();
    assert!(
        !outcome.device_names.contains(&"2".to_owned()),
        "{:?}",
        outcome.device_names
    );
    assert!(outcome.device_names.contains(&"3".to_owned()));
    assert_eq!(outcome.skipped.len(), 1, "{:?}", outcome.skipped);
}

#[test]
fn writes_atomically_only_on_change_with_mode_0644() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cdi");
    let first = cdi::write_spec(&dir, "a: 1\n").unwrap();
    assert!(first.changed);
    let mode = fs::metadata(&first.path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644);
    let inode = fs::metadata(&first.path).unwrap();
    let again = cdi::write_spec(&dir, "a: 1\n").unwrap();
    assert!(!again.changed);
    assert_eq!(again.digest, first.digest);
    let same = fs::metadata(&first.path).unwrap();
    assert_eq!(
        (
            inode.modified().unwrap(),
            std::os::unix::fs::MetadataExt::ino(&inode)
        ),
        (
            same.modified().unwrap(),
            std::os::unix::fs::MetadataExt::ino(&same)
        )
    );
    let changed = cdi::write_spec(&dir, "a: 2\n").unwrap();
    assert!(changed.changed);
    assert_ne!(changed.digest, first.digest);
    let leftovers: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, [cdi::SPEC_FILE_NAME]);
    assert!(cdi::remove_spec(&dir).unwrap());
    assert!(!cdi::remove_spec(&dir).unwrap());
    assert!(cdi::write_spec(Path::new("relative/dir"), "x").is_err());
}

#[test]
fn lowest_cdi_version_the_content_needs() {
    let backend = sim(&fixtures_dir().join("rtx4090.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    // Host paths equal to container paths (driver root `/`), UUID names only: nothing needs
    // more than the earliest version the crate supports.
    let host = HostFiles {
        nodes: [
            ("/dev/nvidia0", "/dev/nvidia0"),
            ("/dev/nvidiactl", "/dev/nvidiactl"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect(),
        mounts: vec![MountEdit {
            host_path: "/usr/bin/nvidia-smi".into(),
            container_path: "/usr/bin/nvidia-smi".into(),
        }],
        ..HostFiles::default()
    };
    let uuid_only = CdiOptions {
        naming: vec![CdiDeviceNameStrategy::Uuid],
        ..options()
    };
    let spec = cdi::cdi_spec(&inv, &Default::default(), &host, &uuid_only).unwrap();
    let text = cdi::render(&spec.spec).unwrap();
    assert!(text.contains("cdiVersion: 0.3.0"), "{text}");
    cdi::validate_spec(&spec.spec, Path::new("/var/run/cdi/gpupool-nvidia.yaml")).unwrap();
    let by_index = cdi::cdi_spec(&inv, &Default::default(), &host, &options()).unwrap();
    assert!(
        cdi::render(&by_index.spec)
            .unwrap()
            .contains("cdiVersion: 0.5.0")
    );
}

#[test]
fn invalid_kind_is_rejected() {
    let policy = CdiPolicy {
        kind: "../etc/gpu".into(),
        ..CdiPolicy::default()
    };
    assert!(CdiOptions::from_policy(&policy).is_err());
}

/// Serialises `(flags, name, path)` entries as ldconfig lays out an ld.so.cache: the new layout
/// alone, or (`compat`) after an old-format header and table, at the next 8-byte boundary.
fn ld_so_cache(entries: &[(CacheFlags, &str, &str)], compat: bool) -> Vec<u8> {
    const HEADER: usize = 48;
    const ENTRY: usize = 24;
    let table_end = HEADER + ENTRY * entries.len();
    // String offsets count from the start of the new header.
    let mut strings = Vec::new();
    let mut offsets = Vec::new();
    for (_, name, path) in entries {
        let key = table_end + strings.len();
        strings.extend_from_slice(name.as_bytes());
        strings.push(0);
        let value = table_end + strings.len();
        strings.extend_from_slice(path.as_bytes());
        strings.push(0);
        offsets.push((key as u32, value as u32));
    }
    let mut new = b"glibc-ld.so.cache1.1".to_vec();
    new.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    new.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    new.extend_from_slice(&[2, 0, 0, 0]); // little-endian, padding
    new.extend_from_slice(&[0; 16]); // no extension, unused words
    assert_eq!(new.len(), HEADER);
    for ((flags, _, _), (key, value)) in entries.iter().zip(&offsets) {
        new.extend_from_slice(&flags.0.to_le_bytes());
        new.extend_from_slice(&key.to_le_bytes());
        new.extend_from_slice(&value.to_le_bytes());
        new.extend_from_slice(&0u32.to_le_bytes()); // osversion
        new.extend_from_slice(&0u64.to_le_bytes()); // hwcap
    }
    new.extend_from_slice(&strings);
    if !compat {
        return new;
    }
    let mut old = b"ld.so-1.7.0\0".to_vec();
    old.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    let old_end = 16 + 12 * entries.len();
    let new_start = old_end.div_ceil(8) * 8;
    // Old entries count from the end of the old table; they point into the same strings.
    let shift = (new_start - old_end) as u32;
    for ((flags, _, _), (key, value)) in entries.iter().zip(&offsets) {
        old.extend_from_slice(&flags.0.to_le_bytes());
        old.extend_from_slice(&(key + shift).to_le_bytes());
        old.extend_from_slice(&(value + shift).to_le_bytes());
    }
    old.resize(new_start, 0);
    old.extend_from_slice(&new);
    old
}

const X86: CacheFlags = CacheFlags::X86_64_LIBC6;
const ARM: CacheFlags = CacheFlags::AARCH64_LIBC6;
const LIBS: &str = "usr/lib/x86_64-linux-gnu";

fn write_file(root: &Path, rel: &str, content: &str) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

fn link(root: &Path, rel: &str, target: impl AsRef<Path>) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    symlink(target, path).unwrap();
}

/// Paths (as seen from the driver root) of the libraries found, leaving out those the fake
/// driver root holds beyond the four compute libraries these cache tests are about.
fn libraries(host: &HostFiles) -> Vec<&str> {
    const ABOUT: [&str; 6] = [
        "libcuda",
        "libnvidia-ml",
        "libnvidia-ptxjitcompiler",
        "libnvidia-nvvm",
        "libnvidia-inside",
        "libnvidia-evil",
    ];
    host.libraries
        .iter()
        .map(|l| l.root_path.as_str())
        .filter(|p| {
            let stem = p
                .rsplit('/')
                .next()
                .and_then(|n| n.split_once(".so"))
                .map_or("", |(stem, _)| stem);
            !p.starts_with(&format!("/{LIBS}/")) || ABOUT.contains(&stem)
        })
        .collect()
}

/// A fake driver root with soname links as the driver installs them, a driver library in a
/// directory only the cache knows, another driver's `libcuda` in a CUDA compat directory, an
/// AArch64 library and the C library; returns the cache entries that describe it.
fn root_for_cache(root: &Path, version: &str) -> Vec<(CacheFlags, String, String)> {
    driver_root::build(root, version, 1).unwrap();
    for lib in ["libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler"] {
        link(
            root,
            &format!("{LIBS}/{lib}.so.1"),
            format!("{lib}.so.{version}"),
        );
    }
    write_file(
        root,
        &format!("opt/nvidia/lib/libnvidia-cfg.so.{version}"),
        "",
    );
    link(
        root,
        "opt/nvidia/lib/libnvidia-cfg.so.1",
        format!("libnvidia-cfg.so.{version}"),
    );
    write_file(root, "usr/local/cuda/compat/libcuda.so.535.104.05", "");
    link(
        root,
        "usr/local/cuda/compat/libcuda.so.1",
        "libcuda.so.535.104.05",
    );
    write_file(
        root,
        &format!("usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}"),
        "",
    );
    write_file(root, "lib/x86_64-linux-gnu/libc.so.6", "");
    [
        (
            X86,
            "libcuda.so.1",
            "/usr/local/cuda/compat/libcuda.so.1".to_owned(),
        ),
        (X86, "libcuda.so.1", format!("/{LIBS}/libcuda.so.1")),
        (
            X86,
            "libnvidia-ml.so.1",
            format!("/{LIBS}/libnvidia-ml.so.1"),
        ),
        // ldconfig also lists the file names that are their own soname.
        (
            X86,
            "libnvidia-ml.so.1",
            format!("/{LIBS}/libnvidia-ml.so.{version}"),
        ),
        (
            X86,
            "libnvidia-ptxjitcompiler.so.1",
            format!("/{LIBS}/libnvidia-ptxjitcompiler.so.1"),
        ),
        (
            X86,
            "libnvidia-cfg.so.1",
            "/opt/nvidia/lib/libnvidia-cfg.so.1".to_owned(),
        ),
        (
            ARM,
            "libnvidia-ml.so.1",
            format!("/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}"),
        ),
        (
            X86,
            "libc.so.6",
            "/lib/x86_64-linux-gnu/libc.so.6".to_owned(),
        ),
        // Stale: removed since ldconfig last ran.
        (
            X86,
            "libnvidia-gone.so.1",
            format!("/{LIBS}/libnvidia-gone.so.1"),
        ),
    ]
    .into_iter()
    .map(|(f, n, p)| (f, n.to_owned(), p))
    .collect()
}

fn borrowed(entries: &[(CacheFlags, String, String)]) -> Vec<(CacheFlags, &str, &str)> {
    entries
        .iter()
        .map(|(f, n, p)| (*f, n.as_str(), p.as_str()))
        .collect()
}

#[test]
fn ldcache_gives_the_driver_libraries_of_this_version() {
    let version = "550.54.15";
    for compat in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("driver");
        let entries = root_for_cache(&root, version);
        let cache = ld_so_cache(&borrowed(&entries), compat);
        write_file(&root, "etc/ld.so.cache", "");
        fs::write(root.join("etc/ld.so.cache"), &cache).unwrap();

        let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
        assert_eq!(
            host.library_source,
            LibrarySource::LdCache,
            "compat {compat}"
        );
        // The versioned files the sonames lead to; not libnvidia-nvvm (present, but not in the
        // cache), not the compat directory's libcuda of another driver, not the AArch64 copy.
        assert_eq!(
            libraries(&host),
            [
                format!("/opt/nvidia/lib/libnvidia-cfg.so.{version}"),
                format!("/{LIBS}/libcuda.so.{version}"),
                format!("/{LIBS}/libnvidia-ml.so.{version}"),
                format!("/{LIBS}/libnvidia-ptxjitcompiler.so.{version}"),
            ],
            "compat {compat}: {host:?}"
        );
        assert!(host.rejected.is_empty(), "{:?}", host.rejected);
        let root_canon = fs::canonicalize(&root).unwrap();
        for m in &host.mounts {
            assert!(Path::new(&m.host_path).starts_with(&root_canon), "{m:?}");
        }
        // Binaries and firmware come as before.
        assert!(
            host.mounts
                .iter()
                .any(|m| m.container_path == "/usr/bin/nvidia-smi")
        );

        // On an AArch64 host the same cache gives the AArch64 library only.
        let arm = cdi::discover_host_files_for_arch(&root, version, &[], Some(ARM)).unwrap();
        assert_eq!(arm.library_source, LibrarySource::LdCache);
        assert_eq!(
            libraries(&arm),
            [format!(
                "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}"
            )]
        );
    }
}

#[test]
fn ldcache_paths_that_leave_the_driver_root_are_rejected() {
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    let mut entries = root_for_cache(&root, version);
    let outside = tmp.path().join("outside");
    write_file(
        &outside,
        &format!("libnvidia-evil.so.{version}"),
        "host file",
    );
    write_file(&outside, "passwd", "root:x:0:0");
    // Climbs out with `..`, lexically.
    entries.push((
        X86,
        "libnvidia-climb.so.1".into(),
        "/../../etc/passwd".into(),
    ));
    entries.push((
        X86,
        "libnvidia-climb2.so.1".into(),
        format!("/{LIBS}/../../../../outside/libnvidia-evil.so.{version}"),
    ));
    // A soname link inside the root whose target is outside.
    link(
        &root,
        &format!("{LIBS}/libnvidia-evil.so.1"),
        outside.join(format!("libnvidia-evil.so.{version}")),
    );
    entries.push((
        X86,
        "libnvidia-evil.so.1".into(),
        format!("/{LIBS}/libnvidia-evil.so.1"),
    ));
    // Not absolute.
    entries.push((
        X86,
        "libnvidia-rel.so.1".into(),
        format!("{LIBS}/libcuda.so.1"),
    ));
    write_file(&root, "etc/ld.so.cache", "");
    fs::write(
        root.join("etc/ld.so.cache"),
        ld_so_cache(&borrowed(&entries), false),
    )
    .unwrap();

    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    assert_eq!(host.library_source, LibrarySource::LdCache);
    let mut rejected = host.rejected.clone();
    rejected.sort();
    assert_eq!(
        rejected,
        [
            "/../../etc/passwd".to_owned(),
            format!("/{LIBS}/../../../../outside/libnvidia-evil.so.{version}"),
            format!("/{LIBS}/libnvidia-evil.so.1"),
            format!("{LIBS}/libcuda.so.1"),
        ]
    );
    let outside_canon = fs::canonicalize(&outside).unwrap();
    for m in &host.mounts {
        assert!(
            !Path::new(&m.host_path).starts_with(&outside_canon),
            "{m:?}"
        );
        assert!(!m.container_path.contains("evil"), "{m:?}");
    }
    assert_eq!(libraries(&host).len(), 4, "{host:?}");

    // The cache itself a link out of the root: not read; the scan is used.
    fs::write(
        outside.join("ld.so.cache"),
        ld_so_cache(&borrowed(&entries), false),
    )
    .unwrap();
    fs::remove_file(root.join("etc/ld.so.cache")).unwrap();
    symlink(outside.join("ld.so.cache"), root.join("etc/ld.so.cache")).unwrap();
    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    assert_eq!(
        host.library_source,
        LibrarySource::DirectoryScan(ScanReason::CacheOutsideRoot)
    );
    assert_eq!(host.rejected, ["etc/ld.so.cache"]);
    assert!(
        !libraries(&host).iter().any(|l| l.contains("libnvidia-cfg")),
        "{host:?}"
    );
}

#[test]
fn every_truncation_and_corruption_of_a_cache_is_handled() {
    let entries = [
        (
            X86,
            "libcuda.so.1",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        ),
        (
            ARM,
            "libnvidia-ml.so.1",
            "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
        ),
        (X86, "libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
    ];
    for compat in [false, true] {
        let full = ld_so_cache(&entries, compat);
        let cache = LdCache::parse(&full).unwrap();
        assert_eq!(cache.entries.len(), 3);
        assert_eq!(cache.for_flags(X86).count(), 2);
        assert_eq!(
            cache.entries[1].path,
            Path::new("/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1")
        );
        // The last string ends the file, so every shorter prefix lacks a NUL or more.
        for len in 0..full.len() {
            assert!(
                LdCache::parse(&full[..len]).is_err(),
                "compat {compat}: {len} of {} bytes parsed",
                full.len()
            );
        }
        // Any single byte changed: an answer either way, never a panic.
        for at in 0..full.len() {
            for value in [0x00, 0xff, 0x7f, 0x80] {
                let mut bad = full.clone();
                bad[at] = value;
                let _ = LdCache::parse(&bad);
            }
        }
    }
}

#[test]
fn without_a_usable_cache_the_directories_are_scanned() {
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    let entries = root_for_cache(&root, version);
    // The scan goes through the known directories of this architecture: the AArch64 library is
    // left out on x86-64.
    let scanned = [
        format!("/{LIBS}/libcuda.so.{version}"),
        format!("/{LIBS}/libnvidia-ml.so.{version}"),
        format!("/{LIBS}/libnvidia-nvvm.so.{version}"),
        format!("/{LIBS}/libnvidia-ptxjitcompiler.so.{version}"),
    ];
    let check = |reason: ScanReason| {
        let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
        assert_eq!(host.library_source, LibrarySource::DirectoryScan(reason));
        assert_eq!(libraries(&host), scanned, "{host:?}");
        assert!(host.rejected.is_empty(), "{:?}", host.rejected);
    };
    check(ScanReason::CacheMissing);

    // Unknown architecture: the cache is not consulted, and every directory is scanned.
    let host = cdi::discover_host_files_for_arch(&root, version, &[], None).unwrap();
    assert_eq!(
        host.library_source,
        LibrarySource::DirectoryScan(ScanReason::UnknownArchitecture)
    );
    assert!(
        libraries(&host)
            .iter()
            .any(|l| *l == format!("/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}")),
        "{host:?}"
    );
    // On AArch64 the x86-64 directory is the one left out.
    fs::remove_file(root.join("etc/ld.so.cache")).ok();
    let arm = cdi::discover_host_files_for_arch(&root, version, &[], Some(ARM)).unwrap();
    assert_eq!(
        libraries(&arm),
        [format!(
            "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}"
        )],
        "{arm:?}"
    );

    // Every truncation of a good cache: an unreadable cache, and the scan.
    let cache = ld_so_cache(&borrowed(&entries), true);
    let cache_path = root.join("etc/ld.so.cache");
    fs::create_dir_all(cache_path.parent().unwrap()).unwrap();
    for len in (0..cache.len()).step_by(7) {
        fs::write(&cache_path, &cache[..len]).unwrap();
        let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
        assert!(
            matches!(
                host.library_source,
                LibrarySource::DirectoryScan(ScanReason::CacheUnreadable(_))
            ),
            "{len}: {:?}",
            host.library_source
        );
        assert_eq!(libraries(&host), scanned);
    }
    fs::write(&cache_path, "not a cache at all").unwrap();
    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    let LibrarySource::DirectoryScan(ScanReason::CacheUnreadable(why)) = &host.library_source
    else {
        panic!("{:?}", host.library_source);
    };
    assert!(why.contains("magic"), "{why}");

    // A cache of another driver version (ldconfig not run since the upgrade).
    fs::write(&cache_path, ld_so_cache(&borrowed(&entries), false)).unwrap();
    let host = cdi::discover_host_files_for_arch(&root, "560.28.03", &[], Some(X86)).unwrap();
    assert_eq!(
        host.library_source,
        LibrarySource::DirectoryScan(ScanReason::NoDriverLibraries)
    );

    // A directory where the cache should be.
    fs::remove_file(&cache_path).unwrap();
    fs::create_dir(&cache_path).unwrap();
    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    assert!(matches!(
        host.library_source,
        LibrarySource::DirectoryScan(ScanReason::CacheUnreadable(_))
    ));
}

/// On a driver root laid out as the scan expects, the cache finds the same files: the spec is
/// the golden one either way.
#[test]
fn cache_and_scan_make_the_same_spec_on_a_plain_root() {
    let backend = sim(&fixtures_dir().join("rtx4090.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    let version = inv.driver.driver_version.clone();
    let mut texts = Vec::new();
    for with_cache in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("driver");
        driver_root::build(&root, &version, 1).unwrap();
        if with_cache {
            // Every library as ldconfig lists it: by soname through its link, or by its own
            // name when that is its soname; not the vdpau/ one (ldconfig does not index it).
            let entries: Vec<(CacheFlags, String, String)> = driver_root::libraries(&version)
                .into_iter()
                .filter(|l| !l.rel.contains("/vdpau/"))
                .map(|l| {
                    let (dir, file) = l.rel.rsplit_once('/').unwrap();
                    if l.soname != file {
                        link(&root, &format!("{dir}/{}", l.soname), file);
                    }
                    (X86, l.soname.clone(), format!("/{dir}/{}", l.soname))
                })
                .chain([(
                    X86,
                    "libnvidia-ml.so.1".into(),
                    format!("/{LIBS}/libnvidia-ml.so.1.0.0"),
                )])
                .collect();
            write_file(&root, "etc/ld.so.cache", "");
            fs::write(
                root.join("etc/ld.so.cache"),
                ld_so_cache(&borrowed(&entries), false),
            )
            .unwrap();
        }
        let spec_dir = tmp.path().join("cdi");
        let arch = if with_cache { Some(X86) } else { None };
        let host = cdi::discover_host_files_for_arch(&root, &version, &[], arch).unwrap();
        let want = if with_cache {
            LibrarySource::LdCache
        } else {
            LibrarySource::DirectoryScan(ScanReason::UnknownArchitecture)
        };
        assert_eq!(host.library_source, want);
        // The whole path, on the host's own architecture.
        if CacheFlags::host() == Some(X86) {
            let outcome = cdi::generate_and_write(
                &inv,
                &cdi::DriverRoot::direct(&root),
                &spec_dir,
                &options(),
            )
            .unwrap();
            let want = if with_cache {
                LibrarySource::LdCache
            } else {
                LibrarySource::DirectoryScan(ScanReason::CacheMissing)
            };
            assert_eq!(outcome.library_source, want);
            let text = fs::read_to_string(&outcome.written.path).unwrap();
            let canonical_root = fs::canonicalize(&root).unwrap();
            texts.push(text.replace(&canonical_root.display().to_string(), "/DRIVER_ROOT"));
        }
    }
    if let [scan, cache] = texts.as_slice() {
        assert_eq!(scan, cache);
        assert!(check_golden("rtx4090", cache));
    }
}

/// The spec's mounts as (container path, host path with the root replaced by `/DRIVER_ROOT`).
fn spec_mounts(text: &str) -> Vec<(String, String)> {
    let spec: serde_yaml::Value = serde_yaml::from_str(text).unwrap();
    spec["containerEdits"]["mounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap().to_owned(),
                m["hostPath"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn spec_env(text: &str) -> Vec<String> {
    let spec: serde_yaml::Value = serde_yaml::from_str(text).unwrap();
    spec["containerEdits"]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_owned())
        .collect()
}

fn h200() -> Inventory {
    Inventory::read(&sim(&fixtures_dir().join("h200-1x.yaml"))).unwrap()
}

#[test]
fn every_library_is_mounted_at_its_soname_in_every_target_directory() {
    let inv = h200();
    let version = inv.driver.driver_version.clone();
    let tmp = tempfile::tempdir().unwrap();
    let (text, _, _) = generate(&inv, tmp.path());
    let mounts: BTreeMap<String, String> = spec_mounts(&text).into_iter().collect();
    let libraries = driver_root::libraries(&version);
    assert!(libraries.len() >= 25, "{libraries:?}");
    for lib in &libraries {
        let (dir, file) = lib.rel.rsplit_once('/').unwrap();
        let host = format!("/DRIVER_ROOT/{}", lib.rel);
        let mut want = vec![format!("/{}", lib.rel)];
        if dir.ends_with("/vdpau") {
            want.push(format!("/usr/lib/x86_64-linux-gnu/vdpau/{}", lib.soname));
            want.push(format!("/usr/lib64/vdpau/{}", lib.soname));
        } else {
            want.push(format!("{}/{file}", cdi::NVIDIA_LIB_DIR));
            want.push(format!("{}/{}", cdi::NVIDIA_LIB_DIR, lib.soname));
            want.push(format!("/usr/lib/x86_64-linux-gnu/{}", lib.soname));
            want.push(format!("/usr/lib64/{}", lib.soname));
        }
        for path in want {
            assert_eq!(mounts.get(&path), Some(&host), "{path} for {}", lib.rel);
        }
    }
    // The development names Triton and optical-flow users link against.
    for stem in ["libcuda", "libnvidia-opticalflow"] {
        assert_eq!(
            mounts.get(&format!("{}/{stem}.so", cdi::NVIDIA_LIB_DIR)),
            Some(&format!("/DRIVER_ROOT/{LIBS}/{stem}.so.{version}")),
            "{stem}.so"
        );
    }
    assert!(!mounts.contains_key(&format!("{}/libnvidia-ml.so", cdi::NVIDIA_LIB_DIR)));
    // The library of another driver version is still left out, under every name.
    assert!(!text.contains("libnvidia-ml.so.1.0.0"), "{text}");
}

#[test]
fn fake_driver_root_sonames_match_the_known_table() {
    // Without a cache or ELF files the generator falls back to its table; the fake root's
    // sonames (carried by its ELF files and links) must be the same, or tests would disagree
    // with the e2e layer.
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    driver_root::build(&root, version, 1).unwrap();
    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    let found: BTreeMap<&str, (Option<&str>, SonameSource)> = host
        .libraries
        .iter()
        .map(|l| (l.root_path.as_str(), (l.soname.as_deref(), l.soname_source)))
        .collect();
    for lib in driver_root::libraries(version) {
        let path = format!("/{}", lib.rel);
        assert_eq!(
            found.get(path.as_str()),
            Some(&(Some(lib.soname.as_str()), SonameSource::KnownTable)),
            "{path}"
        );
    }
}

fn have_cc() -> bool {
    std::process::Command::new("cc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Compiles an empty shared object with `soname` at `path`.
fn cc_shared(path: &Path, soname: &str) {
    let src = path.with_extension("c");
    fs::write(&src, "int x;\n").unwrap();
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-nostdlib"])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(path)
        .arg(&src)
        .status()
        .unwrap();
    assert!(status.success());
    fs::remove_file(src).unwrap();
}

#[test]
fn soname_is_read_from_the_elf_file_when_the_cache_has_none() {
    if !have_cc() {
        gpupool_sim::testbed::skip("no C compiler (cc) to build an ELF shared object");
        return;
    }
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    driver_root::build(&root, version, 1).unwrap();
    // A soname the table does not have: only the ELF file can give it.
    let nvvm = root.join(format!("{LIBS}/libnvidia-nvvm.so.{version}"));
    cc_shared(&nvvm, "libnvidia-nvvm.so.5");
    let info = cdi::elf::read(&nvvm).unwrap();
    assert_eq!(info.soname.as_deref(), Some("libnvidia-nvvm.so.5"));
    assert_eq!(
        info.machine == cdi::elf::EM_X86_64,
        cfg!(target_arch = "x86_64")
    );
    // An ELF file naming another library's soname is not believed.
    let cuda = root.join(format!("{LIBS}/libcuda.so.{version}"));
    cc_shared(&cuda, "libc.so.6");

    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    let by_path = |p: &str| {
        host.libraries
            .iter()
            .find(|l| l.root_path == format!("/{LIBS}/{p}"))
            .unwrap()
    };
    let nvvm = by_path(&format!("libnvidia-nvvm.so.{version}"));
    assert_eq!(nvvm.soname.as_deref(), Some("libnvidia-nvvm.so.5"));
    assert_eq!(nvvm.soname_source, SonameSource::Elf);
    let cuda = by_path(&format!("libcuda.so.{version}"));
    assert_eq!(cuda.soname.as_deref(), Some("libcuda.so.1"));
    assert_eq!(cuda.soname_source, SonameSource::KnownTable);
    let plan = cdi::container_mounts(&host);
    let paths: Vec<&str> = plan
        .mounts
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert!(
        paths.contains(&"/usr/lib64/libnvidia-nvvm.so.5"),
        "{paths:?}"
    );
    assert!(
        !paths.iter().any(|p| p.ends_with("/libc.so.6")),
        "{paths:?}"
    );
}

#[test]
fn malformed_elf_falls_back_to_the_table_and_unknown_libraries_keep_their_file_name() {
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    driver_root::build(&root, version, 1).unwrap();
    // An ELF header that claims program headers far past the end of the file.
    let mut bad = b"\x7fELF\x02\x01\x01".to_vec();
    bad.resize(64, 0xff);
    fs::write(root.join(format!("{LIBS}/libcuda.so.{version}")), &bad).unwrap();
    assert!(cdi::elf::read(&root.join(format!("{LIBS}/libcuda.so.{version}"))).is_err());
    // A driver library no table knows, not ELF: mounted under its file name only.
    write_file(&root, &format!("{LIBS}/libnvidia-future.so.{version}"), "");

    let host = cdi::discover_host_files_for_arch(&root, version, &[], Some(X86)).unwrap();
    let plan = cdi::container_mounts(&host);
    let paths: BTreeSet<&str> = plan
        .mounts
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert!(paths.contains("/usr/lib64/libcuda.so.1"));
    assert!(paths.contains("/usr/local/nvidia/lib64/libcuda.so"));
    let future = host
        .libraries
        .iter()
        .find(|l| l.root_path.contains("libnvidia-future"))
        .unwrap();
    assert_eq!(
        (future.soname.as_deref(), future.soname_source),
        (None, SonameSource::Unknown)
    );
    let future_paths: Vec<&str> = paths
        .iter()
        .copied()
        .filter(|p| p.contains("libnvidia-future"))
        .collect();
    assert_eq!(
        future_paths,
        [
            format!("/usr/lib/x86_64-linux-gnu/libnvidia-future.so.{version}"),
            format!("/usr/local/nvidia/lib64/libnvidia-future.so.{version}"),
        ]
    );
}

#[test]
fn no_container_path_twice_and_a_deterministic_winner() {
    let inv = h200();
    let version = inv.driver.driver_version.clone();
    let mut texts = Vec::new();
    for _ in 0..2 {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("driver");
        driver_root::build(&root, &version, 1).unwrap();
        // The same library in a second directory: both claim the same soname paths.
        write_file(&root, &format!("usr/lib64/libcuda.so.{version}"), "second");
        let spec_dir = tmp.path().join("cdi");
        let host = cdi::discover_host_files(&root, &version, &[]).unwrap();
        let plan = cdi::container_mounts(&host);
        let first = fs::canonicalize(root.join(format!("{LIBS}/libcuda.so.{version}"))).unwrap();
        let winner = plan
            .mounts
            .iter()
            .find(|m| m.container_path == "/usr/local/nvidia/lib64/libcuda.so.1")
            .unwrap();
        assert_eq!(Path::new(&winner.host_path), first);
        assert!(
            plan.conflicts
                .iter()
                .any(|c| c.starts_with("/usr/local/nvidia/lib64/libcuda.so.1: ")),
            "{:?}",
            plan.conflicts
        );
        // Each file keeps its own host path, whoever wins the aliases.
        let second = plan
            .mounts
            .iter()
            .find(|m| m.container_path == format!("/usr/lib64/libcuda.so.{version}"))
            .unwrap();
        assert!(
            second
                .host_path
                .ends_with("usr/lib64/libcuda.so.570.133.20"),
            "{second:?}"
        );
        let outcome =
            cdi::generate_and_write(&inv, &cdi::DriverRoot::direct(&root), &spec_dir, &options())
                .unwrap();
        let text = fs::read_to_string(&outcome.written.path).unwrap();
        let canonical_root = fs::canonicalize(&root).unwrap();
        texts.push(text.replace(&canonical_root.display().to_string(), "/DRIVER_ROOT"));
    }
    assert_eq!(texts[0], texts[1]);
    let mounts = spec_mounts(&texts[0]);
    let unique: BTreeSet<&String> = mounts.iter().map(|(c, _)| c).collect();
    assert_eq!(unique.len(), mounts.len());
}

#[test]
fn every_golden_spec_has_unique_container_paths_and_leaves_ld_library_path_alone() {
    let mut checked = 0;
    for entry in fs::read_dir(golden_dir()).unwrap() {
        let text = fs::read_to_string(entry.unwrap().path()).unwrap();
        let mounts = spec_mounts(&text);
        let unique: BTreeSet<&String> = mounts.iter().map(|(c, _)| c).collect();
        assert_eq!(unique.len(), mounts.len());
        let env = spec_env(&text);
        assert!(
            !env.iter().any(|e| e.starts_with("LD_LIBRARY_PATH=")),
            "{env:?}"
        );
        assert!(!env.iter().any(|e| e.starts_with("LD_PRELOAD=")), "{env:?}");
        assert!(
            env.contains(&format!("TRITON_LIBCUDA_PATH={}", cdi::NVIDIA_LIB_DIR)),
            "{env:?}"
        );
        assert!(!text.contains("hooks"));
        checked += 1;
    }
    assert!(checked >= 9);
}

#[test]
fn graphics_loader_configs_firmware_and_imex_are_mounted_and_mps_control_is_not() {
    let inv = h200();
    let version = inv.driver.driver_version.clone();
    let tmp = tempfile::tempdir().unwrap();
    let (text, _, _) = generate(&inv, tmp.path());
    let mounts: BTreeMap<String, String> = spec_mounts(&text).into_iter().collect();
    for (container, host) in [
        (
            "/usr/share/glvnd/egl_vendor.d/10_nvidia.json".to_owned(),
            "/DRIVER_ROOT/usr/share/glvnd/egl_vendor.d/10_nvidia.json".to_owned(),
        ),
        (
            "/etc/vulkan/icd.d/nvidia_icd.json".to_owned(),
            "/DRIVER_ROOT/usr/share/vulkan/icd.d/nvidia_icd.json".to_owned(),
        ),
        (
            "/etc/vulkan/implicit_layer.d/nvidia_layers.json".to_owned(),
            "/DRIVER_ROOT/usr/share/vulkan/implicit_layer.d/nvidia_layers.json".to_owned(),
        ),
        (
            "/etc/OpenCL/vendors/nvidia.icd".to_owned(),
            "/DRIVER_ROOT/etc/OpenCL/vendors/nvidia.icd".to_owned(),
        ),
        (
            "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json".to_owned(),
            "/DRIVER_ROOT/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json".to_owned(),
        ),
        (
            format!("/lib/firmware/nvidia/{version}/gsp_tu10x.bin"),
            format!("/DRIVER_ROOT/lib/firmware/nvidia/{version}/gsp_tu10x.bin"),
        ),
        (
            "/usr/bin/nvidia-imex".to_owned(),
            "/DRIVER_ROOT/usr/bin/nvidia-imex".to_owned(),
        ),
        (
            "/usr/bin/nvidia-imex-ctl".to_owned(),
            "/DRIVER_ROOT/usr/bin/nvidia-imex-ctl".to_owned(),
        ),
        (
            "/run/nvidia-persistenced/socket".to_owned(),
            "/DRIVER_ROOT/run/nvidia-persistenced/socket".to_owned(),
        ),
        (
            format!("/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.{version}"),
            format!("/DRIVER_ROOT/{LIBS}/libGLX_nvidia.so.{version}"),
        ),
        (
            "/usr/lib/x86_64-linux-gnu/libEGL_nvidia.so.0".to_owned(),
            format!("/DRIVER_ROOT/{LIBS}/libEGL_nvidia.so.{version}"),
        ),
    ] {
        assert_eq!(mounts.get(&container), Some(&host), "{container}");
    }
    // The driver root holds both (the fake driver root has them, as a real one does), and
    // neither reaches a tenant: the control program would let a tenant quit or reconfigure
    // the MPS daemon co-tenants use, and the host's /tmp is anyone's to write.
    for withheld in ["/usr/bin/nvidia-cuda-mps-control", "/tmp/nvidia-mps"] {
        assert!(
            tmp.path()
                .join("driver")
                .join(withheld.trim_start_matches('/'))
                .exists(),
            "the fixture lacks {withheld}"
        );
        assert!(
            !mounts.contains_key(withheld) && !mounts.values().any(|h| h.ends_with(withheld)),
            "{withheld} is mounted into GPU containers"
        );
    }
    assert!(
        mounts.contains_key("/usr/bin/nvidia-cuda-mps-server"),
        "{mounts:?}"
    );
}

#[test]
fn symlinked_config_and_mps_dir_leaving_the_root_are_left_out() {
    let inv = h200();
    let version = inv.driver.driver_version.clone();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    driver_root::build(&root, &version, 1).unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("icd.json"), "{}").unwrap();
    let icd = root.join("usr/share/vulkan/icd.d/nvidia_icd.json");
    fs::remove_file(&icd).unwrap();
    symlink(outside.join("icd.json"), &icd).unwrap();
    fs::remove_dir(root.join("tmp/nvidia-mps")).unwrap();
    symlink(&outside, root.join("tmp/nvidia-mps")).unwrap();
    // A soname link out of the root in a library directory changes nothing: links are not
    // what the generator mounts.
    symlink(
        outside.join("icd.json"),
        root.join(format!("{LIBS}/libcuda.so.1")),
    )
    .unwrap();
    let host = cdi::discover_host_files(&root, &version, &[]).unwrap();
    let outside_canon = fs::canonicalize(&outside).unwrap();
    let plan = cdi::container_mounts(&host);
    for m in &plan.mounts {
        assert!(
            !Path::new(&m.host_path).starts_with(&outside_canon),
            "{m:?}"
        );
    }
    assert!(
        host.rejected.iter().any(|r| r.contains("nvidia_icd.json")),
        "{:?}",
        host.rejected
    );
    assert!(
        !plan
            .mounts
            .iter()
            .any(|m| m.container_path.contains("nvidia-mps") || m.host_path.contains("nvidia-mps")),
        "{:?}",
        plan.mounts
    );
    assert!(
        plan.mounts
            .iter()
            .any(|m| m.container_path == "/usr/lib64/libcuda.so.1")
    );
}

/// On a root built as the e2e layer builds it (ELF libraries, soname links, `ldconfig -r`),
/// the libraries come from the real cache with the sonames they carry. Needs root and cc.
#[test]
fn real_ld_cache_of_an_elf_driver_root_gives_every_soname() {
    let is_root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if !is_root || !have_cc() || CacheFlags::host() != Some(X86) {
        gpupool_sim::testbed::skip(&format!(
            "needs root (ldconfig -r chroots), cc and an x86-64 host (root: {is_root}, cc: {})",
            have_cc()
        ));
        return;
    }
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    let options = driver_root::BuildOptions {
        elf_libraries: true,
        ldconfig: true,
        ..driver_root::BuildOptions::default()
    };
    driver_root::build_with(&root, version, 1, &options).unwrap();
    let host = cdi::discover_host_files(&root, version, &[]).unwrap();
    assert_eq!(host.library_source, LibrarySource::LdCache);
    let found: BTreeMap<&str, &cdi::DriverLibrary> = host
        .libraries
        .iter()
        .map(|l| (l.root_path.as_str(), l))
        .collect();
    for lib in driver_root::libraries(version) {
        let found = found[format!("/{}", lib.rel).as_str()];
        assert_eq!(
            found.soname.as_deref(),
            Some(lib.soname.as_str()),
            "{}",
            lib.rel
        );
        // Names other than the file's come from the cache; a library that is its own soname
        // (or in vdpau/, which ldconfig skips) gets it from its ELF file.
        let want = if lib.rel.ends_with(&lib.soname) || lib.rel.contains("/vdpau/") {
            SonameSource::Elf
        } else {
            SonameSource::LdCache
        };
        assert_eq!(found.soname_source, want, "{}", lib.rel);
        assert_eq!(found.arch, Some(cdi::LibArch::X86_64));
    }
}

/// The agent in its container reads the driver root through the host's `/` mounted at a path
/// of its own; the spec it writes is the one it would write on the host, naming host paths.
#[test]
fn spec_read_through_a_host_root_names_the_hosts_paths() {
    let backend = sim(&fixtures_dir().join("a100-8x.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let host = tmp.path().join("host");
    let root = host.join("run/nvidia/driver");
    driver_root::build(&root, &inv.driver.driver_version, inv.gpus.len() as u32).unwrap();

    let direct_dir = tmp.path().join("direct");
    let direct = cdi::generate_and_write(
        &inv,
        &cdi::DriverRoot::direct(&root),
        &direct_dir,
        &options(),
    )
    .unwrap();
    let through = cdi::DriverRoot::new(Some(&host), Path::new("/run/nvidia/driver")).unwrap();
    let through_dir = tmp.path().join("through");
    let outcome = cdi::generate_and_write(&inv, &through, &through_dir, &options()).unwrap();
    assert_eq!(outcome.device_names, direct.device_names);

    let text = fs::read_to_string(&outcome.written.path).unwrap();
    let tmp_canon = fs::canonicalize(tmp.path()).unwrap().display().to_string();
    assert!(
        !text.contains(&tmp_canon),
        "a path of the agent's own view leaked into the spec:\n{text}"
    );
    assert!(
        text.contains("hostPath: /run/nvidia/driver/usr/bin/nvidia-smi"),
        "{text}"
    );
    // The same spec as read directly, with the root in the host's terms.
    let root_canon = fs::canonicalize(&root).unwrap().display().to_string();
    let expected = fs::read_to_string(&direct.written.path)
        .unwrap()
        .replace(&root_canon, "/run/nvidia/driver");
    assert_eq!(text, expected);
}

/// NVML is loaded by full path from the driver root, found through the root's ld.so.cache
/// even in a directory the scan does not look at.
#[test]
fn nvml_is_found_through_the_roots_ldcache() {
    let version = "550.54.15";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    write_file(&root, &format!("opt/nvml/libnvidia-ml.so.{version}"), "");
    link(
        &root,
        "opt/nvml/libnvidia-ml.so.1",
        format!("libnvidia-ml.so.{version}"),
    );
    assert_eq!(
        cdi::find_nvml_library(&root),
        None,
        "not in a scanned directory"
    );
    let cache = ld_so_cache(
        &[
            // Another architecture's first: not taken.
            (
                ARM,
                "libnvidia-ml.so.1",
                "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
            ),
            (X86, "libnvidia-ml.so.1", "/opt/nvml/libnvidia-ml.so.1"),
        ],
        false,
    );
    write_file(&root, "etc/ld.so.cache", "");
    fs::write(root.join("etc/ld.so.cache"), &cache).unwrap();
    write_file(
        &root,
        &format!("usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}"),
        "",
    );
    link(
        &root,
        "usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
        format!("libnvidia-ml.so.{version}"),
    );
    assert_eq!(
        cdi::find_nvml_library(&root),
        Some(fs::canonicalize(root.join(format!("opt/nvml/libnvidia-ml.so.{version}"))).unwrap())
    );
}

/// The memo skips validation and rendering only for the very spec it holds: the same bytes as
/// a pass without it, a driver change still seen, a file edited behind the agent's back still
/// put back.
#[test]
fn memo_reuses_only_an_identical_spec() {
    let backend = sim(&fixtures_dir().join("l4-4x.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    driver_root::build(&root, &inv.driver.driver_version, 4).unwrap();
    let root = cdi::DriverRoot::direct(&root);
    let (plain_dir, memo_dir) = (tmp.path().join("plain"), tmp.path().join("memo"));
    let mut memo = cdi::SpecMemo::default();
    let run = |memo: &mut cdi::SpecMemo| {
        cdi::generate_and_write_memo(&inv, &root, &memo_dir, &options(), memo).unwrap()
    };

    let plain = cdi::generate_and_write(&inv, &root, &plain_dir, &options()).unwrap();
    let first = run(&mut memo);
    assert!(first.written.changed);
    assert_eq!(first.written.digest, plain.written.digest);
    let again = run(&mut memo);
    assert!(!again.written.changed);
    assert_eq!(again.written.digest, plain.written.digest);
    assert_eq!(
        fs::read(&again.written.path).unwrap(),
        fs::read(&plain.written.path).unwrap()
    );

    // Edited behind the agent's back: the memo's content is written back.
    fs::write(&again.written.path, "edited\n").unwrap();
    let restored = run(&mut memo);
    assert!(restored.written.changed);
    assert_eq!(restored.written.digest, plain.written.digest);

    // A GPU's device node goes: a new spec, not the memo's.
    fs::remove_file(root.local().join("dev/nvidia3")).unwrap();
    let changed = run(&mut memo);
    assert!(changed.written.changed);
    assert_ne!(changed.written.digest, plain.written.digest);
    assert!(!changed.device_names.contains(&"3".to_owned()));
    let fresh = cdi::generate_and_write(&inv, &root, &plain_dir, &options()).unwrap();
    assert_eq!(fresh.written.digest, changed.written.digest);
}
