//! The chart's RBAC proven on the real apiserver: the operator and a node agent run as the
//! chart's ServiceAccounts (kubeconfigs holding tokens from `kubectl create token`), not as
//! the cluster admin.
//!
//! - A pool with one node is reconciled (GpuNode created, node labelled) and the agent writes
//!   its GpuNode status and its Node's labels: the pool becomes Ready, and neither log holds a
//!   "forbidden". The agent's token is bound to the DaemonSet's pod on its node (kwok runs
//!   that pod), as the kubelet's projected token is; the chart's admission policy then lets it
//!   write only that node's objects, and only its own labels there.
//! - With one verb removed from the operator's ClusterRole (`patch` on nodes), the operator
//!   logs the apiserver's "forbidden" naming the verb and resource, keeps retrying rather
//!   than hanging or exiting, and converges once the verb is back.

#[path = "chart_support.rs"]
mod chart;
#[path = "operator_support.rs"]
mod op;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use chart::{Release, service_account_kubeconfig};
use gpupool_crds::labels::{POOL_LABEL, PRODUCT_LABEL};
use gpupool_crds::node::Verdict;
use gpupool_e2e::agent::{agent_binaries, fake_driver_root};
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, crds, repo_root};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const DRIVER: &str = "550.54.15";
const POLL: Duration = Duration::from_millis(250);
const REACT: Duration = Duration::from_secs(90);

/// The agent binary, built once per test process and copied out of the shared target
/// directory (others may rebuild it meanwhile).
fn agent_binary() -> Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let private = repo_root().join(format!("target/e2e-rbac-bin/{}", std::process::id()));
            agent_binaries(&private)
                .map(|(agent, _nvml)| agent)
                .map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

/// A child process (operator or agent) with its log; killed on drop.
struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- {} ---\n{}",
            self.log.display(),
            lines[lines.len().saturating_sub(30)..].join("\n")
        )
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_file(dir: &Path, name: &str) -> Result<(PathBuf, fs::File, fs::File)> {
    fs::create_dir_all(dir)?;
    let path = dir.join(name);
    let out = fs::File::create(&path)?;
    let err = out.try_clone()?;
    Ok((path, out, err))
}

/// Starts the operator as the release's ServiceAccount, managing the scope's pools only and
/// electing a leader on the chart's Lease in the release namespace.
fn start_operator(
    scope: &TestScope,
    release: &Release,
    kubeconfig: &Path,
    dir: &Path,
) -> Result<Process> {
    let (log, out, err) = log_file(dir, "operator.log")?;
    let child = Command::new(op::operator_binary()?)
        .args([
            "--http-addr",
            "127.0.0.1:0",
            "--pool-selector",
            &scope.selector(),
            "--lease-name",
            "gpupool-operator",
            "--lease-namespace",
            &release.namespace,
            "--identity",
            "rbac-e2e",
            "--lease-duration",
            "6",
            "--lease-grace",
            "2",
            "--log",
            "info,gpupool_operator=debug",
        ])
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("starting gpupool-operator")?;
    Ok(Process { child, log })
}

/// A node's fake host for the agent: fixture, kubelet dir, CDI dir, driver root whose device
/// nodes are plain files.
fn fake_host(dir: &Path, node: &str) -> Result<()> {
    let _ = fs::remove_dir_all(dir.join("host"));
    fake_driver_root(&dir.join("host/driver"), DRIVER, 2)?;
    // An empty kernel log: the host's own /dev/kmsg is not this fake node's.
    fs::write(dir.join("host/kmsg"), "")?;
    fs::create_dir_all(dir.join("host/kubelet/device-plugins"))?;
    fs::create_dir_all(dir.join("host/cdi"))?;
    fs::write(
        dir.join("host/fixture.yaml"),
        format!(
            "node: {node}\ndriver: {{version: \"{DRIVER}\", cuda: \"12.4\"}}\ngpus:\n  - model: H100-SXM5-80GB\n    count: 2\n"
        ),
    )?;
    Ok(())
}

