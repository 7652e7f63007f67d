//! The gpupool.io API types.

pub mod catalog;
