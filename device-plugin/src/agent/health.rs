//! Device health, the agent's side: NVML's health events translated for the plugins' health
//! monitor (and the Xids passed on to validation), and the re-check that lets a faulted GPU
//! recover.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;

use super::advertise::{MigIds, MigParents};
use super::{AgentError, blocking};
use crate::backend::{self, GpuBackend, HealthEventKind as BackendEventKind};
use crate::plugin::{HealthEvent, HealthEventKind, HealthProbe, HealthTarget, PluginRuntime};
use crate::xid;

/// An Xid NVML reported, for the validation ledger and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidSeen {
    /// GPU index.
    pub gpu: u32,
    /// The Xid.
    pub xid: u64,
}

/// The health monitor's view of an NVML health event kind: an Xid (79 as a lost GPU), a
/// double-bit ECC error, or nothing for a corrected single-bit error.
pub fn health_event_kind(kind: BackendEventKind) -> Option<HealthEventKind> {
    match kind {
        BackendEventKind::Xid(xid::GPU_LOST) => Some(HealthEventKind::GpuLost),
        BackendEventKind::Xid(x) => Some(HealthEventKind::Xid(x)),
        BackendEventKind::DoubleBitEcc => Some(HealthEventKind::DoubleBitEcc),
        BackendEventKind::SingleBitEcc => None,
    }
}

/// What one NVML health event means: for the health monitor (on the MIG device the driver
/// attributed it to, when it is known, else on the whole GPU), and for validation (its Xid).
pub fn translate(
    event: &backend::HealthEvent,
    mig_ids: &MigIds,
) -> (Option<HealthEvent>, Option<XidSeen>) {
    let target = match (event.gpu_instance, event.compute_instance) {
        (Some(gi), Some(ci)) => mig_ids
            .get(&(event.gpu, gi.0, ci.0))
            .and_then(|uuid| uuid.parse().ok())
            .map(HealthTarget::Device)
            .unwrap_or(HealthTarget::Gpu(event.gpu)),
        _ => HealthTarget::Gpu(event.gpu),
    };
    let health = health_event_kind(event.kind).map(|kind| HealthEvent { target, kind });
    let xid = match event.kind {
        BackendEventKind::Xid(xid) => Some(XidSeen {
            gpu: event.gpu,
            xid,
        }),
        _ => None,
    };
    (health, xid)
}

/// What the health forwarder tells the agent loop: something happened (re-validate), and the
/// Xid if it was one.
pub type Notice = Option<XidSeen>;

/// Starts NVML's health event stream and forwards each event, translated, to the health
/// monitor (`events`) and the loop (`notices`). Ends when the stream does.
pub fn spawn_forwarder(
    tasks: &mut tokio::task::JoinSet<Result<(), AgentError>>,
    runtime: &Arc<PluginRuntime>,
    backend: Arc<dyn GpuBackend>,
    stop: Arc<AtomicBool>,
    mig_ids: Arc<RwLock<MigIds>>,
    events: mpsc::Sender<HealthEvent>,
    notices: mpsc::Sender<Notice>,
) {
    let (mut raw, _thread) =
        backend::spawn_health_stream(backend, Duration::from_millis(500), stop);
    // On the kubelet-facing thread, beside the monitor it feeds.
    let forward = runtime.spawn(async move {
        while let Some(event) = raw.recv().await {
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(error = %e, "health events ended");
                    break;
                }
            };
            // Looked up under the read lock (released before awaiting), not copied per event.
            let (health, xid) = match mig_ids.read() {
                Ok(ids) => translate(&event, &ids),
                Err(_) => translate(&event, &MigIds::new()),
            };
            if let Some(health) = health {
                let _ = events.send(health).await;
            }
            let _ = notices.send(xid).await;
        }
        Ok::<(), AgentError>(())
    });
    tasks.spawn(async move {
        forward
            .await
            .map_err(|e| AgentError::Task("health forwarder", e.to_string()))?
    });
}

/// Re-checks faulted GPUs: cleared when the GPU answers again without uncorrected ECC errors.
pub struct BackendProbe {
    /// The GPUs.
    pub backend: Arc<dyn GpuBackend>,
    /// MIG UUID → parent GPU, kept current by the loop.
    pub mig_parents: Arc<RwLock<MigParents>>,
}

impl HealthProbe for BackendProbe {
    fn recheck<'a>(
        &'a self,
        target: &'a HealthTarget,
    ) -> crate::plugin::health::BoxFuture<'a, bool> {
        Box::pin(async move {
            let gpu = match target {
                HealthTarget::Gpu(g) => Some(*g),
                HealthTarget::Device(id) => self
                    .mig_parents
                    .read()
                    .ok()
                    .and_then(|m| m.get(id.as_str()).copied()),
            };
            let Some(gpu) = gpu else { return false };
            blocking(&self.backend, move |b| {
                b.health(gpu)
                    .is_ok_and(|h| h.ecc_uncorrected.unwrap_or(0) == 0)
            })
            .await
            .unwrap_or(false)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{ComputeInstanceId, GpuInstanceId};

    const MIG: &str = "MIG-11111111-2222-3333-4444-555555555555";

    fn event(kind: BackendEventKind, instance: Option<(u32, u32)>) -> backend::HealthEvent {
        backend::HealthEvent {
            gpu: 2,
            uuid: "GPU-00000000-0000-0000-0000-000000000002".parse().unwrap(),
            kind,
            gpu_instance: instance.map(|(gi, _)| GpuInstanceId(gi)),
            compute_instance: instance.map(|(_, ci)| ComputeInstanceId(ci)),
        }
    }

    #[test]
    fn nvml_event_kinds_translate() {
        let cases = [
            (BackendEventKind::Xid(79), Some(HealthEventKind::GpuLost)),
            (BackendEventKind::Xid(48), Some(HealthEventKind::Xid(48))),
            (BackendEventKind::Xid(13), Some(HealthEventKind::Xid(13))),
            (
                BackendEventKind::DoubleBitEcc,
                Some(HealthEventKind::DoubleBitEcc),
            ),
            (BackendEventKind::SingleBitEcc, None),
        ];
        for (kind, want) in cases {
            assert_eq!(health_event_kind(kind), want, "{kind:?}");
        }
    }

    #[test]
    fn events_land_on_the_mig_device_when_attributed_else_on_the_gpu() {
        let ids: MigIds = [((2, 1, 0), MIG.to_owned())].into_iter().collect();
        let mig = HealthTarget::Device(MIG.parse().unwrap());
        let cases = [
            // (event, expected health target, expected Xid)
            (
                event(BackendEventKind::Xid(48), Some((1, 0))),
                Some(mig.clone()),
                Some(48),
            ),
            // An instance the loop does not know (yet): the whole GPU.
            (
                event(BackendEventKind::Xid(48), Some((5, 0))),
                Some(HealthTarget::Gpu(2)),
                Some(48),
            ),
            (
                event(BackendEventKind::Xid(79), None),
                Some(HealthTarget::Gpu(2)),
                Some(79),
            ),
            (
                event(BackendEventKind::DoubleBitEcc, Some((1, 0))),
                Some(mig),
                None,
            ),
            (event(BackendEventKind::SingleBitEcc, None), None, None),
        ];
        for (ev, target, xid) in cases {
            let (health, seen) = translate(&ev, &ids);
            assert_eq!(health.map(|h| h.target), target, "{ev:?}");
            assert_eq!(seen.map(|s| s.xid), xid, "{ev:?}");
            assert!(seen.is_none_or(|s| s.gpu == 2));
        }
    }
}
