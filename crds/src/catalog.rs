//! MIG profile catalog (placeholder; filled by the GPU backends work).
