//! The figures the agent's `/metrics` shows, from what its jobs last saw.

use std::collections::BTreeMap;
use std::time::Instant;

use gpupool_crds::node::Activity;

use crate::inventory::Inventory;
use crate::metrics_http::{Figures, GpuFigures, MigFigures};
use crate::plugin;
use crate::utilization::DeviceSample;

/// What the agent's jobs last saw that `/metrics` shows.
pub struct FigureInputs<'a> {
    /// The node the agent runs on.
    pub node: &'a str,
    /// The GPUs, or why they could not be read.
    pub inventory: Option<&'a Result<Inventory, String>>,
    /// Health per advertised device.
    pub health: &'a BTreeMap<String, plugin::Health>,
    /// The last sample per device UUID.
    pub samples: &'a BTreeMap<String, DeviceSample>,
    /// Xids seen through NVML, by (GPU, Xid).
    pub xids: &'a BTreeMap<(u32, u64), u64>,
    /// Every driver check passed.
    pub validated: bool,
    /// GpuNode status writes so far.
    pub status_writes: u64,
    /// CDI spec writes so far.
    pub cdi_writes: u64,
    /// Whether the spec the runtime reads is the agent's and resolvable; `None` with CDI off.
    pub cdi_spec_ready: Option<bool>,
    /// Other device plugins' live sockets for NVIDIA resources; `None` before the first scan.
    pub foreign_device_plugins: Option<u32>,
    /// When a utilization sample last returned figures.
    pub last_sample: Option<Instant>,
    /// When the GpuNode status was last written.
    pub last_status_write: Option<Instant>,
}

/// The figures for `inputs`.
pub fn figures(inputs: FigureInputs<'_>) -> Figures {
    let mut figures = Figures {
        node: inputs.node.to_owned(),
        last_sample: inputs.last_sample,
        last_status_write: inputs.last_status_write,
        xids: inputs.xids.clone(),
        validated: inputs.validated,
        status_writes: inputs.status_writes,
        cdi_writes: inputs.cdi_writes,
        cdi_spec_ready: inputs.cdi_spec_ready,
        foreign_device_plugins: inputs.foreign_device_plugins,
        ..Figures::default()
    };
    if let Some(Ok(inv)) = inputs.inventory {
        for g in &inv.gpus {
            let uuid = g.device.uuid.to_string();
            let s = inputs.samples.get(&uuid);
            let unhealthy = |uuid: &str| {
                matches!(
                    inputs.health.get(uuid),
                    Some(plugin::Health::Unhealthy { .. })
                )
            };
            for m in &g.mig_devices {
                let mig_uuid = m.uuid.to_string();
                let sample = inputs.samples.get(&mig_uuid);
                figures.mig_devices.insert(
                    mig_uuid.clone(),
                    MigFigures {
                        gpu: g.device.index,
                        profile: m.profile.to_string(),
                        // A fault of the parent GPU takes its MIG devices down too.
                        healthy: !unhealthy(&mig_uuid) && !unhealthy(&uuid) && g.health.is_ok(),
                        memory_used_mib: sample.and_then(|s| s.memory_used_mib),
                        idle: sample.and_then(|s| match s.activity {
                            Activity::Idle => Some(true),
                            Activity::Busy => Some(false),
                            Activity::Unknown => None,
                        }),
                    },
                );
            }
            figures.gpus.insert(
                g.device.index,
                GpuFigures {
                    uuid: uuid.clone(),
                    model: g.device.name.clone(),
                    utilization_percent: s.and_then(|s| s.utilization_percent),
                    memory_used_mib: s.and_then(|s| s.memory_used_mib),
                    healthy: !matches!(
                        inputs.health.get(&uuid),
                        Some(plugin::Health::Unhealthy { .. })
                    ) && g.health.is_ok(),
                    temperature_c: g.health.as_ref().ok().and_then(|h| h.temperature_c),
                },
            );
        }
    }
    figures
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unhealthy_device_shows_as_unhealthy_and_samples_carry_over() {
        let inv = Ok(crate::agent::testing::inventory());
        let Ok(i) = &inv else { unreachable!() };
        let a30 = i.gpus[0].device.uuid.to_string();
        let a30_uuid = a30.clone();
        let l4 = i.gpus[1].device.uuid.to_string();
        let health = [(
            l4.clone(),
            plugin::Health::Unhealthy {
                reason: "Xid 79".into(),
            },
        )]
        .into_iter()
        .collect();
        let samples = [(
            a30,
            DeviceSample {
                utilization_percent: Some(42),
                memory_used_mib: Some(1024),
                ..DeviceSample::default()
            },
        )]
        .into_iter()
        .collect();
        let xids = [((1, 79), 1)].into_iter().collect();
        let f = figures(FigureInputs {
            inventory: Some(&inv),
            health: &health,
            samples: &samples,
            xids: &xids,
            validated: true,
            status_writes: 3,
            cdi_writes: 1,
            cdi_spec_ready: Some(false),
            foreign_device_plugins: Some(1),
            last_sample: None,
            last_status_write: None,
            node: "node-a",
        });
        assert_eq!(f.node, "node-a");
        assert_eq!(f.gpus[&0].uuid, a30_uuid);
        assert!(!f.gpus[&1].model.is_empty());
        assert!(f.gpus[&0].healthy);
        assert!(!f.gpus[&1].healthy);
        assert_eq!(f.gpus[&0].utilization_percent, Some(42));
        assert_eq!(f.gpus[&0].memory_used_mib, Some(1024));
        assert_eq!(f.gpus[&1].utilization_percent, None);
        assert_eq!((f.validated, f.status_writes, f.cdi_writes), (true, 3, 1));
        assert_eq!(f.cdi_spec_ready, Some(false));
        assert_eq!(f.foreign_device_plugins, Some(1));
        assert_eq!(f.xids[&(1, 79)], 1);
    }
}

