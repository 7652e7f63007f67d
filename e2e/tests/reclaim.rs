//! Idle-pod reclamation against the real control plane, with kwok running the pods and the
//! test writing the GpuNode statuses a node agent would (idleSince set in the past, since
//! idleAfter cannot be shorter than 5m).

#[path = "operator_support.rs"]
mod support;

use std::collections::BTreeMap;

use anyhow::{Context, Result, ensure};
use gpupool_crds::labels::{IDLE_SINCE_ANNOTATION, RECLAIM_AT_ANNOTATION};
use gpupool_crds::node::{Activity, GpuStatus, Idleness, PodRef};
use gpupool_crds::pool::ReclaimRecord;
use gpupool_e2e::{Cluster, TestScope, crds, wait};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use support::*;

/// Pods with this label are left running by the e2e cluster's kwok, which otherwise completes
/// a Job's pod at once (see `write_kwok_stages` in e2e/cluster).
const KEEP_RUNNING_LABEL: &str = "e2e.gpupool.io/keep-running";

/// What the fake agent says about one pod's GPU.
#[derive(Clone, Copy)]
enum Seen {
    /// Idle for an hour.
    Idle,
    Busy,
    Unknown,
}

fn gpu(index: u32, holder: &Pod, seen: Seen) -> GpuStatus {
    let (activity, idle_since) = match seen {
        Seen::Idle => (
            Activity::Idle,
            Some(Time(
                Timestamp::now()
                    .checked_sub(SignedDuration::from_hours(1))
                    .unwrap_or(Timestamp::UNIX_EPOCH),
            )),
        ),
        Seen::Busy => (Activity::Busy, None),
        Seen::Unknown => (Activity::Unknown, None),
    };
    GpuStatus {
        index,
        uuid: format!("GPU-e2e-{index}"),
        model: "NVIDIA H100 80GB HBM3".into(),
        memory_mib: 81559,
        pci_bus_id: format!("0000:{index:02x}:00.0"),
        idleness: Idleness {
            activity,
            idle_since,
            pods: vec![PodRef {
                namespace: holder.namespace().unwrap_or_default().into(),
                name: holder.name_any(),
                container: Some("main".into()),
            }],
        },
        ..Default::default()
    }
}

/// Reports the node with these pods on its GPUs, one GPU each, stamped now.
async fn report_gpus(client: &Client, node: &str, holders: &[(&Pod, Seen)]) -> Result<()> {
    report_gpus_stamped(client, node, holders, Some(Timestamp::now())).await
}

/// [`report_gpus`] with this heartbeat stamp (`None`: none).
async fn report_gpus_stamped(
    client: &Client,
    node: &str,
    holders: &[(&Pod, Seen)],
    stamp: Option<Timestamp>,
) -> Result<()> {
    let gpus: Vec<GpuStatus> = holders
        .iter()
        .enumerate()
        .map(|(i, (p, seen))| gpu(i as u32, p, *seen))
        .collect();
    report_status(client, node, move |s| {
        s.gpus = gpus;
        s.heartbeat_time = stamp.map(Time);
    })
    .await
}

fn reclaim_spec(scope: &TestScope, extra: serde_json::Value) -> serde_json::Value {
    let (k, v) = scope.label();
    let mut reclaim = json!({
        "mode": "Enforce",
        "idleAfter": "5m",
        "gracePeriod": "3s",
        "startupGracePeriod": "0s",
        "action": "Auto",
    });
    if let (Some(r), Some(e)) = (reclaim.as_object_mut(), extra.as_object()) {
        for (key, value) in e {
            r.insert(key.clone(), value.clone());
        }
    }
    json!({ "nodeSelector": { "matchLabels": { k: v } }, "reclaim": reclaim })
}

/// A node, an operator and a pool with this reclaim policy; returns (node, pool, operator).
async fn setup(
    cluster: &'static Cluster,
    scope: &TestScope,
    client: &Client,
    reclaim: serde_json::Value,
) -> Result<(String, String, Operator)> {
    setup_with(cluster, scope, client, reclaim, &[]).await
}

