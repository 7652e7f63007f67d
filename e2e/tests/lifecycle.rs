//! What the chart's hooks run, against the real control plane: `gpupool-operator uninstall`
//! (pre-delete) leaves no pool on its finalizer and nothing of gpupool's on a node, with the
//! operator running and without it; `gpupool-operator apply-pool` (post-install/post-upgrade)
//! changes the default pool in place, keeping its uid and status.

#[path = "operator_support.rs"]
mod support;

use std::process::Command;

use anyhow::{Context, Result, ensure};
use gpupool_crds::labels::{DRIVER_INVALID_TAINT, POOL_FINALIZER, POOL_LABEL};
use gpupool_crds::node::{CheckName, CheckResult, Verdict};
use gpupool_crds::{GpuNode, GpuPool};
use gpupool_e2e::{Cluster, TestScope, crds, wait};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, ResourceExt};
use serde_json::json;
use support::*;

const ROLE: &str = "e2e.gpupool.io/role";

/// Runs `gpupool-operator <args>` to completion; returns its output, failing on a non-zero exit.
fn operator_command(cluster: &Cluster, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let out = Command::new(operator_binary()?)
        .args(args)
        .envs(env.iter().copied())
        .env("KUBECONFIG", cluster.kubeconfig())
        .output()
        .context("running gpupool-operator")?;
    let text: String = String::from_utf8_lossy(&out.stdout)
        .lines()
        .chain(String::from_utf8_lossy(&out.stderr).lines())
        .map(|l| strip_ansi(l) + "\n")
        .collect();
    ensure!(
        out.status.success(),
        "gpupool-operator {args:?}: {}\n{text}",
        out.status
    );
    Ok(text)
}

fn marked(node: &Node) -> Vec<String> {
    let mut found: Vec<String> = node
        .labels()
        .keys()
        .filter(|k| k.starts_with("gpupool.io/"))
        .cloned()
        .collect();
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == DRIVER_INVALID_TAINT));
    if tainted {
        found.push(format!("taint {DRIVER_INVALID_TAINT}"));
    }
    found
}

fn pool_spec(scope: &TestScope) -> serde_json::Value {
    let (k, v) = scope.label();
    json!({
        "nodeSelector": { "matchLabels": { k: v, ROLE: "gpu" } },
        "driver": { "onFailure": "Taint" },
    })
}

#[tokio::test]
async fn uninstall_leaves_no_finalizer_label_or_taint_with_or_without_the_operator() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "uninstall")?;
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
        &[(ROLE, "gpu")],
    )?;
    let nodes: Api<Node> = Api::all(client.clone());
    let pools: Api<GpuPool> = Api::all(client.clone());
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let selector = scope.selector();

    // 1. With the operator running: the pools go through its cleanup.
    let mut op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let pool = scope.name("train");
    apply_pool(&client, &scope, &pool, pool_spec(&scope)).await?;
    for node in [&n1, &n2] {
        wait_gpunode(&client, node, |_| true)
            .await
            .with_context(|| op.log_tail())?;
        wait_pool_label(&client, node, Some(&pool)).await?;
        report_status(&client, node, |_| {}).await?;
    }
    // n1 fails validation: the operator taints it.
    report_status(&client, &n1, |s| {
        s.validated = Some(Verdict::False);
        s.checks = vec![CheckResult {
            name: CheckName::DriverVersion,
            passed: false,
            message: "driver too old".into(),
        }];
    })
    .await?;
    wait::poll("n1 tainted", REACT, POLL, || async {
        let n = nodes.get(&n1).await?;
        Ok(marked(&n)
            .iter()
            .any(|m| m.starts_with("taint"))
            .then_some(()))
    })
    .await
    .with_context(|| op.log_tail())?;
    // An agent's label on n2 with no agent to take it off: uninstall must.
    set_node_label(&client, &n2, "gpupool.io/gpu.count", Some("8")).await?;

    let out = operator_command(
        cluster,
        &[
            "--pool-selector",
            &selector,
            "uninstall",
            "--timeout-secs",
            "10",
        ],
        &[],
    )?;
    ensure!(
        pools.get_opt(&pool).await?.is_none(),
        "pool {pool} left:\n{out}"
    );
    for node in [&n1, &n2] {
        ensure!(
            gpunodes.get_opt(node).await?.is_none(),
            "GpuNode {node} left:\n{out}"
        );
        let n = nodes.get(node).await?;
        ensure!(
            marked(&n).is_empty(),
            "{node} keeps {:?}:\n{out}",
            marked(&n)
        );
        ensure!(
            n.labels().get("nvidia.com/gpu.present").map(String::as_str) == Some("true"),
            "{node}: a label not gpupool's was taken off"
        );
    }
    // The operator released the pool itself; uninstall only took the agent's label off.
    ensure!(
        out.contains("finalizers_released: []")
            && out.contains("nodes_cleaned: [\"")
            && out.contains(&n2),
        "unexpected report:\n{out}"
    );

    // 2. Without the operator (crashed, or removed first): uninstall does the cleanup.
    let pool = scope.name("orphan");
    apply_pool(&client, &scope, &pool, pool_spec(&scope)).await?;
    for node in [&n1, &n2] {
        wait_gpunode(&client, node, |_| true)
            .await
            .with_context(|| op.log_tail())?;
        wait_pool_label(&client, node, Some(&pool)).await?;
    }
    let held = pools.get(&pool).await?;
    ensure!(
        held.finalizers().iter().any(|f| f == POOL_FINALIZER),
        "no finalizer on {pool}"
    );
    op.kill();
    let out = operator_command(
        cluster,
        &[
            "--pool-selector",
            &selector,
            "uninstall",
            "--timeout-secs",
            "3",
        ],
        &[],
    )?;
    ensure!(
        pools.get_opt(&pool).await?.is_none(),
        "pool {pool} stuck:\n{out}"
    );
    for node in [&n1, &n2] {
        ensure!(
            gpunodes.get_opt(node).await?.is_none(),
            "GpuNode {node} left:\n{out}"
        );
        let n = nodes.get(node).await?;
        ensure!(
            marked(&n).is_empty() && !n.labels().contains_key(POOL_LABEL),
            "{node} keeps {:?}:\n{out}",
            marked(&n)
        );
    }
    ensure!(out.contains("did not clean the pool up"), "{out}");
    Ok(())
}

