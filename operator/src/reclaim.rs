//! Idle-pod reclamation: the decision for one pod (pure), and the bookkeeping of actions
//! (rate limit, history).
//!
//! A pod is reclaimed only on positive evidence: every GPU device it holds reports `Idle`
//! with an `idleSince` far enough in the past, on a node whose agent is reporting. Anything
//! else — a busy device, missing or unknown data, a stale node — holds the pod as it is.

use std::collections::BTreeMap;

use gpupool_crds::labels::{IDLE_SINCE_ANNOTATION, RECLAIM_AT_ANNOTATION};
use gpupool_crds::node::{Activity, GpuNode, Idleness, share_of};
use gpupool_crds::policy::{RECLAIM_OPT_OUT_ANNOTATION, ReclaimAction, ReclaimMode, ReclaimPolicy};
use gpupool_crds::pool::{ReclaimRecord, ReclaimStatus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

/// Pod annotation set once a dry run has reported what it would have done, so the report is
/// made once per idle period.
pub const DRY_RUN_ANNOTATION: &str = "gpupool.io/reclaim-dry-run";
/// Most entries in the status history: as many as `rateLimit.maxActions` may ask for, so the
/// history always holds every action the limit counts.
pub const MAX_HISTORY: usize = gpupool_crds::policy::MAX_ACTIONS_LIMIT as usize;

/// What a GPU device says about its activity, as the reclaimer needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceIdleness {
    /// Last sampled activity.
    pub activity: Activity,
    /// Since when it has been idle.
    pub idle_since: Option<Timestamp>,
}

impl From<&Idleness> for DeviceIdleness {
    fn from(i: &Idleness) -> Self {
        Self {
            activity: i.activity,
            idle_since: i.idle_since.as_ref().map(|t| t.0),
        }
    }
}

/// The devices each pod holds on a node, keyed by `(namespace, name)`. A GPU split into MIG
/// devices is represented by its MIG devices, which carry their own idleness. A pod sharing a
/// device (time-slicing, MPS) is judged on its own share when the agent reports one; else by
/// the device only when the device is idle (then so is every share of it), and otherwise as
/// unknown: a busy shared device says nothing about one tenant.
pub fn devices_by_pod(gn: &GpuNode) -> BTreeMap<(String, String), Vec<DeviceIdleness>> {
    let mut out: BTreeMap<(String, String), Vec<DeviceIdleness>> = BTreeMap::new();
    let Some(status) = &gn.status else {
        return out;
    };
    for gpu in &status.gpus {
        // MIG devices are partitions, each one pod's: judged by their own idleness.
        let shared = gpu.sharing.as_ref().is_some_and(|s| s.mode != "MIG");
        let shares = &gpu.shares;
        let mut add = |i: &Idleness| {
            for p in &i.pods {
                let own = share_of(shares, p);
                let judged: DeviceIdleness = match (shared, own) {
                    (false, _) => i.into(),
                    (true, Some(share)) => share.into(),
                    (true, None) if i.activity == Activity::Idle => i.into(),
                    (true, None) => DeviceIdleness {
                        activity: Activity::Unknown,
                        idle_since: None,
                    },
                };
                out.entry((p.namespace.to_string(), p.name.clone()))
                    .or_default()
                    .push(judged);
            }
        };
        if gpu.mig_devices.is_empty() {
            add(&gpu.idleness);
        } else {
            for m in &gpu.mig_devices {
                add(&m.idleness);
            }
            // A holder of the whole GPU next to MIG devices cannot be judged by them.
            add(&gpu.idleness);
        }
    }
    out
}

/// Facts about a pod's surroundings that the decision needs.
#[derive(Clone, Debug, Default)]
pub struct PodContext<'a> {
    /// The devices the node's agent says the pod holds.
    pub devices: Vec<DeviceIdleness>,
    /// Whether the pod runs on a node of this pool.
    pub on_pool_node: bool,
    /// Whether the node's agent data can be trusted now (node Ready, agent reporting).
    pub data_fresh: bool,
    /// Labels of the pod's namespace, when known.
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
    /// Whether GPU pods that could run on the pool's nodes are pending ([`crate::demand`]).
    pub demand_pending: bool,
    /// Other pods of the same Job that have not finished (any node). With `action: Auto` a
    /// Job is suspended only when this pod is its last: suspending it would otherwise kill
    /// siblings that may be busy, and past their PodDisruptionBudgets.
    pub job_siblings: usize,
}

