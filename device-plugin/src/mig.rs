//! MIG partitioning: drives the GpuNode's layout (`spec.mig.gpus[]`) to the hardware.
//!
//! - [`plan_mig`] (pure) turns what the hardware shows and what is wanted into the operations
//!   still needed. It is re-run after every operation on a fresh read of the hardware, so a
//!   layout half-applied before a crash is completed from what the hardware shows.
//! - [`MigController`] is the state machine shown in status: `Applied` when nothing is left to
//!   do; on a difference `Draining` (until no pod holds a device of the GPUs being changed and
//!   no compute process runs on them, as [`crate::occupancy`] judges from positive evidence
//!   only; or `Failed` with the holders named after the drain timeout) → `Applying` (one operation per step) → `Applied`, or
//!   `Failed` with the NVML error and the GPU. Only GPUs whose layout differs are touched. A
//!   MIG mode change waiting for a GPU reset fails (`GPUResetTimeout`) after the drain timeout
//!   too. A failure stands until the spec changes or the hardware is seen to match; a restarted
//!   agent takes it up from the GpuNode's status ([`MigController::restore`]) instead of
//!   draining the node again.
//! - [`apply_op`] performs one operation through the backend.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use gpupool_crds::node::{GpuMigSpec, MigState, NodeMigSpec, NodeMigStatus};
use gpupool_mig_catalog::{self as catalog, GpuModel, PlanError};

use crate::backend::{self, GiProfileId, GpuBackend, GpuInstanceId, MigMode, MigModeChange};
use crate::inventory::Inventory;
use crate::occupancy::Occupancy;

/// One GPU instance as the hardware shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentGi {
    /// GPU instance ID.
    pub id: u32,
    /// NVML profile ID.
    pub profile_id: u32,
    /// Placement start (memory slice).
    pub start: u32,
    /// Compute instance IDs.
    pub compute_instances: Vec<u32>,
}

/// One GPU as the hardware shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentGpu {
    /// NVML index.
    pub index: u32,
    /// Product name (to find the model in the catalog).
    pub product: String,
    /// MIG mode; `None` when not MIG-capable.
    pub mode: Option<MigMode>,
    /// GPU instances (when MIG is on).
    pub instances: Vec<CurrentGi>,
}

/// The hardware's MIG state, from an inventory.
pub fn current_from_inventory(inventory: &Inventory) -> Vec<CurrentGpu> {
    inventory
        .gpus
        .iter()
        .map(|g| CurrentGpu {
            index: g.device.index,
            product: g.device.name.clone(),
            mode: g.mig_mode,
            instances: g
                .instances
                .iter()
                .map(|(gi, cis)| CurrentGi {
                    id: gi.id.0,
                    profile_id: gi.profile_id.0,
                    start: gi.placement.start,
                    compute_instances: cis.iter().map(|c| c.id.0).collect(),
                })
                .collect(),
        })
        .collect()
}

/// One step towards the wanted layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigOp {
    /// Turn MIG mode on or off.
    SetMigMode {
        /// GPU index.
        gpu: u32,
        /// Wanted mode.
        enabled: bool,
    },
    /// Destroy a compute instance.
    DestroyComputeInstance {
        /// GPU index.
        gpu: u32,
        /// Its GPU instance.
        gi: u32,
        /// Compute instance ID.
        ci: u32,
    },
    /// Destroy a GPU instance (its compute instances are gone).
    DestroyGpuInstance {
        /// GPU index.
        gpu: u32,
        /// GPU instance ID.
        gi: u32,
    },
    /// Create a GPU instance at a placement, then its full-size compute instance.
    CreateGpuInstance {
        /// GPU index.
        gpu: u32,
        /// Profile name.
        profile: &'static str,
        /// NVML profile ID.
        profile_id: u32,
        /// Placement start.
        start: u32,
        /// Compute slices (for the compute instance).
        compute_slices: u32,
    },
    /// Create the full-size compute instance of a GPU instance that has none.
    CreateComputeInstance {
        /// GPU index.
        gpu: u32,
        /// GPU instance ID.
        gi: u32,
        /// Compute slices.
        compute_slices: u32,
    },
}

impl MigOp {
    /// The GPU it touches.
    pub fn gpu(&self) -> u32 {
        match self {
            MigOp::SetMigMode { gpu, .. }
            | MigOp::DestroyComputeInstance { gpu, .. }
            | MigOp::DestroyGpuInstance { gpu, .. }
            | MigOp::CreateGpuInstance { gpu, .. }
            | MigOp::CreateComputeInstance { gpu, .. } => *gpu,
        }
    }
}

impl fmt::Display for MigOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MigOp::SetMigMode { gpu, enabled } => {
                write!(
                    f,
                    "turning MIG mode {} on GPU {gpu}",
                    if *enabled { "on" } else { "off" }
                )
            }
            MigOp::DestroyComputeInstance { gpu, gi, ci } => {
                write!(
                    f,
                    "destroying compute instance {ci} of GPU instance {gi} on GPU {gpu}"
                )
            }
            MigOp::DestroyGpuInstance { gpu, gi } => {
                write!(f, "destroying GPU instance {gi} on GPU {gpu}")
            }
            MigOp::CreateGpuInstance {
                gpu,
                profile,
                start,
                ..
            } => {
                write!(
                    f,
                    "creating GPU instance {profile} at slice {start} on GPU {gpu}"
                )
            }
            MigOp::CreateComputeInstance { gpu, gi, .. } => {
                write!(
                    f,
                    "creating the compute instance of GPU instance {gi} on GPU {gpu}"
                )
            }
        }
    }
}

