//! `NvmlBackend`: the GPUs as the NVIDIA driver reports them, through NVML.
//!
//! nvml-wrapper's safe API where it has the call; [`raw`] over the same loaded library for the
//! MIG management, event and topology calls it lacks.

pub mod raw;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, TemperatureSensor, TopologyLevel,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;

use super::{
    Architecture, CiProfileId, ComputeInstance, ComputeInstanceId, ComputeInstanceProfile,
    ComputeProcess, CudaVersion, DriverInfo, Error, ErrorKind, GiProfileId, GpuBackend, GpuDevice,
    GpuInstance, GpuInstanceId, GpuInstanceProfile, HealthEvent, HealthEventKind, HealthEvents,
    HealthSnapshot, MigDevice, MigMode, MigModeChange, MigProfile, PcieLink, Placement,
    ProcessUtilization, Result, Topology, Utilization,
};
use gpupool_mig_catalog as catalog;
use raw::{Raw, RawError};

/// Library names tried in order when none is configured.
pub const DEFAULT_LIBRARIES: &[&str] = &["libnvidia-ml.so.1", "libnvidia-ml.so"];

/// Environment variable naming the NVML library to load (a path or a file name).
pub const NVML_LIBRARY_ENV: &str = "GPUPOOL_NVML_LIBRARY";

/// How to load NVML.
#[derive(Debug, Clone, Default)]
pub struct NvmlOptions {
    /// Library path or name; [`DEFAULT_LIBRARIES`] when unset. The agent's
    /// `--nvml-library` flag and `GPUPOOL_NVML_LIBRARY` set it.
    pub library: Option<PathBuf>,
}

impl NvmlOptions {
    /// Options from the environment (`GPUPOOL_NVML_LIBRARY`).
    pub fn from_env() -> NvmlOptions {
        NvmlOptions {
            library: std::env::var_os(NVML_LIBRARY_ENV).map(PathBuf::from),
        }
    }
}

/// A compute-instance profile as the driver gave it: (ID, slices, most instances).
type CiProfileRead = (u32, u32, u32);

/// The NVIDIA driver, through NVML.
pub struct NvmlBackend {
    nvml: Nvml,
    /// Previous GPM sample per (GPU, GPU instance), as the address NVML gave it (a raw
    /// pointer is not `Send`); freed when replaced and on drop.
    gpm_baselines: Mutex<HashMap<(u32, u32), usize>>,
    /// The newest per-process sample timestamp seen per GPU (CPU microseconds, NVML's clock),
    /// so each call asks only for the samples since the previous one.
    process_samples_seen: Mutex<HashMap<u32, u64>>,
    /// Each GPU's GPU-instance profiles, read once: they are the hardware's (the GPU model's
    /// slices and memory), the same whatever the layout, and reading them is one NVML call
    /// per profile NVML knows (18), made by every MIG listing.
    gi_profiles_read: Mutex<HashMap<u32, Vec<(u32, raw::GiProfileInfo)>>>,
    /// The compute-instance profiles a GPU instance of a profile offers, per (GPU, GPU-instance
    /// profile ID), as (ID, slices, most instances), read once for the same reason: nine NVML
    /// calls per GPU instance listed otherwise.
    ci_profiles_read: Mutex<HashMap<(u32, u32), Vec<CiProfileRead>>>,
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        let samples =
            std::mem::take(&mut *self.gpm_baselines.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, sample) in samples {
            // Nothing useful to do on failure while shutting down.
            let _ = self.raw().gpm_sample_free(sample as sys::nvmlGpmSample_t);
        }
    }
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend").finish_non_exhaustive()
    }
}

fn gpu_target(gpu: u32) -> String {
    format!("GPU {gpu}")
}

/// Maps nvml-wrapper's error to ours.
fn wrapper_error(op: &'static str, target: impl Into<String>, e: NvmlError) -> Error {
    let detail = e.to_string();
    let kind = match e {
        NvmlError::DriverNotLoaded
        | NvmlError::LibloadingError(_)
        | NvmlError::LibRmVersionMismatch => ErrorKind::DriverNotLoaded,
        NvmlError::NotSupported
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::FunctionNotFound => ErrorKind::NotSupported,
        NvmlError::NoPermission => ErrorKind::NoPermission,
        NvmlError::NotFound => ErrorKind::NotFound,
        NvmlError::GpuLost => ErrorKind::GpuLost,
        NvmlError::InUse => ErrorKind::InUse,
        NvmlError::InvalidArg => ErrorKind::InvalidArgument,
        _ => ErrorKind::Driver,
    };
    Error::new(kind, op, target, detail)
}

