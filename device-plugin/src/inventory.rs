//! A point-in-time read of the node's GPUs through a [`GpuBackend`]: what the CDI writer, the
//! MIG partitioner, the kubelet plugins and the status reporter all work from.

use crate::backend::{
    self, ComputeInstance, DriverInfo, ErrorKind, GpuBackend, GpuDevice, GpuInstance,
    HealthSnapshot, MigDevice, MigMode,
};

/// One GPU as read.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSnapshot {
    /// Static facts (index, UUID, name, minor number…).
    pub device: GpuDevice,
    /// MIG mode; `None` when the GPU is not MIG-capable.
    pub mig_mode: Option<MigMode>,
    /// GPU instances with their compute instances (empty when MIG is off).
    pub instances: Vec<(GpuInstance, Vec<ComputeInstance>)>,
    /// MIG devices in NVML order; the position is the `<mig>` in CDI name `<gpu>:<mig>`.
    pub mig_devices: Vec<MigDevice>,
    /// Health counters, or why they could not be read.
    pub health: Result<HealthSnapshot, String>,
    /// NUMA node, when known.
    pub numa_node: Option<u32>,
}

impl GpuSnapshot {
    /// Whether MIG mode is on now.
    pub fn mig_enabled(&self) -> bool {
        self.mig_mode.is_some_and(|m| m.current)
    }
}

/// The node's GPUs as read.
#[derive(Debug, Clone, PartialEq)]
pub struct Inventory {
    /// Driver versions.
    pub driver: DriverInfo,
    /// GPUs by index.
    pub gpus: Vec<GpuSnapshot>,
}

impl Inventory {
    /// Reads every GPU. A GPU that cannot be described fails the read; per-GPU health and MIG
    /// queries that fail are recorded instead (a lost GPU still shows up, unhealthy).
    pub fn read(backend: &dyn GpuBackend) -> backend::Result<Inventory> {
        let driver = backend.driver()?;
        let mut gpus = Vec::new();
        for device in backend.devices()? {
            let index = device.index;
            let mig_mode = match backend.mig_mode(index) {
                Ok(mode) => Some(mode),
                Err(e) if e.kind() == ErrorKind::NotSupported => None,
                Err(e) if e.kind() == ErrorKind::GpuLost => None,
                Err(e) => return Err(e),
            };
            let (instances, mig_devices) = if mig_mode.is_some_and(|m| m.current) {
                let mut instances = Vec::new();
                for gi in backend.gpu_instances(index)? {
                    let cis = backend.compute_instances(index, gi.id)?;
                    instances.push((gi, cis));
                }
                let mig_devices = backend.mig_devices_of(index, &instances)?;
                (instances, mig_devices)
            } else {
                (Vec::new(), Vec::new())
            };
            let health = backend.health(index).map_err(|e| e.to_string());
            let numa_node = backend.numa_node(index).unwrap_or(None);
            gpus.push(GpuSnapshot {
                device,
                mig_mode,
                instances,
                mig_devices,
                health,
                numa_node,
            });
        }
        Ok(Inventory { driver, gpus })
    }
}
