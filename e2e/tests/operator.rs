//! The operator against the real control plane: pools become Ready from the agents' reports,
//! membership follows node labels, overlapping pools conflict, deletion cleans up, a refused
//! API call shows in the pool's status until it goes through, a standby replica takes over
//! when the leader dies, and a leader that loses its Lease stands by and leads again.

#[path = "operator_support.rs"]
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpupool_crds::labels::{DRIVER_INVALID_TAINT, POOL_LABEL};
use gpupool_crds::node::{CheckName, CheckResult, Verdict};
use gpupool_crds::{GpuNode, GpuPool};
use gpupool_e2e::{Cluster, TestScope, crds, wait};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use support::*;

const ROLE: &str = "e2e.gpupool.io/role";

fn has_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == DRIVER_INVALID_TAINT))
}

fn owner_name(gn: &GpuNode) -> Option<String> {
    gn.owner_references().first().map(|o| o.name.clone())
}

#[tokio::test]
async fn pool_becomes_ready_follows_labels_taints_and_cleans_up() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-ready")?;
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
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let pool_name = scope.name("train");
    let (k, v) = scope.label();
    apply_pool(
        &client,
        &scope,
        &pool_name,
        json!({
            "nodeSelector": { "matchLabels": { k: v, ROLE: "gpu" } },
            "driver": { "cudaVersion": "12.4", "onFailure": "Taint" },
            "mig": { "strategy": "mixed", "layout": { "preset": "all-1g.10gb" } },
        }),
    )
    .await?;

    // A GpuNode per node, owned by the pool, with the layout resolved for the H100.
    for node in [&n1, &n2] {
        let gn = wait_gpunode(&client, node, |_| true)
            .await
            .with_context(|| op.log_tail())?;
        assert_eq!(owner_name(&gn).as_deref(), Some(pool_name.as_str()));
        assert_eq!(gn.spec.pool, pool_name);
        assert_eq!(gn.spec.mig.gpus.len(), 8);
        assert_eq!(gn.spec.mig.gpus[0].profiles.get("1g.10gb"), Some(&7));
        wait_pool_label(&client, node, Some(&pool_name)).await?;
    }
    let pool = wait_pool(
        &client,
        &pool_name,
        "pool not Ready before any report",
        |p| p.status.as_ref().and_then(|s| s.nodes.as_deref()) == Some("0/2"),
    )
    .await?;
    assert_eq!(condition(&pool, "Ready").as_deref(), Some("False"));

    // The agents report: the pool becomes Ready.
    for node in [&n1, &n2] {
        report_status(&client, node, |_| {}).await?;
    }
    let pool = wait_pool(&client, &pool_name, "pool Ready", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;
    let status = pool.status.clone().unwrap_or_default();
    assert_eq!(status.nodes.as_deref(), Some("2/2"));
    assert_eq!(status.gpus.total, 16);
    assert_eq!(status.mig.summary.as_deref(), Some("all-1g.10gb 2/2"));
    assert_eq!(status.driver.as_deref(), Some("550.54.15"));
    assert_eq!(status.observed_generation, pool.metadata.generation);

    // A failed driver check: not Ready, the problem says why, and the node is tainted.
    report_status(&client, &n1, |s| {
        s.validated = Some(Verdict::False);
        s.driver_version = Some("535.104.05".into());
        s.checks = vec![CheckResult {
            name: CheckName::CudaVersion,
            passed: false,
            message: "driver 535.104.05 supports CUDA 12.2; pool requires 12.4: upgrade the driver to ≥ 550".into(),
        }];
    })
    .await?;
    let pool = wait_pool(&client, &pool_name, "pool reports the failed check", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.problems.iter().any(|pr| pr.node == n1))
    })
    .await?;
    let status = pool.status.clone().unwrap_or_default();
    assert_eq!(condition(&pool, "Ready").as_deref(), Some("False"));
    assert_eq!(condition(&pool, "DriverValid").as_deref(), Some("False"));
    assert_eq!(
        status.problems[0].message,
        "check CUDAVersion failed: driver 535.104.05 supports CUDA 12.2; pool requires 12.4: upgrade the driver to ≥ 550"
    );
    let nodes: Api<Node> = Api::all(client.clone());
    wait::poll("driver taint applied", REACT, POLL, || {
        let nodes = nodes.clone();
        let n1 = n1.clone();
        async move { Ok(has_taint(&nodes.get(&n1).await?).then_some(())) }
    })
    .await?;
    report_status(&client, &n1, |_| {}).await?;
    wait::poll("driver taint removed", REACT, POLL, || {
        let nodes = nodes.clone();
        let n1 = n1.clone();
        async move { Ok((!has_taint(&nodes.get(&n1).await?)).then_some(())) }
    })
    .await?;

    // n2 leaves the pool by label, then comes back.
    set_node_label(&client, &n2, ROLE, Some("cpu")).await?;
    wait_gpunode_gone(&client, &n2).await?;
    let pool = wait_pool(&client, &pool_name, "pool of one node", |p| {
        p.status.as_ref().and_then(|s| s.nodes.as_deref()) == Some("1/1")
    })
    .await?;
    assert_eq!(condition(&pool, "Ready").as_deref(), Some("True"));
    wait_pool_label(&client, &n2, None).await?;
    set_node_label(&client, &n2, ROLE, Some("gpu")).await?;
    wait_gpunode(&client, &n2, |_| true).await?;
    wait_pool(&client, &pool_name, "n2 back in the pool", |p| {
        p.status.as_ref().and_then(|s| s.nodes.as_deref()) == Some("1/2")
    })
    .await?;

    // Deletion removes the GpuNodes and labels, then the pool goes.
    delete_pool(&client, &pool_name)
        .await
        .with_context(|| op.log_tail())?;
    for node in [&n1, &n2] {
        wait_gpunode_gone(&client, node).await?;
        wait_pool_label(&client, node, None).await?;
        assert!(!has_taint(&nodes.get(node).await?));
    }
    Ok(())
}

