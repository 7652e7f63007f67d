//! Utilization and idleness: samples each device and keeps `idleSince` with hysteresis (the pods
//! holding each device come from [`crate::podresources`]).
//!
//! Whole GPUs are judged by NVML utilization against the pool's threshold. NVML reports no
//! utilization for MIG devices, so a MIG device is busy while a compute process runs in it and
//! idle otherwise (GPM metrics would be finer, but the backend does not expose them). A device
//! whose activity cannot be observed is `Unknown`, which is never idle.

use std::collections::BTreeMap;

use gpupool_crds::node::{Activity, Idleness, PodRef};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::backend::{ErrorKind, GpuBackend};
use crate::inventory::Inventory;

/// What one sample of one device showed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceSample {
    /// Busy, idle or unknown.
    pub activity: Activity,
    /// SM utilization, percent, when NVML reports it.
    pub utilization_percent: Option<u32>,
    /// GPU memory used by compute processes, MiB.
    pub memory_used_mib: Option<u64>,
}

/// Samples every GPU and MIG device, keyed by UUID.
pub fn sample(
    backend: &dyn GpuBackend,
    inventory: &Inventory,
    idle_threshold: u32,
) -> BTreeMap<String, DeviceSample> {
    let mut out = BTreeMap::new();
    for gpu in &inventory.gpus {
        let index = gpu.device.index;
        let processes = backend.processes(index);
        let memory = processes
            .as_ref()
            .ok()
            .map(|ps| ps.iter().filter_map(|p| p.used_memory_mib).sum::<u64>());
        if gpu.mig_enabled() {
            // The whole GPU is not handed out under MIG; its MIG devices carry the activity.
            out.insert(
                gpu.device.uuid.to_string(),
                DeviceSample {
                    activity: Activity::Unknown,
                    utilization_percent: None,
                    memory_used_mib: memory,
                },
            );
            for mig in &gpu.mig_devices {
                let sample = match &processes {
                    Ok(ps) => {
                        let mine: Vec<_> = ps
                            .iter()
                            .filter(|p| {
                                p.gpu_instance == Some(mig.gpu_instance)
                                    && p.compute_instance.is_none_or(|c| c == mig.compute_instance)
                            })
                            .collect();
                        DeviceSample {
                            activity: if mine.is_empty() {
                                Activity::Idle
                            } else {
                                Activity::Busy
                            },
                            utilization_percent: None,
                            memory_used_mib: Some(
                                mine.iter().filter_map(|p| p.used_memory_mib).sum(),
                            ),
                        }
                    }
                    // An unreadable process list says nothing: unknown, never idle.
                    Err(_) => DeviceSample {
                        activity: Activity::Unknown,
                        utilization_percent: None,
                        memory_used_mib: None,
                    },
                };
                out.insert(mig.uuid.to_string(), sample);
            }
            continue;
        }
        let sample = match backend.utilization(index) {
            Ok(u) => DeviceSample {
                activity: if u.gpu_percent > idle_threshold {
                    Activity::Busy
                } else {
                    Activity::Idle
                },
                utilization_percent: Some(u.gpu_percent),
                memory_used_mib: memory,
            },
            Err(e) => {
                if e.kind() != ErrorKind::NotSupported {
                    tracing::debug!(gpu = index, error = %e, "utilization unreadable");
                }
                DeviceSample {
                    activity: Activity::Unknown,
                    utilization_percent: None,
                    memory_used_mib: memory,
                }
            }
        };
        out.insert(gpu.device.uuid.to_string(), sample);
    }
    out
}

/// The activity of every share a pod holds on a shared whole GPU (`held`: GPU UUID → the replica
/// IDs held on it), keyed by replica ID (see [`share_activity`]). Shares of MIG devices are not
/// told apart here: the reclaimer judges those by their device.
pub fn sample_shares(
    backend: &dyn GpuBackend,
    inventory: &Inventory,
    held: &BTreeMap<String, Vec<String>>,
    attribution: &crate::attribution::Attribution,
    threshold: u32,
) -> BTreeMap<String, Activity> {
    let mut out = BTreeMap::new();
    for gpu in inventory.gpus.iter().filter(|g| !g.mig_enabled()) {
        let Some(replicas) = held.get(gpu.device.uuid.as_str()) else {
            continue;
        };
        let index = gpu.device.index;
        let activity = match backend.processes(index) {
            Ok(ps) => {
                let pids: Vec<u32> = ps.iter().map(|p| p.pid).collect();
                let used = backend.process_utilization(index).ok();
                share_activity(
                    replicas,
                    &pids,
                    used.as_deref(),
                    |pid| attribution.owner(pid),
                    threshold,
                )
            }
            Err(_) => replicas
                .iter()
                .map(|r| (r.clone(), Activity::Unknown))
                .collect(),
        };
        out.extend(activity);
    }
    out
}

