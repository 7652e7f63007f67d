//! Helpers shared by the operator and reclaim e2e tests (included with `#[path]`): running the
//! built operator binary against the test cluster, the test's own kwok GPU nodes, GpuNode
//! statuses written as the node agent would, and polling.
//!
//! Each test runs its own operator, restricted with `--pool-selector` to the test's pools, so
//! tests running in parallel on one cluster never act on each other's objects.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use gpupool_crds::node::GpuNodeStatus;
use gpupool_crds::testing::healthy_status;
use gpupool_crds::{GpuNode, GpuPool};
use gpupool_e2e::{Cluster, TestScope, repo_root, wait};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Polling interval for conditions the tests wait on.
pub const POLL: Duration = Duration::from_millis(250);
/// Deadline for the operator to react to a change.
pub const REACT: Duration = Duration::from_secs(60);

pub use gpupool_e2e::artifacts::operator_binary;

/// A running operator process; killed on drop.
pub struct Operator {
    child: Child,
    /// Its `--identity`.
    pub identity: String,
    /// Its log file.
    pub log: PathBuf,
}

impl Operator {
    /// Starts an operator managing the scope's pools, leader-elected on `lease`.
    pub fn start(
        cluster: &Cluster,
        scope: &TestScope,
        identity: &str,
        lease: &str,
    ) -> Result<Self> {
        Self::start_with(cluster, scope, identity, lease, &[])
    }

    /// [`Operator::start`] with more flags.
    pub fn start_with(
        cluster: &Cluster,
        scope: &TestScope,
        identity: &str,
        lease: &str,
        extra: &[&str],
    ) -> Result<Self> {
        let bin = operator_binary()?;
        let log = repo_root()
            .join("target/e2e-tests")
            .join(format!("operator-{}-{identity}.log", scope.prefix()));
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let out = std::fs::File::create(&log)?;
        let err = out.try_clone()?;
        let child = Command::new(bin)
            .args([
                "--http-addr",
                "127.0.0.1:0",
                "--pool-selector",
                &scope.selector(),
                "--lease-name",
                lease,
                "--lease-namespace",
                scope.namespace(),
                "--identity",
                identity,
                "--lease-duration",
                "6",
                "--lease-grace",
                "2",
                "--reclaim-interval",
                "1",
                "--log",
                "info,gpupool_operator=debug",
            ])
            .args(extra)
            .env("KUBECONFIG", cluster.kubeconfig())
            // An error it exits with then ends its log, where `log_tail` shows it, instead
            // of a backtrace longer than the tail.
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .context("starting gpupool-operator")?;
        Ok(Self {
            child,
            identity: identity.to_owned(),
            log,
        })
    }

    /// Whether the process still runs (it has not exited on its own).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the process at once (SIGKILL): a crashed leader.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The address it serves `/metrics` on, from its log (it listens on a free port).
    pub fn metrics_addr(&self) -> Result<String> {
        let text = std::fs::read_to_string(&self.log)
            .with_context(|| format!("reading {}", self.log.display()))?;
        let line = text
            .lines()
            .map(strip_ansi)
            .find(|l| l.contains("serving /metrics"))
            .with_context(|| {
                format!(
                    "the operator has not logged its address yet:\n{}",
                    self.log_tail()
                )
            })?;
        Ok(line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .with_context(|| format!("no addr= in {line:?}"))?
            .to_owned())
    }

    /// Its `/metrics` text.
    pub async fn metrics(&self) -> Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.metrics_addr()?;
        let mut stream = tokio::net::TcpStream::connect(&addr)
            .await
            .with_context(|| format!("connecting to the operator at {addr}"))?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n")
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .with_context(|| format!("not an HTTP response: {response:?}"))?;
        ensure(head.starts_with("HTTP/1.1 200"), || {
            format!("GET /metrics: {head}")
        })?;
        Ok(body.to_owned())
    }

    /// Whether its log has a line containing `needle` so far.
    pub fn logged(&self, needle: &str) -> bool {
        std::fs::read_to_string(&self.log).is_ok_and(|t| t.lines().any(|l| l.contains(needle)))
    }

    /// The tail of its log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

pub use gpupool_e2e::strip_ansi;

/// Creates the scope's own kwok GPU node, labelled with the scope label (so the scope deletes
/// it) plus `extra` labels. H100 × 8 unless `product` says otherwise.
pub fn create_node(
    cluster: &Cluster,
    scope: &TestScope,
    name: &str,
    product: &str,
    extra: &[(&str, &str)],
) -> Result<String> {
    scope.track_kind("nodes");
    let manifest = kwok_node(scope, name, product, extra);
    cluster
        .kubectl()
        .run_with_stdin(["create", "-f", "-"], Some(&manifest.to_string()))?;
    Ok(name.to_owned())
}