/// [`setup`] with more operator flags.
async fn setup_with(
    cluster: &'static Cluster,
    scope: &TestScope,
    client: &Client,
    reclaim: serde_json::Value,
    operator_flags: &[&str],
) -> Result<(String, String, Operator)> {
    crds::install(cluster).await?;
    let node = create_node(
        cluster,
        scope,
        &scope.name("n"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let op = Operator::start_with(cluster, scope, "only", &scope.name("lease"), operator_flags)?;
    let pool = scope.name("pool");
    apply_pool(client, scope, &pool, reclaim_spec(scope, reclaim)).await?;
    wait_gpunode(client, &node, |_| true)
        .await
        .with_context(|| op.log_tail())?;
    Ok((node, pool, op))
}

fn warned(pod: &Pod) -> bool {
    let a = pod.annotations();
    a.contains_key(IDLE_SINCE_ANNOTATION) && a.contains_key(RECLAIM_AT_ANNOTATION)
}

async fn wait_warned(client: &Client, ns: &str, name: &str) -> Result<Pod> {
    wait::poll(&format!("{name} warned"), REACT, POLL, || async move {
        Ok(pod_now(client, ns, name).await?.filter(warned))
    })
    .await
}

async fn history(client: &Client, pool: &str) -> Result<Vec<ReclaimRecord>> {
    let api: Api<gpupool_crds::GpuPool> = Api::all(client.clone());
    Ok(api
        .get(pool)
        .await?
        .status
        .map(|s| s.reclaim.history)
        .unwrap_or_default())
}

async fn wait_history(
    client: &Client,
    pool: &str,
    what: &str,
    check: impl Fn(&ReclaimRecord) -> bool,
) -> Result<ReclaimRecord> {
    let check = &check;
    wait::poll(what, REACT, POLL, || async move {
        Ok(history(client, pool).await?.into_iter().find(|r| check(r)))
    })
    .await
}

async fn events_for(client: &Client, ns: &str, name: &str) -> Result<Vec<Event>> {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect())
}

#[tokio::test]
async fn idle_pods_are_warned_then_evicted_at_the_deadline() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-act")?;
    let client = cluster.client().await?;
    let (node, pool, op) = setup(cluster, &scope, &client, json!({})).await?;
    let ns = scope.namespace();
    let bare = running_gpu_pod(&client, &scope, "bare", &node, &[], &[]).await?;
    report_gpus(&client, &node, &[(&bare, Seen::Idle)]).await?;

    // Warned first, with an Event saying when and how to opt out.
    let warned_bare = wait_warned(&client, ns, "bare")
        .await
        .with_context(|| op.log_tail())?;
    let at: Timestamp = warned_bare.annotations()[RECLAIM_AT_ANNOTATION].parse()?;
    let warning = wait::poll("IdleGPU Event on the pod", REACT, POLL, || async {
        Ok(events_for(&client, ns, "bare")
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("IdleGPU")))
    })
    .await?;
    let note = warning.note.clone().unwrap_or_default();
    assert!(note.contains("gpupool.io/reclaim=disabled"), "{note}");

    // Then evicted at the deadline (a bare pod: Auto evicts), once.
    wait_evicted(&client, ns, "bare")
        .await
        .with_context(|| op.log_tail())?;
    let evict = wait_history(&client, &pool, "Evict in history", |r| {
        r.pod == format!("{ns}/bare") && r.action == "Evict"
    })
    .await?;
    assert_eq!(evict.result, "Succeeded");
    assert!(
        evict.time.0 >= at,
        "acted at {} before the announced {at}",
        evict.time.0
    );
    let p = wait_pool(&client, &pool, "reclaimed counted", |p| {
        p.status.as_ref().is_some_and(|s| s.reclaim.reclaimed == 1)
    })
    .await?;
    let h = p.status.map(|s| s.reclaim.history).unwrap_or_default();
    assert_eq!(h.len(), 1, "{h:?}");
    delete_pool(&client, &pool).await?;
    Ok(())
}

