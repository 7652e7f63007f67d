//! Counters for the plugin: prometheus-client [`Counter`]s, shared by the plugin's tasks and
//! registered in the agent's registry by [`PluginMetrics::register`].

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

/// Monotonic counters, shared by the plugin's tasks.
#[derive(Debug, Default)]
pub struct PluginMetrics {
    /// Successful `Register` calls to the kubelet.
    pub registrations: Counter,
    /// Failed `Register` attempts (kubelet socket missing, refused, timed out).
    pub registration_failures: Counter,
    /// Kubelet restarts noticed (its socket was recreated).
    pub kubelet_restarts: Counter,
    /// Plugin servers (re)started.
    pub server_starts: Counter,
    /// Device lists sent on `ListAndWatch` streams.
    pub list_and_watch_sends: Counter,
    /// Successful `Allocate` calls.
    pub allocations: Counter,
    /// `Allocate` calls rejected (unknown or unhealthy devices).
    pub allocation_errors: Counter,
    /// `GetPreferredAllocation` calls answered.
    pub preferred_allocations: Counter,
    /// Health transitions Healthy → Unhealthy (per GPU or MIG device target).
    pub health_unhealthy_transitions: Counter,
    /// Health transitions back to Healthy after the hold-down.
    pub health_healthy_transitions: Counter,
    /// Xid events ignored as application errors.
    pub ignored_xids: Counter,
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
    pub fn inc(counter: &Counter) {
        counter.inc();
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            registrations: self.registrations.get(),
            registration_failures: self.registration_failures.get(),
            kubelet_restarts: self.kubelet_restarts.get(),
            server_starts: self.server_starts.get(),
            list_and_watch_sends: self.list_and_watch_sends.get(),
            allocations: self.allocations.get(),
            allocation_errors: self.allocation_errors.get(),
            preferred_allocations: self.preferred_allocations.get(),
            health_unhealthy_transitions: self.health_unhealthy_transitions.get(),
            health_healthy_transitions: self.health_healthy_transitions.get(),
            ignored_xids: self.ignored_xids.get(),
        }
    }

    /// Registers the counters `/metrics` has always shown, as
    /// `gpupool_plugin_<name>_total` (prometheus-client adds the `_total` of a counter).
    /// The others stay internal: tests and benchmarks read them through
    /// [`PluginMetrics::snapshot`].
    pub fn register(&self, registry: &mut Registry) {
        for (name, counter) in [
            ("registrations", &self.registrations),
            ("registration_failures", &self.registration_failures),
            ("allocations", &self.allocations),
            ("allocation_errors", &self.allocation_errors),
            (
                "health_unhealthy_transitions",
                &self.health_unhealthy_transitions,
            ),
            (
                "health_healthy_transitions",
                &self.health_healthy_transitions,
            ),
        ] {
            // A clone shares the counter's value: the registry reads what the tasks count.
            registry.register(
                format!("gpupool_plugin_{name}"),
                "Kubelet device plugin counter",
                counter.clone(),
            );
        }
    }
}
