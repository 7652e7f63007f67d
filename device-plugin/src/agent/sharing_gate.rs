//! A change of sharing mode waits for the GPUs it changes to be free, as a MIG change does.
//!
//! Pods on a GPU were admitted under its mode: an exclusive pod must not suddenly share, and an
//! MPS client must not lose its server under it. So when the GpuNode's sharing would change the
//! mode (exclusive, time-slicing, MPS) of a GPU that pods hold, the agent keeps the sharing it
//! last applied, reports the node `Draining` on those GPUs (reason `SharingChange`) through the
//! MIG status the operator already drains by (fence taint, evictions, PDBs), and applies the new
//! sharing once they are free. Changes that keep every GPU's mode (replicas, limits, placement)
//! and changes on free GPUs apply at once. Pure: the caller passes what pods hold.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_crds::node::{GpuStatus, MigState, NodeMigStatus, PodRef};
use gpupool_crds::policy::{MigStrategy, SharingPolicy};

use crate::inventory::Inventory;

/// How one GPU is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One pod per device.
    Exclusive,
    /// Time-slicing replicas (of the GPU or of its MIG devices).
    TimeSlicing,
    /// MPS clients.
    Mps,
}

/// Each GPU's mode under `sharing`.
pub fn modes(
    inventory: &Inventory,
    sharing: &SharingPolicy,
    strategy: MigStrategy,
) -> BTreeMap<u32, Mode> {
    inventory
        .gpus
        .iter()
        .map(|g| {
            let index = g.device.index;
            let mps = sharing.mps.as_ref().is_some_and(|m| {
                !g.mig_enabled() && m.gpus.as_ref().is_none_or(|s| s.contains(&index))
            });
            let ts = sharing.time_slicing.as_ref().is_some_and(|ts| {
                let resources: Vec<String> = if !g.mig_enabled() || strategy != MigStrategy::Mixed {
                    vec!["nvidia.com/gpu".into()]
                } else {
                    g.mig_devices
                        .iter()
                        .map(|m| {
                            format!("nvidia.com/mig-{}", m.profile.to_string().replace('+', "."))
                        })
                        .collect()
                };
                ts.gpus.as_ref().is_none_or(|s| s.contains(&index))
                    && ts
                        .resources
                        .as_ref()
                        .is_none_or(|want| resources.iter().any(|r| want.contains(r)))
            });
            let mode = if mps {
                Mode::Mps
            } else if ts {
                Mode::TimeSlicing
            } else {
                Mode::Exclusive
            };
            (index, mode)
        })
        .collect()
}

/// A GPU's mode as evidence from before a restart shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recovered {
    /// Known: the last published status named it, or a pod holds the whole device.
    Mode(Mode),
    /// Pods hold shares of it (`<UUID>::<n>`): time-sliced or MPS, which is not told.
    Shared,
}

impl Recovered {
    /// Whether pods admitted under this mode may stay under `mode`.
    fn admits(self, mode: Mode) -> bool {
        match self {
            Recovered::Mode(m) => m == mode,
            Recovered::Shared => mode != Mode::Exclusive,
        }
    }
}

/// The sharing the agent has applied, held back while a mode change waits for pods to leave.
#[derive(Debug, Default)]
pub struct SharingGate {
    applied: Option<SharingPolicy>,
    /// Each GPU's mode as the GpuNode's last published status showed it (see
    /// [`SharingGate::restore`]).
    published: BTreeMap<u32, Mode>,
    draining: Vec<u32>,
    /// GPUs not advertised at all: after a restart, pods hold them under a shared mode the
    /// wanted sharing would change, and that mode cannot be rebuilt from what is known.
    withheld: Vec<u32>,
    /// Why the pods on the node are not known, while that holds the change.
    unknown_pods: Option<String>,
}

impl SharingGate {
    /// Takes up each GPU's sharing mode from the GpuNode's last published status (a restarted
    /// agent's evidence of what the pods on the node were admitted under).
    pub fn restore(&mut self, gpus: &[GpuStatus]) {
        self.published = gpus
            .iter()
            .map(|g| {
                let mode = match g.sharing.as_ref().map(|s| s.mode.as_str()) {
                    Some("MPS") => Mode::Mps,
                    Some("TimeSlicing") => Mode::TimeSlicing,
                    _ => Mode::Exclusive,
                };
                (g.index, mode)
            })
            .collect();
    }

