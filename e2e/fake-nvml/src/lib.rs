//! A fake `libnvidia-ml.so` for GPU-less CI.
//!
//! It exports the NVML C functions gpupool's `NvmlBackend` calls (through nvml-wrapper and its
//! raw layer), with NVML's signatures, return codes and struct layouts (taken from
//! nvml-wrapper-sys's generated `nvml.h` bindings), and answers them from a simulator fixture:
//! the same format and the same state machine as `SimBackend` (both use the `gpupool-sim`
//! crate), so the two backends cannot disagree by construction of the data, only by the FFI
//! and mapping code in between — which is what the conformance suite tests.
//!
//! - `GPUPOOL_FAKE_NVML_FIXTURE`: the fixture (YAML). Without it `nvmlInit` fails with
//!   `NVML_ERROR_DRIVER_NOT_LOADED`, as on a node without a driver.
//! - `GPUPOOL_FAKE_NVML_STATE`: the state file (JSON); default `<fixture>.state.json`. MIG mode,
//!   GPU/compute instances, injected faults and a pinned clock live there, so a layout survives
//!   an agent restart and every process using the fixture sees the same GPUs.
//! - `GPUPOOL_FAKE_NVML_DEV_DIR`: where the device nodes are, default `/dev`. As the driver
//!   does, the library enumerates only the GPUs whose `nvidia<minor>` node the process sees
//!   there (a character device, unless the fixture's `device_nodes` says `files` or
//!   `ignored`), decided at `nvmlInit`: indices are dense over those GPUs, and a UUID or bus ID
//!   of another GPU, or of a MIG device on one, is not found.
//! - The fixture's `pid_namespace`: as the driver lists only processes whose PID the caller
//!   sees, a caller outside that PID namespace gets no processes (unset: every caller does).
//!
//! nvml-wrapper-sys looks every symbol up when the library is loaded and keeps the missing ones
//! as errors, so loading succeeds with this subset; a function we lack fails when called.
//! Calls we do not model return `NVML_ERROR_NOT_SUPPORTED`. No panic crosses the FFI boundary:
//! every export runs under `catch_unwind` and turns a panic into `NVML_ERROR_UNKNOWN`.

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpupool_sim::{
    EventKey, Node, SimError, SimGpu, SimHealth, SimMigDevice, SimState, StateCache, StateFile,
    arch,
};
use nvml_wrapper_sys::bindings as sys;
use sys::{nvmlComputeInstance_t, nvmlDevice_t, nvmlEventSet_t, nvmlGpuInstance_t, nvmlReturn_t};

type R<T = ()> = Result<T, nvmlReturn_t>;

const SUCCESS: nvmlReturn_t = sys::nvmlReturn_enum_NVML_SUCCESS;
const UNINITIALIZED: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID_ARGUMENT: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const DRIVER_NOT_LOADED: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
const TIMEOUT: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const RESET_REQUIRED: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
const IN_USE: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_IN_USE;
const INSUFFICIENT_RESOURCES: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
const ARGUMENT_VERSION_MISMATCH: nvmlReturn_t =
    sys::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
const UNKNOWN: nvmlReturn_t = sys::nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// `NVML_VALUE_NOT_AVAILABLE` for instance IDs of non-MIG processes and events.
const NO_ID: c_uint = 0xFFFF_FFFF;

fn code(e: &SimError) -> nvmlReturn_t {
    match e {
        SimError::InvalidArgument(_) => INVALID_ARGUMENT,
        SimError::NotSupported(_) => NOT_SUPPORTED,
        SimError::NotFound(_) => NOT_FOUND,
        SimError::InsufficientResources(_) => INSUFFICIENT_RESOURCES,
        SimError::InUse(_) => IN_USE,
        SimError::GpuIsLost(_) => GPU_IS_LOST,
        SimError::ResetRequired(_) => RESET_REQUIRED,
        SimError::Fixture(m) => {
            eprintln!("fake libnvidia-ml: {m}");
            UNKNOWN
        }
    }
}

fn sim<T>(r: Result<T, SimError>) -> R<T> {
    r.map_err(|e| code(&e))
}

// ---------------------------------------------------------------------------------------------
// Library context
// ---------------------------------------------------------------------------------------------

struct Ctx {
    node: Node,
    /// Fixture indices of the GPUs this process sees, in NVML index order.
    visible: Vec<u32>,
    /// Whether this process is in the fixture's PID namespace, so its processes are listed.
    sees_processes: bool,
    state: StateFile,
    /// The last state this process parsed: calls on an unchanged state (all of them but the
    /// first after a change) read the file but do not parse it, as a driver answers from what
    /// it holds.
    cache: StateCache,
    start: Instant,
}

struct Global {
    ctx: Option<Arc<Ctx>>,
    refcount: u32,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    ctx: None,
    refcount: 0,
});

fn global() -> MutexGuard<'static, Global> {
    GLOBAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn ctx() -> R<Arc<Ctx>> {
    global().ctx.clone().ok_or(UNINITIALIZED)
}

impl Ctx {
    /// The NVML index of fixture GPU `gpu`, if this process sees it.
    fn nvml_index(&self, gpu: u32) -> Option<u32> {
        self.visible
            .iter()
            .position(|&g| g == gpu)
            .map(|i| i as u32)
    }

    fn read(&self) -> R<(Arc<SimState>, f64)> {
        let state = sim(self.state.read_cached(&self.node, &self.cache))?;
        let now = state
            .clock_s
            .unwrap_or_else(|| self.start.elapsed().as_secs_f64());
        Ok((state, now))
    }

    fn update<T>(&self, f: impl FnOnce(&mut SimState, &Node, f64) -> Result<T, SimError>) -> R<T> {
        let start = self.start;
        sim(self.state.update(&self.node, |state| {
            let now = state
                .clock_s
                .unwrap_or_else(|| start.elapsed().as_secs_f64());
            f(state, &self.node, now)
        }))
    }
}

/// Whether the calling process runs in PID namespace `owner` (`pid:[inode]`), where the
/// fixture's processes live. The driver lists only processes whose PID the caller can see; the
/// fake does not model an ancestor namespace seeing a child's processes, so any other namespace
/// sees none. No `owner`: every caller sees them.
fn in_pid_namespace(owner: Option<&str>) -> bool {
    let Some(owner) = owner else {
        return true;
    };
    match std::fs::read_link("/proc/self/ns/pid") {
        Ok(own) => own.as_os_str() == owner,
        Err(e) => {
            eprintln!("fake libnvidia-ml: reading /proc/self/ns/pid: {e}; listing no processes");
            false
        }
    }
}

