//! MIG drain coordination against the real control plane: while a node's agent reports
//! `Draining`, the operator taints the node, evicts the GPU pods on the GPUs whose layout
//! changes through the Eviction API (a PodDisruptionBudget holds a pod back until it allows
//! the eviction), leaves other pods alone (a GPU pod on a GPU that keeps its layout too),
//! records why on each pod, and reports the drain's progress in pool status. The test writes the
//! GpuNode status an agent would; kwok runs the pods.

#[path = "operator_support.rs"]
mod support;

use anyhow::{Context, Result, ensure};
use gpupool_crds::GpuPool;
use gpupool_crds::labels::MIG_RECONFIGURING_TAINT;
use gpupool_crds::node::{GpuStatus, Idleness, MigState, PodRef};
use gpupool_e2e::{Cluster, TestScope, crds, wait};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use support::*;

fn mig_pool_spec(scope: &TestScope) -> serde_json::Value {
    let (k, v) = scope.label();
    json!({
        "nodeSelector": { "matchLabels": { k: v } },
        "mig": { "strategy": "mixed", "layout": { "preset": "all-1g.10gb" } },
        "reclaim": { "mode": "Off" },
    })
}

async fn wait_event(client: &Client, ns: &str, pod: &str, reason: &str) -> Result<Event> {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    wait::poll(&format!("{reason} Event on {pod}"), REACT, POLL, || {
        let api = api.clone();
        async move {
            Ok(api
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
                }))
        }
    })
    .await
}

/// A pod without GPUs on `node`: a drain must leave it alone.
async fn cpu_pod(client: &Client, scope: &TestScope, name: &str, node: &str) -> Result<()> {
    let (k, v) = scope.label();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "labels": { k: v } },
        "spec": {
            "nodeName": node,
            "containers": [{ "name": "main", "image": "registry.invalid/sidecar:1" }],
            "tolerations": [{ "operator": "Exists" }],
            "terminationGracePeriodSeconds": 0,
        },
    }))?;
    Api::<Pod>::namespaced(client.clone(), scope.namespace())
        .create(&PostParams::default(), &pod)
        .await?;
    wait_running(client, scope.namespace(), name).await?;
    Ok(())
}

fn pods_to_drain(pool: &GpuPool) -> Option<u32> {
    pool.status.as_ref().map(|s| s.mig.pods_to_drain)
}