/// Why a layout cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigPlanError {
    /// The layout names a GPU the node does not have.
    #[error("GPU {0} is in the MIG layout but not on this node")]
    NoSuchGpu(u32),
    /// MIG wanted on a GPU that does not support it.
    #[error("GPU {gpu} ({product}) does not support MIG")]
    NotMigCapable {
        /// GPU index.
        gpu: u32,
        /// Product name.
        product: String,
    },
    /// The catalog does not know the model.
    #[error("GPU {gpu}: no MIG catalog entry for {product:?}")]
    UnknownModel {
        /// GPU index.
        gpu: u32,
        /// Product name.
        product: String,
    },
    /// The profiles do not fit the GPU.
    #[error("GPU {gpu}: {source}")]
    Layout {
        /// GPU index.
        gpu: u32,
        /// The planner's reason.
        source: PlanError,
    },
}

fn expand(profiles: &BTreeMap<String, u32>) -> Vec<&str> {
    profiles
        .iter()
        .flat_map(|(name, n)| std::iter::repeat_n(name.as_str(), *n as usize))
        .collect()
}

fn plan_gpu(
    gpu: &CurrentGpu,
    wanted: &GpuMigSpec,
    ops: &mut Vec<MigOp>,
) -> Result<(), MigPlanError> {
    let index = gpu.index;
    let Some(mode) = gpu.mode else {
        if wanted.enabled {
            return Err(MigPlanError::NotMigCapable {
                gpu: index,
                product: gpu.product.clone(),
            });
        }
        return Ok(());
    };
    let destroy_all = |ops: &mut Vec<MigOp>, gis: &[&CurrentGi]| {
        for gi in gis {
            for ci in &gi.compute_instances {
                ops.push(MigOp::DestroyComputeInstance {
                    gpu: index,
                    gi: gi.id,
                    ci: *ci,
                });
            }
        }
        for gi in gis {
            ops.push(MigOp::DestroyGpuInstance {
                gpu: index,
                gi: gi.id,
            });
        }
    };
    if !wanted.enabled {
        let all: Vec<&CurrentGi> = gpu.instances.iter().collect();
        destroy_all(ops, &all);
        if mode.pending {
            ops.push(MigOp::SetMigMode {
                gpu: index,
                enabled: false,
            });
        }
        return Ok(());
    }
    if !mode.current {
        if !mode.pending {
            ops.push(MigOp::SetMigMode {
                gpu: index,
                enabled: true,
            });
        }
        // Instances can only be created once the mode is in effect (after a reset if needed).
        return Ok(());
    }
    let model: &GpuModel =
        catalog::model_by_product_name(&gpu.product).ok_or_else(|| MigPlanError::UnknownModel {
            gpu: index,
            product: gpu.product.clone(),
        })?;
    let wanted_names = expand(&wanted.profiles);
    let profile_of = |gi: &CurrentGi| model.profile_by_id(gi.profile_id).map(|p| p.name);
    let complete = |gi: &CurrentGi| gi.compute_instances.len() == 1;

    // Already right as a multiset of complete instances: leave the placements alone.
    let mut have: Vec<&str> = gpu.instances.iter().filter_map(profile_of).collect();
    let mut want = wanted_names.clone();
    have.sort_unstable();
    want.sort_unstable();
    if have == want
        && gpu
            .instances
            .iter()
            .all(|gi| complete(gi) && profile_of(gi).is_some())
    {
        return Ok(());
    }

    let plan = catalog::plan_layout(model, &wanted_names)
        .map_err(|source| MigPlanError::Layout { gpu: index, source })?;
    // Keep instances that sit exactly where the plan puts one of their profile.
    let mut unmatched: Vec<_> = plan.clone();
    let mut keep: Vec<&CurrentGi> = Vec::new();
    let mut drop: Vec<&CurrentGi> = Vec::new();
    for gi in &gpu.instances {
        let slot = profile_of(gi).and_then(|name| {
            unmatched
                .iter()
                .position(|p| p.profile.name == name && p.start == gi.start)
        });
        match slot {
            Some(i) if gi.compute_instances.len() <= 1 => {
                unmatched.remove(i);
                keep.push(gi);
            }
            _ => drop.push(gi),
        }
    }
    destroy_all(ops, &drop);
    for gi in keep {
        if gi.compute_instances.is_empty() {
            let slices = model
                .profile_by_id(gi.profile_id)
                .map(|p| p.compute_slices)
                .unwrap_or(1);
            ops.push(MigOp::CreateComputeInstance {
                gpu: index,
                gi: gi.id,
                compute_slices: slices,
            });
        }
    }
    for p in unmatched {
        ops.push(MigOp::CreateGpuInstance {
            gpu: index,
            profile: p.profile.name,
            profile_id: p.profile.profile_id,
            start: p.start,
            compute_slices: p.profile.compute_slices,
        });
    }
    Ok(())
}