fn init() -> R {
    let mut g = global();
    if g.ctx.is_some() {
        g.refcount += 1;
        return Ok(());
    }
    let Some(fixture) = std::env::var_os("GPUPOOL_FAKE_NVML_FIXTURE").map(PathBuf::from) else {
        eprintln!("fake libnvidia-ml: GPUPOOL_FAKE_NVML_FIXTURE is not set");
        return Err(DRIVER_NOT_LOADED);
    };
    let node = Node::load(&fixture).map_err(|e| {
        eprintln!("fake libnvidia-ml: {e}");
        DRIVER_NOT_LOADED
    })?;
    let state = match std::env::var_os("GPUPOOL_FAKE_NVML_STATE") {
        Some(p) => StateFile::at(PathBuf::from(p)),
        None => StateFile::for_fixture(&fixture),
    };
    // Fail init, not a later call, when the state file is unusable.
    state.read(&node).map_err(|e| {
        eprintln!("fake libnvidia-ml: {e}");
        DRIVER_NOT_LOADED
    })?;
    let dev_dir = std::env::var_os("GPUPOOL_FAKE_NVML_DEV_DIR")
        .map_or_else(|| PathBuf::from("/dev"), PathBuf::from);
    let visible = node.visible_gpus(&dev_dir);
    let sees_processes = in_pid_namespace(node.fixture.pid_namespace.as_deref());
    g.ctx = Some(Arc::new(Ctx {
        node,
        visible,
        sees_processes,
        state,
        cache: StateCache::default(),
        start: Instant::now(),
    }));
    g.refcount = 1;
    Ok(())
}

/// Runs an export's body; a panic becomes `NVML_ERROR_UNKNOWN` instead of unwinding into C.
fn guard(body: impl FnOnce() -> R) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// Writes through an out-pointer the caller passed; NULL is an invalid argument, as in NVML.
fn out<T>(p: *mut T, value: T) -> R {
    if p.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: NVML's contract: a non-NULL out-pointer points to writable storage for one T.
    unsafe { p.write(value) };
    Ok(())
}

/// Copies a string into a caller's `char` buffer of `len` bytes, NUL-terminated.
fn out_str(buf: *mut c_char, len: c_uint, s: &str) -> R {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller's buffer holds `len` bytes and we write at most `bytes.len() + 1`.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

fn fill_c(dst: &mut [c_char], s: &str) {
    let room = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

// ---------------------------------------------------------------------------------------------
// Handles: small integers tagged in the high bits; never dereferenced.
// ---------------------------------------------------------------------------------------------

const TAG_GPU: usize = 0x1 << 28;
const TAG_MIG: usize = 0x2 << 28;
const TAG_GI: usize = 0x3 << 28;
const TAG_CI: usize = 0x4 << 28;
const TAG_MASK: usize = 0xF << 28;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dev {
    Gpu(u32),
    Mig { gpu: u32, gi: u32, ci: u32 },
}

fn gpu_handle(gpu: u32) -> nvmlDevice_t {
    (TAG_GPU | gpu as usize) as nvmlDevice_t
}

fn mig_handle(gpu: u32, gi: u32, ci: u32) -> nvmlDevice_t {
    (TAG_MIG | (gpu as usize) << 16 | (gi as usize) << 8 | ci as usize) as nvmlDevice_t
}

fn gi_handle(gpu: u32, gi: u32) -> nvmlGpuInstance_t {
    (TAG_GI | (gpu as usize) << 16 | (gi as usize) << 8) as nvmlGpuInstance_t
}

fn ci_handle(gpu: u32, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    (TAG_CI | (gpu as usize) << 16 | (gi as usize) << 8 | ci as usize) as nvmlComputeInstance_t
}

fn fields(v: usize) -> (u32, u32, u32) {
    (
        ((v >> 16) & 0xFFF) as u32,
        ((v >> 8) & 0xFF) as u32,
        (v & 0xFF) as u32,
    )
}

fn dev(c: &Ctx, h: nvmlDevice_t) -> R<Dev> {
    let v = h as usize;
    match v & TAG_MASK {
        TAG_GPU => {
            let gpu = (v & !TAG_MASK) as u32;
            c.nvml_index(gpu).ok_or(INVALID_ARGUMENT)?;
            Ok(Dev::Gpu(gpu))
        }
        TAG_MIG => {
            let (gpu, gi, ci) = fields(v);
            c.nvml_index(gpu).ok_or(INVALID_ARGUMENT)?;
            Ok(Dev::Mig { gpu, gi, ci })
        }
        _ => Err(INVALID_ARGUMENT),
    }
}

fn gpu_of(c: &Ctx, h: nvmlDevice_t) -> R<u32> {
    match dev(c, h)? {
        Dev::Gpu(g) => Ok(g),
        Dev::Mig { .. } => Err(NOT_SUPPORTED),
    }
}

fn gi_of(h: nvmlGpuInstance_t) -> R<(u32, u32)> {
    let v = h as usize;
    if v & TAG_MASK != TAG_GI {
        return Err(INVALID_ARGUMENT);
    }
    let (gpu, gi, _) = fields(v);
    Ok((gpu, gi))
}

fn ci_of(h: nvmlComputeInstance_t) -> R<(u32, u32, u32)> {
    let v = h as usize;
    if v & TAG_MASK != TAG_CI {
        return Err(INVALID_ARGUMENT);
    }
    Ok(fields(v))
}

/// The MIG device behind a MIG handle, if it still exists.
fn mig_device(c: &Ctx, gpu: u32, gi: u32, ci: u32) -> R<SimMigDevice> {
    let (state, now) = c.read()?;
    sim(state.mig_devices(&c.node, gpu, now))?
        .into_iter()
        .find(|d| d.gi == gi && d.ci == ci)
        .ok_or(INVALID_ARGUMENT)
}

/// A MIG device's attributes from its GPU-instance profile and compute-instance size. Whole
/// GPUs answer NOT_SUPPORTED (the fake has no per-GPU engine counts).
fn device_attributes(
    c: &Ctx,
    device: nvmlDevice_t,
    attributes: *mut sys::nvmlDeviceAttributes_t,
) -> R {
    match dev(c, device)? {
        Dev::Mig { gpu, gi, ci } => {
            let d = mig_device(c, gpu, gi, ci)?;
            let p = d.profile;
            out(
                attributes,
                sys::nvmlDeviceAttributes_t {
                    multiprocessorCount: p.multiprocessors * d.ci_slices / p.compute_slices.max(1),
                    sharedCopyEngineCount: 0,
                    sharedDecoderCount: 0,
                    sharedEncoderCount: 0,
                    sharedJpegCount: 0,
                    sharedOfaCount: 0,
                    gpuInstanceSliceCount: p.compute_slices,
                    computeInstanceSliceCount: d.ci_slices,
                    memorySizeMB: p.memory_mib,
                },
            )
        }
        Dev::Gpu(_) => Err(NOT_SUPPORTED),
    }
}

// ---------------------------------------------------------------------------------------------
// Exports
// ---------------------------------------------------------------------------------------------

macro_rules! export {
    ($(fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> nvmlReturn_t {
            guard(move || $body)
        }
    )*};
}

/// Functions NvmlBackend does not use but callers commonly probe; answered "not supported".
macro_rules! not_supported {
    ($($name:ident),* $(,)?) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name() -> nvmlReturn_t {
            NOT_SUPPORTED
        }
    )*};
}

