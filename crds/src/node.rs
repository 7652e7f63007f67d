//! The `GpuNode` resource: one per GPU node, spec from the operator, status from the node agent.

use crate::policy::{CdiPolicy, DriverCheck, DriverPolicy, MigStrategy, SharingPolicy};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use kube::core::Duration;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The desired state of one GPU node, resolved by the operator from the node's pool.
/// Named after its Node.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    doc = "A GpuNode is one GPU node as gpupool manages it, named after its Node. The operator writes its spec from the node's GpuPool (edit the pool, not this); the node's gpupool agent reports the GPUs, driver, MIG state and checks in its status.",
    group = "gpupool.io",
    version = "v1alpha1",
    kind = "GpuNode",
    plural = "gpunodes",
    shortname = "gn",
    category = "gpupool-all",
    status = "GpuNodeStatus",
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".spec.pool"}"#,
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.gpuCount"}"#,
    printcolumn = r#"{"name":"Healthy","type":"integer","jsonPath":".status.healthyGpus"}"#,
    printcolumn = r#"{"name":"MIG-State","type":"string","jsonPath":".status.mig.state"}"#,
    printcolumn = r#"{"name":"Driver","type":"string","jsonPath":".status.driverVersion"}"#,
    printcolumn = r#"{"name":"Valid","type":"string","description":"All driver checks passed","jsonPath":".status.validated"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSpec {
    /// The pool this node belongs to.
    pub pool: String,

    /// Driver requirements and checks.
    #[serde(default)]
    // Shared like `mig`: every node of a pool carries the pool's copy.
    pub driver: Arc<DriverPolicy>,

    /// CDI spec options.
    #[serde(default)]
    // Shared like `mig`.
    pub cdi: Arc<CdiPolicy>,

    /// The MIG layout resolved for this node's GPUs.
    #[serde(default)]
    // Shared: nodes of one kind carry the same layout, and the operator keeps one copy of it for
    // all of them (its GpuNode cache interns it); `Arc::make_mut` edits a copy of one's own.
    pub mig: Arc<NodeMigSpec>,

    /// What the agent needs of the pool's reclaim policy.
    #[serde(default)]
    pub utilization: UtilizationSpec,

    /// The pool's sharing for this node (`models` already resolved against its GPUs).
    #[serde(default, skip_serializing_if = "is_default")]
    pub sharing: SharingPolicy,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// The MIG layout for one node, GPU by GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeMigSpec {
    /// How MIG devices are advertised.
    #[serde(default)]
    pub strategy: MigStrategy,

    /// Whether the pool asks for a layout at all; when false, MIG is left as found.
    #[serde(default)]
    pub managed: bool,

    /// The layout's name, for display (`all-1g.10gb`, `custom`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout_name: Option<String>,

    /// Wanted state per GPU index. GPUs not listed keep MIG as found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuMigSpec>,
}

/// Wanted MIG state of one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuMigSpec {
    /// GPU index.
    pub index: u32,
    /// MIG mode on.
    pub enabled: bool,
    /// Profiles and counts.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub profiles: BTreeMap<String, u32>,
}

/// Sampling settings the agent needs for idleness.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UtilizationSpec {
    /// Utilization (percent) at or below which a sample counts as idle.
    pub idle_threshold: u32,
    /// How often to sample.
    pub sample_interval: Duration,
}

impl Default for UtilizationSpec {
    fn default() -> Self {
        Self {
            idle_threshold: 5,
            sample_interval: Duration::from(std::time::Duration::from_secs(30)),
        }
    }
}

/// The GpuNode condition the agent sets on whether the CDI spec the runtime reads is its own and
/// resolvable (False: deleted, edited, invalid, or another spec claims the same devices). The
/// operator holds the pool's `CDIReady` False while it is.
pub const CDI_SPEC_READY: &str = "CdiSpecReady";

/// The GpuNode condition the agent sets on whether another device plugin (NVIDIA's, found by
/// the socket names it uses) is live on the node for NVIDIA GPU resources. True names the
/// sockets and resources: the kubelet keeps only the last plugin registered for a resource, so
/// two plugins take it from each other at every restart. Unlike `CdiSpecReady`, True is the
/// bad state, as with a Node's `MemoryPressure`: the condition names what was found.
pub const FOREIGN_DEVICE_PLUGIN: &str = "ForeignDevicePlugin";

