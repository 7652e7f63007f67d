//! What every reconcile shares: the [`Context`] (client, caches, recorder, metrics,
//! settings, backoff state) and the field manager the operator writes as. Kept apart from the
//! controller so the I/O modules that take a `Context` ([`crate::drain`],
//! [`crate::reclaim_run`]) depend on it, not on the controller that calls them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpupool_crds::pool::{ReclaimRecord, ReclaimStatus};
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Pod};
use k8s_openapi::jiff::SignedDuration;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::PartialObjectMeta;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Event, Recorder};
use kube::runtime::reflector::Store;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cache::CachedNode;
use crate::liveness::Liveness;
use crate::metrics::Metrics;
/// Field manager for every write.
pub const FIELD_MANAGER: &str = "gpupool-operator";

/// Operator settings the reconciler needs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How often pools with reclaim on are re-examined.
    pub reclaim_interval: Duration,
    /// Requeue period when nothing is pending.
    pub resync: Duration,
    /// First error backoff.
    pub backoff_min: Duration,
    /// Error backoff cap.
    pub backoff_max: Duration,
    /// Label selector narrowing the GpuPools this operator manages (sharding, tests).
    pub pool_selector: Option<String>,
    /// How long an agent may go without a heartbeat before its node's report is stale.
    pub agent_stale_after: Duration,
    /// How often the leader samples GpuNode status for the GPU-time counters.
    pub accounting_interval: Duration,
    /// How the caches make their initial lists (and relists).
    pub initial_list: InitialList,
}

/// How a cache fills at start, and again when its watch must start over. The choice sets the
/// operator's peak memory in a large cluster: the API server's answer to a list is held whole
/// while it is decoded, and a restart lists every pod, node and GpuNode at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InitialList {
    /// Pages of [`LIST_PAGE`] objects ([`GPUNODE_LIST_PAGE`] GpuNodes, [`POD_LIST_PAGE`]
    /// pods), each a consistent read: one page in memory at a time.
    #[default]
    Paged,
    /// One unpaged answer from the API server's watch cache (`resourceVersion=0`): the fewest
    /// requests and the least API server work, but the whole list in memory at once.
    Cache,
    /// A watch that sends the current objects as events first (`sendInitialEvents`, the API
    /// server's WatchList feature, on by default since Kubernetes 1.32): one object in memory
    /// at a time.
    Streaming,
}

/// Objects per page of a [`InitialList::Paged`] list.
pub const LIST_PAGE: u32 = 500;

/// Objects per page of a paged GpuNode list. A page is held whole, body and decoded objects,
/// until every object in it is cut, and a GpuNode reporting many MIG devices is large, so
/// this page is ten times smaller than [`LIST_PAGE`] (sizes measured by the `cache_bytes`
/// bench: docs/benchmarks.md, "Operator at scale").
pub const GPUNODE_LIST_PAGE: u32 = 50;

/// Objects per page of a paged pod list. A page's body is in memory three or four times over
/// while it is read (the HTTP client's read buffers, the collected body, the client library's
/// copy of it as text), and at 500 a page that was the operator's highest point; smaller pages
/// cost more list requests and lower the peak (docs/benchmarks.md, "Operator at scale", and
/// the dated log).
pub const POD_LIST_PAGE: u32 = 100;

impl Default for Settings {
    fn default() -> Self {
        Self {
            reclaim_interval: Duration::from_secs(30),
            resync: Duration::from_secs(300),
            backoff_min: Duration::from_secs(5),
            backoff_max: Duration::from_secs(300),
            pool_selector: None,
            agent_stale_after: Duration::from_secs(180),
            accounting_interval: Duration::from_secs(15),
            initial_list: InitialList::default(),
        }
    }
}

