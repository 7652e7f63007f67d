//! A real node: the kubelet on containerd with runc (`e2e/kubelet` with
//! `GPUPOOL_E2E_RUNTIME=containerd`), our node agent on the fake NVML, and GPU pods that really
//! start. containerd resolves the CDI names our plugin hands out against the spec our agent
//! wrote, runc builds the containers, and a probe inside each container reports what it sees
//! (`e2e/tools/node/images/probe.c` and NVIDIA's Python bindings in `pyprobe.py`).
//!
//! The driver root is as a driver install leaves it: real character device nodes, real ELF
//! libraries carrying their sonames (the fake NVML as `libnvidia-ml.so.<version>`, the fake CUDA
//! driver as `libcuda.so.<version>`) and an `ld.so.cache`. Inside a container the fake NVML and
//! fake CUDA count only the GPUs whose `/dev/nvidia<minor>` the container has, as the real driver
//! does, so a count is a statement about the device nodes the spec gave it.
//!
//! One scenario, in order (one kubelet per machine):
//! 1. capacity: 1 whole GPU and three `1g.10gb` MIG slices;
//! 2. a pod asking for `nvidia.com/gpu: 1` on a Debian image with no environment of its own:
//!    exactly that GPU's node and the control nodes; `libcuda.so.1`, `libcuda.so` and
//!    `libnvidia-ml.so.1` load by soname; CUDA, NVML and nvidia-ml-py count one GPU, the one
//!    the agent reports the pod on; the driver files are read-only;
//! 3. the same with a read-only root file system and a non-root user;
//! 4. an image that sets `LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64` (as
//!    NVIDIA's CUDA images do): the variable is the image's, unchanged, and the driver loads from
//!    `/usr/local/nvidia/lib64`;
//! 5. a pod asking for `nvidia.com/mig-1g.10gb: 1`: the parent GPU's node and that slice's
//!    `nvidia-caps` nodes, no other GPU;
//! 6. the CDI spec deleted under the running agent: the agent reports it and writes it again,
//!    and a new GPU pod starts;
//! 7. the agent run again as a container laid out as the chart runs it (its own root file
//!    system and loader, the host's `/` read-only at `/host`, NVML loaded by full path from the
//!    driver root): the same spec, byte for byte, and a GPU pod starts through it;
//! 8. the chart installed on this node with the project's images (`images/build.sh`): the agent
//!    DaemonSet's pod and the operator's pods run as real containers with their own service
//!    accounts; the agent pod registers and writes the spec, the operator takes the lease and
//!    makes a pool of this node Ready; `helm test`'s pod starts through the agent pod, finds
//!    the GPU's device node, and NVML (the spec's `nvidia-smi -L`) lists that GPU and no other;
//!    two MPS clients get GPU 1's daemon but neither its control program nor `/tmp/nvidia-mps`;
//!    the agent takes its driver root from the pool as far as the node trusts it (`/tmp` is
//!    refused by the operator's admission policy, a symlinked root by the agent, which keeps
//!    its spec and serves a new pod); `helm uninstall` (its pre-delete hook a container too)
//!    leaves no `gpupool.io/` label.
//!
//! Opt-in with the rest of the real-kubelet layer (`GPUPOOL_E2E_KUBELET=1`); `e2e/kubelet check`
//! with the containerd runtime says why it cannot run otherwise.

#[path = "chart_support.rs"]
mod chart;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use gpupool_crds::node::{GpuMigSpec, MigState, NodeMigSpec};
use gpupool_crds::policy::MigStrategy;
use gpupool_crds::{GpuNode, GpuPool};
use gpupool_e2e::agent::{wait_event, wait_status};
use gpupool_e2e::kubelet::{
    RealKubelet, Runtime, create_pod, delete_pod_and_wait, phase, skip_reason, wait_node_resources,
    wait_pod,
};
use gpupool_e2e::node::{FAKE_DIR, GpuNodeHost, PROBE_CUDA_ENV_IMAGE, PROBE_IMAGE, probe_pod};
use gpupool_e2e::service_relay::ApiServiceRelay;
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, crds, images, repo_root};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

const GPU: &str = "nvidia.com/gpu";
const MIG_1G: &str = "nvidia.com/mig-1g.10gb";
/// The C probe, then NVIDIA's Python bindings.
const PROBE_COMMAND: [&str; 3] = ["/bin/sh", "-c", "/probe && python3 /pyprobe.py"];

/// The probe's `key=value` lines; repeated keys keep every value.
#[derive(Debug, Default)]
struct Probe(BTreeMap<String, Vec<String>>);

impl Probe {
    fn parse(text: &str) -> Probe {
        let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for line in text.lines() {
            if let Some((k, v)) = line.split_once('=') {
                map.entry(k.to_owned()).or_default().push(v.to_owned());
            }
        }
        Probe(map)
    }

