//! gpupool node agent.
