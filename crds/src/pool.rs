//! The `GpuPool` resource: a set of GPU nodes and the policies they follow.

use crate::policy::{CdiPolicy, DriverPolicy, MigPolicy, ReclaimPolicy, SharingPolicy};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The pool's nodes, chosen by a label selector, and the driver, CDI, MIG and
/// idle-reclaim policies that gpupool enforces on them.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    doc = "A GpuPool is a set of GPU nodes, chosen by label, on which gpupool checks the driver, writes CDI specs, lays out MIG and reclaims GPUs from idle pods. Its status counts the pool's nodes and GPUs and says whether they are ready.",
    group = "gpupool.io",
    version = "v1alpha1",
    kind = "GpuPool",
    plural = "gpupools",
    shortname = "gp",
    category = "gpupool-all",
    status = "GpuPoolStatus",
    printcolumn = r#"{"name":"Nodes","type":"string","description":"Ready nodes / selected nodes","jsonPath":".status.nodes"}"#,
    printcolumn = r#"{"name":"GPUs","type":"integer","description":"GPUs on the pool's nodes","jsonPath":".status.gpus.total"}"#,
    printcolumn = r#"{"name":"Healthy","type":"integer","description":"Healthy GPUs","jsonPath":".status.gpus.healthy"}"#,
    printcolumn = r#"{"name":"MIG","type":"string","description":"MIG layout and nodes applied","jsonPath":".status.mig.summary"}"#,
    printcolumn = r#"{"name":"Sharing","type":"string","description":"How GPUs are shared between pods","jsonPath":".status.sharing"}"#,
    printcolumn = r#"{"name":"Driver","type":"string","description":"Driver versions seen","jsonPath":".status.driver"}"#,
    printcolumn = r#"{"name":"Reclaimed","type":"integer","description":"Idle pods reclaimed","jsonPath":".status.reclaim.reclaimed"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "!has(self.sharing) || !has(self.sharing.mps) || !has(self.mig) || !has(self.mig.strategy) || self.mig.strategy != 'single'"
).message(kube::core::Message::Message(
    "sharing.mps shares whole GPUs only, and with mig.strategy single every advertised device is a \
     MIG device: use sharing.timeSlicing, or mig.strategy mixed (whole GPUs stay nvidia.com/gpu)".into()
)))]
pub struct GpuPoolSpec {
    /// Nodes that belong to the pool. A node matched by two pools belongs to the older one.
    #[schemars(schema_with = "crate::policy::node_selector_schema")]
    #[x_kube(validation = kube::core::Rule::new(
        "(has(self.matchLabels) && size(self.matchLabels) > 0) || (has(self.matchExpressions) && size(self.matchExpressions) > 0)"
    ).message(kube::core::Message::Message(
        "nodeSelector must name labels (matchLabels or matchExpressions): an empty selector \
         selects every node in the cluster, CPU nodes included".into()
    )))]
    #[x_kube(validation = crate::policy::selector_operator_rule("nodeSelector"))]
    #[x_kube(validation = crate::policy::selector_values_rule("nodeSelector"))]
    pub node_selector: LabelSelector,

    /// Driver requirements and health checks.
    #[serde(default)]
    pub driver: DriverPolicy,

    /// CDI spec generation.
    #[serde(default)]
    // This rule sits here rather than on `CdiPolicy`: the operator writes GpuNodes from
    // pools, so a pool that passes need not be checked again on its GpuNodes.
    #[x_kube(validation = kube::core::Rule::new(
        "!has(self.deviceNameStrategies) || size(self.deviceNameStrategies) < 2 || self.deviceNameStrategies[0] != self.deviceNameStrategies[1]"
    ).message(kube::core::Message::Message(
        "cdi.deviceNameStrategies lists a strategy twice: write [index], [uuid] or [index, uuid]".into()
    )))]
    pub cdi: CdiPolicy,

    /// MIG partitioning and advertising.
    #[serde(default)]
    pub mig: MigPolicy,

    /// Sharing GPUs between pods (time-slicing, MPS). Absent: one pod per device.
    #[serde(default)]
    pub sharing: SharingPolicy,

    /// Idle-job reclamation.
    #[serde(default)]
    pub reclaim: ReclaimPolicy,
}

/// What the operator observes of a pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuPoolStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `ready/selected`, for display.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<String>,

    /// Nodes the selector matches (and that no older pool owns).
    #[serde(default)]
    pub selected_nodes: u32,

    /// Selected nodes that are validated, with a current CDI spec and the MIG layout applied.
    #[serde(default)]
    pub ready_nodes: u32,

    /// GPU counts.
    #[serde(default)]
    pub gpus: GpuCounts,

    /// Driver versions seen on the pool's nodes, comma-separated, for display.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,

    /// Each driver version seen and on how many nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub driver_versions: Vec<DriverVersionCount>,

    /// MIG rollout progress.
    #[serde(default)]
    pub mig: MigProgress,

    /// How the pool shares its GPUs, e.g. `TimeSlicing x4` (isolation: none), or `Exclusive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<String>,

    /// Reclaim counters and recent actions.
    #[serde(default)]
    pub reclaim: ReclaimStatus,

    /// `Ready`, `DriverValid`, `CDIReady`, `MIGApplied`, `Conflict`, `Degraded`, `APIErrors`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// Per-node problems, sorted by node then reason, at most 50.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub problems: Vec<NodeProblem>,
}

/// GPU counts of a pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuCounts {
    /// Physical GPUs on the pool's nodes.
    pub total: u32,
    /// GPUs with no health fault.
    pub healthy: u32,
}

/// A driver version and the number of nodes running it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverVersionCount {
    /// Driver version, e.g. `550.54.15`.
    pub version: String,
    /// Nodes reporting it.
    pub nodes: u32,
}

/// MIG rollout progress across a pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigProgress {
    /// Layout and progress for display, e.g. `all-1g.10gb 3/4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Nodes whose hardware matches the layout.
    pub applied: u32,
    /// Nodes draining or applying.
    pub pending: u32,
    /// Nodes where applying failed.
    pub failed: u32,
    /// GPU pods still to be evicted on draining nodes.
    #[serde(default)]
    pub pods_to_drain: u32,
}

/// Reclaim counters of a pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimStatus {
    /// Pods currently warned.
    pub warned: u32,
    /// Pods reclaimed since the pool was created.
    pub reclaimed: u64,
    /// When the last action happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reclaim_time: Option<Time>,
    /// The most recent actions, newest first, at most 20.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub history: Vec<ReclaimRecord>,
}

/// One reclaim action.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimRecord {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The owner acted on, `Kind/name`, when not the pod itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// What was done: `Suspend`, `Evict`, `Delete`, or `DryRun:<action>`.
    pub action: String,
    /// `Succeeded`, `BlockedByPDB`, `Failed`, `WouldSucceed`, `WouldBeBlocked`.
    pub result: String,
    /// When.
    pub time: Time,
}

/// A problem on one node of a pool.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeProblem {
    /// The node.
    pub node: String,
    /// A CamelCase reason, e.g. `DriverTooOld`, `MIGFailed`, `Conflict`.
    pub reason: String,
    /// What is wrong and what to do.
    pub message: String,
}