#[cfg(test)]
mod mig_tests {
    use super::*;
    use crate::backend::{ComputeInstanceId, GpuInstanceId, MigDevice};

    /// MIG devices get their own series: the parent's index, the profile, their own health and
    /// sample, and a fault of the parent GPU takes them down too.
    #[test]
    fn mig_devices_carry_parent_profile_health_and_idleness() {
        let mut inv = crate::agent::testing::inventory();
        let parent = inv.gpus[0].device.uuid.clone();
        let mig = |n: u32| MigDevice {
            uuid: format!("MIG-11111111-2222-3333-4444-55555555555{n}")
                .parse()
                .unwrap(),
            gpu: 0,
            parent: parent.clone(),
            gpu_instance: GpuInstanceId(n),
            compute_instance: ComputeInstanceId(0),
            profile: "1g.6gb".parse().unwrap(),
            memory_mib: 5952,
        };
        inv.gpus[0].mig_devices = vec![mig(1), mig(2)];
        let (a, b) = (
            inv.gpus[0].mig_devices[0].uuid.to_string(),
            inv.gpus[0].mig_devices[1].uuid.to_string(),
        );
        let samples = [(
            a.clone(),
            DeviceSample {
                activity: Activity::Idle,
                memory_used_mib: Some(7),
                ..DeviceSample::default()
            },
        )]
        .into_iter()
        .collect();
        let health = [(
            b.clone(),
            plugin::Health::Unhealthy {
                reason: "Xid 48".into(),
            },
        )]
        .into_iter()
        .collect();
        let no_xids = BTreeMap::new();
        let inputs = |health, inv| FigureInputs {
            node: "n",
            inventory: Some(inv),
            health,
            samples: &samples,
            xids: &no_xids,
            validated: true,
            status_writes: 0,
            cdi_writes: 0,
            cdi_spec_ready: None,
            foreign_device_plugins: None,
            last_sample: None,
            last_status_write: None,
        };
        let inv = Ok(inv);
        let f = figures(inputs(&health, &inv));
        assert_eq!(f.mig_devices.len(), 2);
        let m = &f.mig_devices[&a];
        assert_eq!((m.gpu, m.profile.as_str(), m.healthy), (0, "1g.6gb", true));
        assert_eq!((m.idle, m.memory_used_mib), (Some(true), Some(7)));
        assert!(!f.mig_devices[&b].healthy);
        assert_eq!(f.mig_devices[&b].idle, None);

        // The parent GPU faulted: every MIG device on it is down.
        let parent_down = [(
            parent.to_string(),
            plugin::Health::Unhealthy {
                reason: "Xid 79".into(),
            },
        )]
        .into_iter()
        .collect();
        let f = figures(inputs(&parent_down, &inv));
        assert!(f.mig_devices.values().all(|m| !m.healthy));
    }
}
