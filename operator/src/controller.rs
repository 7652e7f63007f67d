//! The GpuPool controller: reconcile (I/O edges around the pure decisions in [`crate::pool`],
//! [`crate::membership`] and [`crate::reclaim`], with MIG drains in [`crate::drain`]), error
//! policy, and wiring of watches and stores. What reconciles share is in [`crate::context`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, future, stream};
use gpupool_crds::conditions::{Observed, condition};
use gpupool_crds::labels::{OPERATOR_TAINTS, POOL_FINALIZER, POOL_LABEL};
use gpupool_crds::policy::ReclaimMode;
use gpupool_crds::{GpuNode, GpuPool, GpuPoolStatus};
use k8s_openapi::api::core::v1::{Namespace, Node, Taint};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, PartialObjectMeta, Patch, PatchParams};
use kube::core::{ApiResource, DeserializeGuard};
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher::{self, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::cache::{
    CachedNode, CachedPod, SharedSpecs, WatchedNode, WatchedPod, cached_event, keep_pod,
};
use crate::context::{
    ActionLedger, Context, FIELD_MANAGER, GPUNODE_LIST_PAGE, InitialList, LIST_PAGE, POD_LIST_PAGE,
    Settings,
};
use crate::error::{Error, Failures, Result};
use crate::liveness::Liveness;
use crate::metrics::{ErrorLabels, Metrics, ReconcileLabels};
use crate::pool::{self, Member};
use crate::{drain, membership, reclaim_run, store};

const CONTROLLER: &str = "gpupool";
/// Writes of one reconcile in flight at once.
const WRITE_CONCURRENCY: usize = 16;

fn pool_api_resource() -> ApiResource {
    ApiResource::erase::<GpuPool>(&())
}

/// Reconciles one pool: the entry point the controller calls.
pub async fn reconcile(guard: Arc<DeserializeGuard<GpuPool>>, ctx: Arc<Context>) -> Result<Action> {
    let name = guard.name_any();
    let span = info_span!("reconcile", pool = %name);
    async move {
        let started = std::time::Instant::now();
        ctx.metrics.queue_depth.inc();
        ctx.metrics
            .reconciles
            .get_or_create(&ReconcileLabels {
                controller: CONTROLLER,
            })
            .inc();
        // At start or after a failover the pool store can be full before the others: wait for
        // every cache's first list instead of acting on a partial one.
        let unsynced = ctx.unsynced_cache();
        let result = match &guard.0 {
            Ok(_) if unsynced.is_some() => {
                debug!(
                    cache = unsynced.unwrap_or_default(),
                    "waiting for the cache's first list before reconciling"
                );
                Ok(Action::requeue(Duration::from_secs(1)))
            }
            Ok(pool) => {
                let api: Api<GpuPool> = Api::all(ctx.client.clone());
                let pool = Arc::new(pool.clone());
                let result = finalizer(&api, POOL_FINALIZER, pool.clone(), |event| async {
                    match event {
                        Finalizer::Apply(pool) => apply(&pool, &ctx, Timestamp::now()).await,
                        Finalizer::Cleanup(pool) => cleanup(&pool, &ctx).await,
                    }
                })
                .await
                .map_err(|e| Error::Finalizer {
                    pool: name.clone(),
                    source: Box::new(e),
                });
                if let Err(e) = &result {
                    report_unapplied_failure(&pool, e, &ctx).await;
                }
                result
            }
            Err(invalid) => report_invalid(&name, &invalid.to_string(), &ctx).await,
        };
        ctx.metrics
            .duration
            .observe(started.elapsed().as_secs_f64());
        ctx.metrics.queue_depth.dec();
        if result.is_ok() {
            ctx.reset_failures(&name);
        }
        result
    }
    .instrument(span)
    .await
}

/// Logs, counts and requeues with a capped backoff.
pub fn error_policy(
    guard: Arc<DeserializeGuard<GpuPool>>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    let name = guard.name_any();
    let delay = ctx.backoff(&name);
    warn!(pool = %name, error = %error, retry_in = ?delay, "reconcile failed");
    ctx.metrics
        .errors
        .get_or_create(&ErrorLabels {
            controller: CONTROLLER,
            error: error.category(),
        })
        .inc();
    Action::requeue(delay)
}

/// A reconcile that failed outside [`apply`] (which reports its own failures in the status it
/// writes): the finalizer could not be added or removed, or the cleanup failed. The previous
/// status gets the failure, so the pool says why nothing happens (best effort: logged if even
/// that write fails).
async fn report_unapplied_failure(pool: &GpuPool, error: &Error, ctx: &Context) {
    use kube::runtime::finalizer::Error as F;
    let Error::Finalizer { source, .. } = error else {
        return;
    };
    if matches!(source.as_ref(), F::ApplyFailed(_)) {
        return;
    }
    let Some(failure) = error.api_failure() else {
        return;
    };
    let status = pool::with_api_failures(pool, &[failure], Timestamp::now());
    if let Err(e) = write_status(pool, status, ctx).await {
        warn!(error = %e, "reporting the failure in the pool's status failed");
    }
}

/// A pool whose object cannot be read: say so in its status and wait for an edit.
async fn report_invalid(name: &str, message: &str, ctx: &Context) -> Result<Action> {
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &pool_api_resource());
    // The object cannot be read, so neither can its previous conditions: the transition time
    // is now.
    let ready = condition(
        &[],
        Observed {
            type_: "Ready",
            status: false,
            reason: "InvalidSpec",
            message: format!("the GpuPool cannot be read: {message}"),
            observed_generation: None,
        },
        Timestamp::now(),
    );
    let patch = json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "status": { "conditions": [ready] }
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(Error::kube(
        "patch",
        "gpupools/status",
        format!("reporting malformed GpuPool {name}"),
    ))?;
    ctx.metrics.write("GpuPool", "status");
    Ok(Action::await_change())
}

