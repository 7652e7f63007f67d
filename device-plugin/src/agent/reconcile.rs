//! One pass of the agent over its node: each job in turn (MIG, CDI spec and advertised devices,
//! validation, sampling), then the report (Events, status, Node labels, metrics). Each job owns
//! its state; this file only orders them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use gpupool_crds::node::{CheckResult, GpuNode, Verdict};
use gpupool_crds::policy::SharingPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Recorder, Reporter};
use tokio::sync::watch;
use tokio::time::Instant;

use super::advertise::{MigIds, MigParents, MpsView, advertisement, mig_index};
use super::cdi_spec::{CdiJob, Roots};
use super::events::{Events, GpuHealthSeen, Observed};
use super::figures::{FigureInputs, figures};
use super::foreign_plugin::ForeignPluginJob;
use super::labels::NodeLabeler;
use super::mps::{self, MpsJob, MpsPaths};
use super::reconfigure::{MigJob, MigProgress};
use super::sampling::SamplingJob;
use super::sharing_gate::SharingGate;
use super::status::{self, StatusInputs, StatusPublisher};
use super::validation::ValidationJob;
use super::{Agent, FIELD_MANAGER, blocking};
use crate::cdi::DriverRoot;
use crate::inventory::Inventory;
use crate::pidns::HostPidNamespace;
use crate::plugin::{self, Advertisement, Topology};
use crate::trust::{self, Refusal, TrustedRoot};

/// How long one PodResources read for the sharing gate may take.
const POD_RESOURCES_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything the agent keeps about its node between passes, job by job.
pub struct NodeState {
    mig: MigJob,
    /// Whether the agent sees the host's processes (read once: a process's PID namespace is
    /// fixed for its life).
    host_pid: HostPidNamespace,
    /// The driver root in use: the last one the node trusted (`None`: none yet, so no CDI
    /// spec is written, no driver program runs and no device is advertised).
    driver_root: Option<TrustedRoot>,
    /// This pass's verdict on the driver root the GpuNode names.
    root_decision: Result<TrustedRoot, Refusal>,
    /// Whether the GpuNode's recorded MIG state has been taken up (first pass only).
    mig_restored: bool,
    cdi: CdiJob,
    /// Driver checks (public to the loop: health events make them due).
    pub validation: ValidationJob,
    sampling: SamplingJob,
    foreign: ForeignPluginJob,
    /// The MPS control daemons (public to the loop: it hands them a waker and stops them).
    pub mps: MpsJob,
    /// The sharing applied, held back while a mode change drains its GPUs.
    sharing_gate: SharingGate,
    /// What the gate last let through (for status).
    sharing: SharingPolicy,
    /// The agent's own conditions, carried from one status to the next.
    conditions: Vec<Condition>,
    status: StatusPublisher,
    labels: NodeLabeler,
    events: Events,
    /// GPU interconnect, read once at start.
    pub topology: Arc<Topology>,
    /// (GPU, GI, CI) → MIG UUID, shared with the health forwarder.
    pub mig_ids: Arc<RwLock<MigIds>>,
    /// MIG UUID → parent GPU, shared with the health probe.
    pub mig_parents: Arc<RwLock<MigParents>>,
}

impl NodeState {
    /// The GpuNode is gone: takes the agent's labels off the Node.
    pub(super) async fn released(&mut self) {
        self.labels.clear().await;
    }

