//! The node agent: watches its own GpuNode, makes the node match it (MIG layout, CDI spec,
//! kubelet plugins) and reports what it sees (status, Node labels, Events, metrics).
//!
//! One loop owns all state and reconciles on every change it hears of — the GpuNode, device
//! health, a health event, a timer — so each pass reads the hardware afresh and decides from
//! what it reads (level-triggered; a restart at any point converges). Status is written only
//! when the computed status differs from the last one written (or, at start, from the one on
//! the server), so a steady node costs no writes.
//!
//! The loop is here; each job lives beside it with its state, its pure core next to its edge:
//! [`reconfigure`] (MIG), [`cdi_spec`], [`advertise`] (what the kubelet plugins offer),
//! [`validation`], [`sampling`], [`health`] (NVML events for the plugins' health monitor),
//! [`foreign_plugin`] (another device plugin serving NVIDIA resources on the node), and
//! the report: [`events`], [`status`], [`labels`], [`figures`]. [`reconcile`] orders them.

pub mod advertise;
pub mod cdi_spec;
pub mod events;
pub mod figures;
pub mod foreign_plugin;
pub mod health;
pub mod labels;
pub mod mps;
pub mod reconcile;
pub mod reconfigure;
pub mod sampling;
pub mod sharing_gate;
pub mod status;
#[cfg(test)]
mod testing;
pub mod validation;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use gpupool_crds::node::GpuNode;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use advertise::{advertisement, cdi_naming};

use crate::backend::GpuBackend;
use crate::metrics_http::AgentMetrics;
use crate::plugin::{
    self, Advertisement, CdiKind, HealthMonitor, HealthPolicy, PluginConfig, PluginRuntime,
};
use health::{BackendProbe, Notice};
use reconcile::NodeState;

/// Field manager of every write the agent makes.
pub const FIELD_MANAGER: &str = "gpupool-agent";

/// Agent settings (from the command line).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This node's name (the GpuNode and Node to work on).
    pub node_name: String,
    /// Kubelet root (device plugins in `<dir>/device-plugins`).
    pub kubelet_dir: PathBuf,
    /// Kubelet PodResources socket.
    pub pod_source: crate::podresources::PodSource,
    /// Overrides the GpuNode's `cdi.specDir`.
    pub cdi_dir: Option<PathBuf>,
    /// Overrides the GpuNode's `cdi.driverRoot` (the admin's own setting: trusted as it is).
    pub driver_root: Option<PathBuf>,
    /// The driver roots a GpuNode's `cdi.driverRoot` may name on this node ([`crate::trust`]).
    pub allowed_driver_roots: crate::trust::AllowedRoots,
    /// Where the host's `/` is mounted in this process; the driver root is read under it,
    /// and the CDI spec still names host paths (`None`: the host's `/` is ours).
    pub host_root: Option<PathBuf>,
    /// Where `/proc` is (the kernel module check).
    pub proc_root: PathBuf,
    /// The host's procfs, where the agent reads its own `status` to tell whether it is in the
    /// host's PID namespace, so that the GPU process lists are the host's (see [`crate::pidns`]).
    pub host_proc_root: PathBuf,
    /// The kernel log (`/dev/kmsg`), scanned for Xids logged since boot.
    pub kmsg_path: PathBuf,
    /// How often driver checks re-run.
    pub validate_interval: Duration,
    /// Longest wait for GPUs to drain before a MIG change fails.
    pub drain_timeout: Duration,
    /// Pause between MIG operations (tests use it to observe `Applying`).
    pub mig_step_delay: Duration,
    /// Consecutive idle samples before a device counts as idle.
    pub idle_samples: u32,
    /// How long a device stays Unhealthy after its fault was seen to clear.
    pub health_hold_down: Duration,
    /// Longest time between two GpuNode status writes, changed or not (the heartbeat the
    /// operator judges the agent's liveness by).
    pub heartbeat: Duration,
    /// The MPS daemons' directories, host terms (`/run/gpupool/mps`).
    pub mps_root: PathBuf,
    /// The cgroup (v2, host terms) the MPS daemons are moved into, out of the agent's
    /// container's, so that they outlive it (`None`: they stay in the agent's).
    pub mps_cgroup: Option<PathBuf>,
}