#[tokio::test]
async fn overlapping_pools_conflict_and_the_older_keeps_the_nodes() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-conflict")?;
    let client = cluster.client().await?;
    let a = create_node(
        cluster,
        &scope,
        &scope.name("a"),
        "NVIDIA-A100-SXM4-80GB",
        &[(ROLE, "x")],
    )?;
    let b = create_node(
        cluster,
        &scope,
        &scope.name("b"),
        "NVIDIA-A100-SXM4-80GB",
        &[(ROLE, "y")],
    )?;
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let (k, v) = scope.label();
    // Named so that they sort by age even if created within the same second.
    let old = scope.name("p1-old");
    let young = scope.name("p2-young");
    apply_pool(
        &client,
        &scope,
        &old,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    for node in [&a, &b] {
        wait_gpunode(&client, node, |g| {
            owner_name(g).as_deref() == Some(old.as_str())
        })
        .await
        .with_context(|| op.log_tail())?;
    }
    apply_pool(
        &client,
        &scope,
        &young,
        json!({ "nodeSelector": { "matchLabels": { k: v, ROLE: "y" } } }),
    )
    .await?;
    let pool = wait_pool(&client, &young, "young pool Conflict", |p| {
        condition(p, "Conflict").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;
    let conflict = pool
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Conflict"))
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        conflict.contains(&old) && conflict.contains(&b),
        "{conflict}"
    );
    assert_eq!(condition(&pool, "Ready").as_deref(), Some("False"));
    // The pool that keeps the node says so too.
    let holder = wait_pool(&client, &old, "old pool reports the overlap", |p| {
        condition(p, "Conflict").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;
    let held = holder
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Conflict"))
        .map(|c| (c.reason.clone(), c.message.clone()))
        .unwrap_or_default();
    assert_eq!(held.0, "OtherPoolsMatchNodesHere", "{held:?}");
    assert!(held.1.contains(&young) && held.1.contains(&b), "{held:?}");
    let gn_b: Api<GpuNode> = Api::all(client.clone());
    assert_eq!(
        owner_name(&gn_b.get(&b).await?).as_deref(),
        Some(old.as_str())
    );
    wait_pool_label(&client, &b, Some(&old)).await?;

    // The old pool goes: the young one takes node b, and the conflict clears.
    delete_pool(&client, &old).await?;
    wait_gpunode(&client, &b, |g| {
        owner_name(g).as_deref() == Some(young.as_str())
    })
    .await?;
    wait_pool(&client, &young, "conflict cleared", |p| {
        condition(p, "Conflict").as_deref() == Some("False")
    })
    .await?;
    wait_gpunode_gone(&client, &a).await?;
    delete_pool(&client, &young).await?;
    wait_gpunode_gone(&client, &b).await?;
    Ok(())
}

/// An older pool whose selector widens over a node a younger pool holds does not take it (no
/// new layout, no drain of running jobs): the holder keeps it and both pools report the overlap.
#[tokio::test]
async fn a_widened_older_selector_does_not_take_a_held_node() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-widen")?;
    let client = cluster.client().await?;
    let a = create_node(
        cluster,
        &scope,
        &scope.name("a"),
        "NVIDIA-A100-SXM4-80GB",
        &[(ROLE, "x")],
    )?;
    let b = create_node(
        cluster,
        &scope,
        &scope.name("b"),
        "NVIDIA-A100-SXM4-80GB",
        &[(ROLE, "y")],
    )?;
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let (k, v) = scope.label();
    let old = scope.name("p1-old");
    let young = scope.name("p2-young");
    apply_pool(
        &client,
        &scope,
        &old,
        json!({ "nodeSelector": { "matchLabels": { k: v, ROLE: "x" } } }),
    )
    .await?;
    wait_gpunode(&client, &a, |g| {
        owner_name(g).as_deref() == Some(old.as_str())
    })
    .await
    .with_context(|| op.log_tail())?;
    apply_pool(
        &client,
        &scope,
        &young,
        json!({ "nodeSelector": { "matchLabels": { k: v, ROLE: "y" } } }),
    )
    .await?;
    wait_gpunode(&client, &b, |g| {
        owner_name(g).as_deref() == Some(young.as_str())
    })
    .await
    .with_context(|| op.log_tail())?;
    wait_pool_label(&client, &b, Some(&young)).await?;

    // The older pool widens over both nodes.
    apply_pool(
        &client,
        &scope,
        &old,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    let reason = |p: &GpuPool| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Conflict"))
            .filter(|c| c.status == "True")
            .map(|c| c.reason.clone())
    };
    wait_pool(
        &client,
        &old,
        "the widened pool reports b held elsewhere",
        |p| reason(p).as_deref() == Some("NodesHeldByOtherPools"),
    )
    .await
    .with_context(|| op.log_tail())?;
    wait_pool(&client, &young, "the holder reports the overlap", |p| {
        reason(p).as_deref() == Some("OtherPoolsMatchNodesHere")
    })
    .await
    .with_context(|| op.log_tail())?;
    // Several reconciles later b is still the younger pool's.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let gn: Api<GpuNode> = Api::all(client.clone());
    assert_eq!(
        owner_name(&gn.get(&b).await?).as_deref(),
        Some(young.as_str())
    );
    assert_eq!(
        node_labels(&client, &b)
            .await?
            .get(POOL_LABEL)
            .map(String::as_str),
        Some(young.as_str())
    );
    delete_pool(&client, &young).await?;
    // Released, b goes to the pool that matches it.
    wait_gpunode(&client, &b, |g| {
        owner_name(g).as_deref() == Some(old.as_str())
    })
    .await
    .with_context(|| op.log_tail())?;
    delete_pool(&client, &old).await?;
    wait_gpunode_gone(&client, &a).await?;
    wait_gpunode_gone(&client, &b).await?;
    Ok(())
}

async fn lease_holder(client: &kube::Client, ns: &str, name: &str) -> Result<Option<String>> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    Ok(leases
        .get_opt(name)
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity))
}

