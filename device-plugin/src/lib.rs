//! gpupool node agent.
pub mod backend;
pub mod plugin;
