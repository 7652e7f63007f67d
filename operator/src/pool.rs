//! Pool decisions, free of I/O: which pool owns a node, the GpuNode a node should have, and
//! the status a pool reports.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use gpupool_crds::conditions::{Observed, condition, set_condition};
use gpupool_crds::labels::{DRIVER_INVALID_TAINT, MIG_RECONFIGURING_TAINT, POOL_LABEL};
use gpupool_crds::node::{
    CDI_SPEC_READY, GpuNode, GpuNodeSpec, Health, MigState, NodeMigSpec, UtilizationSpec, Verdict,
};
use gpupool_crds::policy::{
    MigPolicy, MigStrategy, MpsPolicy, OnFailure, SharingPolicy, TimeSlicingPolicy,
};
use gpupool_crds::pool::{
    DriverVersionCount, GpuCounts, GpuPool, GpuPoolStatus, MigProgress, NodeProblem, ReclaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::core::{Selector, SelectorExt};
use kube::{Resource, ResourceExt};

use crate::error::ApiFailure;
use crate::layout::{self, LayoutProblem, NodeGpus};
use crate::liveness::{AgentLiveness, HEARTBEAT_INTERVAL};

/// Most per-node problems a status lists.
pub const MAX_PROBLEMS: usize = 50;
/// Most node names a condition message lists before "and N more".
const MAX_NAMES_IN_MESSAGE: usize = 10;
/// The condition naming the API calls the operator could not make for the pool.
pub const API_ERRORS: &str = "APIErrors";
/// Longest APIErrors message.
const MAX_API_ERRORS_MESSAGE: usize = 2000;

/// The pool's node selector, or why it cannot be used.
pub fn selector(pool: &GpuPool) -> Result<Selector, String> {
    Selector::try_from(pool.spec.node_selector.clone()).map_err(|e| e.to_string())
}

/// Whether the pool's selector matches these node labels (an unusable selector matches nothing).
pub fn matches(pool: &GpuPool, labels: &BTreeMap<String, String>) -> bool {
    selector(pool).is_ok_and(|s| s.matches(labels))
}

/// The pool that owns a node matched by `pools`: the pool that holds it now (its
/// `gpupool.io/pool` label) while that pool still matches it, else the oldest by creation time,
/// then by name. A held node is never taken: an older pool whose selector widens over it does
/// not re-layout and drain it, it reports the overlap instead (see [`ConflictingNode`]).
pub fn owner_of<'p>(
    labels: &BTreeMap<String, String>,
    pools: impl IntoIterator<Item = &'p GpuPool>,
) -> Option<&'p GpuPool> {
    let matching: Vec<&GpuPool> = pools.into_iter().filter(|p| matches(p, labels)).collect();
    let holder = labels.get(POOL_LABEL);
    matching
        .iter()
        .copied()
        .find(|p| holder == Some(&p.name_any()))
        .or_else(|| {
            matching
                .into_iter()
                .min_by(|a, b| age_key(a).cmp(&age_key(b)))
        })
}

fn age_key(pool: &GpuPool) -> (Option<Timestamp>, String) {
    // A pool without a creation time has not been stored yet; it sorts last (None < Some is
    // reversed by mapping None to the latest possible time).
    let created = pool
        .meta()
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .or(Some(Timestamp::MAX));
    (created, pool.name_any())
}

/// The operator's taints a member node of `pool` should carry, from its GpuNode:
/// [`DRIVER_INVALID_TAINT`] while the driver checks fail and the pool says `onFailure: Taint`;
/// [`MIG_RECONFIGURING_TAINT`] while the agent drains the node for, or applies, a new MIG
/// layout, so the pods evicted for it are scheduled elsewhere and not back onto the node.
pub fn node_taints(pool: &GpuPool, gn: Option<&GpuNode>) -> BTreeSet<&'static str> {
    let status = gn.and_then(|g| g.status.as_ref());
    let mut taints = BTreeSet::new();
    if pool.spec.driver.on_failure == OnFailure::Taint
        && status.and_then(|s| s.validated) == Some(Verdict::False)
    {
        taints.insert(DRIVER_INVALID_TAINT);
    }
    if status.is_some_and(|s| matches!(s.mig.state, MigState::Draining | MigState::Applying)) {
        taints.insert(MIG_RECONFIGURING_TAINT);
    }
    taints
}

/// Whether a GpuNode's MIG change is under way: handed over and not yet reported done
/// (`Applied` or `Failed`) for the spec's generation.
fn mig_in_progress(gn: &GpuNode) -> bool {
    match &gn.status {
        None => gn.spec.mig.managed,
        Some(s) => {
            matches!(s.mig.state, MigState::Draining | MigState::Applying)
                || (gn.spec.mig.managed && s.mig.observed_generation != gn.metadata.generation)
        }
    }
}

/// Whether a node that has the wanted layout failed to apply it (`Failed`, including a drain
/// that timed out, for the generation it was handed).
fn mig_failed(gn: &GpuNode) -> bool {
    gn.status.as_ref().is_some_and(|s| {
        s.mig.state == MigState::Failed && s.mig.observed_generation == gn.metadata.generation
    })
}

/// The MIG rollout over a pool's nodes: which of them must keep their current layout for now.
/// `nodes` are `(name, its GpuNode, the layout it should get)`. Nodes that already have the
/// wanted layout but have not finished applying it are under way, and so are those that failed
/// to apply it: a failure keeps its slot until it is fixed, so a layout that fails stops the
/// rollout after `max_unavailable` nodes instead of draining the whole pool a few at a time. Of
/// the nodes whose layout is to change, the first in name order get it while fewer than
/// `max_unavailable` are under way, and the rest hold. A node without a GpuNode yet gets its
/// layout at once (it has no layout of its own to keep). Pure.
pub fn mig_rollout_holds<'a>(
    max_unavailable: u32,
    nodes: &[(&'a str, Option<&GpuNode>, &NodeMigSpec)],
) -> BTreeSet<&'a str> {
    let under_way = nodes
        .iter()
        .filter(|(_, gn, want)| {
            gn.is_some_and(|g| *g.spec.mig == **want && (mig_in_progress(g) || mig_failed(g)))
        })
        .count() as u32;
    let mut budget = max_unavailable.saturating_sub(under_way);
    let mut sorted: Vec<_> = nodes.iter().collect();
    sorted.sort_by_key(|(name, _, _)| *name);
    let mut holds = BTreeSet::new();
    for (name, gn, want) in sorted {
        let Some(gn) = gn else { continue };
        if *gn.spec.mig == **want {
            continue;
        }
        if budget > 0 {
            budget -= 1;
        } else {
            holds.insert(*name);
        }
    }
    holds
}

/// The pool's sharing as one node gets it: time-slicing or MPS limited to some GPU models
/// applies to a node only when its `nvidia.com/gpu.product` label is one of them (then the
/// list is dropped: the node's agent has nothing more to match).
pub fn node_sharing(
    sharing: &SharingPolicy,
    node_labels: &BTreeMap<String, String>,
) -> SharingPolicy {
    let product = node_labels.get("nvidia.com/gpu.product");
    let applies = |models: &Option<Vec<String>>| {
        models
            .as_ref()
            .is_none_or(|models| product.is_some_and(|p| models.contains(p)))
    };
    SharingPolicy {
        time_slicing: sharing
            .time_slicing
            .as_ref()
            .filter(|ts| applies(&ts.models))
            .map(|ts| TimeSlicingPolicy {
                models: None,
                ..ts.clone()
            }),
        mps: sharing
            .mps
            .as_ref()
            .filter(|mps| applies(&mps.models))
            .map(|mps| MpsPolicy {
                models: None,
                ..mps.clone()
            }),
    }
}

/// The GpuNode a node of `pool` should have, and a layout problem if the pool's MIG layout
/// does not fit the node's GPUs.
pub fn desired_gpunode(
    pool: &GpuPool,
    node_name: &str,
    node_labels: &BTreeMap<String, String>,
) -> (GpuNode, Option<LayoutProblem>) {
    let resolved = resolve_spec(pool, node_labels);
    (
        gpunode_for(pool, node_name, resolved.spec),
        resolved.problem,
    )
}

/// A node's desired GpuNode spec and the layout problem met resolving it.
#[derive(Debug, PartialEq)]
pub struct ResolvedSpec {
    /// The spec.
    pub spec: GpuNodeSpec,
    /// Why the pool's MIG layout does not fit the node, if it does not.
    pub problem: Option<LayoutProblem>,
}

/// Resolves the desired GpuNode specs of a pool's nodes once per kind of node: the spec depends
/// on the node only through the GPU labels [`NodeGpus`] and [`node_sharing`] read, so thousands
/// of nodes of a few models share a few specs instead of each holding its own.
pub struct SpecResolver<'a> {
    pool: &'a GpuPool,
    resolved: HashMap<(NodeGpus, Option<String>), Arc<ResolvedSpec>>,
}

impl<'a> SpecResolver<'a> {
    /// A resolver for `pool`'s nodes.
    pub fn new(pool: &'a GpuPool) -> Self {
        Self {
            pool,
            resolved: HashMap::new(),
        }
    }