/// Waits until `name` has a holder, `want` when given; the holder.
async fn wait_lease_holder(
    client: &kube::Client,
    ns: &str,
    name: &str,
    want: Option<&str>,
) -> Result<String> {
    let what = want.map_or_else(|| "a leader".to_owned(), |w| format!("{w} leading"));
    wait::poll(&what, REACT, POLL, || async {
        Ok(lease_holder(client, ns, name)
            .await?
            .filter(|h| want.is_none_or(|w| h == w)))
    })
    .await
}

#[tokio::test]
async fn a_standby_replica_takes_over_when_the_leader_dies() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-leader")?;
    let client = cluster.client().await?;
    let n = create_node(
        cluster,
        &scope,
        &scope.name("n"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let lease = scope.name("lease");
    let mut a = Operator::start(cluster, &scope, "replica-a", &lease)?;
    let leader = wait_lease_holder(&client, scope.namespace(), &lease, None)
        .await
        .with_context(|| a.log_tail())?;
    assert_eq!(leader, "replica-a");
    let b = Operator::start(cluster, &scope, "replica-b", &lease)?;
    let (k, v) = scope.label();
    let first = scope.name("first");
    apply_pool(
        &client,
        &scope,
        &first,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    wait_gpunode(&client, &n, |_| true).await?;

    // Kill the leader without letting it release the Lease.
    a.kill();
    let killed = Instant::now();
    let second = scope.name("second");
    apply_pool(
        &client,
        &scope,
        &second,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    let pool: GpuPool = wait::poll(
        "the standby handles a new pool",
        Duration::from_secs(15),
        POLL,
        || {
            let api: Api<GpuPool> = Api::all(client.clone());
            let second = second.clone();
            async move {
                let p = api.get(&second).await?;
                Ok(p.status.is_some().then_some(p))
            }
        },
    )
    .await
    .with_context(|| b.log_tail())?;
    eprintln!("standby took over in {:?}", killed.elapsed());
    assert_eq!(
        lease_holder(&client, scope.namespace(), &lease)
            .await?
            .as_deref(),
        Some("replica-b")
    );
    // The second pool matches the same node, which the first (older) pool keeps.
    assert_eq!(condition(&pool, "Conflict").as_deref(), Some("True"));
    delete_pool(&client, &second).await?;
    delete_pool(&client, &first)
        .await
        .with_context(|| b.log_tail())?;
    wait_gpunode_gone(&client, &n).await?;
    Ok(())
}

#[tokio::test]
async fn a_leader_that_loses_its_lease_stands_by_and_leads_again() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-relead")?;
    let client = cluster.client().await?;
    let lease = scope.name("lease");
    let mut a = Operator::start(cluster, &scope, "replica-a", &lease)?;
    let ns = scope.namespace();
    let leader = wait_lease_holder(&client, ns, &lease, None)
        .await
        .with_context(|| a.log_tail())?;
    assert_eq!(leader, "replica-a");

    // Another identity takes the Lease, as a standby does when a renewal comes too late.
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(Timestamp::now());
    leases
        .patch(
            &lease,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": {
                "holderIdentity": "intruder",
                "acquireTime": now,
                "renewTime": now,
                "leaseDurationSeconds": 12,
            } })),
        )
        .await?;
    wait::poll("replica-a stands by", REACT, POLL, || {
        let standing_by = a.logged("standing by");
        async move { Ok(standing_by.then_some(())) }
    })
    .await
    .with_context(|| a.log_tail())?;
    assert!(
        a.is_running(),
        "exited on losing the Lease:\n{}",
        a.log_tail()
    );
    let metrics = a.metrics().await?;
    assert!(
        metrics.lines().any(|l| l == "gpupool_leader 0"),
        "a replica standing by says it leads:\n{metrics}"
    );

    // The intruder never renews: once its Lease expires, replica-a leads again and reconciles.
    let (k, v) = scope.label();
    let pool = scope.name("pool");
    apply_pool(
        &client,
        &scope,
        &pool,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    let leader = wait_lease_holder(&client, ns, &lease, Some("replica-a"))
        .await
        .with_context(|| a.log_tail())?;
    assert_eq!(leader, "replica-a");
    wait_pool(&client, &pool, "a status from the new term", |p| {
        p.status.is_some()
    })
    .await
    .with_context(|| a.log_tail())?;
    let metrics = a.metrics().await?;
    assert!(
        metrics.lines().any(|l| l == "gpupool_leader 1"),
        "leading again but not saying so:\n{metrics}"
    );
    delete_pool(&client, &pool)
        .await
        .with_context(|| a.log_tail())?;
    Ok(())
}

