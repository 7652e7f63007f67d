//! MIG profile catalog: the GPU-instance profiles NVIDIA documents per GPU model, and a
//! layout planner that places a wanted multiset of profiles on one GPU.
//!
//! Pure data and functions, no dependencies: the API types (the profile names CEL accepts), the
//! operator (to resolve a pool's MIG layout for a node), the node agent (to apply it) and the
//! simulator (to behave like the hardware) share this crate, so it stays small enough for
//! every one of them, the fake `libnvidia-ml.so` included, to depend on.
//!
//! Sources of the numbers (checked against each other; where they disagree the hardware
//! capture wins and the row says so):
//! - NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles"
//!   (<https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html>):
//!   profile names, compute/memory fractions and instance counts for A100-40GB, A100-80GB,
//!   A30-24GB, H100-80GB and H200-141GB; and its `nvidia-smi mig -lgip`/`-lgipp` examples
//!   (<https://docs.nvidia.com/datacenter/tesla/mig-user-guide/index.html>) for the A100
//!   profile IDs (19, 20, 15, 14, 9, 5, 0) and placements.
//! - NVML API reference (`nvml.h`, also in NVIDIA/go-nvml `gen/nvml/nvml.h`):
//!   the `NVML_GPU_INSTANCE_PROFILE_*` enum values passed to
//!   `nvmlDeviceGetGpuInstanceProfileInfo`, and the placement struct (`start`/`size` count
//!   memory slices).
//! - `nvidia-smi mig -lgip` / `-lgipp` captures from real H100 80GB and H200 boards published
//!   with NVIDIA's H100 MIG material, and from A30 boards; SM counts and sizes in GiB. The H100
//!   IDs, counts, SMs and sizes (19/20/15/14/9/5/0; 7/1/4/3/2/1/1; 16/16/26/32/60/64/132 SMs;
//!   9.75/9.75/19.62/19.62/39.50/39.50/79.25 GiB) match a published capture at
//!   <https://jbarrow.ai/field_notes/nvidia-mig/>.
//! - NVIDIA/go-nvml `pkg/nvml/mock/gpus/{a100,a30,h200}.go` for memory sizes in MiB where no
//!   hardware capture was available (marked below).
//!
//! Memory sizes are what NVML's `memorySizeMB` reports on recent R5xx drivers (GiB shown by
//! `nvidia-smi` × 1024, rounded). Drivers differ by a few MiB; at runtime NVML is the truth.
//! GPU-instance profile IDs (`info.id`, the `nvidia-smi mig -cgi` argument) are not the NVML
//! enum value; both are recorded.

use std::fmt;

/// NVML `NVML_GPU_INSTANCE_PROFILE_*` enum values (nvml.h).
pub mod nvml_gi_profile {
    /// `NVML_GPU_INSTANCE_PROFILE_1_SLICE`
    pub const SLICE_1: u32 = 0x0;
    /// `NVML_GPU_INSTANCE_PROFILE_2_SLICE`
    pub const SLICE_2: u32 = 0x1;
    /// `NVML_GPU_INSTANCE_PROFILE_3_SLICE`
    pub const SLICE_3: u32 = 0x2;
    /// `NVML_GPU_INSTANCE_PROFILE_4_SLICE`
    pub const SLICE_4: u32 = 0x3;
    /// `NVML_GPU_INSTANCE_PROFILE_7_SLICE`
    pub const SLICE_7: u32 = 0x4;
    /// `NVML_GPU_INSTANCE_PROFILE_8_SLICE`
    pub const SLICE_8: u32 = 0x5;
    /// `NVML_GPU_INSTANCE_PROFILE_6_SLICE`
    pub const SLICE_6: u32 = 0x6;
    /// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1` (the `+me` media-extension variant)
    pub const SLICE_1_REV1: u32 = 0x7;
    /// `NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1` (`2g…+me`)
    pub const SLICE_2_REV1: u32 = 0x8;
    /// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2` (one compute slice, two memory slices)
    pub const SLICE_1_REV2: u32 = 0x9;
    /// One past the highest enum value the agent probes.
    pub const COUNT: u32 = 0x12;
}

