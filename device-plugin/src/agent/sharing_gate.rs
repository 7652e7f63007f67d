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

use gpupool_crds::node::{MigState, NodeMigStatus};
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

/// The sharing the agent has applied, held back while a mode change waits for pods to leave.
#[derive(Debug, Default)]
pub struct SharingGate {
    applied: Option<SharingPolicy>,
    draining: Vec<u32>,
}

impl SharingGate {
    /// The sharing to apply now, given the GpuNode's (`desired`) and the GPUs pods hold
    /// (`occupied`). The first call applies `desired` (a restarted agent cannot know what the
    /// pods on the node were admitted under).
    pub fn step(
        &mut self,
        inventory: &Inventory,
        desired: &SharingPolicy,
        strategy: MigStrategy,
        occupied: &BTreeSet<u32>,
    ) -> SharingPolicy {
        let Some(applied) = &self.applied else {
            self.applied = Some(desired.clone());
            self.draining.clear();
            return desired.clone();
        };
        if applied == desired {
            self.draining.clear();
            return desired.clone();
        }
        let before = modes(inventory, applied, strategy);
        let after = modes(inventory, desired, strategy);
        self.draining = after
            .iter()
            .filter(|(i, mode)| before.get(i).is_some_and(|b| b != *mode) && occupied.contains(i))
            .map(|(i, _)| *i)
            .collect();
        if self.draining.is_empty() {
            self.applied = Some(desired.clone());
        }
        self.applied.clone().unwrap_or_default()
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
        NodeMigStatus {
            state: MigState::Draining,
            reason: Some("SharingChange".into()),
            message: Some(format!(
                "GPU {} change sharing mode: waiting for the pods on them to leave",
                list.join(", ")
            )),
            gpus: self.draining.clone(),
            observed_generation: mig.observed_generation,
        }
    }
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
        let none = BTreeSet::new();
        let busy = BTreeSet::from([1]);
        let mut gate = SharingGate::default();
        assert_eq!(
            gate.step(&inv, &ts(vec![1], 2), MigStrategy::None, &busy),
            ts(vec![1], 2),
            "first pass: applied as asked"
        );
        // Replicas only: same mode, applied at once even with pods on GPU 1.
        assert_eq!(
            gate.step(&inv, &ts(vec![1], 4), MigStrategy::None, &busy),
            ts(vec![1], 4)
        );
        // Time-slicing → MPS on occupied GPU 1: held, GPU 1 draining.
        assert_eq!(
            gate.step(&inv, &mps(vec![1]), MigStrategy::None, &busy),
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
            gate.step(&inv, &mps(vec![1]), MigStrategy::None, &none),
            mps(vec![1])
        );
        assert!(gate.draining().is_empty());
        assert_eq!(gate.status(NodeMigStatus::default()).state, MigState::Idle);
    }
}