    /// The spec of a node with these labels.
    pub fn resolve(&mut self, node_labels: &BTreeMap<String, String>) -> Arc<ResolvedSpec> {
        let key = (
            NodeGpus::from_labels(node_labels),
            node_labels.get(layout::GFD_PRODUCT_LABEL).cloned(),
        );
        let pool = self.pool;
        self.resolved
            .entry(key)
            .or_insert_with(|| Arc::new(resolve_spec(pool, node_labels)))
            .clone()
    }
}

fn resolve_spec(pool: &GpuPool, node_labels: &BTreeMap<String, String>) -> ResolvedSpec {
    let (mig, problem) = layout::resolve(&pool.spec.mig, &NodeGpus::from_labels(node_labels));
    let spec = GpuNodeSpec {
        pool: pool.name_any(),
        driver: Arc::new(pool.spec.driver.clone()),
        cdi: Arc::new(pool.spec.cdi.clone()),
        mig: Arc::new(mig),
        utilization: UtilizationSpec {
            idle_threshold: pool.spec.reclaim.idle_threshold,
            ..UtilizationSpec::default()
        },
        sharing: node_sharing(&pool.spec.sharing, node_labels),
    };
    ResolvedSpec { spec, problem }
}

/// The GpuNode of `node_name` in `pool` with `spec`: named after the node, labelled with the
/// pool and owned by it.
pub fn gpunode_for(pool: &GpuPool, node_name: &str, spec: GpuNodeSpec) -> GpuNode {
    let mut gn = GpuNode::new(node_name, spec);
    gn.metadata = ObjectMeta {
        name: Some(node_name.to_owned()),
        labels: Some(BTreeMap::from([(
            gpupool_crds::labels::POOL_LABEL.to_owned(),
            pool.name_any(),
        )])),
        owner_references: pool.controller_owner_ref(&()).map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    gn
}

/// Whether an existing GpuNode already has what `desired` asks (spec, pool label, owner): the
/// reference [`gpunode_wanted`] is tested against, comparing with a built GpuNode.
#[cfg(test)]
pub(crate) fn gpunode_up_to_date(existing: &GpuNode, desired: &GpuNode) -> bool {
    let label = crate::cache::gpunode_pool;
    existing.spec == desired.spec
        && label(existing) == label(desired)
        && controller_uid(existing) == controller_uid(desired)
}

/// Whether an existing GpuNode already has what the GpuNode [`gpunode_for`] would build from
/// `pool` and `spec`, with `mig` as its layout, asks (spec, pool label, owner), without
/// building it: a reconcile asks this of every node.
pub fn gpunode_wanted(
    existing: &GpuNode,
    pool: &GpuPool,
    spec: &GpuNodeSpec,
    mig: &NodeMigSpec,
) -> bool {
    // Named field by field, so that a field added to the spec does not compile until it is
    // compared here too.
    let GpuNodeSpec {
        pool: pool_name,
        driver,
        cdi,
        mig: _,
        utilization,
        sharing,
    } = spec;
    let have = &existing.spec;
    have.pool == *pool_name
        && have.driver == *driver
        && have.cdi == *cdi
        && *have.mig == *mig
        && have.utilization == *utilization
        && have.sharing == *sharing
        && crate::cache::gpunode_pool(existing) == pool.metadata.name.as_deref()
        && controller_uid(existing) == pool.metadata.uid.as_deref()
}

/// The UID of a GpuNode's controller owner.
fn controller_uid(gn: &GpuNode) -> Option<&str> {
    gn.owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.as_str())
}

/// One node the pool owns, as the status sees it.
#[derive(Clone, Debug)]
pub struct Member<'a> {
    /// Node name.
    pub node: &'a str,
    /// Its GpuNode, if it exists yet.
    pub gpunode: Option<&'a GpuNode>,
    /// A layout that does not fit the node.
    pub layout_problem: Option<LayoutProblem>,
    /// Whether the Node reports Ready: a node whose kubelet has stopped reporting (powered
    /// off, partitioned) cannot vouch for what its agent last said.
    pub node_ready: bool,
    /// Whether its agent is alive, by its heartbeats ([`crate::liveness`]).
    pub agent: AgentLiveness,
    /// Whether it keeps its current MIG layout until other nodes finish changing theirs
    /// ([`mig_rollout_holds`]).
    pub mig_waiting: bool,
}

/// A node two pools' selectors both match. Both pools report it: the one that holds the node
/// and the one that cannot have it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConflictingNode {
    /// The node.
    pub node: String,
    /// The other pool.
    pub other: String,
    /// Whether this pool holds the node (else `other` does).
    pub held_here: bool,
}

/// Everything the status is computed from.
#[derive(Clone, Debug)]
pub struct StatusInput<'a> {
    /// The pool.
    pub pool: &'a GpuPool,
    /// Nodes it owns.
    pub members: Vec<Member<'a>>,
    /// Nodes it shares with other pools' selectors, held here or there.
    pub conflicts: Vec<ConflictingNode>,
    /// Why the selector is unusable, if it is.
    pub selector_error: Option<String>,
    /// GPU pods still to be evicted on draining nodes.
    pub pods_to_drain: u32,
    /// Reclaim counters, as the reclaimer left them.
    pub reclaim: ReclaimStatus,
    /// API calls of this reconcile that failed.
    pub api_failures: Vec<ApiFailure>,
    /// Now, for condition transition times.
    pub now: Timestamp,
}

/// How one node fares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct NodeVerdict {
    /// The Node is Ready and its agent live: what it reported stands for now.
    trusted: bool,
    reported: bool,
    validated: bool,
    driver_failed: bool,
    cdi_current: bool,
    mig: MigVerdict,
    unhealthy: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum MigVerdict {
    #[default]
    NotManaged,
    Applied,
    Pending,
    Failed,
}

impl NodeVerdict {
    fn ready(&self) -> bool {
        self.trusted
            && self.reported
            && self.validated
            && self.cdi_current
            && matches!(self.mig, MigVerdict::NotManaged | MigVerdict::Applied)
    }
}

/// A [`NodeProblem`] borrowing what it can: a pool of thousands of nodes, none reported yet,
/// has a problem on every node, of which the status keeps [`MAX_PROBLEMS`]. The fields are
/// ordered as `NodeProblem`'s, so both sort alike.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Problem<'a> {
    node: &'a str,
    reason: &'a str,
    message: Cow<'a, str>,
}

impl From<Problem<'_>> for NodeProblem {
    fn from(p: Problem<'_>) -> Self {
        NodeProblem {
            node: p.node.to_owned(),
            reason: p.reason.to_owned(),
            message: p.message.into_owned(),
        }
    }
}

