//! Which GPUs a disruptive change (a MIG layout, a sharing-mode switch) must wait for, from
//! positive evidence only (issue #38).
//!
//! A GPU is free only when the kubelet's PodResources API, read just now, shows no pod holding
//! it or any of its MIG devices or shares, **and** its compute process list reads empty, **and**
//! the agent sees the host's processes at all (its PID namespace is the host's). Anything it
//! cannot read counts as a holder: an unreadable PodResources, an unreadable process list or a
//! foreign PID namespace keeps every GPU it concerns busy. A pod without a CUDA context at the
//! moment still holds its device, so a GPU is never freed by its processes alone.
//!
//! Pure: the caller reads PodResources and the process lists and passes them in.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use gpupool_crds::node::PodRef;

use crate::inventory::Inventory;

/// Why a GPU counts as busy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// A pod holds the GPU, one of its MIG devices or one of its shares (PodResources).
    Pod(PodRef),
    /// Compute processes run on it (NVML).
    Processes(usize),
    /// What holds it cannot be told; the reason says what could not be read.
    Unknown(String),
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::Pod(p) => write!(f, "pod {}/{}", p.namespace, p.name),
            Holder::Processes(1) => f.write_str("1 compute process"),
            Holder::Processes(n) => write!(f, "{n} compute processes"),
            Holder::Unknown(why) => f.write_str(why),
        }
    }
}

/// The busy GPUs (by index) and what holds each; a GPU not listed is free.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Occupancy(BTreeMap<u32, Vec<Holder>>);

impl Occupancy {
    /// Whether `gpu` must be waited for.
    pub fn is_busy(&self, gpu: u32) -> bool {
        self.0.contains_key(&gpu)
    }

    /// The busy GPUs.
    pub fn gpus(&self) -> BTreeSet<u32> {
        self.0.keys().copied().collect()
    }

    /// What holds `gpu` (empty when it is free).
    pub fn holders(&self, gpu: u32) -> &[Holder] {
        self.0.get(&gpu).map(Vec::as_slice).unwrap_or_default()
    }

