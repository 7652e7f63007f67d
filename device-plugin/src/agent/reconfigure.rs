//! MIG reconfiguration as a job of the agent: steps the MIG state machine ([`crate::mig`],
//! pure) against a fresh read of the hardware, runs the operations it asks for through the
//! backend, one at a time, paced by `--mig-step-delay-ms`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use gpupool_crds::node::{NodeMigSpec, NodeMigStatus};
use tokio::time::Instant;

use super::blocking;
use crate::backend::GpuBackend;
use crate::inventory::Inventory;
use crate::mig::{self, MigController, Step};

/// What one step of the job came to.
#[derive(Debug, PartialEq, Eq)]
pub enum MigProgress {
    /// Nothing more to do now; come back at this time, if any.
    Waiting(Option<Instant>),
    /// The phase changed: report it, then step again.
    PhaseChanged,
    /// An operation ran: read the hardware again, then step again.
    Executed,
    /// An operation failed (the phase is `Failed` now): report it and stop stepping.
    Failed,
}

/// The MIG state machine and the pacing of its operations.
pub struct MigJob {
    controller: MigController,
    /// Earliest time for the next operation.
    next_op: Instant,
    step_delay: Duration,
}

impl MigJob {
    /// A job that gives up draining after `drain_timeout` and waits `step_delay` between
    /// operations.
    pub fn new(drain_timeout: Duration, step_delay: Duration, now: Instant) -> MigJob {
        MigJob {
            controller: MigController::new(drain_timeout),
            next_op: now,
            step_delay,
        }
    }

    /// Whether the node is mid-reconfiguration (devices must not be re-advertised).
    pub fn busy(&self) -> bool {
        self.controller.busy()
    }

    /// Takes up a failure the GpuNode's status records for this spec generation (see
    /// [`MigController::restore`]): a restarted agent does not drain the node again for a
    /// change that already failed.
    pub fn restore(&mut self, status: &NodeMigStatus, generation: Option<i64>) {
        self.controller.restore(status, generation);
    }

    /// Where reconfiguration stands, as GpuNode status.
    pub fn status(&self) -> NodeMigStatus {
        self.controller.status()
    }

    /// One step towards `spec` from the hardware as `inventory` shows it.
    pub async fn advance(
        &mut self,
        backend: &Arc<dyn GpuBackend>,
        spec: &NodeMigSpec,
        generation: Option<i64>,
        inventory: &Inventory,
    ) -> MigProgress {
        let current = mig::current_from_inventory(inventory);
        let busy = busy_gpus(backend, inventory).await;
        let step =
            self.controller
                .step(&current, spec, generation, &busy, Instant::now().into_std());
        match step {
            Step::Idle => MigProgress::Waiting(None),
            Step::Wait(d) => MigProgress::Waiting(Some(Instant::now() + d)),
            Step::PhaseChanged => MigProgress::PhaseChanged,
            Step::Execute(op) => {
                let now = Instant::now();
                if now < self.next_op {
                    return MigProgress::Waiting(Some(self.next_op));
                }
                self.next_op = now + self.step_delay;
                tracing::info!(%op, "MIG");
                let result = blocking(backend, move |b| mig::apply_op(b, &op)).await;
                match result {
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "MIG operation failed");
                        self.controller.fail(&e);
                        MigProgress::Failed
                    }
                    // The blocking task died; the next pass reads the hardware afresh.
                    None => MigProgress::Waiting(None),
                    Some(Ok(_)) => MigProgress::Executed,
                }
            }
        }
    }
}

/// The GPUs a MIG change must wait for, from the backend.
async fn busy_gpus(backend: &Arc<dyn GpuBackend>, inv: &Inventory) -> BTreeSet<u32> {
    let indices: Vec<u32> = inv.gpus.iter().map(|g| g.device.index).collect();
    let all = indices.clone();
    blocking(backend, move |b| {
        busy_from(indices.into_iter().map(|i| (i, b.processes(i))))
    })
    .await
    // The blocking task died: nothing is known, so nothing may be taken as free.
    .unwrap_or_else(|| all.into_iter().collect())
}

/// The GPUs a MIG change must wait for: those with compute processes, and those whose process
/// list could not be read (an unreadable list never passes for an idle GPU).
fn busy_from<T, E: std::fmt::Display>(
    lists: impl IntoIterator<Item = (u32, Result<Vec<T>, E>)>,
) -> BTreeSet<u32> {
    lists
        .into_iter()
        .filter(|(gpu, list)| match list {
            Ok(processes) => !processes.is_empty(),
            Err(e) => {
                // Debug only: this runs every pass, and a lost GPU is reported by health.
                tracing::debug!(gpu, error = %e, "cannot list compute processes: counted as busy");
                true
            }
        })
        .map(|(gpu, _)| gpu)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_is_free_only_when_its_process_list_reads_empty() {
        let lists: Vec<(u32, Result<Vec<u32>, String>)> = vec![
            (0, Ok(vec![])),
            (1, Ok(vec![4242])),
            (2, Err("GPU is lost".into())),
            (3, Ok(vec![])),
        ];
        assert_eq!(busy_from(lists), BTreeSet::from([1, 2]));
    }
}
