//! Pool-level policies: driver validation, CDI generation, MIG layout and idle reclamation.
//!
//! These types are shared by [`GpuPool`](crate::GpuPool) (what the user writes) and, where
//! the node needs them, by [`GpuNode`](crate::GpuNode) (what the operator resolves per node).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::KubeSchema;
use kube::core::Duration;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// Every MIG profile name that some supported GPU model offers (from the catalog). The CEL
/// rule on layouts rejects any other name at admission; whether a profile exists on a *given*
/// model is checked per node by the operator, since the model is only known from the node.
pub use gpupool_mig_catalog::ALL_PROFILE_NAMES as KNOWN_MIG_PROFILES;

/// Presets that need no profile name.
pub const FIXED_MIG_PRESETS: &[&str] = &["all-disabled", "all-enabled", "all-balanced"];

/// Annotation a pod owner sets to opt a pod out of reclamation: `disabled`, or
/// `disabled-until=<RFC 3339 time>` for an opt-out that expires.
pub const RECLAIM_OPT_OUT_ANNOTATION: &str = "gpupool.io/reclaim";

fn cel_string_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("'{s}'")).collect();
    format!("[{}]", quoted.join(", "))
}

/// CEL: a path field must be absolute and free of `..` components.
fn absolute_path_rule(field: &str) -> kube::core::Rule {
    kube::core::Rule::new("self.startsWith('/') && !self.split('/').exists(p, p == '..')").message(
        kube::core::Message::Message(format!(
            "{field} must be an absolute path without '..' components, e.g. /var/run/cdi"
        )),
    )
}

fn profile_names_rule() -> kube::core::Rule {
    kube::core::Rule::new(format!(
        "self.all(k, k in {})",
        cel_string_list(KNOWN_MIG_PROFILES)
    ))
    .message(kube::core::Message::Message(format!(
        "unknown MIG profile name; valid names are: {}",
        KNOWN_MIG_PROFILES.join(", ")
    )))
}

fn profile_fit_rule() -> kube::core::Rule {
    // Names that are not `<n>g.…` count 0 here: the names rule rejects them, and `int()` on
    // them would fail the evaluation instead of giving a message.
    kube::core::Rule::new(
        "self.map(k, k.matches('^[0-9]g[.]') ? int(k.split('g.')[0]) * self[k] : 0).sum() <= 7",
    )
    .message(
        "the profiles need more than the 7 compute slices a GPU has: lower the counts \
         (the leading number of a profile name is its compute slices, e.g. 3g.40gb uses 3)",
    )
}

fn profile_count_rule() -> kube::core::Rule {
    kube::core::Rule::new("self.all(k, self[k] >= 1 && self[k] <= 7)")
        .message("each profile count must be between 1 and 7")
}

fn preset_rule() -> kube::core::Rule {
    kube::core::Rule::new(format!(
        "self in {} || (self.startsWith('all-') && self.substring(4) in {})",
        cel_string_list(FIXED_MIG_PRESETS),
        cel_string_list(KNOWN_MIG_PROFILES)
    ))
    .message(
        "unknown MIG preset: use all-disabled, all-enabled, all-balanced, or all-<profile> \
         such as all-1g.10gb",
    )
}

// ---------------------------------------------------------------------------------------------
// Driver validation
// ---------------------------------------------------------------------------------------------

/// Driver requirements and the health checks a node must pass to serve GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverPolicy {
    /// Lowest acceptable NVIDIA driver version, e.g. `550.54.15` (one to three dot-separated numbers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+){0,2}$"))]
    pub min_version: Option<String>,

    /// CUDA version the pool's workloads need, e.g. `12.4`. The driver's supported CUDA version
    /// must be at least this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+\.[0-9]+$"))]
    pub cuda_version: Option<String>,

    /// Health checks the node agent runs. Defaults to all of them.
    #[serde(default = "DriverCheck::all")]
    #[schemars(length(max = 16))]
    pub checks: Vec<DriverCheck>,

    /// A PCIe replay counter at or above this fails the `PCIeReplay` check.
    #[serde(default = "default_pcie_replay_threshold")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub pcie_replay_threshold: u32,

    /// What a failed check does: `Report` only reports it; `Taint` also taints the node
    /// `gpupool.io/driver-invalid:NoSchedule` until it passes again.
    #[serde(default)]
    pub on_failure: OnFailure,
}

impl Default for DriverPolicy {
    fn default() -> Self {
        Self {
            min_version: None,
            cuda_version: None,
            checks: DriverCheck::all(),
            pcie_replay_threshold: default_pcie_replay_threshold(),
            on_failure: OnFailure::default(),
        }
    }
}

