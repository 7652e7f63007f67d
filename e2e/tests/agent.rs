//! The node agent (`gpupool-device-plugin`) against the real control plane: one agent process
//! per kwok GPU node, each with its own fixture, kubelet directory, CDI directory and fake
//! driver root; GpuNode objects are created by the tests (no operator runs here).
//!
//! - validation passes on a good node and fails with the CUDA message and an Event on an old
//!   driver (then passes once the pool's requirement is lowered);
//! - the CDI spec is written, well-formed, and rewritten only when its content changes;
//! - the CDI spec deleted under the running agent is reported (Event, `CdiSpecReady`
//!   condition) and rewritten; another spec claiming its devices is reported and left alone;
//! - another device plugin live on NVIDIA's socket name for `nvidia.com/gpu` is reported
//!   (`ForeignDevicePlugin` condition, Event) while the agent keeps serving, and a leftover
//!   socket file nobody listens on is not;
//! - a MIG layout walks Draining → Applying → Applied and the plugin serves the new resource;
//!   `kill -9` mid-Applying and a restart still end Applied with the right instances (NVML
//!   backend on the fake libnvidia-ml, whose state file stands in for the hardware);
//! - idleness: `idleSince` is set when the fixture's GPU goes idle and cleared when it is busy;
//! - a steady node costs no status writes (resourceVersion unchanged over 20 s).
//!
//! The agent binary and the fake NVML library are built with cargo on first use and copied to
//! a private directory (the shared target directory may be rebuilt by others meanwhile);
//! `GPUPOOL_AGENT_BIN` / `GPUPOOL_FAKE_NVML_LIB` point at prebuilt ones instead.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, ensure};
use gpupool_crds::node::{CheckName, GpuMigSpec, MigState, NodeMigSpec, UtilizationSpec, Verdict};
use gpupool_crds::policy::{CdiDeviceNameStrategy, DriverPolicy, MigStrategy};
use gpupool_crds::{GpuNode, GpuNodeSpec};
use gpupool_e2e::agent::{agent_binaries, events_for, fake_driver_root, wait_event, wait_status};
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, FAKE_NODE_LABEL, TestScope, crds, repo_root, strip_ansi};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

const DRIVER: &str = "550.54.15";

struct Binaries {
    agent: PathBuf,
    nvml: PathBuf,
}

static BINARIES: OnceLock<Result<Binaries, String>> = OnceLock::new();

fn build_binaries() -> Result<Binaries> {
    let private = repo_root().join(format!("target/e2e-agent-bin/{}", std::process::id()));
    let (agent, nvml) = agent_binaries(&private)?;
    Ok(Binaries { agent, nvml })
}

fn binaries() -> Result<&'static Binaries> {
    BINARIES
        .get_or_init(|| build_binaries().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow::anyhow!("agent binaries: {e}"))
}

/// The `i`-th kwok GPU node's name.
async fn kwok_node(client: &Client, i: usize) -> Result<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut names: Vec<String> = nodes
        .list(&ListParams::default().labels(FAKE_NODE_LABEL))
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    names.sort();
    names.get(i).cloned().with_context(|| {
        format!(
            "the agent tests need 3 fake GPU nodes; the cluster has {}",
            names.len()
        )
    })
}

/// One node's host: fixture, kubelet dir, CDI dir, fake driver root. The fixtures say
/// `device_nodes: ignored`: the agent runs on this host, which has no `/dev/nvidiaN`, and on a
/// GPU node it would see all of them.
struct NodeHost {
    node: String,
    dir: PathBuf,
    fixture: PathBuf,
    kubelet: PathBuf,
    cdi: PathBuf,
    driver_root: PathBuf,
    /// Stands in for `/dev/kmsg`: the kernel log the agent reads Xids from.
    kmsg: PathBuf,
}

impl NodeHost {
    fn new(scope: &TestScope, node: &str, fixture_yaml: &str, gpus: u32) -> Result<NodeHost> {
        let dir = scope.socket_dir();
        let _ = fs::remove_dir_all(&dir);
        let host = NodeHost {
            node: node.to_owned(),
            fixture: dir.join("fixture.yaml"),
            kubelet: dir.join("kubelet"),
            cdi: dir.join("cdi"),
            driver_root: dir.join("driver"),
            kmsg: dir.join("kmsg"),
            dir,
        };
        fs::create_dir_all(host.kubelet.join("device-plugins"))?;
        fs::write(&host.fixture, fixture_yaml)?;
        fs::write(&host.kmsg, "6,1,1000,-;Linux version 6.1.0 (e2e)\n")?;
        fake_driver_root(&host.driver_root, DRIVER, gpus)?;
        Ok(host)
    }

    fn spec_file(&self) -> PathBuf {
        self.cdi.join("gpupool-nvidia.yaml")
    }

    fn socket(&self, resource: &str) -> PathBuf {
        self.kubelet
            .join("device-plugins")
            .join(format!("gpupool-{}.sock", resource.replace('/', "-")))
    }
}

/// A running agent; killed (SIGKILL) on drop.
struct Agent {
    child: Child,
    log: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sim,
    /// NVML on the fake library.
    Nvml,
}

