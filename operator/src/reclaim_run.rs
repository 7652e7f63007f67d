//! The reclaimer's edges: gathering each pod's facts from the stores, and carrying out the
//! decisions of [`crate::reclaim`] (annotations, Events, Job suspension, evictions, deletes).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use gpupool_crds::labels::{IDLE_SINCE_ANNOTATION, POOL_LABEL, RECLAIM_AT_ANNOTATION};
use gpupool_crds::policy::ReclaimMode;
use gpupool_crds::pool::ReclaimStatus;
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::cache::{CachedNode, CachedPod};
use crate::context::{Context, FIELD_MANAGER, capped_backoff};
use crate::demand::demand_pending;
use crate::error::{Error, Failures, Result, api_code};
use crate::liveness::on_operator_clock;
use crate::reclaim::{
    self, ActionKind, DRY_RUN_ANNOTATION, Decision, PodContext, devices_by_pod, reclaim_decision,
};
use crate::uid::Uid;

/// Whether a node reports Ready (the agent's data on it can be current).
fn node_ready(node: Option<&Arc<CachedNode>>) -> bool {
    node.is_some_and(|n| n.is_ready())
}

fn rfc3339(t: Timestamp) -> String {
    Timestamp::from_second(t.as_second())
        .unwrap_or(t)
        .to_string()
}

/// The Job label by which Kueue manages a Job (its LocalQueue).
pub const KUEUE_QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";

/// Deactivates the Kueue Workload of `job` (`spec.active: false`): Kueue then evicts it
/// (suspending the Job itself) and does not queue it again until someone reactivates it.
/// `None`: already inactive, nothing to do.
async fn deactivate_workload(
    job: &Job,
    ctx: &Context,
    dry: bool,
    failures: &mut Failures,
) -> Result<Option<Outcome>> {
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let uid = job.uid().unwrap_or_default();
    let failed = |message: String| {
        Ok(Some(Outcome {
            result: "Failed",
            message,
        }))
    };
    let group = match kube::discovery::group(&ctx.client, "kueue.x-k8s.io").await {
        Ok(g) => g,
        Err(e) => {
            return failed(format!(
                "Job {name} is Kueue's (label {KUEUE_QUEUE_LABEL}), but Kueue's API cannot be read ({e}); not suspending it, which Kueue would undo"
            ));
        }
    };
    let Some((resource, _)) = group.recommended_kind("Workload") else {
        return failed(format!(
            "Job {name} is Kueue's (label {KUEUE_QUEUE_LABEL}), but this cluster serves no Kueue Workload kind"
        ));
    };
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &resource);
    let list = match api.list(&Default::default()).await {
        Ok(l) => l,
        Err(e) => {
            failures.note(
                "list",
                "workloads",
                format!("listing Kueue Workloads in {ns}"),
                &e,
            );
            return failed(format!("listing Kueue Workloads failed: {e}"));
        }
    };
    let Some(workload) = list
        .items
        .into_iter()
        .find(|w| w.owner_references().iter().any(|o| o.uid == uid))
    else {
        return failed(format!(
            "Job {name} is Kueue's (label {KUEUE_QUEUE_LABEL}), but no Workload owned by it was found; not suspending it, which Kueue would undo"
        ));
    };
    if workload.data["spec"]["active"] == json!(false) {
        return Ok(None);
    }
    let wl = workload.name_any();
    if !dry && !ctx.may_act() {
        return Ok(None);
    }
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        dry_run: dry,
        ..Default::default()
    };
    match api
        .patch(
            &wl,
            &pp,
            &Patch::Merge(&json!({ "spec": { "active": false } })),
        )
        .await
    {
        Ok(_) => {
            if !dry {
                ctx.metrics.write("Workload", "patch");
            }
            Ok(Some(Outcome {
                result: "Succeeded",
                message: format!(
                    "deactivated Kueue Workload {wl} of Job {name} (spec.active: false): Kueue stops the Job and keeps it stopped until the Workload is reactivated"
                ),
            }))
        }
        Err(e) => {
            failures.note(
                "patch",
                "workloads",
                format!("deactivating Workload {ns}/{wl}"),
                &e,
            );
            failed(format!("deactivating Kueue Workload {wl} failed: {e}"))
        }
    }
}