fn judge_node<'a>(
    pool: &GpuPool,
    m: &'a Member<'a>,
    problems: &mut Vec<Problem<'a>>,
) -> NodeVerdict {
    let mut v = NodeVerdict::default();
    let mut problem = |reason: &'a str, message: Cow<'a, str>| {
        problems.push(Problem {
            node: m.node,
            reason,
            message,
        })
    };
    if let Some(lp) = &m.layout_problem {
        problem(lp.reason, Cow::Borrowed(&lp.message));
        v.mig = MigVerdict::Failed;
    }
    let managed = m
        .gpunode
        .map(|g| g.spec.mig.managed)
        .unwrap_or(pool.spec.mig.layout.is_some());
    if managed && m.layout_problem.is_none() {
        // Until the agent says otherwise, the layout is still to be applied.
        v.mig = MigVerdict::Pending;
    }
    let Some(gn) = m.gpunode else {
        problem(
            "NotReported",
            "the GpuNode is being created; the gpupool agent has not reported yet".into(),
        );
        return v;
    };
    let Some(status) = &gn.status else {
        problem(
            "NotReported",
            "the gpupool agent has not reported on this node yet: check that the device-plugin pod runs on it".into(),
        );
        return v;
    };
    v.reported = true;
    v.trusted = m.node_ready && m.agent.describes_node();
    if !m.node_ready {
        problem(
            "NodeNotReady",
            "the Node is not Ready (its kubelet has stopped reporting: powered off, partitioned \
             or failing): what the agent last reported is not trusted, and its GPUs are not \
             counted healthy"
                .into(),
        );
    }
    match &m.agent {
        AgentLiveness::Stale { silent_for } => problem(
            "AgentStale",
            format!(
                "the gpupool agent has not reported for {}s (it writes at least every {}s): its \
                 status is out of date, so the node is not ready, its GPUs are not counted \
                 healthy and nothing is reclaimed on it; check the device-plugin pod on this node",
                silent_for.as_secs(),
                HEARTBEAT_INTERVAL.as_secs()
            )
            .into(),
        ),
        AgentLiveness::Live { skew: Some(skew) } => problem(
            "ClockSkew",
            format!(
                "the node's clock is {}s {} the operator's: its idle times are read on the \
                 operator's clock; fix the node's time sync (NTP/chrony)",
                skew.as_secs().unsigned_abs(),
                if skew.is_negative() {
                    "behind"
                } else {
                    "ahead of"
                }
            )
            .into(),
        ),
        AgentLiveness::Unconfirmed {
            stamped: true,
            waited,
        } => problem(
            "AgentUnconfirmed",
            format!(
                "the operator has not yet seen this node's agent write (it started or took over \
                 {}s ago; a live agent writes at least every {}s): its last report is shown, but \
                 nothing is reclaimed or drained on this node until a new heartbeat arrives",
                waited.as_secs(),
                HEARTBEAT_INTERVAL.as_secs()
            )
            .into(),
        ),
        AgentLiveness::Unconfirmed { stamped: false, .. } => problem(
            "AgentUnconfirmed",
            "the GpuNode status carries no heartbeat (status.heartbeatTime): whatever wrote it \
             is not a gpupool agent that stamps its reports, so the node is not ready, its GPUs \
             are not counted healthy and nothing is reclaimed or drained on it"
                .into(),
        ),
        AgentLiveness::Live { skew: None } | AgentLiveness::Unknown => {}
    }
    let generation = gn.metadata.generation;
    let current = |observed: Option<i64>| generation.is_none() || observed == generation;
    match status.validated {
        Some(Verdict::True) => v.validated = true,
        Some(Verdict::False) => {
            v.driver_failed = true;
            let failed: Vec<_> = status.checks.iter().filter(|c| !c.passed).collect();
            if failed.is_empty() {
                problem("DriverCheckFailed", "driver validation failed".into());
            }
            for c in failed {
                problem(
                    "DriverCheckFailed",
                    format!("check {} failed: {}", c.name, c.message).into(),
                );
            }
        }
        _ => problem(
            "NotValidated",
            "the driver checks have not finished on this node yet".into(),
        ),
    }
    v.cdi_current = if pool.spec.cdi.enabled {
        match &status.cdi {
            None => {
                problem(
                    "CDISpecMissing",
                    "the agent has not written a CDI spec yet".into(),
                );
                false
            }
            Some(_) if !current(status.observed_generation) => {
                problem(
                    "CDISpecStale",
                    "the CDI spec predates the node's current desired state; the agent is regenerating it".into(),
                );
                false
            }
            Some(_) => match status
                .conditions
                .iter()
                .find(|c| c.type_ == CDI_SPEC_READY && c.status == "False")
            {
                // Written, but not what the runtime will read: deleted, edited, or claimed by
                // another spec. The agent's message says what to fix.
                Some(c) => {
                    problem(
                        "CDISpecNotReady",
                        format!("{}: {}", c.reason, c.message).into(),
                    );
                    false
                }
                None => true,
            },
        }
    } else {
        true
    };
    if gn.spec.mig.managed && m.layout_problem.is_none() {
        v.mig = match status.mig.state {
            MigState::Applied if current(status.mig.observed_generation) => MigVerdict::Applied,
            MigState::Failed => {
                problem(
                    "MIGFailed",
                    format!(
                        "applying the MIG layout failed: {}",
                        [status.mig.reason.as_deref(), status.mig.message.as_deref()]
                            .into_iter()
                            .flatten()
                            .collect::<Vec<_>>()
                            .join(": ")
                    )
                    .into(),
                );
                MigVerdict::Failed
            }
            _ => MigVerdict::Pending,
        };
    }
    if m.mig_waiting && v.mig != MigVerdict::Failed {
        v.mig = MigVerdict::Pending;
        problem(
            "MIGRolloutWaiting",
            format!(
                "keeps its current MIG layout until its turn: at most {} node(s) of the pool \
                 change their layout at once (mig.maxUnavailable), and a node that failed to \
                 apply it keeps its turn until it is fixed, so a failing layout stops here",
                pool.spec.mig.max_unavailable()
            )
            .into(),
        );
    }
    for gpu in status.gpus.iter().filter(|g| g.health == Health::Unhealthy) {
        v.unhealthy = true;
        problem(
            "GPUUnhealthy",
            format!(
                "GPU {} ({}) is unhealthy: {}",
                gpu.index,
                gpu.uuid,
                gpu.reason.as_deref().unwrap_or("no reason given")
            )
            .into(),
        );
    }
    v
}

/// The pool's status.
pub fn pool_status(input: &StatusInput<'_>) -> GpuPoolStatus {
    let pool = input.pool;
    let previous = pool.status.clone().unwrap_or_default();
    let mut problems = Vec::new();
    let mut verdicts = Vec::new();
    for m in &input.members {
        verdicts.push(judge_node(pool, m, &mut problems));
    }
    for c in &input.conflicts {
        problems.push(Problem {
            node: &c.node,
            reason: "Conflict",
            message: Cow::Owned(if c.held_here {
                format!(
                    "also matched by pool {}; this pool holds the node and keeps it: narrow one of \
                     the selectors",
                    c.other
                )
            } else {
                format!(
                    "also matched by pool {}, which holds the node (it had it first, or is older): \
                     narrow one of the selectors",
                    c.other
                )
            }),
        });
    }
    problems.sort();
    problems.dedup();
    problems.truncate(MAX_PROBLEMS);
    let problems: Vec<NodeProblem> = problems.into_iter().map(NodeProblem::from).collect();

    let selected = input.members.len() as u32;
    let ready = verdicts.iter().filter(|v| v.ready()).count() as u32;
    let mut gpus = GpuCounts::default();
    let mut drivers: BTreeMap<String, u32> = BTreeMap::new();
    for (gn, verdict) in input
        .members
        .iter()
        .zip(&verdicts)
        .filter_map(|(m, v)| m.gpunode.map(|gn| (gn, v)))
    {
        if let Some(s) = &gn.status {
            gpus.total += s.gpu_count;
            // A node that cannot vouch for its report has no GPU known to be healthy.
            if verdict.trusted {
                gpus.healthy += s.healthy_gpus;
            }
            if let Some(d) = &s.driver_version {
                *drivers.entry(d.clone()).or_default() += 1;
            }
        }
    }
    let count = |f: fn(&MigVerdict) -> bool| verdicts.iter().filter(|v| f(&v.mig)).count() as u32;
    let layout_name = pool.spec.mig.layout.as_ref().map(layout::layout_name);
    let mig_applied = count(|m| *m == MigVerdict::Applied);
    let mig = MigProgress {
        summary: layout_name
            .as_ref()
            .map(|name| format!("{name} {mig_applied}/{selected}")),
        applied: mig_applied,
        pending: count(|m| *m == MigVerdict::Pending),
        failed: count(|m| *m == MigVerdict::Failed),
        pods_to_drain: input.pods_to_drain,
    };

    let gen_ = pool.metadata.generation;
    let mut conditions = Vec::new();
    let mut cond = |type_: &str, ok: bool, reason: &str, message: String| {
        conditions.push(condition(
            &previous.conditions,
            Observed {
                type_,
                status: ok,
                reason,
                message,
                observed_generation: gen_,
            },
            input.now,
        ));
    };
    // Nodes this pool selects but cannot have keep it from Ready; nodes it holds that another
    // pool also selects do not, but both pools say so under Conflict.
    let conflict = input.conflicts.iter().any(|c| !c.held_here);
    let overlap = !input.conflicts.is_empty();
    let blocked = input.api_failures.iter().any(blocks_ready);
    let ready_ok = selected > 0
        && ready == selected
        && !conflict
        && input.selector_error.is_none()
        && !blocked;
    let (ready_reason, ready_message) = if let Some(e) = &input.selector_error {
        (
            "InvalidSelector",
            format!("the node selector is invalid: {e}"),
        )
    } else if blocked {
        (API_ERRORS, blocked_message(ready, selected))
    } else if selected == 0 {
        (
            "NoNodes",
            "no node matches the node selector (or other pools hold them all)".to_owned(),
        )
    } else if conflict {
        (
            "Conflict",
            format!(
                "{ready}/{selected} nodes ready; other pools hold nodes this selector matches (see Conflict)"
            ),
        )
    } else if ready_ok {
        ("AllNodesReady", format!("{ready}/{selected} nodes ready"))
    } else {
        (
            "NodesNotReady",
            format!(
                "{ready}/{selected} nodes ready; not ready: {}",
                names(
                    input
                        .members
                        .iter()
                        .zip(&verdicts)
                        .filter(|(_, v)| !v.ready())
                        .map(|(m, _)| m.node)
                )
            ),
        )
    };
    cond("Ready", ready_ok, ready_reason, ready_message);

    let not = |f: &dyn Fn(&NodeVerdict) -> bool| {
        input
            .members
            .iter()
            .zip(&verdicts)
            .filter(|(_, v)| f(v))
            .map(|(m, _)| m.node)
            .collect::<Vec<_>>()
    };
    // With no node, "every node passed" would be a vacuous truth an admin reads as health.
    let none = selected == 0;
    let nothing = || "the pool selects no node: nothing to check".to_owned();
    let bad = not(&|v| !v.validated);
    if none {
        cond("DriverValid", false, "NoNodes", nothing());
    } else {
        cond(
            "DriverValid",
            bad.is_empty(),
            if bad.is_empty() {
                "ChecksPassed"
            } else if not(&|v| v.driver_failed).is_empty() {
                "Pending"
            } else {
                "ChecksFailed"
            },
            if bad.is_empty() {
                "every node passed the driver checks".into()
            } else {
                format!("not validated: {}", names(bad.iter().copied()))
            },
        );
    }
    let bad = not(&|v| !v.cdi_current);
    if none {
        cond("CDIReady", false, "NoNodes", nothing());
    } else {
        cond(
            "CDIReady",
            bad.is_empty(),
            if bad.is_empty() {
                "Current"
            } else {
                "NotCurrent"
            },
            if bad.is_empty() {
                "every node has a current CDI spec".into()
            } else {
                format!("CDI spec missing or stale: {}", names(bad.iter().copied()))
            },
        );
    }
    let bad = not(&|v| matches!(v.mig, MigVerdict::Pending | MigVerdict::Failed));
    cond(
        "MIGApplied",
        bad.is_empty(),
        if bad.is_empty() {
            "Applied"
        } else if not(&|v| v.mig == MigVerdict::Failed).is_empty() {
            "Applying"
        } else {
            "Failed"
        },
        if bad.is_empty() {
            match &layout_name {
                Some(n) => format!("{n} applied on every node"),
                None => "no MIG layout asked".into(),
            }
        } else {
            format!("MIG layout not applied: {}", names(bad.iter().copied()))
        },
    );
    // Conflict is True when there is one: report it with the polarity its name has.
    conditions.push(condition(
        &previous.conditions,
        Observed {
            type_: "Conflict",
            status: overlap,
            reason: if conflict {
                "NodesHeldByOtherPools"
            } else if overlap {
                "OtherPoolsMatchNodesHere"
            } else {
                "NoConflict"
            },
            message: if overlap {
                let mut lost: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
                let mut held: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
                for c in &input.conflicts {
                    let side = if c.held_here { &mut held } else { &mut lost };
                    side.entry(&c.other).or_default().push(&c.node);
                }
                let list = |m: &BTreeMap<&str, Vec<&str>>| {
                    m.iter()
                        .map(|(o, n)| format!("{o} ({})", names(n.iter().copied())))
                        .collect::<Vec<_>>()
                        .join("; ")
                };
                let mut parts = Vec::new();
                if !lost.is_empty() {
                    parts.push(format!(
                        "nodes matched here are held by other pools: {}",
                        list(&lost)
                    ));
                }
                if !held.is_empty() {
                    parts.push(format!(
                        "other pools also match nodes held here (they keep them until the selectors are disjoint): {}",
                        list(&held)
                    ));
                }
                format!("{}; make the selectors disjoint", parts.join("; "))
            } else {
                "no other pool matches a node of this pool".into()
            },
            observed_generation: gen_,
        },
        input.now,
    ));
    let degraded = not(&|v| v.unhealthy);
    conditions.push(condition(
        &previous.conditions,
        Observed {
            type_: "Degraded",
            status: !degraded.is_empty(),
            reason: if degraded.is_empty() {
                "AllGPUsHealthy"
            } else {
                "UnhealthyGPUs"
            },
            message: if degraded.is_empty() {
                "every GPU is healthy".into()
            } else {
                format!("unhealthy GPUs on {}", names(degraded.iter().copied()))
            },
            observed_generation: gen_,
        },
        input.now,
    ));

    conditions.push(condition(
        &previous.conditions,
        api_errors(&input.api_failures, gen_),
        input.now,
    ));

    GpuPoolStatus {
        observed_generation: gen_,
        nodes: Some(format!("{ready}/{selected}")),
        selected_nodes: selected,
        ready_nodes: ready,
        gpus,
        driver: (!drivers.is_empty())
            .then(|| drivers.keys().cloned().collect::<Vec<_>>().join(", ")),
        driver_versions: drivers
            .into_iter()
            .map(|(version, nodes)| DriverVersionCount { version, nodes })
            .collect(),
        mig,
        sharing: Some(sharing_summary(&pool.spec.sharing, &pool.spec.mig)),
        reclaim: input.reclaim.clone(),
        conditions,
        problems,
    }
}

