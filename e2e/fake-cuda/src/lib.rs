//! A fake `libcuda.so` for probes run inside GPU pods' containers on GPU-less CI.
//!
//! It answers the few driver-API calls a "can this container use its GPUs" probe makes, from
//! what the container was given: the devices are the `nvidia<N>` character devices in the
//! device directory (`/dev`, or `GPUPOOL_FAKE_NVML_DEV_DIR`, the fake NVML's override), counted
//! at `cuInit` as the driver enumerates at init.
//!
//! - `cuInit(0)`: `CUDA_SUCCESS` when there is a device, `CUDA_ERROR_NO_DEVICE` when there is
//!   none (as the driver answers), `CUDA_ERROR_INVALID_VALUE` for other flags.
//! - `cuDriverGetVersion`: `GPUPOOL_FAKE_CUDA_VERSION` (`12080` or `12.8`), default 12080;
//!   works before `cuInit`, as the driver's does.
//! - `cuDeviceGetCount`, `cuDeviceGet`: over the devices found at `cuInit`;
//!   `CUDA_ERROR_NOT_INITIALIZED` before it.
//! - `cuGetErrorString`, `cuGetErrorName`: for the codes this library returns.
//!
//! Codes are CUDA's (`cuda.h`). No panic crosses the C boundary: every export runs under
//! `catch_unwind` and a panic becomes `CUDA_ERROR_UNKNOWN`.

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint};
use std::os::unix::fs::FileTypeExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`: an ordinal.
pub type CuDevice = c_int;

/// No error.
pub const CUDA_SUCCESS: CuResult = 0;
/// A parameter is out of range or NULL.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `cuInit` has not succeeded.
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
/// No CUDA-capable device is visible.
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
/// The ordinal names no device.
pub const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
/// Anything else.
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

/// The version `cuDriverGetVersion` reports when `GPUPOOL_FAKE_CUDA_VERSION` is not set.
pub const DEFAULT_VERSION: c_int = 12080;

static ERRORS: &[(CuResult, &str, &str)] = &[
    (CUDA_SUCCESS, "CUDA_SUCCESS\0", "no error\0"),
    (
        CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE\0",
        "invalid argument\0",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED\0",
        "initialization error\0",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE\0",
        "no CUDA-capable device is detected\0",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE\0",
        "invalid device ordinal\0",
    ),
    (
        CUDA_ERROR_UNKNOWN,
        "CUDA_ERROR_UNKNOWN\0",
        "unknown error\0",
    ),
];

/// Device count found by `cuInit`; `None` until it succeeds.
static DEVICES: Mutex<Option<c_int>> = Mutex::new(None);

fn devices() -> Result<c_int, CuResult> {
    DEVICES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

/// The device directory: `GPUPOOL_FAKE_NVML_DEV_DIR`, else `/dev`.
fn dev_dir() -> PathBuf {
    std::env::var_os("GPUPOOL_FAKE_NVML_DEV_DIR")
        .map_or_else(|| PathBuf::from("/dev"), PathBuf::from)
}

/// How many GPU device nodes (`nvidia<N>` character devices, symlinks followed) `dir` holds.
/// A directory that cannot be read holds none, as a container without GPUs has none.
pub fn count_gpu_nodes(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.file_type().is_char_device()))
        .count()
}

/// Parses `GPUPOOL_FAKE_CUDA_VERSION`: `12080` or `12.8` (major.minor, as `nvidia-smi` prints).
pub fn parse_version(text: &str) -> Option<c_int> {
    let text = text.trim();
    match text.split_once('.') {
        Some((major, minor)) => {
            let major: c_int = major.parse().ok()?;
            let minor: c_int = minor.parse().ok()?;
            (0..100)
                .contains(&minor)
                .then(|| major.checked_mul(1000)?.checked_add(minor * 10))?
        }
        None => text.parse().ok().filter(|v| *v > 0),
    }
}

/// Runs an export's body; a panic becomes `CUDA_ERROR_UNKNOWN` instead of unwinding into C.
fn guard(body: impl FnOnce() -> Result<(), CuResult>) -> CuResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes through a caller's out-pointer; NULL is an invalid value, as in CUDA.
fn out<T>(p: *mut T, value: T) -> Result<(), CuResult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the driver API's contract: a non-NULL out-pointer points to storage for one T.
    unsafe { p.write(value) };
    Ok(())
}

/// `CUresult cuInit(unsigned int Flags)`
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    guard(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let count = c_int::try_from(count_gpu_nodes(&dev_dir())).unwrap_or(c_int::MAX);
        if count == 0 {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        *DEVICES.lock().unwrap_or_else(|p| p.into_inner()) = Some(count);
        Ok(())
    })
}

/// `CUresult cuDriverGetVersion(int* driverVersion)`
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    guard(|| {
        let v = match std::env::var("GPUPOOL_FAKE_CUDA_VERSION") {
            Ok(text) => parse_version(&text).ok_or_else(|| {
                eprintln!("fake libcuda: GPUPOOL_FAKE_CUDA_VERSION={text:?} is not 12080 or 12.8");
                CUDA_ERROR_UNKNOWN
            })?,
            Err(_) => DEFAULT_VERSION,
        };
        out(version, v)
    })
}

/// `CUresult cuDeviceGetCount(int* count)`
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    guard(|| out(count, devices()?))
}

/// `CUresult cuDeviceGet(CUdevice* device, int ordinal)`
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CuDevice, ordinal: c_int) -> CuResult {
    guard(|| {
        let n = devices()?;
        if device.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if !(0..n).contains(&ordinal) {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        out(device, ordinal)
    })
}

/// Which text of an error to give: its name or its description.
#[derive(Clone, Copy)]
enum ErrorText {
    Name,
    Description,
}

fn error_text(error: CuResult, which: ErrorText) -> Option<*const c_char> {
    let (_, name, description) = ERRORS.iter().find(|e| e.0 == error)?;
    let text = match which {
        ErrorText::Name => name,
        ErrorText::Description => description,
    };
    Some(text.as_ptr().cast())
}

/// `CUresult cuGetErrorString(CUresult error, const char** pStr)`
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CuResult, text: *mut *const c_char) -> CuResult {
    guard(|| match error_text(error, ErrorText::Description) {
        Some(s) => out(text, s),
        None => {
            out(text, std::ptr::null())?;
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// `CUresult cuGetErrorName(CUresult error, const char** pStr)`
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CuResult, text: *mut *const c_char) -> CuResult {
    guard(|| match error_text(error, ErrorText::Name) {
        Some(s) => out(text, s),
        None => {
            out(text, std::ptr::null())?;
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::fs;

    /// A fresh device directory for one test, removed when dropped.
    struct DevDir(PathBuf);

    impl DevDir {
        fn new(name: &str) -> DevDir {
            let dir = std::env::temp_dir()
                .join(format!("gpupool-fake-cuda-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            DevDir(dir)
        }
    }

    impl Drop for DevDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn only_gpu_character_devices_count() {
        let dev = DevDir::new("count");
        // /dev/null is a character device anywhere; links to it stand in for GPU nodes.
        for name in [
            "nvidia0",
            "nvidia7",
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-caps",
        ] {
            std::os::unix::fs::symlink("/dev/null", dev.0.join(name)).unwrap();
        }
        fs::write(dev.0.join("nvidia1"), "").unwrap(); // a plain file is no device
        fs::create_dir(dev.0.join("nvidia2")).unwrap();
        assert_eq!(count_gpu_nodes(&dev.0), 2);
        assert_eq!(
            count_gpu_nodes(Path::new("/nonexistent/gpupool-fake-cuda")),
            0
        );
    }

    #[test]
    fn versions_parse_in_both_spellings() {
        let cases = [
            ("12080", Some(12080)),
            ("12.8", Some(12080)),
            (" 12.4 ", Some(12040)),
            ("11.10", Some(11100)),
            ("12.100", None),
            ("twelve", None),
            ("", None),
            ("0", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_version(text), want, "{text:?}");
        }
    }

    /// The whole flow through the exports, in one test because they share process state.
    #[test]
    fn exports_answer_as_the_driver_does() {
        let mut n: c_int = -1;
        let mut d: CuDevice = -1;
        // SAFETY: valid out-pointers (or NULL where the test says so) in every call below.
        unsafe {
            assert_eq!(cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
            assert_eq!(cuDeviceGet(&mut d, 0), CUDA_ERROR_NOT_INITIALIZED);
            assert_eq!(cuInit(1), CUDA_ERROR_INVALID_VALUE);
            assert_eq!(
                cuDriverGetVersion(std::ptr::null_mut()),
                CUDA_ERROR_INVALID_VALUE
            );

            let empty = DevDir::new("empty");
            std::env::set_var("GPUPOOL_FAKE_NVML_DEV_DIR", &empty.0);
            assert_eq!(cuInit(0), CUDA_ERROR_NO_DEVICE);
            assert_eq!(cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);

            let dev = DevDir::new("flow");
            std::os::unix::fs::symlink("/dev/null", dev.0.join("nvidia3")).unwrap();
            std::os::unix::fs::symlink("/dev/null", dev.0.join("nvidia5")).unwrap();
            std::env::set_var("GPUPOOL_FAKE_NVML_DEV_DIR", &dev.0);
            assert_eq!(cuInit(0), CUDA_SUCCESS);
            assert_eq!(cuDeviceGetCount(&mut n), CUDA_SUCCESS);
            assert_eq!(n, 2);
            assert_eq!(cuDeviceGet(&mut d, 1), CUDA_SUCCESS);
            assert_eq!(d, 1);
            assert_eq!(cuDeviceGet(&mut d, 2), CUDA_ERROR_INVALID_DEVICE);
            assert_eq!(
                cuDeviceGet(std::ptr::null_mut(), 0),
                CUDA_ERROR_INVALID_VALUE
            );
            assert_eq!(
                cuDeviceGetCount(std::ptr::null_mut()),
                CUDA_ERROR_INVALID_VALUE
            );

            let mut v: c_int = 0;
            std::env::remove_var("GPUPOOL_FAKE_CUDA_VERSION");
            assert_eq!(cuDriverGetVersion(&mut v), CUDA_SUCCESS);
            assert_eq!(v, DEFAULT_VERSION);
            std::env::set_var("GPUPOOL_FAKE_CUDA_VERSION", "12.4");
            assert_eq!(cuDriverGetVersion(&mut v), CUDA_SUCCESS);
            assert_eq!(v, 12040);
            std::env::set_var("GPUPOOL_FAKE_CUDA_VERSION", "bad");
            assert_eq!(cuDriverGetVersion(&mut v), CUDA_ERROR_UNKNOWN);
            std::env::remove_var("GPUPOOL_FAKE_CUDA_VERSION");

            let mut s: *const c_char = std::ptr::null();
            assert_eq!(cuGetErrorString(CUDA_ERROR_NO_DEVICE, &mut s), CUDA_SUCCESS);
            assert_eq!(
                CStr::from_ptr(s).to_str().unwrap(),
                "no CUDA-capable device is detected"
            );
            assert_eq!(cuGetErrorName(CUDA_ERROR_NO_DEVICE, &mut s), CUDA_SUCCESS);
            assert_eq!(CStr::from_ptr(s).to_str().unwrap(), "CUDA_ERROR_NO_DEVICE");
            assert_eq!(cuGetErrorString(12345, &mut s), CUDA_ERROR_INVALID_VALUE);
            assert!(s.is_null());
            std::env::remove_var("GPUPOOL_FAKE_NVML_DEV_DIR");
        }
    }
}