/// A kwok GPU node with 8 GPUs of `product`, the scope's label and `extra` labels (its
/// manifest; [`create_node`] creates one, a `List` of them creates many in one request).
pub fn kwok_node(
    scope: &TestScope,
    name: &str,
    product: &str,
    extra: &[(&str, &str)],
) -> serde_json::Value {
    let (k, v) = scope.label();
    let mut labels = serde_json::Map::new();
    for (key, value) in [
        (k, v),
        ("kubernetes.io/hostname", name),
        ("type", "kwok"),
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.product", product),
        ("nvidia.com/gpu.count", "8"),
    ]
    .into_iter()
    .chain(extra.iter().copied())
    {
        labels.insert(key.to_owned(), json!(value));
    }
    let resources = json!({"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8"});
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
            "labels": labels,
        },
        "status": {"capacity": resources, "allocatable": resources},
    })
}

/// Applies a GpuPool from YAML `spec` text, named and labelled for the scope.
pub async fn apply_pool(
    client: &Client,
    scope: &TestScope,
    name: &str,
    spec: serde_json::Value,
) -> Result<GpuPool> {
    scope.track_kind("gpupools.gpupool.io");
    let (k, v) = scope.label();
    let pool = json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "metadata": { "name": name, "labels": { k: v } },
        "spec": spec,
    });
    let api: Api<GpuPool> = Api::all(client.clone());
    api.patch(
        name,
        &PatchParams::apply("gpupool-e2e").force(),
        &Patch::Apply(&pool),
    )
    .await
    .with_context(|| format!("applying GpuPool {name}"))
}

/// Polls a pool until `check` accepts it.
pub async fn wait_pool<F>(client: &Client, name: &str, what: &str, check: F) -> Result<GpuPool>
where
    F: Fn(&GpuPool) -> bool,
{
    let api: Api<GpuPool> = Api::all(client.clone());
    wait::poll(what, REACT, POLL, || {
        let api = api.clone();
        let check = &check;
        async move {
            let p = api.get(name).await?;
            Ok(check(&p).then_some(p))
        }
    })
    .await
}

/// The status of a pool condition.
pub fn condition(pool: &GpuPool, type_: &str) -> Option<String> {
    pool.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.clone())
}

/// Waits for the GpuNode of `node` to exist (and optionally satisfy `check`).
pub async fn wait_gpunode<F>(client: &Client, node: &str, check: F) -> Result<GpuNode>
where
    F: Fn(&GpuNode) -> bool,
{
    let api: Api<GpuNode> = Api::all(client.clone());
    wait::poll(&format!("GpuNode {node}"), REACT, POLL, || {
        let api = api.clone();
        let check = &check;
        async move { Ok(api.get_opt(node).await?.filter(|g| check(g))) }
    })
    .await
}

/// Waits until the GpuNode of `node` is gone.
pub async fn wait_gpunode_gone(client: &Client, node: &str) -> Result<()> {
    let api: Api<GpuNode> = Api::all(client.clone());
    wait::poll(&format!("GpuNode {node} deleted"), REACT, POLL, || {
        let api = api.clone();
        async move { Ok(api.get_opt(node).await?.is_none().then_some(())) }
    })
    .await
}

/// A healthy agent report for a GpuNode: validated, CDI written, MIG applied (when asked),
/// generation observed, heartbeat stamped now. `edit` adjusts it.
pub async fn report_status(
    client: &Client,
    node: &str,
    edit: impl FnOnce(&mut GpuNodeStatus),
) -> Result<()> {
    let api: Api<GpuNode> = Api::all(client.clone());
    let gn = api.get(node).await?;
    let mut status = healthy_status(&gn);
    edit(&mut status);
    let patch = json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuNode",
        "status": status,
    });
    api.patch_status(
        node,
        &PatchParams::apply("e2e-agent").force(),
        &Patch::Apply(&patch),
    )
    .await
    .with_context(|| format!("writing GpuNode {node} status"))?;
    Ok(())
}

/// An agent that keeps reporting: writes `node`'s status, as `edit` makes it and stamped now,
/// every two seconds until dropped. After an operator (re)start or a leader change the
/// operator acts on a node's report only once it has seen a new stamp arrive.
pub struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    /// Starts beating.
    pub fn start(
        client: &Client,
        node: &str,
        edit: impl Fn(&mut GpuNodeStatus) + Send + Sync + 'static,
    ) -> Self {
        let (client, node) = (client.clone(), node.to_owned());
        Self(tokio::spawn(async move {
            loop {
                if let Err(e) = report_status(&client, &node, &edit).await {
                    eprintln!("e2e: heartbeat of {node}: {e:#}");
                }
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The pool's status problem `reason` on `node`, if it reports one.
pub fn problem(
    pool: &GpuPool,
    node: &str,
    reason: &str,
) -> Option<gpupool_crds::pool::NodeProblem> {
    pool.status
        .as_ref()?
        .problems
        .iter()
        .find(|pr| pr.node == node && pr.reason == reason)
        .cloned()
}

/// Node labels as they are now.
pub async fn node_labels(client: &Client, node: &str) -> Result<BTreeMap<String, String>> {
    let api: Api<Node> = Api::all(client.clone());
    Ok(api.get(node).await?.labels().clone())
}

/// Sets (or with `None` removes) a node label.
pub async fn set_node_label(
    client: &Client,
    node: &str,
    key: &str,
    value: Option<&str>,
) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    api.patch(
        node,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "metadata": { "labels": { key: value } } })),
    )
    .await?;
    Ok(())
}

/// Deletes a pool and waits until it is gone (its finalizer done).
pub async fn delete_pool(client: &Client, name: &str) -> Result<()> {
    let api: Api<GpuPool> = Api::all(client.clone());
    api.delete(name, &DeleteParams::default()).await?;
    wait::poll(&format!("GpuPool {name} deleted"), REACT, POLL, || {
        let api = api.clone();
        async move { Ok(api.get_opt(name).await?.is_none().then_some(())) }
    })
    .await
}

/// Creates a pod on `node` holding one GPU (kwok runs it), with `annotations` and `labels`.
/// Waits for the scope namespace's `default` ServiceAccount: the service account admission
/// plugin refuses pods until the controller manager has created it, shortly after the
/// namespace.
pub async fn wait_default_service_account(client: &Client, scope: &TestScope) -> Result<()> {
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), scope.namespace());
    wait::poll(
        "the namespace's default ServiceAccount",
        REACT,
        POLL,
        || {
            let accounts = accounts.clone();
            async move { Ok(accounts.get_opt("default").await?.map(|_| ())) }
        },
    )
    .await
}

