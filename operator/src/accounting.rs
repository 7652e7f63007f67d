//! GPU-time accounting: GPU-seconds allocated to pods, and the part of them the GPUs sat idle,
//! per pool and namespace, from what the agents report in GpuNode status (the pods holding
//! each device and its `idleSince`).
//!
//! The leader samples its GpuNode cache every `--accounting-interval` and adds, for each
//! device holding pods, the time since the previous sample to `allocated`, and the part of it
//! after the device's `idleSince` to `idle`. The counters live in the leader's process: they
//! start at zero when a replica becomes leader (Prometheus' `increase()` and `rate()` treat
//! that as a counter reset) and do not count while no replica leads. A device's share of a GPU
//! is 1 for a whole GPU and its compute slices over the GPU's for a MIG device; a device shared
//! by several pods (time-slicing, MPS) splits its share between them, so summing over namespaces
//! gives GPU-seconds, never more than the pool's GPUs times the elapsed time; each such pod is
//! idle from its own share's `idleSince` where the agent reports one (its own processes).

use std::collections::BTreeMap;

use gpupool_crds::GpuNode;
use gpupool_crds::node::{GpuStatus, Idleness, share_of};
use k8s_openapi::jiff::Timestamp;

/// A (pool, namespace) pair, the labels of the accounting counters.
pub type Key = (String, String);

/// GPU-seconds to add per (pool, namespace).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Accrual {
    /// Allocated to pods of the namespace.
    pub allocated: BTreeMap<Key, f64>,
    /// Allocated and idle.
    pub idle: BTreeMap<Key, f64>,
}

/// One pod's share of one device.
#[derive(Debug, Clone, PartialEq)]
struct Share {
    namespace: String,
    /// Fraction of a GPU.
    weight: f64,
    idle_since: Option<Timestamp>,
}

/// The fraction of a GPU a MIG device of `profile` is on a GPU of `model`: its compute slices
/// over the GPU's. A profile or model the catalog does not know counts as a seventh per
/// compute slice (`3g.40gb` → 3/7), the split of every MIG-capable GPU but the A30.
fn mig_weight(model: &str, profile: &str) -> f64 {
    let catalog = gpupool_mig_catalog::model_by_product_name(model);
    let total = catalog.map_or(7, |m| m.compute_slices).max(1);
    // `1c.3g.40gb`: a compute instance of 1 slice in a 3-slice GPU instance.
    let compute = profile
        .split_once("c.")
        .and_then(|(c, _)| c.parse::<u32>().ok())
        .or_else(|| {
            catalog
                .and_then(|m| m.profile(profile))
                .map(|p| p.compute_slices)
        })
        .or_else(|| profile.split_once('g')?.0.parse().ok())
        .unwrap_or(1);
    f64::from(compute.min(total)) / f64::from(total)
}

/// Each pod's share of a device of `weight` held as `idleness` says. A pod the agent reports a
/// share of (`shares`: sharing pods judged on their own processes) is idle from its share's
/// `idleSince`; the others from the device's.
fn split(idleness: &Idleness, shares: &[Idleness], weight: f64, out: &mut Vec<Share>) {
    let holders = idleness.pods.len();
    if holders == 0 {
        return;
    }
    for pod in &idleness.pods {
        let own = share_of(shares, pod);
        out.push(Share {
            namespace: pod.namespace.to_string(),
            weight: weight / holders as f64,
            idle_since: own.unwrap_or(idleness).idle_since.as_ref().map(|t| t.0),
        });
    }
}

/// The pods' shares of one GPU: the GPU itself, or its MIG devices when MIG is on.
fn gpu_shares(gpu: &GpuStatus, out: &mut Vec<Share>) {
    if gpu.mig_enabled {
        for m in &gpu.mig_devices {
            split(&m.idleness, &[], mig_weight(&gpu.model, &m.profile), out);
        }
    } else {
        split(&gpu.idleness, &gpu.shares, 1.0, out);
    }
}

/// What the GpuNodes say was allocated and idle over `(from, to]`, counting the state they
/// show now as the state of the whole interval, except that idle time starts at `idleSince`
/// when that falls inside it. A sample thus over- or under-counts a change by at most one
/// interval.
pub fn accrue<'a>(
    gpunodes: impl IntoIterator<Item = &'a GpuNode>,
    from: Timestamp,
    to: Timestamp,
) -> Accrual {
    let mut acc = Accrual::default();
    let elapsed = to.duration_since(from).as_secs_f64();
    if elapsed <= 0.0 {
        return acc;
    }
    for gn in gpunodes {
        let Some(status) = &gn.status else { continue };
        let mut shares = Vec::new();
        for gpu in &status.gpus {
            gpu_shares(gpu, &mut shares);
        }
        for share in shares {
            let key = (gn.spec.pool.clone(), share.namespace);
            *acc.allocated.entry(key.clone()).or_default() += share.weight * elapsed;
            if let Some(since) = share.idle_since {
                let idle = to.duration_since(since.max(from)).as_secs_f64();
                if idle > 0.0 {
                    *acc.idle.entry(key).or_default() += share.weight * idle;
                }
            }
        }
    }
    acc
}

/// The sampler's memory: when it last sampled.
#[derive(Debug, Default)]
pub struct Accountant {
    last: Option<Timestamp>,
}