impl NvmlBackend {
    /// Loads NVML and initializes it: the configured library, or else `libnvidia-ml.so.1` (the
    /// name the driver installs and container runtimes inject) and then `libnvidia-ml.so` (the
    /// development symlink nvml-wrapper defaults to).
    pub fn new(options: &NvmlOptions) -> Result<NvmlBackend> {
        let candidates: Vec<PathBuf> = match &options.library {
            Some(path) => vec![path.clone()],
            None => DEFAULT_LIBRARIES.iter().map(PathBuf::from).collect(),
        };
        let mut failures = Vec::new();
        for library in &candidates {
            match Nvml::builder()
                .lib_path(OsStr::new(library.as_os_str()))
                .init()
            {
                Ok(nvml) => {
                    return Ok(NvmlBackend {
                        nvml,
                        gpm_baselines: Mutex::new(HashMap::new()),
                        process_samples_seen: Mutex::new(HashMap::new()),
                        gi_profiles_read: Mutex::new(HashMap::new()),
                        ci_profiles_read: Mutex::new(HashMap::new()),
                    });
                }
                // Not loadable under this name: try the next.
                Err(NvmlError::LibloadingError(e)) => {
                    failures.push(format!("loading {}: {e}", library.display()));
                }
                Err(other) => return Err(wrapper_error("initializing NVML", "the driver", other)),
            }
        }
        Err(Error::DriverNotLoaded {
            detail: failures.join("; "),
        })
    }

