//! GpuNode status: built from what the agent's jobs last saw (pure), and written with
//! server-side apply only when it differs from what was written last, so a steady node costs no
//! writes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpupool_crds::conditions::Observed;
use gpupool_crds::node::{
    CdiStatus, CheckResult, GpuNode, GpuNodeStatus, GpuSharing, GpuStatus, Health as StatusHealth,
    Idleness, MigDeviceStatus, NodeMigStatus, PodRef, Verdict,
};
use gpupool_crds::policy::{MigStrategy as CrdMigStrategy, SharingPolicy};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::FIELD_MANAGER;
use super::advertise::cdi_naming;
use super::cdi_spec::SpecState;
use super::foreign_plugin;
use crate::inventory::Inventory;
use crate::plugin::foreign::Findings;
use crate::plugin::{Advertisement, CdiKind, CdiNaming, Health};
use crate::utilization::IdleTracker;

/// Health of each advertised device (GPU or MIG UUID), from the health-overlaid advertisement.
pub fn device_health(adv: &Advertisement) -> BTreeMap<String, Health> {
    adv.resources
        .values()
        .flatten()
        .map(|d| (d.id.to_string(), d.health.clone()))
        .collect()
}

fn to_status(h: Option<&Health>) -> (StatusHealth, Option<String>) {
    match h {
        Some(Health::Unhealthy { reason }) => (StatusHealth::Unhealthy, Some(reason.clone())),
        _ => (StatusHealth::Healthy, None),
    }
}

/// `gpus` with each shared GPU's sharing named: MPS as the MPS job reports it (`mps`, by GPU
/// index), time-slicing when it selects the GPU's index and a resource it is advertised under
/// (`nvidia.com/gpu` for a whole GPU or under the single strategy, `nvidia.com/mig-<profile>`
/// for its MIG devices).
pub fn with_sharing(
    mut gpus: Vec<GpuStatus>,
    sharing: &SharingPolicy,
    strategy: CrdMigStrategy,
    mps: &BTreeMap<u32, GpuSharing>,
) -> Vec<GpuStatus> {
    for gpu in &mut gpus {
        if let Some(m) = mps.get(&gpu.index) {
            gpu.sharing = Some(m.clone());
        }
    }
    with_time_slicing(&mut gpus, sharing, strategy);
    // A GPU split into MIG devices and not time-sliced: each pod has its own slice, isolated in
    // hardware (memory, caches, compute; a GPU-wide fault still reaches every slice).
    for gpu in gpus
        .iter_mut()
        .filter(|g| g.sharing.is_none() && g.mig_enabled && !g.mig_devices.is_empty())
    {
        gpu.sharing = Some(GpuSharing {
            mode: "MIG".into(),
            replicas: gpu.mig_devices.len() as u32,
            isolation: "Hardware".into(),
            ..GpuSharing::default()
        });
    }
    gpus
}

fn with_time_slicing(gpus: &mut [GpuStatus], sharing: &SharingPolicy, strategy: CrdMigStrategy) {
    let Some(ts) = &sharing.time_slicing else {
        return;
    };
    for gpu in gpus.iter_mut().filter(|g| g.sharing.is_none()) {
        if ts.gpus.as_ref().is_some_and(|g| !g.contains(&gpu.index)) {
            continue;
        }
        let resources: Vec<String> =
            if gpu.mig_devices.is_empty() || strategy != CrdMigStrategy::Mixed {
                vec!["nvidia.com/gpu".to_owned()]
            } else {
                gpu.mig_devices
                    .iter()
                    .map(|m| format!("nvidia.com/mig-{}", m.profile.replace('+', ".")))
                    .collect()
            };
        let selected = ts
            .resources
            .as_ref()
            .is_none_or(|wanted| resources.iter().any(|r| wanted.contains(r)));
        if selected {
            gpu.sharing = Some(GpuSharing {
                mode: "TimeSlicing".into(),
                replicas: ts.replicas,
                isolation: "None".into(),
                ..GpuSharing::default()
            });
        }
    }
}