/// The operations that take the hardware (`current`) to the layout (`wanted`), in order:
/// destroys before creates, GPU by GPU. Empty when the hardware matches. GPUs not in `wanted`
/// are left alone.
pub fn plan_mig(current: &[CurrentGpu], wanted: &[GpuMigSpec]) -> Result<Vec<MigOp>, MigPlanError> {
    let mut ops = Vec::new();
    for w in wanted {
        let gpu = current
            .iter()
            .find(|g| g.index == w.index)
            .ok_or(MigPlanError::NoSuchGpu(w.index))?;
        plan_gpu(gpu, w, &mut ops)?;
    }
    Ok(ops)
}

/// GPUs whose wanted MIG mode is set but waits for a GPU reset.
pub fn reset_pending(current: &[CurrentGpu], wanted: &[GpuMigSpec]) -> Vec<u32> {
    wanted
        .iter()
        .filter_map(|w| {
            let g = current.iter().find(|g| g.index == w.index)?;
            let m = g.mode?;
            (m.pending == w.enabled && m.current != w.enabled).then_some(g.index)
        })
        .collect()
}

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}")]
pub struct MigError {
    /// The operation.
    pub op: MigOp,
    /// The backend's error.
    pub source: backend::Error,
}

/// Performs one operation. Returns the mode change for `SetMigMode`.
pub fn apply_op(backend: &dyn GpuBackend, op: &MigOp) -> Result<Option<MigModeChange>, MigError> {
    let err = |source| MigError {
        op: op.clone(),
        source,
    };
    match *op {
        MigOp::SetMigMode { gpu, enabled } => {
            backend.set_mig_mode(gpu, enabled).map(Some).map_err(err)
        }
        MigOp::DestroyComputeInstance { gpu, gi, ci } => backend
            .destroy_compute_instance(gpu, GpuInstanceId(gi), backend::ComputeInstanceId(ci))
            .map(|()| None)
            .map_err(err),
        MigOp::DestroyGpuInstance { gpu, gi } => backend
            .destroy_gpu_instance(gpu, GpuInstanceId(gi))
            .map(|()| None)
            .map_err(err),
        MigOp::CreateGpuInstance {
            gpu,
            profile_id,
            start,
            compute_slices,
            ..
        } => {
            let gi = backend
                .create_gpu_instance(gpu, GiProfileId(profile_id), Some(start))
                .map_err(err)?;
            create_ci(backend, gpu, gi.id, compute_slices).map_err(err)?;
            Ok(None)
        }
        MigOp::CreateComputeInstance {
            gpu,
            gi,
            compute_slices,
        } => {
            create_ci(backend, gpu, GpuInstanceId(gi), compute_slices).map_err(err)?;
            Ok(None)
        }
    }
}

fn create_ci(
    backend: &dyn GpuBackend,
    gpu: u32,
    gi: GpuInstanceId,
    slices: u32,
) -> backend::Result<()> {
    let profiles = backend.compute_instance_profiles(gpu, gi)?;
    let profile = profiles
        .iter()
        .find(|p| p.slice_count == slices)
        .or_else(|| profiles.iter().max_by_key(|p| p.slice_count))
        .ok_or_else(|| backend::Error::NotFound {
            op: "finding a compute instance profile",
            target: format!("GPU {gpu} GPU instance {gi}"),
            detail: "the GPU instance offers none".to_owned(),
        })?;
    backend.create_compute_instance(gpu, gi, profile.id)?;
    Ok(())
}

/// Where reconfiguration stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// No layout managed.
    Idle,
    /// Waiting for the pods and compute processes on `gpus` to leave.
    Draining {
        /// Since when.
        since: Instant,
        /// GPUs being changed.
        gpus: Vec<u32>,
        /// What still holds them, as last seen (see [`Occupancy::describe`]).
        waiting_for: String,
    },
    /// Changing `gpus`.
    Applying {
        /// GPUs being changed.
        gpus: Vec<u32>,
        /// GPUs waiting for a reset to change MIG mode.
        reset_pending: Vec<u32>,
        /// Since when a reset has been pending (`None` when none is).
        reset_since: Option<Instant>,
    },
    /// The hardware matches.
    Applied,
    /// Gave up until the spec changes.
    Failed {
        /// Why.
        reason: MigFailure,
        /// Details: the error and the GPU.
        message: String,
        /// GPUs concerned.
        gpus: Vec<u32>,
    },
}

/// Why a MIG change was given up; its [`MigFailure::reason`] is the status `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigFailure {
    /// The planner cannot place the wanted layout on this GPU (unknown model, not MIG-capable,
    /// profiles that do not fit).
    InvalidLayout,
    /// Pods or compute processes did not leave the GPUs within the drain timeout (or what holds
    /// them could not be read).
    DrainTimeout,
    /// An NVML call creating or destroying an instance, or switching MIG mode, failed.
    NvmlError,
    /// A MIG mode change waited for a GPU reset or reboot longer than the drain timeout.
    ResetTimeout,
    /// A failure this agent did not see happen: read back from the GpuNode's status after a
    /// restart, with the reason it gave.
    Restored,
}

