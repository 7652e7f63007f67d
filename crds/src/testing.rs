//! Fixtures for tests of code that reads GpuNode status (the operator's unit tests and scale
//! bench, the e2e tests), so they agree on what a healthy node looks like. Behind the
//! `testing` feature: only dev-dependencies enable it.

use k8s_openapi::jiff::Timestamp;

use crate::conditions::{Observed, condition};
use crate::node::{
    Activity, CDI_SPEC_READY, CdiStatus, CheckName, CheckResult, FOREIGN_DEVICE_PLUGIN, GpuNode,
    GpuNodeStatus, GpuStatus, Health, Idleness, MigDeviceStatus, MigState, NodeMigStatus, PodRef,
    Verdict,
};

/// The status a node agent reports for `gn` when all is well: 8 healthy GPUs, driver
/// 550.54.15 with CUDA 12.4, validated, a CDI spec written, MIG `Applied` when the spec
/// manages it (else `Idle`), the GpuNode's generation observed, and a heartbeat stamped now,
/// as every agent stamps its writes. Tests edit the result to make the node unwell.
pub fn healthy_status(gn: &GpuNode) -> GpuNodeStatus {
    let generation = gn.metadata.generation;
    GpuNodeStatus {
        observed_generation: generation,
        heartbeat_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::now(),
        )),
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

/// What an agent reports for `gn` on a busy 8 × H100 node split into seven `1g.10gb` MIG
/// devices per GPU: [`healthy_status`] with every GPU and MIG device listed (UUIDs, CDI names,
/// PCI bus IDs), the driver checks, the conditions an agent sets on a node that is well
/// (PodResources answering, the CDI spec current, no other device plugin), and `pods`
/// (namespace, name) placed one per MIG device in order, busy. The scale bench reports it for every node.
pub fn mig_node_status(gn: &GpuNode, pods: &[(String, String)]) -> GpuNodeStatus {
    let node = gn.metadata.name.clone().unwrap_or_default();
    let mut holders = pods.iter();
    let mut status = healthy_status(gn);
    status.checks = [
        (
            CheckName::NvmlInit,
            "NVML 12.550.54.15 initialised".to_string(),
        ),
        (
            CheckName::DriverVersion,
            "driver 550.54.15 meets minimum 535.0".to_string(),
        ),
        (
            CheckName::CudaVersion,
            "driver supports CUDA 12.4, pool asks 12.2".to_string(),
        ),
        (
            CheckName::DeviceNodes,
            "/dev/nvidiactl, /dev/nvidia-uvm and 8 GPUs present".to_string(),
        ),
        (
            CheckName::XidErrors,
            "no fatal Xid since the agent started".to_string(),
        ),
    ]
    .into_iter()
    .map(|(name, message)| CheckResult {
        name,
        passed: true,
        message,
    })
    .collect();
    let since = Timestamp::from_second(1_796_000_000).unwrap_or(Timestamp::UNIX_EPOCH);
    status.conditions = [
        (
            CDI_SPEC_READY,
            true,
            "SpecCurrent",
            "/var/run/cdi/gpupool-nvidia.yaml is as the agent wrote it and no other spec claims \
             its devices",
        ),
        (
            FOREIGN_DEVICE_PLUGIN,
            false,
            "NoneFound",
            "no other device plugin serves NVIDIA resources on this node",
        ),
        (
            "PodResourcesAvailable",
            true,
            "Listed",
            "the kubelet PodResources API answers",
        ),
    ]
    .into_iter()
    .map(|(type_, ok, reason, message)| {
        condition(
            &[],
            Observed {
                type_,
                status: ok,
                reason,
                message: message.to_owned(),
                observed_generation: gn.metadata.generation,
            },
            since,
        )
    })
    .collect();
    status.cdi = Some(CdiStatus {
        path: "/var/run/cdi/gpupool-nvidia.yaml".into(),
        digest: "sha256:5f0c7a3e9b1d24c8a6e7f90b3d2c1e4a5b6c7d8e9f0a1b2c3d4e5f60718293a4".into(),
        devices: 8 * 8 + 1,
    });
    status.gpus = (0..8u32)
        .map(|index| GpuStatus {
            index,
            uuid: format!("GPU-{node}-4b1e2c3d-{index:04}-a1b2c3d4e5f6"),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81559,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + index * 0x10),
            mig_enabled: true,
            mig_devices: (0..7u32)
                .map(|m| {
                    let held: Vec<PodRef> = holders
                        .next()
                        .map(|(namespace, name)| PodRef {
                            namespace: namespace.as_str().into(),
                            name: name.clone(),
                            container: Some("trainer".into()),
                        })
                        .into_iter()
                        .collect();
                    MigDeviceStatus {
                        uuid: format!("MIG-{node}-9c8b7a6d-{index:02}{m:02}-5e4f3a2b1c0d"),
                        profile: "1g.10gb".into(),
                        gpu_instance: 7 + m,
                        compute_instance: 0,
                        cdi_name: format!("gpupool.io/gpu={index}:{m}"),
                        health: Health::Healthy,
                        idleness: Idleness {
                            activity: if held.is_empty() {
                                Activity::Idle
                            } else {
                                Activity::Busy
                            },
                            idle_since: None,
                            pods: held,
                        },
                    }
                })
                .collect(),
            ..GpuStatus::default()
        })
        .collect();
    status
}