pub async fn create_gpu_pod(
    client: &Client,
    scope: &TestScope,
    name: &str,
    node: Option<&str>,
    gpus: u32,
    annotations: &[(&str, &str)],
    labels: &[(&str, &str)],
) -> Result<Pod> {
    wait_default_service_account(client, scope).await?;
    let (k, v) = scope.label();
    let mut label_map: BTreeMap<String, String> = labels
        .iter()
        .map(|(a, b)| ((*a).into(), (*b).into()))
        .collect();
    label_map.insert(k.into(), v.into());
    let mut spec = json!({
        "containers": [{
            "name": "main",
            "image": "registry.invalid/train:1",
            "resources": { "limits": { "nvidia.com/gpu": gpus.to_string() } },
        }],
        "tolerations": [{ "operator": "Exists" }],
        "terminationGracePeriodSeconds": 0,
    });
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
    } else {
        spec["nodeSelector"] = json!({ k: v });
    }
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": label_map,
            "annotations": annotations.iter().map(|(a, b)| ((*a).to_owned(), (*b).to_owned())).collect::<BTreeMap<_, _>>(),
        },
        "spec": spec,
    }))?;
    let api: Api<Pod> = Api::namespaced(client.clone(), scope.namespace());
    Ok(api.create(&PostParams::default(), &pod).await?)
}

/// Waits until a pod is Running.
pub async fn wait_running(client: &Client, ns: &str, name: &str) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait::poll(&format!("pod {ns}/{name} Running"), REACT, POLL, || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            Ok(running.then_some(p))
        }
    })
    .await
}

/// Fails unless `cond` holds.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if !cond {
        bail!("{}", msg());
    }
    Ok(())
}

/// Waits until the node's pool label is `want` (`None`: absent).
pub async fn wait_pool_label(client: &Client, node: &str, want: Option<&str>) -> Result<()> {
    wait::poll(
        &format!("{node} pool label {want:?}"),
        REACT,
        POLL,
        || async move {
            let labels = node_labels(client, node).await?;
            Ok((labels
                .get(gpupool_crds::labels::POOL_LABEL)
                .map(String::as_str)
                == want)
                .then_some(()))
        },
    )
    .await
}

/// Moves a running pod's `status.startTime` an hour back, so it is old enough to have been idle
/// past `idleAfter` (the reclaimer never counts idleness from before a pod started).
pub async fn backdate_start(client: &Client, ns: &str, name: &str) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let hour_ago = k8s_openapi::jiff::Timestamp::now()
        .checked_sub(k8s_openapi::jiff::SignedDuration::from_hours(1))
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let pod = api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": { "startTime": hour_ago.to_string() } })),
        )
        .await
        .with_context(|| format!("backdating pod {ns}/{name}"))?;
    Ok(pod)
}

/// Creates a GPU pod on `node`, waits until it runs, and backdates its start.
pub async fn running_gpu_pod(
    client: &Client,
    scope: &TestScope,
    name: &str,
    node: &str,
    annotations: &[(&str, &str)],
    labels: &[(&str, &str)],
) -> Result<Pod> {
    create_gpu_pod(client, scope, name, Some(node), 1, annotations, labels).await?;
    wait_running(client, scope.namespace(), name).await?;
    backdate_start(client, scope.namespace(), name).await
}

/// The pod as it is now, if it exists.
pub async fn pod_now(client: &Client, ns: &str, name: &str) -> Result<Option<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    Ok(api.get_opt(name).await?)
}

/// Waits until the pod is gone or being deleted (an eviction of a kwok pod).
pub async fn wait_evicted(client: &Client, ns: &str, name: &str) -> Result<()> {
    wait::poll(&format!("{name} evicted"), REACT, POLL, || async move {
        let p = pod_now(client, ns, name).await?;
        Ok(p.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await
}
