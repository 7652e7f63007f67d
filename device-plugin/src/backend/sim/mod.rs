//! `SimBackend`: a node of simulated GPUs described by a YAML fixture.
//!
//! Time comes from a [`SimClock`]; tests use a [`ManualSimClock`] and move it, so scripted faults and
//! utilization traces play out without sleeping. Faults can also be injected and cleared at
//! runtime ([`SimBackend::inject`], [`SimBackend::reset_gpu`]).
//!
//! The fixture format and the state machine are the `gpupool-sim` crate's, shared with the fake
//! `libnvidia-ml.so`; this module maps them onto [`GpuBackend`] as `NvmlBackend` maps NVML.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    CiProfileId, ComputeInstance, ComputeInstanceId, ComputeInstanceProfile, ComputeProcess,
    CudaVersion, DriverInfo, Error, ErrorKind, GiProfileId, GpuBackend, GpuDevice, GpuInstance,
    GpuInstanceId, GpuInstanceProfile, HealthEvent, HealthEventKind, HealthEvents, HealthSnapshot,
    MigDevice, MigMode, MigModeChange, PcieLink, Placement, ProcessUtilization, Result, Topology,
    Utilization,
};
use gpupool_mig_catalog as catalog;
use gpupool_sim::{EventKey, FaultFixture, Node, SimError, SimState, arch, event_type};

pub use gpupool_sim::{FaultKind, Fixture};

/// Simulated time: seconds since the simulation started, read synchronously by the simulator's
/// scripted faults and utilization traces. (The health monitor's [`crate::plugin::Clock`] is a
/// different contract: an `Instant` and async timers.)
pub trait SimClock: Send + Sync {
    /// Seconds since start.
    fn now(&self) -> f64;
}

/// Real time since construction.
#[derive(Debug, Clone)]
pub struct SystemSimClock {
    start: Instant,
}

impl SystemSimClock {
    /// Starts at zero now.
    pub fn new() -> SystemSimClock {
        SystemSimClock {
            start: Instant::now(),
        }
    }
}

impl Default for SystemSimClock {
    fn default() -> Self {
        SystemSimClock::new()
    }
}

impl SimClock for SystemSimClock {
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// A clock tests move by hand; clones share the time.
#[derive(Debug, Clone, Default)]
pub struct ManualSimClock {
    now: Arc<Mutex<f64>>,
}

impl ManualSimClock {
    /// Starts at zero.
    pub fn new() -> ManualSimClock {
        ManualSimClock::default()
    }

    fn guard(&self) -> MutexGuard<'_, f64> {
        // A poisoned clock still holds a valid f64.
        self.now.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the time, in seconds since start.
    pub fn set(&self, seconds: f64) {
        *self.guard() = seconds;
    }

    /// Moves the time forward.
    pub fn advance(&self, by: Duration) {
        *self.guard() += by.as_secs_f64();
    }
}

impl SimClock for ManualSimClock {
    fn now(&self) -> f64 {
        *self.guard()
    }
}

/// A fault to inject at runtime, on a GPU, optionally attributed to a MIG device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// GPU index.
    pub gpu: u32,
    /// What happens.
    pub kind: FaultKind,
    /// GPU instance it concerns.
    pub gpu_instance: Option<GpuInstanceId>,
    /// Compute instance it concerns.
    pub compute_instance: Option<ComputeInstanceId>,
}

impl Fault {
    /// A fault on a whole GPU.
    pub fn gpu(gpu: u32, kind: FaultKind) -> Fault {
        Fault {
            gpu,
            kind,
            gpu_instance: None,
            compute_instance: None,
        }
    }

    /// As a fixture entry (its time is set on injection).
    pub fn to_fixture(self) -> FaultFixture {
        FaultFixture {
            at: 0.0,
            gpu: self.gpu,
            fault: self.kind,
            gpu_instance: self.gpu_instance.map(|g| g.0),
            compute_instance: self.compute_instance.map(|c| c.0),
        }
    }
}

struct Shared {
    node: Node,
    state: Mutex<SimState>,
    /// Time of the previous `mig_utilization` sample per (GPU, GPU instance).
    gpm_baselines: Mutex<std::collections::BTreeMap<(u32, u32), f64>>,
    changed: Condvar,
    clock: Arc<dyn SimClock>,
}

/// Simulated GPUs.
#[derive(Clone)]
pub struct SimBackend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBackend")
            .field("node", &self.shared.node.fixture.node)
            .field("gpus", &self.shared.node.gpus.len())
            .finish()
    }
}

