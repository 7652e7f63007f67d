//! The node agent: watches its own GpuNode, makes the node match it (MIG layout, CDI spec,
//! kubelet plugins) and reports what it sees (status, Node labels, Events, metrics).
//!
//! One loop owns all state and reconciles on every change it hears of — the GpuNode, device
//! health, a health event, a timer — so each pass reads the hardware afresh and decides from
//! what it reads (level-triggered; a restart at any point converges). Status is written only
//! when the computed status differs from the last one written (or, at start, from the one on
//! the server), so a steady node costs no writes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use futures::StreamExt;
use gpupool_crds::node::{CdiStatus, CheckResult, GpuNode, GpuNodeStatus, MigState, PodRef};
use gpupool_crds::policy::{CdiDeviceNameStrategy, MigStrategy as CrdMigStrategy};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{self, GpuBackend, HealthEventKind as BackendEventKind, PcieLink};
use crate::cdi::{self, CdiOptions};
use crate::inventory::Inventory;
use crate::metrics_http::{AgentMetrics, Figures, GpuFigures};
use crate::mig::{self, MigController, Step};
use crate::plugin::{
    self, Advertisement, CdiKind, CdiNaming, GpuDescription, HealthEvent, HealthEventKind,
    HealthMonitor, HealthPolicy, HealthProbe, HealthTarget, LinkKind, MigDescription, PluginConfig,
    Topology,
};
use crate::report::{self, FIELD_MANAGER};
use crate::utilization::{self, IdleTracker};
use crate::validate;

/// Agent settings (from the command line).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This node's name (the GpuNode and Node to work on).
    pub node_name: String,
    /// Kubelet root (device plugins in `<dir>/device-plugins`).
    pub kubelet_dir: PathBuf,
    /// Kubelet PodResources socket.
    pub pod_resources_socket: PathBuf,
    /// Overrides the GpuNode's `cdi.specDir`.
    pub cdi_dir: Option<PathBuf>,
    /// Overrides the GpuNode's `cdi.driverRoot`.
    pub driver_root: Option<PathBuf>,
    /// Where `/proc` is (the kernel module check).
    pub proc_root: PathBuf,
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

/// Re-checks faulted GPUs: cleared when the GPU answers again without uncorrected ECC errors.
struct BackendProbe {
    backend: Arc<dyn GpuBackend>,
    mig_parents: Arc<RwLock<BTreeMap<String, u32>>>,
}

impl HealthProbe for BackendProbe {
    fn recheck<'a>(
        &'a self,
        target: &'a HealthTarget,
    ) -> crate::plugin::health::BoxFuture<'a, bool> {
        Box::pin(async move {
            let gpu = match target {
                HealthTarget::Gpu(g) => Some(*g),
                HealthTarget::Device(id) => self
                    .mig_parents
                    .read()
                    .ok()
                    .and_then(|m| m.get(id.as_str()).copied()),
            };
            let Some(gpu) = gpu else { return false };
            blocking(&self.backend, move |b| {
                b.health(gpu)
                    .is_ok_and(|h| h.ecc_uncorrected.unwrap_or(0) == 0)
            })
            .await
            .unwrap_or(false)
        })
    }
}

fn link_kind(t: backend::Topology) -> LinkKind {
    if t.nvlink {
        return LinkKind::NvLink(1);
    }
    match t.pcie {
        PcieLink::SameBoard | PcieLink::SingleSwitch | PcieLink::MultipleSwitches => {
            LinkKind::SamePcieSwitch
        }
        PcieLink::HostBridge | PcieLink::NumaNode => LinkKind::SameNuma,
        PcieLink::System => LinkKind::Cross,
    }
}

fn read_topology(backend: &dyn GpuBackend) -> Topology {
    let mut t = Topology::new();
    let n = backend.device_count().unwrap_or(0);
    for a in 0..n {
        for b in (a + 1)..n {
            if let Ok(link) = backend.topology(a, b) {
                t.set_link(a, b, link_kind(link));
            }
        }
    }
    t
}

/// The CDI device names the kubelet plugins hand out, from the GpuNode's `deviceNameStrategies`:
/// UUID names when they include `uuid` (stable across MIG re-layouts), else index names. GpuNode
/// status reports the same names.
pub fn cdi_naming(strategies: &[CdiDeviceNameStrategy]) -> CdiNaming {
    if strategies.contains(&CdiDeviceNameStrategy::Uuid) {
        CdiNaming::Uuid
    } else {
        CdiNaming::Index
    }
}