fn default_pcie_replay_threshold() -> u32 {
    100
}

/// A driver or device health check.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum DriverCheck {
    /// NVML loads and initialises.
    #[serde(rename = "NVMLInit")]
    NvmlInit,
    /// `/proc/driver/nvidia/version` exists: the kernel module is loaded.
    KernelModule,
    /// `/dev/nvidiactl`, `/dev/nvidia-uvm` and `/dev/nvidiaN` per GPU exist under the driver root.
    DeviceNodes,
    /// No GPU reports uncorrected (double-bit) ECC errors.
    #[serde(rename = "ECCErrors")]
    EccErrors,
    /// No GPU's PCIe replay counter reaches `pcieReplayThreshold`.
    #[serde(rename = "PCIeReplay")]
    PcieReplay,
    /// No fatal Xid error since boot.
    XidErrors,
    /// Persistence mode is on for every GPU.
    PersistenceMode,
}

impl DriverCheck {
    /// Every check, in the order the agent runs them.
    pub fn all() -> Vec<DriverCheck> {
        vec![
            DriverCheck::NvmlInit,
            DriverCheck::KernelModule,
            DriverCheck::DeviceNodes,
            DriverCheck::EccErrors,
            DriverCheck::PcieReplay,
            DriverCheck::XidErrors,
            DriverCheck::PersistenceMode,
        ]
    }
}

/// What a failed driver check does to the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum OnFailure {
    /// Report the failure in status and Events only.
    #[default]
    Report,
    /// Also taint the node `gpupool.io/driver-invalid:NoSchedule` until it passes.
    Taint,
}

// ---------------------------------------------------------------------------------------------
// CDI
// ---------------------------------------------------------------------------------------------

/// How the node agent generates the node's CDI spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct CdiPolicy {
    /// Write a CDI spec on each node. When false, an existing spec written by gpupool is removed.
    #[serde(default = "default_true")]
    pub enabled: bool,

    /// Directory the spec is written to; the container runtime must read CDI specs from it.
    #[serde(default = "default_spec_dir")]
    #[x_kube(validation = absolute_path_rule("cdi.specDir"))]
    #[x_kube(validation = kube::core::Rule::new(
        "self.matches('^(/etc/cdi|/var/run/cdi|/run/cdi)(/[^/]+)*/?$')"
    ).message(kube::core::Message::Message(
        "cdi.specDir must be /etc/cdi, /var/run/cdi or /run/cdi (or a directory under one): the \
         agent writes there as root, and a container runtime reads CDI specs only from such \
         directories".into()
    )))]
    #[schemars(length(max = 256))]
    pub spec_dir: String,

    /// Root of the driver installation on the host (`/` for a host-installed driver,
    /// `/run/nvidia/driver` for a containerized one).
    #[serde(default = "default_driver_root")]
    #[x_kube(validation = absolute_path_rule("cdi.driverRoot"))]
    // On every object that carries a CdiPolicy, GpuNodes too: one spelling per path, so the
    // rules below (and the agents' list of trusted roots) cannot be passed by `//proc` or
    // `/./proc`.
    #[x_kube(validation = kube::core::Rule::new(
        "!self.contains('//') && !self.split('/').exists(p, p == '.') && (self == '/' || !self.endsWith('/'))"
    ).message(kube::core::Message::Message(
        "cdi.driverRoot must be written without '//' or '.' components and without a trailing \
         '/', e.g. /run/nvidia/driver (//proc and /./proc are /proc)".into()
    )))]
    #[x_kube(validation = kube::core::Rule::new(
        "!['/proc', '/sys', '/dev', '/etc', '/var/lib/kubelet'].exists(p, self == p || self.startsWith(p + '/'))"
    ).message(kube::core::Message::Message(
        "cdi.driverRoot must be where the driver is installed, / or e.g. /run/nvidia/driver; \
         not under /proc, /sys, /dev, /etc or /var/lib/kubelet".into()
    )))]
    #[schemars(length(max = 256))]
    pub driver_root: String,

    /// CDI kind (`vendor/class`) of the devices, e.g. `gpupool.io/gpu`. Pods then get devices
    /// named `gpupool.io/gpu=0`.
    #[serde(default = "default_cdi_kind")]
    #[schemars(
        regex(
            pattern = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$"
        ),
        length(max = 128)
    )]
    pub kind: String,

    /// Names each GPU gets in the spec: `index` (`0`, `0:1` for MIG) and/or `uuid` (`GPU-…`, `MIG-…`).
    #[serde(default = "CdiDeviceNameStrategy::all")]
    #[schemars(length(min = 1, max = 2))]
    pub device_name_strategies: Vec<CdiDeviceNameStrategy>,
}