/// A ValidatingAdmissionPolicy, and its binding, refusing with 403 the pool label on one
/// node: the API server answers the operator's label patch as it would a ClusterRole without
/// `patch` on nodes. Returns the binding's name.
fn refuse_pool_label(cluster: &Cluster, scope: &TestScope, node: &str) -> Result<String> {
    let policy = scope.name("no-pool-label");
    let binding = scope.name("no-pool-label");
    let (k, v) = scope.label();
    scope.track_kind("validatingadmissionpolicies.admissionregistration.k8s.io");
    scope.track_kind("validatingadmissionpolicybindings.admissionregistration.k8s.io");
    let manifest = json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": { "name": policy, "labels": { k: v } },
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": { "resourceRules": [{
                        "apiGroups": [""], "apiVersions": ["v1"],
                        "operations": ["UPDATE"], "resources": ["nodes"],
                    }] },
                    "matchConditions": [{
                        "name": "this-node",
                        "expression": format!("object.metadata.name == '{node}'"),
                    }],
                    "validations": [{
                        "expression": format!(
                            "!has(object.metadata.labels) || !('{POOL_LABEL}' in object.metadata.labels)"
                        ),
                        "reason": "Forbidden",
                        "message": "e2e: no pool label on this node",
                    }],
                },
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": { "name": binding, "labels": { k: v } },
                "spec": { "policyName": policy, "validationActions": ["Deny"] },
            },
        ],
    });
    cluster
        .kubectl()
        .run_with_stdin(["create", "-f", "-"], Some(&manifest.to_string()))?;
    Ok(binding)
}