/// What to do with a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nothing to do and nothing to undo.
    Ignore(&'static str),
    /// Keep things as they are: the data does not allow a decision.
    Hold(HoldReason),
    /// The pod was warned but is no longer idle (or became exempt): remove the warning.
    Unwarn(&'static str),
    /// Warn the pod: annotate and send a Warning Event.
    Warn {
        /// Since when its GPUs have been idle.
        idle_since: Timestamp,
        /// When it will be reclaimed.
        reclaim_at: Timestamp,
    },
    /// Warned; the deadline has not come.
    Wait {
        /// The deadline.
        reclaim_at: Timestamp,
    },
    /// Deadline passed, but the policy acts only while GPU demand is pending.
    WaitForPressure,
    /// Deadline passed and the policy only notifies (or the dry run was already reported).
    Notified,
    /// Act now.
    Act(ActionKind),
}

/// Why the reclaimer holds: a fixed set, so it can label a metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HoldReason {
    /// The pod has no start time.
    NoStartTime,
    /// The node's agent lists no GPU held by the pod.
    NoDevices,
    /// The node's utilization data is not current.
    StaleData,
    /// A GPU is idle but reports no valid `idleSince`.
    NoIdleSince,
    /// A GPU's activity is unknown.
    ActivityUnknown,
    /// `Suspend` needs a Job owner.
    NoJobToSuspend,
    /// `Delete` needs `allowDelete: true`.
    DeleteNotAllowed,
}

impl HoldReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            HoldReason::NoStartTime => "NoStartTime",
            HoldReason::NoDevices => "NoDevices",
            HoldReason::StaleData => "StaleData",
            HoldReason::NoIdleSince => "NoIdleSince",
            HoldReason::ActivityUnknown => "ActivityUnknown",
            HoldReason::NoJobToSuspend => "NoJobToSuspend",
            HoldReason::DeleteNotAllowed => "DeleteNotAllowed",
        }
    }
}

impl std::fmt::Display for HoldReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HoldReason::NoStartTime => "the pod has no start time",
            HoldReason::NoDevices => "the node's agent lists no GPU device held by the pod",
            HoldReason::StaleData => "the node's utilization data is not current",
            HoldReason::NoIdleSince => "a GPU is idle but reports no valid idleSince",
            HoldReason::ActivityUnknown => "a GPU's activity is unknown",
            HoldReason::NoJobToSuspend => {
                "action Suspend needs a Job owner and the pod has none: use Auto or Evict"
            }
            HoldReason::DeleteNotAllowed => "action Delete needs allowDelete: true",
        })
    }
}

/// The action at the deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActionKind {
    /// Set `spec.suspend: true` on this Job.
    Suspend {
        /// The Job's name (same namespace as the pod).
        job: String,
    },
    /// Evict through the Eviction API.
    Evict,
    /// Delete the pod.
    Delete,
}

impl ActionKind {
    /// The name used in history, Events and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            ActionKind::Suspend { .. } => "Suspend",
            ActionKind::Evict => "Evict",
            ActionKind::Delete => "Delete",
        }
    }
}

/// Why a pod is exempt, if it is.
pub fn exemption(
    pod: &Pod,
    policy: &ReclaimPolicy,
    namespace_labels: Option<&BTreeMap<String, String>>,
    now: Timestamp,
) -> Option<&'static str> {
    if pod.namespace().as_deref() == Some("kube-system") {
        return Some("kube-system pods are never reclaimed");
    }
    if let Some(v) = pod
        .annotations()
        .get(RECLAIM_OPT_OUT_ANNOTATION)
        .filter(|_| policy.allow_pod_opt_out)
    {
        let v = v.trim();
        if v == "disabled" {
            return Some("opted out");
        }
        match v
            .strip_prefix("disabled-until=")
            .map(|t| t.trim().parse::<Timestamp>())
        {
            Some(Ok(until)) if until <= now => {}
            // In force, or a value we cannot read: on doubt, leave the pod alone.
            _ => return Some("opted out"),
        }
    }
    let ex = &policy.exemptions;
    if let Some(sel) = &ex.pod_selector {
        match Selector::try_from(sel.clone()) {
            Ok(s) if s.matches(pod.labels()) => return Some("matched the exempt pod selector"),
            Ok(_) => {}
            Err(_) => return Some("the exempt pod selector is invalid"),
        }
    }
    if let Some(sel) = &ex.namespace_selector {
        let Some(ns_labels) = namespace_labels else {
            return Some("namespace labels unknown");
        };
        match Selector::try_from(sel.clone()) {
            Ok(s) if s.matches(ns_labels) => return Some("namespace is exempt"),
            Ok(_) => {}
            Err(_) => return Some("the exempt namespace selector is invalid"),
        }
    }
    if let Some(pc) = pod
        .spec
        .as_ref()
        .and_then(|s| s.priority_class_name.as_ref())
        && ex.priority_class_names.iter().any(|n| n == pc)
    {
        return Some("priority class is exempt");
    }
    None
}