/// The devices per resource the kubelet plugins should advertise.
pub fn advertisement(
    inventory: &Inventory,
    strategy: CrdMigStrategy,
    naming: &[CdiDeviceNameStrategy],
    topology: Arc<Topology>,
) -> Advertisement {
    let gpus: Vec<GpuDescription> = inventory
        .gpus
        .iter()
        .map(|g| GpuDescription {
            index: g.device.index,
            uuid: g.device.uuid.to_string(),
            numa_node: g.numa_node.map(i64::from),
            mig_enabled: g.mig_enabled(),
            mig_devices: g
                .mig_devices
                .iter()
                .enumerate()
                .map(|(j, m)| MigDescription {
                    index: j as u32,
                    uuid: m.uuid.to_string(),
                    profile: m.profile.to_string(),
                })
                .collect(),
        })
        .collect();
    let strategy = match strategy {
        CrdMigStrategy::None => plugin::MigStrategy::None,
        CrdMigStrategy::Single => plugin::MigStrategy::Single,
        CrdMigStrategy::Mixed => plugin::MigStrategy::Mixed,
    };
    let resources = match plugin::resource_sets(&gpus, strategy, cdi_naming(naming)) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "cannot advertise devices for this MIG strategy");
            BTreeMap::new()
        }
    };
    Advertisement {
        resources,
        topology,
    }
}

/// (GPU, GPU instance, compute instance) → MIG UUID.
type MigIds = BTreeMap<(u32, u32, u32), String>;

/// What the health forwarder tells the loop.
#[derive(Debug)]
enum Notice {
    Xid { gpu: u32, xid: u64 },
    Other,
}

/// Previous values, to emit Events on transitions only.
#[derive(Default)]
struct Seen {
    validated: Option<String>,
    failed_checks: Vec<String>,
    mig_state: Option<MigState>,
    gpu_health: BTreeMap<u32, bool>,
    pod_resources: Option<bool>,
    cdi_error: Option<String>,
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

        let mut state = LoopState::new(&self);
        let (notice_tx, mut notices) = mpsc::channel::<Notice>(64);
        let (layout_tx, layout_rx) = watch::channel(Advertisement::default());
        let (health_tx, mut health_rx) = watch::channel(Advertisement::default());
        let mut tasks = tokio::task::JoinSet::new();
        let stop_health = Arc::new(AtomicBool::new(false));

        if let Ok(backend) = &self.backend {
            let topology = blocking(backend, read_topology).await.unwrap_or_default();
            state.topology = Arc::new(topology);
            let (events_tx, events_rx) = mpsc::channel(256);
            let (mut raw_rx, _thread) = backend::spawn_health_stream(
                backend.clone(),
                Duration::from_millis(500),
                stop_health.clone(),
            );
            let mig_ids = state.mig_ids.clone();
            tasks.spawn(async move {
                while let Some(event) = raw_rx.recv().await {
                    let event = match event {
                        Ok(e) => e,
                        Err(e) => {
                            tracing::warn!(error = %e, "health events ended");
                            break;
                        }
                    };
                    let kind = match event.kind {
                        BackendEventKind::Xid(79) => Some(HealthEventKind::GpuLost),
                        BackendEventKind::Xid(x) => Some(HealthEventKind::Xid(x)),
                        BackendEventKind::DoubleBitEcc => Some(HealthEventKind::DoubleBitEcc),
                        BackendEventKind::SingleBitEcc => None,
                    };
                    let target = match (event.gpu_instance, event.compute_instance) {
                        (Some(gi), Some(ci)) => mig_ids
                            .read()
                            .ok()
                            .and_then(|m| m.get(&(event.gpu, gi.0, ci.0)).cloned())
                            .and_then(|uuid| uuid.parse().ok())
                            .map(HealthTarget::Device)
                            .unwrap_or(HealthTarget::Gpu(event.gpu)),
                        _ => HealthTarget::Gpu(event.gpu),
                    };
                    if let Some(kind) = kind {
                        let _ = events_tx.send(HealthEvent { target, kind }).await;
                    }
                    let notice = match event.kind {
                        BackendEventKind::Xid(xid) => Notice::Xid {
                            gpu: event.gpu,
                            xid,
                        },
                        _ => Notice::Other,
                    };
                    let _ = notice_tx.send(notice).await;
                }
                Ok::<(), AgentError>(())
            });
            let probe = BackendProbe {
                backend: backend.clone(),
                mig_parents: state.mig_parents.clone(),
            };
            let monitor =
                HealthMonitor::new(self.config.health_policy(), self.metrics.plugin.clone())
                    .with_probe(Arc::new(probe));
            let c = cancel.clone();
            tasks.spawn(async move {
                monitor.run(layout_rx, events_rx, health_tx, c).await;
                Ok(())
            });
        }

