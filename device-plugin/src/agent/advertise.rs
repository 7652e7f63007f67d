//! What the kubelet plugins advertise: devices per resource from the inventory, the MIG
//! strategy and the CDI naming, with the GPUs' interconnect for preferred allocation.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpupool_crds::policy::{
    CdiDeviceNameStrategy, MigStrategy as CrdMigStrategy, SharingPolicy, TimeSlicingPolicy,
};

use crate::backend::{self, GpuBackend, PcieLink};
use crate::inventory::Inventory;
use crate::plugin::sharing;
use crate::plugin::{
    self, Advertisement, CdiNaming, GpuDescription, LinkKind, MigDescription, Topology,
};

/// The CDI device names the kubelet plugins hand out, from the GpuNode's `deviceNameStrategies`:
/// UUID names when they include `uuid` (stable across MIG re-layouts), else index names. GpuNode
/// status reports the same names.
pub fn cdi_naming(strategies: &[CdiDeviceNameStrategy]) -> CdiNaming {
    if strategies.contains(&CdiDeviceNameStrategy::Uuid) {
        CdiNaming::Uuid
    } else {
        CdiNaming::Index
    }
}

/// The plugin's time-slicing from the GpuNode's (resource names that do not parse are left out
/// of the selection: admission allows only valid ones).
fn time_slicing(ts: &TimeSlicingPolicy) -> sharing::TimeSlicing {
    sharing::TimeSlicing {
        replicas: ts.replicas,
        rename_by_default: ts.rename_by_default,
        fail_requests_greater_than_one: ts.fail_requests_greater_than_one,
        gpus: ts.gpus.as_ref().map(|g| g.iter().copied().collect()),
        resources: ts
            .resources
            .as_ref()
            .map(|r| r.iter().filter_map(|n| n.parse().ok()).collect()),
    }
}

/// The devices per resource the kubelet plugins should advertise, time-sliced as `sharing`
/// says.
pub fn advertisement(
    inventory: &Inventory,
    strategy: CrdMigStrategy,
    naming: &[CdiDeviceNameStrategy],
    sharing: &SharingPolicy,
    topology: Arc<Topology>,
) -> Advertisement {
    let gpus: Vec<GpuDescription> = inventory
        .gpus
        .iter()
        .map(|g| GpuDescription {
            index: g.device.index,
            uuid: g.device.uuid.to_string(),
            numa_node: g.numa_node.map(i64::from),
            mig_enabled: g.mig_enabled(),
            mig_devices: g
                .mig_devices
                .iter()
                .enumerate()
                .map(|(j, m)| MigDescription {
                    index: j as u32,
                    uuid: m.uuid.to_string(),
                    profile: m.profile.to_string(),
                })
                .collect(),
        })
        .collect();
    let strategy = match strategy {
        CrdMigStrategy::None => plugin::MigStrategy::None,
        CrdMigStrategy::Single => plugin::MigStrategy::Single,
        CrdMigStrategy::Mixed => plugin::MigStrategy::Mixed,
    };
    let mut resources = match plugin::resource_sets(&gpus, strategy, cdi_naming(naming)) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "cannot advertise devices for this MIG strategy");
            BTreeMap::new()
        }
    };
    if let Some(ts) = sharing.time_slicing.as_ref().map(time_slicing) {
        match sharing::time_slice(resources.clone(), &ts) {
            Ok(shared) => resources = shared,
            // Only an ID too long for the kubelet gets here: those devices stay whole.
            Err(e) => tracing::warn!(error = %e, "cannot time-slice; advertising whole devices"),
        }
    }
    Advertisement {
        resources,
        topology,
    }
}

fn link_kind(t: backend::Topology) -> LinkKind {
    if t.nvlink {
        return LinkKind::NvLink(1);
    }
    match t.pcie {
        PcieLink::SameBoard | PcieLink::SingleSwitch | PcieLink::MultipleSwitches => {
            LinkKind::SamePcieSwitch
        }
        PcieLink::HostBridge | PcieLink::NumaNode => LinkKind::SameNuma,
        PcieLink::System => LinkKind::Cross,
    }
}

/// The links between every pair of GPUs, as far as the backend can tell.
pub fn read_topology(backend: &dyn GpuBackend) -> Topology {
    let mut t = Topology::new();
    let n = backend.device_count().unwrap_or(0);
    for a in 0..n {
        for b in (a + 1)..n {
            if let Ok(link) = backend.topology(a, b) {
                t.set_link(a, b, link_kind(link));
            }
        }
    }
    t
}

/// (GPU, GPU instance, compute instance) → MIG UUID.
pub type MigIds = BTreeMap<(u32, u32, u32), String>;

/// MIG UUID → parent GPU index.
pub type MigParents = BTreeMap<String, u32>;

/// The MIG devices of `inventory`, indexed both ways: health events name a MIG device by its
/// instance IDs, re-checks need its parent GPU.
pub fn mig_index(inventory: &Inventory) -> (MigIds, MigParents) {
    let mut ids = BTreeMap::new();
    let mut parents = BTreeMap::new();
    for g in &inventory.gpus {
        for m in &g.mig_devices {
            ids.insert(
                (g.device.index, m.gpu_instance.0, m.compute_instance.0),
                m.uuid.to_string(),
            );
            parents.insert(m.uuid.to_string(), g.device.index);
        }
    }
    (ids, parents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_map_to_the_preference_order() {
        let t = |nvlink, pcie| backend::Topology { nvlink, pcie };
        assert_eq!(link_kind(t(true, PcieLink::System)), LinkKind::NvLink(1));
        assert_eq!(
            link_kind(t(false, PcieLink::SingleSwitch)),
            LinkKind::SamePcieSwitch
        );
        assert_eq!(link_kind(t(false, PcieLink::NumaNode)), LinkKind::SameNuma);
        assert_eq!(link_kind(t(false, PcieLink::System)), LinkKind::Cross);
    }

    #[test]
    fn uuid_naming_wins_when_listed() {
        use CdiDeviceNameStrategy::{Index, Uuid};
        assert_eq!(cdi_naming(&[Index, Uuid]), CdiNaming::Uuid);
        assert_eq!(cdi_naming(&[Index]), CdiNaming::Index);
        assert_eq!(cdi_naming(&[]), CdiNaming::Index);
    }
}
