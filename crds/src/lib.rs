//! The gpupool.io API types.
