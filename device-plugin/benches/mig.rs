//! MIG reconfiguration time on the simulated node: a layout change until the agent's state
//! machine reports `Applied`, per GPU and for a node of 8 (8 × H100). Each step re-reads the
//! hardware through the backend and performs one operation, as the agent does; no pods run,
//! so draining ends at once. The simulated GPUs apply an operation instantly, so the figures
//! are the agent's own cost (planning, inventory reads, the backend calls), the floor under
//! which real hardware adds its GPU-instance creation times. Prints its figures; run with
//! `cargo bench -p gpupool-device-plugin --bench mig`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool_crds::node::{GpuMigSpec, NodeMigSpec};
use gpupool_device_plugin::backend::{GpuBackend, ManualSimClock, SimBackend};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::mig::{self, MigController, Phase, Step};

const ROUNDS: usize = 30;

fn layout(gpus: &[u32], profile: &str, count: u32) -> NodeMigSpec {
    NodeMigSpec {
        managed: true,
        gpus: gpus
            .iter()
            .map(|&index| GpuMigSpec {
                index,
                enabled: true,
                profiles: BTreeMap::from([(profile.to_owned(), count)]),
            })
            .collect(),
        ..NodeMigSpec::default()
    }
}

/// Steps the controller until `Applied`; returns the operations performed.
fn apply(
    backend: &dyn GpuBackend,
    controller: &mut MigController,
    spec: &NodeMigSpec,
    generation: i64,
) -> Result<usize, Box<dyn std::error::Error>> {
    let idle = gpupool_device_plugin::occupancy::Occupancy::default();
    let mut ops = 0;
    for _ in 0..1000 {
        let inventory = Inventory::read(backend)?;
        let current = mig::current_from_inventory(&inventory);
        match controller.step(&current, spec, Some(generation), &idle, Instant::now()) {
            Step::Execute(op) => {
                mig::apply_op(backend, &op)?;
                ops += 1;
            }
            Step::PhaseChanged | Step::Idle => {
                if *controller.phase() == Phase::Applied {
                    return Ok(ops);
                }
            }
            Step::Wait(d) => return Err(format!("controller waits {d:?}: {controller:?}").into()),
        }
    }
    Err("layout did not converge in 1000 steps".into())
}

fn stats(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let median = samples[samples.len() / 2];
    let p90 = samples[samples.len() * 9 / 10];
    format!(
        "median {median:?}, p90 {p90:?}, min {:?}, max {:?}",
        samples[0],
        samples[samples.len() - 1]
    )
}

fn bench(name: &str, gpus: &[u32]) -> Result<(), Box<dyn std::error::Error>> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/h100-8x.yaml");
    // Past the fixture's traces: GPU 0 runs a process for its first 600 s, which would keep
    // its MIG mode change pending.
    let clock = ManualSimClock::new();
    clock.set(3600.0);
    let backend = SimBackend::from_file(&fixture, Arc::new(clock))?;
    let layouts = [
        ("MIG off → 7 × 1g.10gb", layout(gpus, "1g.10gb", 7)),
        ("7 × 1g.10gb → 2 × 3g.40gb", layout(gpus, "3g.40gb", 2)),
        ("2 × 3g.40gb → 7 × 1g.10gb", layout(gpus, "1g.10gb", 7)),
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); layouts.len()];
    let mut op_counts = vec![0; layouts.len()];
    let mut controller = MigController::new(Duration::from_secs(300));
    let mut generation = 0;
    for _ in 0..ROUNDS {
        // Back to MIG off, untimed.
        let off = NodeMigSpec {
            managed: true,
            gpus: gpus
                .iter()
                .map(|&index| GpuMigSpec {
                    index,
                    enabled: false,
                    profiles: BTreeMap::new(),
                })
                .collect(),
            ..NodeMigSpec::default()
        };
        generation += 1;
        apply(&backend, &mut controller, &off, generation)?;
        for (i, (_, spec)) in layouts.iter().enumerate() {
            generation += 1;
            let start = Instant::now();
            op_counts[i] = apply(&backend, &mut controller, spec, generation)?;
            times[i].push(start.elapsed());
        }
    }
    println!("{name}:");
    for (i, (change, _)) in layouts.iter().enumerate() {
        println!(
            "  {change} ({} operations) → Applied: {}",
            op_counts[i],
            stats(std::mem::take(&mut times[i]))
        );
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    bench("one GPU (GPU 1 of 8 × H100)", &[1])?;
    bench("node of 8 × H100", &[0, 1, 2, 3, 4, 5, 6, 7])?;
    Ok(())
}
