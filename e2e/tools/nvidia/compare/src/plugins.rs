//! Both device plugins as processes, registered with the same kubelet stand-in
//! (`gpupool_device_plugin::plugin::testing::KubeletStandin`).
//!
//! NVIDIA's plugin creates its sockets in the compiled-in
//! `/var/lib/kubelet/device-plugins/`; only the kubelet socket is a flag. It runs in a
//! private mount namespace (`unshare -m`) where a temp directory is bind-mounted over
//! `/var/lib`, and another over `/run` (where it writes its CDI spec), so the host is never
//! touched and the stand-in, outside the namespace, serves the same directory. Ours is the
//! `serve-ours` child of this binary: our NVML backend, inventory, advertisement, health
//! monitor fed by NVML events, and `run_plugins`, as the agent wires them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpupool_crds::policy::{CdiDeviceNameStrategy, MigStrategy as CrdMigStrategy, SharingPolicy};
use gpupool_device_plugin::backend::{self, HealthEventKind as BackendKind};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::plugin::api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse, Device,
};
use gpupool_device_plugin::plugin::testing::{KubeletEvent, KubeletStandin};
use gpupool_device_plugin::plugin::{
    HealthEvent, HealthEventKind, HealthMonitor, HealthPolicy, HealthTarget, PluginConfig,
    PluginMetrics, PluginRuntime, Topology, run_plugins,
};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::cdi_cmp::HOOK_PATH;
use crate::node::{FakeNode, backend as nvml_backend};

/// Which implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    /// NVIDIA's k8s-device-plugin.
    Nvidia,
    /// gpupool.
    Gpupool,
}

impl Side {
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Side::Nvidia => "nvidia",
            Side::Gpupool => "gpupool",
        }
    }
}

/// A plugin process with its kubelet stand-in.
pub struct Running {
    /// The stand-in the plugin registered with.
    pub kubelet: KubeletStandin,
    /// The process.
    pub child: Child,
    /// When the process was spawned.
    pub started: Instant,
    /// Its pid, for VmRSS.
    pub pid: u32,
    /// The plugin's stderr (log) file.
    pub log: PathBuf,
}

/// How long a registration may take (NVIDIA's plugin retries a failed round after 30 s).
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(45);
/// What NVIDIA's plugin logs before retrying a registration round.
const RETRY_MARK: &str = "Failed to start one or more plugins";
/// After the last registration, how long without a new one before the set counts as complete.
pub const QUIET: Duration = Duration::from_millis(1500);

/// Starts one side's plugin for `strategy` in `work` (a fresh directory).
pub async fn start(
    side: Side,
    node: &FakeNode,
    strategy: &str,
    work: &Path,
    nvidia_plugin: &Path,
    self_exe: &Path,
) -> Result<Running> {
    if work.exists() {
        fs::remove_dir_all(work)?;
    }
    let log = work.join("plugin.log");
    match side {
        Side::Nvidia => {
            let var_lib = work.join("var-lib");
            let run = work.join("run");
            let plugin_dir = var_lib.join("kubelet/device-plugins");
            fs::create_dir_all(&plugin_dir)?;
            fs::create_dir_all(run.join("cdi"))?;
            let kubelet = KubeletStandin::start(&short_path(&plugin_dir)?).await?;
            let mut command = Command::new("unshare");
            command
                .args(crate::node::host_namespace_args(
                    node,
                    &[(var_lib.clone(), "/var/lib"), (run.clone(), "/run")],
                    nvidia_plugin,
                ))
                .arg(format!("--mig-strategy={strategy}"))
                .arg("--device-list-strategy=cdi-cri")
                .arg("--device-id-strategy=uuid")
                .arg("--fail-on-init-error=true")
                .arg(format!("--driver-root={}", node.root().display()))
                .arg(format!("--dev-root={}", node.root().display()))
                .arg(format!("--container-driver-root={}", node.root().display()))
                .arg(format!("--nvidia-cdi-hook-path={HOOK_PATH}"))
                // A relative socket path, run from the socket directory: grpc-go uses the dial
                // target as the HTTP/2 :authority, and the stand-in's HTTP/2 server (h2, under
                // tonic) resets a stream whose authority is a path (PROTOCOL_ERROR). The real
                // kubelet is a Go server and accepts it; NVIDIA's plugin sets no authority.
                .arg("--kubelet-socket=kubelet.sock")
                .current_dir(&plugin_dir);
            for (k, v) in node.env() {
                command.env(k, v);
            }
            command.env("LD_LIBRARY_PATH", node.root().join(crate::node::LIB_DIR));
            spawn(command, kubelet, &log)
        }
        Side::Gpupool => {
            let plugin_dir = short_path(&work.join("kubelet"))?;
            fs::create_dir_all(&plugin_dir)?;
            let kubelet = KubeletStandin::start(&plugin_dir).await?;
            let mut command = Command::new(self_exe);
            command
                .arg("serve-ours")
                .arg(&node.dir)
                .arg(&plugin_dir)
                .arg(strategy);
            for (k, v) in node.env() {
                command.env(k, v);
            }
            spawn(command, kubelet, &log)
        }
    }
}