/// Maps a simulator error to the backend error NVML's code would become.
pub(crate) fn sim_error(op: &'static str, target: impl Into<String>, e: SimError) -> Error {
    let target = target.into();
    let (kind, detail) = match e {
        SimError::InvalidArgument(m) => (ErrorKind::InvalidArgument, m),
        SimError::NotSupported(m) => (ErrorKind::NotSupported, m),
        SimError::NotFound(m) => (ErrorKind::NotFound, m),
        SimError::InsufficientResources(m) => (ErrorKind::InsufficientResources, m),
        SimError::InUse(m) => (ErrorKind::InUse, m),
        SimError::GpuIsLost(_) => (ErrorKind::GpuLost, String::new()),
        SimError::ResetRequired(m) => (ErrorKind::Driver, m),
        SimError::Fixture(m) => (ErrorKind::Fixture, m),
    };
    Error::new(kind, op, target, detail)
}

fn gpu_target(gpu: u32) -> String {
    format!("GPU {gpu}")
}

impl SimBackend {
    /// Loads a fixture file; time from `clock`.
    pub fn from_file(path: &Path, clock: Arc<dyn SimClock>) -> Result<SimBackend> {
        let node = Node::load(path).map_err(|e| Error::Fixture(e.to_string()))?;
        Ok(SimBackend::from_node(node, clock))
    }

    /// Builds from a parsed fixture; time from `clock`.
    pub fn new(fixture: Fixture, clock: Arc<dyn SimClock>) -> Result<SimBackend> {
        let node = Node::new(fixture).map_err(|e| Error::Fixture(e.to_string()))?;
        Ok(SimBackend::from_node(node, clock))
    }

    fn from_node(node: Node, clock: Arc<dyn SimClock>) -> SimBackend {
        let state = SimState::boot(&node);
        SimBackend {
            shared: Arc::new(Shared {
                node,
                state: Mutex::new(state),
                gpm_baselines: Mutex::new(std::collections::BTreeMap::new()),
                changed: Condvar::new(),
                clock,
            }),
        }
    }

    /// The resolved fixture.
    pub fn node(&self) -> &Node {
        &self.shared.node
    }

    fn now(&self) -> f64 {
        self.shared.clock.now()
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        // Every mutation below completes before it could panic, so a poisoned state is whole.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read<T>(
        &self,
        op: &'static str,
        target: String,
        f: impl FnOnce(&SimState, &Node, f64) -> Result<T, SimError>,
    ) -> Result<T> {
        let state = self.state();
        f(&state, &self.shared.node, self.now()).map_err(|e| sim_error(op, target, e))
    }

    fn write<T>(
        &self,
        op: &'static str,
        target: String,
        f: impl FnOnce(&mut SimState, &Node, f64) -> Result<T, SimError>,
    ) -> Result<T> {
        let mut state = self.state();
        let out =
            f(&mut state, &self.shared.node, self.now()).map_err(|e| sim_error(op, target, e));
        self.shared.changed.notify_all();
        out
    }

    /// Injects a fault now. Returns its sequence number.
    pub fn inject(&self, fault: Fault) -> Result<u64> {
        self.write("injecting a fault", gpu_target(fault.gpu), |s, n, now| {
            s.inject(n, fault.to_fixture(), now)
        })
    }

    /// Resets a GPU: clears its faults so far and applies a pending MIG mode, as
    /// `nvidia-smi -r` would.
    pub fn reset_gpu(&self, gpu: u32) -> Result<()> {
        self.write("resetting", gpu_target(gpu), |s, n, now| {
            s.reset_gpu(n, gpu, now)
        })
    }

    /// Clears a GPU's faults (same as a reset).
    pub fn clear(&self, gpu: u32) -> Result<()> {
        self.reset_gpu(gpu)
    }

    /// A copy of the mutable state (MIG layout, injected faults).
    pub fn snapshot(&self) -> SimState {
        self.state().clone()
    }
}

struct SimEvents<'a> {
    sim: &'a SimBackend,
    delivered: BTreeSet<EventKey>,
}