/// The unfinished pods (the store holds no Succeeded or Failed ones) of each Job, gathered once
/// per run: asked of every pod the run looks at, a scan of the whole store each time would make
/// a run quadratic in the cluster's GPU pods.
struct JobPods<'a>(HashMap<(&'a str, Uid), Vec<&'a str>>);

impl<'a> JobPods<'a> {
    /// Groups `all` by namespace and owning Job, leaving out pods on their way out.
    fn gather(all: &'a [Arc<CachedPod>]) -> Self {
        let mut by_job: HashMap<(&str, Uid), Vec<&str>> = HashMap::new();
        for p in all.iter().filter(|p| !p.is_deleting()) {
            if let Some(uid) = p.job_uid() {
                by_job
                    .entry((p.pod_namespace(), uid.clone()))
                    .or_default()
                    .push(p.pod_name());
            }
        }
        Self(by_job)
    }

    /// Other unfinished pods of `pod`'s Job.
    fn siblings(&self, pod: &Pod) -> usize {
        let Some(uid) = job_uid(pod.owner_references()) else {
            return 0;
        };
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        self.0
            .get(&(ns, Uid::new(uid)))
            .map_or(0, |names| names.iter().filter(|n| **n != name).count())
    }
}

/// The UID of the Job among a pod's `owners`.
fn job_uid(owners: &[OwnerReference]) -> Option<&str> {
    owners
        .iter()
        .find(|o| crate::cache::is_job_owner(&o.api_version, &o.kind))
        .map(|o| o.uid.as_str())
}

fn pod_key(pod: &impl ResourceExt) -> String {
    crate::cache::pod_key(&pod.namespace().unwrap_or_default(), &pod.name_any())
}

/// Runs the reclaimer over one pool's nodes and returns the new reclaim status. A failed API
/// call is kept in `failures` and the other pods are still seen to, so the actions already
/// taken stay in the history.
pub async fn run(
    pool: &GpuPool,
    nodes: &[Arc<CachedNode>],
    gpunodes: &[&GpuNode],
    mut status: ReclaimStatus,
    ctx: &Context,
    now: Timestamp,
    failures: &mut Failures,
) -> ReclaimStatus {
    let policy = &pool.spec.reclaim;
    let pool_name = pool.name_any();
    // Actions this process took that the status lacks (its write failed) count again.
    let window = reclaim::to_signed(&policy.rate_limit.interval);
    for taken in ctx.ledger.missing_from(&pool_name, &status, window, now) {
        info!(pod = %taken.pod, action = %taken.action, "an action missing from the pool's status (its write failed) is restored from the ledger");
        reclaim::record(&mut status, taken);
    }
    let by_name: BTreeMap<String, &Arc<CachedNode>> =
        nodes.iter().map(|n| (n.name_any(), n)).collect();
    let all_pods = ctx.pods.state();
    let job_pods = JobPods::gather(&all_pods);
    // Only pods waiting for a node can be pending demand: only those are unfolded.
    let demand = policy.only_under_pressure && {
        let waiting: Vec<Pod> = all_pods
            .iter()
            .filter(|p| p.node_name().is_none() && p.phase() == Some("Pending"))
            .map(|p| p.to_pod())
            .collect();
        demand_pending(&waiting, nodes)
    };
    let mut warned: BTreeSet<String> = all_pods
        .iter()
        .filter(|p| {
            p.node_name().is_some_and(|n| by_name.contains_key(n))
                && p.has_annotation(IDLE_SINCE_ANNOTATION)
        })
        .map(|p| p.key())
        .collect();

    let mut holds: BTreeMap<reclaim::HoldReason, u32> = BTreeMap::new();
    for gn in gpunodes {
        let node_name = gn.name_any();
        // Current only while the Node is Ready and its agent's heartbeats keep coming; the
        // agent's idle times are on the node's clock, read here on ours.
        let liveness = ctx
            .liveness
            .judge(&node_name, now, ctx.settings.agent_stale_after);
        let fresh = node_ready(by_name.get(&node_name).copied()) && liveness.is_live();
        for ((ns, name), mut devices) in devices_by_pod(gn) {
            for d in &mut devices {
                d.idle_since = d.idle_since.map(|t| on_operator_clock(t, liveness.skew()));
            }
            let Some(cached) = ctx.pods.get(&ObjectRef::new(&name).within(&ns)) else {
                continue;
            };
            let pod = cached.to_pod();
            let ns_meta = ctx.namespaces.get(&ObjectRef::new(&ns));
            let on_node = cached.node_name() == Some(&node_name);
            let pctx = PodContext {
                devices,
                on_pool_node: on_node,
                data_fresh: fresh,
                namespace_labels: ns_meta.as_ref().map(|m| m.labels()),
                demand_pending: demand,
                job_siblings: job_pods.siblings(&pod),
            };
            let decision = reclaim_decision(&pod, &pctx, policy, now);
            debug!(pod = %pod_key(&pod), ?decision, "reclaim decision");
            match decision {
                Decision::Hold(reason) => *holds.entry(reason).or_default() += 1,
                Decision::Ignore(_) | Decision::Wait { .. } | Decision::Notified => {}
                Decision::WaitForPressure => {
                    debug!(pod = %pod_key(&pod), "deadline passed; waiting for GPU demand");
                }
                Decision::Warn {
                    idle_since,
                    reclaim_at,
                } => match warn_pod(pool, &pod, idle_since, reclaim_at, ctx).await {
                    Ok(()) => {
                        warned.insert(pod_key(&pod));
                    }
                    Err(e) => failures.push(e),
                },
                Decision::Unwarn(why) => match unwarn_pod(&pod, why, ctx).await {
                    Ok(()) => {
                        warned.remove(&pod_key(&pod));
                    }
                    Err(e) => failures.push(e),
                },
                Decision::Act(kind) => {
                    if !reclaim::rate_allows(&status, policy, now) {
                        info!(pod = %pod_key(&pod), "rate limit reached; action deferred");
                        continue;
                    }
                    match act(pool, &pod, &kind, &mut status, ctx, now, failures).await {
                        Ok(true) => {
                            warned.remove(&pod_key(&pod));
                        }
                        Ok(false) => {}
                        Err(e) => failures.push(e),
                    }
                }
            }
        }
    }
    status.warned = warned.len() as u32;
    ctx.metrics.pools.set_holds(&pool_name, holds);
    status
}

