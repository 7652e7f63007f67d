//! Time-slicing (pure): each shared device is advertised as several replicas, which the
//! kubelet hands to different pods while `Allocate` gives every one of them the same underlying
//! device. Nothing isolates the pods from each other: they take turns on the GPU and share its
//! memory, so one pod can run the others out of memory.
//!
//! Replica IDs are `<device ID>::<n>`, as NVIDIA's device plugin names them, so tooling that
//! splits them keeps working. With `rename_by_default`, shared capacity is advertised under
//! `<resource>.shared` (`nvidia.com/gpu.shared`), so quotas and pod specs can tell it apart.

use std::collections::{BTreeMap, BTreeSet};

use super::model::{AdvertisedDevice, DeviceId, ModelError, Replica, ResourceName};

/// Separates a replica's number from its device's ID.
pub const REPLICA_SEPARATOR: &str = "::";

/// Most replicas of one device.
pub const MAX_REPLICAS: u32 = 64;

/// The node's time-slicing, as the agent applies it to what it advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimeSlicing {
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
}

/// The name shared capacity of `resource` goes under with `rename_by_default`.
pub fn shared_name(resource: &ResourceName) -> Result<ResourceName, ModelError> {
    format!("{}.shared", resource.as_str()).parse()
}

/// `resources` with the devices `ts` selects replaced by their replicas. A renamed resource
/// keeps its unshared devices under the old name.
pub fn time_slice(
    resources: BTreeMap<ResourceName, Vec<AdvertisedDevice>>,
    ts: &TimeSlicing,
) -> Result<BTreeMap<ResourceName, Vec<AdvertisedDevice>>, ModelError> {
    let mut out: BTreeMap<ResourceName, Vec<AdvertisedDevice>> = BTreeMap::new();
    let replicas = ts.replicas.clamp(2, MAX_REPLICAS);
    for (resource, devices) in resources {
        let selected_resource = ts.resources.as_ref().is_none_or(|r| r.contains(&resource));
        let shared_resource = if ts.rename_by_default {
            shared_name(&resource)?
        } else {
            resource.clone()
        };
        for device in devices {
            let selected = selected_resource
                && ts
                    .gpus
                    .as_ref()
                    .is_none_or(|g| g.contains(&device.parent_gpu));
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
                        fail_requests_greater_than_one: ts.fail_requests_greater_than_one,
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

    fn ts() -> TimeSlicing {
        TimeSlicing {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: true,
            gpus: None,
            resources: None,
        }
    }

    fn ids(r: &BTreeMap<ResourceName, Vec<AdvertisedDevice>>, name: &str) -> Vec<String> {
        r.get(&name.parse::<ResourceName>().unwrap())
            .map(|d| d.iter().map(|d| d.id.to_string()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn every_device_becomes_its_replicas_with_the_same_cdi_device() {
        let out = time_slice(resources(), &ts()).unwrap();
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
        let out = time_slice(
            resources(),
            &TimeSlicing {
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
        let one = time_slice(
            resources(),
            &TimeSlicing {
                replicas: 1,
                ..ts()
            },
        )
        .unwrap();
        assert_eq!(ids(&one, "nvidia.com/gpu").len(), 4, "at least 2 each");
        let many = time_slice(
            resources(),
            &TimeSlicing {
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
        let shared = time_slice(
            resources,
            &TimeSlicing {
                replicas: 3,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                gpus: None,
                resources: None,
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