/// The pool's `SHARING` column: `Exclusive`, or each mode with its replicas, the models or
/// GPU indices it is limited to, and its isolation (`TimeSlicing x4 (isolation: none)`,
/// `MPS x4 (isolation: memory, tenants trusted)`, `MIG (isolation: hardware)` when the pool lays out MIG
/// devices), joined by `; `.
pub fn sharing_summary(sharing: &SharingPolicy, mig: &MigPolicy) -> String {
    fn scope(s: &mut String, models: &Option<Vec<String>>, gpus: &Option<Vec<u32>>) {
        if let Some(models) = models {
            s.push_str(&format!(" on {}", models.join(",")));
        }
        if let Some(gpus) = gpus {
            let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
            s.push_str(&format!(" on GPU {}", list.join(",")));
        }
    }
    let mut parts = Vec::new();
    if let Some(ts) = &sharing.time_slicing {
        let mut s = format!("TimeSlicing x{}", ts.replicas);
        scope(&mut s, &ts.models, &ts.gpus);
        s.push_str(" (isolation: none)");
        parts.push(s);
    }
    if let Some(mps) = &sharing.mps {
        let mut s = format!("MPS x{}", mps.replicas);
        scope(&mut s, &mps.models, &mps.gpus);
        s.push_str(" (isolation: memory, tenants trusted)");
        parts.push(s);
    }
    let lays_out_mig = mig.strategy != MigStrategy::None
        && mig
            .layout
            .as_ref()
            .is_some_and(|l| l.preset.as_deref().is_none_or(|p| p != "all-disabled"));
    if lays_out_mig {
        parts.insert(0, "MIG (isolation: hardware)".into());
    }
    if parts.is_empty() {
        return "Exclusive".into();
    }
    parts.join("; ")
}

/// Whether a failure keeps the pool's nodes from their desired state (GpuNodes, node labels
/// and taints, the pool's own finalizer): then the pool is not Ready, whatever the nodes say.
fn blocks_ready(failure: &ApiFailure) -> bool {
    matches!(failure.resource, "gpunodes" | "nodes" | "gpupools")
}

fn blocked_message(ready: u32, selected: u32) -> String {
    format!(
        "{ready}/{selected} nodes ready; the operator cannot bring the nodes to the pool's desired state (see {API_ERRORS})"
    )
}

/// `APIErrors`: True, naming each failed kind of call once, while API calls fail; False once
/// a reconcile makes every call it needs.
fn api_errors(failures: &[ApiFailure], generation: Option<i64>) -> Observed<'static> {
    if failures.is_empty() {
        return Observed {
            type_: API_ERRORS,
            status: false,
            reason: "NoErrors",
            message: "the operator's last reconcile of this pool made every API call it needed"
                .into(),
            observed_generation: generation,
        };
    }
    let reason = if failures.iter().any(|f| f.code == Some(403)) {
        "Forbidden"
    } else if failures.iter().any(|f| f.code == Some(401)) {
        "Unauthorized"
    } else {
        "APICallsFailed"
    };
    Observed {
        type_: API_ERRORS,
        status: true,
        reason,
        message: api_errors_message(failures),
        observed_generation: generation,
    }
}

/// Each kind of failed call (verb, resource, HTTP status) once, with how many more of it.
pub fn api_errors_message(failures: &[ApiFailure]) -> String {
    let mut kinds: Vec<(&ApiFailure, usize)> = Vec::new();
    for f in failures {
        match kinds
            .iter_mut()
            .find(|(k, _)| (k.verb, k.resource, k.code) == (f.verb, f.resource, f.code))
        {
            Some((_, n)) => *n += 1,
            None => kinds.push((f, 1)),
        }
    }
    let message = kinds
        .iter()
        .map(|(f, n)| match n - 1 {
            0 => f.summary(),
            more => format!("{} (and {more} more like it)", f.summary()),
        })
        .collect::<Vec<_>>()
        .join("; ");
    if message.chars().count() > MAX_API_ERRORS_MESSAGE {
        let mut cut: String = message.chars().take(MAX_API_ERRORS_MESSAGE).collect();
        cut.push('…');
        cut
    } else {
        message
    }
}

/// The previous status with `failures` reported: for a reconcile that failed before it could
/// compute a status (the finalizer could not be added or removed, the cleanup failed).
pub fn with_api_failures(pool: &GpuPool, failures: &[ApiFailure], now: Timestamp) -> GpuPoolStatus {
    let mut status = pool.status.clone().unwrap_or_default();
    let generation = pool.metadata.generation;
    set_condition(
        &mut status.conditions,
        api_errors(failures, generation),
        now,
    );
    if failures.iter().any(blocks_ready) {
        let message = blocked_message(status.ready_nodes, status.selected_nodes);
        set_condition(
            &mut status.conditions,
            Observed {
                type_: "Ready",
                status: false,
                reason: API_ERRORS,
                message,
                observed_generation: generation,
            },
            now,
        );
    }
    status
}

/// `a, b, c and 4 more`.
pub fn names<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    let all: BTreeSet<&str> = items.into_iter().collect();
    let mut shown: Vec<&str> = all.iter().copied().take(MAX_NAMES_IN_MESSAGE).collect();
    let rest = all.len().saturating_sub(shown.len());
    let mut out = std::mem::take(&mut shown).join(", ");
    if rest > 0 {
        out.push_str(&format!(" and {rest} more"));
    }
    out
}

