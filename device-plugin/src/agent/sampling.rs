//! Utilization sampling as a job of the agent: on the pool's interval, each device's activity
//! feeds the idleness tracker, and the kubelet's PodResources API says which pods hold what.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpupool_crds::node::PodRef;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use super::blocking;
use crate::backend::GpuBackend;
use crate::inventory::Inventory;
use crate::podresources::PodSource;
use crate::utilization::{self, DeviceSample, IdleTracker};
use gpupool_crds::node::Activity;

/// The shortest sampling interval honoured, whatever the spec says.
const MIN_INTERVAL: Duration = Duration::from_millis(200);

/// Samples, idleness and the pods holding each device.
pub struct SamplingJob {
    pods_from: PodSource,
    /// Where the host's `/proc` is (the cgroups of the processes on shared GPUs).
    proc_root: PathBuf,
    /// The kubelet's device-plugin directory, which holds its device checkpoint (pod UID →
    /// device IDs): with the cgroups, whose process holds which share.
    device_plugins_dir: PathBuf,
    next: Instant,
    /// Idleness per device, with hysteresis.
    pub idle: IdleTracker,
    /// The last sample per device UUID.
    pub samples: BTreeMap<String, DeviceSample>,
    /// Pods holding each device UUID.
    pub pods: BTreeMap<String, Vec<PodRef>>,
    /// The last PodResources call; `None` before the first.
    pub pod_resources: Option<Result<(), String>>,
    /// When a sample last returned figures (`/metrics` shows its age).
    pub last_success: Option<Instant>,
}

impl SamplingJob {
    /// A job reading PodResources at `socket`, a device idle after `idle_samples` idle samples.
    pub fn new(
        pods_from: PodSource,
        proc_root: PathBuf,
        device_plugins_dir: PathBuf,
        idle_samples: u32,
        now: Instant,
    ) -> SamplingJob {
        SamplingJob {
            pods_from,
            proc_root,
            device_plugins_dir,
            next: now,
            idle: IdleTracker::new(idle_samples),
            samples: BTreeMap::new(),
            pods: BTreeMap::new(),
            pod_resources: None,
            last_success: None,
        }
    }

    /// When the next sample is due.
    pub fn next(&self) -> Instant {
        self.next
    }

    /// Samples if due at `now` (with a backend and an inventory), then schedules the next one
    /// `interval` later. Without `host_processes` (the agent is not in the host's PID
    /// namespace) every device's activity is `Unknown`.
    pub async fn run_if_due(
        &mut self,
        backend: Option<&Arc<dyn GpuBackend>>,
        inventory: Option<&Inventory>,
        idle_threshold: u32,
        interval: Duration,
        host_processes: bool,
        now: Instant,
    ) {
        if now < self.next {
            return;
        }
        if let (Some(backend), Some(inv)) = (backend, inventory) {
            self.sample(
                backend,
                inv,
                idle_threshold,
                interval.max(MIN_INTERVAL),
                host_processes,
            )
            .await;
        }
        self.next = now + interval.max(MIN_INTERVAL);
    }

    async fn sample(
        &mut self,
        backend: &Arc<dyn GpuBackend>,
        inv: &Inventory,
        threshold: u32,
        interval: Duration,
        host_processes: bool,
    ) {
        match self.pods_from.list(Duration::from_secs(5)).await {
            Ok(map) => {
                self.pods = map;
                self.pod_resources = Some(Ok(()));
            }
            Err(e) => {
                self.pods.clear();
                self.pod_resources = Some(Err(e.to_string()));
            }
        }
        // The replicas pods hold, per shared GPU: each is judged on its own processes.
        let mut held: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for id in self.pods.keys() {
            if let Some((device, _)) = id.split_once(crate::plugin::sharing::REPLICA_SEPARATOR) {
                held.entry(device.to_owned()).or_default().push(id.clone());
            }
        }
        let inv2 = inv.clone();
        let proc_root = self.proc_root.clone();
        let device_plugins_dir = self.device_plugins_dir.clone();
        let (samples, shares) = blocking(backend, move |b| {
            let attribution = (!held.is_empty())
                .then(|| crate::attribution::Attribution::read(&proc_root, &device_plugins_dir));
            (
                utilization::sample(b, &inv2, threshold),
                attribution
                    .map(|a| utilization::sample_shares(b, &inv2, &held, &a, threshold))
                    .unwrap_or_default(),
            )
        })
        .await
        .unwrap_or_default();
        let (samples, activity) = observed_activity(samples, shares, host_processes);
        // Three missed samples in a row (and at least a minute: reclaim waits 5 minutes at
        // the least, so shorter stalls do not matter) break an idle run: the time nobody
        // looked is not counted as idle.
        let max_gap = (interval * 3).max(Duration::from_secs(60));
        self.idle.observe(&activity, Timestamp::now(), max_gap);
        if !samples.is_empty() {
            self.last_success = Some(Instant::now());
        }
        self.samples = samples;
    }
}

/// Each device's and share's activity as reported, and the samples with it: as sampled when
/// the agent sees the host's processes, else `Unknown` for all (an empty process list seen from
/// another PID namespace proves nothing, and `Unknown` is never reclaimed).
fn observed_activity(
    mut samples: BTreeMap<String, DeviceSample>,
    shares: BTreeMap<String, Activity>,
    host_processes: bool,
) -> (BTreeMap<String, DeviceSample>, BTreeMap<String, Activity>) {
    if !host_processes {
        for s in samples.values_mut() {
            s.activity = Activity::Unknown;
        }
    }
    let mut activity: BTreeMap<String, Activity> = samples
        .iter()
        .map(|(k, s)| (k.clone(), s.activity))
        .collect();
    for (share, a) in shares {
        let a = if host_processes { a } else { Activity::Unknown };
        activity.insert(share, a);
    }
    (samples, activity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_host_processes_every_activity_is_unknown() {
        let sample = |activity| DeviceSample {
            activity,
            utilization_percent: Some(0),
            memory_used_mib: Some(0),
        };
        let samples = BTreeMap::from([
            ("GPU-a".to_owned(), sample(Activity::Idle)),
            ("MIG-b".to_owned(), sample(Activity::Busy)),
        ]);
        let shares = BTreeMap::from([("GPU-c::0".to_owned(), Activity::Idle)]);
        // (host processes seen?, expected activity of GPU-a, MIG-b, GPU-c::0)
        let cases = [
            (true, [Activity::Idle, Activity::Busy, Activity::Idle]),
            (
                false,
                [Activity::Unknown, Activity::Unknown, Activity::Unknown],
            ),
        ];
        for (seen, want) in cases {
            let (samples, activity) = observed_activity(samples.clone(), shares.clone(), seen);
            let got: Vec<Activity> = ["GPU-a", "MIG-b", "GPU-c::0"]
                .iter()
                .map(|k| activity[*k])
                .collect();
            assert_eq!(got, want, "host processes seen: {seen}");
            assert_eq!(samples["GPU-a"].activity, want[0]);
        }
    }
}