    /// The sharing to apply now, given the GpuNode's (`desired`) and the pods holding devices
    /// (PodResources: device ID → pods, or why it could not be read, which counts every GPU as
    /// held). A mode change on a held GPU waits. After a restart (nothing applied yet) each
    /// GPU's current mode is recovered from what its pods hold and the last published status,
    /// never assumed: a held GPU keeps it (an exclusive one stays exclusive, a shared one the
    /// wanted sharing would change is withheld, see [`SharingGate::withheld`]).
    pub fn step(
        &mut self,
        inventory: &Inventory,
        desired: &SharingPolicy,
        strategy: MigStrategy,
        pods: Result<&BTreeMap<String, Vec<PodRef>>, &str>,
    ) -> SharingPolicy {
        if self.settled(desired) {
            self.draining.clear();
            self.withheld.clear();
            self.unknown_pods = None;
            return desired.clone();
        }
        let after = modes(inventory, desired, strategy);
        let held = held_gpus(inventory, pods);
        self.unknown_pods = pods.err().map(str::to_owned);
        let Some(applied) = &self.applied else {
            let recovered = recover(inventory, pods.ok(), &self.published);
            // A GPU nothing is known of (pods unreadable, no published status: a new GpuNode)
            // is served exclusive, the mode every device plugin starts from, so an agent that
            // cannot read PodResources still serves its whole GPUs; a shared mode waits for
            // evidence.
            self.draining = after
                .iter()
                .filter(|(i, mode)| {
                    held.contains(i)
                        && match recovered.get(i) {
                            Some(r) => !r.admits(**mode),
                            None => **mode != Mode::Exclusive,
                        }
                })
                .map(|(i, _)| *i)
                .collect();
            if self.draining.is_empty() {
                self.applied = Some(desired.clone());
                self.withheld.clear();
                return desired.clone();
            }
            let exclusive: Vec<u32> = self
                .draining
                .iter()
                .copied()
                .filter(|i| recovered.get(i) == Some(&Recovered::Mode(Mode::Exclusive)))
                .collect();
            self.withheld = self
                .draining
                .iter()
                .copied()
                .filter(|i| !exclusive.contains(i))
                .collect();
            return without_gpus(desired, inventory, &self.draining);
        };
        let before = modes(inventory, applied, strategy);
        self.draining = after
            .iter()
            .filter(|(i, mode)| before.get(i).is_some_and(|b| b != *mode) && held.contains(i))
            .map(|(i, _)| *i)
            .collect();
        if self.draining.is_empty() {
            self.applied = Some(desired.clone());
        }
        self.applied.clone().unwrap_or_default()
    }

    /// Whether `desired` is what is applied: the step needs no evidence of the pods then.
    pub fn settled(&self, desired: &SharingPolicy) -> bool {
        self.applied.as_ref() == Some(desired)
    }

    /// The GPUs not to advertise while their pods leave (see [`SharingGate::step`]).
    pub fn withheld(&self) -> &[u32] {
        &self.withheld
    }

    /// The GPUs waiting for their pods to leave before their mode changes.
    pub fn draining(&self) -> &[u32] {
        &self.draining
    }

    /// `mig` as GpuNode status shows it: `Draining` on the waiting GPUs (reason
    /// `SharingChange`) while MIG itself has nothing under way.
    pub fn status(&self, mig: NodeMigStatus) -> NodeMigStatus {
        let mig_quiet = matches!(mig.state, MigState::Idle | MigState::Applied);
        if self.draining.is_empty() || !mig_quiet {
            return mig;
        }
        let list: Vec<String> = self.draining.iter().map(u32::to_string).collect();
        let mut message = format!(
            "GPU {} change sharing mode: waiting for the pods on them to leave",
            list.join(", ")
        );
        if let Some(why) = &self.unknown_pods {
            message.push_str(&format!(
                " (the pods on the node cannot be read, so every GPU counts as held: {why})"
            ));
        }
        if !self.withheld.is_empty() {
            let list: Vec<String> = self.withheld.iter().map(u32::to_string).collect();
            message.push_str(&format!(
                "; GPU {} not advertised meanwhile: pods hold shares of them",
                list.join(", ")
            ));
        }
        NodeMigStatus {
            state: MigState::Draining,
            reason: Some("SharingChange".into()),
            message: Some(message),
            gpus: self.draining.clone(),
            observed_generation: mig.observed_generation,
        }
    }
}