/// The status of a condition type, if present.
pub fn condition_status<'a>(status: &'a GpuPoolStatus, type_: &str) -> Option<&'a str> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.as_str())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gpupool_crds::node::{CheckName, CheckResult, GpuStatus};
    use gpupool_crds::policy::{MigLayout, MigPolicy, MigStrategy};
    use gpupool_crds::pool::GpuPoolSpec;
    use gpupool_crds::testing::healthy_status;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};

    pub(crate) fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    pub(crate) fn pool(name: &str, created: &str, match_labels: &[(&str, &str)]) -> GpuPool {
        let mut p = GpuPool::new(
            name,
            GpuPoolSpec {
                sharing: Default::default(),
                node_selector: LabelSelector {
                    match_labels: Some(
                        match_labels
                            .iter()
                            .map(|(k, v)| ((*k).into(), (*v).into()))
                            .collect(),
                    ),
                    match_expressions: None,
                },
                driver: Default::default(),
                cdi: Default::default(),
                mig: Default::default(),
                reclaim: Default::default(),
            },
        );
        p.metadata.uid = Some(format!("uid-{name}"));
        p.metadata.generation = Some(1);
        p.metadata.creation_timestamp = Some(Time(ts(created)));
        p
    }

    pub(crate) fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
    }

    pub(crate) fn ready_gpunode(pool: &GpuPool, node: &str) -> GpuNode {
        let (mut gn, _) = desired_gpunode(
            pool,
            node,
            &labels(&[
                ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
                ("nvidia.com/gpu.count", "8"),
            ]),
        );
        gn.metadata.generation = Some(1);
        gn.status = Some(healthy_status(&gn));
        gn
    }

    #[test]
    fn the_holder_else_the_oldest_matching_pool_owns_a_node() {
        let a = pool("a", "2026-01-02T00:00:00Z", &[("team", "x")]);
        let b = pool("b", "2026-01-01T00:00:00Z", &[("team", "x")]);
        let b2 = pool("a0", "2026-01-01T00:00:00Z", &[("team", "x")]);
        let c = pool("c", "2025-01-01T00:00:00Z", &[("team", "y")]);
        struct Case<'a> {
            pools: Vec<&'a GpuPool>,
            labels: &'a [(&'a str, &'a str)],
            want: Option<&'a str>,
        }
        let cases = [
            Case {
                pools: vec![&a, &b, &c],
                labels: &[("team", "x")],
                want: Some("b"),
            },
            Case {
                pools: vec![&a, &b, &b2],
                labels: &[("team", "x")],
                want: Some("a0"),
            },
            Case {
                pools: vec![&a, &b, &c],
                labels: &[("team", "y")],
                want: Some("c"),
            },
            Case {
                pools: vec![&a, &b],
                labels: &[("team", "z")],
                want: None,
            },
            Case {
                pools: vec![],
                labels: &[("team", "x")],
                want: None,
            },
            // The pool that holds the node keeps it while it matches, however old the others.
            Case {
                pools: vec![&a, &b, &b2],
                labels: &[("team", "x"), (POOL_LABEL, "a")],
                want: Some("a"),
            },
            // A label naming a pool that no longer matches holds nothing.
            Case {
                pools: vec![&a, &b, &c],
                labels: &[("team", "y"), (POOL_LABEL, "a")],
                want: Some("c"),
            },
        ];
        for c in cases {
            let got = owner_of(&labels(c.labels), c.pools.iter().copied()).map(|p| p.name_any());
            assert_eq!(got.as_deref(), c.want, "{:?}", c.labels);
        }
    }

    #[test]
    fn desired_gpunode_carries_pool_policy_and_owner() {
        let mut p = pool("train", "2026-01-01T00:00:00Z", &[]);
        p.spec.mig = MigPolicy {
            strategy: MigStrategy::Mixed,
            layout: Some(MigLayout {
                preset: Some("all-1g.10gb".into()),
                custom: None,
            }),
            max_unavailable: None,
        };
        p.spec.reclaim.idle_threshold = 7;
        let (gn, problem) = desired_gpunode(
            &p,
            "n1",
            &labels(&[
                ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
                ("nvidia.com/gpu.count", "8"),
            ]),
        );
        assert_eq!(problem, None);
        assert_eq!(gn.spec.pool, "train");
        assert_eq!(gn.spec.mig.gpus.len(), 8);
        assert_eq!(gn.spec.utilization.idle_threshold, 7);
        let owner = &gn.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("GpuPool", "uid-train")
        );
        assert_eq!(owner.controller, Some(true));
        assert!(gpunode_up_to_date(&gn, &gn));

        // An L4 node cannot take it: a problem, and MIG left alone.
        let (gn, problem) = desired_gpunode(
            &p,
            "n2",
            &labels(&[
                ("nvidia.com/gpu.product", "NVIDIA-L4"),
                ("nvidia.com/gpu.count", "4"),
            ]),
        );
        assert_eq!(problem.map(|p| p.reason), Some("MIGNotSupported"));
        assert!(!gn.spec.mig.managed);
    }

    /// The reconcile's check that a GpuNode is as wanted, made without building the desired
    /// GpuNode, says what comparing with the built one says: every field it compares, changed
    /// alone, makes the GpuNode out of date.
    #[test]
    fn a_gpunode_is_wanted_exactly_when_it_is_up_to_date() {
        let p = pool("train", "2026-01-01T00:00:00Z", &[]);
        let node_labels = labels(&[
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/gpu.count", "8"),
        ]);
        let resolved = resolve_spec(&p, &node_labels);
        let desired = gpunode_for(&p, "n1", resolved.spec.clone());
        let other_layout = Arc::new(NodeMigSpec {
            managed: true,
            ..NodeMigSpec::default()
        });
        type Edit = Box<dyn Fn(&mut GpuNode)>;
        let edits: Vec<(&str, Edit)> = vec![
            ("as built", Box::new(|_| {})),
            ("pool", Box::new(|g| g.spec.pool = "other".into())),
            (
                "driver",
                Box::new(|g| Arc::make_mut(&mut g.spec.driver).min_version = Some("550".into())),
            ),
            (
                "cdi",
                Box::new(|g| Arc::make_mut(&mut g.spec.cdi).spec_dir = "/etc/cdi".into()),
            ),
            (
                "mig",
                Box::new(|g| Arc::make_mut(&mut g.spec.mig).managed ^= true),
            ),
            (
                "utilization",
                Box::new(|g| g.spec.utilization.idle_threshold += 1),
            ),
            (
                "sharing",
                Box::new(|g| {
                    g.spec.sharing.time_slicing =
                        Some(serde_json::from_value(serde_json::json!({"replicas": 4})).unwrap());
                }),
            ),
            (
                "pool label",
                Box::new(|g| {
                    g.labels_mut().insert(POOL_LABEL.into(), "other".into());
                }),
            ),
            ("no labels", Box::new(|g| g.metadata.labels = None)),
            (
                "owner",
                Box::new(|g| g.owner_references_mut()[0].uid = "uid-other".into()),
            ),
            (
                "owner not controller",
                Box::new(|g| g.owner_references_mut()[0].controller = None),
            ),
        ];
        for (what, edit) in &edits {
            let mut existing = desired.clone();
            edit(&mut existing);
            assert_eq!(
                gpunode_wanted(&existing, &p, &resolved.spec, &resolved.spec.mig),
                gpunode_up_to_date(&existing, &desired),
                "{what}"
            );
            assert_eq!(
                gpunode_wanted(&existing, &p, &resolved.spec, &resolved.spec.mig),
                *what == "as built",
                "{what}"
            );
        }
        // A node waiting its turn in a rollout is compared with the layout it keeps.
        let mut kept = desired.clone();
        kept.spec.mig = other_layout.clone();
        assert!(gpunode_wanted(&kept, &p, &resolved.spec, &other_layout));
        assert!(!gpunode_wanted(
            &kept,
            &p,
            &resolved.spec,
            &resolved.spec.mig
        ));
    }

    #[test]
    fn nodes_of_one_kind_share_one_resolved_spec() {
        let mut p = pool("train", "2026-01-01T00:00:00Z", &[]);
        p.spec.mig.layout = Some(MigLayout {
            preset: Some("all-1g.10gb".into()),
            custom: None,
        });
        p.spec.sharing.time_slicing = Some(TimeSlicingPolicy {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: true,
            placement: Default::default(),
            resources: None,
            gpus: None,
            models: Some(vec!["NVIDIA-L4".into()]),
        });
        let h100 = labels(&[
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/gpu.count", "8"),
            ("kubernetes.io/hostname", "n1"),
        ]);
        let mut h100_other_host = h100.clone();
        h100_other_host.insert("kubernetes.io/hostname".into(), "n2".into());
        let mut h100_four = h100.clone();
        h100_four.insert("nvidia.com/gpu.count".into(), "4".into());
        let l4 = labels(&[
            ("nvidia.com/gpu.product", "NVIDIA-L4"),
            ("nvidia.com/gpu.count", "8"),
        ]);
        let mut specs = SpecResolver::new(&p);
        let a = specs.resolve(&h100);
        assert!(Arc::ptr_eq(&a, &specs.resolve(&h100_other_host)));
        let four = specs.resolve(&h100_four);
        let l4_spec = specs.resolve(&l4);
        assert!(!Arc::ptr_eq(&a, &four) && !Arc::ptr_eq(&a, &l4_spec));
        assert_eq!((a.spec.mig.gpus.len(), four.spec.mig.gpus.len()), (8, 4));
        // Sharing follows the product: only the L4 node time-slices.
        assert!(a.spec.sharing.time_slicing.is_none());
        assert!(l4_spec.spec.sharing.time_slicing.is_some());
        // Each is what the node's own resolution gives.
        for (labels, resolved) in [(&h100, &a), (&h100_four, &four), (&l4, &l4_spec)] {
            let (gn, problem) = desired_gpunode(&p, "n9", labels);
            assert_eq!((&gn.spec, &problem), (&resolved.spec, &resolved.problem));
            let built = gpunode_for(&p, "n9", resolved.spec.clone());
            assert_eq!((&gn.metadata, &gn.spec), (&built.metadata, &built.spec));
        }
    }

    fn input<'a>(pool: &'a GpuPool, members: Vec<Member<'a>>) -> StatusInput<'a> {
        StatusInput {
            pool,
            members,
            conflicts: vec![],
            selector_error: None,
            pods_to_drain: 0,
            reclaim: ReclaimStatus::default(),
            api_failures: vec![],
            now: ts("2026-03-01T00:00:00Z"),
        }
    }

    fn member<'a>(node: &'a str, gn: Option<&'a GpuNode>) -> Member<'a> {
        Member {
            node,
            gpunode: gn,
            layout_problem: None,
            node_ready: true,
            agent: AgentLiveness::Live { skew: None },
            mig_waiting: false,
        }
    }

    /// A node whose Node is NotReady, or whose agent has gone quiet, is not ready and its
    /// GPUs are not counted healthy, whatever its last report said; a skewed clock is named
    /// but does not make the node unready.
    #[test]
    fn a_silent_node_or_agent_is_not_ready_and_its_gpus_not_healthy() {
        use crate::liveness::AgentLiveness;
        use k8s_openapi::jiff::SignedDuration;
        let p = pool("train", "2026-01-01T00:00:00Z", &[]);
        let good = ready_gpunode(&p, "n1");
        let powered_off = Member {
            node_ready: false,
            ..member("n2", Some(&good))
        };
        let stale = Member {
            agent: AgentLiveness::Stale {
                silent_for: std::time::Duration::from_secs(240),
            },
            ..member("n3", Some(&good))
        };
        let unknown = Member {
            agent: AgentLiveness::Unknown,
            ..member("n5", Some(&good))
        };
        let skewed = Member {
            agent: AgentLiveness::Live {
                skew: Some(SignedDuration::from_secs(-600)),
            },
            ..member("n4", Some(&good))
        };
        let st = pool_status(&input(
            &p,
            vec![
                member("n1", Some(&good)),
                powered_off,
                stale,
                skewed,
                unknown,
            ],
        ));
        assert_eq!(condition_status(&st, "Ready"), Some("False"));
        assert_eq!(st.nodes.as_deref(), Some("2/5"));
        assert_eq!(st.gpus.total, 40);
        assert_eq!(st.gpus.healthy, 16, "only n1 and n4 vouch for their GPUs");
        let reasons: Vec<(&str, &str)> = st
            .problems
            .iter()
            .map(|p| (p.node.as_str(), p.reason.as_str()))
            .collect();
        assert!(reasons.contains(&("n2", "NodeNotReady")), "{reasons:?}");
        assert!(reasons.contains(&("n3", "AgentStale")), "{reasons:?}");
        assert!(reasons.contains(&("n4", "ClockSkew")), "{reasons:?}");
        let skew = st
            .problems
            .iter()
            .find(|p| p.reason == "ClockSkew")
            .unwrap();
        assert!(skew.message.contains("600s behind"), "{}", skew.message);
        let stale = st
            .problems
            .iter()
            .find(|p| p.reason == "AgentStale")
            .unwrap();
        assert!(stale.message.contains("240s"), "{}", stale.message);
        // Without them, the same reports make a ready pool.
        let st = pool_status(&input(&p, vec![member("n1", Some(&good))]));
        assert_eq!(condition_status(&st, "Ready"), Some("True"));
        assert_eq!(st.gpus.healthy, 8);
    }

    #[test]
    fn status_is_ready_only_when_every_node_is() {
        let mut p = pool("train", "2026-01-01T00:00:00Z", &[]);
        p.spec.mig.layout = Some(MigLayout {
            preset: Some("all-1g.10gb".into()),
            custom: None,
        });
        p.spec.mig.strategy = MigStrategy::Mixed;
        let good = ready_gpunode(&p, "n1");
        let mut bad_driver = ready_gpunode(&p, "n2");
        if let Some(s) = bad_driver.status.as_mut() {
            s.validated = Some(Verdict::False);
            s.driver_version = Some("535.104.05".into());
            s.checks = vec![CheckResult {
                name: CheckName::CudaVersion,
                passed: false,
                message: "driver 535.104.05 supports CUDA 12.2; pool requires 12.4: upgrade the driver to ≥ 550".into(),
            }];
        }
        let mut applying = ready_gpunode(&p, "n3");
        if let Some(s) = applying.status.as_mut() {
            s.mig.state = MigState::Applying;
        }
        let mut stale_cdi = ready_gpunode(&p, "n4");
        stale_cdi.metadata.generation = Some(2);
        if let Some(s) = stale_cdi.status.as_mut() {
            s.mig.observed_generation = Some(2);
        }
        // Current by generation, but the agent found its spec claimed by another file.
        let mut conflicting_cdi = ready_gpunode(&p, "n6");
        if let Some(s) = conflicting_cdi.status.as_mut() {
            s.conditions.push(Condition {
                type_: CDI_SPEC_READY.into(),
                status: "False".into(),
                reason: "SpecConflict".into(),
                message: "/etc/cdi/other.yaml also defines gpupool.io/gpu=0".into(),
                last_transition_time: Time(ts("2026-01-01T00:00:00Z")),
                observed_generation: None,
            });
        }

        let all_good = pool_status(&input(
            &p,
            vec![member("n1", Some(&good)), member("n0", Some(&good))],
        ));
        assert_eq!(condition_status(&all_good, "Ready"), Some("True"));
        assert_eq!(all_good.nodes.as_deref(), Some("2/2"));
        assert_eq!(all_good.gpus.total, 16);
        assert_eq!(all_good.mig.summary.as_deref(), Some("all-1g.10gb 2/2"));
        assert_eq!(all_good.driver.as_deref(), Some("550.54.15"));
        assert!(all_good.problems.is_empty());

        let st = pool_status(&input(
            &p,
            vec![
                member("n1", Some(&good)),
                member("n2", Some(&bad_driver)),
                member("n3", Some(&applying)),
                member("n4", Some(&stale_cdi)),
                member("n5", None),
                member("n6", Some(&conflicting_cdi)),
            ],
        ));
        assert_eq!(condition_status(&st, "Ready"), Some("False"));
        assert_eq!(condition_status(&st, "DriverValid"), Some("False"));
        assert_eq!(condition_status(&st, "MIGApplied"), Some("False"));
        assert_eq!(condition_status(&st, "CDIReady"), Some("False"));
        assert_eq!(st.nodes.as_deref(), Some("1/6"));
        // n1, n2, n4 and n6 have the layout; n3 is applying, n5 has not reported.
        assert_eq!(st.mig.summary.as_deref(), Some("all-1g.10gb 4/6"));
        assert_eq!(st.mig.pending, 2, "n3 applying, n5 not reported");
        assert_eq!(st.driver.as_deref(), Some("535.104.05, 550.54.15"));
        let reasons: Vec<(&str, &str)> = st
            .problems
            .iter()
            .map(|p| (p.node.as_str(), p.reason.as_str()))
            .collect();
        assert_eq!(
            reasons,
            vec![
                ("n2", "DriverCheckFailed"),
                ("n4", "CDISpecStale"),
                ("n5", "NotReported"),
                ("n6", "CDISpecNotReady")
            ]
        );
        assert_eq!(
            st.problems[0].message,
            "check CUDAVersion failed: driver 535.104.05 supports CUDA 12.2; pool requires 12.4: upgrade the driver to ≥ 550"
        );
    }

    #[test]
    fn conflicts_keep_the_pool_from_ready_and_name_the_nodes() {
        let p = pool("young", "2026-02-01T00:00:00Z", &[]);
        let gn = ready_gpunode(&p, "n1");
        let mut inp = input(&p, vec![member("n1", Some(&gn))]);
        inp.conflicts = vec![ConflictingNode {
            node: "n2".into(),
            other: "old".into(),
            held_here: false,
        }];
        let st = pool_status(&inp);
        assert_eq!(condition_status(&st, "Ready"), Some("False"));
        assert_eq!(condition_status(&st, "Conflict"), Some("True"));
        let c = st
            .conditions
            .iter()
            .find(|c| c.type_ == "Conflict")
            .unwrap();
        assert!(c.message.contains("old (n2)"), "{}", c.message);
        assert_eq!(st.problems[0].reason, "Conflict");
    }

    /// The pool that holds a node another pool also matches stays Ready and says so.
    #[test]
    fn a_pool_holding_a_shared_node_stays_ready_and_reports_the_overlap() {
        let p = pool("old", "2026-01-01T00:00:00Z", &[]);
        let gn = ready_gpunode(&p, "n1");
        let mut inp = input(&p, vec![member("n1", Some(&gn))]);
        inp.conflicts = vec![ConflictingNode {
            node: "n1".into(),
            other: "young".into(),
            held_here: true,
        }];
        let st = pool_status(&inp);
        assert_eq!(condition_status(&st, "Ready"), Some("True"));
        let c = st
            .conditions
            .iter()
            .find(|c| c.type_ == "Conflict")
            .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "OtherPoolsMatchNodesHere")
        );
        assert!(c.message.contains("young (n1)"), "{}", c.message);
        assert!(
            st.problems[0].message.contains("keeps it"),
            "{:?}",
            st.problems
        );
    }

    #[test]
    fn nodes_are_tainted_while_their_driver_fails_or_their_mig_layout_changes() {
        let mut p = pool("train", "2026-01-01T00:00:00Z", &[]);
        let gn = ready_gpunode(&p, "n1");
        assert!(node_taints(&p, Some(&gn)).is_empty());
        assert!(node_taints(&p, None).is_empty());
        for (state, tainted) in [
            (MigState::Draining, true),
            (MigState::Applying, true),
            (MigState::Applied, false),
            (MigState::Failed, false),
            (MigState::Idle, false),
        ] {
            let mut g = gn.clone();
            g.status.as_mut().unwrap().mig.state = state;
            assert_eq!(
                node_taints(&p, Some(&g)).contains(MIG_RECONFIGURING_TAINT),
                tainted,
                "{state:?}"
            );
        }
        let mut failing = gn.clone();
        failing.status.as_mut().unwrap().validated = Some(Verdict::False);
        assert!(
            node_taints(&p, Some(&failing)).is_empty(),
            "onFailure defaults to not tainting"
        );
        p.spec.driver.on_failure = OnFailure::Taint;
        assert_eq!(
            node_taints(&p, Some(&failing)),
            BTreeSet::from([DRIVER_INVALID_TAINT])
        );
    }

    /// One layout edit rolls over the nodes `mig.maxUnavailable` at a time, in name order.
    #[test]
    fn a_mig_layout_edit_rolls_over_the_nodes_a_few_at_a_time() {
        let mut p = pool("train", "2026-01-01T00:00:00Z", &[]);
        let old = ready_gpunode(&p, "n1");
        p.spec.mig = MigPolicy {
            strategy: MigStrategy::Mixed,
            layout: Some(MigLayout {
                preset: Some("all-1g.10gb".into()),
                custom: None,
            }),
            max_unavailable: None,
        };
        let want = ready_gpunode(&p, "n1").spec.mig;
        assert_ne!(old.spec.mig, want);
        let on = |name: &str, gn: &GpuNode| {
            let mut g = gn.clone();
            g.metadata.name = Some(name.into());
            g
        };
        let (o1, o2, o3) = (on("n1", &old), on("n2", &old), on("n3", &old));
        let holds = |nodes: &[(&'static str, Option<&GpuNode>)], max: u32| {
            let rows: Vec<_> = nodes.iter().map(|(n, g)| (*n, *g, &*want)).collect();
            mig_rollout_holds(max, &rows)
        };
        // Nothing under way: the first node by name goes, the others hold.
        assert_eq!(
            holds(
                &[("n3", Some(&o3)), ("n1", Some(&o1)), ("n2", Some(&o2))],
                1
            ),
            BTreeSet::from(["n2", "n3"])
        );
        // n1 has the new layout and is draining: nobody else starts.
        let mut n1_draining = on("n1", &old);
        n1_draining.spec.mig = want.clone();
        n1_draining.status.as_mut().unwrap().mig.state = MigState::Draining;
        assert_eq!(
            holds(
                &[
                    ("n1", Some(&n1_draining)),
                    ("n2", Some(&o2)),
                    ("n3", Some(&o3))
                ],
                1
            ),
            BTreeSet::from(["n2", "n3"])
        );
        // Handed over but not yet seen by its agent (generation not observed): still under way.
        let mut n1_handed = n1_draining.clone();
        n1_handed.status.as_mut().unwrap().mig.state = MigState::Applied;
        n1_handed.metadata.generation = Some(2);
        assert_eq!(
            holds(
                &[
                    ("n1", Some(&n1_handed)),
                    ("n2", Some(&o2)),
                    ("n3", Some(&o3))
                ],
                1
            ),
            BTreeSet::from(["n2", "n3"])
        );
        // n1 done (Applied for its generation): n2 goes next; with two at a time, n3 too.
        let mut n1_done = n1_handed.clone();
        n1_done.status.as_mut().unwrap().mig.observed_generation = Some(2);
        assert_eq!(
            holds(
                &[("n1", Some(&n1_done)), ("n2", Some(&o2)), ("n3", Some(&o3))],
                1
            ),
            BTreeSet::from(["n3"])
        );
        assert!(
            holds(
                &[("n1", Some(&n1_done)), ("n2", Some(&o2)), ("n3", Some(&o3))],
                2
            )
            .is_empty()
        );
        // A node that failed to apply the layout keeps its slot: with one at a time, nobody
        // else is drained for a layout that fails (a drain that timed out is a failure too).
        let mut n1_failed = n1_done.clone();
        n1_failed.status.as_mut().unwrap().mig.state = MigState::Failed;
        assert_eq!(
            holds(
                &[
                    ("n1", Some(&n1_failed)),
                    ("n2", Some(&o2)),
                    ("n3", Some(&o3))
                ],
                1
            ),
            BTreeSet::from(["n2", "n3"])
        );
        // With two at a time, one more node may go; a node without a GpuNode never waits.
        assert_eq!(
            holds(
                &[
                    ("n1", Some(&n1_failed)),
                    ("n2", Some(&o2)),
                    ("n3", Some(&o3))
                ],
                2
            ),
            BTreeSet::from(["n3"])
        );
        assert_eq!(
            holds(&[("n1", Some(&n1_failed)), ("n3", None)], 1),
            BTreeSet::new()
        );
        // A failure on an older layout than the one wanted does not hold the new one back.
        let mut n1_failed_old = n1_failed.clone();
        n1_failed_old.spec.mig = old.spec.mig.clone();
        assert_eq!(
            holds(
                &[
                    ("n1", Some(&n1_failed_old)),
                    ("n2", Some(&o2)),
                    ("n3", Some(&o3))
                ],
                1
            ),
            BTreeSet::from(["n2", "n3"])
        );

        // The pool says which nodes wait, and why.
        let waiting = Member {
            mig_waiting: true,
            ..member("n2", Some(&o2))
        };
        let st = pool_status(&input(&p, vec![member("n1", Some(&n1_done)), waiting]));
        assert_eq!(st.mig.pending, 1, "{:?}", st.mig);
        assert!(
            st.problems
                .iter()
                .any(|pr| pr.node == "n2" && pr.reason == "MIGRolloutWaiting"),
            "{:?}",
            st.problems
        );
    }

    #[test]
    fn time_slicing_reaches_the_nodes_of_its_models_and_shows_in_the_status() {
        let ts = TimeSlicingPolicy {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: true,
            placement: Default::default(),
            resources: None,
            gpus: None,
            models: Some(vec!["NVIDIA-L4".into()]),
        };
        let sharing = SharingPolicy {
            time_slicing: Some(ts.clone()),
            mps: None,
        };
        let l4 = labels(&[("nvidia.com/gpu.product", "NVIDIA-L4")]);
        let h100 = labels(&[("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")]);
        let on_l4 = node_sharing(&sharing, &l4);
        assert_eq!(
            on_l4.time_slicing,
            Some(TimeSlicingPolicy {
                models: None,
                ..ts.clone()
            })
        );
        assert_eq!(node_sharing(&sharing, &h100), SharingPolicy::default());
        assert_eq!(
            node_sharing(&sharing, &labels(&[])),
            SharingPolicy::default()
        );
        assert_eq!(
            sharing_summary(&sharing, &MigPolicy::default()),
            "TimeSlicing x4 on NVIDIA-L4 (isolation: none)"
        );
        assert_eq!(
            sharing_summary(&SharingPolicy::default(), &MigPolicy::default()),
            "Exclusive"
        );
        let mig: MigPolicy = serde_json::from_value(serde_json::json!({
            "strategy": "mixed", "layout": {"preset": "all-1g.10gb"},
        }))
        .unwrap();
        assert_eq!(
            sharing_summary(&SharingPolicy::default(), &mig),
            "MIG (isolation: hardware)"
        );
        assert_eq!(
            sharing_summary(&sharing, &mig),
            "MIG (isolation: hardware); TimeSlicing x4 on NVIDIA-L4 (isolation: none)"
        );
        let mut p = pool("infer", "2026-01-01T00:00:00Z", &[]);
        p.spec.sharing = sharing;
        let (gn, _) = desired_gpunode(&p, "n1", &l4);
        assert_eq!(gn.spec.sharing.time_slicing.map(|t| t.replicas), Some(4));
    }

    #[test]
    fn mps_and_time_slicing_reach_their_own_models_and_both_show_in_the_status() {
        let sharing = SharingPolicy {
            time_slicing: Some(TimeSlicingPolicy {
                replicas: 4,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                placement: Default::default(),
                resources: None,
                gpus: None,
                models: Some(vec!["NVIDIA-L4".into()]),
            }),
            mps: Some(MpsPolicy {
                replicas: 8,
                rename_by_default: true,
                fail_requests_greater_than_one: true,
                placement: Default::default(),
                memory_limit: Some("10Gi".into()),
                active_thread_percentage: Some(25),
                gpus: None,
                models: Some(vec!["NVIDIA-H100-80GB-HBM3".into()]),
            }),
        };
        let h100 = node_sharing(
            &sharing,
            &labels(&[("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")]),
        );
        assert_eq!(h100.time_slicing, None);
        let mps = h100.mps.expect("MPS reaches the H100 node");
        assert_eq!((mps.replicas, mps.models.clone()), (8, None));
        assert_eq!(mps.memory_limit_mib(), Some(10 * 1024));
        let l4 = node_sharing(
            &sharing,
            &labels(&[("nvidia.com/gpu.product", "NVIDIA-L4")]),
        );
        assert!(l4.mps.is_none() && l4.time_slicing.is_some());
        assert_eq!(
            sharing_summary(&sharing, &MigPolicy::default()),
            "TimeSlicing x4 on NVIDIA-L4 (isolation: none); MPS x8 on NVIDIA-H100-80GB-HBM3 (isolation: memory, tenants trusted)"
        );
    }

    #[test]
    fn unchanged_input_gives_an_identical_status() {
        let mut p = pool("train", "2026-01-01T00:00:00Z", &[]);
        let gn = ready_gpunode(&p, "n1");
        let first = pool_status(&input(&p, vec![member("n1", Some(&gn))]));
        p.status = Some(first.clone());
        let mut later = input(&p, vec![member("n1", Some(&gn))]);
        later.now = ts("2026-03-02T00:00:00Z");
        assert_eq!(pool_status(&later), first);
    }

    #[test]
    fn problems_are_bounded_and_sorted() {
        let p = pool("big", "2026-01-01T00:00:00Z", &[]);
        let names: Vec<String> = (0..80).map(|i| format!("n{i:03}")).collect();
        let members: Vec<Member<'_>> = names.iter().map(|n| member(n, None)).collect();
        let st = pool_status(&input(&p, members));
        assert_eq!(st.problems.len(), MAX_PROBLEMS);
        assert_eq!(
            condition_status(&st, "MIGApplied"),
            Some("True"),
            "no layout asked"
        );
        assert!(st.problems.windows(2).all(|w| w[0] <= w[1]));
        let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert!(ready.message.contains("and 70 more"), "{}", ready.message);
    }

    #[test]
    fn no_nodes_is_not_ready() {
        let p = pool("empty", "2026-01-01T00:00:00Z", &[]);
        let st = pool_status(&input(&p, vec![]));
        assert_eq!(condition_status(&st, "Ready"), Some("False"));
        let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(ready.reason, "NoNodes");
        // No vacuous "every node passed": nothing was checked.
        for type_ in ["DriverValid", "CDIReady"] {
            let c = st.conditions.iter().find(|c| c.type_ == type_).unwrap();
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", "NoNodes"),
                "{type_}"
            );
            assert!(c.message.contains("selects no node"), "{}", c.message);
        }
    }

    fn failure(verb: &'static str, resource: &'static str, object: &str, code: u16) -> ApiFailure {
        let status = kube::core::Status::failure(&format!("{resource} \"{object}\": nope"), "X")
            .with_code(code);
        ApiFailure::new(
            verb,
            resource,
            format!("doing {object}"),
            &kube::Error::Api(Box::new(status)),
        )
    }

    #[test]
    fn api_failures_make_a_condition_and_keep_ready_false_only_for_the_pools_own_writes() {
        let p = pool("p", "2026-01-01T00:00:00Z", &[]);
        let gn = ready_gpunode(&p, "n1");
        let with = |failures: Vec<ApiFailure>| {
            let mut inp = input(&p, vec![member("n1", Some(&gn))]);
            inp.api_failures = failures;
            pool_status(&inp)
        };
        let cond = |st: &GpuPoolStatus, t: &str| {
            st.conditions
                .iter()
                .find(|c| c.type_ == t)
                .cloned()
                .unwrap()
        };

        let clean = with(vec![]);
        assert_eq!(cond(&clean, API_ERRORS).status, "False");
        assert_eq!(cond(&clean, API_ERRORS).reason, "NoErrors");
        assert_eq!(cond(&clean, "Ready").status, "True");

        // A refused reclaim action: reported, but the nodes are as they should be.
        let jobs = with(vec![failure("patch", "jobs", "train", 403)]);
        assert_eq!(cond(&jobs, API_ERRORS).status, "True");
        assert_eq!(cond(&jobs, API_ERRORS).reason, "Forbidden");
        assert_eq!(cond(&jobs, "Ready").status, "True");

        // The pool's own writes failing: not Ready, whatever the nodes report.
        for resource in ["nodes", "gpunodes", "gpupools"] {
            let st = with(vec![failure("patch", resource, "x", 500)]);
            let api = cond(&st, API_ERRORS);
            assert_eq!(
                (api.status.as_str(), api.reason.as_str()),
                ("True", "APICallsFailed")
            );
            assert!(
                api.message
                    .starts_with(&format!("patch {resource} failed with HTTP 500")),
                "{}",
                api.message
            );
            let ready = cond(&st, "Ready");
            assert_eq!(
                (ready.status.as_str(), ready.reason.as_str()),
                ("False", API_ERRORS)
            );
        }

        let unauthorized = with(vec![failure("delete", "gpunodes", "n9", 401)]);
        assert_eq!(cond(&unauthorized, API_ERRORS).reason, "Unauthorized");
        // 403 wins the reason whatever the order.
        let mixed = with(vec![
            failure("patch", "nodes", "n1", 500),
            failure("patch", "pods", "w", 403),
        ]);
        assert_eq!(cond(&mixed, API_ERRORS).reason, "Forbidden");
    }

    #[test]
    fn api_errors_name_each_kind_of_call_once() {
        let msg = api_errors_message(&[
            failure("patch", "nodes", "n1", 403),
            failure("patch", "nodes", "n2", 403),
            failure("patch", "nodes", "n3", 403),
            failure("patch", "pods", "w", 403),
            failure("patch", "nodes", "n4", 500),
        ]);
        assert_eq!(
            msg.matches("the operator cannot patch nodes").count(),
            1,
            "{msg}"
        );
        assert!(msg.contains("doing n1"), "{msg}");
        assert!(!msg.contains("doing n2"), "{msg}");
        assert!(msg.contains("(and 2 more like it)"), "{msg}");
        assert!(
            msg.contains("the operator cannot patch pods: forbidden"),
            "{msg}"
        );
        assert!(msg.contains("patch nodes failed with HTTP 500"), "{msg}");
        let many: Vec<ApiFailure> = ["nodes", "pods", "jobs", "gpunodes", "gpupools", "events"]
            .iter()
            .flat_map(|r| (400..420).map(move |code| failure("patch", r, &"x".repeat(300), code)))
            .collect();
        let long = api_errors_message(&many);
        assert_eq!(long.chars().count(), MAX_API_ERRORS_MESSAGE + 1);
        assert!(long.ends_with('…'));
    }

    #[test]
    fn a_failure_before_any_status_still_reports() {
        let mut p = pool("p", "2026-01-01T00:00:00Z", &[]);
        let now = ts("2026-03-01T00:00:00Z");
        let st = with_api_failures(&p, &[failure("patch", "gpupools", "p", 403)], now);
        assert_eq!(condition_status(&st, API_ERRORS), Some("True"));
        assert_eq!(condition_status(&st, "Ready"), Some("False"));
        // Over a full status, only the two conditions change.
        let gn = ready_gpunode(&p, "n1");
        p.status = Some(pool_status(&input(&p, vec![member("n1", Some(&gn))])));
        let before = p.status.clone().unwrap();
        let st = with_api_failures(&p, &[failure("delete", "gpunodes", "n1", 403)], now);
        assert_eq!(st.conditions.len(), before.conditions.len());
        assert_eq!(st.gpus, before.gpus);
        assert_eq!(condition_status(&st, API_ERRORS), Some("True"));
        assert_eq!(condition_status(&st, "DriverValid"), Some("True"));
        // A refusal outside the pool's own writes leaves Ready alone.
        let st = with_api_failures(&p, &[failure("patch", "pods", "w", 403)], now);
        assert_eq!(condition_status(&st, "Ready"), Some("True"));
    }

    #[test]
    fn unhealthy_gpus_degrade() {
        let p = pool("p", "2026-01-01T00:00:00Z", &[]);
        let mut gn = ready_gpunode(&p, "n1");
        if let Some(s) = gn.status.as_mut() {
            s.gpus = vec![GpuStatus {
                index: 3,
                uuid: "GPU-3".into(),
                health: Health::Unhealthy,
                reason: Some("Xid 79".into()),
                ..Default::default()
            }];
        }
        let st = pool_status(&input(&p, vec![member("n1", Some(&gn))]));
        assert_eq!(condition_status(&st, "Degraded"), Some("True"));
        assert_eq!(st.problems[0].message, "GPU 3 (GPU-3) is unhealthy: Xid 79");
    }
}
