//! Value types the GPU backends hand out. Plain data, comparable, so the conformance suite can
//! check that two backends give the same answers.

use std::fmt;
use std::str::FromStr;

use super::Error;

/// A GPU's UUID as NVML prints it: `GPU-` followed by a hex UUID.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuUuid(String);

impl GpuUuid {
    /// The UUID text (`GPU-…`).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for GpuUuid {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        parse_uuid(s, "GPU-").map(GpuUuid)
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A MIG device's UUID: `MIG-` followed by a hex UUID (R470 and newer drivers).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MigUuid(String);

impl MigUuid {
    /// The UUID text (`MIG-…`).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for MigUuid {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        parse_uuid(s, "MIG-").map(MigUuid)
    }
}

impl fmt::Display for MigUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn parse_uuid(s: &str, prefix: &str) -> Result<String, Error> {
    let rest = s.strip_prefix(prefix).ok_or_else(|| Error::Parse {
        what: "UUID",
        value: s.to_owned(),
        reason: format!("does not start with {prefix}"),
    })?;
    let ok = rest.len() == 36
        && rest.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(Error::Parse {
            what: "UUID",
            value: s.to_owned(),
            reason: "expected 8-4-4-4-12 hex digits after the prefix".to_owned(),
        })
    }
}

/// A MIG profile name such as `1g.10gb`, `1g.10gb+me` or, for a compute instance smaller than
/// its GPU instance, `1c.3g.40gb`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MigProfile(String);

impl MigProfile {
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether NVIDIA documents this GPU-instance profile for some model in our catalog.
    pub fn is_known(&self) -> bool {
        gpupool_mig_catalog::is_known_profile(&self.0)
    }
}

impl FromStr for MigProfile {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::Parse {
            what: "MIG profile",
            value: s.to_owned(),
            reason: reason.to_owned(),
        };
        let base = s.strip_suffix("+me").unwrap_or(s);
        let mut parts: Vec<&str> = base.split('.').collect();
        if parts.len() == 3 {
            let c = parts.remove(0);
            let n = c
                .strip_suffix('c')
                .ok_or_else(|| bad("expected <n>c.<n>g.<n>gb"))?;
            n.parse::<u32>()
                .map_err(|_| bad("compute slices are not a number"))?;
        }
        match parts.as_slice() {
            [g, mem] => {
                let g = g
                    .strip_suffix('g')
                    .ok_or_else(|| bad("expected <n>g.<n>gb"))?;
                g.parse::<u32>()
                    .map_err(|_| bad("slices are not a number"))?;
                let gb = mem
                    .strip_suffix("gb")
                    .ok_or_else(|| bad("expected <n>g.<n>gb"))?;
                gb.parse::<u32>()
                    .map_err(|_| bad("memory is not a number"))?;
                Ok(MigProfile(s.to_owned()))
            }
            _ => Err(bad("expected <n>g.<n>gb")),
        }
    }
}

impl fmt::Display for MigProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A GPU-instance profile ID as NVML reports it in `info.id` (19 for `1g.10gb` on H100).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GiProfileId(pub u32);

/// A compute-instance profile ID (the NVML `NVML_COMPUTE_INSTANCE_PROFILE_*` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CiProfileId(pub u32);

/// A GPU instance ID on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuInstanceId(pub u32);

/// A compute instance ID within one GPU instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeInstanceId(pub u32);

impl fmt::Display for GpuInstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for ComputeInstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// CUDA driver API version, `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CudaVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl CudaVersion {
    /// From NVML's encoding, `major * 1000 + minor * 10`.
    pub fn from_nvml(v: i32) -> CudaVersion {
        let v = v.max(0) as u32;
        CudaVersion {
            major: v / 1000,
            minor: (v % 1000) / 10,
        }
    }

    /// To NVML's encoding.
    pub fn to_nvml(self) -> i32 {
        (self.major * 1000 + self.minor * 10) as i32
    }
}

impl FromStr for CudaVersion {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::Parse {
            what: "CUDA version",
            value: s.to_owned(),
            reason: "expected <major>.<minor>".to_owned(),
        };
        let (major, minor) = s.trim().split_once('.').ok_or_else(bad)?;
        Ok(CudaVersion {
            major: major.parse().map_err(|_| bad())?,
            minor: minor.parse().map_err(|_| bad())?,
        })
    }
}

impl fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Driver versions of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// Kernel driver version (`550.54.15`).
    pub driver_version: String,
    /// Highest CUDA version the driver supports.
    pub cuda_version: CudaVersion,
}