not_supported!(
    nvmlDeviceGetPowerUsage,
    nvmlDeviceGetSerial,
    nvmlDeviceGetVbiosVersion,
    nvmlDeviceGetBoardPartNumber,
    nvmlDeviceGetBrand,
    nvmlDeviceGetFieldValues,
    nvmlDeviceGetNvLinkState,
    nvmlDeviceGetMPSComputeRunningProcesses_v3,
    nvmlDeviceGetGraphicsRunningProcesses_v3,
);

static ERROR_STRINGS: &[(nvmlReturn_t, &str)] = &[
    (SUCCESS, "Success\0"),
    (UNINITIALIZED, "Uninitialized\0"),
    (INVALID_ARGUMENT, "Invalid Argument\0"),
    (NOT_SUPPORTED, "Not Supported\0"),
    (NOT_FOUND, "Not Found\0"),
    (INSUFFICIENT_SIZE, "Insufficient Size\0"),
    (DRIVER_NOT_LOADED, "Driver Not Loaded\0"),
    (TIMEOUT, "Timeout\0"),
    (GPU_IS_LOST, "GPU is lost\0"),
    (RESET_REQUIRED, "GPU requires reset\0"),
    (IN_USE, "In use by another client\0"),
    (INSUFFICIENT_RESOURCES, "Insufficient resources\0"),
    (ARGUMENT_VERSION_MISMATCH, "Argument version mismatch\0"),
];

/// `const char* nvmlErrorString(nvmlReturn_t result)`
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    ERROR_STRINGS
        .iter()
        .find(|(c, _)| *c == result)
        .map(|(_, s)| *s)
        .unwrap_or("Unknown Error\0")
        .as_ptr()
        .cast()
}