impl MigFailure {
    /// The `reason` in GpuNode status.
    pub fn reason(self) -> &'static str {
        match self {
            MigFailure::InvalidLayout => "InvalidLayout",
            MigFailure::DrainTimeout => "DrainTimeout",
            MigFailure::NvmlError => "NVMLError",
            MigFailure::ResetTimeout => "GPUResetTimeout",
            MigFailure::Restored => "Failed",
        }
    }
}

/// What the agent should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing until something changes.
    Idle,
    /// The phase changed: publish status, then step again.
    PhaseChanged,
    /// Check again after this long (draining, reset pending).
    Wait(Duration),
    /// Perform this operation, re-read the hardware, step again.
    Execute(MigOp),
}

/// The MIG state machine of one node.
#[derive(Debug, Clone)]
pub struct MigController {
    phase: Phase,
    /// The generation the phase refers to.
    generation: Option<i64>,
    drain_timeout: Duration,
    poll: Duration,
    /// The status reason of a failure read back by [`MigController::restore`].
    restored_reason: Option<String>,
}

impl MigController {
    /// A controller that gives up draining after `drain_timeout`.
    pub fn new(drain_timeout: Duration) -> MigController {
        MigController {
            phase: Phase::Idle,
            generation: None,
            drain_timeout,
            poll: Duration::from_millis(500),
            restored_reason: None,
        }
    }

    /// Takes up a `Failed` state the GpuNode's status records for `generation`, as a restarted
    /// agent finds it: the failure stands (no new drain of the node's pods) until the spec
    /// changes or the hardware is seen to match the layout (after a reboot, say).
    pub fn restore(&mut self, status: &NodeMigStatus, generation: Option<i64>) {
        if status.state != MigState::Failed
            || generation.is_none()
            || status.observed_generation != generation
        {
            return;
        }
        self.phase = Phase::Failed {
            reason: MigFailure::Restored,
            message: status.message.clone().unwrap_or_default(),
            gpus: status.gpus.clone(),
        };
        self.generation = generation;
        self.restored_reason = status.reason.clone();
    }

    /// The current phase.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Whether the node is mid-reconfiguration (devices must not be re-advertised).
    pub fn busy(&self) -> bool {
        matches!(self.phase, Phase::Draining { .. } | Phase::Applying { .. })
    }

    fn set(&mut self, phase: Phase, generation: Option<i64>) -> Step {
        let changed = self.phase != phase || self.generation != generation;
        self.phase = phase;
        self.generation = generation;
        if changed {
            Step::PhaseChanged
        } else {
            Step::Idle
        }
    }

    /// Decides the next step from a fresh read of the hardware, the spec (and its generation),
    /// what holds each GPU (pods, processes, or what could not be read), and the time.
    pub fn step(
        &mut self,
        current: &[CurrentGpu],
        spec: &NodeMigSpec,
        generation: Option<i64>,
        busy: &Occupancy,
        now: Instant,
    ) -> Step {
        if !spec.managed || spec.gpus.is_empty() {
            return self.set(Phase::Idle, generation);
        }
        let failed_here =
            matches!(self.phase, Phase::Failed { .. }) && self.generation == generation;
        if failed_here {
            // A failure stands until the spec changes, unless the hardware now matches (a
            // reset or reboot completed the change).
            let done = plan_mig(current, &spec.gpus).is_ok_and(|ops| ops.is_empty())
                && reset_pending(current, &spec.gpus).is_empty();
            return if done {
                self.set(Phase::Applied, generation)
            } else {
                Step::Idle
            };
        }
        let ops = match plan_mig(current, &spec.gpus) {
            Ok(ops) => ops,
            Err(e) => {
                let gpus = match &e {
                    MigPlanError::NoSuchGpu(g) => vec![*g],
                    MigPlanError::NotMigCapable { gpu, .. }
                    | MigPlanError::UnknownModel { gpu, .. }
                    | MigPlanError::Layout { gpu, .. } => vec![*gpu],
                };
                return self.set(
                    Phase::Failed {
                        reason: MigFailure::InvalidLayout,
                        message: e.to_string(),
                        gpus,
                    },
                    generation,
                );
            }
        };
        if ops.is_empty() {
            let pending = reset_pending(current, &spec.gpus);
            if pending.is_empty() {
                return self.set(Phase::Applied, generation);
            }
            let since = match &self.phase {
                Phase::Applying {
                    reset_since: Some(t),
                    ..
                } if self.generation == generation => *t,
                _ => now,
            };
            if now.duration_since(since) >= self.drain_timeout {
                let list: Vec<String> = pending.iter().map(u32::to_string).collect();
                return self.set(
                    Phase::Failed {
                        reason: MigFailure::ResetTimeout,
                        message: format!(
                            "the MIG mode change on GPU {} needs a GPU reset or a reboot, not done within {:?}; reset the GPU (nvidia-smi -r) or reboot the node, and the agent completes the layout",
                            list.join(", "),
                            self.drain_timeout
                        ),
                        gpus: pending,
                    },
                    generation,
                );
            }
            let step = self.set(
                Phase::Applying {
                    gpus: pending.clone(),
                    reset_pending: pending,
                    reset_since: Some(since),
                },
                generation,
            );
            return if step == Step::Idle {
                Step::Wait(Duration::from_secs(10))
            } else {
                step
            };
        }
        let gpus: Vec<u32> = ops
            .iter()
            .map(MigOp::gpu)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        match &self.phase {
            Phase::Applying { .. } if self.generation == generation => {
                Step::Execute(ops[0].clone())
            }
            Phase::Draining { since, .. } if self.generation == generation => {
                let since = *since;
                let waiting_for = busy.describe(&gpus);
                if gpus.iter().all(|g| !busy.is_busy(*g)) {
                    self.set(
                        Phase::Applying {
                            gpus,
                            reset_pending: vec![],
                            reset_since: None,
                        },
                        generation,
                    )
                } else if now.duration_since(since) >= self.drain_timeout {
                    self.set(
                        Phase::Failed {
                            reason: MigFailure::DrainTimeout,
                            message: format!(
                                "still held after {:?}: {waiting_for}; MIG layout not applied, the instances are intact",
                                self.drain_timeout
                            ),
                            gpus,
                        },
                        generation,
                    )
                } else {
                    // Keep the GPU list and holders current; waiting is not a phase change.
                    self.phase = Phase::Draining {
                        since,
                        gpus,
                        waiting_for,
                    };
                    Step::Wait(self.poll)
                }
            }
            _ => {
                let waiting_for = busy.describe(&gpus);
                self.set(
                    Phase::Draining {
                        since: now,
                        gpus,
                        waiting_for,
                    },
                    generation,
                )
            }
        }
    }

