//! Prometheus metrics (fixed, low-cardinality labels only; the pool name is bounded by the
//! number of pools).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of reconcile counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// Which controller.
    pub controller: &'static str,
}

/// Labels of error counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Which controller.
    pub controller: &'static str,
    /// A fixed error category.
    pub error: &'static str,
}

/// Labels of reclaim counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReclaimLabels {
    /// The pool.
    pub pool: String,
    /// `Suspend`, `Evict`, `Delete`, `DryRun:<action>`, `Warn`, `Unwarn`.
    pub action: String,
    /// `Succeeded`, `BlockedByPDB`, `Failed`, `WouldSucceed`, `WouldBeBlocked`.
    pub result: String,
}

/// Labels of API write counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// The kind written.
    pub kind: &'static str,
    /// `apply`, `patch`, `delete`, `evict`, `status`.
    pub verb: &'static str,
}

/// Labels of the GPU-time counters: bounded by pools × namespaces that hold GPUs.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AccountLabels {
    /// The pool.
    pub pool: String,
    /// The namespace of the pods holding the GPUs.
    pub namespace: String,
}

/// A counter of seconds, fractional.
pub type Seconds = Counter<f64, AtomicU64>;

/// The operator's metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Reconciles run.
    pub reconciles: Family<ReconcileLabels, Counter>,
    /// Reconcile failures.
    pub errors: Family<ErrorLabels, Counter>,
    /// Reconcile durations in seconds.
    pub duration: Histogram,
    /// Reclaim actions.
    pub reclaims: Family<ReclaimLabels, Counter>,
    /// API writes the operator made.
    pub writes: Family<WriteLabels, Counter>,
    /// Reconciles in flight (kube's controller does not expose its queue; this is the part of
    /// it being worked on).
    pub queue_depth: Gauge,
    /// 1 while this replica leads.
    pub leader: Gauge,
    /// GPU-seconds allocated to pods (see [`crate::accounting`]).
    pub gpu_allocated_seconds: Family<AccountLabels, Seconds>,
    /// GPU-seconds allocated and idle.
    pub gpu_idle_seconds: Family<AccountLabels, Seconds>,
    /// Pool gauges, read from the leader's caches at scrape time.
    pub pools: Arc<crate::pool_metrics::PoolView>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reconciles: Family::default(),
            errors: Family::default(),
            duration: Histogram::new([
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            reclaims: Family::default(),
            writes: Family::default(),
            queue_depth: Gauge::default(),
            leader: Gauge::default(),
            gpu_allocated_seconds: Family::default(),
            gpu_idle_seconds: Family::default(),
            pools: Arc::default(),
        }
    }
}

impl Metrics {
    /// Registers every metric under the `gpupool` prefix.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "gpupool_reconciles",
            "Reconciles run",
            self.reconciles.clone(),
        );
        registry.register(
            "gpupool_reconcile_errors",
            "Reconciles that failed",
            self.errors.clone(),
        );
        registry.register(
            "gpupool_reconcile_duration_seconds",
            "How long reconciles take",
            self.duration.clone(),
        );
        registry.register(
            "gpupool_reclaims",
            "Idle-pod reclaim actions",
            self.reclaims.clone(),
        );
        registry.register(
            "gpupool_api_writes",
            "Writes the operator made to the API server",
            self.writes.clone(),
        );
        registry.register(
            "gpupool_queue_depth",
            "Pool reconciles in flight",
            self.queue_depth.clone(),
        );
        registry.register(
            "gpupool_leader",
            "1 while this replica is the leader",
            self.leader.clone(),
        );
        registry.register(
            "gpupool_gpu_allocated_seconds",
            "GPU-seconds allocated to pods, by pool and namespace, counted by the leader while it leads",
            self.gpu_allocated_seconds.clone(),
        );
        registry.register(
            "gpupool_gpu_idle_seconds",
            "GPU-seconds allocated to pods while the GPU was idle, by pool and namespace, counted by the leader while it leads",
            self.gpu_idle_seconds.clone(),
        );
        registry.register_collector(Box::new(crate::pool_metrics::PoolCollector(
            self.pools.clone(),
        )));
        registry.register_collector(Box::new(crate::heap::HeapCollector));
    }

    /// Adds a sample's GPU time.
    pub fn account(&self, accrual: &crate::accounting::Accrual) {
        for (family, by_key) in [
            (&self.gpu_allocated_seconds, &accrual.allocated),
            (&self.gpu_idle_seconds, &accrual.idle),
        ] {
            for ((pool, namespace), seconds) in by_key {
                family
                    .get_or_create(&AccountLabels {
                        pool: pool.clone(),
                        namespace: namespace.clone(),
                    })
                    .inc_by(*seconds);
            }
        }
    }

    /// Counts a write.
    pub fn write(&self, kind: &'static str, verb: &'static str) {
        self.writes.get_or_create(&WriteLabels { kind, verb }).inc();
    }

    /// Counts a reclaim action.
    pub fn reclaim(&self, pool: &str, action: &str, result: &str) {
        self.reclaims
            .get_or_create(&ReclaimLabels {
                pool: pool.to_owned(),
                action: action.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }
}
