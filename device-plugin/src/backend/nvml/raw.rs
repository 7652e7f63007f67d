//! A small safe layer over the NVML calls nvml-wrapper 0.13 has no safe API for (GPU/compute
//! instance management, placements, MIG device identity, events with MIG attribution, P2P
//! status, remapped rows). It uses the `NvmlLib` nvml-wrapper already loaded (`Nvml::lib()`),
//! so there is one binding and one loaded library.
//!
//! Function signatures, struct layouts and return codes are NVML's (nvml.h, as generated into
//! nvml-wrapper-sys); the semantics are from NVIDIA's NVML API reference
//! (<https://docs.nvidia.com/deploy/nvml-api/>).

use std::ffi::{CStr, c_char, c_uint};
use std::ptr;

use nvml_wrapper_sys::bindings as sys;
use sys::{NvmlLib, nvmlComputeInstance_t, nvmlDevice_t, nvmlGpuInstance_t, nvmlReturn_t};

/// An NVML call that failed: which function, and its return code (or a missing symbol).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawError {
    /// The function returned this code.
    Code(&'static str, nvmlReturn_t),
    /// The library lacks the function (older driver).
    MissingSymbol(&'static str),
}

impl RawError {
    /// The NVML return code; a missing function counts as `NVML_ERROR_FUNCTION_NOT_FOUND`.
    pub fn code(&self) -> nvmlReturn_t {
        match self {
            RawError::Code(_, c) => *c,
            RawError::MissingSymbol(_) => sys::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
        }
    }

    /// Whether the GPU or driver does not offer the call.
    pub fn is_not_supported(&self) -> bool {
        matches!(
            self.code(),
            sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                | sys::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND
        )
    }
}

pub type RawResult<T> = Result<T, RawError>;

macro_rules! sym {
    ($lib:expr, $name:ident) => {
        $lib.$name
            .as_ref()
            .map_err(|_| RawError::MissingSymbol(stringify!($name)))?
    };
}

fn check(name: &'static str, ret: nvmlReturn_t) -> RawResult<()> {
    if ret == sys::nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(RawError::Code(name, ret))
    }
}

/// Reads a NUL-terminated buffer NVML filled.
fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// NVML's `nvmlGpuInstanceProfileInfo_t`, the fields we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiProfileInfo {
    /// Profile ID.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// Most instances.
    pub instance_count: u32,
    /// SMs.
    pub multiprocessor_count: u32,
    /// Memory, MiB.
    pub memory_size_mb: u64,
}

/// NVML's `nvmlGpuInstanceInfo_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiInfo {
    /// GPU instance ID.
    pub id: u32,
    /// Profile ID.
    pub profile_id: u32,
    /// Placement start.
    pub start: u32,
    /// Placement size.
    pub size: u32,
}

/// NVML's `nvmlComputeInstanceInfo_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CiInfo {
    /// Compute instance ID.
    pub id: u32,
    /// Profile ID.
    pub profile_id: u32,
    /// Placement start.
    pub start: u32,
    /// Placement size.
    pub size: u32,
}

/// One event from `nvmlEventSetWait_v2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawEvent {
    /// Device handle the event is about.
    pub device: nvmlDevice_t,
    /// Event type bit.
    pub event_type: u64,
    /// Xid code for Xid events.
    pub data: u64,
    /// GPU instance, `u32::MAX` when not attributed.
    pub gpu_instance: u32,
    /// Compute instance, `u32::MAX` when not attributed.
    pub compute_instance: u32,
}

/// The raw NVML calls, bound to the library nvml-wrapper loaded.
///
/// Every method takes handles that came from this same library (device handles from
/// nvml-wrapper's `Device::handle()`, instance handles from the methods here), which is what
/// makes the FFI calls sound: NVML validates handles it issued and returns
/// `NVML_ERROR_INVALID_ARGUMENT` for stale ones.
#[derive(Clone, Copy)]
pub struct Raw<'a> {
    lib: &'a NvmlLib,
}

