//! The state machine: everything that changes while a simulated node runs (MIG mode, GPU and
//! compute instances, injected faults), and what NVML answers from it at a given time. Kept in
//! memory by `SimBackend` and in a JSON state file by the fake library.

use std::collections::BTreeMap;

use gpupool_mig_catalog::{self as catalog, GpuModel, MigProfileSpec};
use serde::{Deserialize, Serialize};

use crate::error::{SimError, SimResult};
use crate::fixture::{BusyPeriod, FaultFixture, FaultKind};
use crate::node::{Node, mig_uuid};

/// Everything that changes while a simulated node runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SimState {
    /// Simulated time in seconds, when a test pins it (the fake library's clock; `SimBackend`
    /// takes its time from its own clock instead).
    #[serde(default)]
    pub clock_s: Option<f64>,
    /// Per-GPU state, by index.
    pub gpus: Vec<GpuState>,
    /// Faults injected at runtime.
    #[serde(default)]
    pub injected: Vec<InjectedFault>,
    /// Sequence number of the next injected fault.
    #[serde(default)]
    pub next_seq: u64,
    /// Per GPU: the last time its faults were cleared (a reset), and the injected-fault
    /// sequence number at that time.
    #[serde(default)]
    pub clears: BTreeMap<u32, Clear>,
    /// Compute processes started at runtime, per GPU index (beside the fixture's), for tests
    /// that start and stop workloads while the node runs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub processes: BTreeMap<u32, Vec<crate::fixture::ProcessFixture>>,
}

/// When a GPU's faults were last cleared.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Clear {
    /// Time of the clear.
    pub at: f64,
    /// Injected faults with a lower sequence number are cleared.
    pub seq: u64,
}

/// A fault injected at runtime.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InjectedFault {
    /// Order of injection.
    pub seq: u64,
    /// The fault; its `at` is the time of injection.
    pub fault: FaultFixture,
}

/// MIG state of one GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuState {
    /// MIG mode in effect.
    pub mig_current: bool,
    /// MIG mode after the next reset.
    pub mig_pending: bool,
    /// GPU instances.
    pub gpu_instances: Vec<GiState>,
}

/// A GPU instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GiState {
    /// GPU instance ID.
    pub id: u32,
    /// Profile ID (`info.id`).
    pub profile_id: u32,
    /// Placement start (memory slices).
    pub start: u32,
    /// Placement size (memory slices).
    pub size: u32,
    /// Compute instances.
    pub compute_instances: Vec<CiState>,
}

/// A compute instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CiState {
    /// Compute instance ID.
    pub id: u32,
    /// Profile ID (= NVML enum value).
    pub profile_id: u32,
    /// Placement start (compute slices within the GPU instance).
    pub start: u32,
    /// Placement size (compute slices).
    pub size: u32,
}

/// A MIG device (one compute instance) as enumeration shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SimMigDevice {
    /// Parent GPU index.
    pub gpu: u32,
    /// GPU instance ID.
    pub gi: u32,
    /// Compute instance ID.
    pub ci: u32,
    /// `MIG-…` UUID.
    pub uuid: String,
    /// GPU-instance profile.
    pub profile: &'static MigProfileSpec,
    /// Compute slices of the compute instance.
    pub ci_slices: u32,
}

impl SimMigDevice {
    /// Name as `nvidia-smi -L` shows it: `1g.10gb`, or `1c.3g.40gb` for a partial CI.
    pub fn name(&self) -> String {
        if self.ci_slices == self.profile.compute_slices {
            self.profile.name.to_owned()
        } else {
            format!("{}c.{}", self.ci_slices, self.profile.name)
        }
    }
}