    fn one(&self, key: &str) -> Result<&str> {
        match self.0.get(key).map(Vec::as_slice) {
            Some([v]) => Ok(v),
            other => bail!("probe key {key}: want one value, got {other:?}; probe said {self:?}"),
        }
    }

    fn all(&self, key: &str) -> Vec<String> {
        self.0.get(key).cloned().unwrap_or_default()
    }

    /// `device=/dev/x 195:0` lines as path -> "major:minor".
    fn devices(&self) -> BTreeMap<String, String> {
        self.all("device")
            .iter()
            .filter_map(|d| d.split_once(' '))
            .map(|(p, n)| (p.to_owned(), n.to_owned()))
            .collect()
    }
}

/// Runs a probe pod to completion and returns what it printed.
async fn run_probe(
    client: &Client,
    scope: &TestScope,
    kubelet: &RealKubelet,
    pod: &Pod,
) -> Result<(Probe, Pod)> {
    let name = pod.metadata.name.clone().context("pod without name")?;
    let created = Instant::now();
    create_pod(client, scope, pod).await?;
    let done = wait_pod(
        client,
        scope,
        &name,
        &format!("{name} to run to completion"),
        Duration::from_secs(120),
        |p| matches!(phase(p), "Succeeded" | "Failed"),
    )
    .await
    .with_context(|| format!("kubelet log: {}", kubelet.log.display()))?;
    let log = kubelet
        .container_log(&done, "probe")
        .with_context(|| format!("{name} ended {}: {:?}", phase(&done), done.status))?;
    eprintln!(
        "e2e: {name} {} after {:.1}s; it printed:\n{log}",
        phase(&done),
        created.elapsed().as_secs_f64()
    );
    ensure!(
        phase(&done) == "Succeeded",
        "{name} ended {}: {:?}",
        phase(&done),
        done.status
    );
    Ok((Probe::parse(&log), done))
}

/// The checks every GPU container must pass: the driver loads by soname from read-only files
/// and CUDA, NVML and nvidia-ml-py count one GPU.
fn check_driver_loads(probe: &Probe, what: &str) -> Result<()> {
    for lib in ["libcuda", "libcuda_unversioned", "libnvml"] {
        ensure!(
            probe.one(&format!("{lib}_load"))? == "ok",
            "{what}: {lib} did not load: {probe:?}"
        );
        ensure!(
            probe.one(&format!("{lib}_writable"))?.starts_with("no"),
            "{what}: the mounted {lib} is writable: {probe:?}"
        );
    }
    ensure!(probe.one("cuInit")? == "0", "{what}: cuInit failed");
    ensure!(
        probe.one("cuDeviceGetCount")? == "0 count=1",
        "{what}: CUDA counts {}, want 1",
        probe.one("cuDeviceGetCount")?
    );
    ensure!(probe.one("nvmlInit")? == "0", "{what}: nvmlInit failed");
    ensure!(
        probe.one("nvmlDeviceGetCount")? == "0 count=1",
        "{what}: NVML counts {}, want 1",
        probe.one("nvmlDeviceGetCount")?
    );
    ensure!(
        probe.one("pynvml_count")? == "1",
        "{what}: nvidia-ml-py counts {}, want 1",
        probe.one("pynvml_count")?
    );
    Ok(())
}

/// The NVIDIA device nodes in the container: exactly `want` (path -> major:minor).
fn check_devices(probe: &Probe, what: &str, want: &BTreeMap<String, String>) -> Result<()> {
    let got = probe.devices();
    ensure!(
        &got == want,
        "{what}: device nodes {got:?}, want exactly {want:?}"
    );
    ensure!(
        probe.all("not_a_device").is_empty(),
        "{what}: NVIDIA paths that are not character devices: {:?}",
        probe.all("not_a_device")
    );
    Ok(())
}

/// The control nodes every GPU container gets (char 195:255, 195:254, 510:0, 510:1).
fn control_nodes() -> BTreeMap<String, String> {
    [
        ("/dev/nvidiactl", "195:255"),
        ("/dev/nvidia-modeset", "195:254"),
        ("/dev/nvidia-uvm", "510:0"),
        ("/dev/nvidia-uvm-tools", "510:1"),
    ]
    .into_iter()
    .map(|(p, n)| (p.to_owned(), n.to_owned()))
    .collect()
}

/// The MIG capability nodes' minors for GPU `gpu`'s GPU instance `gi` and compute instance `ci`,
/// from the driver root's `mig-minors`.
fn mig_cap_minors(driver_root: &Path, gpu: u32, gi: u32, ci: u32) -> Result<BTreeSet<String>> {
    let table = fs::read_to_string(driver_root.join("proc/driver/nvidia-caps/mig-minors"))?;
    let want = [
        format!("gpu{gpu}/gi{gi}/access"),
        format!("gpu{gpu}/gi{gi}/ci{ci}/access"),
    ];
    let minors: BTreeSet<String> = table
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| want.contains(&k.to_string()))
        .map(|(_, m)| m.trim().to_owned())
        .collect();
    ensure!(minors.len() == 2, "mig-minors lacks {want:?}");
    Ok(minors)
}