        let mut plugins_started = false;
        let mut wake: Option<Instant> = None;
        loop {
            let sleep = match wake {
                Some(at) => tokio::time::sleep_until(at),
                None => tokio::time::sleep(Duration::from_secs(3600)),
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
                }
                changed = health_rx.changed() => {
                    if changed.is_err() { break; }
                }
                Some(notice) = notices.recv() => {
                    if let Notice::Xid { gpu, xid } = notice {
                        *state.xid_counts.entry((gpu, xid)).or_default() += 1;
                        state.xid_ledger().record_event(gpu, xid);
                    }
                    state.next_validate = Instant::now();
                }
                () = sleep => {}
            }
            let gpunode = node_rx.borrow_and_update().clone();
            let Some(gpunode) = gpunode else {
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
                tasks.spawn(async move {
                    plugin::run_plugins(config, rx, metrics, c)
                        .await
                        .map_err(AgentError::from)
                });
                plugins_started = true;
            }
            let health = report::device_health(&health_rx.borrow_and_update());
            wake = state.reconcile(&self, &gpunode, &health, &layout_tx).await;
        }

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

struct LoopState {
    mig: MigController,
    checks: Vec<CheckResult>,
    next_validate: Instant,
    next_sample: Instant,
    idle: IdleTracker,
    pods: BTreeMap<String, Vec<PodRef>>,
    pod_resources: Option<Result<(), String>>,
    conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    cdi: Option<CdiStatus>,
    samples: BTreeMap<String, utilization::DeviceSample>,
    xid_counts: BTreeMap<(u32, u64), u64>,
    /// Fatal Xids from NVML events and the kernel log (shared with the blocking scan task).
    xids: Arc<Mutex<validate::XidLedger>>,
    last_written: Option<(String, GpuNodeStatus)>,
    last_labels: Option<BTreeMap<String, String>>,
    seen: Seen,
    topology: Arc<Topology>,
    /// (GPU, GI, CI) → MIG UUID, for attributing health events.
    mig_ids: Arc<RwLock<MigIds>>,
    /// MIG UUID → parent GPU, for re-checks.
    mig_parents: Arc<RwLock<BTreeMap<String, u32>>>,
    status_writes: u64,
    cdi_writes: u64,
    recorder: Recorder,
    /// Earliest time for the next MIG operation (`--mig-step-delay-ms`).
    mig_next_op: Instant,
    /// The spec generation the checks were last run for.
    validated_generation: Option<i64>,
}

impl LoopState {
    fn new(agent: &Agent) -> LoopState {
        let now = Instant::now();
        LoopState {
            mig: MigController::new(agent.config.drain_timeout),
            checks: Vec::new(),
            next_validate: now,
            next_sample: now,
            idle: IdleTracker::new(agent.config.idle_samples),
            pods: BTreeMap::new(),
            pod_resources: None,
            conditions: Vec::new(),
            cdi: None,
            samples: BTreeMap::new(),
            xid_counts: BTreeMap::new(),
            xids: Arc::new(Mutex::new(validate::XidLedger::new(
                agent.config.kmsg_path.clone(),
            ))),
            last_written: None,
            last_labels: None,
            seen: Seen::default(),
            topology: Arc::new(Topology::new()),
            mig_ids: Arc::default(),
            mig_parents: Arc::default(),
            status_writes: 0,
            cdi_writes: 0,
            mig_next_op: now,
            validated_generation: None,
            recorder: Recorder::new(
                agent.client.clone(),
                Reporter {
                    controller: FIELD_MANAGER.to_owned(),
                    instance: Some(agent.config.node_name.clone()),
                },
            ),
        }
    }

    async fn event(&self, gpunode: &GpuNode, warning: bool, reason: &str, note: String) {
        self.event_with_action(gpunode, warning, reason, reason, note)
            .await;
    }