    /// Records a failed operation.
    pub fn fail(&mut self, error: &MigError) {
        let gpu = error.op.gpu();
        self.phase = Phase::Failed {
            reason: MigFailure::NvmlError,
            message: format!("GPU {gpu}: {error}"),
            gpus: vec![gpu],
        };
    }

    /// The phase as GpuNode status.
    pub fn status(&self) -> NodeMigStatus {
        let (state, reason, message, gpus) = match &self.phase {
            Phase::Idle => (MigState::Idle, None, None, vec![]),
            Phase::Draining {
                gpus, waiting_for, ..
            } => (
                MigState::Draining,
                Some("WaitingForGPUPods".to_owned()),
                Some(if waiting_for.is_empty() {
                    "waiting until no pod holds a device of the GPUs being changed and no compute process runs on them".to_owned()
                } else {
                    format!("waiting for the GPUs being changed to be free: {waiting_for}")
                }),
                gpus.clone(),
            ),
            Phase::Applying {
                gpus,
                reset_pending,
                ..
            } if !reset_pending.is_empty() => {
                let list: Vec<String> = reset_pending.iter().map(u32::to_string).collect();
                (
                    MigState::Applying,
                    Some("GPUResetPending".to_owned()),
                    Some(format!(
                        "MIG mode change on GPU {} takes effect after a GPU reset or reboot",
                        list.join(", ")
                    )),
                    gpus.clone(),
                )
            }
            Phase::Applying { gpus, .. } => (MigState::Applying, None, None, gpus.clone()),
            Phase::Applied => (MigState::Applied, None, None, vec![]),
            Phase::Failed {
                reason,
                message,
                gpus,
            } => (
                MigState::Failed,
                Some(match (reason, &self.restored_reason) {
                    (MigFailure::Restored, Some(r)) => r.clone(),
                    _ => reason.reason().to_owned(),
                }),
                Some(message.clone()),
                gpus.clone(),
            ),
        };
        NodeMigStatus {
            state,
            reason,
            message,
            gpus,
            observed_generation: self.generation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::occupancy::Holder;

    fn processes_on_gpu_0() -> Occupancy {
        [(0, Holder::Processes(1))].into_iter().collect()
    }

    const H100: &str = "NVIDIA H100 80GB HBM3";

    fn model() -> &'static GpuModel {
        catalog::model_by_product_name(H100).unwrap()
    }

    fn pid(name: &str) -> u32 {
        model().profile(name).unwrap().profile_id
    }

    fn gpu(
        index: u32,
        current: bool,
        pending: bool,
        gis: &[(u32, &str, u32, usize)],
    ) -> CurrentGpu {
        CurrentGpu {
            index,
            product: H100.to_owned(),
            mode: Some(MigMode { current, pending }),
            instances: gis
                .iter()
                .map(|&(id, name, start, cis)| CurrentGi {
                    id,
                    profile_id: pid(name),
                    start,
                    compute_instances: (0..cis as u32).collect(),
                })
                .collect(),
        }
    }

    fn want(index: u32, enabled: bool, profiles: &[(&str, u32)]) -> GpuMigSpec {
        GpuMigSpec {
            index,
            enabled,
            profiles: profiles
                .iter()
                .map(|(n, c)| ((*n).to_owned(), *c))
                .collect(),
        }
    }

    fn creates(ops: &[MigOp]) -> Vec<(&'static str, u32)> {
        ops.iter()
            .filter_map(|o| match o {
                MigOp::CreateGpuInstance { profile, start, .. } => Some((*profile, *start)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn plan_table() {
        let seven: Vec<(u32, &str, u32, usize)> =
            (0..7).map(|i| (i + 1, "1g.10gb", i, 1)).collect();
        struct Case {
            name: &'static str,
            current: Vec<CurrentGpu>,
            wanted: Vec<GpuMigSpec>,
            check: fn(&[MigOp]),
        }
        let cases = vec![
            Case {
                name: "MIG off, wanted on: enable first, nothing else yet",
                current: vec![gpu(0, false, false, &[])],
                wanted: vec![want(0, true, &[("1g.10gb", 7)])],
                check: |ops| {
                    assert_eq!(
                        ops,
                        [MigOp::SetMigMode {
                            gpu: 0,
                            enabled: true
                        }]
                    )
                },
            },
            Case {
                name: "enable pending a reset: nothing to do",
                current: vec![gpu(0, false, true, &[])],
                wanted: vec![want(0, true, &[("1g.10gb", 7)])],
                check: |ops| assert!(ops.is_empty(), "{ops:?}"),
            },
            Case {
                name: "MIG on and empty: create seven at valid placements",
                current: vec![gpu(0, true, true, &[])],
                wanted: vec![want(0, true, &[("1g.10gb", 7)])],
                check: |ops| {
                    let c = creates(ops);
                    assert_eq!(c.len(), 7);
                    let starts: BTreeSet<u32> = c.iter().map(|x| x.1).collect();
                    assert_eq!(starts.len(), 7, "distinct placements: {c:?}");
                },
            },
            Case {
                name: "already matching: nothing",
                current: vec![gpu(0, true, true, &seven)],
                wanted: vec![want(0, true, &[("1g.10gb", 7)])],
                check: |ops| assert!(ops.is_empty(), "{ops:?}"),
            },
            Case {
                name: "matching but listed in another order: nothing",
                current: vec![gpu(
                    0,
                    true,
                    true,
                    &[(1, "3g.40gb", 4, 1), (2, "4g.40gb", 0, 1)],
                )],
                wanted: vec![want(0, true, &[("4g.40gb", 1), ("3g.40gb", 1)])],
                check: |ops| assert!(ops.is_empty(), "{ops:?}"),
            },
            Case {
                name: "7x1g to 1x7g: destroy CIs, then GIs, then create",
                current: vec![gpu(0, true, true, &seven)],
                wanted: vec![want(0, true, &[("7g.80gb", 1)])],
                check: |ops| {
                    let first_gi = ops
                        .iter()
                        .position(|o| matches!(o, MigOp::DestroyGpuInstance { .. }))
                        .unwrap();
                    let last_ci = ops
                        .iter()
                        .rposition(|o| matches!(o, MigOp::DestroyComputeInstance { .. }))
                        .unwrap();
                    assert!(last_ci < first_gi, "{ops:?}");
                    assert_eq!(
                        ops.iter()
                            .filter(|o| matches!(o, MigOp::DestroyGpuInstance { .. }))
                            .count(),
                        7
                    );
                    assert_eq!(creates(ops), [("7g.80gb", 0)]);
                    assert!(matches!(ops.last(), Some(MigOp::CreateGpuInstance { .. })));
                },
            },
            Case {
                name: "crash midway: three of seven made, one without its CI",
                current: vec![gpu(
                    0,
                    true,
                    true,
                    &[
                        (1, "1g.10gb", 0, 1),
                        (2, "1g.10gb", 1, 1),
                        (3, "1g.10gb", 2, 0),
                    ],
                )],
                wanted: vec![want(0, true, &[("1g.10gb", 7)])],
                check: |ops| {
                    assert!(
                        ops.contains(&MigOp::CreateComputeInstance {
                            gpu: 0,
                            gi: 3,
                            compute_slices: 1
                        }),
                        "{ops:?}"
                    );
                    assert_eq!(creates(ops).len(), 4);
                    assert!(
                        !ops.iter()
                            .any(|o| matches!(o, MigOp::DestroyGpuInstance { .. }))
                    );
                },
            },
            Case {
                name: "wanted off: destroy everything, then turn off",
                current: vec![gpu(0, true, true, &[(1, "3g.40gb", 4, 1)])],
                wanted: vec![want(0, false, &[])],
                check: |ops| {
                    assert_eq!(
                        ops,
                        [
                            MigOp::DestroyComputeInstance {
                                gpu: 0,
                                gi: 1,
                                ci: 0
                            },
                            MigOp::DestroyGpuInstance { gpu: 0, gi: 1 },
                            MigOp::SetMigMode {
                                gpu: 0,
                                enabled: false
                            },
                        ]
                    )
                },
            },
            Case {
                name: "only GPUs whose layout changed are touched",
                current: vec![gpu(0, true, true, &seven), gpu(1, true, true, &[])],
                wanted: vec![
                    want(0, true, &[("1g.10gb", 7)]),
                    want(1, true, &[("3g.40gb", 2)]),
                ],
                check: |ops| {
                    assert!(ops.iter().all(|o| o.gpu() == 1), "{ops:?}");
                    assert_eq!(creates(ops).len(), 2);
                },
            },
            Case {
                name: "GPUs not in the layout are left alone",
                current: vec![gpu(0, true, true, &[]), gpu(1, false, false, &[])],
                wanted: vec![want(1, false, &[])],
                check: |ops| assert!(ops.is_empty(), "{ops:?}"),
            },
        ];
        for case in cases {
            let ops = plan_mig(&case.current, &case.wanted)
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            eprintln!("{}: {ops:?}", case.name);
            (case.check)(&ops);
        }
    }

    #[test]
    fn plan_errors() {
        let mut not_capable = gpu(0, false, false, &[]);
        not_capable.mode = None;
        assert!(matches!(
            plan_mig(&[not_capable], &[want(0, true, &[("1g.10gb", 1)])]),
            Err(MigPlanError::NotMigCapable { gpu: 0, .. })
        ));
        assert_eq!(
            plan_mig(&[], &[want(3, true, &[])]),
            Err(MigPlanError::NoSuchGpu(3))
        );
        assert!(matches!(
            plan_mig(
                &[gpu(0, true, true, &[])],
                &[want(0, true, &[("7g.80gb", 2)])]
            ),
            Err(MigPlanError::Layout { gpu: 0, .. })
        ));
    }

    #[test]
    fn state_machine_walks_draining_applying_applied() {
        let spec = NodeMigSpec {
            managed: true,
            gpus: vec![want(0, true, &[("7g.80gb", 1)])],
            ..NodeMigSpec::default()
        };
        let t0 = Instant::now();
        let mut c = MigController::new(Duration::from_secs(60));
        let hw = vec![gpu(0, true, true, &[])];
        let busy = processes_on_gpu_0();
        assert_eq!(c.step(&hw, &spec, Some(1), &busy, t0), Step::PhaseChanged);
        assert_eq!(c.status().state, MigState::Draining);
        assert_eq!(c.status().gpus, [0]);
        assert!(matches!(
            c.step(&hw, &spec, Some(1), &busy, t0),
            Step::Wait(_)
        ));
        assert_eq!(
            c.step(&hw, &spec, Some(1), &Occupancy::default(), t0),
            Step::PhaseChanged
        );
        assert_eq!(c.status().state, MigState::Applying);
        let Step::Execute(op) = c.step(&hw, &spec, Some(1), &Occupancy::default(), t0) else {
            panic!()
        };
        assert!(matches!(
            op,
            MigOp::CreateGpuInstance {
                profile: "7g.80gb",
                ..
            }
        ));
        let done = vec![gpu(0, true, true, &[(1, "7g.80gb", 0, 1)])];
        assert_eq!(
            c.step(&done, &spec, Some(1), &Occupancy::default(), t0),
            Step::PhaseChanged
        );
        assert_eq!(c.status().state, MigState::Applied);
        assert_eq!(c.status().observed_generation, Some(1));
        assert_eq!(
            c.step(&done, &spec, Some(1), &Occupancy::default(), t0),
            Step::Idle
        );
    }

    #[test]
    fn a_pod_holding_a_device_without_a_process_holds_the_drain_and_is_named() {
        let spec = NodeMigSpec {
            managed: true,
            gpus: vec![want(0, true, &[("7g.80gb", 1)])],
            ..NodeMigSpec::default()
        };
        let t0 = Instant::now();
        let mut c = MigController::new(Duration::from_secs(5));
        let hw = vec![gpu(0, true, true, &[])];
        let held: Occupancy = [(
            0,
            Holder::Pod(gpupool_crds::node::PodRef {
                namespace: "ml".into(),
                name: "train-0".into(),
                container: None,
            }),
        )]
        .into_iter()
        .collect();
        assert_eq!(c.step(&hw, &spec, Some(1), &held, t0), Step::PhaseChanged);
        assert!(matches!(
            c.step(&hw, &spec, Some(1), &held, t0 + Duration::from_secs(1)),
            Step::Wait(_)
        ));
        let s = c.status();
        assert_eq!(s.state, MigState::Draining);
        assert!(
            s.message.unwrap_or_default().contains("pod ml/train-0"),
            "the holder is named while draining"
        );
        assert_eq!(
            c.step(&hw, &spec, Some(1), &held, t0 + Duration::from_secs(6)),
            Step::PhaseChanged
        );
        let s = c.status();
        assert_eq!(
            (s.state, s.reason.as_deref()),
            (MigState::Failed, Some("DrainTimeout"))
        );
        assert!(
            s.message
                .unwrap_or_default()
                .contains("GPU 0: pod ml/train-0"),
            "the holder is named on timeout"
        );
    }

    #[test]
    fn drain_timeout_fails_until_the_spec_changes() {
        let spec = NodeMigSpec {
            managed: true,
            gpus: vec![want(0, true, &[("7g.80gb", 1)])],
            ..NodeMigSpec::default()
        };
        let t0 = Instant::now();
        let mut c = MigController::new(Duration::from_secs(5));
        let hw = vec![gpu(0, true, true, &[])];
        let busy = processes_on_gpu_0();
        c.step(&hw, &spec, Some(1), &busy, t0);
        assert_eq!(
            c.step(&hw, &spec, Some(1), &busy, t0 + Duration::from_secs(6)),
            Step::PhaseChanged
        );
        let s = c.status();
        assert_eq!(
            (s.state, s.reason.as_deref()),
            (MigState::Failed, Some("DrainTimeout"))
        );
        assert!(s.message.unwrap_or_default().contains("GPU 0"));
        assert_eq!(
            c.step(&hw, &spec, Some(1), &Occupancy::default(), t0),
            Step::Idle
        );
        assert_eq!(
            c.step(&hw, &spec, Some(2), &Occupancy::default(), t0),
            Step::PhaseChanged
        );
        assert_eq!(c.status().state, MigState::Draining);
    }

    #[test]
    fn reset_pending_is_reported_while_applying() {
        let spec = NodeMigSpec {
            managed: true,
            gpus: vec![want(0, true, &[("1g.10gb", 1)])],
            ..NodeMigSpec::default()
        };
        let mut c = MigController::new(Duration::from_secs(5));
        let hw = vec![gpu(0, false, true, &[])];
        assert_eq!(
            c.step(&hw, &spec, Some(1), &Occupancy::default(), Instant::now()),
            Step::PhaseChanged
        );
        let s = c.status();
        assert_eq!(
            (s.state, s.reason.as_deref()),
            (MigState::Applying, Some("GPUResetPending"))
        );
        assert!(matches!(
            c.step(&hw, &spec, Some(1), &Occupancy::default(), Instant::now()),
            Step::Wait(_)
        ));
    }

    #[test]
    fn a_reset_pending_too_long_fails_and_a_completed_reset_then_applies() {
        let spec = NodeMigSpec {
            managed: true,
            gpus: vec![want(0, true, &[("1g.10gb", 1)])],
            ..NodeMigSpec::default()
        };
        let t0 = Instant::now();
        let mut c = MigController::new(Duration::from_secs(5));
        let pending = vec![gpu(0, false, true, &[])];
        let none = Occupancy::default();
        assert_eq!(
            c.step(&pending, &spec, Some(1), &none, t0),
            Step::PhaseChanged
        );
        assert!(matches!(
            c.step(&pending, &spec, Some(1), &none, t0 + Duration::from_secs(4)),
            Step::Wait(_)
        ));
        assert_eq!(
            c.step(&pending, &spec, Some(1), &none, t0 + Duration::from_secs(5)),
            Step::PhaseChanged
        );
        let s = c.status();
        assert_eq!(
            (s.state, s.reason.as_deref()),
            (MigState::Failed, Some("GPUResetTimeout"))
        );
        assert!(s.message.unwrap_or_default().contains("reboot"));
        // Still pending: the failure stands.
        assert_eq!(
            c.step(
                &pending,
                &spec,
                Some(1),
                &none,
                t0 + Duration::from_secs(60)
            ),
            Step::Idle
        );
        // The GPU was reset and the mode took effect: the instances are still to create,
        // so the failure stands until the spec changes...
        let reset = vec![gpu(0, true, true, &[])];
        assert_eq!(c.step(&reset, &spec, Some(1), &none, t0), Step::Idle);
        // ...unless the hardware matches the layout in full.
        let done = vec![gpu(0, true, true, &[(1, "1g.10gb", 0, 1)])];
        assert_eq!(c.step(&done, &spec, Some(1), &none, t0), Step::PhaseChanged);
        assert_eq!(c.status().state, MigState::Applied);
    }

    #[test]
    fn a_restarted_agent_keeps_a_recorded_failure_instead_of_draining_again() {
        let spec = NodeMigSpec {
            managed: true,
            gpus: vec![want(0, true, &[("7g.80gb", 1)])],
            ..NodeMigSpec::default()
        };
        let recorded = NodeMigStatus {
            state: MigState::Failed,
            reason: Some("DrainTimeout".into()),
            message: Some("compute processes still run on GPU 0".into()),
            gpus: vec![0],
            observed_generation: Some(3),
        };
        let hw = vec![gpu(0, true, true, &[])];
        let busy = processes_on_gpu_0();
        let t0 = Instant::now();
        let mut c = MigController::new(Duration::from_secs(60));
        c.restore(&recorded, Some(3));
        assert_eq!(c.step(&hw, &spec, Some(3), &busy, t0), Step::Idle);
        let s = c.status();
        assert_eq!(s.state, MigState::Failed);
        assert_eq!(
            s.reason.as_deref(),
            Some("DrainTimeout"),
            "the reason it gave"
        );
        assert_eq!(s.message, recorded.message);
        // A new spec generation is a new attempt.
        assert_eq!(c.step(&hw, &spec, Some(4), &busy, t0), Step::PhaseChanged);
        assert_eq!(c.status().state, MigState::Draining);
        // A failure recorded for another generation is not taken up.
        let mut fresh = MigController::new(Duration::from_secs(60));
        fresh.restore(&recorded, Some(4));
        assert_eq!(
            fresh.step(&hw, &spec, Some(4), &busy, t0),
            Step::PhaseChanged
        );
        assert_eq!(fresh.status().state, MigState::Draining);
    }

    #[test]
    fn unmanaged_is_idle() {
        let mut c = MigController::new(Duration::from_secs(5));
        let spec = NodeMigSpec::default();
        c.step(&[], &spec, Some(1), &Occupancy::default(), Instant::now());
        assert_eq!(c.status().state, MigState::Idle);
    }
}