/// A pod's phase, readiness and container states, for error messages.
fn pod_summary(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let containers = status
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    format!(
                        "{} ready={} restarts={} state={}",
                        c.name,
                        c.ready,
                        c.restart_count,
                        c.state
                            .as_ref()
                            .and_then(|s| serde_json::to_string(s).ok())
                            .unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
        .unwrap_or_default();
    format!(
        "{} on {}: {} [{containers}]",
        pod.metadata.name.as_deref().unwrap_or("?"),
        pod.spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .unwrap_or("(unscheduled)"),
        phase(pod)
    )
}

/// The pods matching `selector` in `namespace`, with their containers' logs as the runtime
/// keeps them: what an error message needs when a chart workload misbehaves.
async fn workload_report(
    client: &Client,
    kubelet: &RealKubelet,
    namespace: &str,
    selector: &str,
) -> String {
    let pods = match Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(selector))
        .await
    {
        Ok(p) => p.items,
        Err(e) => return format!("(listing pods {selector} in {namespace}: {e})"),
    };
    let mut out = String::new();
    for pod in &pods {
        out.push_str(&format!("--- {}\n", pod_summary(pod)));
        for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
            let log = kubelet
                .container_log(pod, &c.name)
                .unwrap_or_else(|e| format!("({e:#})"));
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    if pods.is_empty() {
        out.push_str(&format!("(no pods {selector} in {namespace})\n"));
    }
    out
}

/// The chart as it runs on a GPU node, in place of the agent the earlier steps ran.
///
/// The project's images (`images/build.sh` over this build's binaries) are imported into
/// containerd and the chart is installed with its own templates and image references. The agent
/// DaemonSet's pod and both operator replicas run as real containers on this node, and reach
/// the API server through the `kubernetes` Service ([`ApiServiceRelay`]) with their own service
/// accounts. Then: the agent pod registers with the kubelet and writes the CDI spec; the
/// operator takes the lease and makes a pool of this node Ready; `helm test`'s pod starts
/// through the agent pod, finds the GPU's device node, and NVML (the spec's `nvidia-smi -L`)
/// lists that GPU and no other; `helm uninstall`, whose pre-delete hook is a real container
/// too, leaves no `gpupool.io/` label on the node.
async fn chart_on_node(
    cluster: &'static Cluster,
    client: &Client,
    kubelet: &RealKubelet,
    scope: &TestScope,
    host: &mut GpuNodeHost,
    uuid: &str,
) -> Result<()> {
    let node = kubelet.node.clone();
    // The chart's agent replaces the one run so far, and the operator hands the node its
    // desired state from a pool: the earlier steps' GpuNode goes.
    let spec_path = host.agent.cdi_spec.clone();
    host.agent.stop();
    let _ = fs::remove_file(&spec_path);
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    if gpunodes.get_opt(&node).await?.is_some() {
        gpunodes.delete(&node, &DeleteParams::default()).await?;
    }
    poll(
        "the earlier GpuNode to go",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async { Ok(gpunodes.get_opt(&node).await?.is_none().then_some(())) },
    )
    .await?;

    images::build_and_import(kubelet, &host.dir.join("images-work"))?;
    let _relay = ApiServiceRelay::start(cluster, client).await?;

    let release = scope.name("rel");
    let agent_ns = format!("{release}-node");
    let (label_key, label_value) = scope.label();
    let toleration = json!([{"key": "e2e.gpupool.io/real-kubelet", "operator": "Exists", "effect": "NoSchedule"}]);
    let fake_dir = &host.dir;
    let mut sets: Vec<(String, serde_json::Value)> = [
        ("crds.install", json!(false)),
        (
            "operator.nodeSelector",
            json!({"kubernetes.io/hostname": node}),
        ),
        ("operator.tolerations", toleration.clone()),
        (
            "operator.poolSelector",
            json!(format!("{label_key}={label_value}")),
        ),
        ("operator.logJson", json!(false)),
        ("agent.logJson", json!(false)),
        ("tests.image.repository", json!("gpupool.local/e2e/probe")),
        ("tests.image.tag", json!("1")),
        ("tests.image.pullPolicy", json!("Never")),
        (
            "tests.nodeSelector",
            json!({"kubernetes.io/hostname": node}),
        ),
        ("tests.tolerations", toleration),
        (
            "tests.env",
            json!([
                {"name": "GPUPOOL_FAKE_NVML_FIXTURE", "value": format!("{FAKE_DIR}/fixture.yaml")},
                {"name": "GPUPOOL_FAKE_NVML_STATE", "value": format!("{FAKE_DIR}/nvml-state.json")},
            ]),
        ),
        (
            "tests.volumes",
            json!([{"name": "fake", "hostPath": {"path": fake_dir, "type": "Directory"}}]),
        ),
        (
            "tests.volumeMounts",
            json!([{"name": "fake", "mountPath": FAKE_DIR}]),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    sets.extend(host.chart_agent_values(kubelet)?);
    // The agent takes its driver root from the pool (through its GpuNode), as far as the node
    // trusts it: the fake root, and a symbolic link to it that the node must refuse.
    let driver_root = host.driver_root.display().to_string();
    let link = host.dir.join("driver-link");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&host.driver_root, &link)?;
    let link = link.display().to_string();
    sets.push(("agent.hostPaths.driverRoot".into(), json!("")));
    sets.push((
        "agent.allowedDriverRoots".into(),
        json!([driver_root.clone(), link.clone()]),
    ));
    let chart = repo_root().join("charts/gpupool").display().to_string();
    let set_json: Vec<String> = sets.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut args = vec!["install", release.as_str(), chart.as_str()];
    for set in &set_json {
        args.extend(["--set-json", set.as_str()]);
    }
    helm_in(cluster, scope.namespace(), &args)?;

    let installed = installed_chart_works(
        cluster,
        client,
        kubelet,
        scope,
        &release,
        &agent_ns,
        &node,
        &spec_path,
        uuid,
        fake_dir,
        (&driver_root, &link),
    )
    .await;
    let report = if installed.is_err() {
        format!(
            "agent:\n{}\noperator:\n{}",
            workload_report(
                client,
                kubelet,
                &agent_ns,
                "app.kubernetes.io/component=node-agent"
            )
            .await,
            workload_report(
                client,
                kubelet,
                scope.namespace(),
                "app.kubernetes.io/component=operator"
            )
            .await
        )
    } else {
        String::new()
    };
    let uninstalled = helm_in(
        cluster,
        scope.namespace(),
        &["uninstall", &release, "--wait", "--timeout", "3m"],
    );
    installed.with_context(|| report.clone())?;
    uninstalled.with_context(|| format!("the pre-delete hook:\n{}", report))?;
    // The hook deleted the pool while the operator ran; the operator's cleanup took the
    // node's labels with it.
    let labels = Api::<Node>::all(client.clone())
        .get(&node)
        .await?
        .metadata
        .labels
        .unwrap_or_default();
    let left: Vec<&String> = labels
        .keys()
        .filter(|k| k.starts_with("gpupool.io/"))
        .collect();
    ensure!(
        left.is_empty(),
        "helm uninstall left labels on {node}: {left:?}"
    );
    Ok(())
}

/// What the installed chart must do before and during `helm test` (see [`chart_on_node`]).
#[allow(clippy::too_many_arguments)]
async fn installed_chart_works(
    cluster: &Cluster,
    client: &Client,
    kubelet: &RealKubelet,
    scope: &TestScope,
    release: &str,
    agent_ns: &str,
    node: &str,
    spec_path: &Path,
    uuid: &str,
    fake_dir: &Path,
    (driver_root, link): (&str, &str),
) -> Result<()> {
    // A pool of this node, with the MIG layout the node already has and the driver root it
    // trusts: the operator hands the node its GpuNode, which the agent waits for.
    let (k, v) = scope.label();
    let pool_name = scope.name("pool");
    let pool: GpuPool = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "metadata": {"name": pool_name, "labels": {k: v}},
        "spec": {
            "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
            "driver": {"minVersion": "550"},
            "cdi": {"driverRoot": driver_root},
            "mig": {"strategy": "mixed", "layout": {"custom": [
                {"gpus": [0], "enabled": true, "profiles": {"1g.10gb": 3}},
            ]}},
        },
    }))?;
    scope.track_kind("gpupools.gpupool.io");
    let pools: Api<GpuPool> = Api::all(client.clone());
    pools.create(&PostParams::default(), &pool).await?;
    // The agent DaemonSet's pod: running, ready (validated, registered with the kubelet), spec
    // written.
    let agent_pods: Api<Pod> = Api::namespaced(client.clone(), agent_ns);
    let agent_pod = poll(
        "the agent DaemonSet's pod to be ready on the real node",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let pods = agent_pods
                .list(&ListParams::default().labels("app.kubernetes.io/component=node-agent"))
                .await?;
            Ok(pods.items.into_iter().find(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                    && p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
            }))
        },
    )
    .await?;
    poll(
        "the agent pod to write the CDI spec",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { Ok(spec_path.exists().then_some(())) },
    )
    .await?;
    let log = kubelet.container_log(&agent_pod, "agent")?;
    ensure!(
        log.contains("NVML found"),
        "the agent pod did not load the driver root's NVML:\n{log}"
    );

    let ready = poll(
        "the pool to be Ready from the agent pod's report",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let p = pools.get(&pool_name).await?;
            Ok(p.status
                .as_ref()
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
                .filter(|c| c.status == "True")
                .map(|_| p.clone()))
        },
    )
    .await;
    ready.with_context(|| {
        format!(
            "pool status: {}",
            serde_json::to_string(&pool).unwrap_or_default()
        )
    })?;
    wait_node_resources(
        client,
        node,
        "1 GPU and 3 × 1g.10gb from the agent pod",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1)), (MIG_1G, Some(3), Some(3))],
    )
    .await?;

    // The lease is held by one of the operator's pods, running here.
    let lease = Api::<Lease>::namespaced(client.clone(), scope.namespace())
        .get("gpupool-operator")
        .await
        .context("the operator's Lease")?;
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .context("the Lease has no holder")?;
    let operators = Api::<Pod>::namespaced(client.clone(), scope.namespace())
        .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
        .await?;
    let leader = operators
        .items
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(holder.as_str()))
        .with_context(|| format!("the Lease holder {holder} is no operator pod"))?;
    ensure!(
        phase(leader) == "Running"
            && leader.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node),
        "the leader is not running on {node}: {}",
        pod_summary(leader)
    );

    // `helm test`: its pod gets the GPU through the agent pod's plugin.
    // `--logs` would fetch them through the kubelet's server, by a node name this test bed
    // cannot resolve; the container's log is read from the runtime instead.
    let tested = helm_in(
        cluster,
        scope.namespace(),
        &["test", release, "--timeout", "3m"],
    );
    let pod_name = format!("{release}-gpupool-test-gpu");
    let log = match Api::<Pod>::namespaced(client.clone(), scope.namespace())
        .get(&pod_name)
        .await
    {
        Ok(pod) => kubelet.container_log(&pod, "gpu")?,
        Err(e) => format!("(test pod {pod_name}: {e})"),
    };
    eprintln!("e2e: helm test's pod printed:\n{log}");
    let out = tested.with_context(|| format!("the test pod printed:\n{log}"))?;
    ensure!(out.contains("Succeeded"), "helm test did not pass:\n{out}");
    ensure!(
        log.contains("ok: nvidia.com/gpu gave 1 device node(s), NVML lists 1 GPU(s)"),
        "unexpected test output:\n{log}"
    );
    ensure!(
        log.contains(&format!("(UUID: {uuid})")),
        "the test pod's NVML did not list the allocated GPU {uuid}:\n{log}"
    );
    mps_on_the_node(
        client, kubelet, scope, &pools, &pool_name, node, fake_dir, uuid,
    )
    .await?;
    trust_on_the_node(
        client,
        kubelet,
        scope,
        &pools,
        &pool_name,
        node,
        spec_path,
        fake_dir,
        (driver_root, link),
    )
    .await
}