/// A fault the reclaimer must survive: the agent falls silent. The node's status still says
/// the pod's GPU has been idle for an hour, but with no heartbeat for longer than the operator's
/// limit the report is stale: the pool says so (`AgentStale`, not Ready, no healthy GPU) and
/// the pod is neither warned nor evicted. One fresh heartbeat and the same report is acted on.
#[tokio::test]
async fn a_silent_agent_holds_reclaim_and_its_pool_says_so() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-stale")?;
    let client = cluster.client().await?;
    let stale_after = 10;
    let (node, pool, op) = setup_with(
        cluster,
        &scope,
        &client,
        json!({}),
        &["--agent-stale-secs", &stale_after.to_string()],
    )
    .await?;
    let ns = scope.namespace();
    let pod = running_gpu_pod(&client, &scope, "quiet", &node, &[], &[]).await?;
    // Reports without a heartbeat never count as one: the agent last spoke when the GpuNode
    // appeared.
    report_gpus_stamped(&client, &node, &[(&pod, Seen::Busy)], None).await?;
    let stale = wait_pool(&client, &pool, "the node's agent stale", |p| {
        problem(p, &node, "AgentStale").is_some()
    })
    .await
    .with_context(|| op.log_tail())?;
    let st = stale.status.clone().unwrap_or_default();
    assert_eq!(condition(&stale, "Ready").as_deref(), Some("False"));
    assert_eq!((st.gpus.total, st.gpus.healthy), (8, 0), "{:?}", st.gpus);

    // Idle for an hour, by a report nobody vouches for: held, over many reclaim passes.
    report_gpus_stamped(&client, &node, &[(&pod, Seen::Idle)], None).await?;
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    let now = pod_now(&client, ns, "quiet")
        .await?
        .context("the pod went while its agent was silent")?;
    assert!(
        !warned(&now),
        "warned on stale data: {:?}",
        now.annotations()
    );
    assert!(history(&client, &pool).await?.is_empty());

    // Heartbeats again, as a live agent writes them: the same report now stands, and the pod
    // is warned and then evicted.
    // (The same idleSince every time, as an agent keeps it: a new one restarts the warning.)
    let idle = gpu(0, &pod, Seen::Idle);
    let beating = {
        let (client, node) = (client.clone(), node.clone());
        tokio::spawn(async move {
            loop {
                let beat = report_status(&client, &node, |s| {
                    s.gpus = vec![idle.clone()];
                    s.heartbeat_time = Some(Time(Timestamp::now()));
                })
                .await;
                if let Err(e) = beat {
                    eprintln!("e2e: heartbeat: {e:#}");
                }
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        })
    };
    let revived = wait_pool(&client, &pool, "fresh again", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await;
    let acted = match revived {
        Ok(_) => match wait_warned(&client, ns, "quiet").await {
            Ok(_) => wait_evicted(&client, ns, "quiet").await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    beating.abort();
    acted.with_context(|| op.log_tail())?;
    delete_pool(&client, &pool).await?;
    Ok(())
}

/// A node whose clock runs ten minutes behind reports a pod idle for two minutes. Read on the
/// node's clock its `idleSince` is twelve minutes ago by the operator's clock, past the pool's
/// five-minute `idleAfter`: without correction the pod would be warned ten minutes early. The
/// operator measures the skew from the agent's heartbeats, reports it (`ClockSkew`) and reads
/// the node's times on its own clock, so the pod is left alone; idle for an hour (node clock),
/// it is warned.
#[tokio::test]
async fn a_node_clock_ten_minutes_behind_neither_acts_early_nor_goes_unreported() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-skew")?;
    let client = cluster.client().await?;
    let (node, pool, op) = setup(cluster, &scope, &client, json!({})).await?;
    let ns = scope.namespace();
    let pod = running_gpu_pod(&client, &scope, "skewed", &node, &[], &[]).await?;
    let behind = SignedDuration::from_mins(10);
    let node_now = || {
        Timestamp::now()
            .checked_sub(behind)
            .unwrap_or(Timestamp::UNIX_EPOCH)
    };
    let idle_for = |mins: i64| {
        let mut g = gpu(0, &pod, Seen::Idle);
        g.idleness.idle_since = Some(Time(
            node_now()
                .checked_sub(SignedDuration::from_mins(mins))
                .unwrap_or(Timestamp::UNIX_EPOCH),
        ));
        g
    };
    let recent = idle_for(2);
    // Two heartbeats on the node's clock; the second one gives the skew.
    for _ in 0..2 {
        let g = recent.clone();
        report_status(&client, &node, move |s| {
            s.gpus = vec![g];
            s.heartbeat_time = Some(Time(node_now()));
        })
        .await?;
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    }
    let reported = wait_pool(&client, &pool, "the skew reported", |p| {
        problem(p, &node, "ClockSkew").is_some()
    })
    .await
    .with_context(|| op.log_tail())?;
    let message = problem(&reported, &node, "ClockSkew")
        .map(|pr| pr.message)
        .unwrap_or_default();
    ensure!(message.contains("behind"), "{message}");
    // Many reclaim passes: the pod, idle two minutes in truth, is not warned.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let now = pod_now(&client, ns, "skewed")
        .await?
        .context("the pod went")?;
    ensure!(
        !warned(&now),
        "warned early, on the node's clock: {:?}",
        now.annotations()
    );
    // Idle for an hour by the node's clock: now it is acted on.
    let long = idle_for(60);
    report_status(&client, &node, move |s| {
        s.gpus = vec![long];
        s.heartbeat_time = Some(Time(node_now()));
    })
    .await?;
    wait_warned(&client, ns, "skewed")
        .await
        .with_context(|| op.log_tail())?;
    delete_pool(&client, &pool).await?;
    Ok(())
}

#[tokio::test]
async fn unknown_exempt_and_opted_out_pods_are_never_touched() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-spare")?;
    let client = cluster.client().await?;
    let (node, pool, op) = setup(
        cluster,
        &scope,
        &client,
        json!({ "action": "Evict", "exemptions": { "podSelector": { "matchLabels": { "keep": "yes" } } } }),
    )
    .await?;
    let ns = scope.namespace();
    let later = Timestamp::now()
        .checked_add(SignedDuration::from_hours(24))
        .unwrap_or(Timestamp::MAX)
        .to_string();
    let until = format!("disabled-until={later}");
    for (name, annotations, labels) in [
        ("canary", vec![], vec![]),
        ("unknown", vec![], vec![]),
        ("nodata", vec![], vec![]),
        ("exempt", vec![], vec![("keep", "yes")]),
        ("optout", vec![("gpupool.io/reclaim", "disabled")], vec![]),
        (
            "optout-until",
            vec![("gpupool.io/reclaim", until.as_str())],
            vec![],
        ),
    ] {
        create_gpu_pod(&client, &scope, name, Some(&node), 1, &annotations, &labels).await?;
    }
    let mut running = BTreeMap::new();
    for name in [
        "canary",
        "unknown",
        "nodata",
        "exempt",
        "optout",
        "optout-until",
    ] {
        wait_running(&client, ns, name).await?;
        running.insert(name, backdate_start(&client, ns, name).await?);
    }
    report_gpus(
        &client,
        &node,
        &[
            (&running["canary"], Seen::Idle),
            (&running["unknown"], Seen::Unknown),
            (&running["exempt"], Seen::Idle),
            (&running["optout"], Seen::Idle),
            (&running["optout-until"], Seen::Idle),
        ],
    )
    .await?;
    // The canary shows the reclaimer has run its course on this node.
    wait_evicted(&client, ns, "canary")
        .await
        .with_context(|| op.log_tail())?;
    for name in ["unknown", "nodata", "exempt", "optout", "optout-until"] {
        let p = pod_now(&client, ns, name)
            .await?
            .with_context(|| format!("{name} is gone"))?;
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{name} is being deleted"
        );
        assert!(!warned(&p), "{name} was warned");
    }
    let h = history(&client, &pool).await?;
    assert!(h.iter().all(|r| r.pod == format!("{ns}/canary")), "{h:?}");
    delete_pool(&client, &pool).await?;
    Ok(())
}

