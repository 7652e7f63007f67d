//! MIG reconfiguration as a job of the agent: steps the MIG state machine ([`crate::mig`],
//! pure) against a fresh read of the hardware, runs the operations it asks for through the
//! backend, one at a time, paced by `--mig-step-delay-ms`.
//!
//! While draining, each step reads afresh what holds the GPUs ([`crate::occupancy`]): the
//! kubelet's PodResources (a pod holding a MIG device keeps its GPU busy with or without a
//! process) and NVML's process lists, and whether those lists are the host's at all.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpupool_crds::node::{NodeMigSpec, NodeMigStatus};
use tokio::time::Instant;

use super::blocking;
use crate::backend::GpuBackend;
use crate::inventory::Inventory;
use crate::mig::{self, MigController, Phase, Step};
use crate::occupancy::{self, Evidence, Occupancy};
use crate::podresources::PodSource;

/// How long one PodResources read may take.
const POD_RESOURCES_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// Where the pods holding devices are learnt.
    pod_resources: PodSource,
}

impl MigJob {
    /// A job that gives up draining after `drain_timeout`, waits `step_delay` between
    /// operations and asks the kubelet at `pod_resources` which pods hold the GPUs.
    pub fn new(
        drain_timeout: Duration,
        step_delay: Duration,
        pod_resources: PodSource,
        now: Instant,
    ) -> MigJob {
        MigJob {
            controller: MigController::new(drain_timeout),
            next_op: now,
            step_delay,
            pod_resources,
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

    /// One step towards `spec` from the hardware as `inventory` shows it. `host_processes` says
    /// whether the process lists NVML gives are the host's (see [`crate::pidns`]).
    pub async fn advance(
        &mut self,
        backend: &Arc<dyn GpuBackend>,
        spec: &NodeMigSpec,
        generation: Option<i64>,
        inventory: &Inventory,
        host_processes: Result<(), &str>,
    ) -> MigProgress {
        let current = mig::current_from_inventory(inventory);
        // Only a drain decides from what holds the GPUs; steady state costs no kubelet call.
        let busy = if matches!(self.controller.phase(), Phase::Draining { .. }) {
            self.occupancy(backend, inventory, host_processes).await
        } else {
            Occupancy::default()
        };
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

    /// What holds each GPU now: PodResources and the process lists, read afresh.
    async fn occupancy(
        &self,
        backend: &Arc<dyn GpuBackend>,
        inv: &Inventory,
        host_processes: Result<(), &str>,
    ) -> Occupancy {
        let pods = self
            .pod_resources
            .list(POD_RESOURCES_TIMEOUT)
            .await
            .map_err(|e| e.to_string());
        if let Err(e) = &pods {
            tracing::debug!(error = %e, "PodResources unreadable: every GPU counts as held");
        }
        let processes = process_counts(backend, inv).await;
        occupancy::occupancy(
            &occupancy::device_ids(inv),
            Evidence {
                pods: pods.as_ref().map_err(String::as_str),
                processes: &processes,
                host_processes,
            },
        )
    }
}

/// The number of compute processes on each GPU, or why its list could not be read. A GPU
/// missing from the answer (the blocking task died) counts as unread, never as free.
async fn process_counts(
    backend: &Arc<dyn GpuBackend>,
    inv: &Inventory,
) -> BTreeMap<u32, Result<usize, String>> {
    let indices: Vec<u32> = inv.gpus.iter().map(|g| g.device.index).collect();
    blocking(backend, move |b| {
        indices
            .into_iter()
            .map(|i| {
                (
                    i,
                    b.processes(i).map(|ps| ps.len()).map_err(|e| e.to_string()),
                )
            })
            .collect()
    })
    .await
    .unwrap_or_default()
}