impl Default for CdiPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            spec_dir: default_spec_dir(),
            driver_root: default_driver_root(),
            kind: default_cdi_kind(),
            device_name_strategies: CdiDeviceNameStrategy::all(),
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_spec_dir() -> String {
    "/var/run/cdi".into()
}
fn default_driver_root() -> String {
    "/".into()
}
fn default_cdi_kind() -> String {
    "gpupool.io/gpu".into()
}

/// How devices are named in the CDI spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CdiDeviceNameStrategy {
    /// By index: `0`, `1`, and `<gpu>:<mig>` for MIG devices.
    Index,
    /// By UUID: `GPU-…`, `MIG-…`.
    Uuid,
}

impl CdiDeviceNameStrategy {
    /// Both strategies (the default), matching `nvidia-ctk cdi generate`.
    pub fn all() -> Vec<CdiDeviceNameStrategy> {
        vec![CdiDeviceNameStrategy::Index, CdiDeviceNameStrategy::Uuid]
    }
}

// ---------------------------------------------------------------------------------------------
// MIG
// ---------------------------------------------------------------------------------------------

/// How GPUs are partitioned and advertised.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "self.strategy != 'mixed' || (has(self.layout) && (has(self.layout.preset) ? !(self.layout.preset in ['all-disabled', 'all-enabled']) : self.layout.custom.exists(e, size(e.profiles) > 0)))"
).message("strategy mixed advertises nvidia.com/mig-<profile> resources, so mig.layout must name at least one profile (a preset other than all-disabled or all-enabled, or a custom entry with profiles)"))]
#[x_kube(validation = kube::core::Rule::new(
    "self.strategy != 'single' || !has(self.layout) || !has(self.layout.preset) || self.layout.preset != 'all-balanced'"
).message("strategy single advertises one profile as nvidia.com/gpu, so it cannot use the all-balanced preset, which mixes profiles: use mixed, or a preset all-<profile>"))]
#[x_kube(validation = kube::core::Rule::new(
    "self.strategy != 'single' || !has(self.layout) || !has(self.layout.preset) || self.layout.preset != 'all-enabled'"
).message("strategy single advertises the GPUs' MIG devices as nvidia.com/gpu, and the all-enabled preset creates none, so nothing would be advertised: use a preset all-<profile> such as all-1g.10gb"))]
#[x_kube(validation = kube::core::Rule::new(
    "self.strategy != 'single' || !has(self.layout) || !has(self.layout.custom) || self.layout.custom.all(e, (has(e.enabled) && !e.enabled) || (has(e.profiles) && size(e.profiles) == 1))"
).message("strategy single advertises one MIG profile as nvidia.com/gpu, so each mig.layout.custom entry with MIG enabled must name exactly one profile, e.g. {1g.10gb: 7}: use strategy mixed for several profiles"))]
pub struct MigPolicy {
    /// How MIG devices are advertised to the kubelet, as NVIDIA's device plugin does:
    /// `none` (whole GPUs as `nvidia.com/gpu`), `single` (the one MIG profile as `nvidia.com/gpu`),
    /// `mixed` (`nvidia.com/mig-<profile>` per profile).
    #[serde(default)]
    pub strategy: MigStrategy,

    /// The wanted partitioning. Absent: gpupool leaves MIG as it finds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<MigLayout>,

    /// How many of the pool's nodes may change their MIG layout at once (drain, then apply).
    /// A layout edit rolls over the nodes in name order, the next node starting when one
    /// reports `Applied` or `Failed`, so that one edit never drains the whole pool. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_unavailable: Option<u32>,
}

impl MigPolicy {
    /// [`MigPolicy::max_unavailable`], defaulted.
    pub fn max_unavailable(&self) -> u32 {
        self.max_unavailable.unwrap_or(1).max(1)
    }
}

/// MIG advertising strategy (NVIDIA's naming).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// Whole GPUs only.
    #[default]
    None,
    /// All MIG devices on a node share one profile and are advertised as `nvidia.com/gpu`.
    Single,
    /// Each profile is its own resource, `nvidia.com/mig-<profile>`.
    Mixed,
}

/// A MIG layout: a named preset or a custom list, exactly one of the two.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("has(self.preset) != has(self.custom)")
    .message("mig.layout needs exactly one of preset or custom"))]