/// Starts the agent for `node` as the release's agent ServiceAccount, simulated GPUs.
fn start_agent(node: &str, kubeconfig: &Path, dir: &Path) -> Result<Process> {
    fake_host(dir, node)?;
    let host = dir.join("host");
    let (log, out, err) = log_file(dir, "agent.log")?;
    let child = Command::new(agent_binary()?)
        .arg("--node-name")
        .arg(node)
        .args(["--backend", "sim", "--fixture"])
        .arg(host.join("fixture.yaml"))
        .arg("--kubelet-dir")
        .arg(host.join("kubelet"))
        .arg("--cdi-dir")
        .arg(host.join("cdi"))
        .arg("--driver-root")
        .arg(host.join("driver"))
        .arg("--proc-root")
        .arg(host.join("driver/proc"))
        .arg("--kmsg-path")
        .arg(host.join("kmsg"))
        .args([
            "--metrics-addr",
            "127.0.0.1:0",
            "--validate-interval-secs",
            "2",
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("starting gpupool-device-plugin")?;
    Ok(Process { child, log })
}

/// The agent DaemonSet's pod on `node` (kwok runs it).
async fn agent_pod_on(client: &Client, release: &Release, node: &str) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &release.agent_namespace);
    poll(&format!("the agent pod on {node}"), REACT, POLL, || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
                .await?;
            Ok(list.items.first().map(ResourceExt::name_any))
        }
    })
    .await
}

/// Installs the chart for the scope (the CRDs are installed by the test, not the release).
fn install(cluster: &'static Cluster, scope: &TestScope) -> Result<Release> {
    Release::install(
        cluster,
        &scope.name("gp"),
        scope.namespace(),
        &["crds.install=false", "operator.logJson=false"],
    )
}

fn work_dir(scope: &TestScope) -> PathBuf {
    scope.socket_dir()
}

/// How the operator admission policy refuses a Node write beyond the pool label and its taints.
const NODE_REFUSAL: &str = "the gpupool operator may change only a Node's gpupool.io/pool label";