fn valid_pools(ctx: &Context) -> Vec<Arc<GpuPool>> {
    ctx.pools
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().cloned().map(Arc::new))
        .collect()
}

/// Whether `pool` owns `gn` (by the pool's UID).
pub(crate) fn owned_by(gn: &GpuNode, pool: &GpuPool) -> bool {
    let uid = pool.metadata.uid.as_deref();
    gn.owner_references()
        .iter()
        .any(|o| Some(o.uid.as_str()) == uid)
}

/// The operator's taints among a node's `taints`.
pub(crate) fn operator_taints(taints: &[Taint]) -> BTreeSet<&'static str> {
    let keys: BTreeSet<&str> = taints.iter().map(|t| t.key.as_str()).collect();
    OPERATOR_TAINTS
        .into_iter()
        .filter(|k| keys.contains(k))
        .collect()
}

/// The GpuNode `node_name` should have: its kind's resolved spec, with `kept_mig` in place of
/// the resolved layout while the node waits its turn in a layout rollout.
fn desired_gpunode(
    pool: &GpuPool,
    node_name: &str,
    resolved: &pool::ResolvedSpec,
    kept_mig: Option<Arc<gpupool_crds::node::NodeMigSpec>>,
) -> GpuNode {
    let mut spec = resolved.spec.clone();
    if let Some(mig) = kept_mig {
        spec.mig = mig;
    }
    pool::gpunode_for(pool, node_name, spec)
}