/// Each share (replica ID in `held`) of one shared GPU, judged on its own processes: busy when
/// one of them used more than `threshold` percent of the SM time (`used`, NVML's per-process
/// samples; a running process without a sample used none), idle otherwise, a share without
/// processes included. A busy process whose share cannot be told (`owner` gives `None`) could be
/// anyone's: then every share is unknown. Without per-process samples, every share is unknown.
pub fn share_activity(
    held: &[String],
    processes: &[u32],
    used: Option<&[crate::backend::ProcessUtilization]>,
    owner: impl Fn(u32) -> Option<Vec<String>>,
    threshold: u32,
) -> BTreeMap<String, Activity> {
    let unknown = || {
        held.iter()
            .map(|h| (h.clone(), Activity::Unknown))
            .collect()
    };
    let Some(used) = used else {
        return unknown();
    };
    let mut out: BTreeMap<String, Activity> =
        held.iter().map(|h| (h.clone(), Activity::Idle)).collect();
    for &pid in processes {
        let sm = used
            .iter()
            .find(|u| u.pid == pid)
            .map_or(0, |u| u.sm_percent);
        if sm <= threshold {
            continue;
        }
        match owner(pid) {
            Some(ids) => {
                for id in ids {
                    if let Some(a) = out.get_mut(&id) {
                        *a = Activity::Busy;
                    }
                }
            }
            None => return unknown(),
        }
    }
    out
}

#[derive(Debug, Clone, Default, PartialEq)]
struct DeviceIdle {
    reported: Activity,
    idle_run: u32,
    run_started: Option<Timestamp>,
    idle_since: Option<Timestamp>,
    last_sample: Option<Timestamp>,
}

/// Per-device idleness with hysteresis: a device is reported idle only after `idle_samples`
/// consecutive idle samples, with `idleSince` at the first of them; one busy sample makes it
/// busy again and clears `idleSince`; an unknown sample makes it unknown. Samples further apart
/// than the `max_gap` given to [`IdleTracker::observe`] are not consecutive: nobody looked in
/// between (agent stopped, hung or starved), so the run starts again rather than count the gap
/// as idle time.
#[derive(Debug, Clone)]
pub struct IdleTracker {
    idle_samples: u32,
    devices: BTreeMap<String, DeviceIdle>,
}

impl IdleTracker {
    /// A tracker that needs `idle_samples` (at least 1) idle samples in a row.
    pub fn new(idle_samples: u32) -> IdleTracker {
        IdleTracker {
            idle_samples: idle_samples.max(1),
            devices: BTreeMap::new(),
        }
    }

    /// Feeds one round of samples taken at `now` (seconds precision, as the API stores it);
    /// a device last sampled more than `max_gap` before starts over.
    pub fn observe(
        &mut self,
        samples: &BTreeMap<String, Activity>,
        now: Timestamp,
        max_gap: std::time::Duration,
    ) {
        let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
        self.devices.retain(|k, _| samples.contains_key(k));
        for (uuid, activity) in samples {
            let d = self.devices.entry(uuid.clone()).or_default();
            let gap = d
                .last_sample
                .map(|last| now.duration_since(last).unsigned_abs());
            if gap.is_some_and(|g| g > max_gap) {
                *d = DeviceIdle::default();
            }
            d.last_sample = Some(now);
            match activity {
                Activity::Busy => {
                    *d = DeviceIdle {
                        reported: Activity::Busy,
                        last_sample: Some(now),
                        ..DeviceIdle::default()
                    }
                }
                Activity::Unknown => {
                    *d = DeviceIdle {
                        last_sample: Some(now),
                        ..DeviceIdle::default()
                    }
                }
                Activity::Idle => {
                    if d.idle_run == 0 {
                        d.run_started = Some(now);
                    }
                    d.idle_run = d.idle_run.saturating_add(1);
                    if d.idle_run >= self.idle_samples {
                        d.reported = Activity::Idle;
                        d.idle_since = d.run_started;
                    }
                }
            }
        }
    }

