//! The backends' error type.

/// What went wrong talking to the GPUs. Every variant names the operation and its target.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The NVML library or the kernel driver is missing.
    #[error("NVML could not be loaded: is the NVIDIA driver installed on this node? ({detail})")]
    DriverNotLoaded {
        /// What the loader or NVML said.
        detail: String,
    },
    /// The GPU or driver does not offer this.
    #[error("{op} on {target}: not supported by this GPU or driver ({detail})")]
    NotSupported {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
        /// The driver's words.
        detail: String,
    },
    /// The agent lacks the privilege.
    #[error("{op} on {target}: permission denied (MIG changes need root or CAP_SYS_ADMIN)")]
    NoPermission {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
    },
    /// The GPU, instance or device does not exist.
    #[error("{op} on {target}: not found ({detail})")]
    NotFound {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
        /// The driver's words.
        detail: String,
    },
    /// The resource is busy (processes, or instances left).
    #[error("{op} on {target}: in use ({detail})")]
    InUse {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
        /// The driver's words.
        detail: String,
    },
    /// No room for the requested instance.
    #[error("{op} on {target}: insufficient resources ({detail})")]
    InsufficientResources {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
        /// The driver's words.
        detail: String,
    },
    /// A bad argument (profile or placement the GPU does not have).
    #[error("{op} on {target}: invalid argument ({detail})")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
        /// The driver's words.
        detail: String,
    },
    /// The GPU fell off the bus or is otherwise unreachable.
    #[error("{op} on {target}: the GPU has fallen off the bus or is otherwise lost")]
    GpuLost {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
    },
    /// Any other driver error.
    #[error("{op} on {target}: {detail}")]
    Driver {
        /// The operation.
        op: &'static str,
        /// What it was applied to.
        target: String,
        /// The driver's words.
        detail: String,
    },
    /// A fixture (simulated backend) that cannot be used.
    #[error("simulated GPUs: {0}")]
    Fixture(String),
    /// A value that does not parse.
    #[error("{what} {value:?}: {reason}")]
    Parse {
        /// What was parsed.
        what: &'static str,
        /// The text.
        value: String,
        /// Why it is not valid.
        reason: String,
    },
}

/// Kinds of failure, for callers that branch on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// [`Error::DriverNotLoaded`]
    DriverNotLoaded,
    /// [`Error::NotSupported`]
    NotSupported,
    /// [`Error::NoPermission`]
    NoPermission,
    /// [`Error::NotFound`]
    NotFound,
    /// [`Error::InUse`]
    InUse,
    /// [`Error::InsufficientResources`]
    InsufficientResources,
    /// [`Error::InvalidArgument`]
    InvalidArgument,
    /// [`Error::GpuLost`]
    GpuLost,
    /// [`Error::Driver`]
    Driver,
    /// [`Error::Fixture`]
    Fixture,
    /// [`Error::Parse`]
    Parse,
}

impl Error {
    /// The kind, without context.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::DriverNotLoaded { .. } => ErrorKind::DriverNotLoaded,
            Error::NotSupported { .. } => ErrorKind::NotSupported,
            Error::NoPermission { .. } => ErrorKind::NoPermission,
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::InUse { .. } => ErrorKind::InUse,
            Error::InsufficientResources { .. } => ErrorKind::InsufficientResources,
            Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::GpuLost { .. } => ErrorKind::GpuLost,
            Error::Driver { .. } => ErrorKind::Driver,
            Error::Fixture(_) => ErrorKind::Fixture,
            Error::Parse { .. } => ErrorKind::Parse,
        }
    }

    /// Builds an error of `kind` with context.
    pub fn new(
        kind: ErrorKind,
        op: &'static str,
        target: impl Into<String>,
        detail: String,
    ) -> Error {
        let target = target.into();
        match kind {
            ErrorKind::DriverNotLoaded => Error::DriverNotLoaded { detail },
            ErrorKind::NotSupported => Error::NotSupported { op, target, detail },
            ErrorKind::NoPermission => Error::NoPermission { op, target },
            ErrorKind::NotFound => Error::NotFound { op, target, detail },
            ErrorKind::InUse => Error::InUse { op, target, detail },
            ErrorKind::InsufficientResources => Error::InsufficientResources { op, target, detail },
            ErrorKind::InvalidArgument => Error::InvalidArgument { op, target, detail },
            ErrorKind::GpuLost => Error::GpuLost { op, target },
            ErrorKind::Fixture => Error::Fixture(detail),
            ErrorKind::Driver | ErrorKind::Parse => Error::Driver { op, target, detail },
        }
    }
}

/// Results of backend calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;