impl SimEvents<'_> {
    fn pending(&mut self, state: &SimState) -> Vec<HealthEvent> {
        let node = &self.sim.shared.node;
        let mut out = Vec::new();
        for e in state.events(node, self.sim.now()) {
            if !self.delivered.insert(e.key) {
                continue;
            }
            let kind = match e.event_type {
                event_type::XID => HealthEventKind::Xid(e.data),
                event_type::DOUBLE_BIT_ECC => HealthEventKind::DoubleBitEcc,
                _ => HealthEventKind::SingleBitEcc,
            };
            let Some(gpu) = node.gpus.get(e.gpu as usize) else {
                continue;
            };
            let Ok(uuid) = gpu.uuid.parse() else {
                continue;
            };
            out.push(HealthEvent {
                gpu: e.gpu,
                uuid,
                kind,
                gpu_instance: (e.gpu_instance != u32::MAX).then_some(GpuInstanceId(e.gpu_instance)),
                compute_instance: (e.compute_instance != u32::MAX)
                    .then_some(ComputeInstanceId(e.compute_instance)),
            });
        }
        out
    }
}

impl HealthEvents for SimEvents<'_> {
    fn wait(&mut self, timeout: Duration) -> Result<Vec<HealthEvent>> {
        let state = self.sim.state();
        let now = self.pending(&state);
        if !now.is_empty() || timeout.is_zero() {
            return Ok(now);
        }
        let (state, _) = self
            .sim
            .shared
            .changed
            .wait_timeout(state, timeout)
            .unwrap_or_else(|p| p.into_inner());
        Ok(self.pending(&state))
    }
}

impl GpuBackend for SimBackend {
    fn driver(&self) -> Result<DriverInfo> {
        let d = &self.shared.node.fixture.driver;
        Ok(DriverInfo {
            driver_version: d.version.clone(),
            cuda_version: d.cuda.parse::<CudaVersion>()?,
        })
    }

    fn device_count(&self) -> Result<u32> {
        Ok(self.shared.node.gpus.len() as u32)
    }

    fn device(&self, gpu: u32) -> Result<GpuDevice> {
        let g = self
            .shared
            .node
            .gpu(gpu)
            .map_err(|e| sim_error("reading device", gpu_target(gpu), e))?;
        Ok(GpuDevice {
            index: g.index,
            uuid: g.uuid.parse()?,
            name: g.model.product_name.to_owned(),
            minor_number: g.minor,
            pci_bus_id: g.pci_bus_id.clone(),
            memory_mib: g.model.memory_mib,
            compute_capability: g.model.compute_capability,
            architecture: super::Architecture::from_nvml(g.model.architecture),
            mig_capable: g.model.mig_catalog.is_some(),
        })
    }

    fn topology(&self, a: u32, b: u32) -> Result<Topology> {
        let node = &self.shared.node;
        let level = node
            .topology_level(a, b)
            .map_err(|e| sim_error("reading topology", format!("GPUs {a} and {b}"), e))?;
        Ok(Topology {
            nvlink: node.nvlink(a, b),
            pcie: pcie_link(level),
        })
    }

    fn numa_node(&self, gpu: u32) -> Result<Option<u32>> {
        let g = self
            .shared
            .node
            .gpu(gpu)
            .map_err(|e| sim_error("reading NUMA node", gpu_target(gpu), e))?;
        Ok(Some(g.numa_node))
    }

    fn health(&self, gpu: u32) -> Result<HealthSnapshot> {
        self.read("reading health", gpu_target(gpu), |s, n, now| {
            let h = s.health(n, gpu, now)?;
            let ecc = n.gpu(gpu)?.model.ecc;
            Ok(HealthSnapshot {
                ecc_uncorrected: ecc.then_some(h.ecc_uncorrected),
                ecc_corrected: ecc.then_some(h.ecc_corrected),
                pcie_replay: Some(h.pcie_replay),
                retired_pages: ecc.then_some(h.retired),
                temperature_c: Some(h.temperature_c),
            })
        })
    }

    fn persistence_mode(&self, gpu: u32) -> Result<bool> {
        self.read("reading persistence mode", gpu_target(gpu), |s, n, now| {
            s.persistence_mode(n, gpu, now)
        })
    }

