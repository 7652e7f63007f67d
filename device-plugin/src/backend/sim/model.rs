//! The simulated GPU node: the fixture format and the state machine behind both `SimBackend` and
//! the fake `libnvidia-ml.so` in `e2e/fake-nvml` (which includes this file by path, so the two
//! cannot drift apart). It depends only on std, serde, serde_yaml, serde_json and the MIG
//! catalog (reached as `super::catalog`).
//!
//! Errors are [`SimError`] values that mirror NVML return codes one to one, so the fake can
//! return exactly what a driver would and `SimBackend` can map them as `NvmlBackend` maps NVML's.

use super::catalog::{self, GpuModel, MigProfileSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// Fixture format (documented in device-plugin/fixtures/README.md)
// ---------------------------------------------------------------------------------------------

/// A simulated node, as written in a fixture file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fixture {
    /// Seed for generated UUIDs, so two fixtures (two nodes) never share a UUID.
    #[serde(default = "default_node")]
    pub node: String,
    /// The driver.
    pub driver: DriverFixture,
    /// GPU groups in index order.
    pub gpus: Vec<GpuGroup>,
    /// How the GPUs are connected.
    #[serde(default)]
    pub topology: TopologyFixture,
    /// Faults that happen at given times.
    #[serde(default)]
    pub faults: Vec<FaultFixture>,
    /// Busy and idle periods and processes per GPU.
    #[serde(default)]
    pub utilization: Vec<UtilizationFixture>,
}

fn default_node() -> String {
    "sim-node".to_owned()
}

/// Driver versions.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DriverFixture {
    /// Kernel driver version, as `nvidia-smi` prints it (`550.54.15`).
    pub version: String,
    /// Highest CUDA version the driver supports, `major.minor` (`12.4`).
    pub cuda: String,
}

/// `count` GPUs of one model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GpuGroup {
    /// Model key (`H100-SXM5-80GB`) or NVML product name (`NVIDIA H100 80GB HBM3`).
    pub model: String,
    /// How many GPUs of this model.
    #[serde(default = "one")]
    pub count: u32,
    /// Explicit UUIDs (`GPU-…`), one per GPU of the group; generated when empty.
    #[serde(default)]
    pub uuids: Vec<String>,
    /// Explicit PCI bus IDs (`00000000:18:00.0`); generated when empty.
    #[serde(default)]
    pub pci_bus_ids: Vec<String>,
    /// Whether MIG mode is enabled at boot.
    #[serde(default)]
    pub mig_enabled: bool,
    /// Temperature in °C when nothing else is said.
    #[serde(default = "default_temperature")]
    pub temperature_c: u32,
    /// Whether persistence mode is on (`nvidia-smi -pm 1`, or nvidia-persistenced running).
    #[serde(default = "enabled")]
    pub persistence_mode: bool,
}

fn one() -> u32 {
    1
}

fn enabled() -> bool {
    true
}

fn default_temperature() -> u32 {
    38
}

/// Interconnect between GPUs, by GPU index.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TopologyFixture {
    /// Groups of GPUs connected all-to-all by NVLink (directly or through NVSwitch).
    #[serde(default)]
    pub nvlink: Vec<Vec<u32>>,
    /// Groups of GPUs behind the same PCIe switch.
    #[serde(default)]
    pub pcie_switches: Vec<Vec<u32>>,
    /// NUMA node per GPU index; missing entries are node 0.
    #[serde(default)]
    pub numa_nodes: Vec<u32>,
}

/// A fault that happens `at` seconds after the simulation starts.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultFixture {
    /// Seconds since start.
    pub at: f64,
    /// GPU index.
    pub gpu: u32,
    /// What happens: `{xid: 79}`, `{double_bit_ecc: 1}`, `fallen_off_bus`, …
    #[serde(with = "serde_yaml::with::singleton_map")]
    pub fault: FaultKind,
    /// GPU instance the fault is attributed to, if any (MIG).
    #[serde(default)]
    pub gpu_instance: Option<u32>,
    /// Compute instance the fault is attributed to, if any (MIG).
    #[serde(default)]
    pub compute_instance: Option<u32>,
}

/// The kinds of fault a fixture or a test can inject.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// An Xid error with this code (delivered as an NVML Xid critical-error event).
    Xid(u64),
    /// Uncorrectable (double-bit) ECC errors: counted and delivered as an event.
    DoubleBitEcc(u64),
    /// Correctable (single-bit) ECC errors: counted and delivered as an event.
    SingleBitEcc(u64),
    /// The GPU falls off the bus: Xid 79, then every query answers "GPU is lost".
    FallenOffBus,
    /// PCIe replay counter increments.
    PcieReplay(u64),
    /// Pages retired (pre-Ampere) or rows remapped (Ampere and newer) after uncorrectable errors.
    RetiredPages(u64),
    /// The GPU temperature becomes this many °C.
    Temperature(u32),
}

/// Utilization trace and processes of one GPU (or one GPU instance on it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UtilizationFixture {
    /// GPU index.
    pub gpu: u32,
    /// When set, the trace is of this GPU instance (MIG), reported through GPM.
    #[serde(default)]
    pub gpu_instance: Option<u32>,
    /// Busy periods; outside them the GPU is idle (0 %).
    #[serde(default)]
    pub busy: Vec<BusyPeriod>,
    /// Processes using the GPU.
    #[serde(default)]
    pub processes: Vec<ProcessFixture>,
}

/// A period with the given utilization.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BusyPeriod {
    /// Start, seconds since start (inclusive).
    pub from: f64,
    /// End, seconds since start (exclusive); open-ended when missing.
    #[serde(default)]
    pub to: Option<f64>,
    /// SM utilization in percent.
    pub gpu: u32,
    /// Memory-controller utilization in percent.
    #[serde(default)]
    pub memory: u32,
}

/// A compute process on a GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProcessFixture {
    /// Process ID.
    pub pid: u32,
    /// GPU memory used, MiB.
    #[serde(default)]
    pub used_memory_mib: u64,
    /// Start, seconds since start.
    #[serde(default)]
    pub from: f64,
    /// End, seconds since start; runs forever when missing.
    #[serde(default)]
    pub to: Option<f64>,
    /// GPU instance the process runs in (MIG).
    #[serde(default)]
    pub gpu_instance: Option<u32>,
    /// Compute instance the process runs in (MIG).
    #[serde(default)]
    pub compute_instance: Option<u32>,
}