/// The Events about a cluster-scoped object (kube's recorder files them in `default`).
async fn cluster_events(client: &kube::Client, name: &str) -> Result<Vec<Event>> {
    let api: Api<Event> = Api::namespaced(client.clone(), "default");
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect())
}

/// Waits until a dry-run pool label on `node` is refused with 403 (`refused`) or goes through.
async fn wait_policy_in_force(nodes: &Api<Node>, node: &str, refused: bool) -> Result<()> {
    let what = if refused {
        "the admission policy in force"
    } else {
        "the admission policy lifted"
    };
    wait::poll(what, REACT, POLL, || {
        let nodes = nodes.clone();
        async move {
            let dry = PatchParams {
                dry_run: true,
                ..Default::default()
            };
            let patch = json!({ "metadata": { "labels": { POOL_LABEL: "x" } } });
            let now_refused = match nodes.patch(node, &dry, &Patch::Merge(&patch)).await {
                Err(kube::Error::Api(s)) if s.code == 403 => true,
                Ok(_) => false,
                // Anything else (a conflict, a timeout) says nothing about the policy: ask again.
                Err(_) => return Ok(None),
            };
            Ok((now_refused == refused).then_some(()))
        }
    })
    .await
}

fn api_errors(pool: &GpuPool) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    pool.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "APIErrors")
        .cloned()
}