#[tokio::test]
async fn draining_node_loses_its_gpu_pods_through_evictions_that_respect_pdbs() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "mig-drain")?;
    let client = cluster.client().await?;
    crds::install(cluster).await?;
    let ns = scope.namespace();
    let node = create_node(
        cluster,
        &scope,
        &scope.name("n"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    // A second pool node that is not draining: its GPU pod must stay.
    let quiet = create_node(
        cluster,
        &scope,
        &scope.name("q"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let pool = scope.name("pool");
    apply_pool(&client, &scope, &pool, mig_pool_spec(&scope)).await?;
    let gn = wait_gpunode(&client, &node, |g| g.spec.mig.managed)
        .await
        .with_context(|| op.log_tail())?;
    assert!(
        !gn.spec.mig.gpus.is_empty(),
        "the preset resolved to no GPU: {:?}",
        gn.spec.mig
    );
    wait_gpunode(&client, &quiet, |g| g.spec.mig.managed).await?;
    report_status(&client, &quiet, |_| {}).await?;

    // The pods: one free to go, one held by a PDB, one without GPUs, one on the quiet node.
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": { "name": "guard" },
        "spec": { "maxUnavailable": 0, "selector": { "matchLabels": { "app": "guarded" } } },
    }))?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    pdbs.create(&PostParams::default(), &pdb).await?;
    running_gpu_pod(&client, &scope, "free", &node, &[], &[]).await?;
    running_gpu_pod(
        &client,
        &scope,
        "guarded",
        &node,
        &[],
        &[("app", "guarded")],
    )
    .await?;
    running_gpu_pod(&client, &scope, "elsewhere", &quiet, &[], &[]).await?;
    // On the draining node, but on a GPU whose layout stays.
    running_gpu_pod(&client, &scope, "kept", &node, &[], &[]).await?;
    cpu_pod(&client, &scope, "cpu-only", &node).await?;
    // Let the disruption controller see the budget first (it allows no disruption of these
    // controller-less pods either way).
    wait::poll("PDB observed", REACT, POLL, || {
        let pdbs = pdbs.clone();
        async move {
            let p = pdbs.get("guard").await?;
            Ok(p.status
                .filter(|s| s.observed_generation.is_some())
                .map(|_| ()))
        }
    })
    .await?;

    // The agent reports Draining.
    // The agent reports Draining for GPUs 0-6, and places `kept` on GPU 7 (the other pods it
    // cannot place: they may be on a changing GPU, so they go).
    let kept_on_7 = GpuStatus {
        index: 7,
        idleness: Idleness {
            pods: vec![PodRef {
                namespace: ns.into(),
                name: "kept".into(),
                container: Some("main".into()),
            }],
            ..Default::default()
        },
        ..Default::default()
    };
    report_status(&client, &node, |s| {
        s.mig.state = MigState::Draining;
        s.mig.reason = Some("WaitingForGPUPods".into());
        s.mig.gpus = (0..7).collect();
        s.gpus = vec![kept_on_7.clone()];
    })
    .await?;

    // Fenced first: the node is tainted so that the evicted pods' replacements land elsewhere;
    // the quiet node is not.
    let nodes: Api<Node> = Api::all(client.clone());
    let tainted = |n: &Node| {
        n.spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| {
                t.iter()
                    .any(|t| t.key == MIG_RECONFIGURING_TAINT && t.effect == "NoSchedule")
            })
    };
    wait::poll("the draining node tainted", REACT, POLL, || {
        let nodes = nodes.clone();
        let node = node.clone();
        async move { Ok(tainted(&nodes.get(&node).await?).then_some(())) }
    })
    .await
    .with_context(|| op.log_tail())?;
    assert!(
        !tainted(&nodes.get(&quiet).await?),
        "the quiet node was tainted"
    );
    wait_evicted(&client, ns, "free")
        .await
        .with_context(|| op.log_tail())?;
    let why = wait_event(&client, ns, "free", "EvictedForMIGChange").await?;
    let note = why.note.unwrap_or_default();
    assert!(
        note.contains(&pool) && note.contains(&node),
        "the Event should name the pool and the node: {note}"
    );
    wait_event(&client, ns, "guarded", "MIGDrainBlockedByPDB")
        .await
        .with_context(|| op.log_tail())?;
    let p = wait_pool(&client, &pool, "one pod left to drain", |p| {
        pods_to_drain(p) == Some(1)
    })
    .await
    .with_context(|| op.log_tail())?;
    let mig = p.status.map(|s| s.mig).unwrap_or_default();
    assert!(
        mig.pending >= 1,
        "the draining node counts as pending: {mig:?}"
    );
    let guarded = pod_now(&client, ns, "guarded")
        .await?
        .context("the guarded pod is gone")?;
    assert!(
        guarded.metadata.deletion_timestamp.is_none(),
        "the PDB was not respected"
    );

    // The budget lifts: the last GPU pod goes, and the count reaches zero.
    pdbs.delete("guard", &DeleteParams::default()).await?;
    wait_evicted(&client, ns, "guarded")
        .await
        .with_context(|| op.log_tail())?;
    wait_pool(&client, &pool, "nothing left to drain", |p| {
        pods_to_drain(p) == Some(0)
    })
    .await
    .with_context(|| op.log_tail())?;

    // Pods without GPUs and GPU pods on other nodes were never touched.
    for (name, what) in [
        ("cpu-only", "a pod without GPUs"),
        ("elsewhere", "a GPU pod on a node not draining"),
        ("kept", "a GPU pod on a GPU whose layout stays"),
    ] {
        let p = pod_now(&client, ns, name)
            .await?
            .with_context(|| format!("{what} was deleted"))?;
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{what} was evicted"
        );
    }

    // The agent finishes: the pool counts the node as applied.
    report_status(&client, &node, |s| {
        s.mig.state = MigState::Applied;
        s.gpus = vec![kept_on_7.clone()];
    })
    .await?;
    wait_pool(&client, &pool, "MIG applied on both nodes", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.mig.applied == 2 && s.mig.pending == 0)
    })
    .await
    .with_context(|| op.log_tail())?;
    // And the fence comes down.
    wait::poll("the taint removed once applied", REACT, POLL, || {
        let nodes = nodes.clone();
        let node = node.clone();
        async move { Ok((!tainted(&nodes.get(&node).await?)).then_some(())) }
    })
    .await
    .with_context(|| op.log_tail())?;
    delete_pool(&client, &pool).await?;
    Ok(())
}