    /// GPU-instance profiles as the driver reports them, without placements (which need MIG
    /// mode on): read-only, so it can check the catalog against hardware without touching the
    /// GPU's MIG mode.
    pub fn gpu_instance_profile_infos(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>> {
        let op = "reading GPU instance profiles";
        let model = self.catalog_model(&self.dev(op, gpu)?);
        self.gi_profiles(gpu, op)?
            .into_iter()
            .map(|(nvml_profile, info)| {
                Ok(GpuInstanceProfile {
                    name: self.profile_name(model, nvml_profile, &info)?,
                    nvml_profile,
                    id: GiProfileId(info.id),
                    slice_count: info.slice_count,
                    instance_count: info.instance_count,
                    multiprocessors: info.multiprocessor_count,
                    memory_mib: info.memory_size_mb,
                    placements: Vec::new(),
                })
            })
            .collect()
    }

    /// MIG devices of a GPU. With `known`, the GPU's instances as just listed (MIG mode on),
    /// each device's profile comes from there instead of four more NVML calls per device.
    fn list_mig_devices(
        &self,
        gpu: u32,
        known: Option<&[(GpuInstance, Vec<ComputeInstance>)]>,
    ) -> Result<Vec<MigDevice>> {
        let op = "listing MIG devices";
        let t = || gpu_target(gpu);
        let d = self.dev(op, gpu)?;
        let parent: super::GpuUuid = d.uuid().map_err(|e| wrapper_error(op, t(), e))?.parse()?;
        let model = self.catalog_model(&d);
        // SAFETY: see `handle`.
        let h = unsafe { d.handle() };
        if known.is_none() {
            let (current, _) = self
                .raw()
                .mig_mode(h)
                .map_err(|e| self.raw_error(op, t(), e))?;
            if !current {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    op,
                    t(),
                    "MIG mode is not enabled".to_owned(),
                ));
            }
        }
        // MIG mode is on (checked above, or the caller listed its instances).
        let profiles = self.gi_profiles_of_mig_gpu(gpu, op)?;
        let max = self
            .raw()
            .max_mig_devices(h)
            .map_err(|e| self.raw_error(op, t(), e))?;
        let mut out = Vec::new();
        for index in 0..max {
            let mig = match self.raw().mig_device_by_index(h, index) {
                Ok(m) => m,
                // Empty slots answer NOT_FOUND; indices need not be dense.
                Err(e)
                    if matches!(
                        e.code(),
                        sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND
                            | sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(self.raw_error(op, t(), e)),
            };
            let uuid = self
                .raw()
                .uuid(mig)
                .map_err(|e| self.raw_error(op, t(), e))?
                .parse()?;
            let (gi, ci) = self
                .raw()
                .mig_device_ids(mig)
                .map_err(|e| self.raw_error(op, t(), e))?;
            // The profiles from the instances just listed; from the driver when this device's
            // instances are not among them (the layout changed in between).
            let listed = known.and_then(|instances| {
                let (g, cis) = instances.iter().find(|(g, _)| g.id.0 == gi)?;
                let c = cis.iter().find(|c| c.id.0 == ci)?;
                Some((g.profile_id.0, c.profile_id.0, c.placement.size))
            });
            let (gi_profile, ci_profile, ci_size) = match listed {
                Some(ids) => ids,
                None => {
                    let gi_handle = self.gi_handle(op, gpu, GpuInstanceId(gi))?;
                    let gi_info = self
                        .raw()
                        .gi_info(gi_handle)
                        .map_err(|e| self.raw_error(op, t(), e))?;
                    let ci_info = self
                        .raw()
                        .compute_instance_by_id(gi_handle, ci)
                        .and_then(|c| self.raw().ci_info(c))
                        .map_err(|e| self.raw_error(op, t(), e))?;
                    (gi_info.profile_id, ci_info.profile_id, ci_info.size)
                }
            };
            let (nvml_profile, info) = profiles
                .iter()
                .find(|(_, i)| i.id == gi_profile)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Driver,
                        op,
                        t(),
                        format!("GPU instance {gi} has unknown profile ID {gi_profile}"),
                    )
                })?;
            let gi_name = self.profile_name(model, *nvml_profile, info)?;
            let ci_slices = ci_profile_slices(ci_profile).unwrap_or(ci_size);
            let profile = if ci_slices == info.slice_count {
                gi_name
            } else {
                format!("{ci_slices}c.{gi_name}").parse()?
            };
            out.push(MigDevice {
                uuid,
                gpu,
                parent: parent.clone(),
                gpu_instance: GpuInstanceId(gi),
                compute_instance: ComputeInstanceId(ci),
                profile,
                memory_mib: info.memory_size_mb,
            });
        }
        out.sort_by_key(|m| (m.gpu_instance, m.compute_instance));
        Ok(out)
    }

    /// The compute-instance profiles (ID, slices, most instances) GPU instance `gi` offers,
    /// skipping those it lacks; from the driver the first time a GPU instance of its profile
    /// is asked about on this GPU, then remembered.
    fn ci_profiles(
        &self,
        op: &'static str,
        gpu: u32,
        gi: GpuInstanceId,
        handle: sys::nvmlGpuInstance_t,
    ) -> Result<Vec<CiProfileRead>> {
        let target = || format!("GPU {gpu} GPU instance {gi}");
        let gi_profile = self
            .raw()
            .gi_info(handle)
            .map_err(|e| self.raw_error(op, target(), e))?
            .profile_id;
        let lock = || {
            self.ci_profiles_read
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        };
        if let Some(known) = lock().get(&(gpu, gi_profile)) {
            return Ok(known.clone());
        }
        let mut read = Vec::new();
        for profile in 0..catalog::nvml_ci_profile::COUNT {
            match self.raw().ci_profile_info(handle, profile) {
                Ok(p) => read.push(p),
                Err(e)
                    if e.is_not_supported()
                        || e.code() == sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => {}
                Err(e) => return Err(self.raw_error(op, target(), e)),
            }
        }
        if !read.is_empty() {
            lock().insert((gpu, gi_profile), read.clone());
        }
        Ok(read)
    }

    fn raw(&self) -> Raw<'_> {
        Raw::new(self.nvml.lib())
    }

    fn dev(&self, op: &'static str, gpu: u32) -> Result<Device<'_>> {
        self.nvml
            .device_by_index(gpu)
            .map_err(|e| wrapper_error(op, gpu_target(gpu), e))
    }

    fn handle(&self, op: &'static str, gpu: u32) -> Result<sys::nvmlDevice_t> {
        // SAFETY: the handle is only passed back to the library that issued it, while `self`
        // (and so the library) lives.
        Ok(unsafe { self.dev(op, gpu)?.handle() })
    }

    fn raw_error(&self, op: &'static str, target: impl Into<String>, e: RawError) -> Error {
        let (kind, detail) = match &e {
            RawError::MissingSymbol(name) => (
                ErrorKind::NotSupported,
                format!("the driver's NVML lacks {name}"),
            ),
            RawError::Code(name, code) => {
                let kind = match *code {
                    sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                    | sys::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => ErrorKind::NotSupported,
                    sys::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => ErrorKind::NoPermission,
                    sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND => ErrorKind::NotFound,
                    sys::nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED
                    | sys::nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND => {
                        ErrorKind::DriverNotLoaded
                    }
                    sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => ErrorKind::GpuLost,
                    sys::nvmlReturn_enum_NVML_ERROR_IN_USE => ErrorKind::InUse,
                    sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => {
                        ErrorKind::InsufficientResources
                    }
                    sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => ErrorKind::InvalidArgument,
                    _ => ErrorKind::Driver,
                };
                (kind, format!("{name}: {}", self.raw().error_string(*code)))
            }
        };
        Error::new(kind, op, target, detail)
    }

    /// The catalog entry for a GPU, by its product name.
    fn catalog_model(&self, dev: &Device<'_>) -> Option<&'static catalog::GpuModel> {
        dev.name()
            .ok()
            .and_then(|n| catalog::model_by_product_name(&n))
    }

    fn gi_profiles_lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u32, Vec<(u32, raw::GiProfileInfo)>>> {
        self.gi_profiles_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// [`Self::gi_profiles`] for a GPU whose MIG mode is on: as last read, when they were.
    /// (Only with MIG on, where the driver always lists them; with it off it may list none.)
    fn gi_profiles_of_mig_gpu(
        &self,
        gpu: u32,
        op: &'static str,
    ) -> Result<Vec<(u32, raw::GiProfileInfo)>> {
        if let Some(known) = self.gi_profiles_lock().get(&gpu) {
            return Ok(known.clone());
        }
        self.gi_profiles(gpu, op)
    }

    /// GPU-instance profiles as (NVML enum, info), skipping those the GPU lacks; remembered
    /// for [`Self::gi_profiles_of_mig_gpu`] when there are some.
    fn gi_profiles(&self, gpu: u32, op: &'static str) -> Result<Vec<(u32, raw::GiProfileInfo)>> {
        let read = self.read_gi_profiles(gpu, op)?;
        if !read.is_empty() {
            self.gi_profiles_lock().insert(gpu, read.clone());
        }
        Ok(read)
    }

    fn read_gi_profiles(
        &self,
        gpu: u32,
        op: &'static str,
    ) -> Result<Vec<(u32, raw::GiProfileInfo)>> {
        let h = self.handle(op, gpu)?;
        let mut out = Vec::new();
        for nvml_profile in 0..catalog::nvml_gi_profile::COUNT {
            match self.raw().gi_profile_info(h, nvml_profile) {
                Ok(info) => out.push((nvml_profile, info)),
                Err(e)
                    if e.is_not_supported()
                        || e.code() == sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT =>
                {
                    if e.code() == sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                        && nvml_profile == 0
                        && self.raw().mig_mode(h).is_err()
                    {
                        // Not MIG-capable at all: say so instead of returning no profiles.
                        return Err(self.raw_error(op, gpu_target(gpu), e));
                    }
                }
                Err(e) => return Err(self.raw_error(op, gpu_target(gpu), e)),
            }
        }
        Ok(out)
    }

    fn profile_name(
        &self,
        model: Option<&'static catalog::GpuModel>,
        nvml_profile: u32,
        info: &raw::GiProfileInfo,
    ) -> Result<MigProfile> {
        if let Some(p) = model.and_then(|m| m.profile_by_id(info.id)) {
            return p.name.parse();
        }
        // A model the catalog does not know: name it the way nvidia-smi does, from slices and
        // memory rounded up to whole GB.
        let me = matches!(
            nvml_profile,
            catalog::nvml_gi_profile::SLICE_1_REV1 | catalog::nvml_gi_profile::SLICE_2_REV1
        );
        format!(
            "{}g.{}gb{}",
            info.slice_count,
            info.memory_size_mb.div_ceil(1024),
            if me { "+me" } else { "" }
        )
        .parse()
    }

    fn gi_handle(
        &self,
        op: &'static str,
        gpu: u32,
        gi: GpuInstanceId,
    ) -> Result<sys::nvmlGpuInstance_t> {
        let h = self.handle(op, gpu)?;
        self.raw()
            .gpu_instance_by_id(h, gi.0)
            .map_err(|e| self.raw_error(op, format!("GPU {gpu} GPU instance {gi}"), e))
    }

    fn ci_info(
        &self,
        op: &'static str,
        gpu: u32,
        gi: GpuInstanceId,
        ci: sys::nvmlComputeInstance_t,
    ) -> Result<ComputeInstance> {
        let info = self
            .raw()
            .ci_info(ci)
            .map_err(|e| self.raw_error(op, format!("GPU {gpu} GPU instance {gi}"), e))?;
        Ok(ComputeInstance {
            id: ComputeInstanceId(info.id),
            gpu_instance: gi,
            profile_id: CiProfileId(info.profile_id),
            placement: Placement {
                start: info.start,
                size: info.size,
            },
        })
    }
}

fn pcie_level(level: TopologyLevel) -> PcieLink {
    match level {
        TopologyLevel::Internal => PcieLink::SameBoard,
        TopologyLevel::Single => PcieLink::SingleSwitch,
        TopologyLevel::Multiple => PcieLink::MultipleSwitches,
        TopologyLevel::HostBridge => PcieLink::HostBridge,
        TopologyLevel::Node => PcieLink::NumaNode,
        TopologyLevel::System => PcieLink::System,
    }
}

/// Compute slices of a compute-instance profile enum value (nvml.h).
fn ci_profile_slices(profile: u32) -> Option<u32> {
    use catalog::nvml_ci_profile as c;
    match profile {
        c::SLICE_1 | 7 => Some(1),
        c::SLICE_2 => Some(2),
        c::SLICE_3 => Some(3),
        c::SLICE_4 => Some(4),
        c::SLICE_7 | 8 => Some(7),
        c::SLICE_8 => Some(8),
        c::SLICE_6 => Some(6),
        _ => None,
    }
}

/// Unwraps an optional counter: "not supported" means the GPU lacks it.
fn optional<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == ErrorKind::NotSupported => Ok(None),
        Err(e) => Err(e),
    }
}

