//! Driver validation as a job of the agent: when the checks are due (on a timer, at once when
//! the spec's generation changes or a health event arrives), the Xids they judge (from NVML's
//! events and the kernel log), and running them off the async threads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpupool_crds::node::CheckResult;
use gpupool_crds::policy::DriverPolicy;
use tokio::time::Instant;

use super::blocking;
use super::health::XidSeen;
use crate::backend::GpuBackend;
use crate::inventory::Inventory;
use crate::validate::{self, XidLedger};

/// The driver checks, their schedule and the Xids they judge.
pub struct ValidationJob {
    checks: Vec<CheckResult>,
    interval: Duration,
    next: Instant,
    /// The spec generation the checks were last scheduled for.
    generation: Option<i64>,
    /// Fatal Xids from NVML events and the kernel log (shared with the blocking scan task).
    xids: Arc<Mutex<XidLedger>>,
    /// Xids seen through NVML, by (GPU, Xid), for the metrics.
    xid_counts: BTreeMap<(u32, u64), u64>,
}

impl ValidationJob {
    /// Checks every `interval`, the first due at `now`; the kernel log read from `kmsg_path`.
    pub fn new(kmsg_path: PathBuf, interval: Duration, now: Instant) -> ValidationJob {
        ValidationJob {
            checks: Vec::new(),
            interval,
            next: now,
            generation: None,
            xids: Arc::new(Mutex::new(XidLedger::new(kmsg_path))),
            xid_counts: BTreeMap::new(),
        }
    }

    /// The checks as last run (empty before the first run).
    pub fn checks(&self) -> &[CheckResult] {
        &self.checks
    }

    /// Xids seen through NVML, by (GPU, Xid).
    pub fn xid_counts(&self) -> &BTreeMap<(u32, u64), u64> {
        &self.xid_counts
    }

    /// When the checks are next due.
    pub fn next(&self) -> Instant {
        self.next
    }

    /// Something happened to the GPUs: check again at once, counting the Xid if it was one.
    pub fn notice(&mut self, xid: Option<XidSeen>, now: Instant) {
        if let Some(XidSeen { gpu, xid }) = xid {
            *self.xid_counts.entry((gpu, xid)).or_default() += 1;
            self.ledger().record_event(gpu, xid);
        }
        self.next = now;
    }

    /// Whether the checks are due at `now` for a spec of `generation`: a new generation may
    /// change the requirements, so it makes them due at once.
    pub fn due(&mut self, generation: Option<i64>, now: Instant) -> bool {
        if generation != self.generation {
            self.generation = generation;
            self.next = now;
        }
        now >= self.next
    }

    /// The Xid ledger. Every holder finishes its update before it could panic, so a poisoned
    /// ledger is whole.
    fn ledger(&self) -> MutexGuard<'_, XidLedger> {
        self.xids.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the kernel log records that arrived since the last scan, keeping their fatal Xids.
    async fn scan_kernel_log(&mut self) {
        let ledger = self.xids.clone();
        let scanned = tokio::task::spawn_blocking(move || {
            let mut ledger = ledger.lock().unwrap_or_else(|p| p.into_inner());
            let before = ledger.kernel_log().clone();
            (before, ledger.scan_kernel_log())
        })
        .await;
        match scanned {
            Ok((_, Ok(0))) => {}
            Ok((_, Ok(found))) => tracing::info!(xids = found, "Xid records in the kernel log"),
            Ok((before, Err(e))) => {
                // Warn once per distinct failure, not on every validation run.
                if self.ledger().kernel_log() != &before {
                    tracing::warn!(error = %e, "kernel log not readable: only Xids since the agent started are counted");
                }
            }
            Err(e) => tracing::warn!(error = %e, "kernel log scan task failed"),
        }
    }

    /// Runs the checks of `policy` against the driver under `driver_root`, and schedules the
    /// next run one interval after `now`.
    pub async fn run(
        &mut self,
        backend: &Result<Arc<dyn GpuBackend>, String>,
        driver_root: PathBuf,
        proc_root: &Path,
        policy: &DriverPolicy,
        inventory: Option<&Inventory>,
        now: Instant,
    ) {
        self.scan_kernel_log().await;
        let gpus: Vec<(u32, String)> = inventory
            .map(|inv| {
                inv.gpus
                    .iter()
                    .map(|g| (g.device.index, g.device.pci_bus_id.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let xids = self.ledger().observations(&gpus);
        let proc_root = proc_root.to_path_buf();
        let observed = match backend {
            Ok(b) => blocking(b, move |b| {
                validate::observe(Ok(b), &driver_root, &proc_root, xids)
            })
            .await
            .unwrap_or_else(|| {
                validate::observe(
                    Err("validation task failed".into()),
                    &PathBuf::new(),
                    &PathBuf::new(),
                    validate::XidObservations::default(),
                )
            }),
            Err(e) => validate::observe(Err(e.clone()), &driver_root, &proc_root, xids),
        };
        self.checks = validate::run_checks(policy, &observed);
        self.next = now + self.interval;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_are_due_on_the_timer_a_new_generation_or_a_notice() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut job = ValidationJob::new("/nonexistent/kmsg".into(), s(60), t0);
        // (what happens, generation, at, due?)
        assert!(job.due(Some(1), t0), "the first run is due at once");
        job.next = t0 + s(60); // as `run` leaves it
        assert!(
            !job.due(Some(1), t0 + s(1)),
            "same generation, before the interval"
        );
        assert!(
            job.due(Some(2), t0 + s(2)),
            "a new generation is due at once"
        );
        job.next = t0 + s(62);
        assert!(!job.due(Some(2), t0 + s(3)));
        assert!(job.due(Some(2), t0 + s(62)), "the timer");
        job.next = t0 + s(122);
        job.notice(None, t0 + s(70));
        assert!(job.due(Some(2), t0 + s(70)), "a health event");
        job.next = t0 + s(130);
        assert!(
            job.due(None, t0 + s(71)),
            "a GpuNode without generation is a change too"
        );
    }

    #[test]
    fn nvml_xids_are_counted_per_gpu() {
        let mut job = ValidationJob::new(
            "/nonexistent/kmsg".into(),
            Duration::from_secs(60),
            Instant::now(),
        );
        let now = Instant::now();
        job.notice(Some(XidSeen { gpu: 0, xid: 79 }), now);
        job.notice(Some(XidSeen { gpu: 0, xid: 79 }), now);
        job.notice(Some(XidSeen { gpu: 1, xid: 13 }), now);
        job.notice(None, now);
        let counts: Vec<_> = job.xid_counts().iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(counts, [((0, 79), 2), ((1, 13), 1)]);
    }
}
