//! gpupool operator.