#[tokio::test]
async fn dry_run_evicts_nothing_and_busy_pods_are_unwarned() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-dry")?;
    let client = cluster.client().await?;
    let (node, pool, op) = setup(
        cluster,
        &scope,
        &client,
        json!({ "mode": "DryRun", "action": "Evict" }),
    )
    .await?;
    let ns = scope.namespace();
    create_gpu_pod(&client, &scope, "idle", Some(&node), 1, &[], &[]).await?;
    create_gpu_pod(&client, &scope, "wakes", Some(&node), 1, &[], &[]).await?;
    wait_running(&client, ns, "idle").await?;
    let idle = backdate_start(&client, ns, "idle").await?;
    wait_running(&client, ns, "wakes").await?;
    let wakes = backdate_start(&client, ns, "wakes").await?;
    report_gpus(&client, &node, &[(&idle, Seen::Idle), (&wakes, Seen::Idle)]).await?;
    wait_warned(&client, ns, "wakes")
        .await
        .with_context(|| op.log_tail())?;

    let record = wait_history(&client, &pool, "dry-run record", |r| {
        r.pod == format!("{ns}/idle")
    })
    .await
    .with_context(|| op.log_tail())?;
    assert_eq!(record.action, "DryRun:Evict");
    assert_eq!(record.result, "WouldSucceed");
    let p = pod_now(&client, ns, "idle")
        .await?
        .context("dry run removed the pod")?;
    assert!(p.metadata.deletion_timestamp.is_none());

    // A pod busy again loses its warning.
    report_gpus(&client, &node, &[(&idle, Seen::Idle), (&wakes, Seen::Busy)]).await?;
    wait::poll("warning withdrawn", REACT, POLL, || {
        let client = client.clone();
        async move {
            let p = pod_now(&client, ns, "wakes").await?;
            Ok(p.filter(|p| !warned(p)).map(|_| ()))
        }
    })
    .await?;
    wait::poll("IdleWarningWithdrawn Event", REACT, POLL, || async {
        Ok(events_for(&client, ns, "wakes")
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("IdleWarningWithdrawn")))
    })
    .await?;
    assert_eq!(
        pod_now(&client, ns, "idle")
            .await?
            .and_then(|p| p.metadata.deletion_timestamp),
        None
    );
    delete_pool(&client, &pool).await?;
    Ok(())
}

