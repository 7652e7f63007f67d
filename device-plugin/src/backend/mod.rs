//! GPU backends: what the agent needs from the GPUs, behind one trait.
//!
//! - [`NvmlBackend`] talks to the NVIDIA driver through NVML (nvml-wrapper); it is what ships.
//! - [`SimBackend`] plays a node described by a YAML fixture (see `fixtures/README.md`), with
//!   scripted and injected faults and an injectable clock, for tests and the demo.
//!
//! GPUs are addressed by NVML index. Calls are blocking (NVML is); async callers use
//! `spawn_blocking`, and [`spawn_health_stream`] turns health events into a channel.

mod error;
pub mod nvml;
pub mod sim;
mod types;

pub use error::{Error, ErrorKind, Result};
pub use nvml::{NvmlBackend, NvmlOptions};
pub use sim::{Fault, FaultKind, Fixture, ManualSimClock, SimBackend, SimClock, SystemSimClock};
pub use types::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Everything the agent asks of the GPUs.
pub trait GpuBackend: Send + Sync {
    /// Driver and CUDA driver versions.
    fn driver(&self) -> Result<DriverInfo>;
    /// Number of GPUs.
    fn device_count(&self) -> Result<u32>;
    /// One GPU by index.
    fn device(&self, gpu: u32) -> Result<GpuDevice>;
    /// Every GPU, by index: the snapshot the kubelet plugins advertise.
    fn devices(&self) -> Result<Vec<GpuDevice>> {
        (0..self.device_count()?).map(|i| self.device(i)).collect()
    }
    /// How two GPUs are connected.
    fn topology(&self, a: u32, b: u32) -> Result<Topology>;
    /// NUMA node of a GPU, when the platform reports one.
    fn numa_node(&self, gpu: u32) -> Result<Option<u32>>;
    /// Health counters of a GPU. A GPU that fell off the bus answers [`Error::GpuLost`].
    fn health(&self, gpu: u32) -> Result<HealthSnapshot>;
    /// Whether persistence mode is on (the driver stays initialised with no client attached).
    /// GPUs that cannot report it answer [`Error::NotSupported`].
    fn persistence_mode(&self, gpu: u32) -> Result<bool>;
    /// Subscribes to health events (Xid, ECC) of every GPU. Each subscription delivers each
    /// event once.
    fn health_events(&self) -> Result<Box<dyn HealthEvents + '_>>;
    /// MIG mode, current and pending. Not-MIG-capable GPUs answer [`Error::NotSupported`].
    fn mig_mode(&self, gpu: u32) -> Result<MigMode>;
    /// Enables or disables MIG mode.
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange>;
    /// GPU-instance profiles with their possible placements (MIG mode must be on).
    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>>;
    /// Compute-instance profiles a GPU instance offers.
    fn compute_instance_profiles(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
    ) -> Result<Vec<ComputeInstanceProfile>>;
    /// GPU instances, by ID.
    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>>;
    /// Creates a GPU instance, at `start` (memory slice) or wherever the driver chooses.
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile: GiProfileId,
        start: Option<u32>,
    ) -> Result<GpuInstance>;
    /// Destroys a GPU instance (its compute instances must be gone).
    fn destroy_gpu_instance(&self, gpu: u32, gi: GpuInstanceId) -> Result<()>;
    /// Compute instances of a GPU instance, by ID.
    fn compute_instances(&self, gpu: u32, gi: GpuInstanceId) -> Result<Vec<ComputeInstance>>;
    /// Creates a compute instance.
    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
        profile: CiProfileId,
    ) -> Result<ComputeInstance>;
    /// Destroys a compute instance.
    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
        ci: ComputeInstanceId,
    ) -> Result<()>;
    /// MIG devices of a GPU, ordered by (GPU instance, compute instance).
    fn mig_devices(&self, gpu: u32) -> Result<Vec<MigDevice>>;
    /// [`GpuBackend::mig_devices`] of a GPU whose MIG mode is on and whose `instances` were
    /// just listed, which a backend may use instead of asking again.
    fn mig_devices_of(
        &self,
        gpu: u32,
        instances: &[(GpuInstance, Vec<ComputeInstance>)],
    ) -> Result<Vec<MigDevice>> {
        let _ = instances;
        self.mig_devices(gpu)
    }
    /// Utilization of a whole GPU. MIG-enabled GPUs answer [`Error::NotSupported`]; use
    /// [`GpuBackend::processes`] to see which MIG devices are busy.
    fn utilization(&self, gpu: u32) -> Result<Utilization>;
    /// Utilization of one GPU instance since the previous call for it (GPM samples; Hopper and
    /// newer). `None` on the first call, which only takes the baseline sample.
    fn mig_utilization(&self, gpu: u32, gi: GpuInstanceId) -> Result<Option<Utilization>>;
    /// Compute processes on a GPU, with the MIG device each runs on, sorted by PID.
    fn processes(&self, gpu: u32) -> Result<Vec<ComputeProcess>>;
    /// The processes on a GPU that used it since the previous call (the first call: since the
    /// driver started buffering), each with its own SM utilization, sorted by PID. A running
    /// process missing here did not run. A process's samples over the period are averaged.
    fn process_utilization(&self, gpu: u32) -> Result<Vec<ProcessUtilization>>;
}

/// A subscription to health events.
pub trait HealthEvents: Send {
    /// Returns events that arrived, waiting up to `timeout` for the first one; a backend may
    /// hand over one per call, so as not to hold the first back, and callers wait again for
    /// the rest (a queued event answers at once). An empty vector means none arrived in time.
    fn wait(&mut self, timeout: Duration) -> Result<Vec<HealthEvent>>;
}

/// Runs a health subscription on its own thread and forwards events to a channel, so async
/// code (the kubelet plugins' `ListAndWatch`) can `recv().await` them. The thread ends when
/// `stop` is set or the receiver is dropped; errors are forwarded and end it too.
pub fn spawn_health_stream(
    backend: Arc<dyn GpuBackend>,
    poll: Duration,
    stop: Arc<AtomicBool>,
) -> (
    tokio::sync::mpsc::Receiver<Result<HealthEvent>>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let handle = std::thread::spawn(move || {
        let mut events = match backend.health_events() {
            Ok(events) => events,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
            match events.wait(poll) {
                Ok(batch) => {
                    for event in batch {
                        if tx.blocking_send(Ok(event)).is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    (rx, handle)
}