impl Agent {
    /// An agent told its driver root (`--driver-root`, the admin's own, trusted as it is).
    fn start(
        cluster: &Cluster,
        host: &NodeHost,
        backend: Backend,
        extra: &[&str],
    ) -> Result<Agent> {
        Agent::spawn(cluster, host, backend, extra, true)
    }

    /// An agent that takes its driver root from the GpuNode, as far as `extra`'s
    /// `--allowed-driver-roots` lets it.
    fn start_on_the_gpunodes_root(
        cluster: &Cluster,
        host: &NodeHost,
        backend: Backend,
        extra: &[&str],
    ) -> Result<Agent> {
        Agent::spawn(cluster, host, backend, extra, false)
    }

    fn spawn(
        cluster: &Cluster,
        host: &NodeHost,
        backend: Backend,
        extra: &[&str],
        configured_root: bool,
    ) -> Result<Agent> {
        let bins = binaries()?;
        let n = fs::read_dir(&host.dir)?.count();
        let log = host.dir.join(format!("agent-{n}.log"));
        let out = fs::File::create(&log)?;
        let mut cmd = Command::new(&bins.agent);
        cmd.arg("--node-name")
            .arg(&host.node)
            .arg("--kubelet-dir")
            .arg(&host.kubelet)
            .arg("--cdi-dir")
            .arg(&host.cdi);
        if configured_root {
            cmd.arg("--driver-root").arg(&host.driver_root);
        }
        cmd.arg("--proc-root")
            .arg(host.driver_root.join("proc"))
            .arg("--kmsg-path")
            .arg(&host.kmsg)
            .args([
                "--metrics-addr",
                "127.0.0.1:0",
                "--validate-interval-secs",
                "1",
            ])
            .args(extra)
            .env("KUBECONFIG", cluster.kubeconfig())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        match backend {
            Backend::Sim => {
                cmd.args(["--backend", "sim", "--fixture"])
                    .arg(&host.fixture);
            }
            Backend::Nvml => {
                cmd.args(["--backend", "nvml", "--nvml-lib"])
                    .arg(&bins.nvml)
                    .env("GPUPOOL_FAKE_NVML_FIXTURE", &host.fixture)
                    .env("GPUPOOL_FAKE_NVML_STATE", host.dir.join("nvml-state.json"));
            }
        }
        let child = cmd.spawn().context("starting the agent")?;
        Ok(Agent { child, log })
    }

    /// SIGTERM, then wait for it to exit.
    async fn terminate(mut self) -> Result<()> {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status()?;
        let child = &mut self.child;
        poll(
            "the agent to exit after SIGTERM",
            Duration::from_secs(20),
            Duration::from_millis(100),
            || {
                let exited = child.try_wait().map(|s| s.is_some());
                async move { Ok(exited?.then_some(())) }
            },
        )
        .await
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process still runs.
    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The address its metrics and health server listens on, from its log.
    fn metrics_addr(&self) -> Result<String> {
        let text = self.log_text();
        let line = text
            .lines()
            .map(strip_ansi)
            .find(|l| l.contains("serving /metrics"))
            .with_context(|| format!("the agent has not logged its address:\n{text}"))?;
        Ok(line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .with_context(|| format!("no addr= in {line:?}"))?
            .to_owned())
    }
}

/// `GET path` over a new connection; the whole answer.
async fn http_get(addr: &str, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    Ok(answer)
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn fresh_gpunode(
    client: &Client,
    scope: &TestScope,
    name: &str,
    spec: GpuNodeSpec,
) -> Result<GpuNode> {
    let api: Api<GpuNode> = Api::all(client.clone());
    if api.get_opt(name).await?.is_some() {
        api.delete(name, &DeleteParams::default()).await?;
        poll(
            "the old GpuNode to go",
            Duration::from_secs(30),
            Duration::from_millis(200),
            || {
                let api = api.clone();
                async move { Ok(api.get_opt(name).await?.is_none().then_some(())) }
            },
        )
        .await?;
    }
    let mut gn = GpuNode::new(name, spec);
    let (k, v) = scope.label();
    gn.metadata.labels = Some(BTreeMap::from([(k.to_owned(), v.to_owned())]));
    scope.track_kind("gpunodes.gpupool.io");
    Ok(api.create(&PostParams::default(), &gn).await?)
}

fn base_spec(pool: &str) -> GpuNodeSpec {
    GpuNodeSpec {
        sharing: Default::default(),
        pool: pool.to_owned(),
        driver: DriverPolicy {
            min_version: Some("550".into()),
            cuda_version: Some("12.4".into()),
            ..DriverPolicy::default()
        }
        .into(),
        cdi: Default::default(),
        mig: Default::default(),
        utilization: UtilizationSpec {
            idle_threshold: 5,
            sample_interval: Duration::from_secs(1).into(),
        },
    }
}

fn mtime(path: &Path) -> Result<SystemTime> {
    Ok(fs::metadata(path)?.modified()?)
}

#[tokio::test]
async fn agent_validates_writes_cdi_tracks_idleness_and_stays_quiet() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "agent-sim")?;
    let node = kwok_node(&client, 0).await?;
    // GPU 0 is busy for the first 8 s, idle, then busy again from 24 s; GPU 1 is idle.
    let fixture = format!(
        "node: {}\ndevice_nodes: ignored\ndriver: {{version: \"{DRIVER}\", cuda: \"12.4\"}}\ngpus:\n  - model: H100-SXM5-80GB\n    count: 2\nutilization:\n  - gpu: 0\n    busy:\n      - {{from: 0, to: 8, gpu: 90}}\n      - {{from: 24, gpu: 90}}\n",
        scope.prefix()
    );
    let host = NodeHost::new(&scope, &node, &fixture, 2)?;
    // A label the agent does not own must survive its label writes.
    cluster.kubectl().run([
        "label",
        "node",
        &node,
        "--overwrite",
        "e2e.gpupool.io/other=keep",
    ])?;
    fresh_gpunode(&client, &scope, &node, base_spec(scope.prefix())).await?;
    let mut agent = Agent::start(cluster, &host, Backend::Sim, &[])?;

