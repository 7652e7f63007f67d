//! Counters for the plugin. Plain atomics; the agent's `/metrics` endpoint can
//! expose a [`MetricsSnapshot`] in Prometheus format.

use std::sync::atomic::{AtomicU64, Ordering};

/// Monotonic counters, shared by the plugin's tasks.
#[derive(Debug, Default)]
pub struct PluginMetrics {
    /// Successful `Register` calls to the kubelet.
    pub registrations: AtomicU64,
    /// Failed `Register` attempts (kubelet socket missing, refused, timed out).
    pub registration_failures: AtomicU64,
    /// Kubelet restarts noticed (its socket was recreated).
    pub kubelet_restarts: AtomicU64,
    /// Plugin servers (re)started.
    pub server_starts: AtomicU64,
    /// Device lists sent on `ListAndWatch` streams.
    pub list_and_watch_sends: AtomicU64,
    /// Successful `Allocate` calls.
    pub allocations: AtomicU64,
    /// `Allocate` calls rejected (unknown or unhealthy devices).
    pub allocation_errors: AtomicU64,
    /// `GetPreferredAllocation` calls answered.
    pub preferred_allocations: AtomicU64,
    /// Health transitions Healthy → Unhealthy (per GPU or MIG device target).
    pub health_unhealthy_transitions: AtomicU64,
    /// Health transitions back to Healthy after the hold-down.
    pub health_healthy_transitions: AtomicU64,
    /// Xid events ignored as application errors.
    pub ignored_xids: AtomicU64,
}

/// A point-in-time copy of [`PluginMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct MetricsSnapshot {
    pub registrations: u64,
    pub registration_failures: u64,
    pub kubelet_restarts: u64,
    pub server_starts: u64,
    pub list_and_watch_sends: u64,
    pub allocations: u64,
    pub allocation_errors: u64,
    pub preferred_allocations: u64,
    pub health_unhealthy_transitions: u64,
    pub health_healthy_transitions: u64,
    pub ignored_xids: u64,
}

impl PluginMetrics {
    /// Adds one to `counter`.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            registrations: get(&self.registrations),
            registration_failures: get(&self.registration_failures),
            kubelet_restarts: get(&self.kubelet_restarts),
            server_starts: get(&self.server_starts),
            list_and_watch_sends: get(&self.list_and_watch_sends),
            allocations: get(&self.allocations),
            allocation_errors: get(&self.allocation_errors),
            preferred_allocations: get(&self.preferred_allocations),
            health_unhealthy_transitions: get(&self.health_unhealthy_transitions),
            health_healthy_transitions: get(&self.health_healthy_transitions),
            ignored_xids: get(&self.ignored_xids),
        }
    }
}