    /// Idleness of a device for status, with the pods holding it.
    pub fn idleness(&self, uuid: &str, pods: Vec<PodRef>) -> Idleness {
        let d = self.devices.get(uuid).cloned().unwrap_or_default();
        Idleness {
            activity: d.reported,
            idle_since: d.idle_since.map(Time),
            pods,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    /// Test rounds are 30 s apart; more than 90 s is a gap.
    const MAX_GAP: std::time::Duration = std::time::Duration::from_secs(90);

    fn round(t: &mut IdleTracker, a: Activity, s: i64) -> Idleness {
        t.observe(
            &[("GPU-a".to_owned(), a)].into_iter().collect(),
            at(s),
            MAX_GAP,
        );
        t.idleness("GPU-a", vec![])
    }

    #[test]
    fn a_gap_between_samples_is_not_idle_time() {
        let mut t = IdleTracker::new(2);
        round(&mut t, Activity::Idle, 0);
        let idle = round(&mut t, Activity::Idle, 30);
        assert_eq!(idle.activity, Activity::Idle);
        assert_eq!(idle.idle_since.map(|t| t.0), Some(at(0)));
        // Nothing sampled for an hour (agent hung), then idle again: the run starts over at
        // the new sample instead of claiming the GPU idle since before the gap.
        let after = round(&mut t, Activity::Idle, 3600);
        assert_eq!(
            (after.activity, after.idle_since),
            (Activity::Unknown, None)
        );
        let again = round(&mut t, Activity::Idle, 3630);
        assert_eq!(again.activity, Activity::Idle);
        assert_eq!(again.idle_since.map(|t| t.0), Some(at(3600)));
        // Samples within the gap keep the run going.
        let on = round(&mut t, Activity::Idle, 3700);
        assert_eq!(on.idle_since.map(|t| t.0), Some(at(3600)));
    }

    #[test]
    fn idle_needs_consecutive_samples_and_busy_clears() {
        let mut t = IdleTracker::new(2);
        assert_eq!(round(&mut t, Activity::Busy, 0).activity, Activity::Busy);
        let first = round(&mut t, Activity::Idle, 30);
        assert_eq!(
            (first.activity, first.idle_since.is_none()),
            (Activity::Busy, true)
        );
        let second = round(&mut t, Activity::Idle, 60);
        assert_eq!(second.activity, Activity::Idle);
        assert_eq!(
            second.idle_since,
            Some(Time(at(30))),
            "idleSince is the first idle sample"
        );
        let third = round(&mut t, Activity::Idle, 90);
        assert_eq!(third.idle_since, Some(Time(at(30))), "stable while idle");
        let busy = round(&mut t, Activity::Busy, 120);
        assert_eq!((busy.activity, busy.idle_since), (Activity::Busy, None));
    }

    #[test]
    fn unknown_is_never_idle() {
        let mut t = IdleTracker::new(1);
        round(&mut t, Activity::Idle, 0);
        let u = round(&mut t, Activity::Unknown, 10);
        assert_eq!((u.activity, u.idle_since), (Activity::Unknown, None));
    }

    #[test]
    fn a_mig_device_whose_processes_cannot_be_read_is_unknown_not_idle() {
        use crate::backend::{
            CiProfileId, Fault, FaultKind, GiProfileId, ManualSimClock, SimBackend,
        };
        let fixture = serde_yaml::from_str(
            "driver: {version: \"550.54.15\", cuda: \"12.4\"}\n\
             gpus: [{model: A30-24GB, mig_enabled: true}]\n",
        )
        .unwrap();
        let sim = SimBackend::new(fixture, std::sync::Arc::new(ManualSimClock::new())).unwrap();
        let gi = sim.create_gpu_instance(0, GiProfileId(0), None).unwrap();
        sim.create_compute_instance(0, gi.id, CiProfileId(0))
            .unwrap();
        let inventory = Inventory::read(&sim).unwrap();
        let mig = inventory.gpus[0].mig_devices[0].uuid.to_string();
        assert_eq!(sample(&sim, &inventory, 0)[&mig].activity, Activity::Idle);

        // Every query now fails, the process list included.
        sim.inject(Fault::gpu(0, FaultKind::FallenOffBus)).unwrap();
        let after = sample(&sim, &inventory, 0);
        assert_eq!(after[&mig].activity, Activity::Unknown);
        assert_eq!(
            after[&inventory.gpus[0].device.uuid.to_string()].activity,
            Activity::Unknown
        );
    }

    #[test]
    fn sub_second_times_are_truncated() {
        let mut t = IdleTracker::new(1);
        let ts = Timestamp::from_millisecond(1_700_000_000_500).unwrap();
        t.observe(
            &[("GPU-a".to_owned(), Activity::Idle)].into_iter().collect(),
            ts,
            MAX_GAP,
        );
        assert_eq!(
            t.idleness("GPU-a", vec![]).idle_since,
            Some(Time(Timestamp::from_second(1_700_000_000).unwrap()))
        );
    }
}