/// NVML `NVML_COMPUTE_INSTANCE_PROFILE_*` enum values (nvml.h). On current drivers the
/// compute-instance profile ID reported in `info.id` equals this enum value.
pub mod nvml_ci_profile {
    /// `NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE`
    pub const SLICE_1: u32 = 0x0;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE`
    pub const SLICE_2: u32 = 0x1;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE`
    pub const SLICE_3: u32 = 0x2;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE`
    pub const SLICE_4: u32 = 0x3;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE`
    pub const SLICE_7: u32 = 0x4;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE`
    pub const SLICE_8: u32 = 0x5;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE`
    pub const SLICE_6: u32 = 0x6;
    /// One past the highest enum value the agent probes.
    pub const COUNT: u32 = 0x9;
}

/// One GPU-instance profile of one GPU model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfileSpec {
    /// Profile name as `nvidia-smi` and the Kubernetes resource name print it (`1g.10gb+me`).
    pub name: &'static str,
    /// NVML enum value to pass to `nvmlDeviceGetGpuInstanceProfileInfo`.
    pub nvml_profile: u32,
    /// Profile ID NVML reports in `info.id` (the `nvidia-smi mig -cgi` argument).
    pub profile_id: u32,
    /// Compute (SM) slices, the `Ng` in the name.
    pub compute_slices: u32,
    /// Memory slices the instance occupies (placement size).
    pub memory_slices: u32,
    /// Memory of one instance in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of one instance.
    pub multiprocessors: u32,
    /// Most instances of this profile one GPU can hold.
    pub max_instances: u32,
    /// Valid placement starts, in memory slices (placement size is `memory_slices`).
    pub placement_starts: &'static [u32],
    /// Whether the profile carries the media extensions (`+me`: decoders, JPEG, OFA).
    pub media_extensions: bool,
}

impl MigProfileSpec {
    /// The memory slices `[start, start + memory_slices)` an instance placed at `start` uses.
    pub fn memory_range(&self, start: u32) -> std::ops::Range<u32> {
        start..start + self.memory_slices
    }
}

/// A MIG-capable GPU model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModel {
    /// Our short key (`H100-80GB`), used in error messages and fixtures.
    pub key: &'static str,
    /// Product names as NVML's `nvmlDeviceGetName` reports them across board variants.
    pub product_names: &'static [&'static str],
    /// PCI device IDs (`device << 16 | vendor`), as mig-parted's `device-filter` uses them.
    pub pci_device_ids: &'static [u32],
    /// Compute slices on the whole GPU.
    pub compute_slices: u32,
    /// Memory slices on the whole GPU.
    pub memory_slices: u32,
    /// The GPU-instance profiles, smallest first.
    pub profiles: &'static [MigProfileSpec],
}

impl GpuModel {
    /// The profile with this name (`1g.10gb`, `1g.10gb+me`), exactly as NVIDIA spells it.
    pub fn profile(&self, name: &str) -> Option<&'static MigProfileSpec> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// The profile with this NVML profile ID (`info.id`).
    pub fn profile_by_id(&self, profile_id: u32) -> Option<&'static MigProfileSpec> {
        self.profiles.iter().find(|p| p.profile_id == profile_id)
    }

    /// The profile for this NVML enum value.
    pub fn profile_by_nvml_enum(&self, nvml_profile: u32) -> Option<&'static MigProfileSpec> {
        self.profiles
            .iter()
            .find(|p| p.nvml_profile == nvml_profile)
    }
}

const ALL_STARTS_7: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN_STARTS_4: &[u32] = &[0, 2, 4, 6];
const EVEN_STARTS_3: &[u32] = &[0, 2, 4];
const HALVES: &[u32] = &[0, 4];
const WHOLE: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn p(
    name: &'static str,
    nvml_profile: u32,
    profile_id: u32,
    compute_slices: u32,
    memory_slices: u32,
    memory_mib: u64,
    multiprocessors: u32,
    max_instances: u32,
    placement_starts: &'static [u32],
    media_extensions: bool,
) -> MigProfileSpec {
    MigProfileSpec {
        name,
        nvml_profile,
        profile_id,
        compute_slices,
        memory_slices,
        memory_mib,
        multiprocessors,
        max_instances,
        placement_starts,
        media_extensions,
    }
}

use nvml_gi_profile as e;

