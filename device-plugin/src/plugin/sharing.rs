//! Sharing (pure): each shared device is advertised as several replicas, which the kubelet
//! hands to different pods while `Allocate` gives every one of them the same underlying
//! device.
//!
//! Two modes. Time-slicing: nothing isolates the pods from each other; they take turns on the
//! GPU and share its memory, so one pod can run the others out of memory. MPS: the replicas of
//! a GPU are clients of that GPU's MPS server, each capped in device memory and thread share;
//! the [`ShareClient`] of a GPU says what a container needs to reach its server.
//!
//! Replica IDs are `<device ID>::<n>`, as NVIDIA's device plugin names them, so tooling that
//! splits them keeps working. With `rename_by_default`, shared capacity is advertised under
//! `<resource>.shared` (`nvidia.com/gpu.shared`), so quotas and pod specs can tell it apart.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::model::{
    AdvertisedDevice, DeviceId, ModelError, Placement, Replica, ResourceName, ShareClient,
};

/// Separates a replica's number from its device's ID.
pub const REPLICA_SEPARATOR: &str = "::";

/// Most replicas of one device.
pub const MAX_REPLICAS: u32 = 64;

/// One sharing rule, as the agent applies it to what it advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// Replicas per shared device, at least 2.
    pub replicas: u32,
    /// Advertise shared devices under `<resource>.shared`.
    pub rename_by_default: bool,
    /// Refuse containers that ask for more than one replica.
    pub fail_requests_greater_than_one: bool,
    /// Only devices on these GPU indices (`None`: all).
    pub gpus: Option<BTreeSet<u32>>,
    /// Only these resources (`None`: all).
    pub resources: Option<BTreeSet<ResourceName>>,
    /// MPS: the client setup of each GPU whose server is configured; only those GPUs are
    /// shared. Empty for time-slicing.
    pub clients: BTreeMap<u32, Arc<ShareClient>>,
    /// Where a container's replicas go.
    pub placement: Placement,
}

impl Share {
    /// Whether this rule shares through a per-GPU server (MPS) rather than by time-slicing.
    fn per_gpu_server(&self) -> bool {
        !self.clients.is_empty()
    }
}

/// The name shared capacity of `resource` goes under with `rename_by_default`.
pub fn shared_name(resource: &ResourceName) -> Result<ResourceName, ModelError> {
    format!("{}.shared", resource.as_str()).parse()
}

