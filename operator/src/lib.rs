//! gpupool operator: reconciles GpuPools into per-node GpuNodes, folds the node agents'
//! reports into pool status, coordinates MIG drains, and reclaims idle GPU pods.
//!
//! Decisions live in pure functions ([`pool`], [`membership`], [`layout`], [`reclaim`],
//! [`demand`]); [`controller`], [`drain`] and [`reclaim_run`] do the I/O around them, sharing
//! the [`context`] the controller builds. [`lifecycle`] is what the chart's install and uninstall
//! hooks run.

pub mod accounting;
pub mod cache;
pub mod context;
pub mod controller;
pub mod demand;
pub mod drain;
pub mod error;
pub mod heap;
pub mod http;
pub mod intern;
pub mod layout;
pub mod lifecycle;
pub mod liveness;
pub mod membership;
pub mod metrics;
pub mod pool;
pub mod pool_metrics;
pub mod reclaim;
pub mod reclaim_run;
pub mod startup;
pub mod store;
pub mod throttle;
pub mod uid;

pub use error::{Error, Result};

#[cfg(test)]
mod fixtures;