/// A100-SXM4-40GB / A100-PCIE-40GB. IDs and placements: MIG guide `-lgip`/`-lgipp` example;
/// sizes: the guide's `-lgip` (4.75/9.75/19.62/39.50 GiB).
const A100_40GB: &[MigProfileSpec] = &[
    p(
        "1g.5gb",
        e::SLICE_1,
        19,
        1,
        1,
        4864,
        14,
        7,
        ALL_STARTS_7,
        false,
    ),
    p(
        "1g.5gb+me",
        e::SLICE_1_REV1,
        20,
        1,
        1,
        4864,
        14,
        1,
        ALL_STARTS_7,
        true,
    ),
    p(
        "1g.10gb",
        e::SLICE_1_REV2,
        15,
        1,
        2,
        9984,
        14,
        4,
        EVEN_STARTS_4,
        false,
    ),
    p(
        "2g.10gb",
        e::SLICE_2,
        14,
        2,
        2,
        9984,
        28,
        3,
        EVEN_STARTS_3,
        false,
    ),
    p("3g.20gb", e::SLICE_3, 9, 3, 4, 20096, 42, 2, HALVES, false),
    p("4g.20gb", e::SLICE_4, 5, 4, 4, 20096, 56, 1, WHOLE, false),
    p("7g.40gb", e::SLICE_7, 0, 7, 8, 40448, 98, 1, WHOLE, false),
];

/// A100-SXM4-80GB / A100 80GB PCIe: same slices, IDs and placements as the 40GB board.
/// Sizes from an 80GB board's `-lgip` (9.50/19.50/39.25/79.25 GiB).
const A100_80GB: &[MigProfileSpec] = &[
    p(
        "1g.10gb",
        e::SLICE_1,
        19,
        1,
        1,
        9728,
        14,
        7,
        ALL_STARTS_7,
        false,
    ),
    p(
        "1g.10gb+me",
        e::SLICE_1_REV1,
        20,
        1,
        1,
        9728,
        14,
        1,
        ALL_STARTS_7,
        true,
    ),
    p(
        "1g.20gb",
        e::SLICE_1_REV2,
        15,
        1,
        2,
        19968,
        14,
        4,
        EVEN_STARTS_4,
        false,
    ),
    p(
        "2g.20gb",
        e::SLICE_2,
        14,
        2,
        2,
        19968,
        28,
        3,
        EVEN_STARTS_3,
        false,
    ),
    p("3g.40gb", e::SLICE_3, 9, 3, 4, 40192, 42, 2, HALVES, false),
    p("4g.40gb", e::SLICE_4, 5, 4, 4, 40192, 56, 1, WHOLE, false),
    p("7g.80gb", e::SLICE_7, 0, 7, 8, 81152, 98, 1, WHOLE, false),
];

/// H100 80GB (SXM5 "H100 80GB HBM3" and PCIe). IDs, SMs, sizes and placements from H100
/// `-lgip`/`-lgipp` captures (9.75/19.62/39.50/79.25 GiB).
const H100_80GB: &[MigProfileSpec] = &[
    p(
        "1g.10gb",
        e::SLICE_1,
        19,
        1,
        1,
        9984,
        16,
        7,
        ALL_STARTS_7,
        false,
    ),
    p(
        "1g.10gb+me",
        e::SLICE_1_REV1,
        20,
        1,
        1,
        9984,
        16,
        1,
        ALL_STARTS_7,
        true,
    ),
    p(
        "1g.20gb",
        e::SLICE_1_REV2,
        15,
        1,
        2,
        20096,
        26,
        4,
        EVEN_STARTS_4,
        false,
    ),
    p(
        "2g.20gb",
        e::SLICE_2,
        14,
        2,
        2,
        20096,
        32,
        3,
        EVEN_STARTS_3,
        false,
    ),
    p("3g.40gb", e::SLICE_3, 9, 3, 4, 40448, 60, 2, HALVES, false),
    p("4g.40gb", e::SLICE_4, 5, 4, 4, 40448, 64, 1, WHOLE, false),
    p("7g.80gb", e::SLICE_7, 0, 7, 8, 81152, 132, 1, WHOLE, false),
];