#[tokio::test]
async fn a_pdb_allowing_no_disruption_blocks_the_eviction() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-pdb")?;
    let client = cluster.client().await?;
    let (node, pool, op) = setup(cluster, &scope, &client, json!({ "action": "Evict" })).await?;
    let ns = scope.namespace();
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": { "name": "guard" },
        "spec": { "maxUnavailable": 0, "selector": { "matchLabels": { "app": "guarded" } } },
    }))?;
    Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pdb)
        .await?;
    create_gpu_pod(
        &client,
        &scope,
        "guarded",
        Some(&node),
        1,
        &[],
        &[("app", "guarded")],
    )
    .await?;
    wait_running(&client, ns, "guarded").await?;
    let p = backdate_start(&client, ns, "guarded").await?;
    report_gpus(&client, &node, &[(&p, Seen::Idle)]).await?;
    let record = wait_history(&client, &pool, "blocked eviction", |r| {
        r.pod == format!("{ns}/guarded")
    })
    .await
    .with_context(|| op.log_tail())?;
    assert_eq!(record.action, "Evict");
    assert_eq!(record.result, "BlockedByPDB");
    let p = pod_now(&client, ns, "guarded").await?.context("pod gone")?;
    assert!(p.metadata.deletion_timestamp.is_none());
    // Blocks are recorded once, not per retry.
    let h = history(&client, &pool).await?;
    assert_eq!(h.len(), 1, "{h:?}");
    delete_pool(&client, &pool).await?;
    Ok(())
}

#[tokio::test]
async fn only_under_pressure_waits_until_gpu_demand_is_pending() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-pressure")?;
    let client = cluster.client().await?;
    let (node, pool, op) = setup(
        cluster,
        &scope,
        &client,
        json!({ "action": "Evict", "onlyUnderPressure": true }),
    )
    .await?;
    let ns = scope.namespace();
    create_gpu_pod(&client, &scope, "idle", Some(&node), 1, &[], &[]).await?;
    wait_running(&client, ns, "idle").await?;
    let idle = backdate_start(&client, ns, "idle").await?;
    report_gpus(&client, &node, &[(&idle, Seen::Idle)]).await?;
    wait_warned(&client, ns, "idle").await?;
    // The operator says it is waiting for demand once the deadline has passed.
    wait::poll("the reclaimer waits for demand", REACT, POLL, || async {
        let log = std::fs::read_to_string(&op.log).unwrap_or_default();
        Ok(log.contains("waiting for GPU demand").then_some(()))
    })
    .await?;
    let p = pod_now(&client, ns, "idle").await?.context("pod gone")?;
    assert!(
        p.metadata.deletion_timestamp.is_none(),
        "evicted without demand"
    );
    // A GPU pod that cannot be scheduled anywhere but the pool's nodes: demand.
    create_gpu_pod(&client, &scope, "wants-gpus", None, 16, &[], &[]).await?;
    wait_evicted(&client, ns, "idle")
        .await
        .with_context(|| op.log_tail())?;
    delete_pool(&client, &pool).await?;
    Ok(())
}