/// The warning annotations on a pod, if both are there and readable.
pub fn warning(pod: &Pod) -> Option<(Timestamp, Timestamp)> {
    let a = pod.annotations();
    let idle = a.get(IDLE_SINCE_ANNOTATION)?.parse().ok()?;
    let at = a.get(RECLAIM_AT_ANNOTATION)?.parse().ok()?;
    Some((idle, at))
}

fn has_warning_annotations(pod: &Pod) -> bool {
    let a = pod.annotations();
    a.contains_key(IDLE_SINCE_ANNOTATION) || a.contains_key(RECLAIM_AT_ANNOTATION)
}

pub fn to_signed(d: &kube::core::Duration) -> SignedDuration {
    SignedDuration::try_from(std::time::Duration::from(*d)).unwrap_or(SignedDuration::MAX)
}

/// When the pod started (status.startTime, else its creation).
pub fn pod_start(pod: &Pod) -> Option<Timestamp> {
    pod.status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .or(pod.metadata.creation_timestamp.as_ref())
        .map(|t| t.0)
}

/// The Job that controls a pod, if any.
pub fn job_owner(pod: &Pod) -> Option<String> {
    pod.owner_references()
        .iter()
        .find(|o| crate::cache::is_job_owner(&o.api_version, &o.kind))
        .map(|o| o.name.clone())
}

/// Decides what to do with one pod of a pool.
pub fn reclaim_decision(
    pod: &Pod,
    ctx: &PodContext<'_>,
    policy: &ReclaimPolicy,
    now: Timestamp,
) -> Decision {
    let warned = has_warning_annotations(pod);
    let unwarn_or_ignore = |why: &'static str| {
        if warned {
            Decision::Unwarn(why)
        } else {
            Decision::Ignore(why)
        }
    };
    if policy.mode == ReclaimMode::Off {
        return unwarn_or_ignore("reclaim is off");
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Decision::Ignore("being deleted");
    }
    if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
        return Decision::Ignore("not running");
    }
    if !ctx.on_pool_node {
        return unwarn_or_ignore("not on a node of the pool");
    }
    if let Some(why) = exemption(pod, policy, ctx.namespace_labels, now) {
        return unwarn_or_ignore(why);
    }
    let Some(started) = pod_start(pod) else {
        return Decision::Hold(HoldReason::NoStartTime);
    };
    if now.duration_since(started) < to_signed(&policy.startup_grace_period) {
        return unwarn_or_ignore("within its startup grace period");
    }
    if ctx.devices.is_empty() {
        return Decision::Hold(HoldReason::NoDevices);
    }
    if !ctx.data_fresh {
        return Decision::Hold(HoldReason::StaleData);
    }
    if ctx.devices.iter().any(|d| d.activity == Activity::Busy) {
        return unwarn_or_ignore("a GPU is busy");
    }
    let mut idle_since = started;
    for d in &ctx.devices {
        match (d.activity, d.idle_since) {
            (Activity::Idle, Some(t)) if t <= now => idle_since = idle_since.max(t),
            (Activity::Idle, _) => {
                return Decision::Hold(HoldReason::NoIdleSince);
            }
            _ => return Decision::Hold(HoldReason::ActivityUnknown),
        }
    }
    if now.duration_since(idle_since) < to_signed(&policy.idle_after) {
        // Activity since the warning reset the clock.
        return unwarn_or_ignore("not idle long enough");
    }
    let (warned_idle, reclaim_at) = match warning(pod) {
        Some((idle, at)) if idle.as_second() == idle_since.as_second() => (idle, at),
        _ => {
            return Decision::Warn {
                idle_since,
                reclaim_at: now
                    .checked_add(to_signed(&policy.grace_period))
                    .unwrap_or(Timestamp::MAX),
            };
        }
    };
    let _ = warned_idle;
    if now < reclaim_at {
        return Decision::Wait { reclaim_at };
    }
    if policy.action == ReclaimAction::NotifyOnly {
        return Decision::Notified;
    }
    if policy.mode == ReclaimMode::DryRun && pod.annotations().contains_key(DRY_RUN_ANNOTATION) {
        return Decision::Notified;
    }
    if policy.only_under_pressure && !ctx.demand_pending {
        return Decision::WaitForPressure;
    }
    let job = job_owner(pod);
    let kind = match (policy.action, job) {
        (ReclaimAction::Auto, Some(job)) if ctx.job_siblings == 0 => ActionKind::Suspend { job },
        // Other pods of the Job still run: only this idle one goes, through the Eviction API.
        (ReclaimAction::Auto, Some(_)) => ActionKind::Evict,
        (ReclaimAction::Suspend, Some(job)) => ActionKind::Suspend { job },
        (ReclaimAction::Suspend, None) => {
            return Decision::Hold(HoldReason::NoJobToSuspend);
        }
        (ReclaimAction::Delete, _) if !policy.allow_delete => {
            return Decision::Hold(HoldReason::DeleteNotAllowed);
        }
        (ReclaimAction::Delete, _) => ActionKind::Delete,
        _ => ActionKind::Evict,
    };
    Decision::Act(kind)
}

