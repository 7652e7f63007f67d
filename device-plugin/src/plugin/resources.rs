//! Which resources the node advertises, by MIG strategy, the way NVIDIA's
//! device plugin names them:
//!
//! * `none`: every GPU as `nvidia.com/gpu` (MIG-enabled GPUs too, as whole GPUs);
//! * `single`: every GPU has MIG on with one profile; each MIG device is an `nvidia.com/gpu`;
//! * `mixed`: `nvidia.com/mig-<profile>` per profile, `nvidia.com/gpu` for GPUs with MIG off.
//!
//! Device IDs are UUIDs (MIG UUIDs for MIG devices). Pure: inventory in, resource map out.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use super::model::{AdvertisedDevice, DeviceId, Health, ModelError, ResourceName};

/// How MIG devices are exposed as resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MigStrategy {
    /// Whole GPUs only.
    #[default]
    None,
    /// All GPUs share one MIG profile; MIG devices are `nvidia.com/gpu`.
    Single,
    /// One resource per MIG profile plus `nvidia.com/gpu` for non-MIG GPUs.
    Mixed,
}

impl FromStr for MigStrategy {
    type Err = ResourceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Self::None),
            "single" => Ok(Self::Single),
            "mixed" => Ok(Self::Mixed),
            other => Err(ResourceError::UnknownStrategy(other.to_owned())),
        }
    }
}

impl fmt::Display for MigStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Single => "single",
            Self::Mixed => "mixed",
        })
    }
}

/// Which CDI device name each advertised device maps to (both forms are in our CDI spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CdiNaming {
    /// `GPU-<uuid>` / `MIG-<uuid>`: stable across MIG re-layouts and index changes.
    #[default]
    Uuid,
    /// `<gpu>` / `<gpu>:<mig>` as `nvidia-ctk cdi generate` numbers them.
    Index,
}

impl CdiNaming {
    /// The CDI device name (unqualified) of a whole GPU: what `Allocate` hands out for it.
    pub fn gpu_device_name(self, gpu_index: u32, gpu_uuid: &str) -> String {
        match self {
            CdiNaming::Uuid => gpu_uuid.to_owned(),
            CdiNaming::Index => gpu_index.to_string(),
        }
    }

    /// The CDI device name (unqualified) of MIG device `mig_index` (its position on the GPU):
    /// what `Allocate` hands out for it, and what GpuNode status reports.
    pub fn mig_device_name(self, gpu_index: u32, mig_index: u32, mig_uuid: &str) -> String {
        match self {
            CdiNaming::Uuid => mig_uuid.to_owned(),
            CdiNaming::Index => format!("{gpu_index}:{mig_index}"),
        }
    }
}

/// A GPU as the inventory describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDescription {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// NUMA node, when known.
    pub numa_node: Option<i64>,
    /// MIG mode is enabled.
    pub mig_enabled: bool,
    /// The GPU's MIG devices (empty when MIG is off).
    pub mig_devices: Vec<MigDescription>,
}

/// A MIG device on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDescription {
    /// MIG device index on its parent (the `j` in CDI name `i:j`).
    pub index: u32,
    /// `MIG-…` UUID.
    pub uuid: String,
    /// Profile name, e.g. `1g.10gb` or `1g.10gb+me`.
    pub profile: String,
}

/// Why a resource set could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// Not one of `none`, `single`, `mixed`.
    #[error("unknown MIG strategy {0:?} (expected none, single or mixed)")]
    UnknownStrategy(String),
    /// `single` needs every GPU in the same MIG mode.
    #[error(
        "MIG strategy single: all GPUs must have the same MIG mode (MIG off on GPU {off}, on on GPU {on})"
    )]
    MixedMigModes {
        /// A GPU with MIG off.
        off: u32,
        /// A GPU with MIG on.
        on: u32,
    },
    /// `single` with a MIG-enabled GPU that has no MIG devices.
    #[error("MIG strategy single: GPU {0} has MIG enabled but no MIG devices")]
    NoMigDevices(u32),
    /// `single` with more than one profile on the node.
    #[error("MIG strategy single: all MIG devices must have one profile, found {0:?}")]
    MultipleProfiles(Vec<String>),
    /// A UUID or derived name that the kubelet would reject.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// The resource every whole GPU (and, under `single`, every MIG device) is advertised as.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// `nvidia.com/mig-<profile>`, with `+` (profile attributes such as `+me`) turned into `.`.
pub fn mig_resource_name(profile: &str) -> Result<ResourceName, ModelError> {
    format!("nvidia.com/mig-{}", profile.replace('+', ".")).parse()
}