#[tokio::test]
async fn a_new_leader_finishes_the_reclaim_without_repeating_it() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "reclaim-leader")?;
    let client = cluster.client().await?;
    let ns = scope.namespace();
    let node = create_node(
        cluster,
        &scope,
        &scope.name("n"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let lease = scope.name("lease");
    let mut a = Operator::start(cluster, &scope, "replica-a", &lease)?;
    let b = Operator::start(cluster, &scope, "replica-b", &lease)?;
    let pool = scope.name("pool");
    apply_pool(
        &client,
        &scope,
        &pool,
        reclaim_spec(&scope, json!({ "action": "Evict", "gracePeriod": "8s" })),
    )
    .await?;
    wait_gpunode(&client, &node, |_| true).await?;
    let first = running_gpu_pod(&client, &scope, "first", &node, &[], &[]).await?;
    report_gpus(&client, &node, &[(&first, Seen::Idle)]).await?;
    wait_evicted(&client, ns, "first")
        .await
        .with_context(|| a.log_tail())?;

    // Whoever leads now is killed mid-grace-period of a second pod. The agent keeps beating
    // (the same idleSince each time, as an agent keeps it): the new leader acts on the report
    // only once it has seen a stamp arrive itself.
    let second = running_gpu_pod(&client, &scope, "second", &node, &[], &[]).await?;
    let idle = gpu(0, &second, Seen::Idle);
    let _beating = Heartbeat::start(&client, &node, move |s| s.gpus = vec![idle.clone()]);
    wait_warned(&client, ns, "second").await?;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), ns);
    let holder = leases
        .get(&lease)
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    let mut survivor = if holder == a.identity {
        a.kill();
        b
    } else {
        drop(b);
        a.identity.clone_from(&holder);
        a
    };
    wait_evicted(&client, ns, "second")
        .await
        .with_context(|| survivor.log_tail())?;
    let h = wait_pool(&client, &pool, "two evictions recorded", |p| {
        p.status.as_ref().is_some_and(|s| s.reclaim.reclaimed >= 2)
    })
    .await?
    .status
    .map(|s| s.reclaim.history)
    .unwrap_or_default();
    for name in ["first", "second"] {
        let n = h
            .iter()
            .filter(|r| r.pod == format!("{ns}/{name}") && r.result == "Succeeded")
            .count();
        assert_eq!(n, 1, "{name} reclaimed {n} times: {h:?}");
    }
    delete_pool(&client, &pool)
        .await
        .with_context(|| survivor.log_tail())?;
    survivor.kill();
    Ok(())
}