#[tokio::test]
async fn a_refused_node_patch_shows_in_the_pool_status_until_it_goes_through() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-refused")?;
    let client = cluster.client().await?;
    let node = create_node(
        cluster,
        &scope,
        &scope.name("n1"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let binding = refuse_pool_label(cluster, &scope, &node)?;
    // Policies take effect a moment after they are created: wait until a dry run is refused.
    let nodes: Api<Node> = Api::all(client.clone());
    wait_policy_in_force(&nodes, &node, true).await?;

    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let pool_name = scope.name("train");
    let (k, v) = scope.label();
    apply_pool(
        &client,
        &scope,
        &pool_name,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;

    // The status names the refused call and what to check; the pool is not Ready.
    let pool = wait_pool(&client, &pool_name, "APIErrors True", |p| {
        api_errors(p).is_some_and(|c| c.status == "True")
    })
    .await
    .with_context(|| op.log_tail())?;
    let c = api_errors(&pool).context("no APIErrors condition")?;
    eprintln!("operator e2e: APIErrors {}: {}", c.reason, c.message);
    assert_eq!(c.reason, "Forbidden", "{c:?}");
    for part in [
        "the operator cannot patch nodes: forbidden",
        "check the chart's ClusterRole",
        &format!("labelling/tainting node {node}"),
        "e2e: no pool label on this node",
    ] {
        assert!(c.message.contains(part), "{part:?} not in {}", c.message);
    }
    let ready = pool
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .context("no Ready condition")?;
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "APIErrors")
    );
    // The GpuNode was still written: a refused call does not stop the rest.
    wait_gpunode(&client, &node, |_| true).await?;
    let warning = wait::poll("APIErrorsTrue Event on the pool", REACT, POLL, || async {
        Ok(cluster_events(&client, &pool_name)
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("APIErrorsTrue")))
    })
    .await?;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));

    // Lift the refusal: the label goes on and the condition clears, with an Event. The
    // operator retries with a growing backoff; a touch of the pool brings the retry forward.
    cluster.kubectl().run([
        "delete",
        "validatingadmissionpolicybinding",
        &binding,
        "--wait=true",
    ])?;
    // Lifting takes a moment too. A nudge that still meets the refusal would be one more
    // failure, and by now the operator's backoff may be minutes (each failure doubles it): the
    // nudge goes in once a dry run passes.
    wait_policy_in_force(&nodes, &node, false).await?;
    let pools: Api<GpuPool> = Api::all(client.clone());
    pools
        .patch(
            &pool_name,
            &PatchParams::default(),
            &Patch::Merge(
                &json!({ "metadata": { "annotations": { "e2e.gpupool.io/nudge": "1" } } }),
            ),
        )
        .await?;
    wait_pool_label(&client, &node, Some(&pool_name))
        .await
        .with_context(|| op.log_tail())?;
    let pool = wait_pool(&client, &pool_name, "APIErrors False", |p| {
        api_errors(p).is_some_and(|c| c.status == "False")
    })
    .await
    .with_context(|| op.log_tail())?;
    assert_eq!(
        api_errors(&pool).map(|c| c.reason).as_deref(),
        Some("NoErrors")
    );
    let cleared = wait::poll("APIErrorsFalse Event on the pool", REACT, POLL, || async {
        Ok(cluster_events(&client, &pool_name)
            .await?
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("APIErrorsFalse")))
    })
    .await?;
    assert_eq!(cleared.type_.as_deref(), Some("Normal"));
    delete_pool(&client, &pool_name).await?;
    Ok(())
}

/// A node that goes dark (powered off, cut off): its kubelet stops reporting and the Node turns
/// NotReady. The pool is no longer Ready, names the node `NodeNotReady`, and no longer counts
/// its GPUs healthy, whatever the agent's last report said; once the Node is Ready again, so is
/// the pool. (kwok stops managing the node, so its status stays as the test sets it.)
#[tokio::test]
async fn a_node_gone_dark_is_not_ready_and_its_gpus_not_healthy() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-dark")?;
    let client = cluster.client().await?;
    let n = create_node(
        cluster,
        &scope,
        &scope.name("n"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let (k, v) = scope.label();
    let pool = scope.name("pool");
    apply_pool(
        &client,
        &scope,
        &pool,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;
    wait_gpunode(&client, &n, |_| true)
        .await
        .with_context(|| op.log_tail())?;
    report_status(&client, &n, |_| {}).await?;
    wait_pool(&client, &pool, "Ready", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;

    // kwok lets go of the node; then its Ready condition goes False, as the node lifecycle
    // controller sets it when a kubelet stops reporting.
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            &n,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"kwok.x-k8s.io/node": null}}})),
        )
        .await?;
    let ready = |status: &str| {
        json!({"status": {"conditions": [{
            "type": "Ready", "status": status, "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status.",
            "lastHeartbeatTime": Timestamp::now().to_string(),
            "lastTransitionTime": Timestamp::now().to_string(),
        }]}})
    };
    nodes
        .patch_status(
            &n,
            &PatchParams::default(),
            &Patch::Strategic(&ready("Unknown")),
        )
        .await?;
    let dark = wait_pool(&client, &pool, "the dark node named", |p| {
        problem(p, &n, "NodeNotReady").is_some()
    })
    .await
    .with_context(|| op.log_tail())?;
    let st = dark.status.clone().unwrap_or_default();
    assert_eq!(condition(&dark, "Ready").as_deref(), Some("False"));
    assert_eq!((st.gpus.total, st.gpus.healthy), (8, 0), "{:?}", st.gpus);
    assert_eq!(st.nodes.as_deref(), Some("0/1"));

    // Back: Ready again.
    nodes
        .patch_status(
            &n,
            &PatchParams::default(),
            &Patch::Strategic(&ready("True")),
        )
        .await?;
    wait_pool(&client, &pool, "Ready again", |p| {
        condition(p, "Ready").as_deref() == Some("True")
            && p.status.as_ref().is_some_and(|s| s.gpus.healthy == 8)
    })
    .await
    .with_context(|| op.log_tail())?;
    delete_pool(&client, &pool).await?;
    Ok(())
}