/// The node decides which driver root it trusts (docs/security.md), on the real node with the
/// chart's agent pod: a pool naming `/tmp` gets no GpuNode with it (the operator's admission
/// policy refuses the write, and the pool's APIErrors says so); a pool naming a root the node
/// lists but reaches through a symbolic link is refused by the agent itself (its
/// DriverRootTrusted check names the rule), which keeps the spec it wrote and keeps serving: a
/// new GPU pod starts. Back on the real root, the check passes again.
#[allow(clippy::too_many_arguments)]
async fn trust_on_the_node(
    client: &Client,
    kubelet: &RealKubelet,
    scope: &TestScope,
    pools: &Api<GpuPool>,
    pool_name: &str,
    node: &str,
    spec_path: &Path,
    fake_dir: &Path,
    (driver_root, link): (&str, &str),
) -> Result<()> {
    let spec_before = fs::read_to_string(spec_path)?;
    let set_root = |root: &str| {
        let patch = json!({"spec": {"cdi": {"driverRoot": root}}});
        let pools = pools.clone();
        let pool_name = pool_name.to_owned();
        async move {
            pools
                .patch(
                    &pool_name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
        }
    };
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    set_root("/tmp").await?;
    poll(
        "the operator's GpuNode write with /tmp refused, in the pool's APIErrors",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || async {
            let p = pools.get(pool_name).await?;
            Ok(p.status
                .as_ref()
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == "APIErrors"))
                .filter(|c| {
                    c.status == "True"
                        && c.message.contains("may not give GpuNode")
                        && c.message.contains("/tmp")
                })
                .map(|_| ()))
        },
    )
    .await?;
    let gn = gpunodes.get(node).await?;
    ensure!(
        gn.spec.cdi.driver_root == driver_root,
        "the GpuNode's root changed to {}",
        gn.spec.cdi.driver_root
    );

    set_root(link).await?;
    let refusal = format!("driver root {link} is refused: {link} is a symbolic link");
    let trusted = |s: &gpupool_crds::node::GpuNodeStatus| {
        s.checks
            .iter()
            .find(|c| c.name == gpupool_crds::node::CheckName::DriverRootTrusted)
            .cloned()
    };
    wait_status(
        client,
        node,
        "the symlinked root refused by the agent pod",
        Duration::from_secs(60),
        |s| trusted(s).is_some_and(|c| !c.passed && c.message.contains(&refusal)),
    )
    .await?;
    ensure!(
        fs::read_to_string(spec_path)? == spec_before,
        "the CDI spec changed under a refused root"
    );
    let name = scope.name("after-refusal");
    let pod = probe_pod(
        scope,
        &name,
        node,
        PROBE_IMAGE,
        &["/probe"],
        Some(GPU),
        fake_dir,
        false,
    )?;
    run_probe(client, scope, kubelet, &pod)
        .await
        .context("a GPU pod after the refusal")?;
    delete_pod_and_wait(client, scope, &name).await?;

    set_root(driver_root).await?;
    wait_status(
        client,
        node,
        "the real root trusted again",
        Duration::from_secs(60),
        |s| trusted(s).is_some_and(|c| c.passed),
    )
    .await?;
    eprintln!(
        "e2e: trust on the real node: /tmp refused by admission, a symlinked root by the agent, \
         which kept its spec and served a new pod"
    );
    Ok(())
}

