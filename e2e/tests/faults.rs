//! Faults of the control plane itself. A test binary of its own: restarting the API server
//! drops every client of the shared cluster, so no other test may run beside it.
//!
//! - A failover in a pool of many nodes (`GPUPOOL_E2E_FAILOVER_NODES`, default 300): the
//!   standby takes the Lease, starts from empty caches that fill in whatever order the lists
//!   arrive, and deletes or recreates no GpuNode, and emits no `NodeLeft`.
//! - The API server restarts right after a node joins the pool and right after an agent reports
//!   a pod idle: the operator process carries on (no restart of its own), its watches come back
//!   (told their resource version expired, 410, and listing afresh) and pick up what changed,
//!   the node joins and the pod is reclaimed exactly once.

#[path = "operator_support.rs"]
mod support;

use anyhow::{Context, Result, ensure};
use gpupool_crds::GpuNode;
use gpupool_crds::labels::POOL_LABEL;
use gpupool_crds::node::{Activity, GpuStatus, Idleness, PodRef};
use gpupool_crds::pool::ReclaimRecord;
use gpupool_e2e::{Cluster, TestScope, crds, wait};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde_json::json;
use support::*;

const ROLE: &str = "e2e.gpupool.io/role";

/// The scenarios run one after the other: each disturbs the whole cluster (a restart drops
/// every client; hundreds of nodes load the API server).
#[tokio::test]
async fn control_plane_faults() -> Result<()> {
    the_operator_rides_out_an_api_server_restart().await?;
    a_failover_at_scale_deletes_no_gpunode().await
}

async fn the_operator_rides_out_an_api_server_restart() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "fault-restart")?;
    let client = cluster.client().await?;
    let n1 = create_node(
        cluster,
        &scope,
        &scope.name("n1"),
        "NVIDIA-H100-80GB-HBM3",
        &[(ROLE, "gpu")],
    )?;
    let n2 = create_node(
        cluster,
        &scope,
        &scope.name("n2"),
        "NVIDIA-H100-80GB-HBM3",
        &[(ROLE, "later")],
    )?;
    let mut op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let (k, v) = scope.label();
    let pool = scope.name("pool");
    apply_pool(
        &client,
        &scope,
        &pool,
        json!({
            "nodeSelector": { "matchLabels": { k: v, ROLE: "gpu" } },
            "reclaim": {
                "mode": "Enforce", "idleAfter": "5m", "gracePeriod": "3s",
                "startupGracePeriod": "0s", "action": "Evict",
            },
        }),
    )
    .await?;
    wait_gpunode(&client, &n1, |_| true)
        .await
        .with_context(|| op.log_tail())?;
    let pod = running_gpu_pod(&client, &scope, "idle", &n1, &[], &[]).await?;

    // Two changes land, and the API server goes down before the operator can be sure to have
    // acted on them: n2 joins, and the agent calls the pod idle for an hour.
    set_node_label(&client, &n2, ROLE, Some("gpu")).await?;
    let idle = GpuStatus {
        index: 0,
        idleness: Idleness {
            activity: Activity::Idle,
            idle_since: Some(Time(
                Timestamp::now()
                    .checked_sub(SignedDuration::from_hours(1))
                    .unwrap_or(Timestamp::UNIX_EPOCH),
            )),
            pods: vec![PodRef {
                namespace: scope.namespace().into(),
                name: pod.name_any(),
                container: Some("main".into()),
            }],
        },
        ..Default::default()
    };
    report_status(&client, &n1, |s| {
        s.gpus = vec![idle.clone()];
        s.heartbeat_time = Some(Time(Timestamp::now()));
    })
    .await?;
    cluster.restart_apiserver()?;

    // A client made after the restart; the operator keeps the one it had.
    let client = cluster.client().await?;
    wait_gpunode(&client, &n2, |_| true)
        .await
        .with_context(|| op.log_tail())?;
    wait_evicted(&client, scope.namespace(), "idle")
        .await
        .with_context(|| op.log_tail())?;
    ensure!(op.is_running(), "the operator exited:\n{}", op.log_tail());
    // The restarted API server's watch cache starts at the current revision, so a watch
    // resuming from an older one is told it expired (410 Gone) and must list afresh: the joins
    // and reclaims above happened after such relists. Which kinds expire depends on timing: a
    // watch whose last bookmark already carried the current revision resumes without one (seen
    // on a loaded machine for Node), so the fault is proven by the expiries that did happen.
    let log = strip_ansi(&std::fs::read_to_string(&op.log)?);
    let expired: Vec<&str> = ["Node", "GpuNode", "Pod", "Namespace"]
        .into_iter()
        .filter(|kind| {
            log.lines().any(|l| {
                l.contains("watch failed")
                    && l.contains(&format!("kind=\"{kind}\""))
                    && l.contains("too old resource version")
            })
        })
        .collect();
    ensure!(
        !expired.is_empty(),
        "no expired watch in the operator's log: the restart injected no fault\n{}",
        op.log_tail()
    );
    eprintln!("e2e: watches told they expired after the restart: {expired:?}");
    // Exactly once: a few more passes add nothing.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let history: Vec<ReclaimRecord> = Api::<gpupool_crds::GpuPool>::all(client.clone())
        .get(&pool)
        .await?
        .status
        .map(|s| s.reclaim.history)
        .unwrap_or_default();
    let evictions: Vec<&ReclaimRecord> = history
        .iter()
        .filter(|r| r.pod == format!("{}/idle", scope.namespace()) && r.action == "Evict")
        .collect();
    ensure!(
        evictions.len() == 1 && evictions[0].result == "Succeeded",
        "want one successful eviction, got {history:?}"
    );
    wait_pool(&client, &pool, "both nodes counted", |p| {
        p.status.as_ref().is_some_and(|s| s.selected_nodes == 2)
    })
    .await
    .with_context(|| op.log_tail())?;
    delete_pool(&client, &pool).await?;
    wait::poll("the pool gone", REACT, POLL, || {
        let client = client.clone();
        let pool = pool.clone();
        async move {
            Ok(Api::<gpupool_crds::GpuPool>::all(client)
                .get_opt(&pool)
                .await?
                .is_none()
                .then_some(()))
        }
    })
    .await?;
    Ok(())
}