/// The reconcile of a live pool.
async fn apply(pool: &GpuPool, ctx: &Context, now: Timestamp) -> Result<Action> {
    // The status this reconcile builds on (reclaim history and counters above all) must not be
    // older than the one this process last wrote: a cache that lags behind its own write (its
    // watch was reconnecting, after an API server restart say) would make the next write undo
    // the last one. Then the pool is read afresh.
    let fresh;
    let pool = match ctx.written_version(&pool.name_any()) {
        Some(written) if pool.resource_version().as_deref() != Some(written.as_str()) => {
            let api: Api<GpuPool> = Api::all(ctx.client.clone());
            fresh = api.get(&pool.name_any()).await.map_err(Error::kube(
                "get",
                "gpupools",
                format!("reading GpuPool {} afresh", pool.name_any()),
            ))?;
            debug!("the pool cache lags this operator's last status write; read it afresh");
            &fresh
        }
        _ => pool,
    };
    let name = pool.name_any();
    let pools = valid_pools(ctx);
    let nodes = ctx.nodes.state();
    let selector_error = pool::selector(pool).err();
    let membership = membership::plan_membership(pool, &pools, &nodes);
    // Names are borrowed from the cached objects: at thousands of nodes a copy of each name in
    // each of the maps below is tens of thousands of allocations a reconcile, held across its
    // writes while the watches fill the heap around them.
    let gpunode_state = ctx.gpunodes.state();
    let gpunodes: BTreeMap<&str, &GpuNode> = gpunode_state
        .iter()
        .map(|g| (g.metadata.name.as_deref().unwrap_or_default(), g.as_ref()))
        .collect();
    let gn_api: Api<GpuNode> = Api::all(ctx.client.clone());
    let pool_ref = pool.object_ref(&());

    // GpuNodes: ensure one per member, delete those of nodes that left. Writes go out a few
    // at a time: at a thousand nodes, one by one is what makes a first reconcile slow.
    let mut members = Vec::new();
    let member_names: BTreeSet<&str> = membership.members.iter().map(|n| n.name()).collect();
    let mut to_apply = Vec::new();
    let mut joined = Vec::new();
    // One spec per kind of node, shared; what exists is compared with it field by field
    // (pool::gpunode_wanted), and a node's own GpuNode is built only where it must be written
    // (a few at a time, below).
    let mut specs = pool::SpecResolver::new(pool);
    let wanted: Vec<_> = membership
        .members
        .iter()
        .map(|node| (node, node.name(), specs.resolve(node.labels())))
        .collect();
    // A layout edit rolls over the nodes a few at a time (mig.maxUnavailable).
    let owned = |name: &str| gpunodes.get(name).copied().filter(|gn| owned_by(gn, pool));
    let rollout: Vec<(&str, Option<&GpuNode>, &gpupool_crds::node::NodeMigSpec)> = wanted
        .iter()
        .map(|(_, name, resolved)| (*name, owned(name), &*resolved.spec.mig))
        .collect();
    let holds: BTreeSet<&str> = pool::mig_rollout_holds(pool.spec.mig.max_unavailable(), &rollout)
        .into_iter()
        .collect();
    for (node, node_name, resolved) in wanted {
        let mig_waiting = holds.contains(node_name);
        let existing = gpunodes.get(node_name).copied();
        // A node waiting its turn keeps the layout it has.
        let kept_mig = existing
            .filter(|_| mig_waiting)
            .map(|gn| gn.spec.mig.clone());
        let mig = kept_mig.as_ref().unwrap_or(&resolved.spec.mig);
        match existing {
            Some(gn) if !owned_by(gn, pool) => {
                // Still held by a pool that is letting go; take it once it is gone.
                debug!(node = %node_name, "GpuNode still owned by another pool");
            }
            Some(gn) if pool::gpunode_wanted(gn, pool, &resolved.spec, mig) => {}
            _ => {
                if existing.is_none() {
                    joined.push(node_name.to_owned());
                }
                to_apply.push((node_name.to_owned(), resolved.clone(), kept_mig));
            }
        }
        members.push(Member {
            node: node_name,
            gpunode: existing.filter(|gn| owned_by(gn, pool)),
            layout_problem: resolved.problem.clone(),
            node_ready: node.is_ready(),
            agent: ctx
                .liveness
                .judge(node_name, now, ctx.settings.agent_stale_after),
            mig_waiting,
        });
    }
    // A failed write does not stop the others: the status names what failed.
    let mut failures = Failures::default();
    let applied: Vec<(String, Result<()>)> = stream::iter(to_apply)
        .map(|(node_name, resolved, kept_mig)| {
            let gn_api = gn_api.clone();
            async move {
                // The spec carries the MIG layout and sharing mode the agent drains for and
                // applies: a disruptive write, so only while this replica leads.
                if !ctx.may_act() {
                    let action = format!("applying GpuNode {node_name}");
                    return (node_name, Err(Error::NotLeading(action)));
                }
                let desired = desired_gpunode(pool, &node_name, &resolved, kept_mig);
                let result = gn_api
                    .patch(
                        &node_name,
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&desired),
                    )
                    .await
                    .map(|_| ctx.metrics.write("GpuNode", "apply"))
                    .map_err(Error::kube(
                        "patch",
                        "gpunodes",
                        format!("applying GpuNode {node_name}"),
                    ));
                (node_name, result)
            }
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    // Only nodes whose write went through have joined or left (the others are retried).
    let not_applied = keep_failures(applied, &mut failures);
    joined.retain(|n| !not_applied.contains(n));
    let mut left: Vec<String> = gpunodes
        .iter()
        .filter(|(n, gn)| owned_by(gn, pool) && !member_names.contains(*n))
        .map(|(n, _)| n.to_string())
        .collect();
    let deleted: Vec<(String, Result<()>)> = stream::iter(left.clone())
        .map(|n| {
            let gn_api = gn_api.clone();
            async move {
                let result = delete_gpunode(&gn_api, &n, ctx).await;
                (n, result)
            }
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    let not_deleted = keep_failures(deleted, &mut failures);
    left.retain(|n| !not_deleted.contains(n));
    for (reason, verb, nodes) in [
        ("NodeJoined", "joined", &joined),
        ("NodeLeft", "left", &left),
    ] {
        if nodes.is_empty() {
            continue;
        }
        info!(nodes = nodes.len(), "nodes {verb} the pool");
        // One Event per change, not per node: a thousand nodes joining is one story.
        ctx.event(
            &pool_ref,
            Event {
                type_: EventType::Normal,
                reason: reason.into(),
                note: Some(format!(
                    "{} node(s) {verb} the pool: {}",
                    nodes.len(),
                    pool::names(nodes.iter().map(String::as_str))
                )),
                action: "Reconcile".into(),
                secondary: None,
            },
        )
        .await;
    }

    // Node labels and taints.
    let mut node_writes = Vec::new();
    for node in nodes.iter() {
        let node_name = node.name();
        let is_member = member_names.contains(node_name);
        let labelled_ours = node.labels().get(POOL_LABEL) == Some(&name);
        if !is_member && !labelled_ours {
            continue;
        }
        // Only the operator sets these taints, so a node that leaves the pool loses them.
        // Owned keys: a borrowed set in this async pipeline trips a higher-ranked lifetime
        // limitation of the compiler.
        let want: BTreeSet<String> = if is_member {
            pool::node_taints(pool, gpunodes.get(node_name).copied())
                .into_iter()
                .map(str::to_owned)
                .collect()
        } else {
            BTreeSet::new()
        };
        node_writes.push((node.clone(), is_member.then(|| name.clone()), want));
    }
    let synced: Vec<Result<()>> = stream::iter(node_writes)
        .map(|(node, pool_name, want)| async move {
            sync_node(&node, pool_name.as_deref(), &want, ctx).await
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    synced.into_iter().for_each(|r| failures.check(r));

    // MIG drains and idle reclamation.
    let member_gns: Vec<&GpuNode> = members.iter().filter_map(|m| m.gpunode).collect();
    // A drain evicts only on a report the operator can vouch for (see crate::liveness).
    let vouched: BTreeSet<&str> = members
        .iter()
        .filter(|m| m.node_ready && m.agent.is_live())
        .map(|m| m.node)
        .collect();
    let pods_to_drain = drain::run(pool, &member_gns, &vouched, ctx, now, &mut failures).await;
    let previous_reclaim = pool
        .status
        .as_ref()
        .map(|s| s.reclaim.clone())
        .unwrap_or_default();
    let reclaim = if pool.spec.reclaim.mode == ReclaimMode::Off && previous_reclaim.warned == 0 {
        previous_reclaim
    } else {
        reclaim_run::run(
            pool,
            &membership.members,
            &member_gns,
            previous_reclaim,
            ctx,
            now,
            &mut failures,
        )
        .await
    };

    let status = pool::pool_status(&pool::StatusInput {
        pool,
        members,
        conflicts: membership.conflicts,
        selector_error,
        pods_to_drain,
        reclaim,
        api_failures: failures.reported(),
        now,
    });
    if let Err(e) = write_status(pool, status, ctx).await {
        // The failure that came first says more than this one.
        if failures.errors.is_empty() {
            return Err(e);
        }
        warn!(error = %e, "writing the pool's status failed");
    }
    failures.into_result()?;

    let busy = pool.spec.reclaim.mode != ReclaimMode::Off || pods_to_drain > 0;
    Ok(Action::requeue(if busy {
        ctx.settings.reclaim_interval
    } else {
        ctx.settings.resync
    }))
}

/// Moves the errors of named results into `failures`; returns the names that failed.
fn keep_failures(results: Vec<(String, Result<()>)>, failures: &mut Failures) -> BTreeSet<String> {
    let mut failed = BTreeSet::new();
    for (name, result) in results {
        if let Err(e) = result {
            failures.push(e);
            failed.insert(name);
        }
    }
    failed
}

async fn delete_gpunode(api: &Api<GpuNode>, name: &str, ctx: &Context) -> Result<()> {
    // Taking a node out of its pool, decided on what this replica's caches say: only while it
    // leads, as for every write that hands a node its state.
    if !ctx.may_act() {
        return Err(Error::NotLeading(format!("deleting GpuNode {name}")));
    }
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {
            ctx.metrics.write("GpuNode", "delete");
            Ok(())
        }
        Err(e) if crate::error::api_code(&e) == Some(404) => Ok(()),
        Err(e) => Err(Error::kube(
            "delete",
            "gpunodes",
            format!("deleting GpuNode {name}"),
        )(e)),
    }
}

/// Sets the pool label (or removes it with `None`) and the operator's taints (exactly `want`),
/// in one patch, only when something differs.
async fn sync_node(
    node: &CachedNode,
    pool: Option<&str>,
    want: &BTreeSet<String>,
    ctx: &Context,
) -> Result<()> {
    let node_name = node.name_any();
    let label_ok = node.labels().get(POOL_LABEL).map(String::as_str) == pool;
    let taint_ok = operator_taints(node.taints())
        .into_iter()
        .eq(want.iter().map(String::as_str));
    if label_ok && taint_ok {
        return Ok(());
    }
    // Labels and fences (the MIG drain's taint) decide where pods may run: only while leading.
    if !ctx.may_act() {
        return Err(Error::NotLeading(format!(
            "labelling/tainting node {node_name}"
        )));
    }
    let mut patch = json!({ "metadata": { "labels": { POOL_LABEL: pool } } });
    if !taint_ok {
        let mut taints: Vec<Taint> = node
            .taints()
            .iter()
            .filter(|t| !OPERATOR_TAINTS.contains(&t.key.as_str()))
            .cloned()
            .collect();
        for key in want {
            taints.push(Taint {
                key: key.clone(),
                effect: "NoSchedule".into(),
                value: None,
                time_added: None,
            });
        }
        // The taint list is replaced whole, so guard against a concurrent change.
        patch["metadata"]["resourceVersion"] = json!(node.resource_version());
        patch["spec"] = json!({ "taints": taints });
    }
    let api: Api<Node> = Api::all(ctx.client.clone());
    api.patch(
        &node_name,
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        },
        &Patch::Merge(&patch),
    )
    .await
    .map_err(Error::kube(
        "patch",
        "nodes",
        format!("labelling/tainting node {node_name}"),
    ))?;
    ctx.metrics.write("Node", "patch");
    Ok(())
}

/// Writes the status if it differs, with Events for transitions.
async fn write_status(pool: &GpuPool, status: GpuPoolStatus, ctx: &Context) -> Result<()> {
    let previous = pool.status.clone().unwrap_or_default();
    if pool.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let name = pool.name_any();
    let api: Api<GpuPool> = Api::all(ctx.client.clone());
    let patch = json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "status": status,
    });
    let written = api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(Error::kube(
            "patch",
            "gpupools/status",
            format!("writing status of GpuPool {name}"),
        ))?;
    ctx.status_written(&name, written.resource_version());
    ctx.metrics.write("GpuPool", "status");
    let reference = pool.object_ref(&());
    for (type_, good_when_true) in [
        ("Ready", true),
        ("Conflict", false),
        (pool::API_ERRORS, false),
    ] {
        let before = pool::condition_status(&previous, type_);
        let after = pool::condition_status(&status, type_);
        if before == after {
            continue;
        }
        // A pool's first status says nothing new about API errors when there are none.
        if type_ == pool::API_ERRORS && before.is_none() && after == Some("False") {
            continue;
        }
        let Some(c) = status.conditions.iter().find(|c| c.type_ == type_) else {
            continue;
        };
        let good = (c.status == "True") == good_when_true;
        ctx.event(
            &reference,
            Event {
                type_: if good {
                    EventType::Normal
                } else {
                    EventType::Warning
                },
                reason: format!("{type_}{}", c.status),
                note: Some(c.message.chars().take(1000).collect()),
                action: "Reconcile".into(),
                secondary: None,
            },
        )
        .await;
    }
    Ok(())
}

/// The pool is being deleted: remove its GpuNodes, labels and taints, then let go.
async fn cleanup(pool: &GpuPool, ctx: &Context) -> Result<Action> {
    let name = pool.name_any();
    let gn_api: Api<GpuNode> = Api::all(ctx.client.clone());
    for gn in ctx.gpunodes.state() {
        if owned_by(&gn, pool) {
            delete_gpunode(&gn_api, &gn.name_any(), ctx).await?;
        }
    }
    for node in ctx.nodes.state() {
        if node.labels().get(POOL_LABEL) == Some(&name) {
            sync_node(&node, None, &BTreeSet::new(), ctx).await?;
        }
    }
    reclaim_run::unwarn_all(pool, ctx).await;
    info!("pool deleted: GpuNodes, labels and taints removed");
    ctx.event(
        &pool.object_ref(&()),
        Event {
            type_: EventType::Normal,
            reason: "CleanedUp".into(),
            note: Some("removed the pool's GpuNodes, node labels and taints".into()),
            action: "Cleanup".into(),
            secondary: None,
        },
    )
    .await;
    Ok(Action::await_change())
}

/// Logs a failed list or watch of `kind`: the watcher then starts over with a fresh list (an
/// expired resource version, 410 Gone, included) after a backoff, and its cache stays as it
/// was until that list arrives.
fn watch_failed(kind: &'static str) -> impl Fn(&watcher::Error) {
    move |e| info!(kind, error = %e, "watch failed; resuming with a fresh list")
}

/// What about a node concerns a pool: labels (membership, GPU model), taints, readiness.
fn node_fingerprint(node: &CachedNode) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.labels().hash(&mut h);
    for t in node.taints() {
        (&t.key, &t.effect, &t.value).hash(&mut h);
    }
    node.ready_status().hash(&mut h);
    h.finish()
}