/// GPU architecture (NVML `NVML_DEVICE_ARCH_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// Kepler
    Kepler,
    /// Maxwell
    Maxwell,
    /// Pascal
    Pascal,
    /// Volta
    Volta,
    /// Turing
    Turing,
    /// Ampere
    Ampere,
    /// Ada Lovelace
    Ada,
    /// Hopper
    Hopper,
    /// Blackwell
    Blackwell,
    /// A value this build does not know.
    Unknown(u32),
}

impl Architecture {
    /// From the NVML enum value.
    pub fn from_nvml(v: u32) -> Architecture {
        match v {
            2 => Architecture::Kepler,
            3 => Architecture::Maxwell,
            4 => Architecture::Pascal,
            5 => Architecture::Volta,
            6 => Architecture::Turing,
            7 => Architecture::Ampere,
            8 => Architecture::Ada,
            9 => Architecture::Hopper,
            10 => Architecture::Blackwell,
            other => Architecture::Unknown(other),
        }
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Architecture::Unknown(v) => write!(f, "unknown({v})"),
            other => write!(f, "{}", format!("{other:?}").to_lowercase()),
        }
    }
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDevice {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: GpuUuid,
    /// Product name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor_number: u32,
    /// PCI bus ID, `00000000:18:00.0`.
    pub pci_bus_id: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Architecture.
    pub architecture: Architecture,
    /// Whether the GPU supports MIG.
    pub mig_capable: bool,
}

/// How close two GPUs sit on PCIe (NVML `nvmlGpuTopologyLevel_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PcieLink {
    /// Same board.
    SameBoard,
    /// Behind one PCIe switch.
    SingleSwitch,
    /// Behind several switches, no host bridge between.
    MultipleSwitches,
    /// Through one host bridge.
    HostBridge,
    /// Same NUMA node, several host bridges.
    NumaNode,
    /// Across NUMA nodes.
    System,
}

/// The link between two GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Whether NVLink peer-to-peer works between them (directly or through NVSwitch).
    pub nvlink: bool,
    /// Closest common PCIe ancestor.
    pub pcie: PcieLink,
}

/// Health counters of one GPU. `None` where the GPU does not report the counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HealthSnapshot {
    /// Volatile uncorrected (double-bit) ECC errors.
    pub ecc_uncorrected: Option<u64>,
    /// Volatile corrected (single-bit) ECC errors.
    pub ecc_corrected: Option<u64>,
    /// PCIe replay counter.
    pub pcie_replay: Option<u64>,
    /// Pages retired for double-bit errors (pre-Ampere) or uncorrectable remapped rows (Ampere+).
    pub retired_pages: Option<u64>,
    /// GPU temperature, °C.
    pub temperature_c: Option<u32>,
}

/// What a health event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthEventKind {
    /// An Xid error with this code.
    Xid(u64),
    /// A double-bit (uncorrectable) ECC error.
    DoubleBitEcc,
    /// A single-bit (correctable) ECC error.
    SingleBitEcc,
}

impl HealthEventKind {
    /// Xid 79: "GPU has fallen off the bus" (NVIDIA's Xid catalog,
    /// <https://docs.nvidia.com/deploy/xid-errors/>).
    pub fn is_fallen_off_bus(&self) -> bool {
        *self == HealthEventKind::Xid(79)
    }
}

/// One health event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthEvent {
    /// GPU index.
    pub gpu: u32,
    /// GPU UUID.
    pub uuid: GpuUuid,
    /// What happened.
    pub kind: HealthEventKind,
    /// The GPU instance it concerns, when the driver attributes it to one.
    pub gpu_instance: Option<GpuInstanceId>,
    /// The compute instance it concerns, when the driver attributes it to one.
    pub compute_instance: Option<ComputeInstanceId>,
}

/// MIG mode of a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigMode {
    /// In effect now.
    pub current: bool,
    /// In effect after the next GPU reset.
    pub pending: bool,
}

/// What a MIG mode change did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigModeChange {
    /// The new mode is in effect.
    Applied,
    /// The new mode waits for a GPU reset (the driver's reason).
    PendingReset(String),
}

/// A placement: `size` memory slices from `start` (GPU instances) or compute slices within
/// the GPU instance (compute instances).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Placement {
    /// First slice.
    pub start: u32,
    /// Number of slices.
    pub size: u32,
}