/// Computes the advertised devices per resource. Every device starts `Healthy`;
/// the health monitor overlays faults.
pub fn resource_sets(
    gpus: &[GpuDescription],
    strategy: MigStrategy,
    naming: CdiNaming,
) -> Result<BTreeMap<ResourceName, Vec<AdvertisedDevice>>, ResourceError> {
    let gpu_resource: ResourceName = GPU_RESOURCE.parse()?;
    let mut out: BTreeMap<ResourceName, Vec<AdvertisedDevice>> = BTreeMap::new();
    match strategy {
        MigStrategy::None => {
            for gpu in gpus {
                out.entry(gpu_resource.clone())
                    .or_default()
                    .push(whole_gpu(gpu, naming)?);
            }
        }
        MigStrategy::Single => {
            let on = gpus.iter().find(|g| g.mig_enabled);
            let off = gpus.iter().find(|g| !g.mig_enabled);
            match (on, off) {
                // No GPU has MIG on: like NVIDIA's plugin, fall back to whole GPUs.
                (None, _) => return resource_sets(gpus, MigStrategy::None, naming),
                (Some(on), Some(off)) => {
                    return Err(ResourceError::MixedMigModes {
                        off: off.index,
                        on: on.index,
                    });
                }
                (Some(_), None) => {}
            }
            if let Some(empty) = gpus.iter().find(|g| g.mig_devices.is_empty()) {
                return Err(ResourceError::NoMigDevices(empty.index));
            }
            let profiles: BTreeSet<&str> = gpus
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(|m| m.profile.as_str()))
                .collect();
            if profiles.len() > 1 {
                return Err(ResourceError::MultipleProfiles(
                    profiles.into_iter().map(str::to_owned).collect(),
                ));
            }
            for gpu in gpus {
                for mig in &gpu.mig_devices {
                    out.entry(gpu_resource.clone())
                        .or_default()
                        .push(mig_device(gpu, mig, naming)?);
                }
            }
        }
        MigStrategy::Mixed => {
            for gpu in gpus {
                if !gpu.mig_enabled {
                    out.entry(gpu_resource.clone())
                        .or_default()
                        .push(whole_gpu(gpu, naming)?);
                    continue;
                }
                if gpu.mig_devices.is_empty() {
                    tracing::warn!(
                        gpu = gpu.index,
                        "MIG enabled but no MIG devices; GPU not advertised"
                    );
                }
                for mig in &gpu.mig_devices {
                    out.entry(mig_resource_name(&mig.profile)?)
                        .or_default()
                        .push(mig_device(gpu, mig, naming)?);
                }
            }
        }
    }
    Ok(out)
}

fn whole_gpu(gpu: &GpuDescription, naming: CdiNaming) -> Result<AdvertisedDevice, ResourceError> {
    Ok(AdvertisedDevice {
        id: gpu.uuid.parse::<DeviceId>()?,
        cdi_name: naming.gpu_device_name(gpu.index, &gpu.uuid),
        health: Health::Healthy,
        numa_node: gpu.numa_node,
        parent_gpu: gpu.index,
        replica: None,
    })
}