fn owner_ref(pod: &Pod, job: &str) -> ObjectReference {
    let uid = pod
        .owner_references()
        .iter()
        .find(|o| o.kind == "Job" && o.name == job)
        .map(|o| o.uid.clone());
    ObjectReference {
        api_version: Some("batch/v1".into()),
        kind: Some("Job".into()),
        name: Some(job.to_owned()),
        namespace: pod.namespace(),
        uid,
        ..Default::default()
    }
}

async fn patch_annotations(pod: &Pod, annotations: serde_json::Value, ctx: &Context) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace().unwrap_or_default());
    match api
        .patch(
            &pod.name_any(),
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            },
            &Patch::Merge(&json!({ "metadata": { "annotations": annotations } })),
        )
        .await
    {
        Ok(_) => {
            ctx.metrics.write("Pod", "patch");
            Ok(())
        }
        Err(e) if api_code(&e) == Some(404) => Ok(()),
        Err(e) => Err(Error::kube(
            "patch",
            "pods",
            format!("annotating pod {}", pod_key(pod)),
        )(e)),
    }
}

async fn warn_pod(
    pool: &GpuPool,
    pod: &Pod,
    idle_since: Timestamp,
    reclaim_at: Timestamp,
    ctx: &Context,
) -> Result<()> {
    patch_annotations(
        pod,
        json!({
            IDLE_SINCE_ANNOTATION: rfc3339(idle_since),
            RECLAIM_AT_ANNOTATION: rfc3339(reclaim_at),
            DRY_RUN_ANNOTATION: null,
        }),
        ctx,
    )
    .await?;
    let note = reclaim::warning_note(
        Timestamp::from_second(idle_since.as_second()).unwrap_or(idle_since),
        Timestamp::from_second(reclaim_at.as_second()).unwrap_or(reclaim_at),
        &pool.spec.reclaim,
    );
    info!(pod = %pod_key(pod), reclaim_at = %reclaim_at, "warned idle pod");
    ctx.metrics.reclaim(&pool.name_any(), "Warn", "Succeeded");
    let ev = |note: String| Event {
        type_: EventType::Warning,
        reason: "IdleGPU".into(),
        note: Some(note),
        action: "Warn".into(),
        secondary: Some(pool.object_ref(&())),
    };
    ctx.event(&pod.object_ref(&()), ev(note.clone())).await;
    if let Some(job) = reclaim::job_owner(pod) {
        ctx.event(
            &owner_ref(pod, &job),
            ev(format!("pod {}: {note}", pod.name_any())),
        )
        .await;
    }
    Ok(())
}