struct NvmlEvents<'a> {
    backend: &'a NvmlBackend,
    set: sys::nvmlEventSet_t,
    /// Each registered GPU's handle (as an address) → its index and UUID, read once when the
    /// set is made: an event on a known GPU is then described with no NVML call, so nothing
    /// stands between the driver's event and the plugins' Unhealthy but the wait itself.
    known: HashMap<usize, (u32, String)>,
}

// SAFETY: an NVML event set may be waited on from any thread; it is used by one at a time
// (`&mut self`).
unsafe impl Send for NvmlEvents<'_> {}

impl NvmlEvents<'_> {
    fn convert(&self, e: raw::RawEvent) -> Result<Option<HealthEvent>> {
        let kind = match e.event_type {
            t if t & u64::from(sys::nvmlEventTypeXidCriticalError) != 0 => {
                HealthEventKind::Xid(e.data)
            }
            t if t & u64::from(sys::nvmlEventTypeDoubleBitEccError) != 0 => {
                HealthEventKind::DoubleBitEcc
            }
            t if t & u64::from(sys::nvmlEventTypeSingleBitEccError) != 0 => {
                HealthEventKind::SingleBitEcc
            }
            _ => return Ok(None),
        };
        let raw = self.backend.raw();
        let op = "reading a health event";
        let attribution = || {
            (
                (e.gpu_instance != u32::MAX).then_some(GpuInstanceId(e.gpu_instance)),
                (e.compute_instance != u32::MAX).then_some(ComputeInstanceId(e.compute_instance)),
            )
        };
        if let Some((gpu, uuid)) = self.known.get(&(e.device as usize)) {
            let (gpu_instance, compute_instance) = attribution();
            return Ok(Some(HealthEvent {
                gpu: *gpu,
                uuid: uuid.parse()?,
                kind,
                gpu_instance,
                compute_instance,
            }));
        }
        // A handle not registered here: events name the physical GPU; should a driver hand out
        // a MIG device handle, map it to its parent.
        // One index call on the common path: each NVML call costs a driver round trip, and
        // this runs between the fault and the plugins' Unhealthy.
        let (device, gpu) = match raw.index(e.device) {
            Ok(gpu) => (e.device, gpu),
            Err(_) => {
                let parent = raw
                    .parent_of_mig_device(e.device)
                    .map_err(|err| self.backend.raw_error(op, "event device", err))?;
                let gpu = raw
                    .index(parent)
                    .map_err(|err| self.backend.raw_error(op, "event device", err))?;
                (parent, gpu)
            }
        };
        let uuid = raw
            .uuid(device)
            .map_err(|err| self.backend.raw_error(op, gpu_target(gpu), err))?
            .parse()?;
        Ok(Some(HealthEvent {
            gpu,
            uuid,
            kind,
            gpu_instance: (e.gpu_instance != u32::MAX).then_some(GpuInstanceId(e.gpu_instance)),
            compute_instance: (e.compute_instance != u32::MAX)
                .then_some(ComputeInstanceId(e.compute_instance)),
        }))
    }
}

