//! The figures the agent's `/metrics` shows, from what its jobs last saw.

use std::collections::BTreeMap;

use crate::inventory::Inventory;
use crate::metrics_http::{Figures, GpuFigures};
use crate::plugin;
use crate::utilization::DeviceSample;

/// What the agent's jobs last saw that `/metrics` shows.
pub struct FigureInputs<'a> {
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
}

/// The figures for `inputs`.
pub fn figures(inputs: FigureInputs<'_>) -> Figures {
    let mut figures = Figures {
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
            figures.gpus.insert(
                g.device.index,
                GpuFigures {
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
        });
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