    /// The state of a freshly started agent.
    pub fn new(agent: &Agent) -> NodeState {
        let now = Instant::now();
        let config = &agent.config;
        NodeState {
            mig: MigJob::new(
                config.drain_timeout,
                config.mig_step_delay,
                config.pod_source.clone(),
                now,
            ),
            host_pid: host_pid_namespace(&config.host_proc_root),
            driver_root: None,
            root_decision: Err(Refusal::NotPlain {
                root: String::new(),
            }),
            mig_restored: false,
            cdi: CdiJob::default(),
            validation: ValidationJob::new(config.kmsg_path.clone(), config.validate_interval, now),
            sampling: SamplingJob::new(
                config.pod_source.clone(),
                config.proc_root.clone(),
                config.kubelet_dir.join("device-plugins"),
                config.idle_samples,
                now,
            ),
            foreign: ForeignPluginJob::new(
                config.kubelet_dir.join("device-plugins"),
                plugin::PluginConfig::default().name_prefix,
                now,
            ),
            mps: MpsJob::new(MpsPaths {
                root: config.mps_root.clone(),
                host_root: config.host_root.clone(),
                driver_root: config
                    .driver_root
                    .clone()
                    .unwrap_or_else(|| PathBuf::from("/")),
                private_shm: true,
            }),
            sharing_gate: SharingGate::default(),
            sharing: SharingPolicy::default(),
            conditions: Vec::new(),
            status: StatusPublisher::new(agent.client.clone(), agent.config.heartbeat),
            labels: NodeLabeler::new(agent.client.clone(), config.node_name.clone()),
            events: Events::new(Recorder::new(
                agent.client.clone(),
                Reporter {
                    controller: FIELD_MANAGER.to_owned(),
                    instance: Some(config.node_name.clone()),
                },
            )),
            topology: Arc::new(Topology::new()),
            mig_ids: Arc::default(),
            mig_parents: Arc::default(),
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
    pub async fn reconcile(
        &mut self,
        agent: &Agent,
        gpunode: &GpuNode,
        health: &BTreeMap<String, plugin::Health>,
        layout_tx: &watch::Sender<Advertisement>,
    ) -> Option<Instant> {
        let generation = gpunode.metadata.generation;
        let spec = &gpunode.spec;
        if !self.mig_restored {
            if let Some(status) = &gpunode.status {
                self.mig.restore(&status.mig, generation);
                self.sharing_gate.restore(&status.gpus);
            }
            self.mig_restored = true;
        }
        self.decide_driver_root(agent, &spec.cdi.driver_root);
        let mut inventory = self.read_inventory(agent).await;
        let mut mig_wake: Option<Instant> = None;

        // MIG: step the state machine until it waits, reporting each phase change.
        if let Ok(backend) = &agent.backend {
            for _ in 0..256 {
                let Some(Ok(inv)) = &inventory else { break };
                let host = self.host_pid.sees_host_processes();
                let host = host.as_ref().map(|_| ()).map_err(String::as_str);
                match self
                    .mig
                    .advance(backend, &spec.mig, generation, inv, host)
                    .await
                {
                    MigProgress::Waiting(wake) => {
                        mig_wake = wake;
                        break;
                    }
                    MigProgress::PhaseChanged => {
                        self.report(agent, gpunode, inventory.as_ref(), health)
                            .await;
                    }
                    MigProgress::Failed => {
                        self.report(agent, gpunode, inventory.as_ref(), health)
                            .await;
                        break;
                    }
                    MigProgress::Executed => inventory = self.read_inventory(agent).await,
                }
            }
        }

        let inv = match &inventory {
            Some(Ok(inv)) => Some(inv),
            _ => None,
        };
        if let Some(inv) = inv {
            let (ids, parents) = mig_index(inv);
            if let Ok(mut w) = self.mig_ids.write() {
                *w = ids;
            }
            if let Ok(mut w) = self.mig_parents.write() {
                *w = parents;
            }
        }

        // CDI spec, MPS daemons and advertised devices follow the hardware, except
        // mid-reconfiguration.
        let mut mps_wake = None;
        if let (false, Some(inv), Some(root)) = (self.mig.busy(), inv, self.driver_root.clone()) {
            self.cdi.sync(
                agent.config.cdi_dir.as_deref(),
                Roots {
                    driver_root: Some(root.path()),
                    host_root: agent.config.host_root.as_deref(),
                },
                &spec.cdi,
                inv,
            );
            self.mps.set_driver_root(root.path().to_path_buf());
            // A pending change decides on PodResources read now, not on the last sample (which
            // a restarted agent has not taken yet).
            let fresh = if self.sharing_gate.settled(&spec.sharing) {
                Ok(BTreeMap::new())
            } else {
                agent
                    .config
                    .pod_source
                    .list(POD_RESOURCES_TIMEOUT)
                    .await
                    .map_err(|e| e.to_string())
            };
            self.sharing = self.sharing_gate.step(
                inv,
                &spec.sharing,
                spec.mig.strategy,
                fresh.as_ref().map_err(String::as_str),
            );
            let daemons = mps::desired(inv, self.sharing.mps.as_ref());
            mps_wake = self.mps.sync(&daemons, Instant::now()).await;
            let mps_view = MpsView {
                clients: self.mps.clients(),
                down: self
                    .mps
                    .states()
                    .into_iter()
                    .filter_map(|(i, s)| s.err().map(|why| (i, why)))
                    .collect(),
            };
            let withheld = self.sharing_gate.withheld();
            let shown;
            let advertised = if withheld.is_empty() {
                inv
            } else {
                shown = Inventory {
                    gpus: inv
                        .gpus
                        .iter()
                        .filter(|g| !withheld.contains(&g.device.index))
                        .cloned()
                        .collect(),
                    ..inv.clone()
                };
                &shown
            };
            let adv = advertisement(
                advertised,
                spec.mig.strategy,
                &spec.cdi.device_name_strategies,
                &self.sharing,
                &mps_view,
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
        if let Some(root) = self
            .driver_root
            .as_ref()
            .filter(|_| self.validation.due(generation, now))
        {
            let root =
                local_driver_root(agent.config.host_root.as_deref(), root.path().to_path_buf());
            self.validation
                .run(
                    &agent.backend,
                    root,
                    &agent.config.proc_root,
                    &spec.driver,
                    inv,
                    now,
                )
                .await;
        }
        let interval: Duration = spec.utilization.sample_interval.into();
        self.sampling
            .run_if_due(
                agent.backend.as_ref().ok(),
                inv,
                spec.utilization.idle_threshold,
                interval,
                self.host_pid.sees_host_processes().is_ok(),
                now,
            )
            .await;
        let served = layout_tx.borrow().resources.keys().cloned().collect();
        self.foreign.run_if_due(served, now).await;

        self.report(agent, gpunode, inventory.as_ref(), health)
            .await;
        if let Some(inv) = inv {
            self.labels.apply(inv).await;
        }
        agent.metrics.ready.store(true, Ordering::Relaxed);

        [
            Some(self.validation.next()),
            Some(self.sampling.next()),
            Some(self.foreign.next()),
            mig_wake,
            mps_wake,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Reports what the jobs last saw: Events for what changed, status, metrics.
    async fn report(
        &mut self,
        agent: &Agent,
        gpunode: &GpuNode,
        inventory: Option<&Result<Inventory, String>>,
        health: &BTreeMap<String, plugin::Health>,
    ) {
        let mig = self.sharing_gate.status(self.mig.status());
        let mut checks = with_host_pid_check(self.validation.checks(), &self.host_pid);
        if self.root_decision.is_err() || !checks.is_empty() {
            checks.push(trust::root_check(
                &self.root_decision,
                self.driver_root.as_ref(),
            ));
        }
        let observed = Observed {
            checks: checks.clone(),
            mig: Some(mig.clone()),
            gpu_health: match inventory {
                Some(Ok(inv)) => Some(gpu_health(inv, health)),
                _ => None,
            },
            pod_resources: self.sampling.pod_resources.clone(),
            cdi_error: self.cdi.last_error.clone(),
            cdi_spec: self.cdi.check().cloned(),
            foreign_plugin: self.foreign.findings().cloned(),
            mps: self.mps.states(),
        };
        self.events.observe(gpunode, observed).await;
        let status = status::build_status(
            StatusInputs {
                gpunode,
                inventory,
                health,
                idle: &self.sampling.idle,
                pods: &self.sampling.pods,
                pod_resources: self.sampling.pod_resources.as_ref(),
                checks: &checks,
                mig,
                cdi: self.cdi.status.clone(),
                cdi_state: self.cdi.state(),
                foreign_plugin: self.foreign.findings(),
                mps: &self.mps.sharing(),
                sharing: &self.sharing,
            },
            &mut self.conditions,
            Timestamp::now(),
        );
        let validated = status.validated == Some(Verdict::True);
        self.status.publish(gpunode, status).await;
        agent.metrics.set(figures(FigureInputs {
            node: &agent.config.node_name,
            last_sample: self.sampling.last_success.map(|at| at.into_std()),
            last_status_write: self.status.last_write_at(),
            inventory,
            health,
            samples: &self.sampling.samples,
            xids: self.validation.xid_counts(),
            validated,
            status_writes: self.status.writes(),
            cdi_writes: self.cdi.writes,
            cdi_spec_ready: self.cdi.check().map(Result::is_ok),
            foreign_device_plugins: self.foreign.findings().map(|f| f.live.len() as u32),
        }));
    }
}

impl NodeState {
    /// Decides which driver root this pass uses: the admin's `--driver-root`, else the
    /// GpuNode's `requested` root when the node trusts it, else the last one it trusted.
    fn decide_driver_root(&mut self, agent: &Agent, requested: &str) {
        let decision = match &agent.config.driver_root {
            Some(configured) => Ok(TrustedRoot::configured(configured.clone())),
            None => agent
                .config
                .allowed_driver_roots
                .check(requested, agent.config.host_root.as_deref()),
        };
        match &decision {
            Ok(root) => self.driver_root = Some(root.clone()),
            Err(why) if self.root_decision.as_ref().err() != Some(why) => {
                let kept = self.driver_root.as_ref().map(ToString::to_string);
                tracing::warn!(%why, kept = kept.as_deref().unwrap_or("none"), "driver root refused");
            }
            Err(_) => {}
        }
        self.root_decision = decision;
    }
}

/// The driver checks with the host PID namespace check added: always once the driver checks
/// have run, and before that only when it fails (a lone passing check would call the node
/// validated before its driver was looked at).
fn with_host_pid_check(driver: &[CheckResult], host_pid: &HostPidNamespace) -> Vec<CheckResult> {
    let check = host_pid.check();
    let mut out = driver.to_vec();
    if !driver.is_empty() || !check.passed {
        out.push(check);
    }
    out
}

/// The host PID namespace as this process finds it, logged when it is not the host's.
fn host_pid_namespace(host_proc: &Path) -> HostPidNamespace {
    let found = HostPidNamespace::read(host_proc);
    if let Err(why) = found.sees_host_processes() {
        tracing::warn!(%why, "GPU processes are not visible: activity is Unknown and MIG and sharing changes hold");
    }
    found
}

/// Each GPU's health as Events tell it: the health monitor's verdict on the advertised device,
/// else what the inventory read of the GPU said.
fn gpu_health(
    inv: &Inventory,
    health: &BTreeMap<String, plugin::Health>,
) -> BTreeMap<u32, GpuHealthSeen> {
    inv.gpus
        .iter()
        .map(|g| {
            let uuid = g.device.uuid.to_string();
            let fault = match health.get(&uuid) {
                Some(plugin::Health::Unhealthy { reason }) => Some(reason.clone()),
                _ => g.health.as_ref().err().cloned(),
            };
            (g.device.index, GpuHealthSeen { uuid, fault })
        })
        .collect()
}

/// The driver root `root` (in the host's terms) where this process reads it: under
/// `host_root` when the host's `/` is mounted there. A root that cannot be resolved is
/// still joined, so the checks that read it report what is missing.
fn local_driver_root(host_root: Option<&Path>, root: PathBuf) -> PathBuf {
    match DriverRoot::new(host_root, &root) {
        Ok(r) => r.local().to_path_buf(),
        Err(e) => {
            tracing::warn!(error = %e, "driver root");
            match host_root {
                Some(h) => h.join(root.strip_prefix("/").unwrap_or(&root)),
                None => root,
            }
        }
    }
}