    // Validation passes, every check reported.
    let gn = wait_status(
        &client,
        &node,
        "validated=True",
        Duration::from_secs(60),
        |s| s.validated == Some(Verdict::True) && s.gpu_count == 2 && s.cdi.is_some(),
    )
    .await
    .with_context(|| agent.log_text())?;
    let status = gn.status.clone().unwrap_or_default();
    let names: Vec<&str> = status.checks.iter().map(|c| c.name.as_str()).collect();
    for n in [
        "NVMLInit",
        "DriverVersion",
        "CUDAVersion",
        "KernelModule",
        "DeviceNodes",
        "ECCErrors",
        "PCIeReplay",
        "XidErrors",
        "PersistenceMode",
    ] {
        ensure!(names.contains(&n), "check {n} missing from {names:?}");
    }
    ensure!(
        status.checks.iter().all(|c| c.passed),
        "{:?}",
        status.checks
    );
    ensure!(status.driver_version.as_deref() == Some(DRIVER));
    ensure!(status.healthy_gpus == 2);
    wait_event(&client, &node, "ValidationPassed").await?;
    // PodResources socket is absent here: reported as a condition, and the agent keeps serving.
    ensure!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "PodResourcesAvailable" && c.status == "False"),
        "{:?}",
        status.conditions
    );

    // The CDI spec: written, well-formed, paths inside the driver root, no hooks.
    let cdi = status.cdi.clone().context("no cdi status")?;
    ensure!(Path::new(&cdi.path) == host.spec_file(), "{}", cdi.path);
    ensure!(
        cdi.digest.starts_with("sha256:") && cdi.digest.len() == 71,
        "{}",
        cdi.digest
    );
    let text = fs::read_to_string(host.spec_file())?;
    ensure!(fs::metadata(host.spec_file())?.permissions().mode() & 0o777 == 0o644);
    let spec: serde_yaml::Value = serde_yaml::from_str(&text)?;
    ensure!(spec["cdiVersion"] == "0.5.0", "{text}");
    ensure!(spec["kind"] == "gpupool.io/gpu", "{text}");
    ensure!(
        spec.get("hooks").is_none() && spec["containerEdits"].get("hooks").is_none(),
        "{text}"
    );
    let devices: Vec<String> = spec["devices"]
        .as_sequence()
        .context("no devices")?
        .iter()
        .filter_map(|d| d["name"].as_str().map(str::to_owned))
        .collect();
    for want in [
        "0",
        "1",
        "all",
        status.gpus[0].uuid.as_str(),
        status.gpus[1].uuid.as_str(),
    ] {
        ensure!(
            devices.iter().any(|d| d == want),
            "device {want} missing: {devices:?}"
        );
    }
    ensure!(cdi.devices as usize == devices.len());
    let root = fs::canonicalize(&host.driver_root)?.display().to_string();
    for line in text.lines().filter(|l| l.contains("hostPath:")) {
        let path = line.split("hostPath:").nth(1).unwrap_or_default().trim();
        ensure!(
            path.starts_with(&root),
            "hostPath outside the driver root: {path}"
        );
    }
    ensure!(host.socket("nvidia.com/gpu").exists(), "no plugin socket");

    // Hardware labels on the Node; the foreign label kept.
    let labels = Api::<Node>::all(client.clone())
        .get(&node)
        .await?
        .labels()
        .clone();
    ensure!(
        labels.get("gpupool.io/gpu.count").map(String::as_str) == Some("2"),
        "{labels:?}"
    );
    ensure!(
        labels.get("gpupool.io/gpu.product").map(String::as_str) == Some("NVIDIA-H100-80GB-HBM3"),
        "{labels:?}"
    );
    ensure!(
        labels.get("gpupool.io/driver.version").map(String::as_str) == Some(DRIVER),
        "{labels:?}"
    );
    ensure!(
        labels.get("gpupool.io/mig.capable").map(String::as_str) == Some("true"),
        "{labels:?}"
    );
    ensure!(
        labels.get("e2e.gpupool.io/other").map(String::as_str) == Some("keep"),
        "{labels:?}"
    );

    // Idleness: GPU 0 goes idle (idleSince set), then busy again (cleared).
    wait_status(
        &client,
        &node,
        "GPU 0 idleSince set",
        Duration::from_secs(40),
        |s| {
            s.gpus
                .first()
                .is_some_and(|g| g.idleness.idle_since.is_some())
        },
    )
    .await?;
    wait_status(
        &client,
        &node,
        "GPU 0 busy again, idleSince cleared",
        Duration::from_secs(40),
        |s| {
            s.gpus.first().is_some_and(|g| {
                g.idleness.idle_since.is_none()
                    && g.idleness.activity == gpupool_crds::node::Activity::Busy
            })
        },
    )
    .await?;
    let status = wait_status(&client, &node, "GPU 1 idle", Duration::from_secs(10), |s| {
        s.gpus
            .get(1)
            .is_some_and(|g| g.idleness.idle_since.is_some())
    })
    .await?;

    // Steady state: no status writes over a 20 s window, and the CDI spec is not rewritten.
    let rv = status.resource_version().context("no resourceVersion")?;
    let spec_mtime = mtime(&host.spec_file())?;
    let api: Api<GpuNode> = Api::all(client.clone());
    let window = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut interval = tokio::time::interval(Duration::from_millis(500));
    while tokio::time::Instant::now() < window {
        interval.tick().await;
        let now = api.get(&node).await?;
        ensure!(
            now.resource_version().as_deref() == Some(rv.as_str()),
            "status written during the steady window: {:?}",
            now.status
        );
    }
    ensure!(
        mtime(&host.spec_file())? == spec_mtime,
        "CDI spec rewritten without a change"
    );

    // A content change rewrites the spec: UUID names only.
    let patch = serde_json::json!({"spec": {"cdi": {"deviceNameStrategies": ["uuid"]}}});
    api.patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let old_digest = cdi.digest.clone();
    wait_status(
        &client,
        &node,
        "a new CDI digest",
        Duration::from_secs(30),
        |s| s.cdi.as_ref().is_some_and(|c| c.digest != old_digest),
    )
    .await?;
    let text = fs::read_to_string(host.spec_file())?;
    ensure!(
        !text.contains("name: '0'"),
        "index names still present:\n{text}"
    );
    ensure!(
        text.contains("cdiVersion: 0.5.0"),
        "host paths differ from container paths, so 0.5.0:\n{text}"
    );

    // The spec deleted under the running agent: a Warning Event and the condition, then the
    // spec is rewritten as it was and the condition is True again.
    let cdi_ready = |s: &gpupool_crds::node::GpuNodeStatus, status: &str, reason: &str| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "CdiSpecReady" && c.status == status && c.reason == reason)
    };
    wait_status(
        &client,
        &node,
        "CdiSpecReady=True",
        Duration::from_secs(30),
        |s| cdi_ready(s, "True", "SpecCurrent"),
    )
    .await?;
    let written = fs::read_to_string(host.spec_file())?;
    fs::remove_file(host.spec_file())?;
    let event = wait_event(&client, &node, "CdiSpecMissing")
        .await
        .with_context(|| agent.log_text())?;
    ensure!(event.type_.as_deref() == Some("Warning"));
    ensure!(
        event
            .message
            .as_deref()
            .is_some_and(|n| n.contains("was deleted")),
        "{:?}",
        event.message
    );
    let spec_path = host.spec_file();
    poll(
        "the spec rewritten as it was",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let same = fs::read_to_string(&spec_path).is_ok_and(|t| t == written);
            async move { Ok(same.then_some(())) }
        },
    )
    .await?;
    wait_event(&client, &node, "CdiSpecRestored").await?;
    wait_status(
        &client,
        &node,
        "CdiSpecReady=True after the rewrite",
        Duration::from_secs(30),
        |s| cdi_ready(s, "True", "SpecCurrent"),
    )
    .await?;

    // Another spec defining one of our devices under our kind: reported, never touched.
    let theirs = host.cdi.join("another-tool.yaml");
    let clash =
        "cdiVersion: 0.5.0\nkind: gpupool.io/gpu\ndevices:\n- name: all\n  containerEdits: {}\n";
    fs::write(&theirs, clash)?;
    let gn = wait_status(
        &client,
        &node,
        "CdiSpecReady=False, SpecConflict",
        Duration::from_secs(30),
        |s| cdi_ready(s, "False", "SpecConflict"),
    )
    .await?;
    let message = gn
        .status
        .unwrap_or_default()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "CdiSpecReady")
        .map(|c| c.message)
        .unwrap_or_default();
    ensure!(
        message.contains("another-tool.yaml") && message.contains("device all"),
        "{message}"
    );
    wait_event(&client, &node, "CdiSpecConflict").await?;
    ensure!(
        fs::read_to_string(&theirs)? == clash,
        "another tool's spec was changed"
    );
    ensure!(fs::read_to_string(host.spec_file())? == written);
    fs::remove_file(&theirs)?;
    wait_status(
        &client,
        &node,
        "CdiSpecReady=True once the other spec is gone",
        Duration::from_secs(30),
        |s| cdi_ready(s, "True", "SpecCurrent"),
    )
    .await?;

    // NVIDIA's device plugin on the same node: a live socket named like its socket for
    // nvidia.com/gpu is reported (condition, Warning Event) while the agent keeps serving; once
    // nothing listens on it (the file left behind) it is no conflict any more.
    let foreign = |s: &gpupool_crds::node::GpuNodeStatus, status: &str, reason: &str| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "ForeignDevicePlugin" && c.status == status && c.reason == reason)
    };
    wait_status(
        &client,
        &node,
        "ForeignDevicePlugin=False",
        Duration::from_secs(30),
        |s| foreign(s, "False", "NoneFound"),
    )
    .await?;
    let nvidia_socket = host.kubelet.join("device-plugins").join("nvidia-gpu.sock");
    let nvidia = std::os::unix::net::UnixListener::bind(&nvidia_socket)?;
    let gn = wait_status(
        &client,
        &node,
        "ForeignDevicePlugin=True, SameResource",
        Duration::from_secs(30),
        |s| foreign(s, "True", "SameResource"),
    )
    .await
    .with_context(|| agent.log_text())?;
    let message = gn
        .status
        .unwrap_or_default()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "ForeignDevicePlugin")
        .map(|c| c.message)
        .unwrap_or_default();
    ensure!(
        message.contains("nvidia-gpu.sock (nvidia.com/gpu)")
            && message.contains("nvidia.com/gpu.deploy.device-plugin=false"),
        "{message}"
    );
    let event = wait_event(&client, &node, "ForeignDevicePlugin").await?;
    ensure!(event.type_.as_deref() == Some("Warning"));
    ensure!(
        host.socket("nvidia.com/gpu").exists(),
        "the agent stopped serving"
    );
    drop(nvidia);
    wait_status(
        &client,
        &node,
        "ForeignDevicePlugin=False once nothing listens",
        Duration::from_secs(30),
        |s| foreign(s, "False", "NoneFound"),
    )
    .await?;
    wait_event(&client, &node, "ForeignDevicePluginGone").await?;
    fs::remove_file(&nvidia_socket)?;

    // SIGTERM: clean exit, plugin sockets removed; a restart leaves the unchanged spec alone.
    let socket = host.socket("nvidia.com/gpu");
    // Anyone who can reach the metrics port opens thousands of connections and sends nothing:
    // the agent still answers /healthz within a kubelet probe's 1 s, so no probe fails and the
    // kubelet never restarts it (and its MPS daemons with it).
    let addr = agent.metrics_addr()?;
    let mut flood = Vec::new();
    for _ in 0..3000 {
        flood.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .with_context(|| format!("connecting to the agent's metrics port {addr}"))?,
        );
    }
    let mut answered = 0;
    for _ in 0..3 {
        let probe = tokio::time::timeout(Duration::from_secs(1), http_get(&addr, "/healthz")).await;
        if let Ok(Ok(answer)) = probe {
            ensure!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            answered += 1;
        }
    }
    ensure!(
        answered == 3,
        "{} of 3 health probes went unanswered within 1 s behind 3,000 idle connections:\n{}",
        3 - answered,
        agent.log_text()
    );
    ensure!(
        agent.is_running(),
        "the agent exited:\n{}",
        agent.log_text()
    );
    drop(flood);

    agent.terminate().await?;
    ensure!(!socket.exists(), "plugin socket left behind after SIGTERM");
    let spec_mtime = mtime(&host.spec_file())?;
    let again = Agent::start(cluster, &host, Backend::Sim, &[])?;
    poll(
        "the restarted agent to serve",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let exists = socket.exists();
            async move { Ok(exists.then_some(())) }
        },
    )
    .await
    .with_context(|| again.log_text())?;
    ensure!(
        mtime(&host.spec_file())? == spec_mtime,
        "restart rewrote an unchanged CDI spec"
    );

    // The GpuNode deleted (the node left every pool, or gpupool is being uninstalled): the
    // agent takes its hardware-fact labels off; labels others set stay.
    Api::<GpuNode>::all(client.clone())
        .delete(&node, &DeleteParams::default())
        .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let labels = poll(
        "the agent to take its labels off the Node",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let labels = nodes.get(&node).await?.labels().clone();
            Ok((!labels.keys().any(|k| k.starts_with("gpupool.io/"))).then_some(labels))
        },
    )
    .await
    .with_context(|| again.log_text())?;
    ensure!(
        labels.get("e2e.gpupool.io/other").map(String::as_str) == Some("keep"),
        "{labels:?}"
    );
    again.terminate().await?;
    Ok(())
}

