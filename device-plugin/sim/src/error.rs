//! Errors of the simulated node.

use std::fmt;

/// Errors of the simulated node, one per NVML return code it can produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// `NVML_ERROR_INVALID_ARGUMENT`
    InvalidArgument(String),
    /// `NVML_ERROR_NOT_SUPPORTED`
    NotSupported(String),
    /// `NVML_ERROR_NOT_FOUND`
    NotFound(String),
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`
    InsufficientResources(String),
    /// `NVML_ERROR_IN_USE`
    InUse(String),
    /// `NVML_ERROR_GPU_IS_LOST`
    GpuIsLost(u32),
    /// `NVML_ERROR_RESET_REQUIRED`
    ResetRequired(String),
    /// A fixture or state file that cannot be read (NVML has no equivalent; the fake fails
    /// `nvmlInit` with `NVML_ERROR_DRIVER_NOT_LOADED`).
    Fixture(String),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            SimError::NotSupported(m) => write!(f, "not supported: {m}"),
            SimError::NotFound(m) => write!(f, "not found: {m}"),
            SimError::InsufficientResources(m) => write!(f, "insufficient resources: {m}"),
            SimError::InUse(m) => write!(f, "in use: {m}"),
            SimError::GpuIsLost(i) => write!(f, "GPU {i} has fallen off the bus"),
            SimError::ResetRequired(m) => write!(f, "reset required: {m}"),
            SimError::Fixture(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for SimError {}

/// What every fallible operation of the simulated node returns.
pub type SimResult<T> = Result<T, SimError>;