    /// The holders of those of `gpus` that are busy, for a status message or an Event:
    /// `GPU 0: pod ml/train-0; GPU 1: 2 compute processes`. Empty when all are free.
    pub fn describe(&self, gpus: &[u32]) -> String {
        gpus.iter()
            .filter_map(|g| {
                let holders = self.0.get(g)?;
                let list: Vec<String> = holders.iter().map(Holder::to_string).collect();
                Some(format!("GPU {g}: {}", list.join(", ")))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl FromIterator<(u32, Holder)> for Occupancy {
    fn from_iter<I: IntoIterator<Item = (u32, Holder)>>(iter: I) -> Self {
        let mut out: BTreeMap<u32, Vec<Holder>> = BTreeMap::new();
        for (gpu, holder) in iter {
            let holders = out.entry(gpu).or_default();
            if !holders.contains(&holder) {
                holders.push(holder);
            }
        }
        Occupancy(out)
    }
}

/// Each GPU's index and the device IDs the kubelet can name it by: its UUID and its MIG
/// devices' (a share `<id>::<n>` is listed by PodResources under its device too).
pub fn device_ids(inventory: &Inventory) -> BTreeMap<u32, Vec<String>> {
    inventory
        .gpus
        .iter()
        .map(|g| {
            let own = std::iter::once(g.device.uuid.to_string());
            let migs = g.mig_devices.iter().map(|m| m.uuid.to_string());
            (g.device.index, own.chain(migs).collect())
        })
        .collect()
}

/// The evidence one decision is made from.
#[derive(Debug, Clone, Copy)]
pub struct Evidence<'a> {
    /// Device ID → the pods holding it (PodResources), or why it could not be read.
    pub pods: Result<&'a BTreeMap<String, Vec<PodRef>>, &'a str>,
    /// GPU index → the number of compute processes on it, or why the list could not be read.
    /// A GPU missing here was not read, which is no better than unreadable.
    pub processes: &'a BTreeMap<u32, Result<usize, String>>,
    /// `Ok` when the agent sees the host's processes; else why not.
    pub host_processes: Result<(), &'a str>,
}

/// What holds each GPU of `gpus` (index → device IDs, see [`device_ids`]).
pub fn occupancy(gpus: &BTreeMap<u32, Vec<String>>, evidence: Evidence<'_>) -> Occupancy {
    let mut holders: Vec<(u32, Holder)> = Vec::new();
    for (&gpu, ids) in gpus {
        match evidence.pods {
            Ok(pods) => {
                for id in ids {
                    for pod in pods.get(id).into_iter().flatten() {
                        holders.push((gpu, Holder::Pod(pod.clone())));
                    }
                }
            }
            Err(why) => holders.push((
                gpu,
                Holder::Unknown(format!("the pods holding it are unknown ({why})")),
            )),
        }
        match evidence.host_processes {
            Ok(()) => match evidence.processes.get(&gpu) {
                Some(Ok(0)) => {}
                Some(Ok(n)) => holders.push((gpu, Holder::Processes(*n))),
                Some(Err(why)) => holders.push((
                    gpu,
                    Holder::Unknown(format!("its compute processes are unknown ({why})")),
                )),
                None => holders.push((
                    gpu,
                    Holder::Unknown("its compute processes were not read".to_owned()),
                )),
            },
            Err(why) => holders.push((
                gpu,
                Holder::Unknown(format!("its compute processes cannot be seen ({why})")),
            )),
        }
    }
    holders.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "ml".into(),
            name: name.into(),
            container: Some("main".into()),
        }
    }

    #[test]
    fn a_gpu_is_free_only_on_positive_evidence_from_every_source() {
        let gpus = BTreeMap::from([
            (0, vec!["GPU-0".to_owned(), "MIG-0a".to_owned()]),
            (1, vec!["GPU-1".to_owned()]),
        ]);
        let pods_on_mig = BTreeMap::from([("MIG-0a".to_owned(), vec![pod("infer")])]);
        let shared = BTreeMap::from([
            ("GPU-1".to_owned(), vec![pod("a"), pod("b")]),
            ("GPU-1::0".to_owned(), vec![pod("a")]),
        ]);
        let none = BTreeMap::new();
        let idle = BTreeMap::from([(0, Ok(0)), (1, Ok(0))]);
        let running = BTreeMap::from([(0, Ok(0)), (1, Ok(2))]);
        let unreadable = BTreeMap::from([(0, Ok(0)), (1, Err("GPU is lost".to_owned()))]);
        let half_read = BTreeMap::from([(0, Ok(0))]);
        struct Case<'a> {
            name: &'a str,
            pods: Result<&'a BTreeMap<String, Vec<PodRef>>, &'a str>,
            processes: &'a BTreeMap<u32, Result<usize, String>>,
            host: Result<(), &'a str>,
            busy: &'a [u32],
        }
        let cases = [
            Case {
                name: "nothing holds anything",
                pods: Ok(&none),
                processes: &idle,
                host: Ok(()),
                busy: &[],
            },
            Case {
                name: "a pod on a MIG device with no process holds its GPU",
                pods: Ok(&pods_on_mig),
                processes: &idle,
                host: Ok(()),
                busy: &[0],
            },
            Case {
                name: "pods sharing a GPU hold it",
                pods: Ok(&shared),
                processes: &idle,
                host: Ok(()),
                busy: &[1],
            },
            Case {
                name: "processes alone hold a GPU",
                pods: Ok(&none),
                processes: &running,
                host: Ok(()),
                busy: &[1],
            },
            Case {
                name: "an unreadable PodResources holds every GPU",
                pods: Err("socket not found"),
                processes: &idle,
                host: Ok(()),
                busy: &[0, 1],
            },
            Case {
                name: "an unreadable process list holds its GPU",
                pods: Ok(&none),
                processes: &unreadable,
                host: Ok(()),
                busy: &[1],
            },
            Case {
                name: "a process list never read holds its GPU",
                pods: Ok(&none),
                processes: &half_read,
                host: Ok(()),
                busy: &[1],
            },
            Case {
                name: "without the host's PID namespace an empty list proves nothing",
                pods: Ok(&none),
                processes: &idle,
                host: Err("not the host's PID namespace"),
                busy: &[0, 1],
            },
        ];
        for c in cases {
            let occ = occupancy(
                &gpus,
                Evidence {
                    pods: c.pods,
                    processes: c.processes,
                    host_processes: c.host,
                },
            );
            assert_eq!(
                occ.gpus().into_iter().collect::<Vec<_>>(),
                c.busy,
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn holders_are_named() {
        let gpus = BTreeMap::from([(0, vec!["GPU-0".to_owned()]), (1, vec!["GPU-1".to_owned()])]);
        let pods = BTreeMap::from([("GPU-0".to_owned(), vec![pod("train-0")])]);
        let processes = BTreeMap::from([(0, Ok(1)), (1, Ok(2))]);
        let occ = occupancy(
            &gpus,
            Evidence {
                pods: Ok(&pods),
                processes: &processes,
                host_processes: Ok(()),
            },
        );
        assert_eq!(
            occ.describe(&[0, 1]),
            "GPU 0: pod ml/train-0, 1 compute process; GPU 1: 2 compute processes"
        );
        assert_eq!(occ.holders(0)[0], Holder::Pod(pod("train-0")));
        assert_eq!(occ.describe(&[2]), "", "a free GPU is not described");
    }
}
