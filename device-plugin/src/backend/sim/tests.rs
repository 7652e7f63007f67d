//! SimBackend behaviour the conformance suite does not cover (it runs on both backends).

use super::*;
use crate::backend::{ErrorKind, GpuBackend, HealthEventKind, MigModeChange};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn sim(name: &str) -> (SimBackend, ManualSimClock) {
    let clock = ManualSimClock::new();
    let sim = SimBackend::from_file(&fixture(name), Arc::new(clock.clone())).unwrap();
    (sim, clock)
}

#[test]
fn every_shipped_fixture_loads() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut count = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let sim = SimBackend::from_file(&path, Arc::new(ManualSimClock::new()))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(sim.device_count().unwrap() > 0);
            sim.driver().unwrap();
            for d in sim.devices().unwrap() {
                assert!(d.uuid.as_str().starts_with("GPU-"));
            }
            count += 1;
        }
    }
    assert!(count >= 8, "{count} fixtures");
}

#[test]
fn fixture_errors_are_clear() {
    let bad = |yaml: &str| {
        let fixture: Fixture = serde_yaml::from_str(yaml).unwrap();
        SimBackend::new(fixture, Arc::new(ManualSimClock::new()))
            .unwrap_err()
            .to_string()
    };
    let base = "driver: {version: '550.54.15', cuda: '12.4'}\n";
    assert!(
        bad(&format!("{base}gpus: [{{model: B9000}}]")).contains("unknown GPU model \"B9000\"")
    );
    assert!(
        bad(&format!(
            "{base}gpus: [{{model: L4}}]\nfaults: [{{at: 1, gpu: 3, fault: fallen_off_bus}}]"
        ))
        .contains("a fault names GPU 3; the fixture has 1")
    );
    assert!(
        bad(&format!("{base}gpus: [{{model: L4, mig_enabled: true}}]")).contains("not MIG-capable")
    );
    let unknown_field = serde_yaml::from_str::<Fixture>(&format!("{base}gpus: []\nextra: 1"));
    assert!(unknown_field.is_err());
}

#[test]
fn generated_uuids_are_stable_and_differ_per_node() {
    let (a, _) = sim("h100-8x.yaml");
    let (a2, _) = sim("h100-8x.yaml");
    let (b, _) = sim("a100-8x.yaml");
    let ua: Vec<_> = a.devices().unwrap().into_iter().map(|d| d.uuid).collect();
    let ua2: Vec<_> = a2.devices().unwrap().into_iter().map(|d| d.uuid).collect();
    let ub: Vec<_> = b.devices().unwrap().into_iter().map(|d| d.uuid).collect();
    assert_eq!(ua, ua2);
    assert!(ua.iter().all(|u| !ub.contains(u)));
}

#[test]
fn scripted_faults_follow_the_clock_and_clear_on_reset() {
    let (sim, clock) = sim("faults.yaml");
    let mut events = sim.health_events().unwrap();
    assert!(events.wait(Duration::ZERO).unwrap().is_empty());
    assert_eq!(sim.health(1).unwrap().ecc_uncorrected, Some(0));

    clock.set(30.0);
    let got = events.wait(Duration::ZERO).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].gpu, got[0].kind),
        (1, HealthEventKind::DoubleBitEcc)
    );
    assert_eq!(sim.health(1).unwrap().ecc_uncorrected, Some(1));
    // Delivered once per subscription.
    assert!(events.wait(Duration::ZERO).unwrap().is_empty());

    clock.set(125.0);
    let kinds: Vec<_> = events
        .wait(Duration::ZERO)
        .unwrap()
        .into_iter()
        .map(|e| (e.gpu, e.kind))
        .collect();
    assert_eq!(
        kinds,
        vec![(1, HealthEventKind::Xid(13)), (0, HealthEventKind::Xid(79))]
    );
    assert_eq!(sim.health(0).unwrap_err().kind(), ErrorKind::GpuLost);
    assert_eq!(sim.health(2).unwrap().pcie_replay, Some(12));
    // Identity survives, as NVML keeps it for a lost GPU.
    assert_eq!(sim.device(0).unwrap().index, 0);

    sim.reset_gpu(0).unwrap();
    sim.clear(1).unwrap();
    assert_eq!(sim.health(0).unwrap().ecc_uncorrected, Some(0));
    assert_eq!(sim.health(1).unwrap().ecc_uncorrected, Some(0));
    // A fresh subscription does not replay cleared faults.
    let mut fresh = sim.health_events().unwrap();
    let replay: Vec<_> = fresh
        .wait(Duration::ZERO)
        .unwrap()
        .into_iter()
        .map(|e| e.gpu)
        .collect();
    assert!(replay.is_empty(), "{replay:?}");
}

#[test]
fn injected_faults_reach_waiting_subscribers() {
    let (sim, _clock) = sim("h100-8x.yaml");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let backend: Arc<dyn GpuBackend> = Arc::new(sim.clone());
    let (mut rx, handle) =
        crate::backend::spawn_health_stream(backend, Duration::from_secs(5), stop.clone());
    sim.inject(Fault {
        gpu: 3,
        kind: FaultKind::Xid(48),
        gpu_instance: Some(GpuInstanceId(2)),
        compute_instance: Some(ComputeInstanceId(0)),
    })
    .unwrap();
    let event = rx.blocking_recv().unwrap().unwrap();
    assert_eq!(event.gpu, 3);
    assert_eq!(event.kind, HealthEventKind::Xid(48));
    assert_eq!(event.gpu_instance, Some(GpuInstanceId(2)));
    assert_eq!(event.compute_instance, Some(ComputeInstanceId(0)));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    sim.inject(Fault::gpu(3, FaultKind::Temperature(90)))
        .unwrap();
    drop(rx);
    handle.join().unwrap();
}

#[test]
fn ampere_mig_mode_waits_for_a_reset() {
    let (sim, _) = sim("a100-8x.yaml");
    assert_eq!(
        sim.mig_mode(0).unwrap(),
        MigMode {
            current: false,
            pending: false
        }
    );
    assert!(matches!(
        sim.set_mig_mode(0, true).unwrap(),
        MigModeChange::PendingReset(_)
    ));
    assert_eq!(
        sim.mig_mode(0).unwrap(),
        MigMode {
            current: false,
            pending: true
        }
    );
    assert_eq!(
        sim.gpu_instance_profiles(0).unwrap_err().kind(),
        ErrorKind::NotSupported
    );
    sim.reset_gpu(0).unwrap();
    assert_eq!(
        sim.mig_mode(0).unwrap(),
        MigMode {
            current: true,
            pending: true
        }
    );
    assert_eq!(sim.gpu_instance_profiles(0).unwrap().len(), 7);
}

#[test]
fn busy_gpu_keeps_mig_change_pending_and_utilization_follows_trace() {
    let (sim, clock) = sim("h100-8x.yaml");
    assert_eq!(sim.utilization(0).unwrap().gpu_percent, 97);
    assert!(matches!(
        sim.set_mig_mode(0, true).unwrap(),
        MigModeChange::PendingReset(_)
    ));
    clock.set(600.0);
    assert_eq!(sim.utilization(0).unwrap().gpu_percent, 0);
    assert!(sim.processes(0).unwrap().is_empty());
    assert_eq!(sim.set_mig_mode(0, true).unwrap(), MigModeChange::Applied);
    assert_eq!(
        sim.utilization(0).unwrap_err().kind(),
        ErrorKind::NotSupported
    );
}