/// `resources` with the devices `rule` selects replaced by their replicas. A renamed resource
/// keeps its unshared devices under the old name. Devices that are already replicas (of an
/// earlier rule) stay as they are.
pub fn share(
    resources: BTreeMap<ResourceName, Vec<AdvertisedDevice>>,
    rule: &Share,
) -> Result<BTreeMap<ResourceName, Vec<AdvertisedDevice>>, ModelError> {
    let mut out: BTreeMap<ResourceName, Vec<AdvertisedDevice>> = BTreeMap::new();
    let replicas = rule.replicas.clamp(2, MAX_REPLICAS);
    for (resource, devices) in resources {
        let selected_resource = rule
            .resources
            .as_ref()
            .is_none_or(|r| r.contains(&resource));
        let shared_resource = if rule.rename_by_default && !resource.as_str().ends_with(".shared") {
            shared_name(&resource)?
        } else {
            resource.clone()
        };
        for device in devices {
            let client = rule.clients.get(&device.parent_gpu).cloned();
            let selected = selected_resource
                && device.replica.is_none()
                && rule
                    .gpus
                    .as_ref()
                    .is_none_or(|g| g.contains(&device.parent_gpu))
                && (client.is_some() || !rule.per_gpu_server());
            if !selected {
                out.entry(resource.clone()).or_default().push(device);
                continue;
            }
            let into = out.entry(shared_resource.clone()).or_default();
            for n in 0..replicas {
                let id: DeviceId = format!("{}{REPLICA_SEPARATOR}{n}", device.id).parse()?;
                into.push(AdvertisedDevice {
                    id,
                    replica: Some(Replica {
                        of: device.id.clone(),
                        fail_requests_greater_than_one: rule.fail_requests_greater_than_one,
                        client: client.clone(),
                        placement: rule.placement,
                    }),
                    ..device.clone()
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::model::Health;

    fn dev(id: &str, gpu: u32) -> AdvertisedDevice {
        AdvertisedDevice {
            id: id.parse().unwrap(),
            cdi_name: gpu.to_string(),
            health: Health::Healthy,
            numa_node: None,
            parent_gpu: gpu,
            replica: None,
        }
    }

    fn resources() -> BTreeMap<ResourceName, Vec<AdvertisedDevice>> {
        BTreeMap::from([
            (
                "nvidia.com/gpu".parse().unwrap(),
                vec![dev("GPU-a", 0), dev("GPU-b", 1)],
            ),
            (
                "nvidia.com/mig-1g.10gb".parse().unwrap(),
                vec![dev("MIG-c", 2)],
            ),
        ])
    }

    fn ts() -> Share {
        Share {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: true,
            gpus: None,
            resources: None,
            clients: BTreeMap::new(),
            placement: Placement::Spread,
        }
    }

    fn ids(r: &BTreeMap<ResourceName, Vec<AdvertisedDevice>>, name: &str) -> Vec<String> {
        r.get(&name.parse::<ResourceName>().unwrap())
            .map(|d| d.iter().map(|d| d.id.to_string()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn every_device_becomes_its_replicas_with_the_same_cdi_device() {
        let out = share(resources(), &ts()).unwrap();
        let gpu = ids(&out, "nvidia.com/gpu");
        assert_eq!(gpu.len(), 8);
        assert_eq!(&gpu[..4], ["GPU-a::0", "GPU-a::1", "GPU-a::2", "GPU-a::3"]);
        assert_eq!(
            ids(&out, "nvidia.com/mig-1g.10gb").len(),
            4,
            "MIG devices too"
        );
        let first = &out[&"nvidia.com/gpu".parse::<ResourceName>().unwrap()][5];
        assert_eq!(first.cdi_name, "1");
        assert_eq!(first.parent_gpu, 1);
        assert_eq!(first.replica.as_ref().unwrap().of.as_str(), "GPU-b");
    }

    #[test]
    fn renamed_and_selected_sharing_leaves_the_rest_under_the_old_name() {
        let out = share(
            resources(),
            &Share {
                rename_by_default: true,
                gpus: Some(BTreeSet::from([1])),
                resources: Some(BTreeSet::from(["nvidia.com/gpu".parse().unwrap()])),
                ..ts()
            },
        )
        .unwrap();
        assert_eq!(ids(&out, "nvidia.com/gpu"), ["GPU-a"]);
        assert_eq!(
            ids(&out, "nvidia.com/gpu.shared"),
            ["GPU-b::0", "GPU-b::1", "GPU-b::2", "GPU-b::3"]
        );
        assert_eq!(ids(&out, "nvidia.com/mig-1g.10gb"), ["MIG-c"]);
    }

    #[test]
    fn replicas_are_bounded() {
        let one = share(
            resources(),
            &Share {
                replicas: 1,
                ..ts()
            },
        )
        .unwrap();
        assert_eq!(ids(&one, "nvidia.com/gpu").len(), 4, "at least 2 each");
        let many = share(
            resources(),
            &Share {
                replicas: 1000,
                ..ts()
            },
        )
        .unwrap();
        assert_eq!(
            ids(&many, "nvidia.com/gpu").len(),
            2 * MAX_REPLICAS as usize
        );
    }

    fn client(pipe: &str) -> Arc<ShareClient> {
        Arc::new(ShareClient {
            envs: BTreeMap::from([("CUDA_MPS_PIPE_DIRECTORY".into(), pipe.into())]),
            mounts: Vec::new(),
        })
    }

    #[test]
    fn mps_shares_only_the_gpus_whose_server_is_set_up_and_carries_their_client() {
        let mps = Share {
            resources: Some(BTreeSet::from(["nvidia.com/gpu".parse().unwrap()])),
            clients: BTreeMap::from([(1, client("/b"))]),
            ..ts()
        };
        let out = share(resources(), &mps).unwrap();
        assert_eq!(
            ids(&out, "nvidia.com/gpu"),
            ["GPU-a", "GPU-b::0", "GPU-b::1", "GPU-b::2", "GPU-b::3"],
            "GPU 0 has no server: it stays whole"
        );
        assert_eq!(ids(&out, "nvidia.com/mig-1g.10gb"), ["MIG-c"]);
        let replica = out[&"nvidia.com/gpu".parse::<ResourceName>().unwrap()][1]
            .replica
            .clone()
            .unwrap();
        assert_eq!(replica.client, Some(client("/b")));
    }

    #[test]
    fn a_second_rule_leaves_the_first_rules_replicas_alone() {
        let first = share(
            resources(),
            &Share {
                replicas: 2,
                gpus: Some(BTreeSet::from([0])),
                rename_by_default: true,
                ..ts()
            },
        )
        .unwrap();
        let both = share(
            first,
            &Share {
                replicas: 3,
                rename_by_default: true,
                clients: BTreeMap::from([(0, client("/a")), (1, client("/b"))]),
                resources: Some(BTreeSet::from(["nvidia.com/gpu".parse().unwrap()])),
                ..ts()
            },
        )
        .unwrap();
        assert_eq!(
            ids(&both, "nvidia.com/gpu.shared"),
            ["GPU-b::0", "GPU-b::1", "GPU-b::2", "GPU-a::0", "GPU-a::1"],
            "GPU 0 keeps its two time-slicing replicas, GPU 1 gets three MPS ones"
        );
        assert!(ids(&both, "nvidia.com/gpu").is_empty());
    }
}

#[cfg(test)]
mod health_tests {
    use super::*;
    use crate::plugin::health::{
        HealthEvent, HealthEventKind, HealthPolicy, HealthTarget, HealthTracker,
    };
    use crate::plugin::model::{Advertisement, Health};
    use std::time::Instant;

    /// A fault on a GPU, or on a MIG device, takes every replica of it down, and only those.
    #[test]
    fn a_fault_takes_down_every_replica_of_its_device() {
        let dev = |id: &str, gpu: u32| AdvertisedDevice {
            id: id.parse().unwrap(),
            cdi_name: gpu.to_string(),
            health: Health::Healthy,
            numa_node: None,
            parent_gpu: gpu,
            replica: None,
        };
        let resources = BTreeMap::from([
            (
                "nvidia.com/gpu".parse().unwrap(),
                vec![dev("GPU-a", 0), dev("GPU-b", 1)],
            ),
            (
                "nvidia.com/mig-1g.10gb".parse().unwrap(),
                vec![dev("MIG-c", 2), dev("MIG-d", 2)],
            ),
        ]);
        let shared = share(
            resources,
            &Share {
                replicas: 3,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                gpus: None,
                resources: None,
                clients: BTreeMap::new(),
                placement: Placement::Spread,
            },
        )
        .unwrap();
        let base = Advertisement {
            resources: shared,
            topology: Default::default(),
        };
        let mut tracker = HealthTracker::new(HealthPolicy::default());
        let now = Instant::now();
        for target in [
            HealthTarget::Gpu(0),
            HealthTarget::Device("MIG-c".parse().unwrap()),
        ] {
            tracker.on_event(
                &HealthEvent {
                    target,
                    kind: HealthEventKind::DoubleBitEcc,
                },
                now,
            );
        }
        let out = tracker.overlay(&base);
        let unhealthy: Vec<String> = out
            .resources
            .values()
            .flatten()
            .filter(|d| !d.health.is_healthy())
            .map(|d| d.id.to_string())
            .collect();
        assert_eq!(
            unhealthy,
            [
                "GPU-a::0", "GPU-a::1", "GPU-a::2", "MIG-c::0", "MIG-c::1", "MIG-c::2"
            ]
        );
    }
}