/// The idleness of each replica pods hold on the GPU `uuid` (`<uuid>::<n>` in `pods`).
fn shares_of(
    uuid: &str,
    idle: &IdleTracker,
    pods: &BTreeMap<String, Vec<PodRef>>,
) -> Vec<Idleness> {
    let prefix = format!("{uuid}{}", crate::plugin::sharing::REPLICA_SEPARATOR);
    pods.range(prefix.clone()..)
        .take_while(|(id, _)| id.starts_with(&prefix))
        .map(|(id, holders)| idle.idleness(id, holders.clone()))
        .collect()
}

/// The `gpus` list of GpuNode status. MIG devices' `cdiName` is `cdi_kind` qualifying the name
/// `naming` gives them: the one the kubelet plugins' `Allocate` hands out.
pub fn gpu_statuses(
    inventory: &Inventory,
    health: &BTreeMap<String, Health>,
    idle: &IdleTracker,
    pods: &BTreeMap<String, Vec<PodRef>>,
    cdi_kind: &CdiKind,
    naming: CdiNaming,
) -> Vec<GpuStatus> {
    inventory
        .gpus
        .iter()
        .map(|g| {
            let uuid = g.device.uuid.to_string();
            let mig_health: Vec<Option<&Health>> = g
                .mig_devices
                .iter()
                .map(|m| health.get(m.uuid.as_str()))
                .collect();
            let (mut gpu_health, mut reason) = to_status(health.get(&uuid));
            // Under MIG the GPU itself may not be advertised; it is unhealthy when all of its
            // advertised MIG devices are.
            if health.get(&uuid).is_none()
                && !mig_health.is_empty()
                && mig_health
                    .iter()
                    .all(|h| matches!(h, Some(Health::Unhealthy { .. })))
            {
                (gpu_health, reason) = to_status(mig_health[0]);
            }
            if let Err(e) = &g.health
                && (e.contains("fallen off the bus") || e.contains("lost"))
            {
                gpu_health = StatusHealth::Unhealthy;
                reason = Some(e.clone());
            }
            let mig_devices = g
                .mig_devices
                .iter()
                .enumerate()
                .map(|(j, m)| {
                    let (h, _) = to_status(health.get(m.uuid.as_str()));
                    MigDeviceStatus {
                        uuid: m.uuid.to_string(),
                        profile: m.profile.to_string().into(),
                        gpu_instance: m.gpu_instance.0,
                        compute_instance: m.compute_instance.0,
                        cdi_name: cdi_kind.qualify(&naming.mig_device_name(
                            g.device.index,
                            j as u32,
                            m.uuid.as_str(),
                        )),
                        health: h,
                        idleness: idle.idleness(
                            m.uuid.as_str(),
                            pods.get(m.uuid.as_str()).cloned().unwrap_or_default(),
                        ),
                    }
                })
                .collect();
            GpuStatus {
                index: g.device.index,
                uuid: uuid.clone(),
                model: g.device.name.as_str().into(),
                memory_mib: g.device.memory_mib,
                pci_bus_id: g.device.pci_bus_id.clone(),
                health: gpu_health,
                reason,
                mig_enabled: g.mig_enabled(),
                mig_pending: g
                    .mig_mode
                    .filter(|m| m.pending != m.current)
                    .map(|m| m.pending),
                mig_devices,
                sharing: None,
                shares: if g.mig_enabled() {
                    Vec::new()
                } else {
                    shares_of(&uuid, idle, pods)
                },
                idleness: if g.mig_enabled() {
                    Idleness::default()
                } else {
                    idle.idleness(&uuid, pods.get(&uuid).cloned().unwrap_or_default())
                },
            }
        })
        .collect()
}

/// `True` / `False` from check results (`Unknown` when there are none).
pub fn validated(checks: &[CheckResult]) -> Verdict {
    Verdict::of_checks(checks)
}

/// Sets a condition in `conditions` with [`gpupool_crds::conditions::set_condition`]
/// (`lastTransitionTime` kept unless the status changes, whole seconds), sorted by type.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    gpupool_crds::conditions::set_condition(
        conditions,
        Observed {
            type_,
            status,
            reason,
            message: message.to_owned(),
            observed_generation: generation,
        },
        now,
    );
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
}

pub use gpupool_crds::node::{CDI_SPEC_READY, FOREIGN_DEVICE_PLUGIN};