/// Node events that matter: changes of [`node_fingerprint`] and deletions. Heartbeats, which
/// are most node updates, are dropped, so they cost no reconcile.
fn relevant_node_changes(
    events: impl futures::Stream<Item = Result<watcher::Event<CachedNode>, watcher::Error>>
    + Send
    + 'static,
) -> impl futures::Stream<Item = Result<CachedNode, watcher::Error>> + Send + 'static {
    let mut seen: HashMap<String, u64> = HashMap::new();
    events
        .map(move |ev| {
            let out: Vec<Result<CachedNode, watcher::Error>> = match ev {
                Err(e) => vec![Err(e)],
                Ok(watcher::Event::Apply(n)) | Ok(watcher::Event::InitApply(n)) => {
                    let fp = node_fingerprint(&n);
                    if seen.insert(n.name_any(), fp) == Some(fp) {
                        vec![]
                    } else {
                        vec![Ok(n)]
                    }
                }
                Ok(watcher::Event::Delete(n)) => {
                    seen.remove(&n.name_any());
                    vec![Ok(n)]
                }
                Ok(watcher::Event::Init) | Ok(watcher::Event::InitDone) => vec![],
            };
            futures::stream::iter(out)
        })
        .flatten()
}

/// The watch configuration every cache starts from (see [`InitialList`]), `page` objects a
/// page where the list is paged.
fn watcher_config(initial_list: InitialList, page: u32) -> watcher::Config {
    let cfg = watcher::Config::default();
    match initial_list {
        InitialList::Paged => cfg.page_size(page),
        InitialList::Cache => watcher::Config {
            page_size: None,
            ..cfg.any_semantic()
        },
        InitialList::Streaming => cfg.streaming_lists(),
    }
}