/// Whether the pool's rate limit allows another action now, counting the actions in history
/// (dry runs too: they stand for actions).
pub fn rate_allows(status: &ReclaimStatus, policy: &ReclaimPolicy, now: Timestamp) -> bool {
    let window = to_signed(&policy.rate_limit.interval);
    let recent = status
        .history
        .iter()
        .filter(|r| counted(r) && now.duration_since(r.time.0) < window)
        .count();
    (recent as u32) < policy.rate_limit.max_actions
}

/// Adds an action to the history (newest first, bounded) and the counters.
///
/// Entries the rate limit does not count (`BlockedByPDB`, `Failed`) never push counted ones
/// out: a pod keeps only its latest uncounted entry per action, and the oldest uncounted
/// entries go first when the history is full, so a PDB blocking many pods, or an API server
/// failing every eviction, cannot make the limit forget its actions.
pub fn record(status: &mut ReclaimStatus, entry: ReclaimRecord) {
    if entry.result == "Succeeded" {
        status.reclaimed += 1;
        status.last_reclaim_time = Some(entry.time.clone());
    }
    if !counted(&entry) {
        status
            .history
            .retain(|e| counted(e) || e.pod != entry.pod || e.action != entry.action);
    }
    status.history.insert(0, entry);
    while status.history.len() > MAX_HISTORY {
        match status.history.iter().rposition(|e| !counted(e)) {
            Some(oldest_uncounted) => {
                status.history.remove(oldest_uncounted);
            }
            None => status.history.truncate(MAX_HISTORY),
        }
    }
}

/// Whether the rate limit counts a history entry: an action that disrupted a pod (or, in a dry
/// run, would have). A blocked or failed attempt disrupted nothing and spends no budget.
pub fn counted(entry: &ReclaimRecord) -> bool {
    matches!(entry.result.as_str(), "Succeeded" | "WouldSucceed")
}

/// A history entry.
pub fn entry(
    pod: &Pod,
    owner: Option<String>,
    action: &str,
    result: &str,
    now: Timestamp,
) -> ReclaimRecord {
    ReclaimRecord {
        pod: format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any()),
        owner,
        action: action.to_owned(),
        result: result.to_owned(),
        time: Time(now),
    }
}