/// H200 141GB. Names, fractions and counts: MIG guide H200 table; IDs 19/20/14/0 and SMs from an
/// H200 `-lgip` capture; IDs 15/9/5 and placements follow H100 (same GH100 slice geometry);
/// sizes in MiB from go-nvml's H200 mock.
const H200_141GB: &[MigProfileSpec] = &[
    p(
        "1g.18gb",
        e::SLICE_1,
        19,
        1,
        1,
        18432,
        16,
        7,
        ALL_STARTS_7,
        false,
    ),
    p(
        "1g.18gb+me",
        e::SLICE_1_REV1,
        20,
        1,
        1,
        18432,
        16,
        1,
        ALL_STARTS_7,
        true,
    ),
    p(
        "1g.35gb",
        e::SLICE_1_REV2,
        15,
        1,
        2,
        35840,
        26,
        4,
        EVEN_STARTS_4,
        false,
    ),
    p(
        "2g.35gb",
        e::SLICE_2,
        14,
        2,
        2,
        35840,
        32,
        3,
        EVEN_STARTS_3,
        false,
    ),
    p("3g.71gb", e::SLICE_3, 9, 3, 4, 72704, 60, 2, HALVES, false),
    p("4g.71gb", e::SLICE_4, 5, 4, 4, 72704, 64, 1, WHOLE, false),
    p(
        "7g.141gb",
        e::SLICE_7,
        0,
        7,
        8,
        144384,
        132,
        1,
        WHOLE,
        false,
    ),
];

/// A30 24GB: four compute and four memory slices. IDs and SMs from A30 `-lgip` captures,
/// placements and MiB from go-nvml's A30 mock; `2g.12gb+me` needs R525 or newer.
const A30_24GB: &[MigProfileSpec] = &[
    p(
        "1g.6gb",
        e::SLICE_1,
        14,
        1,
        1,
        5836,
        14,
        4,
        &[0, 1, 2, 3],
        false,
    ),
    p(
        "1g.6gb+me",
        e::SLICE_1_REV1,
        21,
        1,
        1,
        5836,
        14,
        1,
        &[0, 1, 2, 3],
        true,
    ),
    p("2g.12gb", e::SLICE_2, 5, 2, 2, 11672, 28, 2, &[0, 2], false),
    p(
        "2g.12gb+me",
        e::SLICE_2_REV1,
        6,
        2,
        2,
        11672,
        28,
        1,
        &[0, 2],
        true,
    ),
    p("4g.24gb", e::SLICE_4, 0, 4, 4, 23344, 56, 1, WHOLE, false),
];

/// Every MIG-capable model the catalog knows.
pub const MODELS: &[GpuModel] = &[
    GpuModel {
        key: "A100-40GB",
        product_names: &["NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"],
        pci_device_ids: &[0x20B0_10DE, 0x20B1_10DE, 0x20F1_10DE, 0x20F6_10DE],
        compute_slices: 7,
        memory_slices: 8,
        profiles: A100_40GB,
    },
    GpuModel {
        key: "A100-80GB",
        product_names: &["NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"],
        pci_device_ids: &[0x20B2_10DE, 0x20B5_10DE, 0x20F3_10DE, 0x20F5_10DE],
        compute_slices: 7,
        memory_slices: 8,
        profiles: A100_80GB,
    },
    GpuModel {
        key: "H100-80GB",
        product_names: &["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"],
        pci_device_ids: &[0x2330_10DE, 0x2331_10DE, 0x2322_10DE, 0x2324_10DE],
        compute_slices: 7,
        memory_slices: 8,
        profiles: H100_80GB,
    },
    GpuModel {
        key: "H200-141GB",
        product_names: &["NVIDIA H200"],
        pci_device_ids: &[0x2335_10DE],
        compute_slices: 7,
        memory_slices: 8,
        profiles: H200_141GB,
    },
    GpuModel {
        key: "A30-24GB",
        product_names: &["NVIDIA A30"],
        pci_device_ids: &[0x20B7_10DE],
        compute_slices: 4,
        memory_slices: 4,
        profiles: A30_24GB,
    },
];

/// Every profile name in the catalog, sorted; the CRD's CEL rule accepts exactly these.
pub const ALL_PROFILE_NAMES: &[&str] = &[
    "1g.10gb",
    "1g.10gb+me",
    "1g.18gb",
    "1g.18gb+me",
    "1g.20gb",
    "1g.35gb",
    "1g.5gb",
    "1g.5gb+me",
    "1g.6gb",
    "1g.6gb+me",
    "2g.10gb",
    "2g.12gb",
    "2g.12gb+me",
    "2g.20gb",
    "2g.35gb",
    "3g.20gb",
    "3g.40gb",
    "3g.71gb",
    "4g.20gb",
    "4g.24gb",
    "4g.40gb",
    "4g.71gb",
    "7g.141gb",
    "7g.40gb",
    "7g.80gb",
];