    /// kube's recorder folds Events with the same reason and action into one series (keeping
    /// the first note), so an Event whose note matters names what differs in its action.
    async fn event_with_action(
        &self,
        gpunode: &GpuNode,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = KubeEvent {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: action.chars().take(128).collect(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &gpunode.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "publishing an Event");
        }
    }

    async fn read_inventory(&self, agent: &Agent) -> Option<Result<Inventory, String>> {
        let backend = agent.backend.as_ref().ok()?;
        Some(
            blocking(backend, |b| Inventory::read(b).map_err(|e| e.to_string()))
                .await
                .unwrap_or_else(|| Err("inventory task failed".to_owned())),
        )
    }

    /// One reconcile pass. Returns when to wake up next.
    async fn reconcile(
        &mut self,
        agent: &Agent,
        gpunode: &GpuNode,
        health: &BTreeMap<String, plugin::Health>,
        layout_tx: &watch::Sender<Advertisement>,
    ) -> Option<Instant> {
        let generation = gpunode.metadata.generation;
        let spec = &gpunode.spec;
        let mut inventory = self.read_inventory(agent).await;
        let mut mig_wake: Option<Instant> = None;

        // MIG: step the state machine until it waits, publishing each phase change.
        if let (Ok(backend), Some(Ok(_))) = (&agent.backend, &inventory) {
            for _ in 0..256 {
                let Some(Ok(inv)) = &inventory else { break };
                let current = mig::current_from_inventory(inv);
                let busy = busy_gpus(backend, inv).await;
                let step = self.mig.step(
                    &current,
                    &spec.mig,
                    generation,
                    &busy,
                    Instant::now().into_std(),
                );
                match step {
                    Step::Idle => break,
                    Step::Wait(d) => {
                        mig_wake = Some(Instant::now() + d);
                        break;
                    }
                    Step::PhaseChanged => {
                        self.on_mig_phase(gpunode).await;
                        self.publish(agent, gpunode, inventory.as_ref(), health)
                            .await;
                    }
                    Step::Execute(op) => {
                        let now = Instant::now();
                        if now < self.mig_next_op {
                            mig_wake = Some(self.mig_next_op);
                            break;
                        }
                        self.mig_next_op = now + agent.config.mig_step_delay;
                        tracing::info!(%op, "MIG");
                        let op2 = op.clone();
                        let result = blocking(backend, move |b| mig::apply_op(b, &op2)).await;
                        match result {
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "MIG operation failed");
                                self.mig.fail(&e);
                                self.on_mig_phase(gpunode).await;
                                self.publish(agent, gpunode, inventory.as_ref(), health)
                                    .await;
                                break;
                            }
                            None => break,
                            Some(Ok(_)) => {}
                        }
                        inventory = self.read_inventory(agent).await;
                    }
                }
            }
        }

        let inv = match &inventory {
            Some(Ok(inv)) => Some(inv),
            _ => None,
        };
        if let Some(inv) = inv {
            let mut ids = BTreeMap::new();
            let mut parents = BTreeMap::new();
            for g in &inv.gpus {
                for m in &g.mig_devices {
                    ids.insert(
                        (g.device.index, m.gpu_instance.0, m.compute_instance.0),
                        m.uuid.to_string(),
                    );
                    parents.insert(m.uuid.to_string(), g.device.index);
                }
            }
            if let Ok(mut w) = self.mig_ids.write() {
                *w = ids;
            }
            if let Ok(mut w) = self.mig_parents.write() {
                *w = parents;
            }
        }

        // CDI spec and advertised devices follow the hardware, except mid-reconfiguration.
        if let (false, Some(inv)) = (self.mig.busy(), inv) {
            self.write_cdi(agent, gpunode, inv).await;
            let adv = advertisement(
                inv,
                spec.mig.strategy,
                &spec.cdi.device_name_strategies,
                self.topology.clone(),
            );
            layout_tx.send_if_modified(|cur| {
                if *cur == adv {
                    false
                } else {
                    *cur = adv;
                    true
                }
            });
        }

        let now = Instant::now();
        if generation != self.validated_generation {
            // A new spec may change the requirements: check at once.
            self.validated_generation = generation;
            self.next_validate = now;
        }
        if now >= self.next_validate {
            self.validate(agent, gpunode, inv).await;
            self.next_validate = now + agent.config.validate_interval;
        }
        let interval: Duration = spec.utilization.sample_interval.into();
        let interval = interval.max(Duration::from_millis(200));
        if now >= self.next_sample {
            if let (Ok(backend), Some(inv)) = (&agent.backend, inv) {
                self.sample(
                    agent,
                    gpunode,
                    backend,
                    inv,
                    spec.utilization.idle_threshold,
                )
                .await;
            }
            self.next_sample = now + interval;
        }

        self.publish(agent, gpunode, inventory.as_ref(), health)
            .await;
        if let Some(inv) = inv {
            self.label_node(agent, inv).await;
            self.health_events(gpunode, inv, health).await;
        }
        agent.metrics.ready.store(true, Ordering::Relaxed);

        [Some(self.next_validate), Some(self.next_sample), mig_wake]
            .into_iter()
            .flatten()
            .min()
    }

    async fn on_mig_phase(&mut self, gpunode: &GpuNode) {
        let status = self.mig.status();
        if self.seen.mig_state == Some(status.state) {
            return;
        }
        let prev = self.seen.mig_state.replace(status.state);
        let gpus: Vec<String> = status.gpus.iter().map(u32::to_string).collect();
        let gpus = gpus.join(", ");
        match status.state {
            MigState::Draining => {
                self.event(
                    gpunode,
                    false,
                    "MigDraining",
                    format!("waiting for GPU pods to leave GPU {gpus} before changing MIG"),
                )
                .await
            }
            MigState::Applying => {
                self.event(
                    gpunode,
                    false,
                    "MigApplying",
                    format!("changing MIG on GPU {gpus}"),
                )
                .await
            }
            MigState::Applied if prev.is_some() && prev != Some(MigState::Idle) => {
                self.event(
                    gpunode,
                    false,
                    "MigApplied",
                    "the MIG layout is applied".to_owned(),
                )
                .await
            }
            MigState::Failed => {
                self.event(
                    gpunode,
                    true,
                    "MigFailed",
                    status.message.clone().unwrap_or_default(),
                )
                .await
            }
            _ => {}
        }
    }

    async fn write_cdi(&mut self, agent: &Agent, gpunode: &GpuNode, inv: &Inventory) {
        let policy = &gpunode.spec.cdi;
        let dir = agent
            .config
            .cdi_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(&policy.spec_dir));
        if !policy.enabled {
            match cdi::remove_spec(&dir) {
                Ok(true) => tracing::info!(dir = %dir.display(), "CDI disabled: spec removed"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "removing the CDI spec"),
            }
            self.cdi = None;
            return;
        }
        let root = agent
            .config
            .driver_root
            .clone()
            .unwrap_or_else(|| PathBuf::from(&policy.driver_root));
        let result = CdiOptions::from_policy(policy)
            .and_then(|opts| cdi::generate_and_write(inv, &root, &dir, &opts));
        match result {
            Ok(outcome) => {
                if outcome.written.changed {
                    self.cdi_writes += 1;
                    tracing::info!(path = %outcome.written.path.display(), digest = %outcome.written.digest, devices = outcome.device_names.len(), "CDI spec written");
                }
                for s in &outcome.skipped {
                    tracing::warn!(skipped = %s, "CDI device left out");
                }
                self.cdi = Some(CdiStatus {
                    path: outcome.written.path.display().to_string(),
                    digest: outcome.written.digest,
                    devices: outcome.device_names.len() as u32,
                });
                self.seen.cdi_error = None;
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::warn!(error = %msg, "CDI spec not written");
                if self.seen.cdi_error.as_deref() != Some(msg.as_str()) {
                    self.seen.cdi_error = Some(msg.clone());
                    self.event(gpunode, true, "CdiSpecFailed", msg).await;
                }
            }
        }
    }

    /// The Xid ledger. Every holder finishes its update before it could panic, so a poisoned
    /// ledger is whole.
    fn xid_ledger(&self) -> MutexGuard<'_, validate::XidLedger> {
        self.xids.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the kernel log records that arrived since the last scan, keeping their fatal Xids.
    async fn scan_kernel_log(&mut self) {
        let ledger = self.xids.clone();
        let scanned = tokio::task::spawn_blocking(move || {
            let mut ledger = ledger.lock().unwrap_or_else(|p| p.into_inner());
            let before = ledger.kernel_log().clone();
            (before, ledger.scan_kernel_log())
        })
        .await;
        match scanned {
            Ok((_, Ok(0))) => {}
            Ok((_, Ok(found))) => tracing::info!(xids = found, "Xid records in the kernel log"),
            Ok((before, Err(e))) => {
                // Warn once per distinct failure, not on every validation run.
                if self.xid_ledger().kernel_log() != &before {
                    tracing::warn!(error = %e, "kernel log not readable: only Xids since the agent started are counted");
                }
            }
            Err(e) => tracing::warn!(error = %e, "kernel log scan task failed"),
        }
    }

    async fn validate(&mut self, agent: &Agent, gpunode: &GpuNode, inv: Option<&Inventory>) {
        self.scan_kernel_log().await;
        let gpus: Vec<(u32, String)> = inv
            .map(|inv| {
                inv.gpus
                    .iter()
                    .map(|g| (g.device.index, g.device.pci_bus_id.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let xids = self.xid_ledger().observations(&gpus);
        let root = agent
            .config
            .driver_root
            .clone()
            .unwrap_or_else(|| PathBuf::from(&gpunode.spec.cdi.driver_root));
        let proc_root = agent.config.proc_root.clone();
        let obs = match &agent.backend {
            Ok(b) => blocking(b, move |b| {
                validate::observe(Ok(b), &root, &proc_root, xids)
            })
            .await
            .unwrap_or_else(|| {
                validate::observe(
                    Err("validation task failed".into()),
                    &PathBuf::new(),
                    &PathBuf::new(),
                    validate::XidObservations::default(),
                )
            }),
            Err(e) => validate::observe(Err(e.clone()), &root, &proc_root, xids),
        };
        self.checks = validate::run_checks(&gpunode.spec.driver, &obs);
        let validated = report::validated(&self.checks);
        let failed: Vec<String> = self
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| format!("{}: {}", c.name, c.message))
            .collect();
        if validated == "False"
            && (self.seen.validated.as_deref() != Some("False")
                || failed != self.seen.failed_checks)
        {
            let names: Vec<&str> = self
                .checks
                .iter()
                .filter(|c| !c.passed)
                .map(|c| c.name.as_str())
                .collect();
            let action = format!("Validate:{}", names.join(","));
            self.event_with_action(
                gpunode,
                true,
                "ValidationFailed",
                &action,
                failed.join("; "),
            )
            .await;
        } else if validated == "True" && self.seen.validated.as_deref() != Some("True") {
            self.event(
                gpunode,
                false,
                "ValidationPassed",
                format!("all {} driver checks passed", self.checks.len()),
            )
            .await;
        }
        self.seen.validated = Some(validated);
        self.seen.failed_checks = failed;
    }

    async fn sample(
        &mut self,
        agent: &Agent,
        gpunode: &GpuNode,
        backend: &Arc<dyn GpuBackend>,
        inv: &Inventory,
        threshold: u32,
    ) {
        let inv2 = inv.clone();
        let samples = blocking(backend, move |b| utilization::sample(b, &inv2, threshold))
            .await
            .unwrap_or_default();
        let activity = samples
            .iter()
            .map(|(k, s)| (k.clone(), s.activity))
            .collect();
        self.idle.observe(&activity, Timestamp::now());
        self.samples = samples;
        let result = utilization::list_pod_devices(
            &agent.config.pod_resources_socket,
            Duration::from_secs(5),
        )
        .await;
        let ok = result.is_ok();
        match result {
            Ok(map) => {
                self.pods = map;
                self.pod_resources = Some(Ok(()));
            }
            Err(e) => {
                self.pods.clear();
                self.pod_resources = Some(Err(e.to_string()));
            }
        }
        if self.seen.pod_resources != Some(ok) {
            self.seen.pod_resources = Some(ok);
            if let Some(Err(msg)) = &self.pod_resources {
                self.event(
                    gpunode,
                    true,
                    "PodResourcesUnavailable",
                    format!("{msg}; pods holding GPUs are not reported until it is back"),
                )
                .await;
            }
        }
    }

    fn build_status(
        &mut self,
        gpunode: &GpuNode,
        inventory: Option<&Result<Inventory, String>>,
        health: &BTreeMap<String, plugin::Health>,
    ) -> GpuNodeStatus {
        let generation = gpunode.metadata.generation;
        let kind = gpunode.spec.cdi.kind.parse::<CdiKind>().unwrap_or_default();
        let (driver_version, cuda_version, gpus) = match inventory {
            Some(Ok(inv)) => (
                Some(inv.driver.driver_version.clone()),
                Some(inv.driver.cuda_version.to_string()),
                report::gpu_statuses(
                    inv,
                    health,
                    &self.idle,
                    &self.pods,
                    &kind,
                    cdi_naming(&gpunode.spec.cdi.device_name_strategies),
                ),
            ),
            _ => (None, None, Vec::new()),
        };
        if let Some(pr) = &self.pod_resources {
            let (ok, reason, msg) = match pr {
                Ok(()) => (
                    true,
                    "Listed",
                    "the kubelet PodResources API answers".to_owned(),
                ),
                Err(e) => (false, "Unavailable", e.clone()),
            };
            report::set_condition(
                &mut self.conditions,
                "PodResourcesAvailable",
                ok,
                reason,
                &msg,
                generation,
                Timestamp::now(),
            );
        }
        let healthy = gpus
            .iter()
            .filter(|g| g.health == gpupool_crds::node::Health::Healthy)
            .count() as u32;
        GpuNodeStatus {
            observed_generation: generation,
            driver_version,
            cuda_version,
            gpu_count: gpus.len() as u32,
            healthy_gpus: healthy,
            validated: Some(gpupool_crds::node::Verdict::of_checks(&self.checks)),
            checks: self.checks.clone(),
            gpus,
            mig: self.mig.status(),
            cdi: self.cdi.clone(),
            conditions: self.conditions.clone(),
        }
    }

    async fn publish(
        &mut self,
        agent: &Agent,
        gpunode: &GpuNode,
        inventory: Option<&Result<Inventory, String>>,
        health: &BTreeMap<String, plugin::Health>,
    ) {
        let status = self.build_status(gpunode, inventory, health);
        self.update_figures(agent, inventory, health);
        let uid = gpunode.uid().unwrap_or_default();
        let unchanged = match &self.last_written {
            Some((u, last)) if *u == uid => *last == status,
            // First pass for this object: compare with what the server holds.
            _ => gpunode.status.as_ref() == Some(&status),
        };
        if unchanged {
            self.last_written = Some((uid, status));
            return;
        }
        let api: Api<GpuNode> = Api::all(agent.client.clone());
        let patch = json!({
            "apiVersion": "gpupool.io/v1alpha1",
            "kind": "GpuNode",
            "status": status,
        });
        match api
            .patch_status(
                &gpunode.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {
                self.status_writes += 1;
                tracing::debug!("GpuNode status written");
                self.last_written = Some((uid, status));
            }
            Err(e) => tracing::warn!(error = %e, "writing GpuNode status"),
        }
    }

    fn update_figures(
        &self,
        agent: &Agent,
        inventory: Option<&Result<Inventory, String>>,
        health: &BTreeMap<String, plugin::Health>,
    ) {
        let mut figures = Figures {
            xids: self.xid_counts.clone(),
            validated: report::validated(&self.checks) == "True",
            status_writes: self.status_writes,
            cdi_writes: self.cdi_writes,
            ..Figures::default()
        };
        if let Some(Ok(inv)) = inventory {
            for g in &inv.gpus {
                let uuid = g.device.uuid.to_string();
                let s = self.samples.get(&uuid);
                figures.gpus.insert(
                    g.device.index,
                    GpuFigures {
                        utilization_percent: s.and_then(|s| s.utilization_percent),
                        memory_used_mib: s.and_then(|s| s.memory_used_mib),
                        healthy: !matches!(
                            health.get(&uuid),
                            Some(plugin::Health::Unhealthy { .. })
                        ) && g.health.is_ok(),
                        temperature_c: g.health.as_ref().ok().and_then(|h| h.temperature_c),
                    },
                );
            }
        }
        agent.metrics.set(figures);
    }

    async fn label_node(&mut self, agent: &Agent, inv: &Inventory) {
        let labels = report::node_labels(inv);
        if self.last_labels.as_ref() == Some(&labels) {
            return;
        }
        let nodes: Api<Node> = Api::all(agent.client.clone());
        let patch = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": agent.config.node_name, "labels": labels },
        });
        match nodes
            .patch(
                &agent.config.node_name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => self.last_labels = Some(labels),
            Err(e) => tracing::warn!(error = %e, "labelling the Node"),
        }
    }

    async fn health_events(
        &mut self,
        gpunode: &GpuNode,
        inv: &Inventory,
        health: &BTreeMap<String, plugin::Health>,
    ) {
        for g in &inv.gpus {
            let uuid = g.device.uuid.to_string();
            let bad = match health.get(&uuid) {
                Some(plugin::Health::Unhealthy { reason }) => Some(reason.clone()),
                _ => g.health.as_ref().err().cloned(),
            };
            let healthy = bad.is_none();
            let prev = self.seen.gpu_health.insert(g.device.index, healthy);
            match (prev, bad) {
                (Some(true) | None, Some(reason)) => {
                    self.event_with_action(
                        gpunode,
                        true,
                        "DeviceUnhealthy",
                        &format!("Health:GPU{}", g.device.index),
                        format!("GPU {} ({uuid}): {reason}", g.device.index),
                    )
                    .await
                }
                (Some(false), None) => {
                    self.event_with_action(
                        gpunode,
                        false,
                        "DeviceRecovered",
                        &format!("Health:GPU{}", g.device.index),
                        format!("GPU {} ({uuid}) is healthy again", g.device.index),
                    )
                    .await
                }
                _ => {}
            }
        }
    }
}