/// What every reconcile shares: the client, the caches ([`crate::store`]), the recorder and
/// metrics.
pub struct Context {
    /// API client.
    pub client: Client,
    /// A client that does not retry 429s itself: evictions blocked by a PodDisruptionBudget
    /// answer 429, and the reclaimer retries those on its own schedule instead of stalling the
    /// reconcile in the client's backoff.
    pub evict_client: Client,
    /// GpuPools (as the controller sees them).
    pub pools: Store<DeserializeGuard<GpuPool>>,
    /// Nodes: labels, taints and readiness.
    pub nodes: crate::store::Store<CachedNode>,
    /// GpuNodes.
    pub gpunodes: crate::store::Store<GpuNode>,
    /// Pods, trimmed to what the reclaimer and drain need.
    pub pods: crate::store::Store<crate::cache::CachedPod>,
    /// Namespaces' metadata.
    pub namespaces: crate::store::Store<PartialObjectMeta<Namespace>>,
    /// Event recorder.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Settings.
    pub settings: Settings,
    /// Consecutive failures per pool, for the capped error backoff.
    pub failures: Mutex<HashMap<String, u32>>,
    /// Per-pod retry state of blocked or failed reclaim actions: attempts and when to try next.
    pub evict_retry: Mutex<HashMap<String, (u32, Timestamp)>>,
    /// The agents' heartbeats as the GpuNode watch delivers them.
    pub liveness: Arc<Liveness>,
    /// Per pool, the resourceVersion the API server gave this process's last status write.
    pub written: Mutex<HashMap<String, String>>,
    /// Cancelled the moment this replica may no longer act: its leader Lease is lost, or it is
    /// shutting down. Every disruptive write asks [`Context::may_act`] first, so a reconcile
    /// still running when leadership ends writes nothing disruptive after that.
    pub acting: CancellationToken,
    /// The reclaim actions this process took, per pool, beside the pool status's history: a
    /// status write that fails after an eviction must not let the next pass spend the rate
    /// limit again ([`ActionLedger`]).
    pub ledger: ActionLedger,
}

/// The counted reclaim actions this process took, per pool, kept until they leave the widest
/// rate-limit window seen. The history in pool status is the record that survives a restart;
/// this is the one that survives a failed status write: each pass puts back into the status
/// any action of the ledger it lacks before the rate limit is asked.
#[derive(Debug, Default)]
pub struct ActionLedger {
    taken: Mutex<HashMap<String, Vec<ReclaimRecord>>>,
}

impl ActionLedger {
    /// Notes an action taken on `pool`.
    pub fn note(&self, pool: &str, record: ReclaimRecord) {
        self.taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(pool.to_owned())
            .or_default()
            .push(record);
    }

    /// The actions on `pool` that `status` does not hold, oldest first; forgets those older
    /// than `window` at `now`.
    pub fn missing_from(
        &self,
        pool: &str,
        status: &ReclaimStatus,
        window: SignedDuration,
        now: Timestamp,
    ) -> Vec<ReclaimRecord> {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let Some(records) = taken.get_mut(pool) else {
            return Vec::new();
        };
        records.retain(|r| now.duration_since(r.time.0) < window);
        let missing = records
            .iter()
            .filter(|r| !status.history.iter().any(|h| same_action(h, r)))
            .cloned()
            .collect();
        if records.is_empty() {
            taken.remove(pool);
        }
        missing
    }
}

/// Whether two history entries record the same action. The API server keeps times to the
/// second, so an entry read back from a status has lost the fraction the ledger's copy has.
fn same_action(a: &ReclaimRecord, b: &ReclaimRecord) -> bool {
    a.pod == b.pod
        && a.owner == b.owner
        && a.action == b.action
        && a.result == b.result
        && a.time.0.as_second() == b.time.0.as_second()
}

impl Context {
    /// Whether this replica may still take a disruptive action (evict, suspend, deactivate,
    /// delete); logged when it may not.
    pub fn may_act(&self) -> bool {
        let ok = !self.acting.is_cancelled();
        if !ok {
            info!("no longer leading (or shutting down): disruptive writes stop here");
        }
        ok
    }

    /// The resourceVersion of this process's last status write to `pool`, if any.
    pub fn written_version(&self, pool: &str) -> Option<String> {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(pool)
            .cloned()
    }

    /// Records a status write's resulting resourceVersion (forgets the pool on `None`).
    pub fn status_written(&self, pool: &str, version: Option<String>) {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        match version {
            Some(v) => written.insert(pool.to_owned(), v),
            None => written.remove(pool),
        };
    }

