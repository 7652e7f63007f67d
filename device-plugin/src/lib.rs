//! gpupool node agent.
pub mod backend;