/// Normalizes a product name or GFD label value for comparison: case-insensitive, spaces and
/// underscores as dashes, without the `NVIDIA-` prefix older drivers omit.
fn normalize(name: &str) -> String {
    let dashed: String = name
        .trim()
        .chars()
        .map(|c| match c {
            ' ' | '_' => '-',
            c => c.to_ascii_uppercase(),
        })
        .collect();
    dashed
        .strip_prefix("NVIDIA-")
        .map(str::to_owned)
        .unwrap_or(dashed)
}

/// Finds a model by the product name NVML reports (`NVIDIA H100 80GB HBM3`), its GFD label form
/// (`NVIDIA-H100-80GB-HBM3`), or our key (`H100-80GB`).
pub fn model_by_product_name(name: &str) -> Option<&'static GpuModel> {
    let wanted = normalize(name);
    MODELS.iter().find(|m| {
        normalize(m.key) == wanted || m.product_names.iter().any(|n| normalize(n) == wanted)
    })
}

/// Finds a model by its PCI device ID (`device << 16 | vendor`).
pub fn model_by_pci_device_id(id: u32) -> Option<&'static GpuModel> {
    MODELS.iter().find(|m| m.pci_device_ids.contains(&id))
}

/// Whether `name` is a profile name of some model in the catalog.
pub fn is_known_profile(name: &str) -> bool {
    ALL_PROFILE_NAMES.contains(&name)
}

/// Compute-instance profiles (NVML enum value = profile ID, compute slices) a GPU instance with
/// `gi_compute_slices` slices offers, smallest first. The full-size one is the default the agent
/// creates.
pub fn compute_instance_profiles(gi_compute_slices: u32) -> Vec<(u32, u32)> {
    use nvml_ci_profile as c;
    [
        (c::SLICE_1, 1),
        (c::SLICE_2, 2),
        (c::SLICE_3, 3),
        (c::SLICE_4, 4),
        (c::SLICE_7, 7),
    ]
    .into_iter()
    .filter(|&(_, slices)| slices <= gi_compute_slices)
    .collect()
}

/// One GPU instance of a planned layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedInstance {
    /// The profile.
    pub profile: &'static MigProfileSpec,
    /// Placement start in memory slices.
    pub start: u32,
}

/// Why a wanted set of profiles does not fit one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// A profile name the model does not offer.
    UnknownProfile {
        /// The model key.
        model: &'static str,
        /// The name asked for.
        profile: String,
    },
    /// More of one profile than the GPU can hold.
    TooManyInstances {
        /// The model key.
        model: &'static str,
        /// The profile name.
        profile: &'static str,
        /// How many were asked for.
        wanted: u32,
        /// The most the GPU holds.
        max: u32,
    },
    /// The profiles need more compute slices than the GPU has.
    ComputeSlices {
        /// The model key.
        model: &'static str,
        /// The wanted profiles, as asked.
        wanted: String,
        /// Compute slices needed.
        needed: u32,
        /// Compute slices the GPU has.
        available: u32,
    },
    /// The profiles need more memory slices than the GPU has.
    MemorySlices {
        /// The model key.
        model: &'static str,
        /// The wanted profiles, as asked.
        wanted: String,
        /// Memory slices needed.
        needed: u32,
        /// Memory slices the GPU has.
        available: u32,
    },
    /// The totals fit, but no combination of valid placements does.
    NoPlacement {
        /// The model key.
        model: &'static str,
        /// The wanted profiles, as asked.
        wanted: String,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::UnknownProfile { model, profile } => {
                write!(f, "{model} has no MIG profile {profile:?}")
            }
            PlanError::TooManyInstances {
                model,
                profile,
                wanted,
                max,
            } => write!(
                f,
                "{wanted} × {profile} wanted; {model} holds at most {max}"
            ),
            PlanError::ComputeSlices {
                model,
                wanted,
                needed,
                available,
            } => write!(
                f,
                "{wanted} needs {needed} compute slices; {model} has {available}"
            ),
            PlanError::MemorySlices {
                model,
                wanted,
                needed,
                available,
            } => write!(
                f,
                "{wanted} needs {needed} memory slices; {model} has {available}"
            ),
            PlanError::NoPlacement { model, wanted } => write!(
                f,
                "{wanted} fits {model}'s slice totals but no valid placement holds them all"
            ),
        }
    }
}

impl std::error::Error for PlanError {}