fn mig_device(
    gpu: &GpuDescription,
    mig: &MigDescription,
    naming: CdiNaming,
) -> Result<AdvertisedDevice, ResourceError> {
    Ok(AdvertisedDevice {
        id: mig.uuid.parse::<DeviceId>()?,
        cdi_name: naming.mig_device_name(gpu.index, mig.index, &mig.uuid),
        health: Health::Healthy,
        numa_node: gpu.numa_node,
        parent_gpu: gpu.index,
        replica: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, migs: &[&str]) -> GpuDescription {
        GpuDescription {
            index,
            uuid: format!("GPU-{index}"),
            numa_node: Some(i64::from(index / 2)),
            mig_enabled: !migs.is_empty(),
            mig_devices: migs
                .iter()
                .enumerate()
                .map(|(j, p)| MigDescription {
                    index: j as u32,
                    uuid: format!("MIG-{index}-{j}"),
                    profile: (*p).to_owned(),
                })
                .collect(),
        }
    }

    fn gpu_mig_on_empty(index: u32) -> GpuDescription {
        GpuDescription {
            mig_enabled: true,
            ..gpu(index, &[])
        }
    }

    /// Resource name → (device ID, CDI name) pairs.
    type Expected = Vec<(&'static str, Vec<(&'static str, &'static str)>)>;

    fn summary(
        map: &BTreeMap<ResourceName, Vec<AdvertisedDevice>>,
    ) -> Vec<(String, Vec<(String, String)>)> {
        map.iter()
            .map(|(r, devs)| {
                (
                    r.to_string(),
                    devs.iter()
                        .map(|d| (d.id.to_string(), d.cdi_name.clone()))
                        .collect(),
                )
            })
            .collect()
    }

    fn owned(e: Expected) -> Vec<(String, Vec<(String, String)>)> {
        e.into_iter()
            .map(|(r, d)| {
                (
                    r.to_owned(),
                    d.into_iter()
                        .map(|(a, b)| (a.to_owned(), b.to_owned()))
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn resource_sets_by_strategy() {
        let cases: Vec<(&str, Vec<GpuDescription>, MigStrategy, CdiNaming, Expected)> = vec![
            (
                "none: whole GPUs by UUID",
                vec![gpu(0, &[]), gpu(1, &[])],
                MigStrategy::None,
                CdiNaming::Uuid,
                vec![(
                    "nvidia.com/gpu",
                    vec![("GPU-0", "GPU-0"), ("GPU-1", "GPU-1")],
                )],
            ),
            (
                "none: MIG-enabled GPUs still advertised whole, index names",
                vec![gpu(0, &["1g.10gb"]), gpu(1, &[])],
                MigStrategy::None,
                CdiNaming::Index,
                vec![("nvidia.com/gpu", vec![("GPU-0", "0"), ("GPU-1", "1")])],
            ),
            (
                "single: MIG devices as nvidia.com/gpu",
                vec![gpu(0, &["1g.10gb", "1g.10gb"]), gpu(1, &["1g.10gb"])],
                MigStrategy::Single,
                CdiNaming::Index,
                vec![(
                    "nvidia.com/gpu",
                    vec![("MIG-0-0", "0:0"), ("MIG-0-1", "0:1"), ("MIG-1-0", "1:0")],
                )],
            ),
            (
                "single without any MIG GPU falls back to none",
                vec![gpu(0, &[])],
                MigStrategy::Single,
                CdiNaming::Uuid,
                vec![("nvidia.com/gpu", vec![("GPU-0", "GPU-0")])],
            ),
            (
                "mixed: per-profile resources plus whole GPUs with MIG off",
                vec![
                    gpu(0, &["1g.10gb", "3g.40gb", "1g.10gb+me"]),
                    gpu(1, &[]),
                    gpu_mig_on_empty(2),
                ],
                MigStrategy::Mixed,
                CdiNaming::Uuid,
                vec![
                    ("nvidia.com/gpu", vec![("GPU-1", "GPU-1")]),
                    ("nvidia.com/mig-1g.10gb", vec![("MIG-0-0", "MIG-0-0")]),
                    ("nvidia.com/mig-1g.10gb.me", vec![("MIG-0-2", "MIG-0-2")]),
                    ("nvidia.com/mig-3g.40gb", vec![("MIG-0-1", "MIG-0-1")]),
                ],
            ),
            (
                "mixed: all GPUs MIG, no nvidia.com/gpu",
                vec![gpu(0, &["7g.80gb"])],
                MigStrategy::Mixed,
                CdiNaming::Index,
                vec![("nvidia.com/mig-7g.80gb", vec![("MIG-0-0", "0:0")])],
            ),
            (
                "no GPUs: nothing",
                vec![],
                MigStrategy::Mixed,
                CdiNaming::Uuid,
                vec![],
            ),
        ];
        for (name, gpus, strategy, naming, expected) in cases {
            let got =
                resource_sets(&gpus, strategy, naming).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(summary(&got), owned(expected), "{name}");
        }
    }

    #[test]
    fn single_strategy_errors() {
        let cases: Vec<(&str, Vec<GpuDescription>, ResourceError)> = vec![
            (
                "mixed MIG modes",
                vec![gpu(0, &["1g.10gb"]), gpu(1, &[])],
                ResourceError::MixedMigModes { off: 1, on: 0 },
            ),
            (
                "MIG on without devices",
                vec![gpu(0, &["1g.10gb"]), gpu_mig_on_empty(1)],
                ResourceError::NoMigDevices(1),
            ),
            (
                "two profiles",
                vec![gpu(0, &["1g.10gb"]), gpu(1, &["2g.20gb"])],
                ResourceError::MultipleProfiles(vec!["1g.10gb".into(), "2g.20gb".into()]),
            ),
        ];
        for (name, gpus, expected) in cases {
            assert_eq!(
                resource_sets(&gpus, MigStrategy::Single, CdiNaming::Uuid),
                Err(expected),
                "{name}"
            );
        }
    }

    #[test]
    fn mig_devices_inherit_parent_numa_and_index() {
        let got =
            resource_sets(&[gpu(3, &["1g.10gb"])], MigStrategy::Mixed, CdiNaming::Uuid).unwrap();
        let dev = &got[&"nvidia.com/mig-1g.10gb".parse::<ResourceName>().unwrap()][0];
        assert_eq!((dev.parent_gpu, dev.numa_node), (3, Some(1)));
    }

    #[test]
    fn strategy_parses() {
        assert_eq!("mixed".parse::<MigStrategy>().unwrap(), MigStrategy::Mixed);
        assert!("Mixed".parse::<MigStrategy>().is_err());
    }
}