/// What the node agent observes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// NVIDIA driver version, e.g. `550.54.15`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,

    /// Highest CUDA version the driver supports, e.g. `12.4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_version: Option<String>,

    /// Physical GPUs found.
    #[serde(default)]
    pub gpu_count: u32,

    /// GPUs with no health fault.
    #[serde(default)]
    pub healthy_gpus: u32,

    /// `True` when every check passed, `False` when one failed, `Unknown` before the first run.
    // The schema stays a plain string: an enum there would make the API server reject a status
    // from an agent that knows a value this version does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub validated: Option<Verdict>,

    /// Each driver check and its result.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<CheckResult>,

    /// The GPUs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuStatus>,

    /// MIG reconfiguration state.
    #[serde(default)]
    pub mig: NodeMigStatus,

    /// The CDI spec written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi: Option<CdiStatus>,

    /// Agent-level conditions (e.g. `PodResourcesAvailable`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// When the agent wrote this status, by the node's clock. The agent writes at least once
    /// per heartbeat interval (`--heartbeat-secs`, 60 s by default) even when nothing changed,
    /// so the operator can tell a live agent from a dead, hung or cut-off one. The operator
    /// times staleness on its own clock, from when it sees this value change, and reads the
    /// difference between the two clocks from it (see the pool's `AgentStale` and `ClockSkew`
    /// node problems).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_time: Option<Time>,
}

/// The isolation MPS gives ([`GpuSharing::isolation`]): device memory capped per client, and
/// nothing else kept apart. Every client of a GPU's daemon shares its control pipe and
/// `/dev/shm`, so co-tenants must trust each other (docs/security.md).
pub const MPS_ISOLATION: &str = "Memory (tenants trusted)";

/// How a GPU is shared, and what that isolates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSharing {
    /// `TimeSlicing` or `MPS`.
    pub mode: String,
    /// Pods per device.
    pub replicas: u32,
    /// What keeps the pods sharing a device apart: `None` for time-slicing (shared memory and
    /// faults: one pod can run the others out of memory), `Memory (tenants trusted)` for MPS
    /// (each client's device memory is capped; faults, the daemon's control pipe and `/dev/shm`
    /// are shared, so a tenant running as root can stop or reconfigure the daemon and read its
    /// co-tenants' shared memory), `Hardware` between MIG devices.
    pub isolation: String,
    /// MPS: the device memory each client may pin, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_mib: Option<u64>,
    /// MPS: the share of the GPU's threads each client may use, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u32>,
    /// MPS: the GPU's control daemon, `Running`, or why it is not (its replicas are then
    /// Unhealthy until it is back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon: Option<String>,
}

/// One driver check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckResult {
    /// The check, e.g. `DriverVersion`, `CUDAVersion`, `ECCErrors`.
    // A plain string in the schema, like `validated`, so a newer agent's checks are accepted.
    #[schemars(with = "String")]
    pub name: CheckName,
    /// Whether it passed.
    pub passed: bool,
    /// What was found, and on failure what to do.
    pub message: String,
}

/// The outcome of a node's driver checks, spelled as a condition status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Verdict {
    /// Every check passed.
    True,
    /// At least one check failed.
    False,
    /// No check has run yet. A value this version does not know reads as this too, so one odd
    /// status cannot stop a watch of every GpuNode.
    #[serde(other)]
    Unknown,
}

impl Verdict {
    /// `True` when every check passed, `False` when one failed, `Unknown` when none ran.
    pub fn of_checks(checks: &[CheckResult]) -> Self {
        if checks.is_empty() {
            Verdict::Unknown
        } else if checks.iter().all(|c| c.passed) {
            Verdict::True
        } else {
            Verdict::False
        }
    }

    /// The serialized form: `True`, `False` or `Unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::True => "True",
            Verdict::False => "False",
            Verdict::Unknown => "Unknown",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name of a driver check in a node's status: the checks a pool selects ([`DriverCheck`])
/// plus the version checks its `minVersion` and `cudaVersion` add. Serialized as the bare
/// name, e.g. `NVMLInit`, `CUDAVersion`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CheckName {
    /// NVML loads and initialises.
    NvmlInit,
    /// The driver is at least the pool's `minVersion`.
    DriverVersion,
    /// The driver supports the pool's `cudaVersion`.
    CudaVersion,
    /// The nvidia kernel module is loaded.
    KernelModule,
    /// The device nodes exist under the driver root.
    DeviceNodes,
    /// No uncorrected ECC errors.
    EccErrors,
    /// PCIe replay counters below the threshold.
    PcieReplay,
    /// No fatal Xid errors.
    XidErrors,
    /// Persistence mode on.
    PersistenceMode,
    /// The agent runs in the host's PID namespace, so it sees the GPU processes (without it
    /// every GPU would look empty: activity is then `Unknown` and MIG and sharing changes hold).
    HostPidNamespace,
    /// The driver root the GpuNode names is one this node trusts (the agent's
    /// `--allowed-driver-roots`, no symlink on the way); the agent uses no file under any other.
    DriverRootTrusted,
    /// A check this version does not know (from a newer agent), kept as written. Never holds
    /// one of the names above: [`CheckName::from`] maps those to their variants.
    Other(String),
}