/// A GPU-instance profile a GPU offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInstanceProfile {
    /// Name (`1g.10gb`).
    pub name: MigProfile,
    /// NVML enum value used to look it up.
    pub nvml_profile: u32,
    /// Profile ID for creation.
    pub id: GiProfileId,
    /// Compute slices.
    pub slice_count: u32,
    /// Most instances.
    pub instance_count: u32,
    /// SMs per instance.
    pub multiprocessors: u32,
    /// Memory per instance, MiB.
    pub memory_mib: u64,
    /// Every placement the profile can take.
    pub placements: Vec<Placement>,
}

/// A compute-instance profile a GPU instance offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeInstanceProfile {
    /// Profile ID.
    pub id: CiProfileId,
    /// Compute slices.
    pub slice_count: u32,
}

/// A GPU instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInstance {
    /// ID on its GPU.
    pub id: GpuInstanceId,
    /// Profile ID.
    pub profile_id: GiProfileId,
    /// Where it sits.
    pub placement: Placement,
}

/// A compute instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeInstance {
    /// ID within its GPU instance.
    pub id: ComputeInstanceId,
    /// Its GPU instance.
    pub gpu_instance: GpuInstanceId,
    /// Profile ID.
    pub profile_id: CiProfileId,
    /// Where it sits within the GPU instance.
    pub placement: Placement,
}

/// A MIG device: what a container gets (one compute instance of one GPU instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDevice {
    /// UUID.
    pub uuid: MigUuid,
    /// Parent GPU index.
    pub gpu: u32,
    /// Parent GPU UUID.
    pub parent: GpuUuid,
    /// GPU instance.
    pub gpu_instance: GpuInstanceId,
    /// Compute instance.
    pub compute_instance: ComputeInstanceId,
    /// Profile name (`1g.10gb`, or `1c.3g.40gb` for a partial compute instance).
    pub profile: MigProfile,
    /// Memory, MiB.
    pub memory_mib: u64,
}

/// Utilization over the driver's last sample period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Utilization {
    /// SM busy, percent.
    pub gpu_percent: u32,
    /// Memory controller busy, percent.
    pub memory_percent: u32,
}

/// A compute process on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ComputeProcess {
    /// Process ID (in the host PID namespace).
    pub pid: u32,
    /// GPU memory used, MiB, when the driver reports it.
    pub used_memory_mib: Option<u64>,
    /// GPU instance it runs in (MIG).
    pub gpu_instance: Option<GpuInstanceId>,
    /// Compute instance it runs in (MIG).
    pub compute_instance: Option<ComputeInstanceId>,
}

/// One process's own utilization over the last sample period (NVML's per-process samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessUtilization {
    /// Process ID (in the host PID namespace).
    pub pid: u32,
    /// SM utilization, percent.
    pub sm_percent: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_uuids_and_profiles() {
        let uuid: GpuUuid = "GPU-2fa5cf01-9520-1bc1-995b-cc0c6d9bca7c".parse().unwrap();
        assert_eq!(uuid.as_str(), "GPU-2fa5cf01-9520-1bc1-995b-cc0c6d9bca7c");
        assert!(
            "MIG-2fa5cf01-9520-1bc1-995b-cc0c6d9bca7c"
                .parse::<GpuUuid>()
                .is_err()
        );
        assert!("GPU-2fa5cf01".parse::<GpuUuid>().is_err());
        assert!(
            "MIG-2fa5cf01-9520-1bc1-995b-cc0c6d9bca7c"
                .parse::<MigUuid>()
                .is_ok()
        );
        for ok in ["1g.10gb", "1g.10gb+me", "7g.141gb", "1c.3g.40gb"] {
            assert_eq!(ok.parse::<MigProfile>().unwrap().as_str(), ok);
        }
        for bad in ["1g", "g.10gb", "1g.10", "x.1g.10gb", ""] {
            assert!(bad.parse::<MigProfile>().is_err(), "{bad}");
        }
        assert!("1g.10gb+me".parse::<MigProfile>().unwrap().is_known());
        assert!(!"1g.11gb".parse::<MigProfile>().unwrap().is_known());
    }

    #[test]
    fn cuda_versions() {
        assert_eq!(
            CudaVersion::from_nvml(12040),
            CudaVersion {
                major: 12,
                minor: 4
            }
        );
        assert_eq!("12.2".parse::<CudaVersion>().unwrap().to_nvml(), 12020);
        assert!("12".parse::<CudaVersion>().is_err());
    }
}