/// The node decides which driver root it trusts (docs/security.md): an agent taking its root
/// from the GpuNode uses it only while its `--allowed-driver-roots` lists it and no component
/// on the way is a symbolic link. A refused root fails the DriverRootTrusted check naming the
/// rule, with a Warning Event; the node keeps the root it last trusted: the CDI spec stays as
/// it was and the plugin keeps serving. Back on a trusted root, the check passes again.
#[tokio::test]
async fn a_driver_root_the_node_does_not_trust_is_refused_and_the_node_keeps_serving() -> Result<()>
{
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "agent-trust")?;
    // A node of this test's own (the three shared fake nodes each belong to another test, whose
    // Events and GpuNode this one must not touch), without the fake-node label those are
    // counted by.
    let node = scope.name("n0");
    scope.track_kind("nodes");
    let (k, v) = scope.label();
    cluster.kubectl().run_with_stdin(
        ["create", "-f", "-"],
        Some(
            &serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {
                    "name": node,
                    "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
                    "labels": {k: v, "kubernetes.io/hostname": node, "type": "kwok"},
                },
            })
            .to_string(),
        ),
    )?;
    let fixture = format!(
        "node: {}\ndevice_nodes: ignored\ndriver: {{version: \"{DRIVER}\", cuda: \"12.4\"}}\ngpus:\n  - model: H100-SXM5-80GB\n    count: 2\n",
        scope.prefix()
    );
    let host = NodeHost::new(&scope, &node, &fixture, 2)?;
    let root = host.driver_root.display().to_string();
    let link = host.dir.join("driver-link");
    std::os::unix::fs::symlink(&host.driver_root, &link)?;
    let link = link.display().to_string();
    let mut spec = base_spec(scope.prefix());
    Arc::make_mut(&mut spec.cdi).driver_root = root.clone();
    fresh_gpunode(&client, &scope, &node, spec).await?;
    let allowed = format!("--allowed-driver-roots={root},{link}");
    let mut agent =
        Agent::start_on_the_gpunodes_root(cluster, &host, Backend::Sim, &[allowed.as_str()])?;
    let trusted = |s: &gpupool_crds::node::GpuNodeStatus| {
        s.checks
            .iter()
            .find(|c| c.name == CheckName::DriverRootTrusted)
            .cloned()
    };
    wait_status(
        &client,
        &node,
        "the GpuNode's root trusted",
        Duration::from_secs(60),
        |s| s.validated == Some(Verdict::True) && trusted(s).is_some_and(|c| c.passed),
    )
    .await
    .with_context(|| agent.log_text())?;
    let spec_before = fs::read_to_string(host.spec_file())
        .with_context(|| format!("no CDI spec written from {root}"))?;
    let canonical = fs::canonicalize(&host.driver_root)?;
    ensure!(
        spec_before.contains(&canonical.display().to_string()),
        "the spec names the root's files"
    );

    let api: Api<GpuNode> = Api::all(client.clone());
    for (asked, refusal) in [
        (
            "/tmp".to_owned(),
            format!("driver root /tmp is refused: this node trusts only {root}, {link}"),
        ),
        (
            link.clone(),
            format!("driver root {link} is refused: {link} is a symbolic link"),
        ),
    ] {
        let patch = serde_json::json!({"spec": {"cdi": {"driverRoot": asked}}});
        api.patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let gn = wait_status(
            &client,
            &node,
            "the root refused",
            Duration::from_secs(30),
            |s| trusted(s).is_some_and(|c| !c.passed && c.message.contains(&refusal)),
        )
        .await
        .with_context(|| agent.log_text())?;
        let status = gn.status.unwrap_or_default();
        let check = trusted(&status).context("no DriverRootTrusted check")?;
        ensure!(
            check
                .message
                .contains(&format!("still using {root}, the last trusted root")),
            "{}",
            check.message
        );
        ensure!(status.validated == Some(Verdict::False));
        ensure!(
            fs::read_to_string(host.spec_file())? == spec_before,
            "the CDI spec changed under a refused root"
        );
        ensure!(
            host.socket("nvidia.com/gpu").exists(),
            "the plugin stopped serving"
        );
        ensure!(agent.is_running(), "{}", agent.log_text());
    }
    let event = wait_event(&client, &node, "ValidationFailed").await?;
    ensure!(event.type_.as_deref() == Some("Warning"));
    ensure!(
        event
            .message
            .unwrap_or_default()
            .contains("DriverRootTrusted"),
        "the Event names the check"
    );

    let patch = serde_json::json!({"spec": {"cdi": {"driverRoot": root}}});
    api.patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_status(
        &client,
        &node,
        "trusted again",
        Duration::from_secs(30),
        |s| s.validated == Some(Verdict::True) && trusted(s).is_some_and(|c| c.passed),
    )
    .await
    .with_context(|| agent.log_text())?;
    Ok(())
}

