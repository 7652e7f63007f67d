//! The CDI spec writer against fake driver roots: golden files per fixture, validation and
//! resolution with the CDI crate, symlink safety, atomic writes.
//!
//! Regenerate the golden files with `GPUPOOL_UPDATE_GOLDEN=1 cargo test -p gpupool-device-plugin --test cdi`.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use container_device_interface::cache::{new_cache, with_auto_refresh};
use container_device_interface::spec_dirs::with_spec_dirs;
use gpupool_crds::node::GpuMigSpec;
use gpupool_crds::policy::{CdiDeviceNameStrategy, CdiPolicy};
use gpupool_device_plugin::backend::{GpuBackend, ManualClock, SimBackend};
use gpupool_device_plugin::cdi::{self, CdiOptions, HostFiles, MountEdit};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::mig;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn sim(fixture: &Path) -> SimBackend {
    SimBackend::from_file(fixture, Arc::new(ManualClock::new())).expect("fixture loads")
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
    cdi::build_fake_driver_root(&root, &inv.driver.driver_version, inv.gpus.len() as u32).unwrap();
    let spec_dir = tmp.join("cdi");
    let outcome = cdi::generate_and_write(inv, &root, &spec_dir, &options()).unwrap();
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
fn symlinks_out_of_the_driver_root_are_not_followed() {
    let backend = sim(&fixtures_dir().join("rtx4090.yaml"));
    let inv = Inventory::read(&backend).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("driver");
    let version = inv.driver.driver_version.clone();
    cdi::build_fake_driver_root(&root, &version, 1).unwrap();
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
    let outcome = cdi::generate_and_write(&inv, &root, &spec_dir, &options()).unwrap();
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
    cdi::build_fake_driver_root(&root, &inv.driver.driver_version, 4).unwrap();
    fs::remove_file(root.join("dev/nvidia2")).unwrap();
    symlink(root.join("usr/bin/nvidia-smi"), root.join("dev/nvidia2")).unwrap();
    let outcome =
        cdi::generate_and_write(&inv, &root, &tmp.path().join("cdi"), &options()).unwrap();
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
        rejected: vec![],
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