impl CheckName {
    /// The name as serialized.
    pub fn as_str(&self) -> &str {
        match self {
            CheckName::NvmlInit => "NVMLInit",
            CheckName::DriverVersion => "DriverVersion",
            CheckName::CudaVersion => "CUDAVersion",
            CheckName::KernelModule => "KernelModule",
            CheckName::DeviceNodes => "DeviceNodes",
            CheckName::EccErrors => "ECCErrors",
            CheckName::PcieReplay => "PCIeReplay",
            CheckName::XidErrors => "XidErrors",
            CheckName::PersistenceMode => "PersistenceMode",
            CheckName::HostPidNamespace => "HostPIDNamespace",
            CheckName::DriverRootTrusted => "DriverRootTrusted",
            CheckName::Other(name) => name,
        }
    }
}

impl From<DriverCheck> for CheckName {
    fn from(check: DriverCheck) -> Self {
        match check {
            DriverCheck::NvmlInit => CheckName::NvmlInit,
            DriverCheck::KernelModule => CheckName::KernelModule,
            DriverCheck::DeviceNodes => CheckName::DeviceNodes,
            DriverCheck::EccErrors => CheckName::EccErrors,
            DriverCheck::PcieReplay => CheckName::PcieReplay,
            DriverCheck::XidErrors => CheckName::XidErrors,
            DriverCheck::PersistenceMode => CheckName::PersistenceMode,
        }
    }
}

impl From<&str> for CheckName {
    fn from(name: &str) -> Self {
        match name {
            "NVMLInit" => CheckName::NvmlInit,
            "DriverVersion" => CheckName::DriverVersion,
            "CUDAVersion" => CheckName::CudaVersion,
            "KernelModule" => CheckName::KernelModule,
            "DeviceNodes" => CheckName::DeviceNodes,
            "ECCErrors" => CheckName::EccErrors,
            "PCIeReplay" => CheckName::PcieReplay,
            "XidErrors" => CheckName::XidErrors,
            "PersistenceMode" => CheckName::PersistenceMode,
            "HostPIDNamespace" => CheckName::HostPidNamespace,
            "DriverRootTrusted" => CheckName::DriverRootTrusted,
            other => CheckName::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for CheckName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for CheckName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for CheckName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<str>::deserialize(deserializer)?;
        Ok(CheckName::from(name.as_ref()))
    }
}

/// Health of a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Health {
    /// No fault.
    #[default]
    Healthy,
    /// Faulted; see `reason`.
    Unhealthy,
}

/// Activity of a device as last sampled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Activity {
    /// Activity was observed.
    Busy,
    /// No activity was observed.
    Idle,
    /// Activity cannot be observed; never treated as idle.
    #[default]
    Unknown,
}

/// A pod holding a device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: String,
    /// Container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// Utilization-derived idleness of one device, and its holders.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Idleness {
    /// What the last samples showed.
    #[serde(default)]
    pub activity: Activity,
    /// Since when the device has been continuously idle; absent while busy or unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since: Option<Time>,
    /// Pods holding the device, from the kubelet PodResources API.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodRef>,
}

/// One physical GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// Index (NVML order).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: Arc<str>,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// PCI bus id, e.g. `0000:17:00.0`.
    pub pci_bus_id: String,
    /// Health.
    #[serde(default)]
    pub health: Health,
    /// Why it is unhealthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// MIG mode currently on.
    #[serde(default)]
    pub mig_enabled: bool,
    /// MIG mode after the next GPU reset, when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_pending: Option<bool>,
    /// MIG devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDeviceStatus>,
    /// How the GPU (or its MIG devices) is shared between pods; absent: one pod per device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<GpuSharing>,
    /// Each share's idleness on a shared whole GPU, one per replica a pod holds, judged on that
    /// pod's own processes (NVML per-process utilization): one idle tenant shows idle while its
    /// neighbour works. `unknown` when a busy process on the GPU cannot be told apart.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<Idleness>,
    /// Idleness (whole GPU; MIG devices carry their own).
    #[serde(default, flatten)]
    pub idleness: Idleness,
}