/// Everything GpuNode status is built from: what each of the agent's jobs last saw.
pub struct StatusInputs<'a> {
    /// The GpuNode (its spec's CDI kind and naming, its generation).
    pub gpunode: &'a GpuNode,
    /// The GPUs, or why they could not be read; `None` without a backend.
    pub inventory: Option<&'a Result<Inventory, String>>,
    /// Health per advertised device.
    pub health: &'a BTreeMap<String, Health>,
    /// Idleness per device.
    pub idle: &'a IdleTracker,
    /// Pods holding each device.
    pub pods: &'a BTreeMap<String, Vec<PodRef>>,
    /// The last PodResources call; `None` before the first.
    pub pod_resources: Option<&'a Result<(), String>>,
    /// The driver checks as last run.
    pub checks: &'a [CheckResult],
    /// The MIG state machine's status.
    pub mig: NodeMigStatus,
    /// The CDI spec as last written.
    pub cdi: Option<CdiStatus>,
    /// Whether the spec the runtime reads is the agent's and resolvable; `None` with CDI off.
    pub cdi_state: Option<SpecState>,
    /// What the last scan for other device plugins found; `None` before the first.
    pub foreign_plugin: Option<&'a Findings>,
    /// The sharing of each GPU under MPS, with its daemon's state.
    pub mps: &'a BTreeMap<u32, GpuSharing>,
    /// The sharing applied (the GpuNode's, unless a mode change waits for pods to leave).
    pub sharing: &'a SharingPolicy,
}

/// GpuNode status from `inputs`. `conditions` carries the agent's conditions from one build to
/// the next, so that a condition keeps its transition time while its status holds.
pub fn build_status(
    inputs: StatusInputs<'_>,
    conditions: &mut Vec<Condition>,
    now: Timestamp,
) -> GpuNodeStatus {
    let generation = inputs.gpunode.metadata.generation;
    let spec = &inputs.gpunode.spec;
    let kind = spec.cdi.kind.parse::<CdiKind>().unwrap_or_default();
    let (driver_version, cuda_version, gpus) = match inputs.inventory {
        Some(Ok(inv)) => (
            Some(inv.driver.driver_version.clone()),
            Some(inv.driver.cuda_version.to_string()),
            with_sharing(
                gpu_statuses(
                    inv,
                    inputs.health,
                    inputs.idle,
                    inputs.pods,
                    &kind,
                    cdi_naming(&spec.cdi.device_name_strategies),
                ),
                inputs.sharing,
                spec.mig.strategy,
                inputs.mps,
            ),
        ),
        _ => (None, None, Vec::new()),
    };
    if let Some(pr) = inputs.pod_resources {
        let (ok, reason, msg) = match pr {
            Ok(()) => (
                true,
                "Listed",
                "the kubelet PodResources API answers".to_owned(),
            ),
            Err(e) => (false, "Unavailable", e.clone()),
        };
        set_condition(
            conditions,
            "PodResourcesAvailable",
            ok,
            reason,
            &msg,
            generation,
            now,
        );
    }
    match &inputs.cdi_state {
        Some(state) => {
            let (ok, reason, msg) = match state {
                SpecState::Ready { path } => (
                    true,
                    "SpecCurrent",
                    format!("{path} is as the agent wrote it and no other spec claims its devices"),
                ),
                SpecState::Problem(p) => (false, p.kind.reason(), p.message.clone()),
                SpecState::WriteFailed(e) => (false, "WriteFailed", e.clone()),
            };
            set_condition(
                conditions,
                CDI_SPEC_READY,
                ok,
                reason,
                &msg,
                generation,
                now,
            );
        }
        None => conditions.retain(|c| c.type_ != CDI_SPEC_READY),
    }
    if let Some(found) = inputs.foreign_plugin {
        let (status, reason, msg) = foreign_plugin::condition(found);
        set_condition(
            conditions,
            FOREIGN_DEVICE_PLUGIN,
            status,
            reason,
            &msg,
            generation,
            now,
        );
    }
    let healthy = gpus
        .iter()
        .filter(|g| g.health == StatusHealth::Healthy)
        .count() as u32;
    GpuNodeStatus {
        observed_generation: generation,
        driver_version,
        cuda_version,
        gpu_count: gpus.len() as u32,
        healthy_gpus: healthy,
        validated: Some(validated(inputs.checks)),
        checks: inputs.checks.to_vec(),
        gpus,
        mig: inputs.mig,
        cdi: inputs.cdi,
        conditions: conditions.clone(),
        heartbeat_time: None,
    }
}