/// The GPUs pods hold (a GPU's UUID, a MIG device's on it, or a share of either, which
/// PodResources lists under its device too); every GPU when PodResources could not be read.
pub fn held_gpus(
    inventory: &Inventory,
    pods: Result<&BTreeMap<String, Vec<PodRef>>, &str>,
) -> BTreeSet<u32> {
    let ids = crate::occupancy::device_ids(inventory);
    ids.into_iter()
        .filter(|(_, ids)| match pods {
            Ok(pods) => ids
                .iter()
                .any(|id| pods.get(id).is_some_and(|p| !p.is_empty())),
            Err(_) => true,
        })
        .map(|(gpu, _)| gpu)
        .collect()
}

/// Each GPU's mode as recovered after a restart: from its pods when they hold it (a share
/// `<id>::<n>` means shared, the bare device exclusive; the published status tells time-slicing
/// from MPS), else from the last published status; absent when neither tells.
fn recover(
    inventory: &Inventory,
    pods: Option<&BTreeMap<String, Vec<PodRef>>>,
    published: &BTreeMap<u32, Mode>,
) -> BTreeMap<u32, Recovered> {
    let separator = crate::plugin::sharing::REPLICA_SEPARATOR;
    let mut out = BTreeMap::new();
    for (gpu, ids) in crate::occupancy::device_ids(inventory) {
        let from_pods = pods.and_then(|pods| {
            let held = |id: &String| pods.get(id).is_some_and(|p| !p.is_empty());
            let shares = ids.iter().any(|id| {
                let prefix = format!("{id}{separator}");
                pods.range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .any(|(_, p)| !p.is_empty())
            });
            if shares {
                Some(match published.get(&gpu) {
                    Some(m) if *m != Mode::Exclusive => Recovered::Mode(*m),
                    _ => Recovered::Shared,
                })
            } else if ids.iter().any(held) {
                Some(Recovered::Mode(Mode::Exclusive))
            } else {
                None
            }
        });
        if let Some(r) = from_pods.or_else(|| published.get(&gpu).map(|m| Recovered::Mode(*m))) {
            out.insert(gpu, r);
        }
    }
    out
}