/// The share `pod` holds among `shares` (a GPU's `shares`), if the agent reports one.
pub fn share_of<'a>(shares: &'a [Idleness], pod: &PodRef) -> Option<&'a Idleness> {
    shares.iter().find(|s| {
        s.pods
            .iter()
            .any(|h| h.namespace == pod.namespace && h.name == pod.name)
    })
}

/// One MIG device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDeviceStatus {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// Profile, e.g. `1g.10gb`.
    pub profile: Arc<str>,
    /// GPU instance id.
    pub gpu_instance: u32,
    /// Compute instance id.
    pub compute_instance: u32,
    /// The CDI device name Allocate hands out for it: `gpupool.io/gpu=MIG-<uuid>` with the `uuid`
    /// naming strategy, else `gpupool.io/gpu=0:1` (GPU 0, MIG device 1).
    pub cdi_name: String,
    /// Health.
    #[serde(default)]
    pub health: Health,
    /// Idleness.
    #[serde(default, flatten)]
    pub idleness: Idleness,
}

/// MIG reconfiguration states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MigState {
    /// Nothing asked or nothing to do yet.
    #[default]
    Idle,
    /// Waiting for GPU pods to leave the GPUs being changed.
    Draining,
    /// Changing MIG mode and instances.
    Applying,
    /// The hardware matches the layout.
    Applied,
    /// Applying failed; see `reason`.
    Failed,
}

/// MIG state of a node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeMigStatus {
    /// Where reconfiguration stands.
    #[serde(default)]
    pub state: MigState,
    /// Why, when `Failed` or waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Details.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// GPU indices being changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    /// The spec generation whose layout this state refers to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The node's CDI spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CdiStatus {
    /// Path of the spec file.
    pub path: String,
    /// `sha256:` digest of its content.
    pub digest: String,
    /// Devices it names.
    #[serde(default)]
    pub devices: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_is_spelled_as_before() {
        for (verdict, text) in [
            (Verdict::True, "True"),
            (Verdict::False, "False"),
            (Verdict::Unknown, "Unknown"),
        ] {
            assert_eq!(serde_json::to_value(verdict).unwrap(), text);
            assert_eq!(verdict.to_string(), text);
            let back: Verdict = serde_json::from_value(text.into()).unwrap();
            assert_eq!(back, verdict);
        }
        let odd: Verdict = serde_json::from_value("Maybe".into()).unwrap();
        assert_eq!(odd, Verdict::Unknown);
    }

    #[test]
    fn verdict_of_checks() {
        let check = |passed| CheckResult {
            name: CheckName::XidErrors,
            passed,
            message: String::new(),
        };
        assert_eq!(Verdict::of_checks(&[]), Verdict::Unknown);
        assert_eq!(Verdict::of_checks(&[check(true)]), Verdict::True);
        assert_eq!(
            Verdict::of_checks(&[check(true), check(false)]),
            Verdict::False
        );
    }

    #[test]
    fn check_names_are_spelled_as_the_policy_spells_them() {
        for check in DriverCheck::all() {
            let name = CheckName::from(check);
            assert_eq!(
                serde_json::to_value(&name).unwrap(),
                serde_json::to_value(check).unwrap()
            );
            assert_eq!(CheckName::from(name.as_str()), name);
        }
        for (name, text) in [
            (CheckName::DriverVersion, "DriverVersion"),
            (CheckName::CudaVersion, "CUDAVersion"),
            (CheckName::HostPidNamespace, "HostPIDNamespace"),
            (CheckName::DriverRootTrusted, "DriverRootTrusted"),
            (CheckName::Other("FanSpeed".into()), "FanSpeed"),
        ] {
            assert_eq!(serde_json::to_value(&name).unwrap(), text);
            let back: CheckName = serde_json::from_value(text.into()).unwrap();
            assert_eq!(back, name);
        }
    }

    #[test]
    fn a_status_reads_and_writes_back_unchanged() {
        let wire = serde_json::json!({
            "gpuCount": 0,
            "healthyGpus": 0,
            "validated": "False",
            "checks": [
                {"name": "CUDAVersion", "passed": false, "message": "too old"},
                {"name": "SomethingNew", "passed": true, "message": "fine"}
            ],
            "mig": {"state": "Idle"}
        });
        let status: GpuNodeStatus = serde_json::from_value(wire.clone()).unwrap();
        assert_eq!(status.validated, Some(Verdict::False));
        assert_eq!(status.checks[0].name, CheckName::CudaVersion);
        assert_eq!(serde_json::to_value(&status).unwrap(), wire);
    }
}
