//! Label, annotation, taint and finalizer keys that gpupool owns.

/// Node label set by the operator: the pool a node belongs to.
pub const POOL_LABEL: &str = "gpupool.io/pool";
/// Taint key the operator sets on nodes that fail driver validation (with `onFailure: Taint`).
pub const DRIVER_INVALID_TAINT: &str = "gpupool.io/driver-invalid";
/// Taint key (NoSchedule) the operator sets on a node while its agent drains it for, or
/// applies, a new MIG layout: the pods evicted for the change are not placed back on it.
pub const MIG_RECONFIGURING_TAINT: &str = "gpupool.io/mig-reconfiguring";
/// Every taint the operator sets, and removes when it no longer applies.
pub const OPERATOR_TAINTS: [&str; 2] = [DRIVER_INVALID_TAINT, MIG_RECONFIGURING_TAINT];
/// Finalizer on GpuPools.
pub const POOL_FINALIZER: &str = "gpupool.io/cleanup";
/// Pod annotation: since when the pod's GPUs have been idle.
pub const IDLE_SINCE_ANNOTATION: &str = "gpupool.io/idle-since";
/// Pod annotation: when the pod will be reclaimed if it stays idle.
pub const RECLAIM_AT_ANNOTATION: &str = "gpupool.io/reclaim-at";
/// Node labels the agent publishes (hardware facts).
pub const PRODUCT_LABEL: &str = "gpupool.io/gpu.product";
/// Number of GPUs.
pub const COUNT_LABEL: &str = "gpupool.io/gpu.count";
/// Memory per GPU in MiB.
pub const MEMORY_LABEL: &str = "gpupool.io/gpu.memory";
/// Whether the GPUs are MIG capable.
pub const MIG_CAPABLE_LABEL: &str = "gpupool.io/mig.capable";
/// Driver version.
pub const DRIVER_LABEL: &str = "gpupool.io/driver.version";