impl HealthEvents for NvmlEvents<'_> {
    /// One event per call, handed over as soon as the driver gives it: draining the queue
    /// first would put another NVML call between the fault and the plugins' Unhealthy, and
    /// the caller waits again at once, which a queued event answers without blocking.
    fn wait(&mut self, timeout: Duration) -> Result<Vec<HealthEvent>> {
        let raw = self.backend.raw();
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        loop {
            match raw.event_wait(self.set, timeout_ms) {
                Ok(Some(e)) => {
                    if let Some(event) = self.convert(e)? {
                        return Ok(vec![event]);
                    }
                    // A type we did not ask for: wait for the next one.
                }
                Ok(None) => return Ok(Vec::new()),
                Err(e) => {
                    return Err(self
                        .backend
                        .raw_error("waiting for health events", "all GPUs", e));
                }
            }
        }
    }
}

impl Drop for NvmlEvents<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.backend.raw().event_set_free(self.set) {
            tracing::warn!(error = ?e, "freeing the NVML event set");
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn driver(&self) -> Result<DriverInfo> {
        let op = "reading driver version";
        let driver_version = self
            .nvml
            .sys_driver_version()
            .map_err(|e| wrapper_error(op, "the driver", e))?;
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .map_err(|e| wrapper_error(op, "the driver", e))?;
        Ok(DriverInfo {
            driver_version,
            cuda_version: CudaVersion::from_nvml(cuda),
        })
    }

    fn device_count(&self) -> Result<u32> {
        self.nvml
            .device_count()
            .map_err(|e| wrapper_error("counting GPUs", "the driver", e))
    }

    fn device(&self, gpu: u32) -> Result<GpuDevice> {
        let op = "reading device";
        let t = || gpu_target(gpu);
        let d = self.dev(op, gpu)?;
        let w = |e| wrapper_error(op, t(), e);
        let cc = d.cuda_compute_capability().map_err(w)?;
        // SAFETY: see `handle`.
        let h = unsafe { d.handle() };
        let arch = self
            .raw()
            .architecture(h)
            .map_err(|e| self.raw_error(op, t(), e))?;
        let name = d.name().map_err(w)?;
        let mig_capable = match self.raw().mig_mode(h) {
            Ok(_) => true,
            Err(e) if e.is_not_supported() => false,
            // A lost GPU still has an identity; judge MIG support by its model.
            Err(e) if e.code() == sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => {
                catalog::model_by_product_name(&name).is_some()
            }
            Err(e) => return Err(self.raw_error(op, t(), e)),
        };
        Ok(GpuDevice {
            index: d.index().map_err(w)?,
            uuid: d.uuid().map_err(w)?.parse()?,
            name,
            minor_number: d.minor_number().map_err(w)?,
            pci_bus_id: d.pci_info().map_err(w)?.bus_id,
            memory_mib: d.memory_info().map_err(w)?.total / (1024 * 1024),
            compute_capability: (cc.major.max(0) as u32, cc.minor.max(0) as u32),
            architecture: Architecture::from_nvml(arch),
            mig_capable,
        })
    }