/// Starts the health floor (`crate::floor`, the `serve-health-floor` child) in `work` (a fresh
/// directory), registered with a stand-in as the plugins are.
pub async fn start_health_floor(node: &FakeNode, work: &Path, self_exe: &Path) -> Result<Running> {
    if work.exists() {
        fs::remove_dir_all(work)?;
    }
    let plugin_dir = short_path(&work.join("kubelet"))?;
    let kubelet = KubeletStandin::start(&plugin_dir).await?;
    let mut command = Command::new(self_exe);
    command
        .arg("serve-health-floor")
        .arg(&node.dir)
        .arg(&plugin_dir);
    for (k, v) in node.env() {
        command.env(k, v);
    }
    spawn(command, kubelet, &work.join("floor.log"))
}

/// A short symlink to `dir` in the temp directory: unix socket paths are limited to 107 bytes,
/// and `<work>/<scenario>/…/kubelet/device-plugins/nvidia-mig-1g.10gb.sock` can exceed that
/// (the stand-in's dial-back then fails with a transport error). Made once per directory.
fn short_path(dir: &Path) -> Result<PathBuf> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    fs::create_dir_all(dir)?;
    let link = std::env::temp_dir().join(format!(
        "gpnv{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(dir, &link)?;
    Ok(link)
}

fn spawn(mut command: Command, kubelet: KubeletStandin, log: &Path) -> Result<Running> {
    let file = fs::File::create(log)?;
    command
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .kill_on_drop(true);
    let started = Instant::now();
    let child = command.spawn().context("spawning the plugin")?;
    let pid = child.id().context("plugin exited at once")?;
    Ok(Running {
        kubelet,
        child,
        started,
        pid,
        log: log.to_path_buf(),
    })
}

/// What a plugin registered and advertised.
#[derive(Debug, Default, Clone)]
pub struct Registered {
    /// Resource → advertised devices (the first list).
    pub resources: BTreeMap<String, Vec<Device>>,
    /// Time from spawn to the last registration's first device list.
    pub took: Duration,
    /// Set when the process exited instead (its log tail).
    pub exited: Option<String>,
    /// Registration rounds NVIDIA's plugin had to retry (its log says so).
    pub retries: usize,
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

impl Running {
    /// Waits for registrations until none arrives for [`QUIET`] (or the process exits).
    pub async fn registered(&mut self) -> Result<Registered> {
        let mut out = Registered::default();
        let deadline = Instant::now() + REGISTER_TIMEOUT;
        let mut pending: BTreeSet<String> = BTreeSet::new();
        let mut retries_seen = 0;
        let mut waiting_for_retry = false;
        loop {
            let wait = if (out.resources.is_empty() && pending.is_empty()) || waiting_for_retry {
                deadline.saturating_duration_since(Instant::now())
            } else {
                QUIET
            };
            if wait.is_zero() {
                bail!("no registration within {REGISTER_TIMEOUT:?}");
            }
            tokio::select! {
                status = self.child.wait() => {
                    out.exited = Some(format!("exited ({}): {}", status?, log_tail(&self.log)));
                    return Ok(out);
                }
                event = self.kubelet.next_event(wait) => match event {
                    Some(KubeletEvent::Registered { request, .. }) => {
                        waiting_for_retry = false;
                        pending.insert(request.resource_name);
                    }
                    Some(KubeletEvent::Devices { resource, devices }) => {
                        if pending.remove(&resource) {
                            out.took = self.started.elapsed();
                        }
                        out.resources.entry(resource).or_insert(devices);
                    }
                    Some(KubeletEvent::StreamClosed { .. }) => {}
                    None if pending.is_empty() => {
                        // NVIDIA's plugin restarts every resource 30 s after one failed to
                        // register (seen under load: the stand-in's dial-back failing); wait
                        // for that round rather than report a partial set.
                        let retries = fs::read_to_string(&self.log)
                            .unwrap_or_default()
                            .matches(RETRY_MARK)
                            .count();
                        if retries > retries_seen {
                            retries_seen = retries;
                            out.retries = retries;
                            waiting_for_retry = true;
                            continue;
                        }
                        return Ok(out);
                    }
                    None => {}
                },
            }
        }
    }

    /// One Allocate for `ids` of `resource`.
    pub async fn allocate(
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<ContainerAllocateResponse> {
        let mut client = self
            .kubelet
            .client(resource)
            .with_context(|| format!("no client for {resource}"))?;
        let response = client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: ids.to_vec(),
                }],
            })
            .await?
            .into_inner();
        response
            .container_responses
            .into_iter()
            .next()
            .context("empty Allocate response")
    }

    /// Stops the process (SIGTERM, then kill) and the stand-in.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status();
            if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
                .await
                .is_err()
            {
                let _ = self.child.kill().await;
            }
        }
        let link = self.kubelet.socket_path().parent().map(Path::to_path_buf);
        self.kubelet.shutdown().await;
        if let Some(link) = link.filter(|l| l.is_symlink()) {
            let _ = fs::remove_file(link);
        }
    }
}

