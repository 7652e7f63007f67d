//! gpupool node agent.
pub mod backend;
pub mod cdi;
pub mod inventory;
pub mod mig;
pub mod plugin;
pub mod validate;
pub mod agent;
pub mod metrics_http;
pub mod report;
pub mod utilization;
