//! The gpupool node agent: GPU backends (NVML and simulated), driver validation (with Xids from
//! the kernel log), CDI spec generation, MIG partitioning, utilization sampling, GpuNode status
//! reporting and the kubelet device-plugin servers.
pub mod agent;
pub mod attribution;
pub mod backend;
pub mod cdi;
pub mod inventory;
pub mod kmsg;
pub mod metrics_http;
pub mod mig;
pub mod occupancy;
pub mod pidns;
pub mod plugin;
pub mod podresources;
pub mod trust;
pub mod utilization;
pub mod validate;
pub mod xid;