/// Writes GpuNode status with server-side apply when it differs from the last status written
/// (or, for a GpuNode not written yet, from the one the server holds), and at least once per
/// heartbeat interval even when it does not: each write carries `heartbeatTime`, by which the
/// operator tells a live agent from a dead, hung or cut-off one.
pub struct StatusPublisher {
    api: Api<GpuNode>,
    /// The GpuNode's UID and the status last written to it (without its heartbeat).
    last_written: Option<(String, GpuNodeStatus)>,
    /// When the last write went through.
    last_write_at: Option<Instant>,
    heartbeat: Duration,
    writes: u64,
}

impl StatusPublisher {
    /// A publisher writing through `client`, stamping at least every `heartbeat`.
    pub fn new(client: Client, heartbeat: Duration) -> StatusPublisher {
        StatusPublisher {
            api: Api::all(client),
            last_written: None,
            last_write_at: None,
            heartbeat,
            writes: 0,
        }
    }

    /// When the last write (a change or a heartbeat) went through.
    pub fn last_write_at(&self) -> Option<Instant> {
        self.last_write_at
    }

    /// Status writes so far.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// [`Self::publish_at`] now.
    pub async fn publish(&mut self, gpunode: &GpuNode, status: GpuNodeStatus) {
        self.publish_at(gpunode, status, Timestamp::now(), Instant::now())
            .await;
    }