pub struct MigLayout {
    /// A named layout for every GPU: `all-disabled`, `all-enabled` (MIG on, no instances),
    /// `all-balanced` (a mix per model), or `all-<profile>` (as many of one profile as fit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = preset_rule())]
    #[schemars(length(max = 32))]
    pub preset: Option<String>,

    /// Entries applied in order; the first entry that matches a GPU (by index and model) wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16))]
    #[x_kube(validation = kube::core::Rule::new(
        "self.all(e, has(e.gpus) || has(e.models)) || (self.filter(e, !has(e.gpus) && !has(e.models)).size() == 1 && !has(self[self.size() - 1].gpus) && !has(self[self.size() - 1].models))"
    ).message(
        "mig.layout.custom: an entry with neither gpus nor models matches every GPU, so the \
         entries after it would never apply: keep one such entry, and make it the last"
    ))]
    pub custom: Option<Vec<MigLayoutEntry>>,
}

/// One rule of a custom MIG layout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.enabled || size(self.profiles) == 0")
    .message("an entry with enabled: false turns MIG off, so it cannot list profiles"))]
pub struct MigLayoutEntry {
    /// GPU indices this entry applies to. Absent: every GPU (an empty list would match none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), inner(range(max = 63)))]
    #[x_kube(validation = kube::core::Rule::new("self.all(g, self.exists_one(x, x == g))")
        .message("mig.layout.custom[].gpus lists a GPU index twice"))]
    pub gpus: Option<Vec<u32>>,

    /// GPU product names this entry applies to, as in the `nvidia.com/gpu.product` label
    /// (e.g. `NVIDIA-H100-80GB-HBM3`). Absent: every model (an empty list would match none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 16),
        inner(
            length(max = 63),
            regex(pattern = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
        )
    )]
    #[x_kube(validation = kube::core::Rule::new("self.all(m, self.exists_one(x, x == m))")
        .message("mig.layout.custom[].models lists a model twice"))]
    pub models: Option<Vec<String>>,

    /// Whether MIG mode is on for these GPUs.
    #[serde(default = "default_true")]
    pub enabled: bool,

    /// MIG profiles and how many of each, e.g. `{"1g.10gb": 7}` or `{"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}`.
    #[serde(default)]
    #[x_kube(validation = profile_names_rule())]
    #[x_kube(validation = profile_count_rule())]
    #[x_kube(validation = profile_fit_rule())]
    #[schemars(extend("maxProperties" = 16))]
    pub profiles: BTreeMap<String, u32>,
}

// ---------------------------------------------------------------------------------------------
// Sharing
// ---------------------------------------------------------------------------------------------

/// Sharing GPUs between pods. Absent: every GPU (and MIG device) goes to one pod at a time.
/// Time-slicing and MPS may both be set when they apply to different GPUs (disjoint `gpus`
/// or `models`), so one pool can time-slice its small cards and run MPS on its large ones.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "!has(self.timeSlicing) || !has(self.mps) \
     || (has(self.timeSlicing.gpus) && has(self.mps.gpus) && self.timeSlicing.gpus.all(g, !(g in self.mps.gpus))) \
     || (has(self.timeSlicing.models) && has(self.mps.models) && self.timeSlicing.models.all(m, !(m in self.mps.models)))"
).message(kube::core::Message::Message(
    "sharing.timeSlicing and sharing.mps would both apply to the same GPUs: give both a gpus \
     list with no index in common, or both a models list with no model in common".into()
)))]
pub struct SharingPolicy {
    /// Time-slicing: each selected device is advertised `replicas` times and the pods given
    /// its replicas take turns on it. No isolation: they share the GPU's memory (one can run
    /// the others out of memory) and its faults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<TimeSlicingPolicy>,

    /// MPS (CUDA Multi-Process Service): each selected whole GPU runs one MPS control daemon
    /// and is advertised `replicas` times; the pods given its replicas run their kernels side
    /// by side, each capped in device memory and in the share of the GPU's threads it may use.
    /// Memory is isolated by the caps; faults are not (one client's fatal error can end the
    /// others' work on that GPU). Whole GPUs only: MIG devices are never shared by MPS here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsPolicy>,
}