    fn health_events(&self) -> Result<Box<dyn HealthEvents + '_>> {
        Ok(Box::new(SimEvents {
            sim: self,
            delivered: BTreeSet::new(),
        }))
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode> {
        self.read("reading MIG mode", gpu_target(gpu), |s, n, now| {
            let (current, pending) = s.mig_mode(n, gpu, now)?;
            Ok(MigMode { current, pending })
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange> {
        self.write("setting MIG mode", gpu_target(gpu), |s, n, now| {
            Ok(match s.set_mig_mode(n, gpu, enabled, now)? {
                None => MigModeChange::Applied,
                Some(why) => MigModeChange::PendingReset(why.to_string()),
            })
        })
    }

    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>> {
        self.read(
            "listing GPU instance profiles",
            gpu_target(gpu),
            |s, n, now| {
                let mut out = Vec::new();
                for nvml_profile in 0..catalog::nvml_gi_profile::COUNT {
                    let p = match s.gi_profile_by_enum(n, gpu, nvml_profile, now) {
                        Ok(p) => p,
                        Err(SimError::NotSupported(_)) if n.gpu(gpu)?.model.mig().is_some() => {
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    let placements = s
                        .gi_possible_placements(n, gpu, p.profile_id, now)?
                        .into_iter()
                        .map(|(start, size)| Placement { start, size })
                        .collect();
                    out.push(GpuInstanceProfile {
                        name: p
                            .name
                            .parse()
                            .map_err(|e: Error| SimError::Fixture(e.to_string()))?,
                        nvml_profile,
                        id: GiProfileId(p.profile_id),
                        slice_count: p.compute_slices,
                        instance_count: p.max_instances,
                        multiprocessors: p.multiprocessors,
                        memory_mib: p.memory_mib,
                        placements,
                    });
                }
                Ok(out)
            },
        )
    }

    fn compute_instance_profiles(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
    ) -> Result<Vec<ComputeInstanceProfile>> {
        self.read(
            "listing compute instance profiles",
            format!("GPU {gpu} GPU instance {gi}"),
            |s, n, now| {
                let mut out = Vec::new();
                for ci in 0..catalog::nvml_ci_profile::COUNT {
                    match s.ci_profile(n, gpu, gi.0, ci, now) {
                        Ok((id, slices)) => out.push(ComputeInstanceProfile {
                            id: CiProfileId(id),
                            slice_count: slices,
                        }),
                        Err(SimError::NotSupported(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(out)
            },
        )
    }

    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>> {
        self.read("listing GPU instances", gpu_target(gpu), |s, n, now| {
            Ok(s.gpu_instances(n, gpu, None, now)?
                .into_iter()
                .map(|g| GpuInstance {
                    id: GpuInstanceId(g.id),
                    profile_id: GiProfileId(g.profile_id),
                    placement: Placement {
                        start: g.start,
                        size: g.size,
                    },
                })
                .collect())
        })
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile: GiProfileId,
        start: Option<u32>,
    ) -> Result<GpuInstance> {
        let target = format!("GPU {gpu} (profile ID {})", profile.0);
        self.write("creating GPU instance", target, |s, n, now| {
            let id = s.create_gpu_instance(n, gpu, profile.0, start, now)?;
            let g = s.gpu_instance(n, gpu, id, now)?;
            Ok(GpuInstance {
                id: GpuInstanceId(g.id),
                profile_id: GiProfileId(g.profile_id),
                placement: Placement {
                    start: g.start,
                    size: g.size,
                },
            })
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gi: GpuInstanceId) -> Result<()> {
        let target = format!("GPU {gpu} GPU instance {gi}");
        self.write("destroying GPU instance", target, |s, n, now| {
            s.destroy_gpu_instance(n, gpu, gi.0, now)
        })
    }

    fn compute_instances(&self, gpu: u32, gi: GpuInstanceId) -> Result<Vec<ComputeInstance>> {
        let target = format!("GPU {gpu} GPU instance {gi}");
        self.read("listing compute instances", target, |s, n, now| {
            Ok(s.gpu_instance(n, gpu, gi.0, now)?
                .compute_instances
                .iter()
                .map(|c| ComputeInstance {
                    id: ComputeInstanceId(c.id),
                    gpu_instance: gi,
                    profile_id: CiProfileId(c.profile_id),
                    placement: Placement {
                        start: c.start,
                        size: c.size,
                    },
                })
                .collect())
        })
    }

    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
        profile: CiProfileId,
    ) -> Result<ComputeInstance> {
        let target = format!("GPU {gpu} GPU instance {gi}");
        self.write("creating compute instance", target, |s, n, now| {
            let id = s.create_compute_instance(n, gpu, gi.0, profile.0, now)?;
            let g = s.gpu_instance(n, gpu, gi.0, now)?;
            let c = g
                .compute_instances
                .iter()
                .find(|c| c.id == id)
                .ok_or_else(|| SimError::NotFound(format!("compute instance {id}")))?;
            Ok(ComputeInstance {
                id: ComputeInstanceId(c.id),
                gpu_instance: gi,
                profile_id: CiProfileId(c.profile_id),
                placement: Placement {
                    start: c.start,
                    size: c.size,
                },
            })
        })
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
        ci: ComputeInstanceId,
    ) -> Result<()> {
        let target = format!("GPU {gpu} GPU instance {gi} compute instance {ci}");
        self.write("destroying compute instance", target, |s, n, now| {
            s.destroy_compute_instance(n, gpu, gi.0, ci.0, now)
        })
    }

    fn mig_devices(&self, gpu: u32) -> Result<Vec<MigDevice>> {
        self.read("listing MIG devices", gpu_target(gpu), |s, n, now| {
            let parent = &n.gpu(gpu)?.uuid;
            s.mig_devices(n, gpu, now)?
                .into_iter()
                .map(|d| {
                    let bad = |e: Error| SimError::Fixture(e.to_string());
                    Ok(MigDevice {
                        uuid: d.uuid.parse().map_err(bad)?,
                        gpu,
                        parent: parent.parse().map_err(bad)?,
                        gpu_instance: GpuInstanceId(d.gi),
                        compute_instance: ComputeInstanceId(d.ci),
                        profile: d.name().parse().map_err(bad)?,
                        memory_mib: d.profile.memory_mib,
                    })
                })
                .collect()
        })
    }

    fn utilization(&self, gpu: u32) -> Result<Utilization> {
        self.read("reading utilization", gpu_target(gpu), |s, n, now| {
            if s.mig_mode(n, gpu, now).is_ok_and(|(current, _)| current) {
                return Err(SimError::NotSupported(
                    "utilization of a MIG-enabled GPU".to_owned(),
                ));
            }
            let (gpu_percent, memory_percent) = s.utilization(n, gpu, now)?;
            Ok(Utilization {
                gpu_percent,
                memory_percent,
            })
        })
    }

    fn mig_utilization(&self, gpu: u32, gi: GpuInstanceId) -> Result<Option<Utilization>> {
        let target = format!("GPU {gpu} GPU instance {gi}");
        self.read("reading GPU instance utilization", target, |s, n, now| {
            if n.gpu(gpu)?.model.architecture < arch::HOPPER {
                return Err(SimError::NotSupported(
                    "GPM needs Hopper or newer".to_owned(),
                ));
            }
            // Validates the instance before touching the baseline.
            s.gpu_instance_utilization(n, gpu, gi.0, now, now)?;
            let previous = self
                .shared
                .gpm_baselines
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((gpu, gi.0), now);
            let Some(from) = previous else {
                return Ok(None);
            };
            let (sm, mem) = s.gpu_instance_utilization(n, gpu, gi.0, from, now)?;
            Ok(Some(Utilization {
                gpu_percent: sm.round() as u32,
                memory_percent: mem.round() as u32,
            }))
        })
    }

    fn processes(&self, gpu: u32) -> Result<Vec<ComputeProcess>> {
        self.read("listing processes", gpu_target(gpu), |s, n, now| {
            let mut out: Vec<ComputeProcess> = s
                .processes(n, gpu, now)?
                .into_iter()
                .map(|p| ComputeProcess {
                    pid: p.pid,
                    used_memory_mib: Some(p.used_memory_mib),
                    gpu_instance: p.gpu_instance.map(GpuInstanceId),
                    compute_instance: p.compute_instance.map(ComputeInstanceId),
                })
                .collect();
            out.sort();
            Ok(out)
        })
    }

    fn process_utilization(&self, gpu: u32) -> Result<Vec<ProcessUtilization>> {
        self.read(
            "reading process utilization",
            gpu_target(gpu),
            |s, n, now| {
                let mut out: Vec<ProcessUtilization> = s
                    .processes(n, gpu, now)?
                    .into_iter()
                    .filter(|p| p.sm_util > 0)
                    .map(|p| ProcessUtilization {
                        pid: p.pid,
                        sm_percent: p.sm_util,
                    })
                    .collect();
                out.sort();
                Ok(out)
            },
        )
    }
}

/// Maps an NVML topology level to our enum.
pub(crate) fn pcie_link(level: u32) -> PcieLink {
    match level {
        0 => PcieLink::SameBoard,
        10 => PcieLink::SingleSwitch,
        20 => PcieLink::MultipleSwitches,
        30 => PcieLink::HostBridge,
        40 => PcieLink::NumaNode,
        _ => PcieLink::System,
    }
}

#[cfg(test)]
mod tests;