    fn topology(&self, a: u32, b: u32) -> Result<Topology> {
        let op = "reading topology";
        let target = || format!("GPUs {a} and {b}");
        let (da, db) = (self.dev(op, a)?, self.dev(op, b)?);
        if a == b {
            return Ok(Topology {
                nvlink: false,
                pcie: PcieLink::SameBoard,
            });
        }
        let level = da
            .topology_common_ancestor(db)
            .map_err(|e| wrapper_error(op, target(), e))?;
        let (ha, hb) = (self.handle(op, a)?, self.handle(op, b)?);
        let nvlink = match self.raw().nvlink_p2p(ha, hb) {
            Ok(ok) => ok,
            Err(e) if e.is_not_supported() => false,
            Err(e) => return Err(self.raw_error(op, target(), e)),
        };
        Ok(Topology {
            nvlink,
            pcie: pcie_level(level),
        })
    }

    fn numa_node(&self, gpu: u32) -> Result<Option<u32>> {
        let op = "reading NUMA node";
        optional(
            self.dev(op, gpu)?
                .numa_node_id()
                .map_err(|e| wrapper_error(op, gpu_target(gpu), e)),
        )
    }

    fn health(&self, gpu: u32) -> Result<HealthSnapshot> {
        let op = "reading health";
        let t = || gpu_target(gpu);
        let d = self.dev(op, gpu)?;
        let w = |e| wrapper_error(op, t(), e);
        let ecc_uncorrected = optional(
            d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                .map_err(w),
        )?;
        let ecc_corrected = optional(
            d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
                .map_err(w),
        )?;
        let pcie_replay = optional(d.pcie_replay_counter().map_err(w))?.map(u64::from);
        // SAFETY: see `handle`.
        let h = unsafe { d.handle() };
        // Ampere and newer remap rows; older GPUs retire pages.
        let retired_pages = match self.raw().remapped_rows_uncorrectable(h) {
            Ok(n) => Some(n),
            Err(e) if e.is_not_supported() => optional(
                self.raw()
                    .retired_pages_dbe(h)
                    .map_err(|e| self.raw_error(op, t(), e)),
            )?,
            Err(e) => return Err(self.raw_error(op, t(), e)),
        };
        let temperature_c = optional(d.temperature(TemperatureSensor::Gpu).map_err(w))?;
        Ok(HealthSnapshot {
            ecc_uncorrected,
            ecc_corrected,
            pcie_replay,
            retired_pages,
            temperature_c,
        })
    }

    fn persistence_mode(&self, gpu: u32) -> Result<bool> {
        let op = "reading persistence mode";
        self.dev(op, gpu)?
            .is_in_persistent_mode()
            .map_err(|e| wrapper_error(op, gpu_target(gpu), e))
    }