async fn unwarn_pod(pod: &Pod, why: &str, ctx: &Context) -> Result<()> {
    patch_annotations(
        pod,
        json!({
            IDLE_SINCE_ANNOTATION: null,
            RECLAIM_AT_ANNOTATION: null,
            DRY_RUN_ANNOTATION: null,
        }),
        ctx,
    )
    .await?;
    info!(pod = %pod_key(pod), why, "idle warning withdrawn");
    ctx.event(
        &pod.object_ref(&()),
        Event {
            type_: EventType::Normal,
            reason: "IdleWarningWithdrawn".into(),
            note: Some(format!("the idle warning no longer applies: {why}")),
            action: "Unwarn".into(),
            secondary: None,
        },
    )
    .await;
    Ok(())
}

/// Removes warnings from the pods on a deleted pool's nodes (best effort).
pub async fn unwarn_all(pool: &GpuPool, ctx: &Context) {
    let name = pool.name_any();
    let nodes: BTreeSet<String> = ctx
        .nodes
        .state()
        .iter()
        .filter(|n| n.labels().get(POOL_LABEL) == Some(&name))
        .map(|n| n.name_any())
        .collect();
    for pod in ctx.pods.state() {
        let on_ours = pod.node_name().is_some_and(|n| nodes.contains(n));
        if on_ours
            && pod.has_annotation(IDLE_SINCE_ANNOTATION)
            && let Err(e) = unwarn_pod(&pod.to_pod(), "its pool was deleted", ctx).await
        {
            warn!(pod = %pod.key(), error = %e, "removing the idle warning failed");
        }
    }
}

/// The outcome of one attempt, as history records it.
struct Outcome {
    result: &'static str,
    message: String,
}