/// MPS sharing, as NVIDIA's device plugin configures it (`sharing.mps`), with the per-client
/// limits stated rather than implied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MpsPolicy {
    /// Pods per GPU, 2–48 (an MPS server takes at most 48 clients per GPU).
    #[schemars(range(min = 2, max = 48))]
    pub replicas: u32,

    /// Advertise MPS capacity under `nvidia.com/gpu.shared` (NVIDIA's `renameByDefault`).
    #[serde(default)]
    pub rename_by_default: bool,

    /// Refuse a container that asks for more than one replica (NVIDIA's
    /// `failRequestsGreaterThanOne`; each replica carries the same per-client limits, so two
    /// would not double them).
    #[serde(default = "default_true")]
    pub fail_requests_greater_than_one: bool,

    /// Where a container's replicas go on the node: `Spread` (default) or `Pack`.
    #[serde(default)]
    pub placement: SharePlacement,

    /// Device memory each client may pin, in Mi or Gi (e.g. `10Gi`). Absent: the GPU's memory
    /// divided by `replicas`, so the clients together cannot run each other out of memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[1-9][0-9]{0,6}(Mi|Gi)$"))]
    pub memory_limit: Option<String>,

    /// Share of the GPU's threads each client may use, 1–100 percent. Absent: 100 divided by
    /// `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub active_thread_percentage: Option<u32>,

    /// Only these GPU indices. Absent: every whole (non-MIG) GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), inner(range(max = 63)))]
    #[x_kube(validation = kube::core::Rule::new("self.all(g, self.exists_one(x, x == g))")
        .message("sharing.mps.gpus lists a GPU index twice"))]
    pub gpus: Option<Vec<u32>>,

    /// Only nodes whose GPUs are one of these products (`nvidia.com/gpu.product`, e.g.
    /// `NVIDIA-H100-80GB-HBM3`). Absent: every model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 16),
        inner(
            length(max = 63),
            regex(pattern = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
        )
    )]
    pub models: Option<Vec<String>>,
}

/// Where `GetPreferredAllocation` puts a container's shared replicas among the node's free
/// ones. A preference within the node: the scheduler picks the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SharePlacement {
    /// Across devices, the one with the most replicas free first: fewer neighbours per pod.
    #[default]
    Spread,
    /// The busiest device with a replica free first: whole GPUs stay free longer.
    Pack,
}

impl MpsPolicy {
    /// The per-client memory limit in MiB, from `memory_limit` (`None` when absent or, which
    /// admission prevents, unparsable).
    pub fn memory_limit_mib(&self) -> Option<u64> {
        let s = self.memory_limit.as_deref()?;
        let (n, mult) = if let Some(n) = s.strip_suffix("Gi") {
            (n, 1024)
        } else {
            (s.strip_suffix("Mi")?, 1)
        };
        n.parse::<u64>().ok().map(|n| n * mult)
    }
}

/// Time-slicing, as NVIDIA's device plugin configures it (`sharing.timeSlicing`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TimeSlicingPolicy {
    /// Pods per shared device, 2–64 (NVIDIA's `resources[].replicas`).
    #[schemars(range(min = 2, max = 64))]
    pub replicas: u32,

    /// Advertise shared capacity under `<resource>.shared` (e.g. `nvidia.com/gpu.shared`) so
    /// quotas and pod specs can tell it from whole devices (NVIDIA's `renameByDefault`).
    #[serde(default)]
    pub rename_by_default: bool,

    /// Refuse a container that asks for more than one replica: two replicas of a time-sliced
    /// GPU give it no more compute than one (NVIDIA's `failRequestsGreaterThanOne`).
    #[serde(default = "default_true")]
    pub fail_requests_greater_than_one: bool,

    /// Where a container's replicas go on the node: `Spread` (default; quietest device first)
    /// or `Pack` (busiest device with room first, keeping whole GPUs free).
    #[serde(default)]
    pub placement: SharePlacement,

    /// The resources to share, e.g. `[nvidia.com/gpu]` or `[nvidia.com/mig-1g.10gb]`. Absent:
    /// all that the node advertises.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 16),
        inner(
            length(max = 63),
            regex(pattern = r"^nvidia\.com/(gpu|mig-[0-9]+g\.[0-9]+gb(\.[a-z0-9]+)*)$")
        )
    )]
    #[x_kube(validation = kube::core::Rule::new("self.all(r, self.exists_one(x, x == r))")
        .message("sharing.timeSlicing.resources lists a resource twice"))]
    pub resources: Option<Vec<String>>,

    /// Only these GPU indices (and the MIG devices on them). Absent: every GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), inner(range(max = 63)))]
    #[x_kube(validation = kube::core::Rule::new("self.all(g, self.exists_one(x, x == g))")
        .message("sharing.timeSlicing.gpus lists a GPU index twice"))]
    pub gpus: Option<Vec<u32>>,

    /// Only nodes whose GPUs are one of these products, as in the `nvidia.com/gpu.product`
    /// label (e.g. `NVIDIA-L4`). Absent: every model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 16),
        inner(
            length(max = 63),
            regex(pattern = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
        )
    )]
    pub models: Option<Vec<String>>,
}