/// An operator restarted (a `helm upgrade`, a crash) into a cluster whose agent fell silent two
/// hours ago, its last report saying "idle for an hour": the report is two hours old, yet the
/// new operator's first sighting of it is fresh to its own clock. It neither warns, evicts nor
/// suspends on it; the pool names the node (`AgentUnconfirmed`) until a new stamp arrives, and
/// then the same report is acted on.
#[tokio::test]
async fn an_operator_restarted_into_a_long_silent_agent_acts_on_nothing_it_reported() -> Result<()>
{
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-restart")?;
    let client = cluster.client().await?;
    let (node, pool, mut op) = setup(cluster, &scope, &client, json!({})).await?;
    let ns = scope.namespace();
    let pod = running_gpu_pod(&client, &scope, "quiet", &node, &[], &[]).await?;
    report_gpus(&client, &node, &[(&pod, Seen::Busy)]).await?;
    wait_pool(&client, &pool, "Ready on the agent's report", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;
    op.kill();

    // While no operator runs, the last report the agent made before it died: idle for an hour,
    // stamped two hours ago.
    let two_hours_ago = Timestamp::now()
        .checked_sub(SignedDuration::from_hours(2))
        .unwrap_or(Timestamp::UNIX_EPOCH);
    let idle = gpu(0, &pod, Seen::Idle);
    let last = idle.clone();
    report_status(&client, &node, move |s| {
        s.gpus = vec![last];
        s.heartbeat_time = Some(Time(two_hours_ago));
    })
    .await?;
    let op = Operator::start(cluster, &scope, "restarted", &scope.name("lease"))?;
    wait_pool(&client, &pool, "the node named unconfirmed", |p| {
        problem(p, &node, "AgentUnconfirmed").is_some()
    })
    .await
    .with_context(|| op.log_tail())?;
    // Many reclaim passes (one a second, a 3 s grace period) and nothing is done.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    let now = pod_now(&client, ns, "quiet")
        .await?
        .context("the pod went on a two-hour-old report")?;
    ensure!(
        !warned(&now),
        "warned on a two-hour-old report: {:?}\n{}",
        now.annotations(),
        op.log_tail()
    );
    ensure!(
        history(&client, &pool).await?.is_empty(),
        "acted on a two-hour-old report"
    );

    // The agent comes back and beats: the report now stands and is acted on.
    let _beating = Heartbeat::start(&client, &node, move |s| s.gpus = vec![idle.clone()]);
    wait_warned(&client, ns, "quiet")
        .await
        .with_context(|| op.log_tail())?;
    wait_evicted(&client, ns, "quiet")
        .await
        .with_context(|| op.log_tail())?;
    let p = wait_pool(&client, &pool, "the node confirmed", |p| {
        problem(p, &node, "AgentUnconfirmed").is_none()
    })
    .await?;
    ensure!(
        condition(&p, "Ready").as_deref() == Some("True"),
        "not Ready after the agent came back"
    );
    delete_pool(&client, &pool).await?;
    Ok(())
}

/// Creates a one-pod Job on `node` whose pod holds one GPU and keeps running (kwok would
/// otherwise complete it), and returns its pod once it runs, started an hour ago.
async fn running_job_pod(client: &Client, scope: &TestScope, job: &str, node: &str) -> Result<Pod> {
    running_labelled_job_pod(client, scope, job, node, &[]).await
}

/// [`running_job_pod`] with more labels on the Job.
async fn running_labelled_job_pod(
    client: &Client,
    scope: &TestScope,
    job: &str,
    node: &str,
    job_labels: &[(&str, &str)],
) -> Result<Pod> {
    let (k, v) = scope.label();
    let ns = scope.namespace();
    let mut labels = serde_json::Map::new();
    labels.insert(k.to_owned(), json!(v));
    for (lk, lv) in job_labels {
        labels.insert((*lk).to_owned(), json!(lv));
    }
    let manifest: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": { "name": job, "labels": labels },
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": { "labels": { k: v, KEEP_RUNNING_LABEL: "true" } },
                "spec": {
                    "restartPolicy": "Never",
                    "nodeName": node,
                    "containers": [{
                        "name": "main",
                        "image": "registry.invalid/train:1",
                        "resources": { "limits": { "nvidia.com/gpu": "1" } },
                    }],
                    "tolerations": [{ "operator": "Exists" }],
                    "terminationGracePeriodSeconds": 0,
                },
            },
        },
    }))?;
    Api::<Job>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &manifest)
        .await
        .with_context(|| format!("creating Job {ns}/{job}"))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = format!("batch.kubernetes.io/job-name={job}");
    let pod = wait::poll(
        &format!("the pod of Job {job} Running"),
        REACT,
        POLL,
        || {
            let (pods, selector) = (pods.clone(), selector.clone());
            async move {
                let list = pods.list(&ListParams::default().labels(&selector)).await?;
                Ok(list.items.into_iter().find(|p| {
                    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                }))
            }
        },
    )
    .await?;
    backdate_start(client, ns, &pod.name_any()).await
}

async fn job_suspended(client: &Client, ns: &str, job: &str) -> Result<bool> {
    let api: Api<Job> = Api::namespaced(client.clone(), ns);
    Ok(api.get(job).await?.spec.and_then(|s| s.suspend) == Some(true))
}