impl Accountant {
    /// The accrual since the previous sample (nothing at the first: there is no interval yet).
    pub fn sample<'a>(
        &mut self,
        gpunodes: impl IntoIterator<Item = &'a GpuNode>,
        now: Timestamp,
    ) -> Accrual {
        let acc = match self.last {
            Some(from) if from < now => accrue(gpunodes, from, now),
            _ => Accrual::default(),
        };
        if self.last.is_none_or(|l| l < now) {
            self.last = Some(now);
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use gpupool_crds::node::{Activity, GpuNodeStatus, MigDeviceStatus, PodRef};
    use gpupool_crds::{GpuNode, GpuNodeSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    fn held(pods: &[&str], idle_since: Option<i64>) -> Idleness {
        Idleness {
            activity: if idle_since.is_some() {
                Activity::Idle
            } else {
                Activity::Busy
            },
            idle_since: idle_since.map(|s| Time(t(s))),
            pods: pods
                .iter()
                .map(|ns| PodRef {
                    namespace: (*ns).into(),
                    name: format!("{ns}-pod"),
                    container: None,
                })
                .collect(),
        }
    }

    fn node(pool: &str, gpus: Vec<GpuStatus>) -> GpuNode {
        let mut gn = GpuNode::new(
            "n",
            GpuNodeSpec {
                pool: pool.into(),
                sharing: Default::default(),
                driver: Default::default(),
                cdi: Default::default(),
                mig: Default::default(),
                utilization: Default::default(),
            },
        );
        gn.status = Some(GpuNodeStatus {
            gpus,
            ..Default::default()
        });
        gn
    }

    fn gpu(idleness: Idleness) -> GpuStatus {
        GpuStatus {
            model: "NVIDIA H100 80GB HBM3".into(),
            idleness,
            ..Default::default()
        }
    }

    fn key(pool: &str, ns: &str) -> Key {
        (pool.into(), ns.into())
    }

    #[test]
    fn whole_gpus_shared_gpus_and_idle_time() {
        let gn = node(
            "training",
            vec![
                // Busy for the whole interval.
                gpu(held(&["a"], None)),
                // Idle since before the interval: all of it idle.
                gpu(held(&["a"], Some(-100))),
                // Idle from 40 s into the 60 s interval.
                gpu(held(&["b"], Some(40))),
                // Time-sliced between two namespaces, idle throughout.
                gpu(held(&["a", "b"], Some(-5))),
                // Nobody holds it: neither allocated nor idle.
                gpu(held(&[], Some(-100))),
            ],
        );
        let acc = accrue([&gn], t(0), t(60));
        assert_eq!(acc.allocated[&key("training", "a")], 60.0 + 60.0 + 30.0);
        assert_eq!(acc.allocated[&key("training", "b")], 60.0 + 30.0);
        assert_eq!(acc.idle[&key("training", "a")], 60.0 + 30.0);
        assert_eq!(acc.idle[&key("training", "b")], 20.0 + 30.0);
        let total: f64 = acc.allocated.values().sum();
        assert_eq!(total, 4.0 * 60.0, "never more than the held GPUs' time");
    }

    #[test]
    fn a_shared_gpus_tenants_are_idle_from_their_own_shares() {
        // Busy as a whole (b works), a's share idle from 30 s into the interval.
        let mut shared = gpu(held(&["a", "b"], None));
        shared.shares = vec![held(&["a"], Some(30)), held(&["b"], None)];
        let acc = accrue([&node("p", vec![shared])], t(0), t(60));
        assert_eq!(acc.allocated[&key("p", "a")], 30.0);
        assert_eq!(acc.idle[&key("p", "a")], 15.0, "half a GPU for 30 s");
        assert!(!acc.idle.contains_key(&key("p", "b")));
    }

    #[test]
    fn mig_devices_count_as_their_compute_slices() {
        let mut h100 = gpu(Idleness::default());
        h100.mig_enabled = true;
        h100.mig_devices = vec![
            MigDeviceStatus {
                profile: "1g.10gb".into(),
                idleness: held(&["a"], Some(-1)),
                ..Default::default()
            },
            MigDeviceStatus {
                profile: "3g.40gb".into(),
                idleness: held(&["b"], None),
                ..Default::default()
            },
            MigDeviceStatus {
                profile: "1c.3g.40gb".into(),
                idleness: held(&["c"], None),
                ..Default::default()
            },
        ];
        let acc = accrue([&node("inference", vec![h100])], t(0), t(70));
        assert_eq!(acc.allocated[&key("inference", "a")], 10.0);
        assert_eq!(acc.idle[&key("inference", "a")], 10.0);
        assert_eq!(acc.allocated[&key("inference", "b")], 30.0);
        assert_eq!(acc.allocated[&key("inference", "c")], 10.0);
        assert!(!acc.idle.contains_key(&key("inference", "b")));
        assert!((mig_weight("NVIDIA A30", "1g.6gb") - 0.25).abs() < 1e-9);
        assert!((mig_weight("unknown", "2g.20gb") - 2.0 / 7.0).abs() < 1e-9);
    }

    #[test]
    fn the_first_sample_opens_the_interval_and_time_never_runs_back() {
        let gn = node("p", vec![gpu(held(&["a"], Some(-10)))]);
        let mut acc = Accountant::default();
        assert_eq!(acc.sample([&gn], t(0)), Accrual::default());
        let a = acc.sample([&gn], t(15));
        assert_eq!(a.allocated[&key("p", "a")], 15.0);
        assert_eq!(a.idle[&key("p", "a")], 15.0);
        // A clock that steps back adds nothing and keeps the high-water mark.
        assert_eq!(acc.sample([&gn], t(5)), Accrual::default());
        assert_eq!(acc.sample([&gn], t(20)).allocated[&key("p", "a")], 5.0);
        // An idleSince in the future (a skewed node clock) adds no idle time.
        let skewed = node("p", vec![gpu(held(&["a"], Some(100)))]);
        let a = acc.sample([&skewed], t(30));
        assert_eq!(a.allocated[&key("p", "a")], 10.0);
        assert!(a.idle.is_empty());
    }
}