impl AgentConfig {
    /// The health monitor's policy: the defaults, with this config's recovery hold-down.
    pub fn health_policy(&self) -> HealthPolicy {
        HealthPolicy {
            hold_down: self.health_hold_down,
            ..HealthPolicy::default()
        }
    }
}

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A task the agent needs ended with an error.
    #[error("kubelet plugins: {0}")]
    Plugins(#[from] plugin::PluginError),
    /// A task panicked or was cancelled unexpectedly.
    #[error("task {0} ended: {1}")]
    Task(&'static str, String),
    /// The kubelet-facing thread could not be started.
    #[error("starting the kubelet plugin thread: {0}")]
    PluginThread(#[source] std::io::Error),
}

/// Runs `task` on the kubelet-facing thread and waits for it from the caller's runtime.
async fn on_plugin_thread(
    runtime: &PluginRuntime,
    name: &'static str,
    task: impl std::future::Future<Output = Result<(), AgentError>> + Send + 'static,
) -> Result<(), AgentError> {
    runtime
        .spawn(task)
        .await
        .map_err(|e| AgentError::Task(name, e.to_string()))?
}

/// Runs `f` on the blocking pool with the backend (NVML calls block).
async fn blocking<T: Send + 'static>(
    backend: &Arc<dyn GpuBackend>,
    f: impl FnOnce(&dyn GpuBackend) -> T + Send + 'static,
) -> Option<T> {
    let b = backend.clone();
    tokio::task::spawn_blocking(move || f(b.as_ref()))
        .await
        .ok()
}

/// The node agent.
pub struct Agent {
    config: AgentConfig,
    client: Client,
    backend: Result<Arc<dyn GpuBackend>, String>,
    metrics: Arc<AgentMetrics>,
}

impl Agent {
    /// An agent for `config`, talking to the API through `client` and to the GPUs through
    /// `backend` (or reporting why NVML failed to load).
    pub fn new(
        config: AgentConfig,
        client: Client,
        backend: Result<Arc<dyn GpuBackend>, String>,
        metrics: Arc<AgentMetrics>,
    ) -> Agent {
        Agent {
            config,
            client,
            backend,
            metrics,
        }
    }

    /// Runs until `cancel`, then stops the plugin servers (removing their sockets).
    pub async fn run(self, cancel: CancellationToken) -> Result<(), AgentError> {
        let gpunodes: Api<GpuNode> = Api::all(self.client.clone());
        let (node_tx, mut node_rx) = watch::channel::<Option<GpuNode>>(None);
        let selector = format!("metadata.name={}", self.config.node_name);
        let watch_cancel = cancel.clone();
        let watch_task = tokio::spawn(async move {
            let stream =
                watcher(gpunodes, watcher::Config::default().fields(&selector)).default_backoff();
            futures::pin_mut!(stream);
            loop {
                let next = tokio::select! {
                    () = watch_cancel.cancelled() => return,
                    next = stream.next() => next,
                };
                match next {
                    None => return,
                    Some(Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj))) => {
                        let _ = node_tx.send(Some(obj));
                    }
                    Some(Ok(watcher::Event::Delete(_))) => {
                        let _ = node_tx.send(None);
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::warn!(error = %e, "watching the GpuNode"),
                }
            }
        });

        let mut state = NodeState::new(&self);
        let (mps_tx, mut mps_exits) = mpsc::channel::<()>(8);
        state.mps.set_waker(mps_tx);
        state.mps.set_takeover(mps::Takeover {
            proc_root: self.config.proc_root.clone(),
            cgroup: self.config.mps_cgroup.clone(),
        });
        let (notice_tx, mut notices) = mpsc::channel::<Notice>(64);
        let (layout_tx, layout_rx) = watch::channel(Advertisement::default());
        let (health_tx, mut health_rx) = watch::channel(Advertisement::default());
        let mut tasks = tokio::task::JoinSet::new();
        let stop_health = Arc::new(AtomicBool::new(false));
        // Health forwarding, the monitor and the plugin servers: one thread of their own.
        let kubelet_side = Arc::new(PluginRuntime::start().map_err(AgentError::PluginThread)?);

        if let Ok(backend) = &self.backend {
            let topology = blocking(backend, advertise::read_topology)
                .await
                .unwrap_or_default();
            state.topology = Arc::new(topology);
            let (events_tx, events_rx) = mpsc::channel(256);
            health::spawn_forwarder(
                &mut tasks,
                &kubelet_side,
                backend.clone(),
                stop_health.clone(),
                state.mig_ids.clone(),
                events_tx,
                notice_tx,
            );
            let probe = BackendProbe {
                backend: backend.clone(),
                mig_parents: state.mig_parents.clone(),
            };
            let monitor =
                HealthMonitor::new(self.config.health_policy(), self.metrics.plugin.clone())
                    .with_probe(Arc::new(probe));
            let c = cancel.clone();
            let side = kubelet_side.clone();
            tasks.spawn(async move {
                on_plugin_thread(&side, "health monitor", async move {
                    monitor.run(layout_rx, events_rx, health_tx, c).await;
                    Ok(())
                })
                .await
            });
        }

        let mut plugins_started = false;
        let mut node_gone = false;
        let mut wake: Option<Instant> = None;
        let beat_every = crate::metrics_http::Heartbeat::INTERVAL;
        loop {
            // Every pass beats; so does a quiet spell, at least every `beat_every`. A pass
            // stuck in a driver call stops the beats, and `/healthz` fails (see Heartbeat).
            self.metrics.heartbeat.beat();
            let sleep = match wake {
                Some(at) => tokio::time::sleep_until(at.min(Instant::now() + beat_every)),
                None => tokio::time::sleep(beat_every),
            };
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                joined = tasks.join_next(), if !tasks.is_empty() => {
                    if let Some(result) = joined {
                        match result {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => { cancel.cancel(); return Err(e); }
                            Err(e) => { cancel.cancel(); return Err(AgentError::Task("agent", e.to_string())); }
                        }
                    }
                }
                changed = node_rx.changed() => {
                    if changed.is_err() { break; }
                    node_gone = node_rx.borrow().is_none();
                }
                changed = health_rx.changed() => {
                    if changed.is_err() { break; }
                }
                Some(xid) = notices.recv() => state.validation.notice(xid, Instant::now()),
                Some(()) = mps_exits.recv() => {}
                () = sleep => {}
            }
            let gpunode = node_rx.borrow_and_update().clone();
            let Some(gpunode) = gpunode else {
                // Out of every pool (or gpupool is being uninstalled): the hardware-fact
                // labels go with the GpuNode.
                if node_gone {
                    state.released().await;
                    node_gone = false;
                }
                wake = None;
                continue;
            };
            if !plugins_started && self.backend.is_ok() {
                let kind = gpunode.spec.cdi.kind.parse::<CdiKind>().unwrap_or_default();
                let mut config =
                    PluginConfig::with_plugin_dir(self.config.kubelet_dir.join("device-plugins"));
                config.cdi_kind = kind;
                let rx = health_tx_subscribe(&health_rx);
                let metrics = self.metrics.plugin.clone();
                let c = cancel.clone();
                let side = kubelet_side.clone();
                tasks.spawn(async move {
                    on_plugin_thread(&side, "kubelet plugins", async move {
                        plugin::run_plugins(config, rx, metrics, c)
                            .await
                            .map_err(AgentError::from)
                    })
                    .await
                });
                plugins_started = true;
            }
            let health = status::device_health(&health_rx.borrow_and_update());
            wake = state.reconcile(&self, &gpunode, &health, &layout_tx).await;
        }

        // The MPS daemons stay, and their clients with them: the next agent takes them over.
        state.mps.hand_over();
        stop_health.store(true, Ordering::Relaxed);
        cancel.cancel();
        watch_task.abort();
        while let Some(result) = tasks.join_next().await {
            if let Ok(Err(e)) = result {
                tracing::warn!(error = %e, "while stopping");
            }
        }
        Ok(())
    }
}

fn health_tx_subscribe(rx: &watch::Receiver<Advertisement>) -> watch::Receiver<Advertisement> {
    let mut rx = rx.clone();
    rx.mark_changed();
    rx
}