    /// Writes `status` to `gpunode`, stamped `now`, unless it is what the GpuNode already has
    /// and the last write is less than a heartbeat old (`mono`). A failed write is logged and
    /// tried again at the next report.
    pub async fn publish_at(
        &mut self,
        gpunode: &GpuNode,
        mut status: GpuNodeStatus,
        now: Timestamp,
        mono: Instant,
    ) {
        status.heartbeat_time = None;
        let uid = gpunode.uid().unwrap_or_default();
        let unchanged = match &self.last_written {
            Some((u, last)) if *u == uid => *last == status,
            // First pass for this object: compare with what the server holds.
            _ => gpunode.status.as_ref().is_some_and(|held| {
                let mut held = held.clone();
                held.heartbeat_time = None;
                held == status
            }),
        };
        let heartbeat_due = self
            .last_write_at
            .is_none_or(|at| mono.saturating_duration_since(at) >= self.heartbeat);
        if unchanged && !heartbeat_due {
            self.last_written = Some((uid, status));
            return;
        }
        let mut stamped = status.clone();
        stamped.heartbeat_time = Some(Time(now));
        let patch = json!({
            "apiVersion": "gpupool.io/v1alpha1",
            "kind": "GpuNode",
            "status": stamped,
        });
        match self
            .api
            .patch_status(
                &gpunode.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {
                self.writes += 1;
                tracing::debug!(changed = !unchanged, "GpuNode status written");
                self.last_written = Some((uid, status));
                self.last_write_at = Some(mono);
            }
            Err(e) => tracing::warn!(error = %e, "writing GpuNode status"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::advertise::advertisement;
    use crate::backend::{CiProfileId, GiProfileId, GpuBackend, ManualSimClock, SimBackend};
    use crate::plugin::allocate::container_response;
    use crate::plugin::{AllocateOptions, ResourceView, Topology};
    use gpupool_crds::policy::{CdiDeviceNameStrategy, MigStrategy as CrdMigStrategy};
    use gpupool_mig_catalog as catalog;
    use std::sync::Arc;

    #[test]
    fn time_sliced_gpus_name_their_sharing_and_isolation() {
        use gpupool_crds::policy::TimeSlicingPolicy;
        let gpu = |index: u32, migs: &[&str]| GpuStatus {
            index,
            mig_devices: migs
                .iter()
                .map(|p| MigDeviceStatus {
                    profile: (*p).into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let gpus = vec![gpu(0, &[]), gpu(1, &[]), gpu(2, &["1g.10gb", "1g.10gb"])];
        let ts = |gpus: Option<Vec<u32>>, resources: Option<Vec<&str>>| SharingPolicy {
            time_slicing: Some(TimeSlicingPolicy {
                replicas: 3,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                placement: Default::default(),
                resources: resources.map(|r| r.into_iter().map(str::to_owned).collect()),
                gpus,
                models: None,
            }),
            mps: None,
        };
        let shared = |out: Vec<GpuStatus>| -> Vec<u32> {
            out.iter()
                .filter(|g| g.sharing.is_some())
                .map(|g| g.index)
                .collect()
        };
        let none = BTreeMap::new();
        let all = with_sharing(gpus.clone(), &ts(None, None), CrdMigStrategy::Mixed, &none);
        assert_eq!(shared(all.clone()), [0, 1, 2]);
        assert_eq!(
            all[0].sharing,
            Some(GpuSharing {
                mode: "TimeSlicing".into(),
                replicas: 3,
                isolation: "None".into(),
                ..GpuSharing::default()
            })
        );
        let some = ts(Some(vec![1, 2]), Some(vec!["nvidia.com/mig-1g.10gb"]));
        assert_eq!(
            shared(with_sharing(
                gpus.clone(),
                &some,
                CrdMigStrategy::Mixed,
                &none
            )),
            [2]
        );
        // A GPU under MPS reports its daemon's sharing, whatever time-slicing says.
        let mps = GpuSharing {
            mode: "MPS".into(),
            replicas: 4,
            isolation: gpupool_crds::node::MPS_ISOLATION.into(),
            memory_limit_mib: Some(5000),
            active_thread_percentage: Some(25),
            daemon: Some("Running".into()),
        };
        let under_mps = with_sharing(
            gpus.clone(),
            &some,
            CrdMigStrategy::Mixed,
            &BTreeMap::from([(0, mps.clone())]),
        );
        assert_eq!(shared(under_mps.clone()), [0, 2]);
        assert_eq!(under_mps[0].sharing, Some(mps));
        // MIG devices not time-sliced: isolated in hardware.
        let mut migged = gpus.clone();
        migged[2].mig_enabled = true;
        let out = with_sharing(
            migged,
            &SharingPolicy::default(),
            CrdMigStrategy::Mixed,
            &none,
        );
        assert_eq!(
            out[2].sharing,
            Some(GpuSharing {
                mode: "MIG".into(),
                replicas: 2,
                isolation: "Hardware".into(),
                ..GpuSharing::default()
            })
        );
        assert!(
            shared(with_sharing(
                gpus,
                &SharingPolicy::default(),
                CrdMigStrategy::Mixed,
                &none
            ))
            .is_empty()
        );
    }

    #[test]
    fn conditions_keep_transition_time_until_status_changes() {
        let t = |s: i64| Timestamp::from_second(1_700_000_000 + s).unwrap();
        let mut c = Vec::new();
        set_condition(
            &mut c,
            "PodResourcesAvailable",
            false,
            "SocketMissing",
            "m",
            Some(1),
            t(0),
        );
        set_condition(
            &mut c,
            "PodResourcesAvailable",
            false,
            "SocketMissing",
            "m",
            Some(1),
            t(10),
        );
        assert_eq!(c[0].last_transition_time, Time(t(0)));
        set_condition(
            &mut c,
            "PodResourcesAvailable",
            true,
            "Listed",
            "ok",
            Some(1),
            t(20),
        );
        assert_eq!(c[0].last_transition_time, Time(t(20)));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn validated_summary() {
        let ok = CheckResult {
            name: "A".into(),
            passed: true,
            message: String::new(),
        };
        let bad = CheckResult {
            passed: false,
            ..ok.clone()
        };
        assert_eq!(validated(&[]), Verdict::Unknown);
        assert_eq!(validated(std::slice::from_ref(&ok)), Verdict::True);
        assert_eq!(validated(&[ok, bad]), Verdict::False);
    }

    fn gpunode(uid: &str, status: Option<GpuNodeStatus>) -> GpuNode {
        let mut gn = crate::agent::testing::gpunode("node-a");
        gn.metadata.uid = Some(uid.into());
        gn.metadata.generation = Some(3);
        gn.status = status;
        gn
    }

    fn status_for(gn: &GpuNode, checks: &[CheckResult]) -> GpuNodeStatus {
        let inv: Result<Inventory, String> = Ok(crate::agent::testing::inventory());
        build_status(
            StatusInputs {
                gpunode: gn,
                inventory: Some(&inv),
                health: &BTreeMap::new(),
                idle: &IdleTracker::new(1),
                pods: &BTreeMap::new(),
                pod_resources: Some(&Ok(())),
                checks,
                mig: NodeMigStatus::default(),
                cdi: None,
                cdi_state: None,
                foreign_plugin: None,
                mps: &BTreeMap::new(),
                sharing: &SharingPolicy::default(),
            },
            &mut Vec::new(),
            Timestamp::from_second(1_700_000_000).unwrap(),
        )
    }

    #[test]
    fn status_is_built_from_the_jobs() {
        let gn = gpunode("u1", None);
        let ok = CheckResult {
            name: "DriverVersion".into(),
            passed: true,
            message: String::new(),
        };
        let s = status_for(&gn, std::slice::from_ref(&ok));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!((s.gpu_count, s.healthy_gpus), (2, 2));
        assert_eq!(s.validated, Some(validated(&[ok])));
        assert_eq!(s.driver_version.as_deref(), Some("550.54.15"));
        assert_eq!(s.conditions.len(), 1);
        assert_eq!(s.conditions[0].type_, "PodResourcesAvailable");
        assert_eq!(s.conditions[0].status, "True");
    }

    #[test]
    fn cdi_spec_ready_follows_the_cdi_job() {
        use crate::agent::cdi_spec::{ProblemKind, SpecProblem};
        let gn = gpunode("u1", None);
        let inv: Result<Inventory, String> = Ok(crate::agent::testing::inventory());
        let build = |state: Option<SpecState>, conditions: &mut Vec<Condition>| {
            build_status(
                StatusInputs {
                    gpunode: &gn,
                    inventory: Some(&inv),
                    health: &BTreeMap::new(),
                    idle: &IdleTracker::new(1),
                    pods: &BTreeMap::new(),
                    pod_resources: None,
                    checks: &[],
                    mig: NodeMigStatus::default(),
                    cdi: None,
                    cdi_state: state,
                    foreign_plugin: None,
                    mps: &BTreeMap::new(),
                    sharing: &SharingPolicy::default(),
                },
                conditions,
                Timestamp::from_second(1_700_000_000).unwrap(),
            )
        };
        let cases = [
            (
                Some(SpecState::Ready {
                    path: "/x/gpupool-nvidia.yaml".into(),
                }),
                Some(("True", "SpecCurrent")),
            ),
            (
                Some(SpecState::Problem(SpecProblem {
                    kind: ProblemKind::Missing,
                    message: "gone".into(),
                })),
                Some(("False", "SpecMissing")),
            ),
            (
                Some(SpecState::WriteFailed("no driver".into())),
                Some(("False", "WriteFailed")),
            ),
            (None, None),
        ];
        let mut conditions = Vec::new();
        for (state, want) in cases {
            let s = build(state.clone(), &mut conditions);
            let got = s
                .conditions
                .iter()
                .find(|c| c.type_ == CDI_SPEC_READY)
                .map(|c| (c.status.as_str(), c.reason.as_str()));
            assert_eq!(got, want, "{state:?}");
        }
    }

    #[test]
    fn foreign_device_plugin_follows_the_scan() {
        use crate::plugin::foreign::ForeignSocket;
        let gn = gpunode("u1", None);
        let found = |live: bool| Findings {
            live: if live {
                vec![ForeignSocket {
                    socket: "nvidia-gpu.sock".into(),
                    resource: "nvidia.com/gpu".parse().unwrap(),
                    also_ours: true,
                }]
            } else {
                Vec::new()
            },
            ..Findings::default()
        };
        let mut conditions = Vec::new();
        let mut get = |findings: Option<&Findings>| {
            let s = build_status(
                StatusInputs {
                    gpunode: &gn,
                    inventory: None,
                    health: &BTreeMap::new(),
                    idle: &IdleTracker::new(1),
                    pods: &BTreeMap::new(),
                    pod_resources: None,
                    checks: &[],
                    mig: NodeMigStatus::default(),
                    cdi: None,
                    cdi_state: None,
                    foreign_plugin: findings,
                    mps: &BTreeMap::new(),
                    sharing: &SharingPolicy::default(),
                },
                &mut conditions,
                Timestamp::from_second(1_700_000_000).unwrap(),
            );
            s.conditions
                .iter()
                .find(|c| c.type_ == FOREIGN_DEVICE_PLUGIN)
                .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        };
        assert_eq!(get(None), None, "no scan yet: no condition");
        let (status, reason, message) = get(Some(&found(true))).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("True", "SameResource"));
        assert!(
            message.contains("nvidia-gpu.sock (nvidia.com/gpu)"),
            "{message}"
        );
        let (status, reason, _) = get(Some(&found(false))).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "NoneFound"));
    }

    #[tokio::test]
    async fn status_is_applied_only_when_it_changes() {
        use crate::agent::testing::{ApiMock, Expect};
        let (client, mock) = ApiMock::new();
        let apply = |healthy: u64| Expect {
            method: "PATCH",
            path: "/apis/gpupool.io/v1alpha1/gpunodes/node-a/status",
            query: &["fieldManager=gpupool-agent", "force=true"],
            status: 200,
            check: Box::new(move |body: &serde_json::Value| {
                assert_eq!(body["kind"], "GpuNode", "{body}");
                assert_eq!(body["status"]["healthyGpus"], healthy, "{body}");
            }),
            reply: Some(serde_json::to_value(gpunode("u1", None)).unwrap()),
        };
        let server = mock.serve(vec![apply(2), apply(1)]);
        let mut publisher = StatusPublisher::new(client, Duration::from_secs(60));
        let gn = gpunode("u1", None);
        let status = status_for(&gn, &[]);
        publisher.publish(&gn, status.clone()).await;
        publisher.publish(&gn, status.clone()).await; // unchanged: no request
        let mut worse = status.clone();
        worse.healthy_gpus = 1;
        publisher.publish(&gn, worse.clone()).await;
        assert_eq!(publisher.writes(), 2);
        // A new GpuNode (new UID) that already holds this status on the server (with an older
        // heartbeat): no write.
        let mut held = worse.clone();
        held.heartbeat_time = Some(Time(Timestamp::from_second(1_600_000_000).unwrap()));
        let again = gpunode("u2", Some(held));
        publisher.publish(&again, worse).await;
        assert_eq!(publisher.writes(), 2);
        drop(publisher);
        server.await.unwrap();
    }

    /// An unchanged status is written again once a heartbeat interval has passed, stamped
    /// with the time of the write; not before.
    #[tokio::test]
    async fn an_unchanged_status_is_stamped_every_heartbeat() {
        use crate::agent::testing::{ApiMock, Expect};
        let (client, mock) = ApiMock::new();
        let stamp = |secs: i64| Expect {
            method: "PATCH",
            path: "/apis/gpupool.io/v1alpha1/gpunodes/node-a/status",
            query: &["fieldManager=gpupool-agent", "force=true"],
            status: 200,
            check: Box::new(move |body: &serde_json::Value| {
                let want = Timestamp::from_second(1_700_000_000 + secs)
                    .unwrap()
                    .to_string();
                assert_eq!(body["status"]["heartbeatTime"], want.as_str(), "{body}");
            }),
            reply: Some(serde_json::to_value(gpunode("u1", None)).unwrap()),
        };
        let server = mock.serve(vec![stamp(0), stamp(61)]);
        let mut publisher = StatusPublisher::new(client, Duration::from_secs(60));
        let gn = gpunode("u1", None);
        let status = status_for(&gn, &[]);
        let start = Instant::now();
        let at = |secs: u64| {
            (
                Timestamp::from_second(1_700_000_000 + secs as i64).unwrap(),
                start + Duration::from_secs(secs),
            )
        };
        for secs in [0, 30, 59, 61, 90] {
            let (now, mono) = at(secs);
            publisher.publish_at(&gn, status.clone(), now, mono).await;
        }
        assert_eq!(publisher.writes(), 2);
        drop(publisher);
        server.await.unwrap();
    }

    /// The condition for another plugin, from a real scan, is what the status write carries.
    #[tokio::test]
    async fn a_foreign_plugin_reaches_the_status_write() {
        use crate::agent::testing::{ApiMock, Expect};
        use std::collections::BTreeSet;
        let tmp = tempfile::tempdir().unwrap();
        let _nvidia =
            std::os::unix::net::UnixListener::bind(tmp.path().join("nvidia-gpu.sock")).unwrap();
        let served: BTreeSet<crate::plugin::ResourceName> =
            ["nvidia.com/gpu".parse().unwrap()].into();
        let found = crate::plugin::foreign::scan(
            tmp.path(),
            &served,
            "gpupool",
            std::time::Duration::from_secs(2),
        )
        .await
        .unwrap();
        let (client, mock) = ApiMock::new();
        let server = mock.serve(vec![Expect {
            method: "PATCH",
            path: "/apis/gpupool.io/v1alpha1/gpunodes/node-a/status",
            query: &["fieldManager=gpupool-agent"],
            status: 200,
            check: Box::new(|body: &serde_json::Value| {
                let conditions = body["status"]["conditions"].as_array().unwrap();
                let c = conditions
                    .iter()
                    .find(|c| c["type"] == "ForeignDevicePlugin")
                    .unwrap_or_else(|| panic!("no ForeignDevicePlugin in {body}"));
                assert_eq!(c["status"], "True", "{body}");
                assert_eq!(c["reason"], "SameResource", "{body}");
                let message = c["message"].as_str().unwrap();
                assert!(
                    message.contains("nvidia-gpu.sock (nvidia.com/gpu)"),
                    "{body}"
                );
            }),
            reply: Some(serde_json::to_value(gpunode("u1", None)).unwrap()),
        }]);
        let gn = gpunode("u1", None);
        let status = build_status(
            StatusInputs {
                gpunode: &gn,
                inventory: None,
                health: &BTreeMap::new(),
                idle: &IdleTracker::new(1),
                pods: &BTreeMap::new(),
                pod_resources: None,
                checks: &[],
                mig: NodeMigStatus::default(),
                cdi: None,
                cdi_state: None,
                foreign_plugin: Some(&found),
                mps: &BTreeMap::new(),
                sharing: &SharingPolicy::default(),
            },
            &mut Vec::new(),
            Timestamp::from_second(1_700_000_000).unwrap(),
        );
        let mut publisher = StatusPublisher::new(client, Duration::from_secs(60));
        publisher.publish(&gn, status).await;
        drop(publisher);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_refused_status_write_is_tried_again() {
        use crate::agent::testing::{ApiMock, Expect};
        let (client, mock) = ApiMock::new();
        let apply = |status| Expect {
            method: "PATCH",
            path: "/apis/gpupool.io/v1alpha1/gpunodes/node-a/status",
            query: &["fieldManager=gpupool-agent"],
            status,
            check: Box::new(|_: &serde_json::Value| {}),
            reply: Some(serde_json::to_value(gpunode("u1", None)).unwrap()),
        };
        let server = mock.serve(vec![apply(403), apply(200)]);
        let mut publisher = StatusPublisher::new(client, Duration::from_secs(60));
        let gn = gpunode("u1", None);
        let status = status_for(&gn, &[]);
        publisher.publish(&gn, status.clone()).await;
        assert_eq!(publisher.writes(), 0);
        publisher.publish(&gn, status).await;
        assert_eq!(publisher.writes(), 1);
        drop(publisher);
        server.await.unwrap();
    }

    /// An A30 with three MIG devices and an L4 (fixtures/mixed-small.yaml).
    fn mig_inventory() -> Inventory {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join("mixed-small.yaml");
        let sim = SimBackend::from_file(&fixture, Arc::new(ManualSimClock::new())).unwrap();
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
                &Default::default(),
                &Default::default(),
                Arc::new(Topology::new()),
            );
            let statuses = gpu_statuses(
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
