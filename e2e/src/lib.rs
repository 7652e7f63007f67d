//! End-to-end test harness for gpupool.