/// Runs the controller until `shutdown` is cancelled.
pub async fn run(
    client: Client,
    evict_client: Client,
    metrics: Arc<Metrics>,
    settings: Settings,
    shutdown: CancellationToken,
) -> Result<()> {
    let pools_api: Api<DeserializeGuard<GpuPool>> = Api::all(client.clone());
    let gn_api: Api<GpuNode> = Api::all(client.clone());
    let node_api: Api<WatchedNode> = Api::all(client.clone());
    let pod_api: Api<WatchedPod> = Api::all(client.clone());
    let ns_api: Api<PartialObjectMeta<Namespace>> = Api::all(client.clone());

    let (gn_store, mut gn_writer) = store::store::<GpuNode>();
    let (node_store, mut node_writer) = store::store::<CachedNode>();
    let (pod_store, mut pod_writer) = store::store::<CachedPod>();
    let (ns_store, mut ns_writer) = store::store::<PartialObjectMeta<Namespace>>();

    let cfg = watcher_config(settings.initial_list, LIST_PAGE);
    let liveness = Arc::new(Liveness::default());
    let seen = liveness.clone();
    // Heartbeats are timed as the watch delivers them (see crate::liveness).
    let mut shared = SharedSpecs::default();
    let gn_stream = watcher(
        gn_api,
        watcher_config(settings.initial_list, GPUNODE_LIST_PAGE),
    )
    .modify(move |gn| shared.trim(gn))
    .inspect_ok(move |ev| gn_writer.apply_watcher_event(ev))
    .default_backoff()
    .inspect_err(watch_failed("GpuNode"))
    .touched_objects()
    .inspect_ok(move |gn: &GpuNode| seen.observe_gpunode(gn, Timestamp::now()));
    let node_stream = relevant_node_changes(
        watcher(node_api, cfg.clone())
            .map_ok(cached_event)
            .inspect_ok(move |ev| node_writer.apply_watcher_event(ev))
            .default_backoff()
            .inspect_err(watch_failed("Node")),
    );
    let pod_stream = watcher(
        pod_api,
        watcher_config(settings.initial_list, POD_LIST_PAGE)
            .fields("status.phase!=Succeeded,status.phase!=Failed"),
    )
    .map_ok(cached_event)
    .try_filter(|ev| future::ready(keep_pod(ev)))
    .inspect_ok(move |ev| pod_writer.apply_watcher_event(ev))
    .default_backoff()
    .inspect_err(watch_failed("Pod"));
    let ns_stream = watcher(ns_api, cfg.clone())
        .inspect_ok(move |ev| ns_writer.apply_watcher_event(ev))
        .default_backoff()
        .inspect_err(watch_failed("Namespace"))
        .touched_objects();

    let pool_cfg = match &settings.pool_selector {
        Some(sel) => cfg.clone().labels(sel),
        None => cfg.clone(),
    };
    // No debounce: kube's restarts its wait on every trigger, which starves a pool whose nodes
    // keep changing; the Node and GpuNode triggers are throttled instead (see below).
    let controller = Controller::new(pools_api, pool_cfg);
    let pool_store = controller.store();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    let ctx = Arc::new(Context {
        client,
        evict_client,
        pools: pool_store.clone(),
        nodes: node_store,
        gpunodes: gn_store.clone(),
        pods: pod_store,
        namespaces: ns_store,
        recorder,
        metrics: metrics.clone(),
        settings,
        failures: Mutex::default(),
        evict_retry: Mutex::default(),
        liveness,
        written: Mutex::default(),
        acting: shutdown.clone(),
        ledger: ActionLedger::default(),
    });

    // A node change concerns the pools that match it and the pool its label names.
    let pools_for_nodes = pool_store.clone();
    let node_to_pools = move |node: CachedNode| {
        let labels = node.labels().clone();
        pools_for_nodes
            .state()
            .iter()
            .filter(|g| {
                g.0.as_ref().is_ok_and(|p| {
                    pool::matches(p, &labels) || labels.get(POOL_LABEL) == Some(&p.name_any())
                })
            })
            .map(|g| ObjectRef::new(&g.name_any()))
            .collect::<Vec<_>>()
    };
    let pools_for_gpunodes = pool_store.clone();
    let gn_to_pool = move |gn: GpuNode| {
        let pool = ObjectRef::<DeserializeGuard<GpuPool>>::new(&gn.spec.pool);
        // GpuNodes of pools another operator shard manages are not ours to reconcile.
        pools_for_gpunodes.get(&pool).map(|_| pool)
    };

    // Pods and namespaces only feed stores; keep their streams polled.
    let side = tokio::spawn(async move {
        futures::join!(
            pod_stream.for_each(|_| future::ready(())),
            ns_stream.for_each(|_| future::ready(()))
        );
    });
    // While this replica leads, the pool gauges read its caches and it counts GPU time.
    metrics.pools.set_caches(Some(crate::pool_metrics::Caches {
        pools: pool_store.clone(),
        gpunodes: gn_store.clone(),
    }));
    let accounting = tokio::spawn(count_gpu_time(
        gn_store.clone(),
        metrics.clone(),
        ctx.settings.accounting_interval,
    ));

    let shutdown_signal = shutdown.clone();
    // A pool's Node and GpuNode triggers, at most one a pool per interval and none held back
    // for longer (crate::throttle). Watch errors are logged where they arise and retried by
    // the watchers' backoff.
    let node_triggers = node_stream
        .filter_map(|n| future::ready(n.ok()))
        .flat_map(move |n| stream::iter(node_to_pools(n)));
    let gn_triggers = gn_stream.filter_map(move |gn| future::ready(gn.ok().and_then(&gn_to_pool)));
    let triggers = crate::throttle::throttle(
        stream::select(node_triggers, gn_triggers),
        crate::throttle::POOL_TRIGGER_INTERVAL,
    );
    controller
        .reconcile_on(triggers)
        .graceful_shutdown_on(async move { shutdown_signal.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|res| {
            match res {
                Ok((obj, _)) => debug!(pool = %obj.name, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile round"),
            }
            future::ready(())
        })
        .await;
    side.abort();
    accounting.abort();
    metrics.pools.set_caches(None);
    Ok(())
}

/// Samples the GpuNode cache every `interval` into the GPU-time counters (see
/// [`crate::accounting`]). The first sample waits for the cache's initial list, so a start
/// never counts from an empty picture.
async fn count_gpu_time(
    gpunodes: store::Store<GpuNode>,
    metrics: Arc<Metrics>,
    interval: Duration,
) {
    if gpunodes.wait_until_ready().await.is_err() {
        return;
    }
    let mut accountant = crate::accounting::Accountant::default();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let state = gpunodes.state();
        let accrual = accountant.sample(state.iter().map(|g| g.as_ref()), Timestamp::now());
        metrics.account(&accrual);
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::{InitialListStrategy, ListSemantic};

    use super::*;

    #[test]
    fn each_initial_list_asks_the_api_server_for_what_it_says() {
        let paged = watcher_config(InitialList::Paged, LIST_PAGE);
        assert_eq!(paged.page_size, Some(LIST_PAGE));
        let gpunodes = watcher_config(InitialList::Paged, GPUNODE_LIST_PAGE);
        assert_eq!(gpunodes.page_size, Some(GPUNODE_LIST_PAGE));
        let pods = watcher_config(InitialList::Paged, POD_LIST_PAGE);
        assert_eq!(pods.page_size, Some(POD_LIST_PAGE));
        assert_eq!(paged.list_semantic, ListSemantic::MostRecent);
        assert_eq!(paged.initial_list_strategy, InitialListStrategy::ListWatch);

        let cache = watcher_config(InitialList::Cache, LIST_PAGE);
        assert_eq!(cache.page_size, None);
        assert_eq!(cache.list_semantic, ListSemantic::Any);
        assert_eq!(cache.initial_list_strategy, InitialListStrategy::ListWatch);

        let streaming = watcher_config(InitialList::Streaming, LIST_PAGE);
        assert_eq!(
            streaming.initial_list_strategy,
            InitialListStrategy::StreamingList
        );
    }
}