impl<'a> Raw<'a> {
    /// Binds to a loaded library.
    pub fn new(lib: &'a NvmlLib) -> Raw<'a> {
        Raw { lib }
    }

    /// `nvmlErrorString`, or a fallback when the symbol is missing.
    pub fn error_string(&self, code: nvmlReturn_t) -> String {
        match self.lib.nvmlErrorString.as_ref() {
            Ok(f) => {
                // SAFETY: NVML returns a pointer to a static NUL-terminated string (or NULL).
                let p = unsafe { f(code) };
                if p.is_null() {
                    format!("NVML error {code}")
                } else {
                    // SAFETY: non-null static C string from NVML.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            Err(_) => format!("NVML error {code}"),
        }
    }

    /// `nvmlDeviceGetArchitecture`
    pub fn architecture(&self, dev: nvmlDevice_t) -> RawResult<u32> {
        let f = sym!(self.lib, nvmlDeviceGetArchitecture);
        let mut arch: sys::nvmlDeviceArchitecture_t = 0;
        // SAFETY: valid out-pointer; handle from this library.
        check("nvmlDeviceGetArchitecture", unsafe { f(dev, &mut arch) })?;
        Ok(arch)
    }

    /// `nvmlDeviceGetIndex`
    pub fn index(&self, dev: nvmlDevice_t) -> RawResult<u32> {
        let f = sym!(self.lib, nvmlDeviceGetIndex);
        let mut index: c_uint = 0;
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetIndex", unsafe { f(dev, &mut index) })?;
        Ok(index)
    }

    /// `nvmlDeviceGetUUID` (works on MIG device handles too).
    pub fn uuid(&self, dev: nvmlDevice_t) -> RawResult<String> {
        let f = sym!(self.lib, nvmlDeviceGetUUID);
        // NVML_DEVICE_UUID_V2_BUFFER_SIZE is 96.
        let mut buf = [0 as c_char; 96];
        // SAFETY: buffer and its length match.
        check("nvmlDeviceGetUUID", unsafe {
            f(dev, buf.as_mut_ptr(), buf.len() as c_uint)
        })?;
        Ok(c_string(&buf))
    }

    /// `nvmlDeviceGetP2PStatus` for the NVLink capability: whether NVLink P2P works.
    pub fn nvlink_p2p(&self, a: nvmlDevice_t, b: nvmlDevice_t) -> RawResult<bool> {
        let f = sym!(self.lib, nvmlDeviceGetP2PStatus);
        let mut status: sys::nvmlGpuP2PStatus_t =
            sys::nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_UNKNOWN;
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetP2PStatus", unsafe {
            f(
                a,
                b,
                sys::nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK,
                &mut status,
            )
        })?;
        Ok(status == sys::nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK)
    }

    /// `nvmlDeviceGetRemappedRows`: uncorrectable remapped rows (Ampere and newer).
    pub fn remapped_rows_uncorrectable(&self, dev: nvmlDevice_t) -> RawResult<u64> {
        let f = sym!(self.lib, nvmlDeviceGetRemappedRows);
        let (mut corr, mut unc, mut pending, mut failure): (c_uint, c_uint, c_uint, c_uint) =
            (0, 0, 0, 0);
        // SAFETY: four valid out-pointers.
        check("nvmlDeviceGetRemappedRows", unsafe {
            f(dev, &mut corr, &mut unc, &mut pending, &mut failure)
        })?;
        Ok(u64::from(unc))
    }

    /// `nvmlDeviceGetRetiredPages_v2` for double-bit errors: how many pages (pre-Ampere).
    pub fn retired_pages_dbe(&self, dev: nvmlDevice_t) -> RawResult<u64> {
        let f = sym!(self.lib, nvmlDeviceGetRetiredPages_v2);
        let mut count: c_uint = 0;
        // SAFETY: count 0 with NULL arrays asks for the count only.
        let ret = unsafe {
            f(
                dev,
                sys::nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
                &mut count,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        if ret == sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            return Ok(u64::from(count));
        }
        check("nvmlDeviceGetRetiredPages_v2", ret)?;
        Ok(u64::from(count))
    }

    /// `nvmlDeviceGetMigMode`: (current, pending).
    pub fn mig_mode(&self, dev: nvmlDevice_t) -> RawResult<(bool, bool)> {
        let f = sym!(self.lib, nvmlDeviceGetMigMode);
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: valid out-pointers.
        check("nvmlDeviceGetMigMode", unsafe {
            f(dev, &mut current, &mut pending)
        })?;
        Ok((
            current == sys::NVML_DEVICE_MIG_ENABLE,
            pending == sys::NVML_DEVICE_MIG_ENABLE,
        ))
    }

    /// `nvmlDeviceSetMigMode`: returns the activation status code.
    pub fn set_mig_mode(&self, dev: nvmlDevice_t, enabled: bool) -> RawResult<nvmlReturn_t> {
        let f = sym!(self.lib, nvmlDeviceSetMigMode);
        let mode = if enabled {
            sys::NVML_DEVICE_MIG_ENABLE
        } else {
            sys::NVML_DEVICE_MIG_DISABLE
        };
        let mut status: nvmlReturn_t = sys::nvmlReturn_enum_NVML_SUCCESS;
        // SAFETY: valid out-pointer.
        check("nvmlDeviceSetMigMode", unsafe { f(dev, mode, &mut status) })?;
        Ok(status)
    }

    /// `nvmlDeviceGetGpuInstanceProfileInfo` for an NVML profile enum value.
    pub fn gi_profile_info(
        &self,
        dev: nvmlDevice_t,
        nvml_profile: u32,
    ) -> RawResult<GiProfileInfo> {
        let f = sym!(self.lib, nvmlDeviceGetGpuInstanceProfileInfo);
        // SAFETY: plain-data struct; all-zero is a valid value.
        let mut info: sys::nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer to the v1 struct this function takes.
        check("nvmlDeviceGetGpuInstanceProfileInfo", unsafe {
            f(dev, nvml_profile, &mut info)
        })?;
        Ok(GiProfileInfo {
            id: info.id,
            slice_count: info.sliceCount,
            instance_count: info.instanceCount,
            multiprocessor_count: info.multiprocessorCount,
            memory_size_mb: info.memorySizeMB,
        })
    }

    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: (start, size) pairs.
    pub fn gi_possible_placements(
        &self,
        dev: nvmlDevice_t,
        profile_id: u32,
    ) -> RawResult<Vec<(u32, u32)>> {
        let f = sym!(self.lib, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
        let mut count: c_uint = 0;
        // SAFETY: NULL placements with a count pointer asks for the count.
        check("nvmlDeviceGetGpuInstancePossiblePlacements_v2", unsafe {
            f(dev, profile_id, ptr::null_mut(), &mut count)
        })?;
        let mut placements =
            vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        // SAFETY: the array holds `count` elements.
        check("nvmlDeviceGetGpuInstancePossiblePlacements_v2", unsafe {
            f(dev, profile_id, placements.as_mut_ptr(), &mut count)
        })?;
        placements.truncate(count as usize);
        Ok(placements.iter().map(|p| (p.start, p.size)).collect())
    }

    /// `nvmlDeviceGetGpuInstances` for one profile ID.
    pub fn gpu_instances(
        &self,
        dev: nvmlDevice_t,
        profile_id: u32,
        max: u32,
    ) -> RawResult<Vec<nvmlGpuInstance_t>> {
        let f = sym!(self.lib, nvmlDeviceGetGpuInstances);
        let mut handles: Vec<nvmlGpuInstance_t> = vec![ptr::null_mut(); max.max(1) as usize];
        let mut count: c_uint = 0;
        // SAFETY: the array holds at least `max` (the profile's instance count) handles, the
        // most NVML writes.
        check("nvmlDeviceGetGpuInstances", unsafe {
            f(dev, profile_id, handles.as_mut_ptr(), &mut count)
        })?;
        handles.truncate((count as usize).min(handles.len()));
        Ok(handles)
    }

    /// `nvmlDeviceGetGpuInstanceById`
    pub fn gpu_instance_by_id(&self, dev: nvmlDevice_t, id: u32) -> RawResult<nvmlGpuInstance_t> {
        let f = sym!(self.lib, nvmlDeviceGetGpuInstanceById);
        let mut gi: nvmlGpuInstance_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetGpuInstanceById", unsafe {
            f(dev, id, &mut gi)
        })?;
        Ok(gi)
    }

    /// `nvmlGpuInstanceGetInfo`
    pub fn gi_info(&self, gi: nvmlGpuInstance_t) -> RawResult<GiInfo> {
        let f = sym!(self.lib, nvmlGpuInstanceGetInfo);
        // SAFETY: plain-data struct; all-zero (null device pointer) is a valid value.
        let mut info: sys::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        check("nvmlGpuInstanceGetInfo", unsafe { f(gi, &mut info) })?;
        Ok(GiInfo {
            id: info.id,
            profile_id: info.profileId,
            start: info.placement.start,
            size: info.placement.size,
        })
    }

    /// `nvmlDeviceCreateGpuInstance` / `nvmlDeviceCreateGpuInstanceWithPlacement`.
    pub fn create_gpu_instance(
        &self,
        dev: nvmlDevice_t,
        profile_id: u32,
        placement: Option<(u32, u32)>,
    ) -> RawResult<nvmlGpuInstance_t> {
        let mut gi: nvmlGpuInstance_t = ptr::null_mut();
        match placement {
            Some((start, size)) => {
                let f = sym!(self.lib, nvmlDeviceCreateGpuInstanceWithPlacement);
                let p = sys::nvmlGpuInstancePlacement_t { start, size };
                // SAFETY: valid in- and out-pointers.
                check("nvmlDeviceCreateGpuInstanceWithPlacement", unsafe {
                    f(dev, profile_id, &p, &mut gi)
                })?;
            }
            None => {
                let f = sym!(self.lib, nvmlDeviceCreateGpuInstance);
                // SAFETY: valid out-pointer.
                check("nvmlDeviceCreateGpuInstance", unsafe {
                    f(dev, profile_id, &mut gi)
                })?;
            }
        }
        Ok(gi)
    }

    /// `nvmlGpuInstanceDestroy`
    pub fn destroy_gpu_instance(&self, gi: nvmlGpuInstance_t) -> RawResult<()> {
        let f = sym!(self.lib, nvmlGpuInstanceDestroy);
        // SAFETY: handle from this library.
        check("nvmlGpuInstanceDestroy", unsafe { f(gi) })
    }

    /// `nvmlGpuInstanceGetComputeInstanceProfileInfo` (shared engines): (ID, slices, max).
    pub fn ci_profile_info(
        &self,
        gi: nvmlGpuInstance_t,
        nvml_profile: u32,
    ) -> RawResult<(u32, u32, u32)> {
        let f = sym!(self.lib, nvmlGpuInstanceGetComputeInstanceProfileInfo);
        // SAFETY: plain-data struct; all-zero is a valid value.
        let mut info: sys::nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer to the v1 struct this function takes.
        check("nvmlGpuInstanceGetComputeInstanceProfileInfo", unsafe {
            f(
                gi,
                nvml_profile,
                sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut info,
            )
        })?;
        Ok((info.id, info.sliceCount, info.instanceCount))
    }

    /// `nvmlGpuInstanceGetComputeInstances` for one profile ID.
    pub fn compute_instances(
        &self,
        gi: nvmlGpuInstance_t,
        profile_id: u32,
        max: u32,
    ) -> RawResult<Vec<nvmlComputeInstance_t>> {
        let f = sym!(self.lib, nvmlGpuInstanceGetComputeInstances);
        let mut handles: Vec<nvmlComputeInstance_t> = vec![ptr::null_mut(); max.max(1) as usize];
        let mut count: c_uint = 0;
        // SAFETY: the array holds at least the profile's instance count.
        check("nvmlGpuInstanceGetComputeInstances", unsafe {
            f(gi, profile_id, handles.as_mut_ptr(), &mut count)
        })?;
        handles.truncate((count as usize).min(handles.len()));
        Ok(handles)
    }

    /// `nvmlGpuInstanceGetComputeInstanceById`
    pub fn compute_instance_by_id(
        &self,
        gi: nvmlGpuInstance_t,
        id: u32,
    ) -> RawResult<nvmlComputeInstance_t> {
        let f = sym!(self.lib, nvmlGpuInstanceGetComputeInstanceById);
        let mut ci: nvmlComputeInstance_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlGpuInstanceGetComputeInstanceById", unsafe {
            f(gi, id, &mut ci)
        })?;
        Ok(ci)
    }

    /// `nvmlComputeInstanceGetInfo_v2`
    pub fn ci_info(&self, ci: nvmlComputeInstance_t) -> RawResult<CiInfo> {
        let f = sym!(self.lib, nvmlComputeInstanceGetInfo_v2);
        // SAFETY: plain-data struct; all-zero (null pointers) is a valid value.
        let mut info: sys::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        check("nvmlComputeInstanceGetInfo_v2", unsafe { f(ci, &mut info) })?;
        Ok(CiInfo {
            id: info.id,
            profile_id: info.profileId,
            start: info.placement.start,
            size: info.placement.size,
        })
    }

    /// `nvmlGpuInstanceCreateComputeInstance`
    pub fn create_compute_instance(
        &self,
        gi: nvmlGpuInstance_t,
        profile_id: u32,
    ) -> RawResult<nvmlComputeInstance_t> {
        let f = sym!(self.lib, nvmlGpuInstanceCreateComputeInstance);
        let mut ci: nvmlComputeInstance_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlGpuInstanceCreateComputeInstance", unsafe {
            f(gi, profile_id, &mut ci)
        })?;
        Ok(ci)
    }

    /// `nvmlComputeInstanceDestroy`
    pub fn destroy_compute_instance(&self, ci: nvmlComputeInstance_t) -> RawResult<()> {
        let f = sym!(self.lib, nvmlComputeInstanceDestroy);
        // SAFETY: handle from this library.
        check("nvmlComputeInstanceDestroy", unsafe { f(ci) })
    }

    /// `nvmlDeviceGetMaxMigDeviceCount`
    pub fn max_mig_devices(&self, dev: nvmlDevice_t) -> RawResult<u32> {
        let f = sym!(self.lib, nvmlDeviceGetMaxMigDeviceCount);
        let mut count: c_uint = 0;
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetMaxMigDeviceCount", unsafe {
            f(dev, &mut count)
        })?;
        Ok(count)
    }

    /// `nvmlDeviceGetMigDeviceHandleByIndex`
    pub fn mig_device_by_index(&self, dev: nvmlDevice_t, index: u32) -> RawResult<nvmlDevice_t> {
        let f = sym!(self.lib, nvmlDeviceGetMigDeviceHandleByIndex);
        let mut mig: nvmlDevice_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetMigDeviceHandleByIndex", unsafe {
            f(dev, index, &mut mig)
        })?;
        Ok(mig)
    }

    /// `nvmlDeviceGetGpuInstanceId` and `nvmlDeviceGetComputeInstanceId` of a MIG device.
    pub fn mig_device_ids(&self, mig: nvmlDevice_t) -> RawResult<(u32, u32)> {
        let fg = sym!(self.lib, nvmlDeviceGetGpuInstanceId);
        let fc = sym!(self.lib, nvmlDeviceGetComputeInstanceId);
        let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
        // SAFETY: valid out-pointers.
        check("nvmlDeviceGetGpuInstanceId", unsafe { fg(mig, &mut gi) })?;
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetComputeInstanceId", unsafe {
            fc(mig, &mut ci)
        })?;
        Ok((gi, ci))
    }

    /// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`
    pub fn parent_of_mig_device(&self, mig: nvmlDevice_t) -> RawResult<nvmlDevice_t> {
        let f = sym!(self.lib, nvmlDeviceGetDeviceHandleFromMigDeviceHandle);
        let mut parent: nvmlDevice_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", unsafe {
            f(mig, &mut parent)
        })?;
        Ok(parent)
    }

    /// `nvmlDeviceGetSupportedEventTypes`
    pub fn supported_event_types(&self, dev: nvmlDevice_t) -> RawResult<u64> {
        let f = sym!(self.lib, nvmlDeviceGetSupportedEventTypes);
        let mut types: std::ffi::c_ulonglong = 0;
        // SAFETY: valid out-pointer.
        check("nvmlDeviceGetSupportedEventTypes", unsafe {
            f(dev, &mut types)
        })?;
        Ok(types)
    }

    /// `nvmlEventSetCreate`
    pub fn event_set_create(&self) -> RawResult<sys::nvmlEventSet_t> {
        let f = sym!(self.lib, nvmlEventSetCreate);
        let mut set: sys::nvmlEventSet_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlEventSetCreate", unsafe { f(&mut set) })?;
        Ok(set)
    }

    /// `nvmlDeviceRegisterEvents`
    pub fn register_events(
        &self,
        dev: nvmlDevice_t,
        types: u64,
        set: sys::nvmlEventSet_t,
    ) -> RawResult<()> {
        let f = sym!(self.lib, nvmlDeviceRegisterEvents);
        // SAFETY: handles from this library.
        check("nvmlDeviceRegisterEvents", unsafe { f(dev, types, set) })
    }

    /// `nvmlEventSetWait_v2`: `Ok(None)` on timeout.
    pub fn event_wait(
        &self,
        set: sys::nvmlEventSet_t,
        timeout_ms: u32,
    ) -> RawResult<Option<RawEvent>> {
        let f = sym!(self.lib, nvmlEventSetWait_v2);
        // SAFETY: plain-data struct; all-zero is a valid value.
        let mut data: sys::nvmlEventData_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; set from this library.
        let ret = unsafe { f(set, &mut data, timeout_ms) };
        if ret == sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT {
            return Ok(None);
        }
        check("nvmlEventSetWait_v2", ret)?;
        Ok(Some(RawEvent {
            device: data.device,
            event_type: data.eventType,
            data: data.eventData,
            gpu_instance: data.gpuInstanceId,
            compute_instance: data.computeInstanceId,
        }))
    }

    /// `nvmlEventSetFree`
    pub fn event_set_free(&self, set: sys::nvmlEventSet_t) -> RawResult<()> {
        let f = sym!(self.lib, nvmlEventSetFree);
        // SAFETY: set from this library, freed once (the caller owns it).
        check("nvmlEventSetFree", unsafe { f(set) })
    }

    /// `nvmlGpmQueryDeviceSupport`: whether the GPU offers GPM metrics (Hopper and newer).
    pub fn gpm_supported(&self, dev: nvmlDevice_t) -> RawResult<bool> {
        let f = sym!(self.lib, nvmlGpmQueryDeviceSupport);
        let mut support = sys::nvmlGpmSupport_t {
            version: sys::NVML_GPM_SUPPORT_VERSION,
            isSupportedDevice: 0,
        };
        // SAFETY: valid pointer to a versioned struct.
        check("nvmlGpmQueryDeviceSupport", unsafe { f(dev, &mut support) })?;
        Ok(support.isSupportedDevice != 0)
    }

    /// `nvmlGpmSampleAlloc` + `nvmlGpmMigSampleGet`: a GPM sample of one GPU instance. The
    /// caller frees it with [`Raw::gpm_sample_free`].
    pub fn gpm_mig_sample(&self, dev: nvmlDevice_t, gi: u32) -> RawResult<sys::nvmlGpmSample_t> {
        let alloc = sym!(self.lib, nvmlGpmSampleAlloc);
        let get = sym!(self.lib, nvmlGpmMigSampleGet);
        let mut sample: sys::nvmlGpmSample_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nvmlGpmSampleAlloc", unsafe { alloc(&mut sample) })?;
        // SAFETY: sample allocated by this library just above.
        if let Err(e) = check("nvmlGpmMigSampleGet", unsafe { get(dev, gi, sample) }) {
            let _ = self.gpm_sample_free(sample);
            return Err(e);
        }
        Ok(sample)
    }

    /// `nvmlGpmSampleFree`
    pub fn gpm_sample_free(&self, sample: sys::nvmlGpmSample_t) -> RawResult<()> {
        let f = sym!(self.lib, nvmlGpmSampleFree);
        // SAFETY: sample from nvmlGpmSampleAlloc, freed once by its owner.
        check("nvmlGpmSampleFree", unsafe { f(sample) })
    }

    /// `nvmlGpmMetricsGet` for SM and DRAM-bandwidth utilization (percent) between two samples.
    pub fn gpm_utilization(
        &self,
        first: sys::nvmlGpmSample_t,
        second: sys::nvmlGpmSample_t,
    ) -> RawResult<(f64, f64)> {
        let f = sym!(self.lib, nvmlGpmMetricsGet);
        // SAFETY: plain-data struct (null pointers and zeros are valid).
        let mut get: sys::nvmlGpmMetricsGet_t = unsafe { std::mem::zeroed() };
        get.version = sys::NVML_GPM_METRICS_GET_VERSION;
        get.numMetrics = 2;
        get.sample1 = first;
        get.sample2 = second;
        get.metrics[0].metricId = sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL;
        get.metrics[1].metricId = sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_DRAM_BW_UTIL;
        // SAFETY: valid pointer; NVML writes only the first `numMetrics` entries.
        check("nvmlGpmMetricsGet", unsafe { f(&mut get) })?;
        for m in &get.metrics[..2] {
            check("nvmlGpmMetricsGet", m.nvmlReturn)?;
        }
        Ok((get.metrics[0].value, get.metrics[1].value))
    }
}