export! {
    fn nvmlInit_v2() { init() }

    fn nvmlInitWithFlags(_flags: c_uint) { init() }

    fn nvmlShutdown() {
        let mut g = global();
        if g.ctx.is_none() {
            return Err(UNINITIALIZED);
        }
        g.refcount = g.refcount.saturating_sub(1);
        if g.refcount == 0 {
            g.ctx = None;
        }
        Ok(())
    }

    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) {
        out_str(version, length, &ctx()?.node.fixture.driver.version)
    }

    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) {
        // NVML's own version is "<CUDA major>.<driver version>", e.g. "12.550.54.15".
        let c = ctx()?;
        let d = &c.node.fixture.driver;
        let cuda_major = d.cuda.split('.').next().unwrap_or("0");
        out_str(version, length, &format!("{cuda_major}.{}", d.version))
    }

    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) {
        let c = ctx()?;
        let cuda = &c.node.fixture.driver.cuda;
        let (major, minor) = cuda.split_once('.').ok_or(UNKNOWN)?;
        let major: c_int = major.trim().parse().map_err(|_| UNKNOWN)?;
        let minor: c_int = minor.trim().parse().map_err(|_| UNKNOWN)?;
        out(version, major * 1000 + minor * 10)
    }

    fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) {
        // SAFETY: same contract as the _v2 function.
        match unsafe { nvmlSystemGetCudaDriverVersion_v2(version) } {
            SUCCESS => Ok(()),
            e => Err(e),
        }
    }

    fn nvmlDeviceGetCount_v2(count: *mut c_uint) {
        out(count, ctx()?.visible.len() as c_uint)
    }

    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) {
        let c = ctx()?;
        let gpu = c.visible.get(index as usize).ok_or(INVALID_ARGUMENT)?;
        out(device, gpu_handle(*gpu))
    }

    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) {
        let c = ctx()?;
        if uuid.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: NVML takes a NUL-terminated string.
        let uuid = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy().into_owned();
        if let Ok(g) = c.node.gpu_by_uuid(&uuid) {
            c.nvml_index(g.index).ok_or(NOT_FOUND)?;
            return out(device, gpu_handle(g.index));
        }
        let (state, now) = c.read()?;
        // A MIG device is visible with its parent.
        for &g in &c.visible {
            if let Ok(devs) = state.mig_devices(&c.node, g, now)
                && let Some(d) = devs.into_iter().find(|d| d.uuid == uuid)
            {
                return out(device, mig_handle(d.gpu, d.gi, d.ci));
            }
        }
        Err(NOT_FOUND)
    }

    fn nvmlDeviceGetHandleByPciBusId_v2(bus_id: *const c_char, device: *mut nvmlDevice_t) {
        let c = ctx()?;
        if bus_id.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: NVML takes a NUL-terminated string.
        let bus = unsafe { std::ffi::CStr::from_ptr(bus_id) }.to_string_lossy().to_ascii_uppercase();
        let g = c
            .node
            .gpus
            .iter()
            .find(|g| g.pci_bus_id.to_ascii_uppercase().ends_with(bus.trim_start_matches('0')))
            .filter(|g| c.nvml_index(g.index).is_some())
            .ok_or(NOT_FOUND)?;
        out(device, gpu_handle(g.index))
    }

    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) {
        let c = ctx()?;
        let gpu = gpu_of(&c, device)?;
        out(index, c.nvml_index(gpu).ok_or(INVALID_ARGUMENT)?)
    }

    fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        out(minor, c.node.gpus[g as usize].minor)
    }

    fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) {
        let c = ctx()?;
        match dev(&c, device)? {
            Dev::Gpu(g) => out_str(uuid, length, &c.node.gpus[g as usize].uuid),
            Dev::Mig { gpu, gi, ci } => out_str(uuid, length, &mig_device(&c, gpu, gi, ci)?.uuid),
        }
    }

    fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) {
        let c = ctx()?;
        match dev(&c, device)? {
            Dev::Gpu(g) => out_str(name, length, c.node.gpus[g as usize].model.product_name),
            Dev::Mig { gpu, gi, ci } => {
                let d = mig_device(&c, gpu, gi, ci)?;
                let product = c.node.gpus[gpu as usize].model.product_name;
                out_str(name, length, &format!("{product} MIG {}", d.name()))
            }
        }
    }

    fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut sys::nvmlPciInfo_t) {
        let c = ctx()?;
        let g = &c.node.gpus[gpu_of(&c, device)? as usize];
        // "00000000:18:00.0" → domain, bus, device.
        let parse = |s: &str| u32::from_str_radix(s, 16).map_err(|_| UNKNOWN);
        let mut parts = g.pci_bus_id.split([':', '.']);
        let (domain, bus, device_no) = (
            parse(parts.next().unwrap_or("0"))?,
            parse(parts.next().unwrap_or("0"))?,
            parse(parts.next().unwrap_or("0"))?,
        );
        // SAFETY: plain-data struct; zero is valid.
        let mut info: sys::nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        info.domain = domain;
        info.bus = bus;
        info.device = device_no;
        info.pciDeviceId = g.model.pci_device_id;
        info.pciSubSystemId = 0x1658_10DE;
        fill_c(&mut info.busId, &g.pci_bus_id);
        fill_c(&mut info.busIdLegacy, &format!("{:04x}:{bus:02x}:{device_no:02x}.0", domain & 0xFFFF));
        out(pci, info)
    }

    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut sys::nvmlMemory_v2_t) {
        const V2: c_uint = (std::mem::size_of::<sys::nvmlMemory_v2_t>() | (2 << 24)) as c_uint;
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's struct; NVML reads `version` first.
        if unsafe { (*memory).version } != V2 {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let (total, used) = memory_mib(device)?;
        let mib = 1024 * 1024;
        let reserved = total.min(512);
        out(memory, sys::nvmlMemory_v2_t {
            version: V2,
            total: total * mib,
            reserved: reserved * mib,
            used: used * mib,
            free: total.saturating_sub(used + reserved) * mib,
        })
    }

    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut sys::nvmlMemory_t) {
        let (total, used) = memory_mib(device)?;
        let mib = 1024 * 1024;
        out(memory, sys::nvmlMemory_t {
            total: total * mib,
            used: used * mib,
            free: total.saturating_sub(used) * mib,
        })
    }

    fn nvmlDeviceGetCudaComputeCapability(device: nvmlDevice_t, major: *mut c_int, minor: *mut c_int) {
        let c = ctx()?;
        let g = match dev(&c, device)? {
            Dev::Gpu(g) | Dev::Mig { gpu: g, .. } => g,
        };
        let (ma, mi) = c.node.gpus[g as usize].model.compute_capability;
        out(major, ma as c_int)?;
        out(minor, mi as c_int)
    }

    fn nvmlDeviceGetArchitecture(device: nvmlDevice_t, arch: *mut sys::nvmlDeviceArchitecture_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        out(arch, c.node.gpus[g as usize].model.architecture)
    }

    fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        out(node, c.node.gpus[g as usize].numa_node)
    }

    fn nvmlDeviceGetTopologyCommonAncestor(a: nvmlDevice_t, b: nvmlDevice_t, level: *mut sys::nvmlGpuTopologyLevel_t) {
        let c = ctx()?;
        let (ga, gb) = (gpu_of(&c, a)?, gpu_of(&c, b)?);
        out(level, sim(c.node.topology_level(ga, gb))?)
    }

    fn nvmlDeviceGetP2PStatus(a: nvmlDevice_t, b: nvmlDevice_t, index: sys::nvmlGpuP2PCapsIndex_t, status: *mut sys::nvmlGpuP2PStatus_t) {
        let c = ctx()?;
        let (ga, gb) = (gpu_of(&c, a)?, gpu_of(&c, b)?);
        let ok = match index {
            sys::nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK => c.node.nvlink(ga, gb),
            _ => ga != gb,
        };
        out(status, if ok {
            sys::nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK
        } else {
            sys::nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED
        })
    }

    fn nvmlDeviceGetTotalEccErrors(device: nvmlDevice_t, error_type: sys::nvmlMemoryErrorType_t, _counter: sys::nvmlEccCounterType_t, count: *mut c_ulonglong) {
        let (h, g) = health(device)?;
        if !g.model.ecc {
            return Err(NOT_SUPPORTED);
        }
        out(count, match error_type {
            sys::nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED => h.ecc_uncorrected,
            sys::nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED => h.ecc_corrected,
            _ => return Err(INVALID_ARGUMENT),
        })
    }

    fn nvmlDeviceGetPcieReplayCounter(device: nvmlDevice_t, value: *mut c_uint) {
        let (h, _) = health(device)?;
        out(value, h.pcie_replay.min(u64::from(u32::MAX)) as c_uint)
    }

    fn nvmlDeviceGetRemappedRows(device: nvmlDevice_t, corr: *mut c_uint, unc: *mut c_uint, pending: *mut c_uint, failure: *mut c_uint) {
        let (h, g) = health(device)?;
        if !g.model.ecc || g.model.architecture < arch::AMPERE {
            return Err(NOT_SUPPORTED);
        }
        out(corr, 0)?;
        out(unc, h.retired.min(u64::from(u32::MAX)) as c_uint)?;
        out(pending, 0)?;
        out(failure, 0)
    }

    fn nvmlDeviceGetRetiredPages_v2(device: nvmlDevice_t, _cause: sys::nvmlPageRetirementCause_t, count: *mut c_uint, addresses: *mut c_ulonglong, timestamps: *mut c_ulonglong) {
        let (h, g) = health(device)?;
        if !g.model.ecc || g.model.architecture >= arch::AMPERE {
            return Err(NOT_SUPPORTED);
        }
        retired_pages(h.retired, count, addresses, timestamps)
    }

    fn nvmlDeviceGetRetiredPages(device: nvmlDevice_t, _cause: sys::nvmlPageRetirementCause_t, count: *mut c_uint, addresses: *mut c_ulonglong) {
        let (h, g) = health(device)?;
        if !g.model.ecc || g.model.architecture >= arch::AMPERE {
            return Err(NOT_SUPPORTED);
        }
        retired_pages(h.retired, count, addresses, std::ptr::null_mut())
    }

    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensor: sys::nvmlTemperatureSensors_t, temp: *mut c_uint) {
        let (h, _) = health(device)?;
        if sensor != sys::nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        out(temp, h.temperature_c)
    }

    fn nvmlDeviceGetPersistenceMode(device: nvmlDevice_t, mode: *mut sys::nvmlEnableState_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        let on = sim(state.persistence_mode(&c.node, g, now))?;
        out(mode, if on {
            sys::nvmlEnableState_enum_NVML_FEATURE_ENABLED
        } else {
            sys::nvmlEnableState_enum_NVML_FEATURE_DISABLED
        })
    }

    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, utilization: *mut sys::nvmlUtilization_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        if sim(state.mig_mode(&c.node, g, now)).is_ok_and(|(current, _)| current) {
            return Err(NOT_SUPPORTED);
        }
        let (gpu, memory) = sim(state.utilization(&c.node, g, now))?;
        out(utilization, sys::nvmlUtilization_t { gpu, memory })
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, infos: *mut sys::nvmlProcessInfo_t) {
        let c = ctx()?;
        let (g, only) = match dev(&c, device)? {
            Dev::Gpu(g) => (g, None),
            Dev::Mig { gpu, gi, ci } => (gpu, Some((gi, ci))),
        };
        let (state, now) = c.read()?;
        let procs: Vec<_> = sim(state.processes(&c.node, g, now))?
            .into_iter()
            // The driver lists only processes whose PID the caller's namespace holds.
            .filter(|_| c.sees_processes)
            .filter(|p| only.is_none_or(|(gi, ci)| p.gpu_instance == Some(gi) && p.compute_instance == Some(ci)))
            .collect();
        if count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null in/out count pointer.
        let capacity = unsafe { *count } as usize;
        out(count, procs.len() as c_uint)?;
        if procs.len() > capacity || (infos.is_null() && !procs.is_empty()) {
            return Err(INSUFFICIENT_SIZE);
        }
        for (i, p) in procs.iter().enumerate() {
            let info = sys::nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p.used_memory_mib * 1024 * 1024,
                gpuInstanceId: p.gpu_instance.unwrap_or(NO_ID),
                computeInstanceId: p.compute_instance.unwrap_or(NO_ID),
            };
            // SAFETY: the caller's array holds `capacity` >= procs.len() entries.
            out(unsafe { infos.add(i) }, info)?;
        }
        Ok(())
    }

    // Per-process samples: one per process of the GPU whose fixture gives it a non-zero
    // `sm_util`, stamped now (CPU microseconds), when now is after `last_seen`. With a null
    // array the count is set and, when there are samples, `INSUFFICIENT_SIZE` returned.
    fn nvmlDeviceGetProcessUtilization(device: nvmlDevice_t, utilization: *mut sys::nvmlProcessUtilizationSample_t, count: *mut c_uint, last_seen: c_ulonglong) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        if sim(state.mig_mode(&c.node, g, now)).is_ok_and(|(current, _)| current) {
            return Err(NOT_SUPPORTED);
        }
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let samples: Vec<_> = sim(state.processes(&c.node, g, now))?
            .into_iter()
            .filter(|_| c.sees_processes && stamp > last_seen)
            .filter(|p| p.sm_util > 0)
            .collect();
        if count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null in/out count pointer.
        let capacity = unsafe { *count } as usize;
        out(count, samples.len() as c_uint)?;
        if samples.is_empty() {
            return Ok(());
        }
        if utilization.is_null() || samples.len() > capacity {
            return Err(INSUFFICIENT_SIZE);
        }
        for (i, p) in samples.iter().enumerate() {
            let sample = sys::nvmlProcessUtilizationSample_t {
                pid: p.pid,
                timeStamp: stamp,
                smUtil: p.sm_util,
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            };
            // SAFETY: the caller's array holds `capacity` >= samples.len() entries.
            out(unsafe { utilization.add(i) }, sample)?;
        }
        Ok(())
    }

    // --- events ---

    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, types: *mut c_ulonglong) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, _) = c.read()?;
        out(types, sim(state.supported_event_types(&c.node, g))?)
    }

    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) {
        ctx()?;
        let boxed = Box::new(EventSet::default());
        let ptr = Box::into_raw(boxed);
        live_sets().insert(ptr as usize);
        out(set, ptr.cast())
    }

    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, _) = c.read()?;
        let supported = sim(state.supported_event_types(&c.node, g))?;
        if types & !supported != 0 {
            return Err(NOT_SUPPORTED);
        }
        with_set(set, |s| {
            *s.lock().registered.entry(g).or_default() |= types;
            Ok(())
        })
    }

    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut sys::nvmlEventData_t, timeout_ms: c_uint) {
        let c = ctx()?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        // The set's watch lives as long as the set: it was watching before the first read
        // below, so a write after any read wakes the wait; and closing an inotify instance
        // waits for an RCU grace period (milliseconds), too long to pay on every call. A wait
        // that does not wait needs none.
        let watch = match timeout_ms {
            0 => None,
            _ => with_set(set, |s| {
                Ok(s.watch
                    .get_or_init(|| StateWatch::new(c.state.path()).map(Arc::new))
                    .clone())
            })?,
        };
        loop {
            // What was queued before this read is seen by it.
            if let Some(w) = &watch {
                w.drain_names_file();
            }
            let (state, now) = c.read()?;
            let next = with_set(set, |s| {
                let mut inner = s.lock();
                let found = state.events(&c.node, now).into_iter().find(|e| {
                    !inner.delivered.contains(&e.key)
                        && inner.registered.get(&e.gpu).is_some_and(|t| t & e.event_type != 0)
                });
                if let Some(e) = found {
                    inner.delivered.insert(e.key);
                }
                Ok(found)
            })?;
            if let Some(e) = next {
                return out(data, sys::nvmlEventData_t {
                    device: gpu_handle(e.gpu),
                    eventType: e.event_type,
                    eventData: e.data,
                    gpuInstanceId: e.gpu_instance,
                    computeInstanceId: e.compute_instance,
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TIMEOUT);
            }
            // Faults injected by another process arrive through the state file; scripted ones,
            // and injected ones dated later, fall due as a running clock passes them.
            let due = match state.clock_s {
                Some(_) => None,
                None => state
                    .next_fault_after(&c.node, now)
                    .map(|at| Duration::from_secs_f64((at - now).max(0.0))),
            };
            let wait = due.map_or(left, |d| d.min(left));
            match &watch {
                Some(w) => w.wait(wait),
                None => std::thread::sleep(wait.min(FALLBACK_POLL)),
            }
        }
    }

    fn nvmlEventSetFree(set: nvmlEventSet_t) {
        if !live_sets().remove(&(set as usize)) {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: the pointer came from Box::into_raw in nvmlEventSetCreate and was live.
        drop(unsafe { Box::from_raw(set.cast::<EventSet>()) });
        Ok(())
    }

    // --- MIG mode ---

    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        let (cur, pen) = sim(state.mig_mode(&c.node, g, now))?;
        out(current, c_uint::from(cur))?;
        out(pending, c_uint::from(pen))
    }

    fn nvmlDeviceSetMigMode(device: nvmlDevice_t, mode: c_uint, activation: *mut nvmlReturn_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let enabled = match mode {
            sys::NVML_DEVICE_MIG_ENABLE => true,
            sys::NVML_DEVICE_MIG_DISABLE => false,
            _ => return Err(INVALID_ARGUMENT),
        };
        let pending = c.update(|s, n, now| s.set_mig_mode(n, g, enabled, now))?;
        out(activation, pending.map(|e| code(&e)).unwrap_or(SUCCESS))
    }

    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let model = c.node.gpus[g as usize].model;
        if model.mig_catalog.is_none() {
            return Err(NOT_SUPPORTED);
        }
        out(count, model.max_mig_devices)
    }

    fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, index: c_uint, mig: *mut nvmlDevice_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        if index >= c.node.gpus[g as usize].model.max_mig_devices {
            return Err(INVALID_ARGUMENT);
        }
        let (state, now) = c.read()?;
        let devices = match state.mig_devices(&c.node, g, now) {
            Ok(devices) => devices,
            // A MIG-capable GPU with MIG mode off has no MIG device at any index: NVML answers
            // NOT_FOUND, which go-nvlib (nvidia-ctk, NVIDIA's device plugin) relies on when it
            // walks every MIG-capable GPU.
            Err(SimError::NotSupported(_))
                if state.mig_mode(&c.node, g, now).is_ok_and(|(current, _)| !current) =>
            {
                return Err(NOT_FOUND);
            }
            Err(e) => return Err(code(&e)),
        };
        let d = devices.get(index as usize).ok_or(NOT_FOUND)?;
        out(mig, mig_handle(d.gpu, d.gi, d.ci))
    }

    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, is_mig: *mut c_uint) {
        let c = ctx()?;
        out(is_mig, c_uint::from(matches!(dev(&c, device)?, Dev::Mig { .. })))
    }

    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig: nvmlDevice_t, device: *mut nvmlDevice_t) {
        let c = ctx()?;
        match dev(&c, mig)? {
            Dev::Mig { gpu, .. } => out(device, gpu_handle(gpu)),
            Dev::Gpu(_) => Err(INVALID_ARGUMENT),
        }
    }

    // go-nvml resolves GetAttributes to `_v2` when the library has it, else to the unversioned
    // name; go-nvlib reads a MIG device's profile from it (nvidia-ctk, NVIDIA's plugin).
    fn nvmlDeviceGetAttributes_v2(device: nvmlDevice_t, attributes: *mut sys::nvmlDeviceAttributes_t) {
        let c = ctx()?;
        device_attributes(&c, device, attributes)
    }

    fn nvmlDeviceGetAttributes(device: nvmlDevice_t, attributes: *mut sys::nvmlDeviceAttributes_t) {
        let c = ctx()?;
        device_attributes(&c, device, attributes)
    }

    fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) {
        let c = ctx()?;
        match dev(&c, device)? {
            Dev::Mig { gpu, gi, ci } => {
                mig_device(&c, gpu, gi, ci)?;
                out(id, gi)
            }
            Dev::Gpu(_) => Err(INVALID_ARGUMENT),
        }
    }

    fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, id: *mut c_uint) {
        let c = ctx()?;
        match dev(&c, device)? {
            Dev::Mig { gpu, gi, ci } => {
                mig_device(&c, gpu, gi, ci)?;
                out(id, ci)
            }
            Dev::Gpu(_) => Err(INVALID_ARGUMENT),
        }
    }

    // --- GPU instances ---

    fn nvmlDeviceGetGpuInstanceProfileInfo(device: nvmlDevice_t, profile: c_uint, info: *mut sys::nvmlGpuInstanceProfileInfo_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        let p = sim(state.gi_profile_by_enum(&c.node, g, profile, now))?;
        out(info, sys::nvmlGpuInstanceProfileInfo_t {
            id: p.profile_id,
            isP2pSupported: 0,
            sliceCount: p.compute_slices,
            instanceCount: p.max_instances,
            multiprocessorCount: p.multiprocessors,
            copyEngineCount: 0,
            decoderCount: 0,
            encoderCount: 0,
            jpegCount: 0,
            ofaCount: 0,
            memorySizeMB: p.memory_mib,
        })
    }

    fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(device: nvmlDevice_t, profile_id: c_uint, placements: *mut sys::nvmlGpuInstancePlacement_t, count: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        let all = sim(state.gi_possible_placements(&c.node, g, profile_id, now))?;
        if count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        if placements.is_null() {
            return out(count, all.len() as c_uint);
        }
        // SAFETY: non-null in/out count.
        let capacity = unsafe { *count } as usize;
        out(count, all.len() as c_uint)?;
        if all.len() > capacity {
            return Err(INSUFFICIENT_SIZE);
        }
        for (i, &(start, size)) in all.iter().enumerate() {
            // SAFETY: the caller's array holds `capacity` entries.
            out(unsafe { placements.add(i) }, sys::nvmlGpuInstancePlacement_t { start, size })?;
        }
        Ok(())
    }

    fn nvmlDeviceGetGpuInstanceRemainingCapacity(device: nvmlDevice_t, profile_id: c_uint, count: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        out(count, sim(state.gi_remaining_capacity(&c.node, g, profile_id, now))?)
    }

    fn nvmlDeviceCreateGpuInstance(device: nvmlDevice_t, profile_id: c_uint, gi: *mut nvmlGpuInstance_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let id = c.update(|s, n, now| s.create_gpu_instance(n, g, profile_id, None, now))?;
        out(gi, gi_handle(g, id))
    }

    fn nvmlDeviceCreateGpuInstanceWithPlacement(device: nvmlDevice_t, profile_id: c_uint, placement: *const sys::nvmlGpuInstancePlacement_t, gi: *mut nvmlGpuInstance_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        if placement.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's placement.
        let p = unsafe { *placement };
        let id = c.update(|s, n, now| {
            let profile = s
                .gi_possible_placements(n, g, profile_id, now)?
                .into_iter()
                .find(|&(start, _)| start == p.start);
            match profile {
                Some((_, size)) if size == p.size => s.create_gpu_instance(n, g, profile_id, Some(p.start), now),
                _ => Err(SimError::InvalidArgument(format!("placement {}:{} is not valid", p.start, p.size))),
            }
        })?;
        out(gi, gi_handle(g, id))
    }

    fn nvmlDeviceGetGpuInstances(device: nvmlDevice_t, profile_id: c_uint, instances: *mut nvmlGpuInstance_t, count: *mut c_uint) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        let list = sim(state.gpu_instances(&c.node, g, Some(profile_id), now))?;
        if instances.is_null() && !list.is_empty() {
            return Err(INVALID_ARGUMENT);
        }
        for (i, gi) in list.iter().enumerate() {
            // SAFETY: NVML's contract: the array holds the profile's instance count, which
            // bounds how many instances of it can exist.
            out(unsafe { instances.add(i) }, gi_handle(g, gi.id))?;
        }
        out(count, list.len() as c_uint)
    }

    fn nvmlDeviceGetGpuInstanceById(device: nvmlDevice_t, id: c_uint, gi: *mut nvmlGpuInstance_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        sim(state.gpu_instance(&c.node, g, id, now))?;
        out(gi, gi_handle(g, id))
    }

    fn nvmlGpuInstanceGetInfo(gi: nvmlGpuInstance_t, info: *mut sys::nvmlGpuInstanceInfo_t) {
        let c = ctx()?;
        let (g, id) = gi_of(gi)?;
        let (state, now) = c.read()?;
        let i = sim(state.gpu_instance(&c.node, g, id, now))?;
        out(info, sys::nvmlGpuInstanceInfo_t {
            device: gpu_handle(g),
            id: i.id,
            profileId: i.profile_id,
            placement: sys::nvmlGpuInstancePlacement_t { start: i.start, size: i.size },
        })
    }

    fn nvmlGpuInstanceDestroy(gi: nvmlGpuInstance_t) {
        let c = ctx()?;
        let (g, id) = gi_of(gi)?;
        c.update(|s, n, now| s.destroy_gpu_instance(n, g, id, now))
    }

    // --- compute instances ---

    fn nvmlGpuInstanceGetComputeInstanceProfileInfo(gi: nvmlGpuInstance_t, profile: c_uint, eng_profile: c_uint, info: *mut sys::nvmlComputeInstanceProfileInfo_t) {
        let c = ctx()?;
        let (g, id) = gi_of(gi)?;
        if eng_profile != sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(NOT_SUPPORTED);
        }
        let (state, now) = c.read()?;
        let (ci_id, slices) = sim(state.ci_profile(&c.node, g, id, profile, now))?;
        let i = sim(state.gpu_instance(&c.node, g, id, now))?;
        let gi_profile = c.node.gpus[g as usize]
            .model
            .mig()
            .and_then(|m| m.profile_by_id(i.profile_id))
            .ok_or(UNKNOWN)?;
        out(info, sys::nvmlComputeInstanceProfileInfo_t {
            id: ci_id,
            sliceCount: slices,
            instanceCount: gi_profile.compute_slices / slices,
            multiprocessorCount: gi_profile.multiprocessors * slices / gi_profile.compute_slices,
            sharedCopyEngineCount: 0,
            sharedDecoderCount: 0,
            sharedEncoderCount: 0,
            sharedJpegCount: 0,
            sharedOfaCount: 0,
        })
    }

    fn nvmlGpuInstanceCreateComputeInstance(gi: nvmlGpuInstance_t, profile_id: c_uint, ci: *mut nvmlComputeInstance_t) {
        let c = ctx()?;
        let (g, id) = gi_of(gi)?;
        let ci_id = c.update(|s, n, now| s.create_compute_instance(n, g, id, profile_id, now))?;
        out(ci, ci_handle(g, id, ci_id))
    }

    fn nvmlGpuInstanceGetComputeInstances(gi: nvmlGpuInstance_t, profile_id: c_uint, instances: *mut nvmlComputeInstance_t, count: *mut c_uint) {
        let c = ctx()?;
        let (g, id) = gi_of(gi)?;
        let (state, now) = c.read()?;
        let list: Vec<_> = sim(state.gpu_instance(&c.node, g, id, now))?
            .compute_instances
            .iter()
            .filter(|ci| ci.profile_id == profile_id)
            .map(|ci| ci.id)
            .collect();
        if instances.is_null() && !list.is_empty() {
            return Err(INVALID_ARGUMENT);
        }
        for (i, ci) in list.iter().enumerate() {
            // SAFETY: the array holds the CI profile's instance count, which bounds the list.
            out(unsafe { instances.add(i) }, ci_handle(g, id, *ci))?;
        }
        out(count, list.len() as c_uint)
    }

    fn nvmlGpuInstanceGetComputeInstanceById(gi: nvmlGpuInstance_t, ci_id: c_uint, ci: *mut nvmlComputeInstance_t) {
        let c = ctx()?;
        let (g, id) = gi_of(gi)?;
        let (state, now) = c.read()?;
        let i = sim(state.gpu_instance(&c.node, g, id, now))?;
        if !i.compute_instances.iter().any(|x| x.id == ci_id) {
            return Err(NOT_FOUND);
        }
        out(ci, ci_handle(g, id, ci_id))
    }

    fn nvmlComputeInstanceGetInfo_v2(ci: nvmlComputeInstance_t, info: *mut sys::nvmlComputeInstanceInfo_t) {
        let c = ctx()?;
        let (g, gi, id) = ci_of(ci)?;
        let (state, now) = c.read()?;
        let i = sim(state.gpu_instance(&c.node, g, gi, now))?;
        let x = i.compute_instances.iter().find(|x| x.id == id).ok_or(INVALID_ARGUMENT)?;
        out(info, sys::nvmlComputeInstanceInfo_t {
            device: gpu_handle(g),
            gpuInstance: gi_handle(g, gi),
            id: x.id,
            profileId: x.profile_id,
            placement: sys::nvmlComputeInstancePlacement_t { start: x.start, size: x.size },
        })
    }

    // --- GPM (Hopper and newer) ---

    fn nvmlGpmQueryDeviceSupport(device: nvmlDevice_t, support: *mut sys::nvmlGpmSupport_t) {
        let c = ctx()?;
        let g = gpu_of(&c, device)?;
        if support.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's versioned struct.
        if unsafe { (*support).version } != sys::NVML_GPM_SUPPORT_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let supported = c.node.gpus[g as usize].model.architecture >= arch::HOPPER;
        out(support, sys::nvmlGpmSupport_t {
            version: sys::NVML_GPM_SUPPORT_VERSION,
            isSupportedDevice: c_uint::from(supported),
        })
    }

    fn nvmlGpmSampleAlloc(sample: *mut sys::nvmlGpmSample_t) {
        ctx()?;
        let ptr = Box::into_raw(Box::new(Mutex::new(None::<GpmSample>)));
        live_samples().insert(ptr as usize);
        out(sample, ptr.cast())
    }

    fn nvmlGpmSampleFree(sample: sys::nvmlGpmSample_t) {
        if !live_samples().remove(&(sample as usize)) {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: allocated by nvmlGpmSampleAlloc as this type and still live.
        drop(unsafe { Box::from_raw(sample.cast::<Mutex<Option<GpmSample>>>()) });
        Ok(())
    }

    fn nvmlGpmSampleGet(device: nvmlDevice_t, sample: sys::nvmlGpmSample_t) {
        let c = ctx()?;
        let gpu = gpu_of(&c, device)?;
        let (state, now) = c.read()?;
        sim(state.check_alive(&c.node, gpu, now))?;
        with_sample(sample, |s| {
            *s = Some(GpmSample { gpu, gi: None, at: now });
            Ok(())
        })
    }

    fn nvmlGpmMigSampleGet(device: nvmlDevice_t, gi: c_uint, sample: sys::nvmlGpmSample_t) {
        let c = ctx()?;
        let gpu = gpu_of(&c, device)?;
        if c.node.gpus[gpu as usize].model.architecture < arch::HOPPER {
            return Err(NOT_SUPPORTED);
        }
        let (state, now) = c.read()?;
        sim(state.gpu_instance(&c.node, gpu, gi, now))?;
        with_sample(sample, |s| {
            *s = Some(GpmSample { gpu, gi: Some(gi), at: now });
            Ok(())
        })
    }

    fn nvmlGpmMetricsGet(get: *mut sys::nvmlGpmMetricsGet_t) {
        let c = ctx()?;
        if get.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null pointer to the caller's struct, which we fill in place.
        let get = unsafe { &mut *get };
        if get.version != sys::NVML_GPM_METRICS_GET_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let first = with_sample(get.sample1, |s| Ok(*s))?.ok_or(INVALID_ARGUMENT)?;
        let second = with_sample(get.sample2, |s| Ok(*s))?.ok_or(INVALID_ARGUMENT)?;
        if (first.gpu, first.gi) != (second.gpu, second.gi) {
            return Err(INVALID_ARGUMENT);
        }
        let (state, _) = c.read()?;
        let (sm, mem) = match first.gi {
            Some(gi) => sim(state.gpu_instance_utilization(&c.node, first.gpu, gi, first.at, second.at))?,
            None => {
                let (g, m) = sim(state.utilization(&c.node, first.gpu, second.at))?;
                (f64::from(g), f64::from(m))
            }
        };
        let n = (get.numMetrics as usize).min(get.metrics.len());
        for m in &mut get.metrics[..n] {
            match m.metricId {
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL => {
                    m.value = sm;
                    m.nvmlReturn = SUCCESS;
                }
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_DRAM_BW_UTIL => {
                    m.value = mem;
                    m.nvmlReturn = SUCCESS;
                }
                _ => m.nvmlReturn = NOT_SUPPORTED,
            }
        }
        Ok(())
    }

    fn nvmlComputeInstanceDestroy(ci: nvmlComputeInstance_t) {
        let c = ctx()?;
        let (g, gi, id) = ci_of(ci)?;
        c.update(|s, n, now| s.destroy_compute_instance(n, g, gi, id, now))
    }
}