/// Plans a layout: a placement for each wanted profile, or why none exists.
///
/// Instances may not share memory slices, their compute slices may not exceed the GPU's, and
/// each start must be one NVIDIA lists for the profile. The search is deterministic (largest
/// instances first, lowest start first), so the same request always gives the same layout.
/// The result is in the order the instances should be created.
pub fn plan_layout(model: &GpuModel, wanted: &[&str]) -> Result<Vec<PlannedInstance>, PlanError> {
    let wanted_text = wanted.join(" + ");
    let mut profiles = Vec::with_capacity(wanted.len());
    for name in wanted {
        let profile = model
            .profile(name)
            .ok_or_else(|| PlanError::UnknownProfile {
                model: model.key,
                profile: (*name).to_owned(),
            })?;
        profiles.push(profile);
    }
    for profile in model.profiles {
        let count = profiles.iter().filter(|p| p.name == profile.name).count() as u32;
        if count > profile.max_instances {
            return Err(PlanError::TooManyInstances {
                model: model.key,
                profile: profile.name,
                wanted: count,
                max: profile.max_instances,
            });
        }
    }
    let compute: u32 = profiles.iter().map(|p| p.compute_slices).sum();
    if compute > model.compute_slices {
        return Err(PlanError::ComputeSlices {
            model: model.key,
            wanted: wanted_text,
            needed: compute,
            available: model.compute_slices,
        });
    }
    let memory: u32 = profiles.iter().map(|p| p.memory_slices).sum();
    if memory > model.memory_slices {
        return Err(PlanError::MemorySlices {
            model: model.key,
            wanted: wanted_text,
            needed: memory,
            available: model.memory_slices,
        });
    }
    // Largest first: they have the fewest starts, so the search prunes early.
    profiles.sort_by(|a, b| {
        (b.memory_slices, b.compute_slices, a.name).cmp(&(
            a.memory_slices,
            a.compute_slices,
            b.name,
        ))
    });
    let mut placed = Vec::with_capacity(profiles.len());
    if place(&profiles, 0, &mut placed) {
        Ok(placed)
    } else {
        Err(PlanError::NoPlacement {
            model: model.key,
            wanted: wanted_text,
        })
    }
}

/// Checks whether `profile` at `start` fits next to instances already placed.
pub fn fits(existing: &[PlannedInstance], profile: &MigProfileSpec, start: u32) -> bool {
    let range = profile.memory_range(start);
    profile.placement_starts.contains(&start)
        && existing.iter().all(|other| {
            let r = other.profile.memory_range(other.start);
            range.end <= r.start || r.end <= range.start
        })
}