/// MPS on the real node: GPU 1 shared by two MPS clients. The agent pod runs the GPU's control
/// daemon (the fake driver's, chrooted into the host's `/` in its own mount namespace); both
/// clients' containers, started by runc through the chart's agent, see GPU 1's device node and
/// NVML lists GPU 1 and no other, the daemon's control pipe in `$CUDA_MPS_PIPE_DIRECTORY`, the daemon's
/// shared memory at `/dev/shm` (the file the daemon left there), and the pool's limits; neither
/// sees the MPS control program nor the driver root's `/tmp/nvidia-mps` (a tenant could stop or
/// reconfigure the daemon with the one, plant a socket through the other), and the GpuNode
/// says what MPS isolates: `Memory (tenants trusted)`.
#[allow(clippy::too_many_arguments)]
async fn mps_on_the_node(
    client: &Client,
    kubelet: &RealKubelet,
    scope: &TestScope,
    pools: &Api<GpuPool>,
    pool_name: &str,
    node: &str,
    fake_dir: &Path,
    uuid: &str,
) -> Result<()> {
    let patch = json!({"spec": {"sharing": {"mps": {
        "replicas": 2, "gpus": [1], "memoryLimit": "8Gi", "activeThreadPercentage": 50,
    }}}});
    pools
        .patch(
            pool_name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await?;
    wait_node_resources(
        client,
        node,
        "GPU 1 as two MPS clients, from the agent pod",
        Duration::from_secs(90),
        &[(GPU, Some(2), Some(2))],
    )
    .await?;
    let command = [
        "/bin/sh",
        "-c",
        "/probe && python3 /pyprobe.py \
         && if [ -p \"$CUDA_MPS_PIPE_DIRECTORY/control\" ]; then echo mps_pipe=ok; else echo mps_pipe=missing; fi \
         && if [ -e /dev/shm/gpupool-fake-mps ]; then echo mps_shm=ok; else echo mps_shm=missing; fi \
         && echo mps_limit=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT \
         && echo mps_threads=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE \
         && if [ -e /usr/bin/nvidia-cuda-mps-control ]; then echo mps_control=visible; else echo mps_control=absent; fi \
         && if [ -e /tmp/nvidia-mps ]; then echo host_mps_dir=visible; else echo host_mps_dir=absent; fi",
    ];
    let mut whole = control_nodes();
    whole.insert("/dev/nvidia1".into(), "195:1".into());
    for i in 0..2 {
        let name = scope.name(&format!("mps-{i}"));
        let pod = probe_pod(
            scope,
            &name,
            node,
            PROBE_IMAGE,
            &command,
            Some(GPU),
            fake_dir,
            false,
        )?;
        let (probe, _) = run_probe(client, scope, kubelet, &pod).await?;
        check_devices(&probe, &name, &whole)?;
        check_driver_loads(&probe, &name)?;
        ensure!(
            probe.all("pynvml_uuid") == [uuid.to_owned()],
            "{name}: nvidia-ml-py sees {:?}, want [{uuid}]",
            probe.all("pynvml_uuid")
        );
        for (key, want) in [
            ("mps_pipe", "ok"),
            ("mps_shm", "ok"),
            ("mps_limit", "0=8192M"),
            ("mps_threads", "50"),
            ("mps_control", "absent"),
            ("host_mps_dir", "absent"),
        ] {
            ensure!(
                probe.one(key)? == want,
                "{name}: {key}={}, want {want}",
                probe.one(key)?
            );
        }
        delete_pod_and_wait(client, scope, &name).await?;
    }
    let gpunode = Api::<GpuNode>::all(client.clone()).get(node).await?;
    let sharing = gpunode
        .status
        .as_ref()
        .and_then(|s| s.gpus.get(1))
        .and_then(|g| g.sharing.clone())
        .context("GPU 1 not shared in the GpuNode status")?;
    ensure!(
        sharing.mode == "MPS" && sharing.isolation == "Memory (tenants trusted)",
        "GPU 1 sharing in status: {sharing:?}"
    );
    eprintln!(
        "e2e: two MPS clients on the real node: GPU {uuid} only, the daemon's pipe and shm, the limits, no control program"
    );
    Ok(())
}

/// `helm` in `namespace` against the test cluster, through the chart tests' runner.
fn helm_in(cluster: &Cluster, namespace: &str, args: &[&str]) -> Result<String> {
    let mut all = args.to_vec();
    all.extend(["-n", namespace]);
    chart::helm(cluster.tools(), Some(cluster.kubeconfig()), &all)
}

#[tokio::test]
async fn gpu_pods_start_on_containerd_with_our_cdi_spec() -> Result<()> {
    if let Some(why) = skip_reason(Runtime::Containerd) {
        eprintln!("e2e: SKIPPED gpu_pods_start_on_containerd_with_our_cdi_spec: {why}");
        return Ok(());
    }
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "node")?;
    let kubelet = RealKubelet::up(cluster, Runtime::Containerd)?;
    let node = kubelet.node.clone();
    // GPU 0 split into three 1g.10gb slices, GPU 1 whole.
    let mig = NodeMigSpec {
        strategy: MigStrategy::Mixed,
        managed: true,
        layout_name: Some("gpu0-1g".into()),
        gpus: vec![GpuMigSpec {
            index: 0,
            enabled: true,
            profiles: BTreeMap::from([("1g.10gb".to_owned(), 3)]),
        }],
    };
    let mut host = GpuNodeHost::start(cluster, &scope, &kubelet, 2, mig, |s| {
        s.mig.state == MigState::Applied && s.gpus.first().is_some_and(|g| g.mig_devices.len() == 3)
    })
    .await?;
    let (agent, dir, driver) = (&host.agent, &host.dir, &host.driver_root);

    // 1. Capacity.
    wait_node_resources(
        &client,
        &node,
        "1 GPU and 3 × 1g.10gb in allocatable",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1)), (MIG_1G, Some(3), Some(3))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let gpu1_uuid = host
        .status
        .gpus
        .get(1)
        .map(|g| g.uuid.clone())
        .context("no GPU 1 in status")?;

    let mut whole = control_nodes();
    whole.insert("/dev/nvidia1".into(), "195:1".into());

    // 2. A whole GPU on a plain Debian image.
    let name = scope.name("whole");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    check_devices(&probe, &name, &whole)?;
    check_driver_loads(&probe, &name)?;
    ensure!(
        probe.one("ld_library_path")?.is_empty(),
        "{name}: LD_LIBRARY_PATH was set to {:?}; the image sets none and the spec must not",
        probe.one("ld_library_path")?
    );
    ensure!(
        probe.all("pynvml_uuid") == [gpu1_uuid.clone()],
        "{name}: nvidia-ml-py sees {:?}, want [{gpu1_uuid}]",
        probe.all("pynvml_uuid")
    );
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 3. The same, read-only root file system and a non-root user.
    let name = scope.name("restricted");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        true,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    ensure!(probe.one("uid")? == "1000", "{name}: not running as 1000");
    check_devices(&probe, &name, &whole)?;
    check_driver_loads(&probe, &name)?;
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 4. An image with NVIDIA's CUDA-image LD_LIBRARY_PATH: kept as the image set it, and the
    // loader takes the driver from /usr/local/nvidia/lib64.
    let name = scope.name("cuda-env");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_CUDA_ENV_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    check_driver_loads(&probe, &name)?;
    ensure!(
        probe.one("ld_library_path")? == "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
        "{name}: the image's LD_LIBRARY_PATH became {:?}",
        probe.one("ld_library_path")?
    );
    for lib in ["libcuda", "libnvml"] {
        let path = probe.one(&format!("{lib}_path"))?;
        ensure!(
            path.starts_with("/usr/local/nvidia/lib64/"),
            "{name}: {lib} loaded from {path}, want /usr/local/nvidia/lib64 (first in LD_LIBRARY_PATH)"
        );
    }
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 5. A MIG slice: the parent's node and the slice's capability nodes only.
    let name = scope.name("mig");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(MIG_1G),
        dir,
        false,
    )?;
    create_pod(&client, &scope, &pod).await?;
    let done = wait_pod(
        &client,
        &scope,
        &name,
        "the MIG pod to finish",
        Duration::from_secs(120),
        |p| matches!(phase(p), "Succeeded" | "Failed"),
    )
    .await?;
    let log = kubelet.container_log(&done, "probe")?;
    eprintln!("e2e: {name} {}; it printed:\n{log}", phase(&done));
    ensure!(phase(&done) == "Succeeded", "{name} failed");
    let probe = Probe::parse(&log);
    // The slice's capability nodes: one GPU instance's and one of its compute instances'
    // (mig-minors), of GPU 0.
    let caps: Vec<(String, String)> = probe
        .devices()
        .into_iter()
        .filter(|(p, _)| p.starts_with("/dev/nvidia-caps/"))
        .collect();
    ensure!(
        caps.len() == 2,
        "{name}: want the slice's two capability nodes (GPU instance and compute instance), got {caps:?}"
    );
    let mut slices = Vec::new();
    for gi in 0..15 {
        slices.push(mig_cap_minors(driver, 0, gi, 0)?);
    }
    let got: BTreeSet<String> = caps
        .iter()
        .filter_map(|(_, n)| n.split_once(':').map(|(_, m)| m.to_owned()))
        .collect();
    ensure!(
        slices.contains(&got),
        "{name}: capability minors {got:?} are no slice of GPU 0"
    );
    let mut mig = control_nodes();
    mig.insert("/dev/nvidia0".into(), "195:0".into());
    for (p, n) in &caps {
        mig.insert(p.clone(), n.clone());
    }
    check_devices(&probe, &name, &mig)?;
    check_driver_loads(&probe, &name)?;
    ensure!(
        probe.all("pynvml_mig_mode") == ["1"],
        "{name}: nvidia-ml-py sees MIG mode {:?} on the parent, want [1]",
        probe.all("pynvml_mig_mode")
    );
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 6. The spec deleted under the running agent: reported, rewritten, and pods start again.
    fs::remove_file(&agent.cdi_spec)
        .with_context(|| format!("removing {}", agent.cdi_spec.display()))?;
    let removed = Instant::now();
    poll(
        "the agent to write the CDI spec again",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { Ok(agent.cdi_spec.exists().then_some(())) },
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!(
        "e2e: the agent rewrote the deleted CDI spec after {:.1}s",
        removed.elapsed().as_secs_f64()
    );
    // Reported, not only healed: a Warning Event saying the spec went missing, then the
    // Normal one when it is back, and the condition True again.
    let missing = wait_event(&client, &node, "CdiSpecMissing")
        .await
        .with_context(|| agent.log_text())?;
    ensure!(
        missing.type_.as_deref() == Some("Warning"),
        "CdiSpecMissing is a {:?} Event",
        missing.type_
    );
    wait_event(&client, &node, "CdiSpecRestored").await?;
    wait_status(
        &client,
        &node,
        "CdiSpecReady=True after the rewrite",
        Duration::from_secs(30),
        |s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "CdiSpecReady" && c.status == "True")
        },
    )
    .await?;
    let name = scope.name("after-delete");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    check_driver_loads(&probe, &name)?;
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 7. The agent as the chart runs it: a container with a root file system of its own, the
    // host's `/` read-only at /host and nothing mounted over its /usr or /lib, NVML loaded by
    // full path from the driver root (whose /lib holds no loader at all). It writes the very
    // spec the host process wrote, naming host paths, and a GPU pod starts through it.
    let dir = dir.clone();
    let spec_path = host.agent.cdi_spec.clone();
    let spec_before = fs::read_to_string(&spec_path)?;
    host.agent.stop();
    fs::remove_file(&spec_path)?;
    ensure!(
        !host.driver_root.join("lib64/ld-linux-x86-64.so.2").exists()
            && !host.driver_root.join("lib/ld-2.31.so").exists(),
        "the driver root has a loader of its own"
    );
    host.agent_in_container(cluster, &kubelet)?;
    let agent = &host.agent;
    poll(
        "the agent's container to write the CDI spec",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async { Ok(spec_path.exists().then_some(())) },
    )
    .await
    .with_context(|| agent.log_text())?;
    let spec_after = fs::read_to_string(&spec_path)?;
    ensure!(
        spec_after == spec_before,
        "the containerized agent wrote another spec:\n--- host process\n{spec_before}\n--- container\n{spec_after}"
    );
    let log = agent.log_text();
    let nvml = format!(
        "/host{}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15",
        host.driver_root.display()
    );
    ensure!(
        log.contains("NVML found") && log.contains(&nvml),
        "the agent did not load NVML from the driver root by full path ({nvml}):\n{log}"
    );
    wait_node_resources(
        &client,
        &node,
        "1 GPU and 3 × 1g.10gb in allocatable from the containerized agent",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1)), (MIG_1G, Some(3), Some(3))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let name = scope.name("agent-container");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        &dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod)
        .await
        .with_context(|| agent.log_text())?;
    check_devices(&probe, &name, &whole)?;
    check_driver_loads(&probe, &name)?;
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 8. The chart on this node: our images in containerd, the agent DaemonSet's pod and the
    // operator's pods as real containers; the pool Ready, `helm test`'s GPU pod started
    // through the agent pod, and `helm uninstall` leaving nothing behind.
    chart_on_node(cluster, &client, &kubelet, &scope, &mut host, &gpu1_uuid).await?;

    drop(host);
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}