/// Total and used memory (MiB) of a GPU or MIG device.
fn memory_mib(device: nvmlDevice_t) -> R<(u64, u64)> {
    let c = ctx()?;
    let (state, now) = c.read()?;
    match dev(&c, device)? {
        Dev::Gpu(g) => {
            let used = state
                .processes(&c.node, g, now)
                .map(|ps| ps.iter().map(|p| p.used_memory_mib).sum())
                .unwrap_or(0);
            Ok((c.node.gpus[g as usize].model.memory_mib, used))
        }
        Dev::Mig { gpu, gi, ci } => {
            let d = mig_device(&c, gpu, gi, ci)?;
            let used = sim(state.processes(&c.node, gpu, now))?
                .iter()
                .filter(|p| p.gpu_instance == Some(gi))
                .map(|p| p.used_memory_mib)
                .sum();
            Ok((d.profile.memory_mib, used))
        }
    }
}

/// Health counters of a (physical) GPU and its static facts.
fn health(device: nvmlDevice_t) -> R<(SimHealth, SimGpu)> {
    let c = ctx()?;
    let g = gpu_of(&c, device)?;
    let (state, now) = c.read()?;
    Ok((
        sim(state.health(&c.node, g, now))?,
        c.node.gpus[g as usize].clone(),
    ))
}