    /// The first cache that has not yet been filled by its initial list, if any. Until every
    /// one has, a reconcile would judge from a partial picture: a GpuNode store filled before
    /// the Node store makes every member look gone, and its GpuNode deleted as "left".
    pub fn unsynced_cache(&self) -> Option<&'static str> {
        if !self.nodes.is_ready() {
            Some("Nodes")
        } else if !self.gpunodes.is_ready() {
            Some("GpuNodes")
        } else if !self.pods.is_ready() {
            Some("Pods")
        } else if !self.namespaces.is_ready() {
            Some("Namespaces")
        } else {
            None
        }
    }

    /// Forgets a pool's failures after a successful reconcile, so its next backoff starts low.
    pub fn reset_failures(&self, pool: &str) {
        if let Ok(mut f) = self.failures.lock() {
            f.remove(pool);
        }
    }

    /// The delay before the next try after a failure: min doubling to max.
    pub fn backoff(&self, pool: &str) -> Duration {
        let n = match self.failures.lock() {
            Ok(mut f) => {
                let n = f.entry(pool.to_owned()).or_insert(0);
                *n = n.saturating_add(1);
                *n
            }
            Err(_) => 1,
        };
        capped_backoff(n, self.settings.backoff_min, self.settings.backoff_max)
    }

    /// Publishes an Event, logging (never failing on) errors: Events are best effort.
    pub async fn event(&self, reference: &ObjectReference, ev: Event) {
        if let Err(e) = self.recorder.publish(&ev, reference).await {
            warn!(error = %e, reason = %ev.reason, "publishing an Event failed");
        }
    }
}

/// Delete options that act on `pod` only while it is the same object: a pod of the same name
/// created since it was judged is left alone (the API answers 409).
pub fn uid_precondition(pod: &Pod) -> kube::api::DeleteParams {
    kube::api::DeleteParams {
        preconditions: kube::ResourceExt::uid(pod).map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..Default::default()
    }
}

/// Evicts `pod` through the Eviction API, only while it is the same object (UID
/// precondition; 409 otherwise), as a dry run when `dry_run`. The Eviction is built here:
/// kube 5's `Api::evict` sends its delete options under `delete_options`, a key the API server
/// ignores, so a precondition given to it would never be checked.
pub async fn evict(api: &kube::Api<Pod>, pod: &Pod, dry_run: bool) -> Result<(), kube::Error> {
    use k8s_openapi::api::policy::v1::Eviction;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
        DeleteOptions, ObjectMeta, Preconditions,
    };
    let name = kube::ResourceExt::name_any(pod);
    let eviction = Eviction {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: kube::ResourceExt::namespace(pod),
            ..Default::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: kube::ResourceExt::uid(pod).map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..Default::default()
        }),
    };
    let pp = kube::api::PostParams {
        dry_run,
        field_manager: None,
    };
    api.create_subresource::<_, serde_json::Value>("eviction", &name, &pp, &eviction)
        .await
        .map(|_| ())
}

/// `min × 2^(n-1)`, capped at `max`.
pub fn capped_backoff(failures: u32, min: Duration, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
    min.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let min = Duration::from_secs(5);
        let max = Duration::from_secs(300);
        let got: Vec<u64> = (1..=9)
            .map(|n| capped_backoff(n, min, max).as_secs())
            .collect();
        assert_eq!(got, vec![5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(capped_backoff(u32::MAX, min, max), max);
    }

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn record(pod: &str, time: Timestamp) -> ReclaimRecord {
        ReclaimRecord {
            pod: pod.into(),
            owner: None,
            action: "Evict".into(),
            result: "Succeeded".into(),
            time: Time(time),
        }
    }

    /// The ledger gives back what a status lacks, and nothing it holds, though the status was
    /// read back from the API server (times to the second); it forgets what left the window.
    #[test]
    fn the_ledger_restores_only_what_the_status_lacks() {
        let ledger = ActionLedger::default();
        let now: Timestamp = "2026-12-07T10:00:00.750Z".parse().unwrap();
        let window = SignedDuration::from_mins(10);
        ledger.note("p", record("ml/a", now));
        ledger.note("p", record("ml/b", now));
        // The status as written and read back: ml/a's entry, its time to the second.
        let written = ReclaimStatus {
            history: vec![record("ml/a", now)],
            ..Default::default()
        };
        let read_back: ReclaimStatus =
            serde_json::from_value(serde_json::to_value(&written).unwrap()).unwrap();
        assert_ne!(read_back.history[0].time, written.history[0].time);
        let missing = ledger.missing_from("p", &read_back, window, now);
        assert_eq!(missing, vec![record("ml/b", now)]);
        // Another pool has its own.
        assert!(ledger.missing_from("q", &read_back, window, now).is_empty());
        // Past the window, forgotten.
        let later = now.checked_add(SignedDuration::from_mins(11)).unwrap();
        assert!(
            ledger
                .missing_from("p", &ReclaimStatus::default(), window, later)
                .is_empty()
        );
    }
}
