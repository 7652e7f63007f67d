//! The kubelet device plugin: advertises healthy GPUs and MIG devices, one gRPC
//! server per resource, and answers `Allocate` with CDI device names.
//!
//! Wiring, for the agent:
//! 1. [`resource_sets`] turns the GPU inventory into devices per resource for the
//!    node's [`MigStrategy`]; put them with the [`Topology`] into an [`Advertisement`]
//!    and send it on a `watch` channel whenever the layout changes.
//! 2. [`HealthMonitor::run`] reads that channel and a channel of [`HealthEvent`]s and
//!    publishes the advertisement with health applied on a second `watch` channel.
//! 3. [`run_plugins`] serves the second channel to the kubelet until cancelled.

pub mod allocate;
pub mod api;
pub mod health;
pub mod manager;
pub mod metrics;
pub mod model;
pub mod resources;
mod server;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::path::PathBuf;

pub use allocate::{AllocateOptions, ResourceView};
pub use health::{
    Clock, DEFAULT_IGNORED_XIDS, FaultReason, HealthEvent, HealthEventKind, HealthMonitor,
    HealthPolicy, HealthProbe, HealthTarget, HealthTracker, ManualClock, TokioClock,
};
pub use manager::{PluginConfig, run_plugins};
pub use metrics::{MetricsSnapshot, PluginMetrics};
pub use model::{
    AdvertisedDevice, Advertisement, CdiKind, DeviceId, Health, LinkKind, ResourceName, Topology,
};
pub use resources::{CdiNaming, GpuDescription, MigDescription, MigStrategy, resource_sets};
pub use server::{connect_unix, plugin_options};

/// Errors at the plugin's edges (sockets, gRPC).
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// Binding or removing a unix socket failed.
    #[error("unix socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Connecting to a unix socket failed.
    #[error("connecting to {path}: {source}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The transport error.
        source: tonic::transport::Error,
    },
    /// A gRPC call failed.
    #[error("{what} on {path}: {source}")]
    Rpc {
        /// Which call.
        what: &'static str,
        /// The socket it went to.
        path: PathBuf,
        /// The status returned.
        source: tonic::Status,
    },
}
