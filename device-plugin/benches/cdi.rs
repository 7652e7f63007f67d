//! Time to generate, validate and write the node's CDI spec: 8 × H100 with 7 MIG devices each,
//! and 8 whole GPUs: a new file, an unchanged file found by a new process, and the agent's
//! steady state (the spec of its last pass). Prints its figures; run with
//! `cargo bench -p gpupool-device-plugin --bench cdi`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool_crds::node::GpuMigSpec;
use gpupool_crds::policy::CdiPolicy;
use gpupool_device_plugin::backend::{GpuBackend, ManualSimClock, SimBackend};
use gpupool_device_plugin::cdi::{self, CdiOptions, SpecMemo};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::mig;

const ROUNDS: u32 = 50;

fn h100_node(mig_devices: bool) -> Result<Inventory, Box<dyn std::error::Error>> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/h100-8x.yaml");
    // Past the fixture's traces: GPU 0 runs a process for its first 600 s, which would keep
    // its MIG mode change pending.
    let clock = ManualSimClock::new();
    clock.set(3600.0);
    let backend = SimBackend::from_file(&fixture, Arc::new(clock))?;
    if mig_devices {
        let wanted: Vec<GpuMigSpec> = (0..8)
            .map(|index| GpuMigSpec {
                index,
                enabled: true,
                profiles: BTreeMap::from([("1g.10gb".to_owned(), 7)]),
            })
            .collect();
        loop {
            let inv = Inventory::read(&backend)?;
            let ops = mig::plan_mig(&mig::current_from_inventory(&inv), &wanted)?;
            let Some(op) = ops.first() else { break };
            mig::apply_op(&backend as &dyn GpuBackend, op)?;
        }
    }
    Ok(Inventory::read(&backend)?)
}

fn stats(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let median = samples[samples.len() / 2];
    let p90 = samples[samples.len() * 9 / 10];
    format!("median {median:?}, p90 {p90:?}, min {:?}", samples[0])
}

fn bench(name: &str, inv: &Inventory) -> Result<(), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("driver");
    gpupool_sim::driver_root::build(&root, &inv.driver.driver_version, inv.gpus.len() as u32)?;
    let root = cdi::DriverRoot::direct(&root);
    let opts = CdiOptions::from_policy(&CdiPolicy::default())?;
    let mut fresh = Vec::new();
    let mut unchanged_cold = Vec::new();
    let mut unchanged = Vec::new();
    let mut devices = 0;
    for round in 0..ROUNDS {
        let dir = tmp.path().join(format!("cdi-{round}"));
        // A new process: nothing validated yet, no file.
        let start = Instant::now();
        let out = cdi::generate_and_write_memo(inv, &root, &dir, &opts, &mut SpecMemo::default())?;
        fresh.push(start.elapsed());
        assert!(out.written.changed);
        assert!(out.skipped.is_empty(), "{:?}", out.skipped);
        devices = out.device_names.len();
        // A new process finding the file it would write (an agent restart).
        let start = Instant::now();
        let again =
            cdi::generate_and_write_memo(inv, &root, &dir, &opts, &mut SpecMemo::default())?;
        unchanged_cold.push(start.elapsed());
        assert!(!again.written.changed);
        // The agent's steady state: the same spec as its last pass.
        let mut memo = SpecMemo::default();
        cdi::generate_and_write_memo(inv, &root, &dir, &opts, &mut memo)?;
        let start = Instant::now();
        let again = cdi::generate_and_write_memo(inv, &root, &dir, &opts, &mut memo)?;
        unchanged.push(start.elapsed());
        assert!(!again.written.changed);
    }
    println!("{name}: {devices} CDI devices");
    println!("  generate + validate + write (new file): {}", stats(fresh));
    println!(
        "  content unchanged, first pass of a process (render + compare, no write): {}",
        stats(unchanged_cold)
    );
    println!(
        "  content unchanged, same spec as the last pass (the agent's steady state): {}",
        stats(unchanged)
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    bench("8 x H100, 7 MIG devices each", &h100_node(true)?)?;
    bench("8 x H100, whole GPUs", &h100_node(false)?)?;
    Ok(())
}