#[tokio::test]
async fn agent_reports_failed_validation_with_message_and_event() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "agent-old-driver")?;
    let node = kwok_node(&client, 1).await?;
    // GPU 1 reports an uncorrectable ECC error 15 s after the agent starts.
    let fixture = "node: old-driver-e2e\ndevice_nodes: ignored\ndriver: {version: \"535.104.05\", cuda: \"12.2\"}\ngpus:\n  - model: A100-SXM4-40GB\n    count: 2\nfaults:\n  - {at: 15, gpu: 1, fault: {double_bit_ecc: 1}}\n";
    let host = NodeHost::new(&scope, &node, fixture, 2)?;
    fs::write(
        host.driver_root.join("proc/driver/nvidia/version"),
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05\n",
    )?;
    let mut spec = base_spec(scope.prefix());
    Arc::make_mut(&mut spec.driver).min_version = Some("550.54.15".into());
    fresh_gpunode(&client, &scope, &node, spec).await?;
    let agent = Agent::start(cluster, &host, Backend::Sim, &[])?;

    let gn = wait_status(
        &client,
        &node,
        "validated=False",
        Duration::from_secs(60),
        |s| s.validated == Some(Verdict::False),
    )
    .await
    .with_context(|| agent.log_text())?;
    let status = gn.status.unwrap_or_default();
    let cuda = status
        .checks
        .iter()
        .find(|c| c.name == CheckName::CudaVersion)
        .context("no CUDAVersion check")?;
    ensure!(!cuda.passed);
    ensure!(
        cuda.message
            == "driver 535.104.05 supports CUDA 12.2; pool requires 12.4: upgrade the driver to ≥ 550.54.14",
        "{}",
        cuda.message
    );
    let version = status
        .checks
        .iter()
        .find(|c| c.name == CheckName::DriverVersion)
        .context("no DriverVersion")?;
    ensure!(
        !version.passed
            && version.message.contains("535.104.05")
            && version.message.contains("550.54.15")
    );
    let failed: Vec<&str> = status
        .checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name.as_str())
        .collect();
    ensure!(failed == ["DriverVersion", "CUDAVersion"], "{failed:?}");
    let event = wait_event(&client, &node, "ValidationFailed").await?;
    ensure!(event.type_.as_deref() == Some("Warning"));
    ensure!(event.message.unwrap_or_default().contains("CUDA 12.2"));

    // The pool lowers its requirement: the node passes, with an Event.
    let api: Api<GpuNode> = Api::all(client.clone());
    let patch =
        serde_json::json!({"spec": {"driver": {"minVersion": "535", "cudaVersion": "12.2"}}});
    api.patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_status(
        &client,
        &node,
        "validated=True after lowering",
        Duration::from_secs(30),
        |s| s.validated == Some(Verdict::True),
    )
    .await?;
    wait_event(&client, &node, "ValidationPassed").await?;

    // The kernel logs a fatal Xid for GPU 0 (as the driver would, by PCI address): the XidErrors
    // check fails naming the GPU. The fixture's driver is older than the agent's start, so the
    // kernel log is how an Xid from before the agent started is seen.
    let pci = status.gpus[0].pci_bus_id.to_ascii_lowercase();
    let kernel_form = pci
        .rsplit_once('.')
        .map(|(a, _)| a)
        .and_then(|a| a.get(a.len().saturating_sub(10)..))
        .with_context(|| format!("odd PCI bus id {pci}"))?
        .to_owned();
    let mut log = fs::OpenOptions::new().append(true).open(&host.kmsg)?;
    writeln!(
        log,
        "3,2,2000,-;NVRM: Xid (PCI:{kernel_form}): 79, pid=0, name=, GPU has fallen off the bus."
    )?;
    drop(log);
    let gn = wait_status(
        &client,
        &node,
        "XidErrors failed from the kernel log",
        Duration::from_secs(30),
        |s| {
            s.checks
                .iter()
                .any(|c| c.name == CheckName::XidErrors && !c.passed)
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    let xid = gn
        .status
        .unwrap_or_default()
        .checks
        .into_iter()
        .find(|c| c.name == CheckName::XidErrors)
        .context("no XidErrors check")?;
    ensure!(xid.message.ends_with("GPU 0: Xid 79"), "{}", xid.message);

    // The ECC fault: the GPU turns unhealthy, the ECC check fails, each with an Event.
    let gn = wait_status(
        &client,
        &node,
        "GPU 1 unhealthy",
        Duration::from_secs(40),
        |s| {
            s.gpus
                .get(1)
                .is_some_and(|g| g.health == gpupool_crds::node::Health::Unhealthy)
                && s.checks
                    .iter()
                    .any(|c| c.name == CheckName::EccErrors && !c.passed)
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    let status = gn.status.unwrap_or_default();
    ensure!(status.healthy_gpus == 1, "{}", status.healthy_gpus);
    ensure!(status.validated == Some(Verdict::False));
    let unhealthy = wait_event(&client, &node, "DeviceUnhealthy").await?;
    ensure!(unhealthy.message.unwrap_or_default().contains("GPU 1"));
    poll(
        "a ValidationFailed Event naming ECCErrors",
        Duration::from_secs(30),
        Duration::from_millis(250),
        || {
            let client = &client;
            let node = &node;
            async move {
                let events = events_for(client, node, "ValidationFailed").await?;
                Ok(events
                    .iter()
                    .any(|e| {
                        e.message
                            .as_deref()
                            .is_some_and(|m| m.contains("ECCErrors"))
                    })
                    .then_some(()))
            }
        },
    )
    .await?;
    agent.terminate().await
}

#[tokio::test]
async fn agent_applies_mig_layout_and_completes_it_after_kill_9() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "agent-mig")?;
    let node = kwok_node(&client, 2).await?;
    // A compute process runs on GPU 0 for the first 12 s after NVML starts: the agent must
    // wait for it (Draining) before touching the GPU.
    let fixture = format!(
        "node: {}\ndevice_nodes: ignored\ndriver: {{version: \"{DRIVER}\", cuda: \"12.4\"}}\ngpus:\n  - model: H100-SXM5-80GB\n    count: 2\nutilization:\n  - gpu: 0\n    processes:\n      - {{pid: 4242, used_memory_mib: 1024, from: 0, to: 12}}\n",
        scope.prefix()
    );
    let host = NodeHost::new(&scope, &node, &fixture, 2)?;
    let mut spec = base_spec(scope.prefix());
    std::sync::Arc::make_mut(&mut spec.mig).strategy = MigStrategy::Mixed;
    Arc::make_mut(&mut spec.cdi).device_name_strategies =
        vec![CdiDeviceNameStrategy::Index, CdiDeviceNameStrategy::Uuid];
    fresh_gpunode(&client, &scope, &node, spec).await?;

    // Record every MIG state the apiserver shows, in order.
    let api: Api<GpuNode> = Api::all(client.clone());
    let states: Arc<Mutex<Vec<MigState>>> = Arc::default();
    let recorder = {
        let (states, api, node) = (states.clone(), api.clone(), node.clone());
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(Duration::from_millis(100));
            loop {
                interval.tick().await;
                let Ok(gn) = api.get(&node).await else {
                    continue;
                };
                let Some(s) = gn.status else { continue };
                if let Ok(mut v) = states.lock()
                    && v.last() != Some(&s.mig.state)
                {
                    v.push(s.mig.state);
                }
            }
        })
    };

    // No kubelet runs here, so no pod can hold a device: said so, the drain need not wait for
    // a PodResources answer that will never come (a real node always has one).
    let agent = Agent::start(
        cluster,
        &host,
        Backend::Nvml,
        &["--mig-step-delay-ms", "700", "--no-kubelet"],
    )?;
    wait_status(
        &client,
        &node,
        "validated on the NVML backend",
        Duration::from_secs(60),
        |s| s.validated == Some(Verdict::True) && s.gpu_count == 2,
    )
    .await
    .with_context(|| agent.log_text())?;
    ensure!(host.socket("nvidia.com/gpu").exists());

    // Ask for 7 × 1g.10gb on GPU 0 only.
    let layout = NodeMigSpec {
        strategy: MigStrategy::Mixed,
        managed: true,
        layout_name: Some("all-1g.10gb".into()),
        gpus: vec![GpuMigSpec {
            index: 0,
            enabled: true,
            profiles: BTreeMap::from([("1g.10gb".to_owned(), 7)]),
        }],
    };
    let patch = serde_json::json!({"spec": {"mig": layout}});
    let generation = api
        .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?
        .metadata
        .generation;
    wait_status(
        &client,
        &node,
        "MIG Applying",
        Duration::from_secs(30),
        |s| s.mig.state == MigState::Applying,
    )
    .await
    .with_context(|| agent.log_text())?;
    // Kill -9 once a few GPU instances exist.
    poll(
        "two GPU instances created",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let n = agent.log_text().matches("creating GPU instance").count();
            async move { Ok((n >= 2).then_some(())) }
        },
    )
    .await?;
    drop(agent);
    let created = fs::read_to_string(host.dir.join("nvml-state.json")).unwrap_or_default();
    ensure!(!created.is_empty(), "the fake NVML kept no state");

    let agent = Agent::start(cluster, &host, Backend::Nvml, &["--no-kubelet"])?;
    let gn = wait_status(
        &client,
        &node,
        "MIG Applied after restart",
        Duration::from_secs(60),
        |s| s.mig.state == MigState::Applied && s.mig.observed_generation == generation,
    )
    .await
    .with_context(|| agent.log_text())?;
    let status = gn.status.unwrap_or_default();
    let gpu0 = &status.gpus[0];
    ensure!(gpu0.mig_enabled);
    let profiles: Vec<&str> = gpu0.mig_devices.iter().map(|m| &*m.profile).collect();
    ensure!(profiles == ["1g.10gb"; 7], "{profiles:?}");
    let mut gis: Vec<u32> = gpu0.mig_devices.iter().map(|m| m.gpu_instance).collect();
    gis.sort();
    gis.dedup();
    ensure!(gis.len() == 7, "seven distinct GPU instances: {gis:?}");
    ensure!(
        !status.gpus[1].mig_enabled && status.gpus[1].mig_devices.is_empty(),
        "GPU 1 was touched"
    );

    // The plugin serves the new resource, and the CDI spec names the MIG devices.
    poll(
        "the mig-1g.10gb plugin socket",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let ok = host.socket("nvidia.com/mig-1g.10gb").exists();
            async move { Ok(ok.then_some(())) }
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    let text = fs::read_to_string(host.spec_file())?;
    for j in 0..7 {
        ensure!(
            text.contains(&format!("name: 0:{j}")) || text.contains(&format!("name: '0:{j}'")),
            "0:{j} missing"
        );
    }
    for m in &gpu0.mig_devices {
        ensure!(
            text.contains(&m.uuid),
            "{} missing from the CDI spec",
            m.uuid
        );
    }
    ensure!(text.contains("/dev/nvidia-caps/nvidia-cap"));

    // The recorder samples every 100 ms: give it the time to see the Applied that
    // `wait_status` already saw, before judging the order.
    let _ = poll(
        "the recorder to see Applied",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let last = states.lock().ok().and_then(|v| v.last().copied());
            async move { Ok((last == Some(MigState::Applied)).then_some(())) }
        },
    )
    .await;
    let seen = states.lock().map(|v| v.clone()).unwrap_or_default();
    let pos = |s: MigState| seen.iter().position(|x| *x == s);
    ensure!(
        matches!((pos(MigState::Draining), pos(MigState::Applying)), (Some(d), Some(a)) if d < a),
        "states seen: {seen:?}"
    );
    ensure!(
        seen.last() == Some(&MigState::Applied),
        "states seen: {seen:?}"
    );
    wait_event(&client, &node, "MigApplied").await?;
    recorder.abort();
    agent.terminate().await
}
