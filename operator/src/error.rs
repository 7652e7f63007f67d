//! The operator's errors.

/// Everything that can go wrong in a reconcile or at start-up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done, e.g. `applying GpuNode gpu-node-0`.
        action: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The finalizer machinery failed.
    #[error("finalizer of GpuPool {pool}: {source}")]
    Finalizer {
        /// The pool.
        pool: String,
        /// What failed.
        #[source]
        source: Box<kube::runtime::finalizer::Error<Error>>,
    },
    /// An object lacks a field the API always sets.
    #[error("{0} has no {1}")]
    MissingField(String, &'static str),
    /// Serializing a patch failed.
    #[error("serializing {what}: {source}")]
    Serialize {
        /// What was being serialized.
        what: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// A GpuPool the API holds cannot be read as one.
    #[error("GpuPool {pool} is malformed: {message}")]
    InvalidPool {
        /// The pool.
        pool: String,
        /// What the deserializer said.
        message: String,
    },
}

impl Error {
    /// Wraps an API error with what was being done.
    pub fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let action = action.into();
        move |source| Error::Kube { action, source }
    }

    /// A short, fixed category for metrics labels.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "api",
            Error::Finalizer { .. } => "finalizer",
            Error::MissingField(..) => "missing_field",
            Error::Serialize { .. } => "serialize",
            Error::InvalidPool { .. } => "invalid_pool",
        }
    }
}

/// The HTTP status of an API error, if it is one.
pub fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Result with the operator's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
