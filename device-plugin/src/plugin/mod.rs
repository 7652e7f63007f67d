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
//!
//! The agent runs 2 and 3 (and the forwarding of NVML events into 2) on a [`PluginRuntime`],
//! one thread of their own, so an event reaches `ListAndWatch` and an `Allocate` is answered
//! without waking other threads.
//!
//! ```no_run
//! use std::sync::Arc;
//! use gpupool_device_plugin::plugin::*;
//! use tokio::sync::{mpsc, watch};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn wire(gpus: Vec<GpuDescription>) -> Result<(), Box<dyn std::error::Error>> {
//! let metrics = Arc::new(PluginMetrics::default());
//! let cancel = CancellationToken::new();
//! let layout = Advertisement {
//!     resources: resource_sets(&gpus, MigStrategy::Mixed, CdiNaming::Uuid)?,
//!     topology: Arc::new(Topology::new().with_link(0, 1, LinkKind::NvLink(12))),
//! };
//! let (layout_tx, layout_rx) = watch::channel(layout.clone());
//! let (events_tx, events_rx) = mpsc::channel(256);
//! let (health_tx, health_rx) = watch::channel(layout);
//! let monitor = HealthMonitor::new(HealthPolicy::default(), metrics.clone());
//! let monitor = tokio::spawn(monitor.run(layout_rx, events_rx, health_tx, cancel.clone()));
//! let plugins = tokio::spawn(run_plugins(PluginConfig::default(), health_rx, metrics, cancel.clone()));
//!
//! // From the backend's health events:
//! events_tx.send(HealthEvent { target: HealthTarget::Gpu(0), kind: HealthEventKind::Xid(79) }).await?;
//! // After a MIG re-layout: layout_tx.send_replace(new_advertisement);
//! # drop(layout_tx);
//! cancel.cancel(); // on SIGTERM: servers stop, sockets are removed
//! plugins.await??;
//! monitor.await?;
//! # Ok(()) }
//! ```

pub mod allocate;
pub mod api;
pub mod foreign;
pub mod health;
pub mod manager;
pub mod metrics;
pub mod model;
pub mod resources;
pub mod runtime;
mod server;
pub mod sharing;
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
pub use runtime::PluginRuntime;
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