/// A health event as NVML's event set would deliver it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimEvent {
    /// Identity, for at-most-once delivery per subscriber.
    pub key: EventKey,
    /// GPU index.
    pub gpu: u32,
    /// NVML event type bit (`nvmlEventType*`).
    pub event_type: u64,
    /// Event data (the Xid code for Xid events).
    pub data: u64,
    /// GPU instance, or `u32::MAX` when not attributed.
    pub gpu_instance: u32,
    /// Compute instance, or `u32::MAX` when not attributed.
    pub compute_instance: u32,
}

/// Which fault an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventKey {
    /// The fixture's fault at this position.
    Scripted(usize),
    /// The injected fault with this sequence number.
    Injected(u64),
}

/// NVML event type bits (`nvmlEventType*` in nvml.h).
pub mod event_type {
    /// `nvmlEventTypeSingleBitEccError`
    pub const SINGLE_BIT_ECC: u64 = 0x1;
    /// `nvmlEventTypeDoubleBitEccError`
    pub const DOUBLE_BIT_ECC: u64 = 0x2;
    /// `nvmlEventTypeXidCriticalError`
    pub const XID: u64 = 0x8;
}

/// Xid NVIDIA documents as "GPU has fallen off the bus".
pub const XID_FALLEN_OFF_BUS: u64 = 79;

/// Health counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimHealth {
    /// Volatile uncorrected ECC errors.
    pub ecc_uncorrected: u64,
    /// Volatile corrected ECC errors.
    pub ecc_corrected: u64,
    /// PCIe replay counter.
    pub pcie_replay: u64,
    /// Retired pages / remapped rows after uncorrectable errors.
    pub retired: u64,
    /// Temperature, °C.
    pub temperature_c: u32,
}

/// A process on a GPU at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimProcess {
    /// Process ID.
    pub pid: u32,
    /// Memory used, MiB.
    pub used_memory_mib: u64,
    /// GPU instance, if on a MIG device.
    pub gpu_instance: Option<u32>,
    /// Compute instance, if on a MIG device.
    pub compute_instance: Option<u32>,
    /// Its own SM utilization, percent.
    pub sm_util: u32,
}

impl SimState {
    /// The state of `node` at boot: MIG modes as the fixture says, no instances, no injected
    /// faults.
    pub fn boot(node: &Node) -> SimState {
        SimState {
            clock_s: None,
            gpus: node
                .gpus
                .iter()
                .map(|g| GpuState {
                    mig_current: g.mig_enabled_at_boot,
                    mig_pending: g.mig_enabled_at_boot,
                    gpu_instances: Vec::new(),
                })
                .collect(),
            injected: Vec::new(),
            next_seq: 0,
            clears: BTreeMap::new(),
            processes: BTreeMap::new(),
        }
    }