/// `policy` with `gpus` taken out of its time-slicing and MPS (so they are exclusive).
fn without_gpus(policy: &SharingPolicy, inventory: &Inventory, gpus: &[u32]) -> SharingPolicy {
    let all: Vec<u32> = inventory.gpus.iter().map(|g| g.device.index).collect();
    let keep = |selected: &Option<Vec<u32>>| -> Option<Vec<u32>> {
        Some(
            selected
                .as_ref()
                .unwrap_or(&all)
                .iter()
                .copied()
                .filter(|i| !gpus.contains(i))
                .collect(),
        )
    };
    let mut out = policy.clone();
    if let Some(ts) = &mut out.time_slicing {
        ts.gpus = keep(&ts.gpus);
    }
    if let Some(mps) = &mut out.mps {
        mps.gpus = keep(&mps.gpus);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::testing::inventory;
    use gpupool_crds::policy::{MpsPolicy, TimeSlicingPolicy};

    fn ts(gpus: Vec<u32>, replicas: u32) -> SharingPolicy {
        SharingPolicy {
            time_slicing: Some(TimeSlicingPolicy {
                replicas,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                placement: Default::default(),
                resources: None,
                gpus: Some(gpus),
                models: None,
            }),
            mps: None,
        }
    }

    fn mps(gpus: Vec<u32>) -> SharingPolicy {
        SharingPolicy {
            time_slicing: None,
            mps: Some(MpsPolicy {
                replicas: 4,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                placement: Default::default(),
                memory_limit: None,
                active_thread_percentage: None,
                gpus: Some(gpus),
                models: None,
            }),
        }
    }

    /// PodResources as `list_pod_devices` gives it: each ID held by pod `p`, a share under its
    /// device too.
    fn pods_holding(ids: &[&str]) -> BTreeMap<String, Vec<PodRef>> {
        let p = PodRef {
            namespace: "ml".into(),
            name: "p".into(),
            container: None,
        };
        let mut out = BTreeMap::new();
        for id in ids {
            out.insert((*id).to_owned(), vec![p.clone()]);
            if let Some((device, _)) = id.split_once("::") {
                out.insert(device.to_owned(), vec![p.clone()]);
            }
        }
        out
    }

    fn status_gpu(index: u32, mode: Option<&str>) -> GpuStatus {
        GpuStatus {
            index,
            sharing: mode.map(|m| gpupool_crds::node::GpuSharing {
                mode: m.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn after_a_restart_the_mode_comes_from_the_pods_and_the_last_status() {
        let inv = inventory();
        let l4 = inv.gpus[1].device.uuid.to_string();
        let exclusive_pod = pods_holding(&[&l4]);
        let share_pod = pods_holding(&[&format!("{l4}::1")]);
        let nobody = pods_holding(&[]);
        struct Case<'a> {
            name: &'a str,
            published: Vec<GpuStatus>,
            pods: Result<&'a BTreeMap<String, Vec<PodRef>>, &'a str>,
            desired: SharingPolicy,
            applied: SharingPolicy,
            draining: &'a [u32],
            withheld: &'a [u32],
        }
        let cases = [
            Case {
                name: "an exclusive pod: time-slicing waits, GPU 1 stays exclusive",
                published: vec![],
                pods: Ok(&exclusive_pod),
                desired: ts(vec![1], 4),
                applied: ts(vec![], 4),
                draining: &[1],
                withheld: &[],
            },
            Case {
                name: "the status says exclusive, PodResources unreadable: held",
                published: vec![status_gpu(0, None), status_gpu(1, None)],
                pods: Err("socket not found"),
                desired: ts(vec![1], 4),
                applied: ts(vec![], 4),
                draining: &[1],
                withheld: &[],
            },
            Case {
                name: "the status says time-sliced, PodResources unreadable: same mode applies",
                published: vec![status_gpu(0, None), status_gpu(1, Some("TimeSlicing"))],
                pods: Err("socket not found"),
                desired: ts(vec![1], 4),
                applied: ts(vec![1], 4),
                draining: &[],
                withheld: &[],
            },
            Case {
                name: "pods hold shares, MPS wanted, time-slicing published: withheld",
                published: vec![status_gpu(1, Some("TimeSlicing"))],
                pods: Ok(&share_pod),
                desired: mps(vec![1]),
                applied: mps(vec![]),
                draining: &[1],
                withheld: &[1],
            },
            Case {
                name: "pods hold shares, exclusive wanted: withheld",
                published: vec![],
                pods: Ok(&share_pod),
                desired: SharingPolicy::default(),
                applied: SharingPolicy::default(),
                draining: &[1],
                withheld: &[1],
            },
            Case {
                name: "nobody holds anything: applied as asked",
                published: vec![],
                pods: Ok(&nobody),
                desired: mps(vec![1]),
                applied: mps(vec![1]),
                draining: &[],
                withheld: &[],
            },
        ];
        for c in cases {
            let mut gate = SharingGate::default();
            gate.restore(&c.published);
            let applied = gate.step(&inv, &c.desired, MigStrategy::None, c.pods);
            assert_eq!(
                modes(&inv, &applied, MigStrategy::None),
                modes(&inv, &c.applied, MigStrategy::None),
                "{}",
                c.name
            );
            assert_eq!(gate.draining(), c.draining, "{}", c.name);
            assert_eq!(gate.withheld(), c.withheld, "{}", c.name);
            let shown = gate.status(NodeMigStatus::default());
            if c.draining.is_empty() {
                assert_eq!(shown.state, MigState::Idle, "{}", c.name);
            } else {
                assert_eq!(shown.reason.as_deref(), Some("SharingChange"), "{}", c.name);
                if c.pods.is_err() {
                    assert!(
                        shown.message.unwrap_or_default().contains("cannot be read"),
                        "{}: the hold says why",
                        c.name
                    );
                }
            }
        }
    }

    #[test]
    fn an_unreadable_pod_resources_holds_a_pending_change() {
        let inv = inventory();
        let nobody = pods_holding(&[]);
        let mut gate = SharingGate::default();
        gate.step(&inv, &ts(vec![1], 2), MigStrategy::None, Ok(&nobody));
        assert_eq!(
            gate.step(&inv, &mps(vec![1]), MigStrategy::None, Err("timed out")),
            ts(vec![1], 2),
            "held"
        );
        assert_eq!(gate.draining(), [1]);
        assert_eq!(
            gate.step(&inv, &mps(vec![1]), MigStrategy::None, Ok(&nobody)),
            mps(vec![1])
        );
    }

    /// A new agent on a new GpuNode that cannot read PodResources (the kubelet restarting, or
    /// no kubelet): its whole GPUs are served exclusive, as any device plugin serves them, and
    /// only a shared mode waits for evidence of the pods.
    #[test]
    fn without_any_evidence_whole_gpus_are_served_exclusive_and_sharing_waits() {
        let inv = inventory();
        let mut gate = SharingGate::default();
        let none = SharingPolicy::default();
        assert_eq!(
            gate.step(&inv, &none, MigStrategy::None, Err("socket not found")),
            none
        );
        assert!(gate.draining().is_empty() && gate.withheld().is_empty());
        let mut gate = SharingGate::default();
        let shared = gate.step(
            &inv,
            &ts(vec![1], 2),
            MigStrategy::None,
            Err("socket not found"),
        );
        assert_eq!(gate.draining(), [1], "{shared:?}");
        assert_eq!(gate.withheld(), [1]);
    }

    #[test]
    fn each_gpu_has_the_mode_its_rules_give() {
        let inv = inventory();
        let m = modes(&inv, &ts(vec![1], 2), MigStrategy::None);
        assert_eq!(m[&0], Mode::Exclusive);
        assert_eq!(m[&1], Mode::TimeSlicing);
        let m = modes(&inv, &mps(vec![0, 1]), MigStrategy::None);
        assert_eq!(
            (m[&0], m[&1]),
            (Mode::Exclusive, Mode::Mps),
            "GPU 0 is in MIG mode: never MPS"
        );
    }

    #[test]
    fn a_mode_change_on_an_occupied_gpu_waits_and_shows_as_draining() {
        let inv = inventory();
        let none = pods_holding(&[]);
        let none = Ok(&none);
        let l4 = inv.gpus[1].device.uuid.to_string();
        let busy = pods_holding(&[&format!("{l4}::0")]);
        let busy = Ok(&busy);
        let mut gate = SharingGate::default();
        assert_eq!(
            gate.step(&inv, &ts(vec![1], 2), MigStrategy::None, none),
            ts(vec![1], 2),
            "first pass, no pod on the node: applied as asked"
        );
        // Replicas only: same mode, applied at once even with pods on GPU 1.
        assert_eq!(
            gate.step(&inv, &ts(vec![1], 4), MigStrategy::None, busy),
            ts(vec![1], 4)
        );
        // Time-slicing → MPS on occupied GPU 1: held, GPU 1 draining.
        assert_eq!(
            gate.step(&inv, &mps(vec![1]), MigStrategy::None, busy),
            ts(vec![1], 4)
        );
        assert_eq!(gate.draining(), [1]);
        let shown = gate.status(NodeMigStatus {
            state: MigState::Applied,
            ..Default::default()
        });
        assert_eq!(shown.state, MigState::Draining);
        assert_eq!(shown.reason.as_deref(), Some("SharingChange"));
        assert_eq!(shown.gpus, [1]);
        // MIG busy on its own: its status wins.
        let applying = NodeMigStatus {
            state: MigState::Applying,
            ..Default::default()
        };
        assert_eq!(gate.status(applying.clone()), applying);
        // The pods left: applied.
        assert_eq!(
            gate.step(&inv, &mps(vec![1]), MigStrategy::None, none),
            mps(vec![1])
        );
        assert!(gate.draining().is_empty());
        assert_eq!(gate.status(NodeMigStatus::default()).state, MigState::Idle);
    }
}