fn place(
    profiles: &[&'static MigProfileSpec],
    next: usize,
    placed: &mut Vec<PlannedInstance>,
) -> bool {
    let Some(profile) = profiles.get(next) else {
        return true;
    };
    for &start in profile.placement_starts {
        if fits(placed, profile, start) {
            placed.push(PlannedInstance { profile, start });
            if place(profiles, next + 1, placed) {
                return true;
            }
            placed.pop();
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transcription of NVIDIA's tables, kept apart from the data above so a typo in one
    /// shows up as a difference. Columns: model, name, NVML enum, profile ID, compute slices,
    /// memory slices, max instances, placement starts. Sources as in the module docs: MIG user
    /// guide "Supported MIG Profiles" tables (A100 Table 6, H100 Table 7, H200 Table 8, A30
    /// table) and the `nvidia-smi mig -lgip`/`-lgipp` outputs quoted there and in NVIDIA's H100
    /// material.
    const NVIDIA_TABLE: &str = "
        A100-40GB  1g.5gb      0 19 1 1 7 0,1,2,3,4,5,6
        A100-40GB  1g.5gb+me   7 20 1 1 1 0,1,2,3,4,5,6
        A100-40GB  1g.10gb     9 15 1 2 4 0,2,4,6
        A100-40GB  2g.10gb     1 14 2 2 3 0,2,4
        A100-40GB  3g.20gb     2  9 3 4 2 0,4
        A100-40GB  4g.20gb     3  5 4 4 1 0
        A100-40GB  7g.40gb     4  0 7 8 1 0
        A100-80GB  1g.10gb     0 19 1 1 7 0,1,2,3,4,5,6
        A100-80GB  1g.10gb+me  7 20 1 1 1 0,1,2,3,4,5,6
        A100-80GB  1g.20gb     9 15 1 2 4 0,2,4,6
        A100-80GB  2g.20gb     1 14 2 2 3 0,2,4
        A100-80GB  3g.40gb     2  9 3 4 2 0,4
        A100-80GB  4g.40gb     3  5 4 4 1 0
        A100-80GB  7g.80gb     4  0 7 8 1 0
        H100-80GB  1g.10gb     0 19 1 1 7 0,1,2,3,4,5,6
        H100-80GB  1g.10gb+me  7 20 1 1 1 0,1,2,3,4,5,6
        H100-80GB  1g.20gb     9 15 1 2 4 0,2,4,6
        H100-80GB  2g.20gb     1 14 2 2 3 0,2,4
        H100-80GB  3g.40gb     2  9 3 4 2 0,4
        H100-80GB  4g.40gb     3  5 4 4 1 0
        H100-80GB  7g.80gb     4  0 7 8 1 0
        H200-141GB 1g.18gb     0 19 1 1 7 0,1,2,3,4,5,6
        H200-141GB 1g.18gb+me  7 20 1 1 1 0,1,2,3,4,5,6
        H200-141GB 1g.35gb     9 15 1 2 4 0,2,4,6
        H200-141GB 2g.35gb     1 14 2 2 3 0,2,4
        H200-141GB 3g.71gb     2  9 3 4 2 0,4
        H200-141GB 4g.71gb     3  5 4 4 1 0
        H200-141GB 7g.141gb    4  0 7 8 1 0
        A30-24GB   1g.6gb      0 14 1 1 4 0,1,2,3
        A30-24GB   1g.6gb+me   7 21 1 1 1 0,1,2,3
        A30-24GB   2g.12gb     1  5 2 2 2 0,2
        A30-24GB   2g.12gb+me  8  6 2 2 1 0,2
        A30-24GB   4g.24gb     3  0 4 4 1 0
    ";

    #[test]
    fn catalog_matches_nvidia_tables() {
        let mut rows = 0;
        for line in NVIDIA_TABLE.lines().filter(|l| !l.trim().is_empty()) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let model = model_by_product_name(cols[0]).expect("model in catalog");
            let profile = model.profile(cols[1]).expect("profile in catalog");
            let num = |i: usize| cols[i].parse::<u32>().expect("number");
            let starts: Vec<u32> = cols[7].split(',').map(|s| s.parse().unwrap()).collect();
            assert_eq!(profile.nvml_profile, num(2), "{line}");
            assert_eq!(profile.profile_id, num(3), "{line}");
            assert_eq!(profile.compute_slices, num(4), "{line}");
            assert_eq!(profile.memory_slices, num(5), "{line}");
            assert_eq!(profile.max_instances, num(6), "{line}");
            assert_eq!(profile.placement_starts, starts.as_slice(), "{line}");
            rows += 1;
        }
        let catalog_rows: usize = MODELS.iter().map(|m| m.profiles.len()).sum();
        assert_eq!(rows, catalog_rows, "every catalog row is in the table");
    }

    #[test]
    fn names_encode_slices_and_memory() {
        for model in MODELS {
            for profile in model.profiles {
                let (g, rest) = profile.name.split_once("g.").unwrap();
                assert_eq!(g.parse::<u32>().unwrap(), profile.compute_slices);
                let gb: u64 = rest
                    .trim_end_matches("+me")
                    .trim_end_matches("gb")
                    .parse()
                    .unwrap();
                // The GB in the name is the size rounded to a whole number of GB.
                let mib_gb = profile.memory_mib as f64 / 1024.0;
                assert!(
                    (mib_gb - gb as f64).abs() <= 1.5,
                    "{} {}: {} MiB",
                    model.key,
                    profile.name,
                    profile.memory_mib
                );
                assert_eq!(profile.media_extensions, profile.name.ends_with("+me"));
                for &start in profile.placement_starts {
                    assert!(start + profile.memory_slices <= model.memory_slices);
                }
            }
        }
    }

    #[test]
    fn all_profile_names_is_the_union() {
        let mut names: Vec<&str> = MODELS
            .iter()
            .flat_map(|m| m.profiles.iter().map(|p| p.name))
            .collect();
        names.sort();
        names.dedup();
        assert_eq!(names, ALL_PROFILE_NAMES);
    }

    #[test]
    fn lookup_by_product_name_and_label() {
        for (name, key) in [
            ("NVIDIA H100 80GB HBM3", "H100-80GB"),
            ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
            ("nvidia h100 pcie", "H100-80GB"),
            ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
            ("A100-SXM4-40GB", "A100-40GB"),
            ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
            ("NVIDIA A100 80GB PCIe", "A100-80GB"),
            ("NVIDIA H200", "H200-141GB"),
            ("NVIDIA A30", "A30-24GB"),
            ("H100-80GB", "H100-80GB"),
        ] {
            assert_eq!(
                model_by_product_name(name).map(|m| m.key),
                Some(key),
                "{name}"
            );
        }
        assert!(model_by_product_name("NVIDIA L4").is_none());
        assert!(model_by_product_name("NVIDIA GeForce RTX 4090").is_none());
        assert_eq!(
            model_by_pci_device_id(0x2330_10DE).map(|m| m.key),
            Some("H100-80GB")
        );
    }

    fn h100() -> &'static GpuModel {
        model_by_product_name("H100-80GB").unwrap()
    }

    fn starts(plan: &[PlannedInstance]) -> Vec<(&str, u32)> {
        plan.iter().map(|i| (i.profile.name, i.start)).collect()
    }

    #[test]
    fn plans_fitting_layouts() {
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, u32)]);
        let cases: &[Case] = &[
            (&["7g.80gb"], &[("7g.80gb", 0)]),
            (&["3g.40gb", "4g.40gb"], &[("4g.40gb", 0), ("3g.40gb", 4)]),
            // 3g.40gb at 0 leaves no start for the second 1g.10gb (they stop at 6): the
            // planner has to backtrack to 3g.40gb at 4.
            (
                &["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"],
                &[
                    ("3g.40gb", 4),
                    ("2g.20gb", 0),
                    ("1g.10gb", 2),
                    ("1g.10gb", 3),
                ],
            ),
            (
                &["1g.10gb"; 7],
                &[
                    ("1g.10gb", 0),
                    ("1g.10gb", 1),
                    ("1g.10gb", 2),
                    ("1g.10gb", 3),
                    ("1g.10gb", 4),
                    ("1g.10gb", 5),
                    ("1g.10gb", 6),
                ],
            ),
            (
                &["1g.10gb+me", "1g.20gb", "2g.20gb", "2g.20gb"],
                &[
                    ("2g.20gb", 0),
                    ("2g.20gb", 2),
                    ("1g.20gb", 4),
                    ("1g.10gb+me", 6),
                ],
            ),
        ];
        for (wanted, expected) in cases {
            let plan = plan_layout(h100(), wanted).unwrap_or_else(|e| panic!("{wanted:?}: {e}"));
            assert_eq!(starts(&plan), expected.to_vec(), "{wanted:?}");
        }
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let err = plan_layout(h100(), &["3g.40gb", "4g.40gb", "1g.10gb"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "3g.40gb + 4g.40gb + 1g.10gb needs 8 compute slices; H100-80GB has 7"
        );
        let err = plan_layout(h100(), &["1g.10gb"; 8]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "8 × 1g.10gb wanted; H100-80GB holds at most 7"
        );
        let err = plan_layout(h100(), &["1g.5gb"]).unwrap_err();
        assert_eq!(err.to_string(), "H100-80GB has no MIG profile \"1g.5gb\"");
        let err = plan_layout(h100(), &["3g.40gb", "3g.40gb", "1g.10gb"]).unwrap_err();
        assert!(
            matches!(err, PlanError::MemorySlices { needed: 9, .. }),
            "{err}"
        );
        // Totals that fit but placements that don't: a model whose 2-slice profile may only
        // start at 0 cannot hold two of them.
        const ODD: &[MigProfileSpec] = &[p("2g.x", 1, 1, 2, 2, 1, 1, 2, &[0], false)];
        let odd = GpuModel {
            key: "ODD",
            product_names: &[],
            pci_device_ids: &[],
            compute_slices: 4,
            memory_slices: 4,
            profiles: ODD,
        };
        let err = plan_layout(&odd, &["2g.x", "2g.x"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "2g.x + 2g.x fits ODD's slice totals but no valid placement holds them all"
        );
    }

    #[test]
    fn compute_instance_profiles_per_gpu_instance_size() {
        assert_eq!(compute_instance_profiles(1), vec![(0, 1)]);
        assert_eq!(compute_instance_profiles(2), vec![(0, 1), (1, 2)]);
        assert_eq!(compute_instance_profiles(3), vec![(0, 1), (1, 2), (2, 3)]);
        assert_eq!(
            compute_instance_profiles(4),
            vec![(0, 1), (1, 2), (2, 3), (3, 4)]
        );
        assert_eq!(
            compute_instance_profiles(7),
            vec![(0, 1), (1, 2), (2, 3), (3, 4), (4, 7)]
        );
    }
}
