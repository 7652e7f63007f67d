//! Faults of the control plane itself. A test binary of its own: restarting the API server
//! drops every client of the shared cluster, so no other test may run beside it.
//!
//! - The API server restarts right after a node joins the pool and right after an agent reports
//!   a pod idle: the operator process carries on (no restart of its own), its watches come back
//!   (each told its resource version expired, 410, and listing afresh) and pick up what changed,
//!   the node joins and the pod is reclaimed exactly once.

#[path = "operator_support.rs"]
mod support;

use anyhow::{Context, Result, ensure};
use gpupool_crds::node::{Activity, GpuStatus, Idleness, PodRef};
use gpupool_crds::pool::ReclaimRecord;
use gpupool_e2e::{Cluster, TestScope, crds, wait};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{Api, ResourceExt};
use serde_json::json;
use support::*;

const ROLE: &str = "e2e.gpupool.io/role";

#[tokio::test]
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
                namespace: scope.namespace().to_owned(),
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
    // The restarted API server's watch cache starts at the current revision, so every watch
    // resuming from an older one is told it expired (410 Gone) and must list afresh: the joins
    // and reclaims above happened after such relists, of each kind the operator watches.
    let log = strip_ansi(&std::fs::read_to_string(&op.log)?);
    for kind in ["Node", "GpuNode", "Pod", "Namespace"] {
        ensure!(
            log.lines().any(|l| l.contains("watch failed")
                && l.contains(&format!("kind=\"{kind}\""))
                && l.contains("too old resource version")),
            "no expired {kind} watch in the operator's log:\n{}",
            op.log_tail()
        );
    }
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