// ---------------------------------------------------------------------------------------------
// Reclaim
// ---------------------------------------------------------------------------------------------

/// When and how GPU pods that sit idle are reclaimed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.action != 'Delete' || self.allowDelete")
    .message("action Delete removes pods without eviction: set allowDelete: true to confirm, or use Auto or Evict"))]
pub struct ReclaimPolicy {
    /// `Off` disables reclamation; `DryRun` warns and reports what it would do; `Enforce` acts.
    #[serde(default)]
    pub mode: ReclaimMode,

    /// Utilization (percent) at or below which a sample counts as idle.
    #[serde(default = "default_idle_threshold")]
    #[schemars(range(max = 99))]
    pub idle_threshold: u32,

    /// How long every GPU of a pod must be continuously idle before the pod is warned.
    /// Any activity resets the clock. Between 5m and 720h.
    #[serde(default = "default_idle_after")]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"))]
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('5m') && duration(self) <= duration('720h')")
        .message("idleAfter must be between 5m and 720h, e.g. 2h"))]
    pub idle_after: Duration,

    /// Time between the warning and the action. Between 0s and 168h.
    #[serde(default = "default_grace_period")]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"))]
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('0s') && duration(self) <= duration('168h')")
        .message("gracePeriod must be between 0s and 168h, e.g. 30m"))]
    pub grace_period: Duration,

    /// Pods younger than this are never considered idle (model loading, data staging). Between 0s and 24h.
    #[serde(default = "default_startup_grace_period")]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"))]
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('0s') && duration(self) <= duration('24h')")
        .message("startupGracePeriod must be between 0s and 24h, e.g. 15m"))]
    pub startup_grace_period: Duration,

    /// What is done at the deadline. `Auto` suspends a Job-like owner that supports
    /// `spec.suspend` and evicts otherwise.
    #[serde(default)]
    pub action: ReclaimAction,

    /// Confirms `action: Delete`.
    #[serde(default)]
    pub allow_delete: bool,

    /// Act only while pods that want this pool's GPUs are pending.
    #[serde(default)]
    pub only_under_pressure: bool,

    /// Cap on actions per pool.
    #[serde(default)]
    pub rate_limit: RateLimit,

    /// Pods that are never reclaimed. `kube-system` is always exempt, and so is any pod
    /// annotated `gpupool.io/reclaim: disabled` while `allowPodOptOut` is true.
    #[serde(default)]
    pub exemptions: ReclaimExemptions,

    /// Whether a pod may exempt itself with the annotation `gpupool.io/reclaim: disabled` (or
    /// `disabled-until=<time>`). Anyone who can create a pod can set it, so on a pool where
    /// tenants must not keep idle GPUs, set false: only `exemptions` (chosen by the pool's
    /// owner) then exempt a pod.
    #[serde(default = "default_true")]
    pub allow_pod_opt_out: bool,
}

impl Default for ReclaimPolicy {
    fn default() -> Self {
        Self {
            mode: ReclaimMode::default(),
            idle_threshold: default_idle_threshold(),
            idle_after: default_idle_after(),
            grace_period: default_grace_period(),
            startup_grace_period: default_startup_grace_period(),
            action: ReclaimAction::default(),
            allow_delete: false,
            only_under_pressure: false,
            rate_limit: RateLimit::default(),
            exemptions: ReclaimExemptions::default(),
            allow_pod_opt_out: true,
        }
    }
}

fn default_idle_threshold() -> u32 {
    5
}
fn duration_secs(secs: u64) -> Duration {
    Duration::from(std::time::Duration::from_secs(secs))
}
fn default_idle_after() -> Duration {
    duration_secs(2 * 3600)
}
fn default_grace_period() -> Duration {
    duration_secs(30 * 60)
}
fn default_startup_grace_period() -> Duration {
    duration_secs(15 * 60)
}

/// Whether the reclaimer acts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReclaimMode {
    /// No warnings, no actions.
    Off,
    /// Warn and report what would be done (evictions are checked server-side with dryRun).
    #[default]
    DryRun,
    /// Warn, then act.
    Enforce,
}