/// The Warning Event text for a warned pod.
pub fn warning_note(
    idle_since: Timestamp,
    reclaim_at: Timestamp,
    policy: &ReclaimPolicy,
) -> String {
    let what = match policy.action {
        ReclaimAction::NotifyOnly => "it will be reported (no action is taken)",
        _ if policy.mode == ReclaimMode::DryRun => {
            "it would be reclaimed (dry run: nothing is done)"
        }
        ReclaimAction::Suspend | ReclaimAction::Auto => {
            "its Job will be suspended, or the pod evicted"
        }
        ReclaimAction::Evict => "it will be evicted",
        ReclaimAction::Delete => "it will be deleted",
    };
    let opt_out = if policy.allow_pod_opt_out {
        format!(
            "To opt out, annotate the pod {RECLAIM_OPT_OUT_ANNOTATION}=disabled (or disabled-until=<RFC 3339 time>)"
        )
    } else {
        "This pool does not let pods opt out (reclaim.allowPodOptOut: false)".to_owned()
    };
    format!(
        "every GPU of this pod has been idle since {idle_since}; at {reclaim_at} {what} if it stays idle. {opt_out}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_crds::policy::ReclaimExemptions;
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    const NOW: &str = "2026-03-01T12:00:00Z";

    fn pod(annotations: &[(&str, &str)]) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        p.metadata.namespace = Some("ml".into());
        p.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        );
        p.spec = Some(PodSpec::default());
        p.status = Some(PodStatus {
            phase: Some("Running".into()),
            start_time: Some(Time(ts("2026-03-01T00:00:00Z"))),
            ..Default::default()
        });
        p
    }

    fn idle(since: &str) -> DeviceIdleness {
        DeviceIdleness {
            activity: Activity::Idle,
            idle_since: Some(ts(since)),
        }
    }

    fn ctx(devices: Vec<DeviceIdleness>) -> PodContext<'static> {
        PodContext {
            devices,
            on_pool_node: true,
            data_fresh: true,
            namespace_labels: None,
            demand_pending: false,
            job_siblings: 0,
        }
    }

    fn policy() -> ReclaimPolicy {
        ReclaimPolicy {
            mode: ReclaimMode::Enforce,
            idle_after: std::time::Duration::from_secs(3600).into(),
            grace_period: std::time::Duration::from_secs(600).into(),
            startup_grace_period: std::time::Duration::from_secs(900).into(),
            ..Default::default()
        }
    }

    fn warned(idle_since: &str, at: &str) -> Pod {
        pod(&[
            (IDLE_SINCE_ANNOTATION, idle_since),
            (RECLAIM_AT_ANNOTATION, at),
        ])
    }

    #[test]
    fn decisions() {
        let job_pod = {
            let mut p = warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z");
            p.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "batch/v1".into(),
                kind: "Job".into(),
                name: "train".into(),
                uid: "u".into(),
                controller: Some(true),
                ..Default::default()
            }]);
            p
        };
        let young = {
            let mut p = pod(&[]);
            if let Some(s) = p.status.as_mut() {
                s.start_time = Some(Time(ts("2026-03-01T11:50:00Z")));
            }
            p
        };
        let expired_opt_out = pod(&[(
            RECLAIM_OPT_OUT_ANNOTATION,
            "disabled-until=2026-02-01T00:00:00Z",
        )]);
        let mut dry = policy();
        dry.mode = ReclaimMode::DryRun;
        let mut pressure = policy();
        pressure.only_under_pressure = true;
        let mut notify = policy();
        notify.action = ReclaimAction::NotifyOnly;
        let mut off = policy();
        off.mode = ReclaimMode::Off;

        struct Case<'a> {
            name: &'a str,
            pod: Pod,
            ctx: PodContext<'static>,
            policy: ReclaimPolicy,
            want: Decision,
        }
        let warn = Decision::Warn {
            idle_since: ts("2026-03-01T10:00:00Z"),
            reclaim_at: ts("2026-03-01T12:10:00Z"),
        };
        let cases = vec![
            Case {
                name: "idle long enough: warn",
                pod: pod(&[]),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: warn.clone(),
            },
            Case {
                name: "idle since before the pod started counts from its start",
                pod: pod(&[]),
                ctx: ctx(vec![idle("2026-02-01T00:00:00Z")]),
                policy: policy(),
                want: Decision::Warn {
                    idle_since: ts("2026-03-01T00:00:00Z"),
                    reclaim_at: ts("2026-03-01T12:10:00Z"),
                },
            },
            Case {
                name: "not idle long enough",
                pod: pod(&[]),
                ctx: ctx(vec![idle("2026-03-01T11:30:00Z")]),
                policy: policy(),
                want: Decision::Ignore("not idle long enough"),
            },
            Case {
                name: "one device busy",
                pod: pod(&[]),
                ctx: ctx(vec![
                    idle("2026-03-01T10:00:00Z"),
                    DeviceIdleness {
                        activity: Activity::Busy,
                        idle_since: None,
                    },
                ]),
                policy: policy(),
                want: Decision::Ignore("a GPU is busy"),
            },
            Case {
                name: "unknown activity never reclaims",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:00:00Z"),
                ctx: ctx(vec![
                    idle("2026-03-01T10:00:00Z"),
                    DeviceIdleness {
                        activity: Activity::Unknown,
                        idle_since: None,
                    },
                ]),
                policy: policy(),
                want: Decision::Hold(HoldReason::ActivityUnknown),
            },
            Case {
                name: "idle without idleSince",
                pod: pod(&[]),
                ctx: ctx(vec![DeviceIdleness {
                    activity: Activity::Idle,
                    idle_since: None,
                }]),
                policy: policy(),
                want: Decision::Hold(HoldReason::NoIdleSince),
            },
            Case {
                name: "idleSince in the future",
                pod: pod(&[]),
                ctx: ctx(vec![idle("2026-03-02T00:00:00Z")]),
                policy: policy(),
                want: Decision::Hold(HoldReason::NoIdleSince),
            },
            Case {
                name: "no devices listed",
                pod: pod(&[]),
                ctx: ctx(vec![]),
                policy: policy(),
                want: Decision::Hold(HoldReason::NoDevices),
            },
            Case {
                name: "stale data",
                pod: pod(&[]),
                ctx: PodContext {
                    data_fresh: false,
                    ..ctx(vec![idle("2026-03-01T10:00:00Z")])
                },
                policy: policy(),
                want: Decision::Hold(HoldReason::StaleData),
            },
            Case {
                name: "young pod",
                pod: young,
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Ignore("within its startup grace period"),
            },
            Case {
                name: "warned, before deadline",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T12:10:00Z"),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Wait {
                    reclaim_at: ts("2026-03-01T12:10:00Z"),
                },
            },
            Case {
                name: "deadline passed, bare pod: evict",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Act(ActionKind::Evict),
            },
            Case {
                name: "deadline passed, Job pod: suspend",
                pod: job_pod.clone(),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Act(ActionKind::Suspend {
                    job: "train".into(),
                }),
            },
            Case {
                name: "deadline passed, Job pod with running siblings: evict it, not the Job",
                pod: job_pod.clone(),
                ctx: PodContext {
                    job_siblings: 3,
                    ..ctx(vec![idle("2026-03-01T10:00:00Z")])
                },
                policy: policy(),
                want: Decision::Act(ActionKind::Evict),
            },
            Case {
                name: "deadline passed, Job pod with siblings, action Suspend: as asked",
                pod: job_pod.clone(),
                ctx: PodContext {
                    job_siblings: 3,
                    ..ctx(vec![idle("2026-03-01T10:00:00Z")])
                },
                policy: ReclaimPolicy {
                    action: ReclaimAction::Suspend,
                    ..policy()
                },
                want: Decision::Act(ActionKind::Suspend {
                    job: "train".into(),
                }),
            },
            Case {
                name: "became busy after warning: unwarn",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![DeviceIdleness {
                    activity: Activity::Busy,
                    idle_since: None,
                }]),
                policy: policy(),
                want: Decision::Unwarn("a GPU is busy"),
            },
            Case {
                name: "idle clock restarted after warning: unwarn",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![idle("2026-03-01T11:55:00Z")]),
                policy: policy(),
                want: Decision::Unwarn("not idle long enough"),
            },
            Case {
                name: "only under pressure, none",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: pressure.clone(),
                want: Decision::WaitForPressure,
            },
            Case {
                name: "only under pressure, demand pending",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: PodContext {
                    demand_pending: true,
                    ..ctx(vec![idle("2026-03-01T10:00:00Z")])
                },
                policy: pressure,
                want: Decision::Act(ActionKind::Evict),
            },
            Case {
                name: "notify only stops at the warning",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: notify,
                want: Decision::Notified,
            },
            Case {
                name: "dry run acts (the edge makes it a dry run)",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: dry.clone(),
                want: Decision::Act(ActionKind::Evict),
            },
            Case {
                name: "dry run reported once",
                pod: {
                    let mut p = warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z");
                    p.metadata
                        .annotations
                        .get_or_insert_default()
                        .insert(DRY_RUN_ANNOTATION.into(), NOW.into());
                    p
                },
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: dry,
                want: Decision::Notified,
            },
            Case {
                name: "opted out",
                pod: pod(&[(RECLAIM_OPT_OUT_ANNOTATION, "disabled")]),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Ignore("opted out"),
            },
            Case {
                name: "opted out until later",
                pod: pod(&[(
                    RECLAIM_OPT_OUT_ANNOTATION,
                    "disabled-until=2026-04-01T00:00:00Z",
                )]),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Ignore("opted out"),
            },
            Case {
                name: "unreadable opt-out is honoured",
                pod: pod(&[(RECLAIM_OPT_OUT_ANNOTATION, "disabled-until=soon")]),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Ignore("opted out"),
            },
            Case {
                name: "an opt-out the pool does not allow is not honoured",
                pod: pod(&[(RECLAIM_OPT_OUT_ANNOTATION, "disabled")]),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: ReclaimPolicy {
                    allow_pod_opt_out: false,
                    ..policy()
                },
                want: warn.clone(),
            },
            Case {
                name: "expired opt-out",
                pod: expired_opt_out,
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: warn.clone(),
            },
            Case {
                name: "kube-system",
                pod: {
                    let mut p = pod(&[]);
                    p.metadata.namespace = Some("kube-system".into());
                    p
                },
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Ignore("kube-system pods are never reclaimed"),
            },
            Case {
                name: "not on a pool node",
                pod: pod(&[]),
                ctx: PodContext {
                    on_pool_node: false,
                    ..ctx(vec![idle("2026-03-01T10:00:00Z")])
                },
                policy: policy(),
                want: Decision::Ignore("not on a node of the pool"),
            },
            Case {
                name: "off: unwarn",
                pod: warned("2026-03-01T10:00:00Z", "2026-03-01T11:50:00Z"),
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: off,
                want: Decision::Unwarn("reclaim is off"),
            },
            Case {
                name: "pending pod",
                pod: {
                    let mut p = pod(&[]);
                    if let Some(s) = p.status.as_mut() {
                        s.phase = Some("Pending".into());
                    }
                    p
                },
                ctx: ctx(vec![idle("2026-03-01T10:00:00Z")]),
                policy: policy(),
                want: Decision::Ignore("not running"),
            },
        ];
        for c in cases {
            assert_eq!(
                reclaim_decision(&c.pod, &c.ctx, &c.policy, ts(NOW)),
                c.want,
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn exemptions_by_selector_and_priority_class() {
        let mut p = policy();
        p.exemptions = ReclaimExemptions {
            namespace_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([("tier".into(), "prod".into())])),
                match_expressions: None,
            }),
            pod_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([("keep".into(), "yes".into())])),
                match_expressions: None,
            }),
            priority_class_names: vec!["critical".into()],
        };
        let now = ts(NOW);
        let prod = BTreeMap::from([("tier".to_owned(), "prod".to_owned())]);
        let dev = BTreeMap::from([("tier".to_owned(), "dev".to_owned())]);
        let plain = pod(&[]);
        assert_eq!(
            exemption(&plain, &p, Some(&prod), now),
            Some("namespace is exempt")
        );
        assert_eq!(exemption(&plain, &p, Some(&dev), now), None);
        assert_eq!(
            exemption(&plain, &p, None, now),
            Some("namespace labels unknown")
        );
        let mut labelled = pod(&[]);
        labelled.metadata.labels = Some(BTreeMap::from([("keep".into(), "yes".into())]));
        assert_eq!(
            exemption(&labelled, &p, Some(&dev), now),
            Some("matched the exempt pod selector")
        );
        let mut critical = pod(&[]);
        if let Some(s) = critical.spec.as_mut() {
            s.priority_class_name = Some("critical".into());
        }
        assert_eq!(
            exemption(&critical, &p, Some(&dev), now),
            Some("priority class is exempt")
        );
    }

    #[test]
    fn rate_limit_counts_recent_actions() {
        let mut p = policy();
        p.rate_limit.max_actions = 2;
        p.rate_limit.interval = std::time::Duration::from_secs(600).into();
        let now = ts(NOW);
        let mut st = ReclaimStatus::default();
        let pd = pod(&[]);
        assert!(rate_allows(&st, &p, now));
        record(
            &mut st,
            entry(&pd, None, "Evict", "Succeeded", ts("2026-03-01T11:00:00Z")),
        );
        record(
            &mut st,
            entry(&pd, None, "Evict", "Succeeded", ts("2026-03-01T11:55:00Z")),
        );
        assert!(
            rate_allows(&st, &p, now),
            "the 11:00 action is outside the window"
        );
        record(
            &mut st,
            entry(
                &pd,
                None,
                "Evict",
                "BlockedByPDB",
                ts("2026-03-01T11:56:00Z"),
            ),
        );
        assert!(rate_allows(&st, &p, now), "blocked attempts do not count");
        record(
            &mut st,
            entry(&pd, None, "Evict", "Succeeded", ts("2026-03-01T11:58:00Z")),
        );
        assert!(!rate_allows(&st, &p, now));
        assert_eq!(st.reclaimed, 3);
        // Thirty failed attempts (an API server answering 500): no budget spent, one entry.
        let mut failing = st.clone();
        failing
            .history
            .retain(|e| e.time.0 < ts("2026-03-01T11:58:00Z"));
        assert!(rate_allows(&failing, &p, now));
        for _ in 0..30 {
            record(&mut failing, entry(&pd, None, "Evict", "Failed", now));
        }
        assert!(rate_allows(&failing, &p, now), "failures spend no budget");
        assert_eq!(
            failing
                .history
                .iter()
                .filter(|e| e.result == "Failed")
                .count(),
            1
        );
    }

    #[test]
    fn blocked_attempts_never_push_counted_actions_out_of_the_history() {
        let now = ts("2026-03-01T12:00:00Z");
        let p = ReclaimPolicy {
            rate_limit: gpupool_crds::policy::RateLimit {
                max_actions: 5,
                interval: std::time::Duration::from_secs(600).into(),
            },
            ..policy()
        };
        let mut st = ReclaimStatus::default();
        let pod = |name: &str| {
            let mut p = Pod::default();
            p.metadata.namespace = Some("ml".into());
            p.metadata.name = Some(name.into());
            p
        };
        for i in 0..5 {
            record(
                &mut st,
                entry(&pod(&format!("done-{i}")), None, "Evict", "Succeeded", now),
            );
        }
        assert!(!rate_allows(&st, &p, now), "five actions in the window");
        // A PDB then blocks thirty pods, each retried: the five actions stay counted.
        for round in 0..2 {
            for i in 0..30 {
                let at = now.checked_add(SignedDuration::from_secs(round)).unwrap();
                record(
                    &mut st,
                    entry(
                        &pod(&format!("held-{i}")),
                        None,
                        "Evict",
                        "BlockedByPDB",
                        at,
                    ),
                );
            }
        }
        assert_eq!(st.history.len(), MAX_HISTORY);
        assert_eq!(
            st.history
                .iter()
                .filter(|e| e.result == "Succeeded")
                .count(),
            5
        );
        assert!(!rate_allows(&st, &p, now), "the limit still holds");
        // One entry per blocked pod: the retry replaced the first attempt.
        let held_29 = st.history.iter().filter(|e| e.pod == "ml/held-29").count();
        assert_eq!(held_29, 1);
    }

    /// GpuNode `n` of pool `p` reporting `gpus`.
    fn gpunode_with(gpus: Vec<gpupool_crds::node::GpuStatus>) -> GpuNode {
        let mut gn = GpuNode::new(
            "n",
            gpupool_crds::GpuNodeSpec {
                sharing: Default::default(),
                pool: "p".into(),
                driver: Default::default(),
                cdi: Default::default(),
                mig: Default::default(),
                utilization: Default::default(),
            },
        );
        gn.status = Some(gpupool_crds::node::GpuNodeStatus {
            gpus,
            ..Default::default()
        });
        gn
    }

    #[test]
    fn mig_devices_carry_their_own_idleness() {
        use gpupool_crds::node::{GpuStatus, MigDeviceStatus, PodRef};
        let holder = |name: &str| PodRef {
            namespace: "ml".into(),
            name: name.into(),
            container: None,
        };
        let gn = gpunode_with(vec![
            GpuStatus {
                index: 0,
                idleness: Idleness {
                    activity: Activity::Idle,
                    idle_since: Some(Time(ts("2026-03-01T00:00:00Z"))),
                    pods: vec![holder("a")],
                },
                ..Default::default()
            },
            GpuStatus {
                index: 1,
                mig_enabled: true,
                mig_devices: vec![
                    MigDeviceStatus {
                        idleness: Idleness {
                            activity: Activity::Busy,
                            idle_since: None,
                            pods: vec![holder("b")],
                        },
                        ..Default::default()
                    },
                    MigDeviceStatus {
                        idleness: Idleness {
                            activity: Activity::Idle,
                            idle_since: None,
                            pods: vec![holder("a")],
                        },
                        ..Default::default()
                    },
                ],
                ..Default::default()
            },
        ]);
        let by_pod = devices_by_pod(&gn);
        assert_eq!(by_pod[&("ml".to_owned(), "a".to_owned())].len(), 2);
        assert_eq!(
            by_pod[&("ml".to_owned(), "b".to_owned())][0].activity,
            Activity::Busy
        );
    }

    /// Two tenants on one time-sliced GPU: the idle one is judged idle on its own share while
    /// the GPU is busy with its neighbour; a tenant the agent reports no share for is unknown
    /// on a busy GPU, and idle on an idle one.
    #[test]
    fn a_shared_gpus_tenants_are_judged_on_their_own_shares() {
        use gpupool_crds::node::{GpuSharing, GpuStatus, PodRef};
        let holder = |name: &str| PodRef {
            namespace: "nb".into(),
            name: name.into(),
            container: None,
        };
        let share = |name: &str, activity, since: Option<&str>| Idleness {
            activity,
            idle_since: since.map(|s| Time(ts(s))),
            pods: vec![holder(name)],
        };
        let gpu = |activity, shares: Vec<Idleness>| GpuStatus {
            index: 0,
            sharing: Some(GpuSharing {
                mode: "TimeSlicing".into(),
                replicas: 4,
                isolation: "None".into(),
                ..Default::default()
            }),
            shares,
            idleness: Idleness {
                activity,
                idle_since: (activity == Activity::Idle).then(|| Time(ts("2026-03-01T02:00:00Z"))),
                pods: vec![holder("idle"), holder("busy"), holder("unreported")],
            },
            ..Default::default()
        };
        let node = |g: GpuStatus| gpunode_with(vec![g]);
        let key = |n: &str| ("nb".to_owned(), n.to_owned());
        let busy_gpu = node(gpu(
            Activity::Busy,
            vec![
                share("idle", Activity::Idle, Some("2026-03-01T00:00:00Z")),
                share("busy", Activity::Busy, None),
            ],
        ));
        let by_pod = devices_by_pod(&busy_gpu);
        assert_eq!(
            by_pod[&key("idle")],
            [DeviceIdleness {
                activity: Activity::Idle,
                idle_since: Some(ts("2026-03-01T00:00:00Z")),
            }],
            "idle on its own share while the GPU is busy"
        );
        assert_eq!(by_pod[&key("busy")][0].activity, Activity::Busy);
        assert_eq!(by_pod[&key("unreported")][0].activity, Activity::Unknown);
        let idle_gpu = node(gpu(Activity::Idle, Vec::new()));
        assert_eq!(
            devices_by_pod(&idle_gpu)[&key("unreported")][0].idle_since,
            Some(ts("2026-03-01T02:00:00Z")),
            "an idle device: every share of it is idle"
        );
    }
}