async fn busy_gpus(backend: &Arc<dyn GpuBackend>, inv: &Inventory) -> BTreeSet<u32> {
    let indices: Vec<u32> = inv.gpus.iter().map(|g| g.device.index).collect();
    blocking(backend, move |b| {
        indices
            .into_iter()
            .filter(|i| b.processes(*i).is_ok_and(|p| !p.is_empty()))
            .collect()
    })
    .await
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CiProfileId, GiProfileId, ManualClock, SimBackend};
    use crate::plugin::allocate::container_response;
    use crate::plugin::{AllocateOptions, ResourceView};
    use gpupool_crds::catalog;

    /// An A30 with three MIG devices and an L4 (fixtures/mixed-small.yaml).
    fn mig_inventory() -> Inventory {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join("mixed-small.yaml");
        let sim = SimBackend::from_file(&fixture, Arc::new(ManualClock::new())).unwrap();
        let a30 = catalog::model_by_product_name("NVIDIA A30").unwrap();
        for step in catalog::plan_layout(a30, &["1g.6gb", "2g.12gb", "1g.6gb"]).unwrap() {
            let gi = sim
                .create_gpu_instance(0, GiProfileId(step.profile.profile_id), Some(step.start))
                .unwrap();
            sim.create_compute_instance(0, gi.id, CiProfileId(step.profile.compute_slices - 1))
                .unwrap();
        }
        Inventory::read(&sim).unwrap()
    }

    #[test]
    fn status_reports_the_mig_cdi_names_allocate_hands_out() {
        use CdiDeviceNameStrategy::{Index, Uuid};
        let inv = mig_inventory();
        let kind: CdiKind = "example.com/gpu".parse().unwrap();
        let options = AllocateOptions {
            cdi_kind: kind.clone(),
            ..AllocateOptions::default()
        };
        for strategies in [vec![Index, Uuid], vec![Uuid], vec![Index], vec![]] {
            let adv = advertisement(
                &inv,
                CrdMigStrategy::Mixed,
                &strategies,
                Arc::new(Topology::new()),
            );
            let statuses = report::gpu_statuses(
                &inv,
                &BTreeMap::new(),
                &IdleTracker::new(1),
                &BTreeMap::new(),
                &kind,
                cdi_naming(&strategies),
            );
            let migs: Vec<_> = statuses.iter().flat_map(|g| &g.mig_devices).collect();
            assert_eq!(migs.len(), 3, "{strategies:?}");
            for (j, m) in migs.iter().enumerate() {
                // What Allocate answers for this device, through the plugin's own code.
                let (resource, devices) = adv
                    .resources
                    .iter()
                    .find(|(_, ds)| ds.iter().any(|d| d.id.as_str() == m.uuid))
                    .unwrap_or_else(|| panic!("{} not advertised", m.uuid));
                let view =
                    ResourceView::new(resource.clone(), 1, devices.clone(), adv.topology.clone());
                let response =
                    container_response(&view, std::slice::from_ref(&m.uuid), &options).unwrap();
                let handed_out: Vec<&str> = response
                    .cdi_devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect();
                assert_eq!(handed_out, [m.cdi_name.as_str()], "{strategies:?}");
                let want = if strategies.contains(&Uuid) {
                    format!("example.com/gpu={}", m.uuid)
                } else {
                    format!("example.com/gpu=0:{j}")
                };
                assert_eq!(m.cdi_name, want, "{strategies:?}");
            }
        }
    }
}