/// The action taken on an idle pod at its deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReclaimAction {
    /// Suspend a Job-like owner that supports `spec.suspend`; evict otherwise.
    #[default]
    Auto,
    /// Warn only.
    NotifyOnly,
    /// Set `spec.suspend: true` on the owning Job.
    Suspend,
    /// Evict through the Eviction API (PodDisruptionBudgets apply).
    Evict,
    /// Delete the pod (needs `allowDelete`).
    Delete,
}

/// Cap on reclaim actions per pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateLimit {
    /// Most actions per interval.
    #[serde(default = "default_max_actions")]
    #[schemars(range(min = 1, max = MAX_ACTIONS_LIMIT))]
    pub max_actions: u32,

    /// The interval. Between 1m and 24h.
    #[serde(default = "default_rate_interval")]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"))]
    #[x_kube(validation = kube::core::Rule::new("duration(self) >= duration('1m') && duration(self) <= duration('24h')")
        .message("rateLimit.interval must be between 1m and 24h"))]
    pub interval: Duration,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self {
            max_actions: default_max_actions(),
            interval: default_rate_interval(),
        }
    }
}

/// The most `rateLimit.maxActions` may be: the operator counts actions in the pool's reclaim
/// history, which keeps this many entries, so a larger limit would never be reached.
pub const MAX_ACTIONS_LIMIT: u32 = 20;

fn default_max_actions() -> u32 {
    5
}
fn default_rate_interval() -> Duration {
    duration_secs(10 * 60)
}

/// CEL for a label selector field: every `matchExpressions` operator is one Kubernetes knows.
pub fn selector_operator_rule(field: &str) -> kube::core::Rule {
    kube::core::Rule::new(
        "!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])",
    )
    .message(kube::core::Message::Message(format!(
        "{field}.matchExpressions: operator must be In, NotIn, Exists or DoesNotExist"
    )))
}

/// CEL for a label selector field: `In`/`NotIn` come with values, `Exists`/`DoesNotExist`
/// without.
pub fn selector_values_rule(field: &str) -> kube::core::Rule {
    kube::core::Rule::new(
        "!has(self.matchExpressions) || self.matchExpressions.all(e, (e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0))",
    )
    .message(kube::core::Message::Message(format!(
        "{field}.matchExpressions: In and NotIn need values, Exists and DoesNotExist take none"
    )))
}

/// Most `matchLabels` entries a selector in a GpuPool may have.
pub const MAX_SELECTOR_LABELS: u32 = 64;
/// Most `matchExpressions` a selector in a GpuPool may have.
pub const MAX_SELECTOR_EXPRESSIONS: u32 = 32;
/// Most `values` one `matchExpressions` entry may list.
pub const MAX_SELECTOR_VALUES: u32 = 256;

/// The name part of a label key, and a non-empty label value: 1–63 letters, digits, `-`, `_`
/// or `.`, starting and ending with a letter or digit (Kubernetes' `IsQualifiedName`).
const LABEL_NAME_RE: &str = "([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]";
/// A lowercase DNS subdomain, the optional prefix of a label key.
const DNS_SUBDOMAIN_RE: &str = "[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*";

/// CEL: `x` (a string expression) is a label key; the prefix before `/` is at most 253 long.
fn label_key_cel(x: &str) -> String {
    format!(
        "{x}.matches('^({DNS_SUBDOMAIN_RE}/)?{LABEL_NAME_RE}$') && (!{x}.contains('/') || {x}.indexOf('/') <= 253)"
    )
}

const LABEL_KEY_HELP: &str = "a name of at most 63 letters, digits, '-', '_' or '.' that starts \
     and ends with a letter or digit, optionally after a lowercase DNS prefix and '/', \
     e.g. nvidia.com/gpu.present";
const LABEL_VALUE_HELP: &str = "at most 63 letters, digits, '-', '_' or '.', starting and \
     ending with a letter or digit, e.g. NVIDIA-H100-80GB-HBM3";

fn cel_rule(rule: String, message: String) -> Value {
    json!({ "rule": rule, "message": message })
}

