//! The `gpupool.io/v1alpha1` API: [`GpuPool`] (written by users) and [`GpuNode`]
//! (spec by the operator, status by the node agent), plus the shared policy types.
//!
//! The CRD YAML under `crds/` and the chart is generated from these types by `crdgen`;
//! never edit it by hand.

pub mod conditions;
pub mod crdgen;
pub mod labels;
pub mod node;
pub mod policy;
pub mod pool;
#[cfg(feature = "testing")]
pub mod testing;

pub use node::{GpuNode, GpuNodeSpec, GpuNodeStatus};
pub use pool::{GpuPool, GpuPoolSpec, GpuPoolStatus};