/// The pods of a Deployment named `app` on `node`, not being deleted.
async fn app_pods_on(client: &Client, ns: &str, app: &str, node: &str) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    Ok(pods
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .collect())
}

/// A MIG change on a node whose GPU pod belongs to a Deployment: the node is fenced before the
/// eviction, so the Deployment's replacement is scheduled on another node of the pool instead
/// of back onto the node being drained (where it would be evicted again, or hold up the
/// change until the drain timeout).
#[tokio::test]
async fn a_drained_deployment_pod_comes_back_on_another_node() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "mig-redeploy")?;
    let client = cluster.client().await?;
    crds::install(cluster).await?;
    let ns = scope.namespace();
    let a = create_node(
        cluster,
        &scope,
        &scope.name("a"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let b = create_node(
        cluster,
        &scope,
        &scope.name("b"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let pool = scope.name("pool");
    apply_pool(&client, &scope, &pool, mig_pool_spec(&scope)).await?;
    for node in [&a, &b] {
        wait_gpunode(&client, node, |g| g.spec.mig.managed)
            .await
            .with_context(|| op.log_tail())?;
        report_status(&client, node, |_| {}).await?;
    }

    wait_default_service_account(&client, &scope).await?;
    // `b` is the less attractive node (most of its CPU taken), so that without the fence the
    // scheduler would put the replacement back on `a`.
    let filler: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": "filler" },
        "spec": {
            "nodeName": b,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "main",
                "image": "registry.invalid/filler:1",
                "resources": { "requests": { "cpu": "90" } },
            }],
        },
    }))?;
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &filler)
        .await?;
    wait_running(&client, ns, "filler").await?;
    // The Deployment's pod starts on `a` (b cordoned meanwhile).
    let nodes: Api<Node> = Api::all(client.clone());
    let cordon = |on: bool| json!({ "spec": { "unschedulable": on } });
    nodes
        .patch(&b, &PatchParams::default(), &Patch::Merge(&cordon(true)))
        .await?;
    let (k, v) = scope.label();
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": "train", "labels": { k: v } },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": "train" } },
            "template": {
                "metadata": { "labels": { "app": "train", k: v } },
                "spec": {
                    "nodeSelector": { k: v },
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{
                        "name": "main",
                        "image": "registry.invalid/train:1",
                        "resources": { "limits": { "nvidia.com/gpu": "1" } },
                    }],
                },
            },
        },
    }))?;
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &deployment)
        .await?;
    let first = wait::poll("the Deployment's pod running on a", REACT, POLL, || async {
        Ok(app_pods_on(&client, ns, "train", &a)
            .await?
            .into_iter()
            .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")))
    })
    .await?;
    nodes
        .patch(&b, &PatchParams::default(), &Patch::Merge(&cordon(false)))
        .await?;

    // The agent on `a` starts draining for a new layout.
    report_status(&client, &a, |s| {
        s.mig.state = MigState::Draining;
        s.mig.reason = Some("WaitingForGPUPods".into());
        s.mig.gpus = (0..8).collect();
    })
    .await?;
    wait_evicted(&client, ns, &first.name_any())
        .await
        .with_context(|| op.log_tail())?;
    wait::poll("the replacement running on b", REACT, POLL, || async {
        Ok(app_pods_on(&client, ns, "train", &b)
            .await?
            .into_iter()
            .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")))
    })
    .await
    .with_context(|| op.log_tail())?;
    ensure!(
        app_pods_on(&client, ns, "train", &a).await?.is_empty(),
        "a replacement landed back on the draining node"
    );
    report_status(&client, &a, |s| s.mig.state = MigState::Applied).await?;
    Api::<Deployment>::namespaced(client.clone(), ns)
        .delete("train", &DeleteParams::default())
        .await?;
    delete_pool(&client, &pool).await?;
    Ok(())
}