/// Errors of the simulated node, one per NVML return code it can produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// `NVML_ERROR_INVALID_ARGUMENT`
    InvalidArgument(String),
    /// `NVML_ERROR_NOT_SUPPORTED`
    NotSupported(String),
    /// `NVML_ERROR_NOT_FOUND`
    NotFound(String),
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`
    InsufficientResources(String),
    /// `NVML_ERROR_IN_USE`
    InUse(String),
    /// `NVML_ERROR_GPU_IS_LOST`
    GpuIsLost(u32),
    /// `NVML_ERROR_RESET_REQUIRED`
    ResetRequired(String),
    /// A fixture or state file that cannot be read (NVML has no equivalent; the fake fails
    /// `nvmlInit` with `NVML_ERROR_DRIVER_NOT_LOADED`).
    Fixture(String),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            SimError::NotSupported(m) => write!(f, "not supported: {m}"),
            SimError::NotFound(m) => write!(f, "not found: {m}"),
            SimError::InsufficientResources(m) => write!(f, "insufficient resources: {m}"),
            SimError::InUse(m) => write!(f, "in use: {m}"),
            SimError::GpuIsLost(i) => write!(f, "GPU {i} has fallen off the bus"),
            SimError::ResetRequired(m) => write!(f, "reset required: {m}"),
            SimError::Fixture(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for SimError {}

type SimResult<T> = Result<T, SimError>;

// ---------------------------------------------------------------------------------------------
// GPU models the simulator knows
// ---------------------------------------------------------------------------------------------

/// NVML `nvmlDeviceArchitecture_t` values (nvml.h `NVML_DEVICE_ARCH_*`).
pub mod arch {
    /// Turing
    pub const TURING: u32 = 6;
    /// Ampere
    pub const AMPERE: u32 = 7;
    /// Ada Lovelace
    pub const ADA: u32 = 8;
    /// Hopper
    pub const HOPPER: u32 = 9;
}

/// Static facts about a GPU model (from NVIDIA's product pages and `nvidia-smi` on the boards;
/// memory totals are what NVML's `nvmlDeviceGetMemoryInfo` reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelInfo {
    /// Fixture key.
    pub key: &'static str,
    /// Name NVML reports.
    pub product_name: &'static str,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// `NVML_DEVICE_ARCH_*`.
    pub architecture: u32,
    /// CUDA compute capability.
    pub compute_capability: (u32, u32),
    /// PCI device ID (`device << 16 | 0x10DE`).
    pub pci_device_id: u32,
    /// Whether the board has ECC memory.
    pub ecc: bool,
    /// Catalog key of the MIG profiles, if MIG-capable.
    pub mig_catalog: Option<&'static str>,
    /// Whether enabling/disabling MIG needs a GPU reset (Ampere) or applies at once (Hopper).
    pub mig_mode_needs_reset: bool,
    /// Most MIG devices the GPU can hold (`nvmlDeviceGetMaxMigDeviceCount`).
    pub max_mig_devices: u32,
}

/// Models a fixture may name.
pub const MODEL_INFOS: &[ModelInfo] = &[
    ModelInfo {
        key: "H100-SXM5-80GB",
        product_name: "NVIDIA H100 80GB HBM3",
        memory_mib: 81559,
        architecture: arch::HOPPER,
        compute_capability: (9, 0),
        pci_device_id: 0x2330_10DE,
        ecc: true,
        mig_catalog: Some("H100-80GB"),
        mig_mode_needs_reset: false,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "H200-SXM5-141GB",
        product_name: "NVIDIA H200",
        memory_mib: 143771,
        architecture: arch::HOPPER,
        compute_capability: (9, 0),
        pci_device_id: 0x2335_10DE,
        ecc: true,
        mig_catalog: Some("H200-141GB"),
        mig_mode_needs_reset: false,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "A100-SXM4-80GB",
        product_name: "NVIDIA A100-SXM4-80GB",
        memory_mib: 81920,
        architecture: arch::AMPERE,
        compute_capability: (8, 0),
        pci_device_id: 0x20B2_10DE,
        ecc: true,
        mig_catalog: Some("A100-80GB"),
        mig_mode_needs_reset: true,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "A100-SXM4-40GB",
        product_name: "NVIDIA A100-SXM4-40GB",
        memory_mib: 40960,
        architecture: arch::AMPERE,
        compute_capability: (8, 0),
        pci_device_id: 0x20B0_10DE,
        ecc: true,
        mig_catalog: Some("A100-40GB"),
        mig_mode_needs_reset: true,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "A30-24GB",
        product_name: "NVIDIA A30",
        memory_mib: 24576,
        architecture: arch::AMPERE,
        compute_capability: (8, 0),
        pci_device_id: 0x20B7_10DE,
        ecc: true,
        mig_catalog: Some("A30-24GB"),
        mig_mode_needs_reset: true,
        max_mig_devices: 4,
    },
    ModelInfo {
        key: "L4",
        product_name: "NVIDIA L4",
        memory_mib: 23034,
        architecture: arch::ADA,
        compute_capability: (8, 9),
        pci_device_id: 0x27B8_10DE,
        ecc: true,
        mig_catalog: None,
        mig_mode_needs_reset: false,
        max_mig_devices: 0,
    },
    ModelInfo {
        key: "RTX-4090",
        product_name: "NVIDIA GeForce RTX 4090",
        memory_mib: 24564,
        architecture: arch::ADA,
        compute_capability: (8, 9),
        pci_device_id: 0x2684_10DE,
        ecc: false,
        mig_catalog: None,
        mig_mode_needs_reset: false,
        max_mig_devices: 0,
    },
    ModelInfo {
        key: "T4",
        product_name: "Tesla T4",
        memory_mib: 15360,
        architecture: arch::TURING,
        compute_capability: (7, 5),
        pci_device_id: 0x1EB8_10DE,
        ecc: true,
        mig_catalog: None,
        mig_mode_needs_reset: false,
        max_mig_devices: 0,
    },
];

/// Finds a model by fixture key or NVML product name (case-insensitive).
pub fn model_info(name: &str) -> Option<&'static ModelInfo> {
    MODEL_INFOS.iter().find(|m| {
        m.key.eq_ignore_ascii_case(name.trim()) || m.product_name.eq_ignore_ascii_case(name.trim())
    })
}

impl ModelInfo {
    /// The MIG catalog entry, if MIG-capable.
    pub fn mig(&self) -> Option<&'static GpuModel> {
        self.mig_catalog.and_then(catalog::model_by_product_name)
    }
}

// ---------------------------------------------------------------------------------------------
// The node: the fixture resolved into GPUs
// ---------------------------------------------------------------------------------------------

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct SimGpu {
    /// Index (NVML enumeration order).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Model facts.
    pub model: &'static ModelInfo,
    /// PCI bus ID, `00000000:BB:DD.F`.
    pub pci_bus_id: String,
    /// Minor number of `/dev/nvidiaN`.
    pub minor: u32,
    /// NUMA node.
    pub numa_node: u32,
    /// Whether MIG mode is on at boot.
    pub mig_enabled_at_boot: bool,
    /// Temperature when no fault says otherwise.
    pub temperature_c: u32,
    /// Whether persistence mode is on.
    pub persistence_mode: bool,
}

/// A fixture resolved into GPUs; immutable.
#[derive(Debug, Clone)]
pub struct Node {
    /// The fixture it came from.
    pub fixture: Fixture,
    /// The GPUs, by index.
    pub gpus: Vec<SimGpu>,
}

/// A deterministic 128-bit hash (two FNV-1a 64 lanes), for generated UUIDs.
fn hash128(parts: &[&str]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (lane, seed) in [0xcbf2_9ce4_8422_2325u64, 0x8422_2325_cbf2_9ce4u64]
        .into_iter()
        .enumerate()
    {
        let mut h = seed;
        for part in parts {
            for b in part.bytes().chain(std::iter::once(0xff)) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out[lane * 8..lane * 8 + 8].copy_from_slice(&h.to_be_bytes());
    }
    out
}

fn uuid_text(prefix: &str, bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The UUID a MIG device gets: stable for (parent, GI, CI), as hardware keeps it while the
/// instances exist.
pub fn mig_uuid(parent_uuid: &str, gi: u32, ci: u32) -> String {
    uuid_text(
        "MIG",
        hash128(&[parent_uuid, &gi.to_string(), &ci.to_string()]),
    )
}

/// PCI buses of a DGX-style board, used for generated bus IDs.
const DGX_BUSES: &[u32] = &[0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];

impl Node {
    /// Reads and resolves a fixture file.
    pub fn load(path: &Path) -> SimResult<Node> {
        let text = fs::read_to_string(path)
            .map_err(|e| SimError::Fixture(format!("reading fixture {}: {e}", path.display())))?;
        let fixture: Fixture = serde_yaml::from_str(&text)
            .map_err(|e| SimError::Fixture(format!("parsing fixture {}: {e}", path.display())))?;
        Node::new(fixture)
            .map_err(|e| SimError::Fixture(format!("fixture {}: {e}", path.display())))
    }

    /// Resolves a fixture: models, UUIDs, bus IDs; checks indices in faults and topology.
    pub fn new(fixture: Fixture) -> SimResult<Node> {
        let bad = |m: String| SimError::Fixture(m);
        let mut gpus = Vec::new();
        for group in &fixture.gpus {
            let model = model_info(&group.model).ok_or_else(|| {
                bad(format!(
                    "unknown GPU model {:?}; known: {}",
                    group.model,
                    MODEL_INFOS
                        .iter()
                        .map(|m| m.key)
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            for n in 0..group.count {
                let index = gpus.len() as u32;
                let uuid = match group.uuids.get(n as usize) {
                    Some(u) if u.starts_with("GPU-") => u.clone(),
                    Some(u) => return Err(bad(format!("GPU UUID {u:?} does not start with GPU-"))),
                    None => uuid_text("GPU", hash128(&[&fixture.node, &index.to_string()])),
                };
                let pci_bus_id = match group.pci_bus_ids.get(n as usize) {
                    Some(b) => b.clone(),
                    None => {
                        let bus = DGX_BUSES
                            .get(index as usize)
                            .copied()
                            .unwrap_or(0x10 + index * 8);
                        format!("00000000:{bus:02X}:00.0")
                    }
                };
                if group.mig_enabled && model.mig_catalog.is_none() {
                    return Err(bad(format!("{} is not MIG-capable", model.key)));
                }
                gpus.push(SimGpu {
                    index,
                    uuid,
                    model,
                    pci_bus_id,
                    minor: index,
                    numa_node: fixture
                        .topology
                        .numa_nodes
                        .get(index as usize)
                        .copied()
                        .unwrap_or(0),
                    mig_enabled_at_boot: group.mig_enabled,
                    temperature_c: group.temperature_c,
                    persistence_mode: group.persistence_mode,
                });
            }
        }
        let count = gpus.len() as u32;
        let check = |what: &str, i: u32| {
            if i < count {
                Ok(())
            } else {
                Err(bad(format!(
                    "{what} names GPU {i}; the fixture has {count}"
                )))
            }
        };
        for f in &fixture.faults {
            check("a fault", f.gpu)?;
        }
        for u in &fixture.utilization {
            check("a utilization trace", u.gpu)?;
        }
        for group in fixture
            .topology
            .nvlink
            .iter()
            .chain(&fixture.topology.pcie_switches)
        {
            for &i in group {
                check("the topology", i)?;
            }
        }
        let mut uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
        uuids.sort();
        uuids.dedup();
        if uuids.len() != gpus.len() {
            return Err(bad("two GPUs share a UUID".to_owned()));
        }
        Ok(Node { fixture, gpus })
    }

    /// The GPU at `index`.
    pub fn gpu(&self, index: u32) -> SimResult<&SimGpu> {
        self.gpus
            .get(index as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("no GPU with index {index}")))
    }

    /// The GPU with this UUID.
    pub fn gpu_by_uuid(&self, uuid: &str) -> SimResult<&SimGpu> {
        self.gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| SimError::NotFound(format!("no GPU with UUID {uuid}")))
    }

    /// The state at boot: MIG modes as the fixture says, no instances, no injected faults.
    pub fn boot_state(&self) -> SimState {
        SimState {
            clock_s: None,
            gpus: self
                .gpus
                .iter()
                .map(|g| GpuState {
                    mig_current: g.mig_enabled_at_boot,
                    mig_pending: g.mig_enabled_at_boot,
                    gpu_instances: Vec::new(),
                })
                .collect(),
            injected: Vec::new(),
            next_seq: 0,
            clears: BTreeMap::new(),
        }
    }

    /// Whether two GPUs share an NVLink group.
    pub fn nvlink(&self, a: u32, b: u32) -> bool {
        a != b
            && self
                .fixture
                .topology
                .nvlink
                .iter()
                .any(|g| g.contains(&a) && g.contains(&b))
    }

    /// The NVML topology level (`nvmlGpuTopologyLevel_t`) of the closest common ancestor.
    pub fn topology_level(&self, a: u32, b: u32) -> SimResult<u32> {
        let (ga, gb) = (self.gpu(a)?, self.gpu(b)?);
        Ok(if a == b {
            topology::INTERNAL
        } else if self
            .fixture
            .topology
            .pcie_switches
            .iter()
            .any(|g| g.contains(&a) && g.contains(&b))
        {
            topology::SINGLE
        } else if ga.numa_node == gb.numa_node {
            topology::NODE
        } else {
            topology::SYSTEM
        })
    }
}

/// NVML `nvmlGpuTopologyLevel_t` values.
pub mod topology {
    /// Same board.
    pub const INTERNAL: u32 = 0;
    /// One PCIe switch.
    pub const SINGLE: u32 = 10;
    /// Several PCIe switches, no host bridge.
    pub const MULTIPLE: u32 = 20;
    /// One host bridge.
    pub const HOSTBRIDGE: u32 = 30;
    /// One NUMA node.
    pub const NODE: u32 = 40;
    /// Across NUMA nodes (SMP interconnect).
    pub const SYSTEM: u32 = 50;
}

// ---------------------------------------------------------------------------------------------
// Mutable state (kept in memory by SimBackend, in a JSON state file by the fake library)
// ---------------------------------------------------------------------------------------------

/// Everything that changes while a simulated node runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SimState {
    /// Simulated time in seconds, when a test pins it (the fake library's clock; `SimBackend`
    /// takes its time from its own clock instead).
    #[serde(default)]
    pub clock_s: Option<f64>,
    /// Per-GPU state, by index.
    pub gpus: Vec<GpuState>,
    /// Faults injected at runtime.
    #[serde(default)]
    pub injected: Vec<InjectedFault>,
    /// Sequence number of the next injected fault.
    #[serde(default)]
    pub next_seq: u64,
    /// Per GPU: the last time its faults were cleared (a reset), and the injected-fault
    /// sequence number at that time.
    #[serde(default)]
    pub clears: BTreeMap<u32, Clear>,
}

/// When a GPU's faults were last cleared.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Clear {
    /// Time of the clear.
    pub at: f64,
    /// Injected faults with a lower sequence number are cleared.
    pub seq: u64,
}

/// A fault injected at runtime.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InjectedFault {
    /// Order of injection.
    pub seq: u64,
    /// The fault; its `at` is the time of injection.
    pub fault: FaultFixture,
}

/// MIG state of one GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuState {
    /// MIG mode in effect.
    pub mig_current: bool,
    /// MIG mode after the next reset.
    pub mig_pending: bool,
    /// GPU instances.
    pub gpu_instances: Vec<GiState>,
}

/// A GPU instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GiState {
    /// GPU instance ID.
    pub id: u32,
    /// Profile ID (`info.id`).
    pub profile_id: u32,
    /// Placement start (memory slices).
    pub start: u32,
    /// Placement size (memory slices).
    pub size: u32,
    /// Compute instances.
    pub compute_instances: Vec<CiState>,
}

/// A compute instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CiState {
    /// Compute instance ID.
    pub id: u32,
    /// Profile ID (= NVML enum value).
    pub profile_id: u32,
    /// Placement start (compute slices within the GPU instance).
    pub start: u32,
    /// Placement size (compute slices).
    pub size: u32,
}

/// A MIG device (one compute instance) as enumeration shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SimMigDevice {
    /// Parent GPU index.
    pub gpu: u32,
    /// GPU instance ID.
    pub gi: u32,
    /// Compute instance ID.
    pub ci: u32,
    /// `MIG-…` UUID.
    pub uuid: String,
    /// GPU-instance profile.
    pub profile: &'static MigProfileSpec,
    /// Compute slices of the compute instance.
    pub ci_slices: u32,
}

impl SimMigDevice {
    /// Name as `nvidia-smi -L` shows it: `1g.10gb`, or `1c.3g.40gb` for a partial CI.
    pub fn name(&self) -> String {
        if self.ci_slices == self.profile.compute_slices {
            self.profile.name.to_owned()
        } else {
            format!("{}c.{}", self.ci_slices, self.profile.name)
        }
    }
}

/// A health event as NVML's event set would deliver it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimEvent {
    /// Identity, for at-most-once delivery per subscriber.
    pub key: EventKey,
    /// GPU index.
    pub gpu: u32,
    /// NVML event type bit (`nvmlEventType*`).
    pub event_type: u64,
    /// Event data (the Xid code for Xid events).
    pub data: u64,
    /// GPU instance, or `u32::MAX` when not attributed.
    pub gpu_instance: u32,
    /// Compute instance, or `u32::MAX` when not attributed.
    pub compute_instance: u32,
}

/// Which fault an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventKey {
    /// The fixture's fault at this position.
    Scripted(usize),
    /// The injected fault with this sequence number.
    Injected(u64),
}

/// NVML event type bits (`nvmlEventType*` in nvml.h).
pub mod event_type {
    /// `nvmlEventTypeSingleBitEccError`
    pub const SINGLE_BIT_ECC: u64 = 0x1;
    /// `nvmlEventTypeDoubleBitEccError`
    pub const DOUBLE_BIT_ECC: u64 = 0x2;
    /// `nvmlEventTypeXidCriticalError`
    pub const XID: u64 = 0x8;
}

/// Xid NVIDIA documents as "GPU has fallen off the bus".
pub const XID_FALLEN_OFF_BUS: u64 = 79;

/// Health counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimHealth {
    /// Volatile uncorrected ECC errors.
    pub ecc_uncorrected: u64,
    /// Volatile corrected ECC errors.
    pub ecc_corrected: u64,
    /// PCIe replay counter.
    pub pcie_replay: u64,
    /// Retired pages / remapped rows after uncorrectable errors.
    pub retired: u64,
    /// Temperature, °C.
    pub temperature_c: u32,
}

/// A process on a GPU at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimProcess {
    /// Process ID.
    pub pid: u32,
    /// Memory used, MiB.
    pub used_memory_mib: u64,
    /// GPU instance, if on a MIG device.
    pub gpu_instance: Option<u32>,
    /// Compute instance, if on a MIG device.
    pub compute_instance: Option<u32>,
}

impl SimState {
    fn gpu_mut(&mut self, index: u32) -> SimResult<&mut GpuState> {
        self.gpus
            .get_mut(index as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("no GPU with index {index}")))
    }

    fn gpu_ref(&self, index: u32) -> SimResult<&GpuState> {
        self.gpus
            .get(index as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("no GPU with index {index}")))
    }

    /// All faults (scripted and injected) active on `gpu` at `now`, in time order.
    fn active_faults<'a>(
        &'a self,
        node: &'a Node,
        gpu: u32,
        now: f64,
    ) -> impl Iterator<Item = (EventKey, &'a FaultFixture)> + 'a {
        let clear = self.clears.get(&gpu).copied();
        let scripted = node
            .fixture
            .faults
            .iter()
            .enumerate()
            .filter(move |(_, f)| f.gpu == gpu && f.at <= now && clear.is_none_or(|c| f.at > c.at))
            .map(|(i, f)| (EventKey::Scripted(i), f));
        let injected = self
            .injected
            .iter()
            .filter(move |f| {
                f.fault.gpu == gpu && f.fault.at <= now && clear.is_none_or(|c| f.seq >= c.seq)
            })
            .map(|f| (EventKey::Injected(f.seq), &f.fault));
        scripted.chain(injected)
    }

    /// Whether the GPU has fallen off the bus at `now`.
    pub fn is_lost(&self, node: &Node, gpu: u32, now: f64) -> bool {
        self.active_faults(node, gpu, now)
            .any(|(_, f)| f.fault == FaultKind::FallenOffBus)
    }

    /// Fails with `GpuIsLost` when the GPU has fallen off the bus.
    pub fn check_alive(&self, node: &Node, gpu: u32, now: f64) -> SimResult<()> {
        node.gpu(gpu)?;
        if self.is_lost(node, gpu, now) {
            Err(SimError::GpuIsLost(gpu))
        } else {
            Ok(())
        }
    }

    /// Health counters at `now`.
    pub fn health(&self, node: &Node, gpu: u32, now: f64) -> SimResult<SimHealth> {
        self.check_alive(node, gpu, now)?;
        let mut health = SimHealth {
            temperature_c: node.gpu(gpu)?.temperature_c,
            ..SimHealth::default()
        };
        for (_, f) in self.active_faults(node, gpu, now) {
            match f.fault {
                FaultKind::DoubleBitEcc(n) => health.ecc_uncorrected += n,
                FaultKind::SingleBitEcc(n) => health.ecc_corrected += n,
                FaultKind::PcieReplay(n) => health.pcie_replay += n,
                FaultKind::RetiredPages(n) => health.retired += n,
                FaultKind::Temperature(c) => health.temperature_c = c,
                FaultKind::Xid(_) | FaultKind::FallenOffBus => {}
            }
        }
        Ok(health)
    }

    /// Persistence mode at `now` (`nvmlDeviceGetPersistenceMode`): as the fixture says, unless
    /// the GPU is lost.
    pub fn persistence_mode(&self, node: &Node, gpu: u32, now: f64) -> SimResult<bool> {
        self.check_alive(node, gpu, now)?;
        Ok(node.gpu(gpu)?.persistence_mode)
    }

    /// Events of every GPU whose faults are active at `now`, in order; the caller remembers
    /// which keys it has delivered.
    pub fn events(&self, node: &Node, now: f64) -> Vec<SimEvent> {
        let mut out: Vec<(f64, SimEvent)> = Vec::new();
        for gpu in &node.gpus {
            for (key, f) in self.active_faults(node, gpu.index, now) {
                let (event_type, data) = match f.fault {
                    FaultKind::Xid(code) => (event_type::XID, code),
                    FaultKind::FallenOffBus => (event_type::XID, XID_FALLEN_OFF_BUS),
                    FaultKind::DoubleBitEcc(_) => (event_type::DOUBLE_BIT_ECC, 0),
                    FaultKind::SingleBitEcc(_) => (event_type::SINGLE_BIT_ECC, 0),
                    _ => continue,
                };
                out.push((
                    f.at,
                    SimEvent {
                        key,
                        gpu: gpu.index,
                        event_type,
                        data,
                        gpu_instance: f.gpu_instance.unwrap_or(u32::MAX),
                        compute_instance: f.compute_instance.unwrap_or(u32::MAX),
                    },
                ));
            }
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.key.cmp(&b.1.key)));
        out.into_iter().map(|(_, e)| e).collect()
    }

    /// Event types the GPU can deliver (`nvmlDeviceGetSupportedEventTypes`).
    pub fn supported_event_types(&self, node: &Node, gpu: u32) -> SimResult<u64> {
        let g = node.gpu(gpu)?;
        Ok(if g.model.ecc {
            event_type::XID | event_type::SINGLE_BIT_ECC | event_type::DOUBLE_BIT_ECC
        } else {
            event_type::XID
        })
    }

    /// Adds a fault now; returns its sequence number.
    pub fn inject(&mut self, node: &Node, mut fault: FaultFixture, now: f64) -> SimResult<u64> {
        node.gpu(fault.gpu)?;
        fault.at = now;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.injected.push(InjectedFault { seq, fault });
        Ok(seq)
    }

    /// Clears every fault of `gpu` up to `now`, as a GPU reset would, and applies a pending MIG
    /// mode change.
    pub fn reset_gpu(&mut self, node: &Node, gpu: u32, now: f64) -> SimResult<()> {
        node.gpu(gpu)?;
        let seq = self.next_seq;
        self.clears.insert(gpu, Clear { at: now, seq });
        let state = self.gpu_mut(gpu)?;
        if state.mig_current != state.mig_pending {
            state.gpu_instances.clear();
            state.mig_current = state.mig_pending;
        }
        Ok(())
    }

    /// Utilization (SM %, memory %) at `now`.
    pub fn utilization(&self, node: &Node, gpu: u32, now: f64) -> SimResult<(u32, u32)> {
        self.check_alive(node, gpu, now)?;
        Ok(node
            .fixture
            .utilization
            .iter()
            .filter(|u| u.gpu == gpu && u.gpu_instance.is_none())
            .flat_map(|u| &u.busy)
            .find(|p| p.from <= now && p.to.is_none_or(|to| now < to))
            .map(|p| (p.gpu.min(100), p.memory.min(100)))
            .unwrap_or((0, 0)))
    }

    /// Mean utilization (SM %, memory %) of a GPU instance over `[from, to]`, as GPM reports
    /// it between two samples; the value at `to` when the interval is empty.
    pub fn gpu_instance_utilization(
        &self,
        node: &Node,
        gpu: u32,
        gi: u32,
        from: f64,
        to: f64,
    ) -> SimResult<(f64, f64)> {
        self.gpu_instance(node, gpu, gi, to)?;
        let periods: Vec<&BusyPeriod> = node
            .fixture
            .utilization
            .iter()
            .filter(|u| u.gpu == gpu && u.gpu_instance == Some(gi))
            .flat_map(|u| &u.busy)
            .collect();
        if to <= from {
            return Ok(periods
                .iter()
                .find(|p| p.from <= to && p.to.is_none_or(|end| to < end))
                .map(|p| (f64::from(p.gpu.min(100)), f64::from(p.memory.min(100))))
                .unwrap_or((0.0, 0.0)));
        }
        let (mut sm, mut mem) = (0.0, 0.0);
        for p in periods {
            let overlap = (p.to.unwrap_or(f64::INFINITY).min(to) - p.from.max(from)).max(0.0);
            sm += overlap * f64::from(p.gpu.min(100));
            mem += overlap * f64::from(p.memory.min(100));
        }
        Ok((sm / (to - from), mem / (to - from)))
    }

    /// Compute processes at `now`. Processes attributed to a MIG device show only while that
    /// device exists.
    pub fn processes(&self, node: &Node, gpu: u32, now: f64) -> SimResult<Vec<SimProcess>> {
        self.check_alive(node, gpu, now)?;
        let state = self.gpu_ref(gpu)?;
        Ok(node
            .fixture
            .utilization
            .iter()
            .filter(|u| u.gpu == gpu)
            .flat_map(|u| &u.processes)
            .filter(|p| p.from <= now && p.to.is_none_or(|to| now < to))
            .filter(|p| match (p.gpu_instance, p.compute_instance) {
                (None, _) => !state.mig_current,
                (Some(gi), ci) => state.gpu_instances.iter().any(|g| {
                    g.id == gi
                        && g.compute_instances
                            .iter()
                            .any(|c| ci.is_none_or(|ci| c.id == ci))
                }),
            })
            .map(|p| SimProcess {
                pid: p.pid,
                used_memory_mib: p.used_memory_mib,
                gpu_instance: p.gpu_instance,
                compute_instance: p.gpu_instance.map(|_| p.compute_instance.unwrap_or(0)),
            })
            .collect())
    }

    /// MIG mode (current, pending).
    pub fn mig_mode(&self, node: &Node, gpu: u32, now: f64) -> SimResult<(bool, bool)> {
        self.check_alive(node, gpu, now)?;
        if node.gpu(gpu)?.model.mig_catalog.is_none() {
            return Err(SimError::NotSupported(format!(
                "GPU {gpu} is not MIG-capable"
            )));
        }
        let s = self.gpu_ref(gpu)?;
        Ok((s.mig_current, s.mig_pending))
    }

    /// Sets the MIG mode. Returns `Ok(None)` when it took effect, `Ok(Some(why))` when it is
    /// pending a GPU reset (NVML's activation status: `IN_USE` while processes run, otherwise
    /// `RESET_REQUIRED` on boards that need a reset).
    pub fn set_mig_mode(
        &mut self,
        node: &Node,
        gpu: u32,
        enabled: bool,
        now: f64,
    ) -> SimResult<Option<SimError>> {
        self.mig_mode(node, gpu, now)?;
        let busy = !self.processes(node, gpu, now)?.is_empty();
        let needs_reset = node.gpu(gpu)?.model.mig_mode_needs_reset;
        let state = self.gpu_mut(gpu)?;
        if !enabled && !state.gpu_instances.is_empty() {
            return Err(SimError::InUse(format!(
                "GPU {gpu} still has GPU instances; destroy them before disabling MIG"
            )));
        }
        state.mig_pending = enabled;
        if state.mig_current == enabled {
            return Ok(None);
        }
        if busy {
            return Ok(Some(SimError::InUse(format!(
                "GPU {gpu} has running processes"
            ))));
        }
        if needs_reset {
            return Ok(Some(SimError::ResetRequired(format!(
                "GPU {gpu} needs a reset to change MIG mode"
            ))));
        }
        state.mig_current = enabled;
        Ok(None)
    }

    fn mig_ready(&self, node: &Node, gpu: u32, now: f64) -> SimResult<&'static GpuModel> {
        self.check_alive(node, gpu, now)?;
        let model = node
            .gpu(gpu)?
            .model
            .mig()
            .ok_or_else(|| SimError::NotSupported(format!("GPU {gpu} is not MIG-capable")))?;
        if !self.gpu_ref(gpu)?.mig_current {
            return Err(SimError::NotSupported(format!(
                "MIG mode is not enabled on GPU {gpu}"
            )));
        }
        Ok(model)
    }

    /// The profile behind an NVML enum value (`nvmlDeviceGetGpuInstanceProfileInfo`). Answers
    /// whether or not MIG mode is on, as current drivers do.
    pub fn gi_profile_by_enum(
        &self,
        node: &Node,
        gpu: u32,
        nvml_profile: u32,
        now: f64,
    ) -> SimResult<&'static MigProfileSpec> {
        self.check_alive(node, gpu, now)?;
        let model = node
            .gpu(gpu)?
            .model
            .mig()
            .ok_or_else(|| SimError::NotSupported(format!("GPU {gpu} is not MIG-capable")))?;
        if nvml_profile >= catalog::nvml_gi_profile::COUNT {
            return Err(SimError::InvalidArgument(format!(
                "GPU instance profile {nvml_profile} is out of range"
            )));
        }
        model.profile_by_nvml_enum(nvml_profile).ok_or_else(|| {
            SimError::NotSupported(format!("{} has no profile {nvml_profile}", model.key))
        })
    }

    fn gi_profile_by_id(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
    ) -> SimResult<&'static MigProfileSpec> {
        let model = node
            .gpu(gpu)?
            .model
            .mig()
            .ok_or_else(|| SimError::NotSupported(format!("GPU {gpu} is not MIG-capable")))?;
        model.profile_by_id(profile_id).ok_or_else(|| {
            SimError::InvalidArgument(format!(
                "{} has no GPU instance profile ID {profile_id}",
                model.key
            ))
        })
    }

    /// Every placement the profile can take (`...PossiblePlacements`), regardless of what is
    /// already placed.
    pub fn gi_possible_placements(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
        now: f64,
    ) -> SimResult<Vec<(u32, u32)>> {
        self.mig_ready(node, gpu, now)?;
        let p = self.gi_profile_by_id(node, gpu, profile_id)?;
        Ok(p.placement_starts
            .iter()
            .map(|&s| (s, p.memory_slices))
            .collect())
    }

    /// How many more instances of the profile fit now (`...RemainingCapacity`).
    pub fn gi_remaining_capacity(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
        now: f64,
    ) -> SimResult<u32> {
        let model = self.mig_ready(node, gpu, now)?;
        let profile = self.gi_profile_by_id(node, gpu, profile_id)?;
        let mut placed = self.planned(node, gpu)?;
        let mut count = 0;
        while let Some(start) = self.free_start(model, &placed, profile) {
            placed.push(catalog::PlannedInstance { profile, start });
            count += 1;
        }
        Ok(count)
    }

    fn planned(&self, node: &Node, gpu: u32) -> SimResult<Vec<catalog::PlannedInstance>> {
        let state = self.gpu_ref(gpu)?;
        state
            .gpu_instances
            .iter()
            .map(|g| {
                Ok(catalog::PlannedInstance {
                    profile: self.gi_profile_by_id(node, gpu, g.profile_id)?,
                    start: g.start,
                })
            })
            .collect()
    }

    fn free_start(
        &self,
        model: &GpuModel,
        placed: &[catalog::PlannedInstance],
        profile: &'static MigProfileSpec,
    ) -> Option<u32> {
        let same = placed
            .iter()
            .filter(|p| p.profile.name == profile.name)
            .count() as u32;
        let compute: u32 = placed.iter().map(|p| p.profile.compute_slices).sum();
        if same >= profile.max_instances || compute + profile.compute_slices > model.compute_slices
        {
            return None;
        }
        profile
            .placement_starts
            .iter()
            .copied()
            .find(|&s| catalog::fits(placed, profile, s))
    }

    /// Creates a GPU instance, at `start` or at the first free placement. Returns its ID.
    pub fn create_gpu_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
        start: Option<u32>,
        now: f64,
    ) -> SimResult<u32> {
        let model = self.mig_ready(node, gpu, now)?;
        let profile = self.gi_profile_by_id(node, gpu, profile_id)?;
        let placed = self.planned(node, gpu)?;
        let start = match start {
            Some(s) => {
                if !profile.placement_starts.contains(&s) {
                    return Err(SimError::InvalidArgument(format!(
                        "{} cannot start at memory slice {s}",
                        profile.name
                    )));
                }
                let ok = catalog::fits(&placed, profile, s)
                    && placed.iter().map(|p| p.profile.compute_slices).sum::<u32>()
                        + profile.compute_slices
                        <= model.compute_slices
                    && (placed
                        .iter()
                        .filter(|p| p.profile.name == profile.name)
                        .count() as u32)
                        < profile.max_instances;
                if !ok {
                    return Err(SimError::InsufficientResources(format!(
                        "{} at {s} overlaps existing GPU instances on GPU {gpu}",
                        profile.name
                    )));
                }
                s
            }
            None => self.free_start(model, &placed, profile).ok_or_else(|| {
                SimError::InsufficientResources(format!(
                    "no room for {} on GPU {gpu}",
                    profile.name
                ))
            })?,
        };
        let state = self.gpu_mut(gpu)?;
        let id = (1..)
            .find(|id| state.gpu_instances.iter().all(|g| g.id != *id))
            .unwrap_or(u32::MAX);
        state.gpu_instances.push(GiState {
            id,
            profile_id,
            start,
            size: profile.memory_slices,
            compute_instances: Vec::new(),
        });
        state.gpu_instances.sort_by_key(|g| g.id);
        Ok(id)
    }

    /// The GPU instance with this ID.
    pub fn gpu_instance(&self, node: &Node, gpu: u32, gi: u32, now: f64) -> SimResult<&GiState> {
        self.mig_ready(node, gpu, now)?;
        self.gpu_ref(gpu)?
            .gpu_instances
            .iter()
            .find(|g| g.id == gi)
            .ok_or_else(|| SimError::NotFound(format!("GPU {gpu} has no GPU instance {gi}")))
    }

    /// GPU instances, optionally only of one profile.
    pub fn gpu_instances(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: Option<u32>,
        now: f64,
    ) -> SimResult<Vec<GiState>> {
        self.mig_ready(node, gpu, now)?;
        Ok(self
            .gpu_ref(gpu)?
            .gpu_instances
            .iter()
            .filter(|g| profile_id.is_none_or(|p| g.profile_id == p))
            .cloned()
            .collect())
    }

    /// Destroys a GPU instance that has no compute instances left.
    pub fn destroy_gpu_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        gi: u32,
        now: f64,
    ) -> SimResult<()> {
        let instance = self.gpu_instance(node, gpu, gi, now)?;
        if !instance.compute_instances.is_empty() {
            return Err(SimError::InUse(format!(
                "GPU instance {gi} on GPU {gpu} still has compute instances"
            )));
        }
        self.gpu_mut(gpu)?.gpu_instances.retain(|g| g.id != gi);
        Ok(())
    }

    /// Compute-instance profile by NVML enum value, for a GPU instance (`(ID, slices)`).
    pub fn ci_profile(
        &self,
        node: &Node,
        gpu: u32,
        gi: u32,
        ci_profile: u32,
        now: f64,
    ) -> SimResult<(u32, u32)> {
        let instance = self.gpu_instance(node, gpu, gi, now)?;
        let p = self.gi_profile_by_id(node, gpu, instance.profile_id)?;
        catalog::compute_instance_profiles(p.compute_slices)
            .into_iter()
            .find(|(id, _)| *id == ci_profile)
            .ok_or_else(|| {
                SimError::NotSupported(format!(
                    "{} has no compute instance profile {ci_profile}",
                    p.name
                ))
            })
    }

    /// Creates a compute instance in a GPU instance; returns its ID.
    pub fn create_compute_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        gi: u32,
        ci_profile: u32,
        now: f64,
    ) -> SimResult<u32> {
        let (_, slices) = self.ci_profile(node, gpu, gi, ci_profile, now)?;
        let gi_slices = {
            let instance = self.gpu_instance(node, gpu, gi, now)?;
            self.gi_profile_by_id(node, gpu, instance.profile_id)?
                .compute_slices
        };
        let state = self.gpu_mut(gpu)?;
        let instance = state
            .gpu_instances
            .iter_mut()
            .find(|g| g.id == gi)
            .ok_or_else(|| SimError::NotFound(format!("GPU {gpu} has no GPU instance {gi}")))?;
        let used: Vec<(u32, u32)> = instance
            .compute_instances
            .iter()
            .map(|c| (c.start, c.size))
            .collect();
        let start = (0..gi_slices)
            .step_by(slices as usize)
            .find(|&s| {
                s + slices <= gi_slices && used.iter().all(|&(us, uz)| s + slices <= us || us + uz <= s)
            })
            .ok_or_else(|| {
                SimError::InsufficientResources(format!(
                    "no room for a {slices}-slice compute instance in GPU instance {gi} on GPU {gpu}"
                ))
            })?;
        let id = (0..)
            .find(|id| instance.compute_instances.iter().all(|c| c.id != *id))
            .unwrap_or(u32::MAX);
        instance.compute_instances.push(CiState {
            id,
            profile_id: ci_profile,
            start,
            size: slices,
        });
        instance.compute_instances.sort_by_key(|c| c.id);
        Ok(id)
    }

    /// Destroys a compute instance; fails while a process runs on it.
    pub fn destroy_compute_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        gi: u32,
        ci: u32,
        now: f64,
    ) -> SimResult<()> {
        let instance = self.gpu_instance(node, gpu, gi, now)?;
        if !instance.compute_instances.iter().any(|c| c.id == ci) {
            return Err(SimError::NotFound(format!(
                "GPU instance {gi} on GPU {gpu} has no compute instance {ci}"
            )));
        }
        let busy = self
            .processes(node, gpu, now)?
            .iter()
            .any(|p| p.gpu_instance == Some(gi) && p.compute_instance == Some(ci));
        if busy {
            return Err(SimError::InUse(format!(
                "a process runs on compute instance {ci} of GPU instance {gi} on GPU {gpu}"
            )));
        }
        let state = self.gpu_mut(gpu)?;
        if let Some(instance) = state.gpu_instances.iter_mut().find(|g| g.id == gi) {
            instance.compute_instances.retain(|c| c.id != ci);
        }
        Ok(())
    }

    /// MIG devices (one per compute instance), ordered by (GI, CI).
    pub fn mig_devices(&self, node: &Node, gpu: u32, now: f64) -> SimResult<Vec<SimMigDevice>> {
        self.mig_ready(node, gpu, now)?;
        let parent = node.gpu(gpu)?;
        let mut out = Vec::new();
        for g in &self.gpu_ref(gpu)?.gpu_instances {
            let profile = self.gi_profile_by_id(node, gpu, g.profile_id)?;
            for c in &g.compute_instances {
                out.push(SimMigDevice {
                    gpu,
                    gi: g.id,
                    ci: c.id,
                    uuid: mig_uuid(&parent.uuid, g.id, c.id),
                    profile,
                    ci_slices: c.size,
                });
            }
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// State file (the fake library's persistence; also how tests drive the fake)
// ---------------------------------------------------------------------------------------------

/// A state file shared by every process that loads the fake library for the same fixture.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
    lock_path: PathBuf,
}

impl StateFile {
    /// The state file for a fixture: `<fixture>.state.json` next to it.
    pub fn for_fixture(fixture: &Path) -> StateFile {
        let mut name = fixture.as_os_str().to_owned();
        name.push(".state.json");
        StateFile::at(PathBuf::from(name))
    }

    /// A state file at an explicit path.
    pub fn at(path: PathBuf) -> StateFile {
        let mut lock = path.as_os_str().to_owned();
        lock.push(".lock");
        StateFile {
            path,
            lock_path: PathBuf::from(lock),
        }
    }

    /// Where the state lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> SimResult<File> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock_path)
            .map_err(|e| {
                SimError::Fixture(format!("opening lock {}: {e}", self.lock_path.display()))
            })?;
        file.lock()
            .map_err(|e| SimError::Fixture(format!("locking {}: {e}", self.lock_path.display())))?;
        Ok(file)
    }

    fn read_unlocked(&self, node: &Node) -> SimResult<SimState> {
        match fs::read_to_string(&self.path) {
            Ok(text) => {
                let state: SimState = serde_json::from_str(&text).map_err(|e| {
                    SimError::Fixture(format!("parsing state {}: {e}", self.path.display()))
                })?;
                if state.gpus.len() != node.gpus.len() {
                    return Err(SimError::Fixture(format!(
                        "state {} is for {} GPUs; the fixture has {}",
                        self.path.display(),
                        state.gpus.len(),
                        node.gpus.len()
                    )));
                }
                Ok(state)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(node.boot_state()),
            Err(e) => Err(SimError::Fixture(format!(
                "reading state {}: {e}",
                self.path.display()
            ))),
        }
    }

    /// Reads the state (the boot state when the file does not exist yet).
    pub fn read(&self, node: &Node) -> SimResult<SimState> {
        let _lock = self.lock()?;
        self.read_unlocked(node)
    }

    /// Read-modify-write under the lock; the file is replaced atomically, and only when the
    /// state changed.
    pub fn update<T>(
        &self,
        node: &Node,
        change: impl FnOnce(&mut SimState) -> SimResult<T>,
    ) -> SimResult<T> {
        let _lock = self.lock()?;
        let before = self.read_unlocked(node)?;
        let mut state = before.clone();
        let out = change(&mut state)?;
        if state != before {
            let text = serde_json::to_string_pretty(&state)
                .map_err(|e| SimError::Fixture(format!("encoding state: {e}")))?;
            let mut tmp = self.path.as_os_str().to_owned();
            tmp.push(".tmp");
            let tmp = PathBuf::from(tmp);
            let write = |p: &Path| -> std::io::Result<()> {
                let mut f = File::create(p)?;
                f.write_all(text.as_bytes())?;
                f.sync_all()
            };
            write(&tmp)
                .and_then(|()| fs::rename(&tmp, &self.path))
                .map_err(|e| {
                    SimError::Fixture(format!("writing state {}: {e}", self.path.display()))
                })?;
        }
        Ok(out)
    }
}
