//! The fixture format: a simulated node as a YAML file describes it (documented in
//! `device-plugin/fixtures/README.md`).

use serde::{Deserialize, Serialize};

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
    /// Which GPUs the fake `libnvidia-ml.so` enumerates for the process that loads it (read by
    /// the fake only; `SimBackend` always sees every GPU).
    #[serde(default)]
    pub device_nodes: DeviceNodes,
    /// The PID namespace the fixture's processes run in, as `readlink /proc/self/ns/pid` prints
    /// it (`pid:[4026531836]`). Read by the fake `libnvidia-ml.so` only: like the driver, it
    /// lists processes only to a caller in that namespace, so an agent without `hostPID` sees
    /// none. Unset, every caller sees them (`SimBackend` always does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_namespace: Option<String>,
}

/// How the fake `libnvidia-ml.so` decides which GPUs the calling process sees.
///
/// The real driver enumerates only the GPUs whose `/dev/nvidia<minor>` the process can open, so
/// a container given two GPUs of eight sees two, indexed 0 and 1. The device directory is
/// `/dev` unless `GPUPOOL_FAKE_NVML_DEV_DIR` names another.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DeviceNodes {
    /// Only GPUs whose `<dev dir>/nvidia<minor>` is a character device, as the driver does.
    #[default]
    CharDevices,
    /// GPUs whose `<dev dir>/nvidia<minor>` exists as any file: fake driver roots make plain
    /// files, and unprivileged tests cannot make device nodes.
    Files,
    /// Every GPU in the fixture, device nodes or not: for hosts without any (CI, the
    /// conformance suite, agents the e2e harness runs on the host).
    Ignored,
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
    /// The process's own SM utilization, percent (NVML's per-process samples); absent or 0:
    /// no sample, as NVML reports a process that did not run.
    #[serde(default)]
    pub sm_util: u32,
}