/// Creates `count` kwok GPU nodes named `<prefix>-<i>` with the scope's label, in one request
/// per hundred.
fn create_nodes(cluster: &Cluster, scope: &TestScope, prefix: &str, count: usize) -> Result<()> {
    scope.track_kind("nodes");
    let names: Vec<String> = (0..count).map(|i| format!("{prefix}-{i}")).collect();
    for chunk in names.chunks(100) {
        let items: Vec<serde_json::Value> = chunk
            .iter()
            .map(|name| kwok_node(scope, name, "NVIDIA-H100-80GB-HBM3", &[]))
            .collect();
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        cluster
            .kubectl()
            .run_with_stdin(["create", "-f", "-"], Some(&list.to_string()))?;
    }
    Ok(())
}

/// The UIDs of the pool's GpuNodes, by name.
async fn gpunode_uids(
    client: &kube::Client,
    pool: &str,
) -> Result<std::collections::BTreeMap<String, String>> {
    let api: Api<GpuNode> = Api::all(client.clone());
    Ok(api
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={pool}")))
        .await?
        .items
        .into_iter()
        .map(|g| (g.name_any(), g.uid().unwrap_or_default()))
        .collect())
}

async fn a_failover_at_scale_deletes_no_gpunode() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "fault-failover")?;
    let client = cluster.client().await?;
    let count: usize = std::env::var("GPUPOOL_E2E_FAILOVER_NODES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let started = std::time::Instant::now();
    create_nodes(cluster, &scope, &scope.name("n"), count)?;
    let lease = scope.name("lease");
    let mut a = Operator::start(cluster, &scope, "replica-a", &lease)?;
    let (k, v) = scope.label();
    let pool = scope.name("pool");
    apply_pool(
        &client,
        &scope,
        &pool,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    let before = wait::poll(
        &format!("{count} GpuNodes"),
        std::time::Duration::from_secs(300),
        POLL,
        || async {
            let uids = gpunode_uids(&client, &pool).await?;
            Ok((uids.len() == count).then_some(uids))
        },
    )
    .await
    .with_context(|| a.log_tail())?;
    eprintln!(
        "e2e: {count} nodes and their GpuNodes in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    // The leader dies; the standby starts from nothing and takes over.
    let b = Operator::start(cluster, &scope, "replica-b", &lease)?;
    a.kill();
    let leases: Api<Lease> = Api::namespaced(client.clone(), scope.namespace());
    wait::poll("replica-b leads", REACT, POLL, || async {
        Ok(leases
            .get_opt(&lease)
            .await?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| h == "replica-b")
            .map(|_| ()))
    })
    .await
    .with_context(|| b.log_tail())?;
    // Its first reconciles of the pool, from caches filled in whatever order: until the pool
    // has been reconciled a few times by b, nothing is concluded.
    wait::poll("replica-b reconciles the pool", REACT, POLL, || async {
        let log = std::fs::read_to_string(&b.log).unwrap_or_default();
        Ok((strip_ansi(&log)
            .lines()
            .filter(|l| l.contains("reconciled") && l.contains(pool.as_str()))
            .count()
            >= 3)
            .then_some(()))
    })
    .await
    .with_context(|| b.log_tail())?;
    let after = gpunode_uids(&client, &pool).await?;
    ensure!(
        after == before,
        "the failover changed GpuNodes: {} before, {} after, {} with another UID",
        before.len(),
        after.len(),
        before
            .iter()
            .filter(|(n, uid)| after.get(*n) != Some(*uid))
            .count()
    );
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let left: Vec<Event> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some("NodeLeft")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pool.as_str())
        })
        .collect();
    ensure!(left.is_empty(), "NodeLeft at failover: {left:?}");
    delete_pool(&client, &pool).await?;
    wait::poll(
        "the pool gone",
        std::time::Duration::from_secs(300),
        POLL,
        || {
            let client = client.clone();
            let pool = pool.clone();
            async move {
                Ok(Api::<gpupool_crds::GpuPool>::all(client)
                    .get_opt(&pool)
                    .await?
                    .is_none()
                    .then_some(()))
            }
        },
    )
    .await
    .with_context(|| b.log_tail())?;
    Ok(())
}