    fn gpu_mut(&mut self, index: u32) -> SimResult<&mut GpuState> {
        self.gpus
            .get_mut(index as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("no GPU with index {index}")))
    }

    fn gpu_ref(&self, index: u32) -> SimResult<&GpuState> {
        self.gpus
            .get(index as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("no GPU with index {index}")))
    }

    /// All faults (scripted and injected) active on `gpu` at `now`, in time order.
    fn active_faults<'a>(
        &'a self,
        node: &'a Node,
        gpu: u32,
        now: f64,
    ) -> impl Iterator<Item = (EventKey, &'a FaultFixture)> + 'a {
        let clear = self.clears.get(&gpu).copied();
        let scripted = node
            .fixture
            .faults
            .iter()
            .enumerate()
            .filter(move |(_, f)| f.gpu == gpu && f.at <= now && clear.is_none_or(|c| f.at > c.at))
            .map(|(i, f)| (EventKey::Scripted(i), f));
        let injected = self
            .injected
            .iter()
            .filter(move |f| {
                f.fault.gpu == gpu && f.fault.at <= now && clear.is_none_or(|c| f.seq >= c.seq)
            })
            .map(|f| (EventKey::Injected(f.seq), &f.fault));
        scripted.chain(injected)
    }

    /// Whether the GPU has fallen off the bus at `now`.
    pub fn is_lost(&self, node: &Node, gpu: u32, now: f64) -> bool {
        self.active_faults(node, gpu, now)
            .any(|(_, f)| f.fault == FaultKind::FallenOffBus)
    }

    /// Fails with `GpuIsLost` when the GPU has fallen off the bus.
    pub fn check_alive(&self, node: &Node, gpu: u32, now: f64) -> SimResult<()> {
        node.gpu(gpu)?;
        if self.is_lost(node, gpu, now) {
            Err(SimError::GpuIsLost(gpu))
        } else {
            Ok(())
        }
    }

    /// Health counters at `now`.
    pub fn health(&self, node: &Node, gpu: u32, now: f64) -> SimResult<SimHealth> {
        self.check_alive(node, gpu, now)?;
        let mut health = SimHealth {
            temperature_c: node.gpu(gpu)?.temperature_c,
            ..SimHealth::default()
        };
        for (_, f) in self.active_faults(node, gpu, now) {
            match f.fault {
                FaultKind::DoubleBitEcc(n) => health.ecc_uncorrected += n,
                FaultKind::SingleBitEcc(n) => health.ecc_corrected += n,
                FaultKind::PcieReplay(n) => health.pcie_replay += n,
                FaultKind::RetiredPages(n) => health.retired += n,
                FaultKind::Temperature(c) => health.temperature_c = c,
                FaultKind::Xid(_) | FaultKind::FallenOffBus => {}
            }
        }
        Ok(health)
    }

    /// Persistence mode at `now` (`nvmlDeviceGetPersistenceMode`): as the fixture says, unless
    /// the GPU is lost.
    pub fn persistence_mode(&self, node: &Node, gpu: u32, now: f64) -> SimResult<bool> {
        self.check_alive(node, gpu, now)?;
        Ok(node.gpu(gpu)?.persistence_mode)
    }

    /// Events of every GPU whose faults are active at `now`, in order; the caller remembers
    /// which keys it has delivered.
    pub fn events(&self, node: &Node, now: f64) -> Vec<SimEvent> {
        let mut out: Vec<(f64, SimEvent)> = Vec::new();
        for gpu in &node.gpus {
            for (key, f) in self.active_faults(node, gpu.index, now) {
                let (event_type, data) = match f.fault {
                    FaultKind::Xid(code) => (event_type::XID, code),
                    FaultKind::FallenOffBus => (event_type::XID, XID_FALLEN_OFF_BUS),
                    FaultKind::DoubleBitEcc(_) => (event_type::DOUBLE_BIT_ECC, 0),
                    FaultKind::SingleBitEcc(_) => (event_type::SINGLE_BIT_ECC, 0),
                    _ => continue,
                };
                out.push((
                    f.at,
                    SimEvent {
                        key,
                        gpu: gpu.index,
                        event_type,
                        data,
                        gpu_instance: f.gpu_instance.unwrap_or(u32::MAX),
                        compute_instance: f.compute_instance.unwrap_or(u32::MAX),
                    },
                ));
            }
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.key.cmp(&b.1.key)));
        out.into_iter().map(|(_, e)| e).collect()
    }

    /// The earliest time after `now` at which a scripted or injected fault falls due, so an
    /// event wait on a running clock knows when to look again without polling.
    pub fn next_fault_after(&self, node: &Node, now: f64) -> Option<f64> {
        node.fixture
            .faults
            .iter()
            .map(|f| f.at)
            .chain(self.injected.iter().map(|f| f.fault.at))
            .filter(|at| *at > now)
            .min_by(f64::total_cmp)
    }

    /// Event types the GPU can deliver (`nvmlDeviceGetSupportedEventTypes`).
    pub fn supported_event_types(&self, node: &Node, gpu: u32) -> SimResult<u64> {
        let g = node.gpu(gpu)?;
        Ok(if g.model.ecc {
            event_type::XID | event_type::SINGLE_BIT_ECC | event_type::DOUBLE_BIT_ECC
        } else {
            event_type::XID
        })
    }

    /// Adds a fault now; returns its sequence number.
    pub fn inject(&mut self, node: &Node, mut fault: FaultFixture, now: f64) -> SimResult<u64> {
        node.gpu(fault.gpu)?;
        fault.at = now;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.injected.push(InjectedFault { seq, fault });
        Ok(seq)
    }

    /// Clears every fault of `gpu` up to `now`, as a GPU reset would, and applies a pending MIG
    /// mode change.
    pub fn reset_gpu(&mut self, node: &Node, gpu: u32, now: f64) -> SimResult<()> {
        node.gpu(gpu)?;
        let seq = self.next_seq;
        self.clears.insert(gpu, Clear { at: now, seq });
        let state = self.gpu_mut(gpu)?;
        if state.mig_current != state.mig_pending {
            state.gpu_instances.clear();
            state.mig_current = state.mig_pending;
        }
        Ok(())
    }

    /// Utilization (SM %, memory %) at `now`: the fixture's trace, plus the SM time of the
    /// processes started at runtime (capped at 100).
    pub fn utilization(&self, node: &Node, gpu: u32, now: f64) -> SimResult<(u32, u32)> {
        self.check_alive(node, gpu, now)?;
        let (sm, mem) = node
            .fixture
            .utilization
            .iter()
            .filter(|u| u.gpu == gpu && u.gpu_instance.is_none())
            .flat_map(|u| &u.busy)
            .find(|p| p.from <= now && p.to.is_none_or(|to| now < to))
            .map(|p| (p.gpu.min(100), p.memory.min(100)))
            .unwrap_or((0, 0));
        let started: u32 = self
            .processes
            .get(&gpu)
            .into_iter()
            .flatten()
            .filter(|p| p.from <= now && p.to.is_none_or(|to| now < to))
            .map(|p| p.sm_util)
            .sum();
        Ok(((sm + started).min(100), mem))
    }

    /// Mean utilization (SM %, memory %) of a GPU instance over `[from, to]`, as GPM reports
    /// it between two samples; the value at `to` when the interval is empty.
    pub fn gpu_instance_utilization(
        &self,
        node: &Node,
        gpu: u32,
        gi: u32,
        from: f64,
        to: f64,
    ) -> SimResult<(f64, f64)> {
        self.gpu_instance(node, gpu, gi, to)?;
        let periods: Vec<&BusyPeriod> = node
            .fixture
            .utilization
            .iter()
            .filter(|u| u.gpu == gpu && u.gpu_instance == Some(gi))
            .flat_map(|u| &u.busy)
            .collect();
        if to <= from {
            return Ok(periods
                .iter()
                .find(|p| p.from <= to && p.to.is_none_or(|end| to < end))
                .map(|p| (f64::from(p.gpu.min(100)), f64::from(p.memory.min(100))))
                .unwrap_or((0.0, 0.0)));
        }
        let (mut sm, mut mem) = (0.0, 0.0);
        for p in periods {
            let overlap = (p.to.unwrap_or(f64::INFINITY).min(to) - p.from.max(from)).max(0.0);
            sm += overlap * f64::from(p.gpu.min(100));
            mem += overlap * f64::from(p.memory.min(100));
        }
        Ok((sm / (to - from), mem / (to - from)))
    }

    /// Compute processes at `now`. Processes attributed to a MIG device show only while that
    /// device exists.
    pub fn processes(&self, node: &Node, gpu: u32, now: f64) -> SimResult<Vec<SimProcess>> {
        self.check_alive(node, gpu, now)?;
        let state = self.gpu_ref(gpu)?;
        Ok(node
            .fixture
            .utilization
            .iter()
            .filter(|u| u.gpu == gpu)
            .flat_map(|u| &u.processes)
            .chain(self.processes.get(&gpu).into_iter().flatten())
            .filter(|p| p.from <= now && p.to.is_none_or(|to| now < to))
            .filter(|p| match (p.gpu_instance, p.compute_instance) {
                (None, _) => !state.mig_current,
                (Some(gi), ci) => state.gpu_instances.iter().any(|g| {
                    g.id == gi
                        && g.compute_instances
                            .iter()
                            .any(|c| ci.is_none_or(|ci| c.id == ci))
                }),
            })
            .map(|p| SimProcess {
                pid: p.pid,
                used_memory_mib: p.used_memory_mib,
                gpu_instance: p.gpu_instance,
                compute_instance: p.gpu_instance.map(|_| p.compute_instance.unwrap_or(0)),
                sm_util: p.sm_util.min(100),
            })
            .collect())
    }

    /// MIG mode (current, pending).
    pub fn mig_mode(&self, node: &Node, gpu: u32, now: f64) -> SimResult<(bool, bool)> {
        self.check_alive(node, gpu, now)?;
        if node.gpu(gpu)?.model.mig_catalog.is_none() {
            return Err(SimError::NotSupported(format!(
                "GPU {gpu} is not MIG-capable"
            )));
        }
        let s = self.gpu_ref(gpu)?;
        Ok((s.mig_current, s.mig_pending))
    }

    /// Sets the MIG mode. Returns `Ok(None)` when it took effect, `Ok(Some(why))` when it is
    /// pending a GPU reset (NVML's activation status: `IN_USE` while processes run, otherwise
    /// `RESET_REQUIRED` on boards that need a reset).
    pub fn set_mig_mode(
        &mut self,
        node: &Node,
        gpu: u32,
        enabled: bool,
        now: f64,
    ) -> SimResult<Option<SimError>> {
        self.mig_mode(node, gpu, now)?;
        let busy = !self.processes(node, gpu, now)?.is_empty();
        let needs_reset = node.gpu(gpu)?.model.mig_mode_needs_reset;
        let state = self.gpu_mut(gpu)?;
        if !enabled && !state.gpu_instances.is_empty() {
            return Err(SimError::InUse(format!(
                "GPU {gpu} still has GPU instances; destroy them before disabling MIG"
            )));
        }
        state.mig_pending = enabled;
        if state.mig_current == enabled {
            return Ok(None);
        }
        if busy {
            return Ok(Some(SimError::InUse(format!(
                "GPU {gpu} has running processes"
            ))));
        }
        if needs_reset {
            return Ok(Some(SimError::ResetRequired(format!(
                "GPU {gpu} needs a reset to change MIG mode"
            ))));
        }
        state.mig_current = enabled;
        Ok(None)
    }

    fn mig_ready(&self, node: &Node, gpu: u32, now: f64) -> SimResult<&'static GpuModel> {
        self.check_alive(node, gpu, now)?;
        let model = node
            .gpu(gpu)?
            .model
            .mig()
            .ok_or_else(|| SimError::NotSupported(format!("GPU {gpu} is not MIG-capable")))?;
        if !self.gpu_ref(gpu)?.mig_current {
            return Err(SimError::NotSupported(format!(
                "MIG mode is not enabled on GPU {gpu}"
            )));
        }
        Ok(model)
    }

    /// The profile behind an NVML enum value (`nvmlDeviceGetGpuInstanceProfileInfo`). Answers
    /// whether or not MIG mode is on, as current drivers do.
    pub fn gi_profile_by_enum(
        &self,
        node: &Node,
        gpu: u32,
        nvml_profile: u32,
        now: f64,
    ) -> SimResult<&'static MigProfileSpec> {
        self.check_alive(node, gpu, now)?;
        let model = node
            .gpu(gpu)?
            .model
            .mig()
            .ok_or_else(|| SimError::NotSupported(format!("GPU {gpu} is not MIG-capable")))?;
        if nvml_profile >= catalog::nvml_gi_profile::COUNT {
            return Err(SimError::InvalidArgument(format!(
                "GPU instance profile {nvml_profile} is out of range"
            )));
        }
        model.profile_by_nvml_enum(nvml_profile).ok_or_else(|| {
            SimError::NotSupported(format!("{} has no profile {nvml_profile}", model.key))
        })
    }

    fn gi_profile_by_id(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
    ) -> SimResult<&'static MigProfileSpec> {
        let model = node
            .gpu(gpu)?
            .model
            .mig()
            .ok_or_else(|| SimError::NotSupported(format!("GPU {gpu} is not MIG-capable")))?;
        model.profile_by_id(profile_id).ok_or_else(|| {
            SimError::InvalidArgument(format!(
                "{} has no GPU instance profile ID {profile_id}",
                model.key
            ))
        })
    }

    /// Every placement the profile can take (`...PossiblePlacements`), regardless of what is
    /// already placed.
    pub fn gi_possible_placements(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
        now: f64,
    ) -> SimResult<Vec<(u32, u32)>> {
        self.mig_ready(node, gpu, now)?;
        let p = self.gi_profile_by_id(node, gpu, profile_id)?;
        Ok(p.placement_starts
            .iter()
            .map(|&s| (s, p.memory_slices))
            .collect())
    }

    /// How many more instances of the profile fit now (`...RemainingCapacity`).
    pub fn gi_remaining_capacity(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
        now: f64,
    ) -> SimResult<u32> {
        let model = self.mig_ready(node, gpu, now)?;
        let profile = self.gi_profile_by_id(node, gpu, profile_id)?;
        let mut placed = self.planned(node, gpu)?;
        let mut count = 0;
        while let Some(start) = self.free_start(model, &placed, profile) {
            placed.push(catalog::PlannedInstance { profile, start });
            count += 1;
        }
        Ok(count)
    }

    fn planned(&self, node: &Node, gpu: u32) -> SimResult<Vec<catalog::PlannedInstance>> {
        let state = self.gpu_ref(gpu)?;
        state
            .gpu_instances
            .iter()
            .map(|g| {
                Ok(catalog::PlannedInstance {
                    profile: self.gi_profile_by_id(node, gpu, g.profile_id)?,
                    start: g.start,
                })
            })
            .collect()
    }

    fn free_start(
        &self,
        model: &GpuModel,
        placed: &[catalog::PlannedInstance],
        profile: &'static MigProfileSpec,
    ) -> Option<u32> {
        let same = placed
            .iter()
            .filter(|p| p.profile.name == profile.name)
            .count() as u32;
        let compute: u32 = placed.iter().map(|p| p.profile.compute_slices).sum();
        if same >= profile.max_instances || compute + profile.compute_slices > model.compute_slices
        {
            return None;
        }
        profile
            .placement_starts
            .iter()
            .copied()
            .find(|&s| catalog::fits(placed, profile, s))
    }

    /// Creates a GPU instance, at `start` or at the first free placement. Returns its ID.
    pub fn create_gpu_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        profile_id: u32,
        start: Option<u32>,
        now: f64,
    ) -> SimResult<u32> {
        let model = self.mig_ready(node, gpu, now)?;
        let profile = self.gi_profile_by_id(node, gpu, profile_id)?;
        let placed = self.planned(node, gpu)?;
        let start = match start {
            Some(s) => {
                if !profile.placement_starts.contains(&s) {
                    return Err(SimError::InvalidArgument(format!(
                        "{} cannot start at memory slice {s}",
                        profile.name
                    )));
                }
                let ok = catalog::fits(&placed, profile, s)
                    && placed.iter().map(|p| p.profile.compute_slices).sum::<u32>()
                        + profile.compute_slices
                        <= model.compute_slices
                    && (placed
                        .iter()
                        .filter(|p| p.profile.name == profile.name)
                        .count() as u32)
                        < profile.max_instances;
                if !ok {
                    return Err(SimError::InsufficientResources(format!(
                        "{} at {s} overlaps existing GPU instances on GPU {gpu}",
                        profile.name
                    )));
                }
                s
            }
            None => self.free_start(model, &placed, profile).ok_or_else(|| {
                SimError::InsufficientResources(format!(
                    "no room for {} on GPU {gpu}",
                    profile.name
                ))
            })?,
        };
        let state = self.gpu_mut(gpu)?;
        let id = (1..)
            .find(|id| state.gpu_instances.iter().all(|g| g.id != *id))
            .unwrap_or(u32::MAX);
        state.gpu_instances.push(GiState {
            id,
            profile_id,
            start,
            size: profile.memory_slices,
            compute_instances: Vec::new(),
        });
        state.gpu_instances.sort_by_key(|g| g.id);
        Ok(id)
    }

    /// The GPU instance with this ID.
    pub fn gpu_instance(&self, node: &Node, gpu: u32, gi: u32, now: f64) -> SimResult<&GiState> {
        self.mig_ready(node, gpu, now)?;
        self.gpu_ref(gpu)?
            .gpu_instances
            .iter()
            .find(|g| g.id == gi)
            .ok_or_else(|| SimError::NotFound(format!("GPU {gpu} has no GPU instance {gi}")))
    }

    /// GPU instances, optionally only of one profile.
    pub fn gpu_instances(
        &self,
        node: &Node,
        gpu: u32,
        profile_id: Option<u32>,
        now: f64,
    ) -> SimResult<Vec<GiState>> {
        self.mig_ready(node, gpu, now)?;
        Ok(self
            .gpu_ref(gpu)?
            .gpu_instances
            .iter()
            .filter(|g| profile_id.is_none_or(|p| g.profile_id == p))
            .cloned()
            .collect())
    }

    /// Destroys a GPU instance that has no compute instances left.
    pub fn destroy_gpu_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        gi: u32,
        now: f64,
    ) -> SimResult<()> {
        let instance = self.gpu_instance(node, gpu, gi, now)?;
        if !instance.compute_instances.is_empty() {
            return Err(SimError::InUse(format!(
                "GPU instance {gi} on GPU {gpu} still has compute instances"
            )));
        }
        self.gpu_mut(gpu)?.gpu_instances.retain(|g| g.id != gi);
        Ok(())
    }

    /// Compute-instance profile by NVML enum value, for a GPU instance (`(ID, slices)`).
    pub fn ci_profile(
        &self,
        node: &Node,
        gpu: u32,
        gi: u32,
        ci_profile: u32,
        now: f64,
    ) -> SimResult<(u32, u32)> {
        let instance = self.gpu_instance(node, gpu, gi, now)?;
        let p = self.gi_profile_by_id(node, gpu, instance.profile_id)?;
        catalog::compute_instance_profiles(p.compute_slices)
            .into_iter()
            .find(|(id, _)| *id == ci_profile)
            .ok_or_else(|| {
                SimError::NotSupported(format!(
                    "{} has no compute instance profile {ci_profile}",
                    p.name
                ))
            })
    }

    /// Creates a compute instance in a GPU instance; returns its ID.
    pub fn create_compute_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        gi: u32,
        ci_profile: u32,
        now: f64,
    ) -> SimResult<u32> {
        let (_, slices) = self.ci_profile(node, gpu, gi, ci_profile, now)?;
        let gi_slices = {
            let instance = self.gpu_instance(node, gpu, gi, now)?;
            self.gi_profile_by_id(node, gpu, instance.profile_id)?
                .compute_slices
        };
        let state = self.gpu_mut(gpu)?;
        let instance = state
            .gpu_instances
            .iter_mut()
            .find(|g| g.id == gi)
            .ok_or_else(|| SimError::NotFound(format!("GPU {gpu} has no GPU instance {gi}")))?;
        let used: Vec<(u32, u32)> = instance
            .compute_instances
            .iter()
            .map(|c| (c.start, c.size))
            .collect();
        let start = (0..gi_slices)
            .step_by(slices as usize)
            .find(|&s| {
                s + slices <= gi_slices && used.iter().all(|&(us, uz)| s + slices <= us || us + uz <= s)
            })
            .ok_or_else(|| {
                SimError::InsufficientResources(format!(
                    "no room for a {slices}-slice compute instance in GPU instance {gi} on GPU {gpu}"
                ))
            })?;
        let id = (0..)
            .find(|id| instance.compute_instances.iter().all(|c| c.id != *id))
            .unwrap_or(u32::MAX);
        instance.compute_instances.push(CiState {
            id,
            profile_id: ci_profile,
            start,
            size: slices,
        });
        instance.compute_instances.sort_by_key(|c| c.id);
        Ok(id)
    }

    /// Destroys a compute instance; fails while a process runs on it.
    pub fn destroy_compute_instance(
        &mut self,
        node: &Node,
        gpu: u32,
        gi: u32,
        ci: u32,
        now: f64,
    ) -> SimResult<()> {
        let instance = self.gpu_instance(node, gpu, gi, now)?;
        if !instance.compute_instances.iter().any(|c| c.id == ci) {
            return Err(SimError::NotFound(format!(
                "GPU instance {gi} on GPU {gpu} has no compute instance {ci}"
            )));
        }
        let busy = self
            .processes(node, gpu, now)?
            .iter()
            .any(|p| p.gpu_instance == Some(gi) && p.compute_instance == Some(ci));
        if busy {
            return Err(SimError::InUse(format!(
                "a process runs on compute instance {ci} of GPU instance {gi} on GPU {gpu}"
            )));
        }
        let state = self.gpu_mut(gpu)?;
        if let Some(instance) = state.gpu_instances.iter_mut().find(|g| g.id == gi) {
            instance.compute_instances.retain(|c| c.id != ci);
        }
        Ok(())
    }

    /// MIG devices (one per compute instance), ordered by (GI, CI).
    pub fn mig_devices(&self, node: &Node, gpu: u32, now: f64) -> SimResult<Vec<SimMigDevice>> {
        self.mig_ready(node, gpu, now)?;
        let parent = node.gpu(gpu)?;
        let mut out = Vec::new();
        for g in &self.gpu_ref(gpu)?.gpu_instances {
            let profile = self.gi_profile_by_id(node, gpu, g.profile_id)?;
            for c in &g.compute_instances {
                out.push(SimMigDevice {
                    gpu,
                    gi: g.id,
                    ci: c.id,
                    uuid: mig_uuid(&parent.uuid, g.id, c.id),
                    profile,
                    ci_slices: c.size,
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::FaultKind;

    /// The fake library's event wait sleeps until this time on a running clock, so an early
    /// answer costs a wake-up and a late or missing one delays a fault.
    #[test]
    fn next_fault_after_counts_scripted_and_injected_faults() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/faults.yaml");
        let node = Node::load(&path).unwrap();
        let mut state = SimState::boot(&node);
        // The fixture's script: 30, 60, 90, 120.
        for (now, next) in [
            (0.0, Some(30.0)),
            (30.0, Some(60.0)),
            (59.9, Some(60.0)),
            (119.0, Some(120.0)),
            (120.0, None),
        ] {
            assert_eq!(state.next_fault_after(&node, now), next, "at {now}");
        }
        let fault = |at| FaultFixture {
            at,
            gpu: 2,
            fault: FaultKind::Xid(48),
            gpu_instance: None,
            compute_instance: None,
        };
        // Injected faults are dated when injected.
        state.inject(&node, fault(0.0), 150.0).unwrap();
        assert_eq!(state.next_fault_after(&node, 120.0), Some(150.0));
        assert_eq!(state.next_fault_after(&node, 10.0), Some(30.0));
        assert_eq!(state.next_fault_after(&node, 150.0), None);
    }
}