#[tokio::test]
async fn apply_pool_changes_the_default_pool_in_place() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "default-pool")?;
    let client = cluster.client().await?;
    let n1 = create_node(
        cluster,
        &scope,
        &scope.name("n1"),
        "NVIDIA-H100-80GB-HBM3",
        &[(ROLE, "gpu")],
    )?;
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    scope.track_kind("gpupools.gpupool.io");
    let name = scope.name("default");
    let (k, v) = scope.label();
    let object = |min: &str| {
        json!({
            "metadata": { "name": name, "labels": { k: v } },
            "spec": {
                "nodeSelector": { "matchLabels": { k: v, ROLE: "gpu" } },
                "driver": { "minVersion": min },
            },
        })
        .to_string()
    };
    // The chart passes the pool in the environment.
    operator_command(
        cluster,
        &["apply-pool"],
        &[("GPUPOOL_POOL_JSON", &object("535"))],
    )?;
    wait_gpunode(&client, &n1, |_| true)
        .await
        .with_context(|| op.log_tail())?;
    report_status(&client, &n1, |_| {}).await?;
    let before = wait_pool(&client, &name, "pool Ready", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;

    // An upgrade with another spec: the same object, its status kept, the new spec in force.
    operator_command(cluster, &["apply-pool", "--pool-json", &object("550")], &[])?;
    let after: GpuPool = Api::all(client.clone()).get(&name).await?;
    ensure!(after.uid() == before.uid(), "the pool was created again");
    ensure!(
        after.spec.driver.min_version.as_deref() == Some("550"),
        "spec not updated: {:?}",
        after.spec.driver
    );
    ensure!(
        after.metadata.generation > before.metadata.generation,
        "generation did not move"
    );
    ensure!(
        after
            .status
            .as_ref()
            .is_some_and(|s| !s.conditions.is_empty()),
        "status lost: {:?}",
        after.status
    );
    let gn: GpuNode = Api::all(client.clone()).get(&n1).await?;
    ensure!(
        gn.status.as_ref().and_then(|s| s.validated) == Some(Verdict::True),
        "the GpuNode's report was lost"
    );
    // Bad input: a clear error, nothing applied.
    let bad = Command::new(operator_binary()?)
        .args(["apply-pool", "--pool-json", "{\"spec\": {}}"])
        .env("KUBECONFIG", cluster.kubeconfig())
        .output()?;
    ensure!(!bad.status.success());
    let text = String::from_utf8_lossy(&bad.stderr);
    ensure!(text.contains("metadata.name"), "{text}");
    delete_pool(&client, &name).await?;
    Ok(())
}