#[tokio::test]
async fn an_idle_job_pod_gets_its_job_suspended_at_the_deadline() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-job")?;
    let client = cluster.client().await?;
    // Auto suspends a Job's pod; a long enough grace period to see the warning come first.
    let (node, pool, op) = setup(cluster, &scope, &client, json!({ "gracePeriod": "5s" })).await?;
    let ns = scope.namespace();
    let pod = running_job_pod(&client, &scope, "train", &node).await?;
    let pod_name = pod.name_any();
    report_gpus(&client, &node, &[(&pod, Seen::Idle)]).await?;

    // Warned first, and the Job is told too; it is not suspended before the deadline.
    let warned_pod = wait_warned(&client, ns, &pod_name)
        .await
        .with_context(|| op.log_tail())?;
    let at: Timestamp = warned_pod.annotations()[RECLAIM_AT_ANNOTATION].parse()?;
    let suspended_early = job_suspended(&client, ns, "train").await?;
    ensure(!suspended_early || Timestamp::now() >= at, || {
        format!("the Job was suspended before the announced {at}")
    })?;
    wait::poll("IdleGPU Event on the Job", REACT, POLL, || async {
        Ok(events_for(&client, ns, "train")
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("IdleGPU")))
    })
    .await?;

    // At the deadline: the Job suspended, not the pod evicted; the Job controller then
    // removes its pod.
    wait::poll("Job suspended", REACT, POLL, || async {
        Ok(job_suspended(&client, ns, "train").await?.then_some(()))
    })
    .await
    .with_context(|| op.log_tail())?;
    let record = wait_history(&client, &pool, "Suspend in history", |r| {
        r.pod == format!("{ns}/{pod_name}")
    })
    .await?;
    assert_eq!(record.action, "Suspend", "{record:?}");
    assert_eq!(record.result, "Succeeded", "{record:?}");
    assert_eq!(record.owner.as_deref(), Some("Job/train"), "{record:?}");
    assert!(
        record.time.0 >= at,
        "acted at {} before the announced {at}",
        record.time.0
    );
    wait::poll("the Job's pod removed", REACT, POLL, || async {
        Ok(pod_now(&client, ns, &pod_name)
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;

    let event = wait::poll("Reclaimed Event on the pod", REACT, POLL, || async {
        Ok(events_for(&client, ns, &pod_name)
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Reclaimed")))
    })
    .await?;
    let note = event.note.unwrap_or_default();
    assert!(note.contains("suspended Job train"), "{note}");
    let metrics = op.metrics().await?;
    let line = format!(
        "gpupool_reclaims_total{{pool=\"{pool}\",action=\"Suspend\",result=\"Succeeded\"}} 1"
    );
    assert!(
        metrics.lines().any(|l| l == line),
        "no {line:?} in\n{metrics}"
    );
    // Once: a suspended Job is not suspended again, and nothing was evicted.
    let p = wait_pool(&client, &pool, "reclaimed counted", |p| {
        p.status.as_ref().is_some_and(|s| s.reclaim.reclaimed == 1)
    })
    .await?;
    let h = p.status.map(|s| s.reclaim.history).unwrap_or_default();
    assert_eq!(h.len(), 1, "{h:?}");
    delete_pool(&client, &pool).await?;
    Ok(())
}

/// A Job that Kueue manages (label `kueue.x-k8s.io/queue-name`) is not suspended: Kueue would
/// unsuspend it. The operator deactivates its Workload instead (`spec.active: false`), which is
/// how Kueue is told to stop a Workload and keep it stopped. A Workload CRD stands in for
/// Kueue's (no Kueue controller runs: what is checked is what the operator writes).
#[tokio::test]
async fn a_kueue_job_is_stopped_through_its_workload_not_suspended() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "reclaim-kueue")?;
    let client = cluster.client().await?;
    gpupool_e2e::kueue::install_workload_crd(cluster)?;
    let (node, pool, op) = setup(cluster, &scope, &client, json!({})).await?;
    let ns = scope.namespace();
    let pod = running_labelled_job_pod(
        &client,
        &scope,
        "queued",
        &node,
        &[("kueue.x-k8s.io/queue-name", "gpu-queue")],
    )
    .await?;
    let job = Api::<Job>::namespaced(client.clone(), ns)
        .get("queued")
        .await?;
    let resource = gpupool_e2e::kueue::workload_resource();
    let workloads: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &resource);
    let workload: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {
            "name": "job-queued",
            "ownerReferences": [{
                "apiVersion": "batch/v1", "kind": "Job", "name": "queued",
                "uid": job.uid().unwrap_or_default(), "controller": true,
            }],
        },
        "spec": { "active": true, "queueName": "gpu-queue" },
    }))?;
    workloads.create(&PostParams::default(), &workload).await?;
    report_gpus(&client, &node, &[(&pod, Seen::Idle)]).await?;

    wait::poll("the Workload deactivated", REACT, POLL, || async {
        let w = workloads.get("job-queued").await?;
        Ok((w.data["spec"]["active"] == json!(false)).then_some(()))
    })
    .await
    .with_context(|| op.log_tail())?;
    ensure!(
        !job_suspended(&client, ns, "queued").await?,
        "the Job was suspended, which Kueue would undo"
    );
    let record = wait_history(&client, &pool, "the action in history", |r| {
        r.pod == format!("{ns}/{}", pod.name_any())
    })
    .await?;
    assert_eq!(
        (record.result.as_str(), record.owner.as_deref()),
        ("Succeeded", Some("Job/queued")),
        "{record:?}"
    );
    let event = wait::poll("Reclaimed Event on the pod", REACT, POLL, || async {
        Ok(events_for(&client, ns, &pod.name_any())
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Reclaimed")))
    })
    .await?;
    let note = event.note.unwrap_or_default();
    ensure!(
        note.contains("deactivated Kueue Workload job-queued"),
        "{note}"
    );
    delete_pool(&client, &pool).await?;
    Ok(())
}