fn retired_pages(
    retired: u64,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> R {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null in/out count.
    let capacity = unsafe { *count } as u64;
    out(count, retired as c_uint)?;
    if addresses.is_null() {
        return if retired > 0 {
            Err(INSUFFICIENT_SIZE)
        } else {
            Ok(())
        };
    }
    if retired > capacity {
        return Err(INSUFFICIENT_SIZE);
    }
    for i in 0..retired as usize {
        // SAFETY: the caller's arrays hold `capacity` >= retired entries.
        out(unsafe { addresses.add(i) }, 0x1000 * (i as u64 + 1))?;
        if !timestamps.is_null() {
            // SAFETY: as above.
            out(unsafe { timestamps.add(i) }, 0)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Event sets
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct EventSetInner {
    /// GPU index → registered event type mask.
    registered: BTreeMap<u32, u64>,
    delivered: BTreeSet<EventKey>,
}

#[derive(Default)]
struct EventSet {
    inner: Mutex<EventSetInner>,
    /// The state file's watch, made by the first wait with a timeout (`None` inside: inotify
    /// unavailable, so waits poll).
    watch: std::sync::OnceLock<Option<Arc<StateWatch>>>,
}

impl EventSet {
    fn lock(&self) -> MutexGuard<'_, EventSetInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static LIVE_SETS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn live_sets() -> MutexGuard<'static, BTreeSet<usize>> {
    LIVE_SETS.lock().unwrap_or_else(|p| p.into_inner())
}

fn with_set<T>(set: nvmlEventSet_t, f: impl FnOnce(&EventSet) -> R<T>) -> R<T> {
    let live = live_sets();
    if !live.contains(&(set as usize)) {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: the pointer is a live Box<EventSet> (checked under the registry lock, which we
    // hold so it cannot be freed meanwhile).
    let s = unsafe { &*set.cast::<EventSet>() };
    f(s)
}

/// How often an event wait looks at the state file when inotify is unavailable.
const FALLBACK_POLL: Duration = Duration::from_millis(20);

/// An inotify watch on the state file's directory: the file is replaced by rename, so the
/// directory is watched and only events naming the file wake the wait (the lock file beside it
/// is opened by every read, and would otherwise wake the waiter with its own reads).
struct StateWatch {
    fd: std::os::fd::OwnedFd,
    name: Vec<u8>,
}

impl StateWatch {
    /// `None` when inotify cannot be used (no instances left, no directory): the wait polls.
    fn new(state: &std::path::Path) -> Option<StateWatch> {
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        let name = state.file_name()?.as_bytes().to_vec();
        let dir = match state.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        let dir = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: plain syscall; a non-negative result is a new descriptor we own.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let mask = libc::IN_MOVED_TO | libc::IN_CLOSE_WRITE | libc::IN_CREATE;
        // SAFETY: `dir` is a NUL-terminated path; `fd` is an inotify descriptor.
        let wd = unsafe {
            libc::inotify_add_watch(std::os::fd::AsRawFd::as_raw_fd(&fd), dir.as_ptr(), mask)
        };
        (wd >= 0).then_some(StateWatch { fd, name })
    }

    /// Returns once the state file was written or replaced, or after `timeout`.
    fn wait(&self, timeout: Duration) {
        use std::os::fd::AsRawFd;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // Rounded up, so a wait for a fault due in 0.3 ms does not spin.
            let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
            if ready <= 0 {
                // Timed out, or interrupted: the caller reads the state again either way.
                return;
            }
            if self.drain_names_file() || left.is_zero() {
                return;
            }
        }
    }

    /// Reads every queued event; whether one names the state file.
    fn drain_names_file(&self) -> bool {
        use std::os::fd::AsRawFd;
        const HEADER: usize = std::mem::size_of::<libc::inotify_event>();
        let mut buf = [0u8; 4096];
        let mut hit = false;
        loop {
            // SAFETY: reading into a buffer of buf.len() bytes.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else {
                // EAGAIN: drained (or an error: the caller reads the state anyway).
                return hit;
            };
            if n == 0 {
                return hit;
            }
            let mut at = 0;
            while at + HEADER <= n {
                // The name length sits after wd, mask and cookie (three 4-byte fields).
                let len_bytes = [buf[at + 12], buf[at + 13], buf[at + 14], buf[at + 15]];
                let len = u32::from_ne_bytes(len_bytes) as usize;
                let name = buf.get(at + HEADER..at + HEADER + len).unwrap_or(&[]);
                let name = name.split(|b| *b == 0).next().unwrap_or(&[]);
                hit |= name == self.name.as_slice();
                at += HEADER + len;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GPM samples
// ---------------------------------------------------------------------------------------------

/// What a GPM sample recorded: whose counters, and when (simulated seconds).
#[derive(Debug, Clone, Copy)]
struct GpmSample {
    gpu: u32,
    gi: Option<u32>,
    at: f64,
}

static LIVE_SAMPLES: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

fn live_samples() -> MutexGuard<'static, BTreeSet<usize>> {
    LIVE_SAMPLES.lock().unwrap_or_else(|p| p.into_inner())
}

fn with_sample<T>(
    sample: sys::nvmlGpmSample_t,
    f: impl FnOnce(&mut Option<GpmSample>) -> R<T>,
) -> R<T> {
    let live = live_samples();
    if !live.contains(&(sample as usize)) {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: a live Box<Mutex<Option<GpmSample>>> from nvmlGpmSampleAlloc; the registry lock
    // we hold keeps it from being freed meanwhile.
    let cell = unsafe { &*sample.cast::<Mutex<Option<GpmSample>>>() };
    let mut guard = cell.lock().unwrap_or_else(|p| p.into_inner());
    f(&mut guard)
}