/// A MIG layout that fails on the first node of a three-node pool, one node at a time
/// (`mig.maxUnavailable: 1`): the failed node keeps its turn, so the other two keep their
/// layout and are never drained for it; the pool says why.
#[tokio::test]
async fn a_mig_layout_that_fails_on_its_first_node_goes_no_further() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "op-rollout")?;
    let client = cluster.client().await?;
    let mut nodes = Vec::new();
    for n in ["n1", "n2", "n3"] {
        nodes.push(create_node(
            cluster,
            &scope,
            &scope.name(n),
            "NVIDIA-H100-80GB-HBM3",
            &[(ROLE, "gpu")],
        )?);
    }
    nodes.sort();
    let op = Operator::start(cluster, &scope, "only", &scope.name("lease"))?;
    let pool_name = scope.name("train");
    let (k, v) = scope.label();
    let spec = |preset: &str| {
        json!({
            "nodeSelector": { "matchLabels": { k: v, ROLE: "gpu" } },
            "mig": { "strategy": "mixed", "layout": { "preset": preset }, "maxUnavailable": 1 },
        })
    };
    apply_pool(&client, &scope, &pool_name, spec("all-balanced")).await?;
    for node in &nodes {
        wait_gpunode(&client, node, |_| true)
            .await
            .with_context(|| op.log_tail())?;
        report_status(&client, node, |_| {}).await?;
    }
    wait_pool(&client, &pool_name, "Ready on all-balanced", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await
    .with_context(|| op.log_tail())?;

    let sliced = |gn: &GpuNode| {
        gn.spec
            .mig
            .gpus
            .first()
            .is_some_and(|g| g.profiles.get("1g.10gb") == Some(&7))
    };
    apply_pool(&client, &scope, &pool_name, spec("all-1g.10gb")).await?;
    let first = wait_gpunode(&client, &nodes[0], sliced)
        .await
        .with_context(|| op.log_tail())?;
    // Its agent fails to apply it, for the generation it was handed.
    report_status(&client, &nodes[0], |s| {
        s.mig.state = gpupool_crds::node::MigState::Failed;
        s.mig.reason = Some("ApplyFailed".into());
        s.mig.message =
            Some("creating GPU instance 1g.10gb on GPU 0: insufficient resources".into());
        s.mig.observed_generation = first.metadata.generation;
    })
    .await?;
    wait_pool(&client, &pool_name, "the others wait", |p| {
        nodes[1..]
            .iter()
            .all(|n| problem(p, n, "MIGRolloutWaiting").is_some())
            && p.status.as_ref().is_some_and(|s| s.mig.failed == 1)
    })
    .await
    .with_context(|| op.log_tail())?;
    // Many reconciles later, neither has been handed the failing layout.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    for node in &nodes[1..] {
        let gn = gpunodes.get(node).await?;
        ensure(!sliced(&gn), || {
            format!("{node} was handed the failing layout:\n{}", op.log_tail())
        })?;
    }
    delete_pool(&client, &pool_name).await?;
    Ok(())
}