/// Carries out (or, in dry run, checks) an action. Returns whether the pod is gone or its
/// warning is settled. An action the API server refuses (RBAC) is recorded as failed like any
/// other, and noted in `failures` for the pool's status.
async fn act(
    pool: &GpuPool,
    pod: &Pod,
    kind: &ActionKind,
    status: &mut ReclaimStatus,
    ctx: &Context,
    now: Timestamp,
    failures: &mut Failures,
) -> Result<bool> {
    let dry = pool.spec.reclaim.mode == ReclaimMode::DryRun;
    let key = pod_key(pod);
    let ns = pod.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let evictions: Api<Pod> = Api::namespaced(ctx.evict_client.clone(), &ns);
    // A pod whose last attempt was blocked or failed waits out its backoff.
    if !dry
        && let Ok(retry) = ctx.evict_retry.lock()
        && retry.get(&key).is_some_and(|(_, next)| *next > now)
    {
        return Ok(false);
    }
    let owner = match kind {
        ActionKind::Suspend { job } => Some(format!("Job/{job}")),
        _ => None,
    };
    if !dry && !ctx.may_act() {
        return Ok(false);
    }
    let outcome = match kind {
        ActionKind::Suspend { job } => {
            let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
            let current = jobs.get_opt(job).await.map_err(Error::kube(
                "get",
                "jobs",
                format!("reading Job {ns}/{job}"),
            ))?;
            match current {
                None => return Ok(false),
                Some(j) if j.spec.as_ref().and_then(|s| s.suspend) == Some(true) => {
                    // Already suspended (by us before a restart, or by its owner): nothing to do.
                    return Ok(false);
                }
                // Kueue admits the Jobs it queues by unsuspending them: suspending one would be
                // undone. Its own way to stop a Workload for good is to deactivate it.
                Some(j) if j.labels().contains_key(KUEUE_QUEUE_LABEL) => {
                    match deactivate_workload(&j, ctx, dry, failures).await? {
                        Some(outcome) => outcome,
                        None => return Ok(false),
                    }
                }
                Some(_) if !dry && !ctx.may_act() => return Ok(false),
                Some(_) => {
                    let pp = PatchParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        dry_run: dry,
                        ..Default::default()
                    };
                    match jobs
                        .patch(
                            job,
                            &pp,
                            &Patch::Merge(&json!({ "spec": { "suspend": true } })),
                        )
                        .await
                    {
                        Ok(_) => {
                            if !dry {
                                ctx.metrics.write("Job", "patch");
                            }
                            Outcome {
                                result: "Succeeded",
                                message: format!("suspended Job {job}"),
                            }
                        }
                        Err(e) => {
                            failures.note(
                                "patch",
                                "jobs",
                                format!("suspending Job {ns}/{job}"),
                                &e,
                            );
                            Outcome {
                                result: "Failed",
                                message: format!("suspending Job {job} failed: {e}"),
                            }
                        }
                    }
                }
            }
        }
        ActionKind::Evict => {
            // This pod, not another one that took its name since it was judged idle.
            match crate::context::evict(&evictions, pod, dry).await {
                Ok(_) => {
                    if !dry {
                        ctx.metrics.write("Pod", "evict");
                    }
                    Outcome {
                        result: "Succeeded",
                        message: "evicted".into(),
                    }
                }
                Err(e) if api_code(&e) == Some(429) => Outcome {
                    result: "BlockedByPDB",
                    message: "a PodDisruptionBudget allows no disruption now; will retry".into(),
                },
                Err(e) if api_code(&e) == Some(500) => Outcome {
                    result: "Failed",
                    message: format!(
                        "the eviction was refused with 500, usually because more than one PodDisruptionBudget selects the pod (misconfigured): {e}"
                    ),
                },
                // Gone, or replaced by a pod of the same name (the UID precondition failed).
                Err(e) if matches!(api_code(&e), Some(404 | 409)) => return Ok(true),
                Err(e) => {
                    failures.note("create", "pods/eviction", format!("evicting pod {key}"), &e);
                    Outcome {
                        result: "Failed",
                        message: format!("eviction failed: {e}"),
                    }
                }
            }
        }
        ActionKind::Delete => {
            let dp = DeleteParams {
                dry_run: dry,
                ..crate::context::uid_precondition(pod)
            };
            match pods.delete(&pod.name_any(), &dp).await {
                Ok(_) => {
                    if !dry {
                        ctx.metrics.write("Pod", "delete");
                    }
                    Outcome {
                        result: "Succeeded",
                        message: "deleted".into(),
                    }
                }
                Err(e) if matches!(api_code(&e), Some(404 | 409)) => return Ok(true),
                Err(e) => {
                    failures.note("delete", "pods", format!("deleting pod {key}"), &e);
                    Outcome {
                        result: "Failed",
                        message: format!("delete failed: {e}"),
                    }
                }
            }
        }
    };

    let (action, result) = if dry {
        (
            format!("DryRun:{}", kind.name()),
            match outcome.result {
                "Succeeded" => "WouldSucceed",
                "BlockedByPDB" => "WouldBeBlocked",
                other => other,
            },
        )
    } else {
        (kind.name().to_owned(), outcome.result)
    };
    ctx.metrics.reclaim(&pool.name_any(), &action, result);

    // A PDB block or a failure (a 500, a timeout) is retried with backoff, and recorded once
    // per run of the same result, not per retry.
    let retried = matches!(result, "BlockedByPDB" | "Failed");
    let repeated_block = retried
        && status
            .history
            .iter()
            .find(|r| r.pod == key)
            .is_some_and(|r| r.result == result);
    if retried {
        if let Ok(mut retry) = ctx.evict_retry.lock() {
            let n = retry.get(&key).map(|(n, _)| n + 1).unwrap_or(1);
            let delay = capped_backoff(
                n,
                std::time::Duration::from_secs(10),
                std::time::Duration::from_secs(600),
            );
            let next = now
                .checked_add(k8s_openapi::jiff::SignedDuration::try_from(delay).unwrap_or_default())
                .unwrap_or(now);
            retry.insert(key.clone(), (n, next));
        }
    } else if let Ok(mut retry) = ctx.evict_retry.lock() {
        retry.remove(&key);
    }
    if !repeated_block {
        let record = reclaim::entry(pod, owner.clone(), &action, result, now);
        if reclaim::counted(&record) {
            ctx.ledger.note(&pool.name_any(), record.clone());
        }
        reclaim::record(status, record);
    }
    if dry {
        patch_annotations(pod, json!({ DRY_RUN_ANNOTATION: rfc3339(now) }), ctx).await?;
    }
    let warning = !matches!(result, "Succeeded" | "WouldSucceed");
    info!(pod = %key, action = %action, result, message = %outcome.message, "reclaim action");
    let note = format!(
        "{action} → {result}: {}; the pod's GPUs had been idle past the pool's idleAfter (pool {})",
        outcome.message,
        pool.name_any()
    );
    if !repeated_block {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: if dry {
                "ReclaimDryRun".into()
            } else if warning {
                "ReclaimBlocked".into()
            } else {
                "Reclaimed".into()
            },
            note: Some(note.clone()),
            action: kind.name().into(),
            secondary: Some(pool.object_ref(&())),
        };
        ctx.event(&pod.object_ref(&()), ev).await;
        ctx.event(
            &pool.object_ref(&()),
            Event {
                type_: if warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: "ReclaimAction".into(),
                note: Some(format!("pod {key}: {note}")),
                action: kind.name().into(),
                secondary: None,
            },
        )
        .await;
    }
    Ok(!dry && result == "Succeeded")
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use kube::api::ObjectMeta;

    use super::*;

    fn job_pod(ns: &str, name: &str, job_uid: Option<&str>, deleting: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                owner_references: job_uid.map(|uid| {
                    vec![OwnerReference {
                        api_version: "batch/v1".into(),
                        kind: "Job".into(),
                        name: "train".into(),
                        uid: uid.into(),
                        ..OwnerReference::default()
                    }]
                }),
                deletion_timestamp: deleting.then_some(Time(Timestamp::UNIX_EPOCH)),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn a_pods_job_siblings_are_the_other_unfinished_pods_of_its_job_and_namespace() {
        // UIDs of any form, and the RFC 4122 form the API server hands out, which the cache
        // holds as numbers.
        for (j1, j2) in [
            ("j1", "j2"),
            (
                "0c6f3a52-9d1e-4b7a-8f21-000000000001",
                "0c6f3a52-9d1e-4b7a-8f21-000000000002",
            ),
        ] {
            let pods = [
                job_pod("ml", "a", Some(j1), false),
                job_pod("ml", "b", Some(j1), false),
                job_pod("ml", "c", Some(j1), true),
                job_pod("other", "d", Some(j1), false),
                job_pod("ml", "e", Some(j2), false),
                job_pod("ml", "f", None, false),
            ];
            let all: Vec<Arc<CachedPod>> = pods
                .iter()
                .map(|p| Arc::new(CachedPod::from(p.clone())))
                .collect();
            let jobs = JobPods::gather(&all);
            // b is a's sibling; c is on its way out, d in another namespace, e of another Job.
            assert_eq!(jobs.siblings(&pods[0]), 1, "{j1}");
            assert_eq!(jobs.siblings(&pods[1]), 1, "{j1}");
            // A pod being deleted still has its Job's unfinished pods as siblings.
            assert_eq!(jobs.siblings(&pods[2]), 2, "{j1}");
            assert_eq!(jobs.siblings(&pods[3]), 0, "{j1}");
            assert_eq!(jobs.siblings(&pods[4]), 0, "{j1}");
            assert_eq!(jobs.siblings(&pods[5]), 0, "{j1}");
            // A pod the snapshot does not hold yet counts every unfinished pod of its Job.
            assert_eq!(
                jobs.siblings(&job_pod("ml", "new", Some(j1), false)),
                2,
                "{j1}"
            );
        }
    }
}