/// The schema of a label selector field of a GpuPool: Kubernetes' `LabelSelector` with its
/// lists and strings bounded (so that the CEL rules over them stay within the apiserver's cost
/// budget) and every key and value checked for label syntax. A key or value that no label can
/// have would match nothing with `In`/`Exists` and everything with `NotIn`/`DoesNotExist`.
fn label_selector_schema(generator: &mut SchemaGenerator, field: &str, nullable: bool) -> Schema {
    let mut schema = generator.subschema_for::<LabelSelector>().to_value();
    // Indexing below would create what is missing; fail loudly if k8s-openapi's shape changes.
    for path in [
        "/properties/matchExpressions/items/properties/key",
        "/properties/matchExpressions/items/properties/operator",
        "/properties/matchExpressions/items/properties/values/items",
        "/properties/matchLabels/additionalProperties",
    ] {
        assert!(
            schema.pointer(path).is_some(),
            "LabelSelector schema lacks {path}"
        );
    }
    let key_len = 253 + 1 + 63;
    let value_rule = format!("self.matches('^({LABEL_NAME_RE})?$')");
    {
        let exprs = &mut schema["properties"]["matchExpressions"];
        exprs["maxItems"] = json!(MAX_SELECTOR_EXPRESSIONS);
        let req = &mut exprs["items"]["properties"];
        req["key"]["maxLength"] = json!(key_len);
        req["key"]["x-kubernetes-validations"] = json!([cel_rule(
            label_key_cel("self"),
            format!("{field}.matchExpressions[].key must be a label key: {LABEL_KEY_HELP}"),
        )]);
        req["operator"]["maxLength"] = json!(16);
        req["values"]["maxItems"] = json!(MAX_SELECTOR_VALUES);
        req["values"]["items"]["maxLength"] = json!(63);
        req["values"]["items"]["x-kubernetes-validations"] = json!([cel_rule(
            value_rule.clone(),
            format!("{field}.matchExpressions[].values must be label values: {LABEL_VALUE_HELP}"),
        )]);
    }
    {
        let labels = &mut schema["properties"]["matchLabels"];
        labels["maxProperties"] = json!(MAX_SELECTOR_LABELS);
        labels["x-kubernetes-validations"] = json!([cel_rule(
            format!("self.all(k, {})", label_key_cel("k")),
            format!("{field}.matchLabels keys must be label keys: {LABEL_KEY_HELP}"),
        )]);
        labels["additionalProperties"]["maxLength"] = json!(63);
        labels["additionalProperties"]["x-kubernetes-validations"] = json!([cel_rule(
            value_rule,
            format!("{field}.matchLabels values must be label values: {LABEL_VALUE_HELP}"),
        )]);
    }
    if nullable {
        schema["nullable"] = json!(true);
    }
    Schema::try_from(schema).expect("a label selector schema is an object")
}

/// Schema of `spec.nodeSelector`.
pub(crate) fn node_selector_schema(generator: &mut SchemaGenerator) -> Schema {
    label_selector_schema(generator, "nodeSelector", false)
}

fn namespace_selector_schema(generator: &mut SchemaGenerator) -> Schema {
    label_selector_schema(generator, "reclaim.exemptions.namespaceSelector", true)
}

fn pod_selector_schema(generator: &mut SchemaGenerator) -> Schema {
    label_selector_schema(generator, "reclaim.exemptions.podSelector", true)
}

/// CEL for an exemption selector: it names labels. An empty selector matches everything, so
/// it would exempt every pod and turn reclamation off without a word.
fn nonempty_exemption_rule(field: &str, matches: &str) -> kube::core::Rule {
    kube::core::Rule::new(
        "(has(self.matchLabels) && size(self.matchLabels) > 0) || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
    )
    .message(kube::core::Message::Message(format!(
        "{field} must name labels (matchLabels or matchExpressions): an empty selector matches \
         every {matches}, which exempts every pod from reclaim; leave it out to exempt none"
    )))
}

/// Pods the reclaimer never touches.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimExemptions {
    /// Namespaces whose pods are exempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "namespace_selector_schema")]
    #[x_kube(validation = nonempty_exemption_rule("reclaim.exemptions.namespaceSelector", "namespace"))]
    #[x_kube(validation = selector_operator_rule("reclaim.exemptions.namespaceSelector"))]
    #[x_kube(validation = selector_values_rule("reclaim.exemptions.namespaceSelector"))]
    pub namespace_selector: Option<LabelSelector>,

    /// Pods that are exempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "pod_selector_schema")]
    #[x_kube(validation = nonempty_exemption_rule("reclaim.exemptions.podSelector", "pod"))]
    #[x_kube(validation = selector_operator_rule("reclaim.exemptions.podSelector"))]
    #[x_kube(validation = selector_values_rule("reclaim.exemptions.podSelector"))]
    pub pod_selector: Option<LabelSelector>,

    /// Pods with one of these priority classes are exempt. Each is a PriorityClass name (a
    /// lowercase DNS subdomain such as `system-cluster-critical`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 32),
        inner(
            length(min = 1, max = 253),
            regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
        )
    )]
    pub priority_class_names: Vec<String>,
}