#[tokio::test]
async fn operator_and_agent_work_as_the_charts_service_accounts() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "rbac-core")?;
    let admin = cluster.client().await?;
    let dir = work_dir(&scope);
    let node = op::create_node(
        cluster,
        &scope,
        &scope.name("n0"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let other = op::create_node(
        cluster,
        &scope,
        &scope.name("n1"),
        "NVIDIA-H100-80GB-HBM3",
        &[("e2e.gpupool.io/role", "not-in-pool")],
    )?;
    let release = install(cluster, &scope)?;

    let op_kc = service_account_kubeconfig(
        cluster,
        &release.namespace,
        &release.operator_name(),
        None,
        &dir.join("operator.kubeconfig"),
    )?;
    let pod = agent_pod_on(&admin, &release, &node).await?;
    let agent_kc = service_account_kubeconfig(
        cluster,
        &release.agent_namespace,
        &release.agent_name(),
        Some(&pod),
        &dir.join("agent.kubeconfig"),
    )?;
    let whoami = gpupool_e2e::Kubectl::new(cluster.kubectl_path(), &agent_kc).run([
        "auth",
        "whoami",
        "-o",
        "jsonpath={.status.userInfo.username} {.status.userInfo.extra.authentication\\.kubernetes\\.io/node-name[0]}",
    ])?;
    assert_eq!(
        whoami.trim(),
        format!(
            "system:serviceaccount:{}:{} {node}",
            release.agent_namespace,
            release.agent_name()
        )
    );

    let mut operator = start_operator(&scope, &release, &op_kc, &dir)?;
    let mut agent = start_agent(&node, &agent_kc, &dir)?;
    let logs = |operator: &Process, agent: &Process| {
        format!("{}\n{}", operator.log_tail(), agent.log_tail())
    };

    let pool = scope.name("pool");
    let (k, v) = scope.label();
    op::apply_pool(
        &admin,
        &scope,
        &pool,
        json!({
            "nodeSelector": {
                "matchLabels": { k: v },
                "matchExpressions": [{ "key": "e2e.gpupool.io/role", "operator": "DoesNotExist" }],
            },
            "driver": { "cudaVersion": "12.4" },
        }),
    )
    .await?;

    // The operator's side: GpuNode created, node labelled with the pool.
    op::wait_gpunode(&admin, &node, |_| true)
        .await
        .with_context(|| logs(&operator, &agent))?;
    poll("the node labelled with its pool", REACT, POLL, || {
        let admin = admin.clone();
        let (node, pool) = (node.clone(), pool.clone());
        async move {
            let labels = op::node_labels(&admin, &node).await?;
            Ok((labels.get(POOL_LABEL) == Some(&pool)).then_some(()))
        }
    })
    .await
    .with_context(|| logs(&operator, &agent))?;

    // The agent's side: GpuNode status validated, its hardware labels on the Node.
    op::wait_gpunode(&admin, &node, |g| {
        g.status
            .as_ref()
            .is_some_and(|s| s.validated == Some(Verdict::True) && s.gpu_count == 2)
    })
    .await
    .with_context(|| logs(&operator, &agent))?;
    poll("the agent's labels on the node", REACT, POLL, || {
        let admin = admin.clone();
        let node = node.clone();
        async move {
            let labels = op::node_labels(&admin, &node).await?;
            Ok(labels.get(PRODUCT_LABEL).cloned())
        }
    })
    .await
    .with_context(|| logs(&operator, &agent))?;

    // Both sides together: the pool is Ready.
    op::wait_pool(&admin, &pool, "pool Ready", |p| {
        op::condition(p, "Ready").as_deref() == Some("True")
    })
    .await
    .with_context(|| logs(&operator, &agent))?;
    ensure!(operator.is_running(), "{}", operator.log_tail());
    ensure!(agent.is_running(), "{}", agent.log_tail());
    for p in [&operator, &agent] {
        let text = p.log_text().to_ascii_lowercase();
        ensure!(!text.contains("forbidden"), "{}", p.log_tail());
    }

    // The agent's token cannot touch another node, nor the operator's label on its own.
    let as_agent = gpupool_e2e::Kubectl::new(cluster.kubectl_path(), &agent_kc);
    let run = as_agent.try_run(
        [
            "label",
            "node",
            &other,
            "--overwrite",
            "gpupool.io/gpu.count=99",
        ],
        None,
    )?;
    ensure!(!run.success, "the agent labelled another node");
    assert!(
        run.stderr.contains("Forbidden")
            && run
                .stderr
                .contains(&format!("may not write nodes {other}: only its own node")),
        "{}",
        run.stderr
    );
    let run = as_agent.try_run(
        [
            "label",
            "node",
            &node,
            "--overwrite",
            "gpupool.io/pool=stolen",
        ],
        None,
    )?;
    ensure!(!run.success, "the agent changed the pool label");
    assert!(
        run.stderr.contains("may change only its own Node labels"),
        "{}",
        run.stderr
    );
    // Nor the rest of its Node's metadata.
    let run = as_agent.try_run(
        [
            "annotate",
            "node",
            &node,
            "--overwrite",
            "example.com/owner=agent",
        ],
        None,
    )?;
    ensure!(!run.success, "the agent annotated its Node");
    assert!(
        run.stderr
            .contains("may not change its Node's annotations, finalizers or owner references"),
        "{}",
        run.stderr
    );
    let run = as_agent.try_run(
        [
            "patch",
            "node",
            &node,
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":["example.com/hold"]}}"#,
        ],
        None,
    )?;
    ensure!(!run.success, "the agent put a finalizer on its Node");
    assert!(
        run.stderr.contains("may not change its Node's annotations"),
        "{}",
        run.stderr
    );
    // The operator's token may annotate pods only under gpupool.io/ (its reclaim marks), and
    // may not touch what a pod runs: RBAC grants `pods: patch`, the chart's admission policy
    // narrows it.
    let as_operator = gpupool_e2e::Kubectl::new(cluster.kubectl_path(), &op_kc);
    let agent_ns = release.agent_namespace.as_str();
    let target = pod.as_str();
    as_operator.run([
        "annotate",
        "pod",
        "-n",
        agent_ns,
        target,
        "--overwrite",
        "gpupool.io/idle-since=2026-01-01T00:00:00Z",
    ])?;
    for (what, args) in [
        (
            "another annotation",
            vec!["annotate", "pod", "-n", agent_ns, target, "example.com/x=1"],
        ),
        (
            "a label",
            vec!["label", "pod", "-n", agent_ns, target, "example.com/x=1"],
        ),
        (
            "the image",
            vec![
                "patch",
                "pod",
                "-n",
                agent_ns,
                target,
                "--type=json",
                "-p",
                r#"[{"op":"replace","path":"/spec/containers/0/image","value":"example.com/evil:1"}]"#,
            ],
        ),
    ] {
        let run = as_operator.try_run(args, None)?;
        ensure!(!run.success, "the operator's token changed {what} on a pod");
        assert!(
            run.stderr
                .contains("the gpupool operator may change only gpupool.io/ annotations on a pod"),
            "{what}: {}",
            run.stderr
        );
    }
    // And on Jobs it may only suspend them (reclaim.action Suspend/Auto).
    let job = scope.name("job");
    cluster.kubectl().run_with_stdin(
        ["apply", "-f", "-"],
        Some(
            &json!({
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": job, "namespace": scope.namespace()},
                "spec": {"suspend": true, "template": {"spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "example.com/train:1"}],
                }}},
            })
            .to_string(),
        ),
    )?;
    let patch_job = |body: &str| {
        as_operator.try_run(
            [
                "patch",
                "job",
                "-n",
                scope.namespace(),
                &job,
                "--type=merge",
                "-p",
                body,
            ],
            None,
        )
    };
    let run = patch_job(r#"{"spec":{"suspend":true}}"#)?;
    ensure!(
        run.success,
        "the operator could not suspend a Job: {}",
        run.stderr
    );
    let run = patch_job(r#"{"spec":{"parallelism":4}}"#)?;
    ensure!(
        !run.success,
        "the operator's token changed a Job's parallelism"
    );
    assert!(
        run.stderr
            .contains("the gpupool operator may only suspend a Job"),
        "{}",
        run.stderr
    );
    // Nor give a Job a bogus owner (the garbage collector would delete it and its pods) or a
    // finalizer, even together with the suspend it may make.
    for (what, body) in [
        (
            "an owner reference",
            format!(
                r#"{{"spec":{{"suspend":true}},"metadata":{{"ownerReferences":[{{"apiVersion":"v1","kind":"ConfigMap","name":"gone","uid":"{}"}}]}}}}"#,
                "00000000-0000-0000-0000-000000000001"
            ),
        ),
        (
            "a finalizer",
            r#"{"spec":{"suspend":true},"metadata":{"finalizers":["example.com/hold"]}}"#
                .to_owned(),
        ),
        (
            "its TTL",
            r#"{"spec":{"suspend":true,"ttlSecondsAfterFinished":0}}"#.to_owned(),
        ),
    ] {
        as_operator
            .expect_refused(
                [
                    "patch",
                    "job",
                    "-n",
                    scope.namespace(),
                    &job,
                    "--type=merge",
                    "-p",
                    &body,
                ],
                "the gpupool operator may only suspend a Job",
            )
            .with_context(|| format!("giving a Job {what}"))?;
    }
    // On Nodes it may set the pool label and its own taints, and nothing else: not strip a
    // control-plane taint, not set another label.
    cluster.kubectl().run([
        "taint",
        "node",
        &other,
        "node-role.kubernetes.io/control-plane:NoSchedule",
    ])?;
    for (what, args) in [
        (
            "a control-plane taint removed",
            vec![
                "taint",
                "node",
                other.as_str(),
                "node-role.kubernetes.io/control-plane:NoSchedule-",
            ],
        ),
        (
            "a foreign label",
            vec!["label", "node", node.as_str(), "example.com/owner=operator"],
        ),
        (
            "an agent's hardware label",
            vec![
                "label",
                "node",
                node.as_str(),
                "--overwrite",
                "gpupool.io/gpu.count=99",
            ],
        ),
    ] {
        as_operator
            .expect_refused(args, NODE_REFUSAL)
            .with_context(|| format!("the operator's token and {what}"))?;
    }
    // Its own taint it may set, as it does (NoSchedule, no value), and take off again; not as
    // NoExecute, which would evict every pod on the node that does not tolerate it.
    for args in [
        vec![
            "taint",
            "node",
            other.as_str(),
            "gpupool.io/driver-invalid:NoSchedule",
        ],
        vec![
            "taint",
            "node",
            other.as_str(),
            "gpupool.io/driver-invalid:NoSchedule-",
        ],
    ] {
        let run = as_operator.try_run(args.clone(), None)?;
        ensure!(run.success, "{args:?}: {}", run.stderr);
    }
    as_operator.expect_refused(
        [
            "taint",
            "node",
            &other,
            "gpupool.io/driver-invalid:NoExecute",
        ],
        NODE_REFUSAL,
    )?;
    // A GpuPool is its owner's: the operator may not rewrite one (it only manages its
    // finalizer, which it did above to get the pool Ready).
    as_operator.expect_refused(
        [
            "patch",
            "gpupool",
            &pool,
            "--type=merge",
            "-p",
            r#"{"spec":{"reclaim":{"mode":"Enforce","allowPodOptOut":false}}}"#,
        ],
        "the gpupool operator may only add or remove its finalizer",
    )?;
    // A GpuNode with a driver root the agents do not trust (the agent runs programs and
    // mounts libraries from it): refused, naming the roots they do.
    as_operator.expect_refused(
        [
            "patch",
            "gpunode",
            &node,
            "--type=merge",
            "-p",
            r#"{"spec":{"cdi":{"driverRoot":"/tmp/x"}}}"#,
        ],
        &format!(
            "the gpupool operator may not give GpuNode {node} the driver root /tmp/x: the agents trust only /, /run/nvidia/driver"
        ),
    )?;
    // Nor give a GpuNode another owner (the garbage collector would delete it with that one).
    as_operator.expect_refused(
        [
            "patch",
            "gpunode",
            &node,
            "--type=merge",
            "-p",
            r#"{"metadata":{"ownerReferences":[{"apiVersion":"v1","kind":"ConfigMap","name":"gone","uid":"00000000-0000-0000-0000-000000000002"}]}}"#,
        ],
        "the gpupool operator may give a GpuNode no owner but its pool",
    )?;
    // A Kueue Workload it may only deactivate.
    gpupool_e2e::kueue::install_workload_crd(cluster)?;
    let workload = scope.name("wl");
    cluster.kubectl().run_with_stdin(
        ["apply", "-f", "-"],
        Some(
            &json!({
                "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
                "metadata": {"name": workload, "namespace": scope.namespace()},
                "spec": {"active": true, "queueName": "gpu-queue"},
            })
            .to_string(),
        ),
    )?;
    // Through the API, not kubectl: kubectl patch reads the object first, and the operator
    // may not get Workloads (it lists them).
    let operator_client = {
        let kubeconfig = kube::config::Kubeconfig::read_from(&op_kc)?;
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?;
        Client::try_from(config)?
    };
    let resource = gpupool_e2e::kueue::workload_resource();
    let workloads: Api<kube::api::DynamicObject> =
        Api::namespaced_with(operator_client, scope.namespace(), &resource);
    let patch_workload = |body: serde_json::Value| {
        let workloads = workloads.clone();
        let workload = workload.clone();
        async move {
            workloads
                .patch(
                    &workload,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&body),
                )
                .await
        }
    };
    match patch_workload(json!({"spec": {"active": false, "queueName": "other-queue"}})).await {
        Ok(_) => anyhow::bail!("the operator's token moved a Workload to another queue"),
        Err(kube::Error::Api(status)) => assert!(
            status
                .message
                .contains("the gpupool operator may only deactivate a Kueue Workload"),
            "{}",
            status.message
        ),
        Err(e) => anyhow::bail!("patching the Workload: {e}"),
    }
    patch_workload(json!({"spec": {"active": false}}))
        .await
        .context("the operator could not deactivate a Workload")?;
    let run = as_agent.try_run(["delete", "gpunode", &node, "--wait=false"], None)?;
    ensure!(!run.success, "the agent deleted its GpuNode");
    assert!(
        run.stderr.contains("cannot delete resource"),
        "{}",
        run.stderr
    );

    op::delete_pool(&admin, &pool)
        .await
        .with_context(|| operator.log_tail())?;
    Ok(())
}

#[tokio::test]
async fn operator_missing_a_verb_says_forbidden_and_recovers() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "rbac-forbidden")?;
    let admin = cluster.client().await?;
    let dir = work_dir(&scope);
    let node = op::create_node(
        cluster,
        &scope,
        &scope.name("n0"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let release = install(cluster, &scope)?;
    let kubectl = cluster.kubectl();

    // Take `patch` away from the operator's rule on nodes.
    let role_name = release.operator_name();
    let original = kubectl.run(["get", "clusterrole", &role_name, "-o", "json"])?;
    let mut role: serde_json::Value = serde_json::from_str(&original)?;
    let mut removed = false;
    for rule in role["rules"].as_array_mut().context("rules")? {
        if rule["resources"] == json!(["nodes"]) {
            let verbs = rule["verbs"].as_array_mut().context("verbs")?;
            verbs.retain(|v| v != "patch");
            removed = true;
        }
    }
    ensure!(removed, "no nodes rule in {original}");
    kubectl.run_with_stdin(["replace", "-f", "-"], Some(&role.to_string()))?;

    let op_kc = service_account_kubeconfig(
        cluster,
        &release.namespace,
        &release.operator_name(),
        None,
        &dir.join("operator.kubeconfig"),
    )?;
    let mut operator = start_operator(&scope, &release, &op_kc, &dir)?;
    let pool = scope.name("pool");
    let (k, v) = scope.label();
    op::apply_pool(
        &admin,
        &scope,
        &pool,
        json!({ "nodeSelector": { "matchLabels": { k: v } } }),
    )
    .await?;

    // The log names what was refused, and the operator keeps running (it retries).
    let sa_user = format!(
        "system:serviceaccount:{}:{}",
        release.namespace,
        release.operator_name()
    );
    let line = poll(
        "a forbidden error in the operator's log",
        REACT,
        POLL,
        || {
            let text = operator.log_text();
            let sa_user = sa_user.clone();
            async move {
                Ok(text
                    .lines()
                    .find(|l| {
                        l.contains("reconcile failed")
                            && l.contains("forbidden")
                            && l.contains(&sa_user)
                            && l.contains("cannot patch resource \"nodes\"")
                    })
                    .map(str::to_owned))
            }
        },
    )
    .await
    .with_context(|| operator.log_tail())?;
    eprintln!("rbac: the operator logged: {line}");
    ensure!(operator.is_running(), "{}", operator.log_tail());
    let gp = op::wait_pool(&admin, &pool, "APIErrors names the refused verb", |p| {
        p.status.as_ref().is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "APIErrors"
                    && c.status == "True"
                    && c.reason == "Forbidden"
                    && c.message
                        .contains("the operator cannot patch nodes: forbidden")
                    && c.message.contains("check the chart's ClusterRole")
            })
        })
    })
    .await
    .with_context(|| operator.log_tail())?;
    assert_eq!(op::condition(&gp, "Ready").as_deref(), Some("False"));

    // Put the verb back: the next retry labels the node.
    let mut restored: serde_json::Value = serde_json::from_str(&original)?;
    if let Some(meta) = restored["metadata"].as_object_mut() {
        meta.remove("resourceVersion");
    }
    kubectl.run_with_stdin(["apply", "-f", "-"], Some(&restored.to_string()))?;
    poll(
        "the node labelled once the verb is back",
        Duration::from_secs(180),
        POLL,
        || {
            let admin = admin.clone();
            let (node, pool) = (node.clone(), pool.clone());
            async move {
                let labels = op::node_labels(&admin, &node).await?;
                Ok((labels.get(POOL_LABEL) == Some(&pool)).then_some(()))
            }
        },
    )
    .await
    .with_context(|| operator.log_tail())?;
    op::wait_pool(&admin, &pool, "APIErrors cleared", |p| {
        op::condition(p, "APIErrors").as_deref() == Some("False")
    })
    .await
    .with_context(|| operator.log_tail())?;
    op::delete_pool(&admin, &pool)
        .await
        .with_context(|| operator.log_tail())?;
    Ok(())
}
