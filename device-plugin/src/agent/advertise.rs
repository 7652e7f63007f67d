//! What the kubelet plugins advertise: devices per resource from the inventory, the MIG
//! strategy and the CDI naming, with the GPUs' interconnect for preferred allocation.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpupool_crds::policy::{
    CdiDeviceNameStrategy, MigStrategy as CrdMigStrategy, MpsPolicy, SharePlacement, SharingPolicy,
    TimeSlicingPolicy,
};

use crate::backend::{self, GpuBackend, PcieLink};
use crate::inventory::Inventory;
use crate::plugin::model::{Health, Placement, ShareClient};
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

fn placement(p: SharePlacement) -> Placement {
    match p {
        SharePlacement::Spread => Placement::Spread,
        SharePlacement::Pack => Placement::Pack,
    }
}

/// The plugin's time-slicing rule from the GpuNode's (resource names that do not parse are left
/// out of the selection: admission allows only valid ones).
fn time_slicing(ts: &TimeSlicingPolicy) -> sharing::Share {
    sharing::Share {
        replicas: ts.replicas,
        rename_by_default: ts.rename_by_default,
        fail_requests_greater_than_one: ts.fail_requests_greater_than_one,
        gpus: ts.gpus.as_ref().map(|g| g.iter().copied().collect()),
        resources: ts
            .resources
            .as_ref()
            .map(|r| r.iter().filter_map(|n| n.parse().ok()).collect()),
        clients: BTreeMap::new(),
        placement: placement(ts.placement),
    }
}

/// The MPS daemons as the advertisement needs them: each configured GPU's client setup, and
/// why a GPU's daemon is not serving (its replicas are advertised Unhealthy meanwhile).
#[derive(Debug, Clone, Default)]
pub struct MpsView {
    /// Client setup per GPU index.
    pub clients: BTreeMap<u32, Arc<ShareClient>>,
    /// GPU index → why its daemon does not serve.
    pub down: BTreeMap<u32, String>,
}

/// The plugin's MPS rule from the GpuNode's: whole GPUs (`nvidia.com/gpu`) with a daemon.
fn mps_rule(mps: &MpsPolicy, clients: &BTreeMap<u32, Arc<ShareClient>>) -> Option<sharing::Share> {
    if clients.is_empty() {
        return None;
    }
    Some(sharing::Share {
        replicas: mps.replicas,
        rename_by_default: mps.rename_by_default,
        fail_requests_greater_than_one: mps.fail_requests_greater_than_one,
        gpus: None,
        resources: "nvidia.com/gpu".parse().ok().map(|r| [r].into()),
        clients: clients.clone(),
        placement: placement(mps.placement),
    })
}

/// The devices per resource the kubelet plugins should advertise, shared as `sharing` says
/// (MPS only on the GPUs `mps` has daemons for).
pub fn advertisement(
    inventory: &Inventory,
    strategy: CrdMigStrategy,
    naming: &[CdiDeviceNameStrategy],
    sharing: &SharingPolicy,
    mps: &MpsView,
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
    let rules = [
        sharing.time_slicing.as_ref().map(time_slicing),
        sharing.mps.as_ref().and_then(|m| mps_rule(m, &mps.clients)),
    ];
    for rule in rules.iter().flatten() {
        match sharing::share(resources.clone(), rule) {
            Ok(shared) => resources = shared,
            // Only an ID too long for the kubelet gets here: those devices stay whole.
            Err(e) => tracing::warn!(error = %e, "cannot share; advertising whole devices"),
        }
    }
    for device in resources.values_mut().flatten() {
        let served_by_down_daemon = device.replica.as_ref().is_some_and(|r| r.client.is_some());
        if let (true, Some(why)) = (served_by_down_daemon, mps.down.get(&device.parent_gpu)) {
            device.health = Health::Unhealthy {
                reason: why.clone(),
            };
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
    fn mps_replicas_carry_their_client_and_go_down_with_their_daemon() {
        let inv = crate::agent::testing::inventory();
        let sharing = SharingPolicy {
            time_slicing: None,
            mps: Some(MpsPolicy {
                replicas: 3,
                rename_by_default: true,
                fail_requests_greater_than_one: true,
                placement: SharePlacement::Pack,
                memory_limit: None,
                active_thread_percentage: None,
                gpus: None,
                models: None,
            }),
        };
        let client = Arc::new(ShareClient::default());
        let mps = MpsView {
            clients: BTreeMap::from([(1, client.clone())]),
            down: BTreeMap::from([(1, "MPS control daemon starting".to_owned())]),
        };
        let adv = advertisement(
            &inv,
            CrdMigStrategy::None,
            &[],
            &sharing,
            &mps,
            Arc::new(Topology::new()),
        );
        let shared = &adv.resources[&"nvidia.com/gpu.shared".parse().unwrap()];
        assert_eq!(shared.len(), 3, "only GPU 1 has a daemon");
        for d in shared {
            let r = d.replica.as_ref().unwrap();
            assert_eq!(r.client.as_ref(), Some(&client));
            assert_eq!(r.placement, Placement::Pack);
            assert_eq!(
                d.health,
                Health::Unhealthy {
                    reason: "MPS control daemon starting".into()
                }
            );
        }
        let whole = &adv.resources[&"nvidia.com/gpu".parse().unwrap()];
        assert_eq!(whole.len(), 1);
        assert!(whole[0].health.is_healthy());
        let up = MpsView {
            down: BTreeMap::new(),
            ..mps
        };
        let adv = advertisement(
            &inv,
            CrdMigStrategy::None,
            &[],
            &sharing,
            &up,
            Arc::new(Topology::new()),
        );
        assert!(
            adv.resources[&"nvidia.com/gpu.shared".parse().unwrap()]
                .iter()
                .all(|d| d.health.is_healthy())
        );
    }

    #[test]
    fn uuid_naming_wins_when_listed() {
        use CdiDeviceNameStrategy::{Index, Uuid};
        assert_eq!(cdi_naming(&[Index, Uuid]), CdiNaming::Uuid);
        assert_eq!(cdi_naming(&[Index]), CdiNaming::Index);
        assert_eq!(cdi_naming(&[]), CdiNaming::Index);
    }
}