    fn health_events(&self) -> Result<Box<dyn HealthEvents + '_>> {
        let op = "subscribing to health events";
        let raw = self.raw();
        let set = raw
            .event_set_create()
            .map_err(|e| self.raw_error(op, "all GPUs", e))?;
        let mut events = NvmlEvents {
            backend: self,
            set,
            known: HashMap::new(),
        };
        let wanted = u64::from(
            sys::nvmlEventTypeXidCriticalError
                | sys::nvmlEventTypeDoubleBitEccError
                | sys::nvmlEventTypeSingleBitEccError,
        );
        for gpu in 0..self.device_count()? {
            let h = self.handle(op, gpu)?;
            let supported = match raw.supported_event_types(h) {
                Ok(s) => s,
                Err(e) if e.is_not_supported() => {
                    tracing::warn!(gpu, "GPU reports no health events; relying on polling");
                    continue;
                }
                Err(e) => return Err(self.raw_error(op, gpu_target(gpu), e)),
            };
            if supported & wanted == 0 {
                continue;
            }
            raw.register_events(h, supported & wanted, set)
                .map_err(|e| self.raw_error(op, gpu_target(gpu), e))?;
            if let Ok(uuid) = raw.uuid(h) {
                events.known.insert(h as usize, (gpu, uuid));
            }
        }
        Ok(Box::new(events))
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode> {
        let op = "reading MIG mode";
        let h = self.handle(op, gpu)?;
        let (current, pending) = self
            .raw()
            .mig_mode(h)
            .map_err(|e| self.raw_error(op, gpu_target(gpu), e))?;
        Ok(MigMode { current, pending })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange> {
        let op = "setting MIG mode";
        let h = self.handle(op, gpu)?;
        let status = self
            .raw()
            .set_mig_mode(h, enabled)
            .map_err(|e| self.raw_error(op, gpu_target(gpu), e))?;
        Ok(if status == sys::nvmlReturn_enum_NVML_SUCCESS {
            MigModeChange::Applied
        } else {
            MigModeChange::PendingReset(self.raw().error_string(status))
        })
    }

    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>> {
        let op = "listing GPU instance profiles";
        let model = self.catalog_model(&self.dev(op, gpu)?);
        let h = self.handle(op, gpu)?;
        let mut out = Vec::new();
        for (nvml_profile, info) in self.gi_profiles(gpu, op)? {
            let placements = self
                .raw()
                .gi_possible_placements(h, info.id)
                .map_err(|e| self.raw_error(op, gpu_target(gpu), e))?
                .into_iter()
                .map(|(start, size)| Placement { start, size })
                .collect();
            out.push(GpuInstanceProfile {
                name: self.profile_name(model, nvml_profile, &info)?,
                nvml_profile,
                id: GiProfileId(info.id),
                slice_count: info.slice_count,
                instance_count: info.instance_count,
                multiprocessors: info.multiprocessor_count,
                memory_mib: info.memory_size_mb,
                placements,
            });
        }
        Ok(out)
    }

    fn compute_instance_profiles(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
    ) -> Result<Vec<ComputeInstanceProfile>> {
        let op = "listing compute instance profiles";
        let handle = self.gi_handle(op, gpu, gi)?;
        let mut out: Vec<ComputeInstanceProfile> = Vec::new();
        for (id, slices, _) in self.ci_profiles(op, gpu, gi, handle)? {
            if !out.iter().any(|p| p.id.0 == id) {
                out.push(ComputeInstanceProfile {
                    id: CiProfileId(id),
                    slice_count: slices,
                });
            }
        }
        Ok(out)
    }

    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>> {
        let op = "listing GPU instances";
        let h = self.handle(op, gpu)?;
        let mut out = Vec::new();
        for (_, info) in self.gi_profiles(gpu, op)? {
            let handles = self
                .raw()
                .gpu_instances(h, info.id, info.instance_count)
                .map_err(|e| self.raw_error(op, gpu_target(gpu), e))?;
            for gi in handles {
                let i = self
                    .raw()
                    .gi_info(gi)
                    .map_err(|e| self.raw_error(op, gpu_target(gpu), e))?;
                out.push(GpuInstance {
                    id: GpuInstanceId(i.id),
                    profile_id: GiProfileId(i.profile_id),
                    placement: Placement {
                        start: i.start,
                        size: i.size,
                    },
                });
            }
        }
        out.sort_by_key(|g| g.id);
        out.dedup_by_key(|g| g.id);
        Ok(out)
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile: GiProfileId,
        start: Option<u32>,
    ) -> Result<GpuInstance> {
        let op = "creating GPU instance";
        let target = || format!("GPU {gpu} (profile ID {})", profile.0);
        let h = self.handle(op, gpu)?;
        let placement = match start {
            None => None,
            Some(start) => {
                let (_, info) = self
                    .gi_profiles(gpu, op)?
                    .into_iter()
                    .find(|(_, i)| i.id == profile.0)
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidArgument,
                            op,
                            target(),
                            format!("the GPU has no GPU instance profile ID {}", profile.0),
                        )
                    })?;
                // A placement's size is the profile's memory slices; take it from the driver.
                let size = self
                    .raw()
                    .gi_possible_placements(h, info.id)
                    .map_err(|e| self.raw_error(op, target(), e))?
                    .into_iter()
                    .find(|&(s, _)| s == start)
                    .map(|(_, size)| size)
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidArgument,
                            op,
                            target(),
                            format!("memory slice {start} is not a valid placement start"),
                        )
                    })?;
                Some((start, size))
            }
        };
        let gi = self
            .raw()
            .create_gpu_instance(h, profile.0, placement)
            .map_err(|e| self.raw_error(op, target(), e))?;
        let i = self
            .raw()
            .gi_info(gi)
            .map_err(|e| self.raw_error(op, target(), e))?;
        Ok(GpuInstance {
            id: GpuInstanceId(i.id),
            profile_id: GiProfileId(i.profile_id),
            placement: Placement {
                start: i.start,
                size: i.size,
            },
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gi: GpuInstanceId) -> Result<()> {
        let op = "destroying GPU instance";
        let handle = self.gi_handle(op, gpu, gi)?;
        self.raw()
            .destroy_gpu_instance(handle)
            .map_err(|e| self.raw_error(op, format!("GPU {gpu} GPU instance {gi}"), e))
    }

    fn compute_instances(&self, gpu: u32, gi: GpuInstanceId) -> Result<Vec<ComputeInstance>> {
        let op = "listing compute instances";
        let handle = self.gi_handle(op, gpu, gi)?;
        let target = || format!("GPU {gpu} GPU instance {gi}");
        let mut out = Vec::new();
        for (id, _, max) in self.ci_profiles(op, gpu, gi, handle)? {
            let handles = self
                .raw()
                .compute_instances(handle, id, max)
                .map_err(|e| self.raw_error(op, target(), e))?;
            for ci in handles {
                out.push(self.ci_info(op, gpu, gi, ci)?);
            }
        }
        out.sort_by_key(|c| c.id);
        out.dedup_by_key(|c| c.id);
        Ok(out)
    }

    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
        profile: CiProfileId,
    ) -> Result<ComputeInstance> {
        let op = "creating compute instance";
        let handle = self.gi_handle(op, gpu, gi)?;
        let ci = self
            .raw()
            .create_compute_instance(handle, profile.0)
            .map_err(|e| self.raw_error(op, format!("GPU {gpu} GPU instance {gi}"), e))?;
        self.ci_info(op, gpu, gi, ci)
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gi: GpuInstanceId,
        ci: ComputeInstanceId,
    ) -> Result<()> {
        let op = "destroying compute instance";
        let target = || format!("GPU {gpu} GPU instance {gi} compute instance {ci}");
        let handle = self.gi_handle(op, gpu, gi)?;
        let ci = self
            .raw()
            .compute_instance_by_id(handle, ci.0)
            .map_err(|e| self.raw_error(op, target(), e))?;
        self.raw()
            .destroy_compute_instance(ci)
            .map_err(|e| self.raw_error(op, target(), e))
    }

    fn mig_devices(&self, gpu: u32) -> Result<Vec<MigDevice>> {
        self.list_mig_devices(gpu, None)
    }

    fn mig_devices_of(
        &self,
        gpu: u32,
        instances: &[(GpuInstance, Vec<ComputeInstance>)],
    ) -> Result<Vec<MigDevice>> {
        self.list_mig_devices(gpu, Some(instances))
    }

    fn utilization(&self, gpu: u32) -> Result<Utilization> {
        let op = "reading utilization";
        let u = self
            .dev(op, gpu)?
            .utilization_rates()
            .map_err(|e| wrapper_error(op, gpu_target(gpu), e))?;
        Ok(Utilization {
            gpu_percent: u.gpu,
            memory_percent: u.memory,
        })
    }

    fn mig_utilization(&self, gpu: u32, gi: GpuInstanceId) -> Result<Option<Utilization>> {
        let op = "reading GPU instance utilization";
        let target = || format!("GPU {gpu} GPU instance {gi}");
        let h = self.handle(op, gpu)?;
        let raw = self.raw();
        match raw.gpm_supported(h) {
            Ok(true) => {}
            Ok(false) => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    op,
                    target(),
                    "GPM needs Hopper or newer".to_owned(),
                ));
            }
            Err(e) => return Err(self.raw_error(op, target(), e)),
        }
        let sample = raw
            .gpm_mig_sample(h, gi.0)
            .map_err(|e| self.raw_error(op, target(), e))?;
        let previous = self
            .gpm_baselines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((gpu, gi.0), sample as usize);
        let Some(previous) = previous else {
            return Ok(None);
        };
        let previous = previous as sys::nvmlGpmSample_t;
        let result = raw.gpm_utilization(previous, sample);
        if let Err(e) = raw.gpm_sample_free(previous) {
            tracing::warn!(error = ?e, "freeing a GPM sample");
        }
        let (sm, dram) = result.map_err(|e| self.raw_error(op, target(), e))?;
        Ok(Some(Utilization {
            gpu_percent: sm.round().clamp(0.0, 100.0) as u32,
            memory_percent: dram.round().clamp(0.0, 100.0) as u32,
        }))
    }

    fn processes(&self, gpu: u32) -> Result<Vec<ComputeProcess>> {
        let op = "listing processes";
        let mut out: Vec<ComputeProcess> = self
            .dev(op, gpu)?
            .running_compute_processes()
            .map_err(|e| wrapper_error(op, gpu_target(gpu), e))?
            .into_iter()
            .map(|p| ComputeProcess {
                pid: p.pid,
                used_memory_mib: match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes / (1024 * 1024)),
                    UsedGpuMemory::Unavailable => None,
                },
                gpu_instance: p.gpu_instance_id.map(GpuInstanceId),
                compute_instance: p.compute_instance_id.map(ComputeInstanceId),
            })
            .collect();
        out.sort();
        Ok(out)
    }

    fn process_utilization(&self, gpu: u32) -> Result<Vec<ProcessUtilization>> {
        let op = "reading process utilization";
        let since = self
            .process_samples_seen
            .lock()
            .map(|m| m.get(&gpu).copied().unwrap_or(0))
            .unwrap_or(0);
        let samples = match self.dev(op, gpu)?.process_utilization_stats(since) {
            Ok(s) => s,
            // No process ran since `since`: the driver has no sample to give.
            Err(NvmlError::NotFound) => Vec::new(),
            Err(e) => return Err(wrapper_error(op, gpu_target(gpu), e)),
        };
        let mut per_pid: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
        let mut newest = since;
        for s in &samples {
            newest = newest.max(s.timestamp);
            let e = per_pid.entry(s.pid).or_default();
            e.0 += u64::from(s.sm_util.min(100));
            e.1 += 1;
        }
        if let Ok(mut m) = self.process_samples_seen.lock() {
            m.insert(gpu, newest);
        }
        Ok(per_pid
            .into_iter()
            .map(|(pid, (sum, n))| ProcessUtilization {
                pid,
                sm_percent: (sum / u64::from(n.max(1))) as u32,
            })
            .collect())
    }
}
