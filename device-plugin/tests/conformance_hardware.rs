//! Read-only checks of `NvmlBackend` against a real driver, for machines with NVIDIA GPUs.
//! Ignored unless asked for (`--ignored`); never changes MIG mode or creates instances.
//!
//! ```sh
//! cargo test -p gpupool-device-plugin --test conformance_hardware -- --ignored --nocapture
//! ```

use gpupool_device_plugin::backend::{ErrorKind, GpuBackend, NvmlBackend, NvmlOptions};
use gpupool_mig_catalog as catalog;

fn real() -> Option<NvmlBackend> {
    Some(NvmlBackend::new(&NvmlOptions::from_env()).expect("NVML loads on this machine"))
}

#[test]
#[ignore = "needs an NVIDIA GPU and its driver: run with --ignored on such a machine"]
fn real_driver_enumerates_and_matches_the_catalog() {
    let Some(nvml) = real() else { return };
    let driver = nvml.driver().unwrap();
    println!(
        "driver {} / CUDA {}",
        driver.driver_version, driver.cuda_version
    );
    let devices = nvml.devices().unwrap();
    assert!(!devices.is_empty());
    for d in &devices {
        println!("{d:?}");
        println!("  health {:?}", nvml.health(d.index).unwrap());
        println!("  numa {:?}", nvml.numa_node(d.index).unwrap());
        match nvml.persistence_mode(d.index) {
            Ok(on) => println!("  persistence mode {}", if on { "on" } else { "off" }),
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}"),
        }
        println!("  processes {:?}", nvml.processes(d.index).unwrap());
        match nvml.mig_mode(d.index) {
            Ok(mode) => println!("  MIG {mode:?}"),
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}"),
        }
        let Some(model) = catalog::model_by_product_name(&d.name) else {
            println!("  (not in the MIG catalog)");
            continue;
        };
        let profiles = match nvml.gpu_instance_profile_infos(d.index) {
            Ok(p) if !p.is_empty() => p,
            other => {
                println!("  driver lists no profiles with MIG in this mode: {other:?}");
                continue;
            }
        };
        for p in &profiles {
            println!("  {p:?}");
            let spec = model
                .profile_by_id(p.id.0)
                .unwrap_or_else(|| panic!("{}: profile ID {} not in catalog", model.key, p.id.0));
            assert_eq!(p.name.as_str(), spec.name);
            assert_eq!(p.nvml_profile, spec.nvml_profile, "{}", spec.name);
            assert_eq!(p.slice_count, spec.compute_slices, "{}", spec.name);
            assert_eq!(p.instance_count, spec.max_instances, "{}", spec.name);
            assert_eq!(p.multiprocessors, spec.multiprocessors, "{}", spec.name);
            let diff =
                (p.memory_mib as f64 - spec.memory_mib as f64).abs() / spec.memory_mib as f64;
            assert!(
                diff < 0.03,
                "{}: NVML {} MiB, catalog {}",
                spec.name,
                p.memory_mib,
                spec.memory_mib
            );
        }
        if nvml.mig_mode(d.index).is_ok_and(|m| m.current) {
            for p in nvml.gpu_instance_profiles(d.index).unwrap() {
                let spec = model.profile_by_id(p.id.0).unwrap();
                let starts: Vec<u32> = p.placements.iter().map(|pl| pl.start).collect();
                assert_eq!(starts, spec.placement_starts, "{}", spec.name);
            }
            println!("  MIG devices {:?}", nvml.mig_devices(d.index).unwrap());
        }
    }
    for a in 0..devices.len() as u32 {
        for b in 0..devices.len() as u32 {
            println!("topology {a}-{b}: {:?}", nvml.topology(a, b).unwrap());
        }
    }
    let mut events = nvml.health_events().unwrap();
    println!(
        "events: {:?}",
        events.wait(std::time::Duration::ZERO).unwrap()
    );
}