/// VmRSS of a process, KiB.
pub fn vm_rss_kib(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The `serve-ours` child: our plugin stack on the fake library until SIGTERM.
pub async fn serve_ours(node_dir: &Path, plugin_dir: &Path, strategy: &str) -> Result<()> {
    let node = FakeNode::open(node_dir)?;
    let backend: Arc<dyn backend::GpuBackend> = Arc::new(nvml_backend(&node)?);
    let inventory =
        Inventory::read(backend.as_ref()).map_err(|e| anyhow::anyhow!("inventory: {e}"))?;
    let strategy = match strategy {
        "none" => CrdMigStrategy::None,
        "single" => CrdMigStrategy::Single,
        "mixed" => CrdMigStrategy::Mixed,
        other => bail!("unknown strategy {other:?}"),
    };
    let advertisement = gpupool_device_plugin::agent::advertisement(
        &inventory,
        strategy,
        &CdiDeviceNameStrategy::all(),
        // No sharing: NVIDIA's plugin runs without a sharing config too.
        &SharingPolicy::default(),
        &gpupool_device_plugin::agent::advertise::MpsView::default(),
        Arc::new(Topology::new()),
    );
    // MIG device UUID by (GPU, GI, CI), to attribute MIG events as the agent does.
    let mut mig_ids = BTreeMap::new();
    for gpu in &inventory.gpus {
        for m in &gpu.mig_devices {
            mig_ids.insert(
                (gpu.device.index, m.gpu_instance.0, m.compute_instance.0),
                m.uuid.to_string(),
            );
        }
    }
    let metrics = Arc::new(PluginMetrics::default());
    let cancel = CancellationToken::new();
    let (_layout_tx, layout_rx) = watch::channel(advertisement.clone());
    let (events_tx, events_rx) = mpsc::channel(256);
    let (health_tx, health_rx) = watch::channel(advertisement);
    // As the agent runs them: forwarding, monitor and servers on one thread of their own.
    let kubelet_side = PluginRuntime::start()?;
    let monitor = kubelet_side.spawn(
        HealthMonitor::new(HealthPolicy::default(), metrics.clone()).run(
            layout_rx,
            events_rx,
            health_tx,
            cancel.clone(),
        ),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (mut raw, _thread) =
        backend::spawn_health_stream(backend.clone(), Duration::from_millis(500), stop.clone());
    let forward = kubelet_side.spawn(async move {
        while let Some(Ok(event)) = raw.recv().await {
            let kind = match event.kind {
                BackendKind::Xid(79) => HealthEventKind::GpuLost,
                BackendKind::Xid(x) => HealthEventKind::Xid(x),
                BackendKind::DoubleBitEcc => HealthEventKind::DoubleBitEcc,
                BackendKind::SingleBitEcc => continue,
            };
            let target = match (event.gpu_instance, event.compute_instance) {
                (Some(gi), Some(ci)) => mig_ids
                    .get(&(event.gpu, gi.0, ci.0))
                    .and_then(|uuid: &String| uuid.parse().ok())
                    .map(HealthTarget::Device)
                    .unwrap_or(HealthTarget::Gpu(event.gpu)),
                _ => HealthTarget::Gpu(event.gpu),
            };
            if events_tx.send(HealthEvent { target, kind }).await.is_err() {
                break;
            }
        }
    });
    let plugins = kubelet_side.spawn(run_plugins(
        PluginConfig::with_plugin_dir(plugin_dir),
        health_rx,
        metrics,
        cancel.clone(),
    ));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    term.recv().await;
    cancel.cancel();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    forward.abort();
    plugins.await??;
    monitor.await?;
    Ok(())
}
