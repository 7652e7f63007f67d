//! Fixtures for tests of code that reads GpuNode status (the operator's unit tests and scale
//! bench, the e2e tests), so they agree on what a healthy node looks like. Behind the
//! `testing` feature: only dev-dependencies enable it.

use crate::node::{CdiStatus, GpuNode, GpuNodeStatus, MigState, NodeMigStatus, Verdict};

/// The status a node agent reports for `gn` when all is well: 8 healthy GPUs, driver
/// 550.54.15 with CUDA 12.4, validated, a CDI spec written, MIG `Applied` when the spec
/// manages it (else `Idle`), and the GpuNode's generation observed. Tests edit the result to
/// make the node unwell.
pub fn healthy_status(gn: &GpuNode) -> GpuNodeStatus {
    let generation = gn.metadata.generation;
    GpuNodeStatus {
        observed_generation: generation,
        driver_version: Some("550.54.15".into()),
        cuda_version: Some("12.4".into()),
        gpu_count: 8,
        healthy_gpus: 8,
        validated: Some(Verdict::True),
        cdi: Some(CdiStatus {
            path: "/var/run/cdi/gpupool-nvidia.yaml".into(),
            digest: "sha256:healthy".into(),
            devices: 8,
        }),
        mig: NodeMigStatus {
            state: if gn.spec.mig.managed {
                MigState::Applied
            } else {
                MigState::Idle
            },
            observed_generation: generation,
            ..Default::default()
        },
        ..Default::default()
    }
}
