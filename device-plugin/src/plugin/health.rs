//! Device health policy: which events make a device Unhealthy, and when it may
//! come back.
//!
//! A device goes Unhealthy on a critical Xid (anything but the application-class
//! ones in [`DEFAULT_IGNORED_XIDS`]), a double-bit ECC error, or when its GPU falls
//! off the bus. Unlike NVIDIA's plugin, where Unhealthy is final until the plugin
//! restarts, a device comes back by itself: once a re-check reports the fault
//! cleared, it stays Unhealthy for a hold-down period and returns to Healthy only
//! if no new fault arrives meanwhile, so a flapping GPU is not handed out.
//!
//! [`HealthTracker`] is the pure state machine (time passed in); [`HealthMonitor`]
//! drives it from an event channel, a [`Clock`] and an optional [`HealthProbe`],
//! and publishes the health-overlaid [`Advertisement`] on a watch channel.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::metrics::PluginMetrics;
use super::model::{Advertisement, DeviceId, Health};

pub use crate::xid::DEFAULT_IGNORED_XIDS;

/// What makes devices go Unhealthy and how fast they come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Xids that do not affect health.
    pub ignored_xids: BTreeSet<u64>,
    /// How long a device stays Unhealthy after its fault was seen to clear.
    pub hold_down: Duration,
    /// How often faulted targets are re-checked through the [`HealthProbe`].
    pub recheck_interval: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            ignored_xids: DEFAULT_IGNORED_XIDS.into_iter().collect(),
            hold_down: Duration::from_secs(300),
            recheck_interval: Duration::from_secs(30),
        }
    }
}

/// What a health event is about: a whole GPU (and every MIG device on it), or one device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HealthTarget {
    /// GPU by index; covers the GPU and all its MIG devices.
    Gpu(u32),
    /// One advertised device (GPU or MIG UUID).
    Device(DeviceId),
}

impl fmt::Display for HealthTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu(i) => write!(f, "GPU {i}"),
            Self::Device(id) => write!(f, "device {id}"),
        }
    }
}

/// Something the health monitor was told about a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEventKind {
    /// An Xid error with this code.
    Xid(u64),
    /// An uncorrectable (double-bit) ECC error.
    DoubleBitEcc,
    /// The GPU is gone from the PCIe bus (Xid 79 or NVML `GPU_IS_LOST`).
    GpuLost,
    /// A re-check found the target's fault cleared.
    Cleared,
}

/// A health event for one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthEvent {
    /// What the event is about.
    pub target: HealthTarget,
    /// What happened.
    pub kind: HealthEventKind,
}

/// Why a target is Unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultReason {
    /// A critical Xid.
    Xid(u64),
    /// A double-bit ECC error.
    DoubleBitEcc,
    /// Fell off the bus.
    GpuLost,
}

impl fmt::Display for FaultReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Xid(x) => write!(f, "critical Xid {x}"),
            Self::DoubleBitEcc => f.write_str("double-bit ECC error"),
            Self::GpuLost => f.write_str("GPU lost from the bus"),
        }
    }
}

/// A change in a target's health, for logging and counting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Healthy → Unhealthy.
    Unhealthy {
        /// The target.
        target: HealthTarget,
        /// Why.
        reason: FaultReason,
    },
    /// A new fault during the hold-down: stays Unhealthy, waits for a fresh clear.
    Refaulted {
        /// The target.
        target: HealthTarget,
        /// The new fault.
        reason: FaultReason,
    },
    /// The fault cleared; the hold-down runs until `healthy_at`.
    HoldDown {
        /// The target.
        target: HealthTarget,
        /// When it becomes Healthy unless a new fault arrives.
        healthy_at: Instant,
    },
    /// Unhealthy → Healthy after the hold-down.
    Healthy {
        /// The target.
        target: HealthTarget,
        /// The fault it recovered from.
        recovered_from: FaultReason,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultState {
    Faulted {
        reason: FaultReason,
    },
    HoldDown {
        reason: FaultReason,
        healthy_at: Instant,
    },
}

impl FaultState {
    fn reason(&self) -> FaultReason {
        match *self {
            Self::Faulted { reason } | Self::HoldDown { reason, .. } => reason,
        }
    }
}

/// The health state machine, per target. Pure: callers pass `now`.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    policy: HealthPolicy,
    faults: BTreeMap<HealthTarget, FaultState>,
}

impl HealthTracker {
    /// A tracker with every target Healthy.
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            policy,
            faults: BTreeMap::new(),
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// True for Xids the policy ignores.
    pub fn is_ignored(&self, kind: HealthEventKind) -> bool {
        matches!(kind, HealthEventKind::Xid(x) if self.policy.ignored_xids.contains(&x))
    }

    /// Applies one event; returns the transition it caused, if any.
    pub fn on_event(&mut self, event: &HealthEvent, now: Instant) -> Option<Transition> {
        let reason = match event.kind {
            HealthEventKind::Xid(x) if self.policy.ignored_xids.contains(&x) => return None,
            HealthEventKind::Xid(x) => FaultReason::Xid(x),
            HealthEventKind::DoubleBitEcc => FaultReason::DoubleBitEcc,
            HealthEventKind::GpuLost => FaultReason::GpuLost,
            HealthEventKind::Cleared => {
                let state = self.faults.get_mut(&event.target)?;
                return match *state {
                    FaultState::Faulted { reason } => {
                        let healthy_at = now + self.policy.hold_down;
                        *state = FaultState::HoldDown { reason, healthy_at };
                        Some(Transition::HoldDown {
                            target: event.target.clone(),
                            healthy_at,
                        })
                    }
                    // Already counting down; a repeated "cleared" must not extend it.
                    FaultState::HoldDown { .. } => None,
                };
            }
        };
        let target = event.target.clone();
        match self
            .faults
            .insert(target.clone(), FaultState::Faulted { reason })
        {
            None => Some(Transition::Unhealthy { target, reason }),
            Some(FaultState::HoldDown { .. }) => Some(Transition::Refaulted { target, reason }),
            Some(previous @ FaultState::Faulted { .. }) => {
                // Still faulted; keep the first reason so logs stay stable.
                self.faults.insert(target, previous);
                None
            }
        }
    }

    /// Ends every hold-down due at `now`; returns the recoveries.
    pub fn poll(&mut self, now: Instant) -> Vec<Transition> {
        let due: Vec<HealthTarget> = self
            .faults
            .iter()
            .filter(
                |(_, s)| matches!(s, FaultState::HoldDown { healthy_at, .. } if *healthy_at <= now),
            )
            .map(|(t, _)| t.clone())
            .collect();
        due.into_iter()
            .filter_map(|target| {
                let state = self.faults.remove(&target)?;
                Some(Transition::Healthy {
                    target,
                    recovered_from: state.reason(),
                })
            })
            .collect()
    }

    /// The earliest pending end of a hold-down.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.faults
            .values()
            .filter_map(|s| match s {
                FaultState::HoldDown { healthy_at, .. } => Some(*healthy_at),
                FaultState::Faulted { .. } => None,
            })
            .min()
    }

    /// Targets whose fault has not yet been seen to clear (to re-check).
    pub fn faulted_targets(&self) -> Vec<HealthTarget> {
        self.faults
            .iter()
            .filter(|(_, s)| matches!(s, FaultState::Faulted { .. }))
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// The health of one device given its ID and parent GPU.
    pub fn device_health(&self, id: &DeviceId, parent_gpu: u32) -> Health {
        self.health_of(id, parent_gpu, true)
    }

    /// [`HealthTracker::device_health`]; `device_faults: false` says no device-level fault is
    /// tracked, which spares building a key (a copy of the ID) for each device looked up.
    fn health_of(&self, id: &DeviceId, parent_gpu: u32, device_faults: bool) -> Health {
        let own = device_faults
            .then(|| self.faults.get(&HealthTarget::Device(id.clone())))
            .flatten();
        let parent = self.faults.get(&HealthTarget::Gpu(parent_gpu));
        match own.or(parent) {
            None => Health::Healthy,
            Some(state) => Health::Unhealthy {
                reason: state.reason().to_string(),
            },
        }
    }

    /// `base` with every device's health set from the tracked faults.
    pub fn overlay(&self, base: &Advertisement) -> Advertisement {
        let mut out = base.clone();
        if self.faults.is_empty() {
            // Every device tracked Healthy: each keeps the health it is advertised with.
            return out;
        }
        let device_faults = self
            .faults
            .keys()
            .any(|t| matches!(t, HealthTarget::Device(_)));
        for devices in out.resources.values_mut() {
            for device in devices.iter_mut() {
                // A replica is as healthy as the device it shares. A device the agent already
                // advertises Unhealthy (an MPS replica whose server is down) stays so.
                let tracked = self.health_of(device.underlying(), device.parent_gpu, device_faults);
                if !tracked.is_healthy() || device.health.is_healthy() {
                    device.health = tracked;
                }
            }
        }
        out
    }
}

/// A boxed future, for the object-safe traits below.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Time source for the health monitor, so tests can drive the hold-down.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
    /// Completes once `now() >= deadline`.
    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()>;
}

/// The real clock (tokio timers, so `tokio::time::pause` also works).
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep_until(deadline.into()))
    }
}

/// A clock that only moves when told to.
#[derive(Debug)]
pub struct ManualClock {
    base: Instant,
    offset: watch::Sender<Duration>,
}

impl ManualClock {
    /// A clock standing at an arbitrary start instant.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            base: Instant::now(),
            offset: watch::Sender::new(Duration::ZERO),
        })
    }

    /// Moves time forward by `by`, waking sleepers that are due.
    pub fn advance(&self, by: Duration) {
        self.offset.send_modify(|o| *o += by);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + *self.offset.borrow()
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        let mut rx = self.offset.subscribe();
        let base = self.base;
        Box::pin(async move {
            // The sender lives as long as the clock; if it is gone, time is over anyway.
            let _ = rx.wait_for(|o| base + *o >= deadline).await;
        })
    }
}

/// Re-checks a faulted target, e.g. by querying NVML for the GPU again.
pub trait HealthProbe: Send + Sync + 'static {
    /// True when the fault on `target` has cleared.
    fn recheck<'a>(&'a self, target: &'a HealthTarget) -> BoxFuture<'a, bool>;
}

/// Drives a [`HealthTracker`] and publishes the health-overlaid advertisement.
pub struct HealthMonitor {
    policy: HealthPolicy,
    clock: Arc<dyn Clock>,
    probe: Option<Arc<dyn HealthProbe>>,
    metrics: Arc<PluginMetrics>,
}

impl HealthMonitor {
    /// A monitor with the real clock and no probe (clears arrive as events).
    pub fn new(policy: HealthPolicy, metrics: Arc<PluginMetrics>) -> Self {
        Self {
            policy,
            clock: Arc::new(TokioClock),
            probe: None,
            metrics,
        }
    }

    /// Uses `clock` instead of the real one.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Re-checks faulted targets through `probe` every `recheck_interval`.
    pub fn with_probe(mut self, probe: Arc<dyn HealthProbe>) -> Self {
        self.probe = Some(probe);
        self
    }

    /// Runs until `cancel`: reads the device layout (all Healthy) from `layout`
    /// and events from `events`, and publishes the layout with health applied on
    /// `out` whenever it changes.
    pub async fn run(
        self,
        mut layout: watch::Receiver<Advertisement>,
        mut events: mpsc::Receiver<HealthEvent>,
        out: watch::Sender<Advertisement>,
        cancel: CancellationToken,
    ) {
        let mut tracker = HealthTracker::new(self.policy.clone());
        let mut next_recheck = self.clock.now() + self.policy.recheck_interval;
        let (mut layout_open, mut events_open) = (true, true);
        publish(&out, tracker.overlay(&layout.borrow_and_update()));
        loop {
            let recheck_due = (self.probe.is_some() && !tracker.faulted_targets().is_empty())
                .then_some(next_recheck);
            let wake = match (tracker.next_deadline(), recheck_due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let sleep = match wake {
                Some(at) => self.clock.sleep_until(at),
                None => Box::pin(std::future::pending()),
            };
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                changed = layout.changed(), if layout_open => {
                    if changed.is_err() {
                        layout_open = false;
                    }
                }
                event = events.recv(), if events_open => match event {
                    Some(event) => {
                        self.apply(&mut tracker, &event);
                        // Take whatever else is queued so a burst publishes once.
                        while let Ok(event) = events.try_recv() {
                            self.apply(&mut tracker, &event);
                        }
                    }
                    None => events_open = false,
                },
                () = sleep => {}
            }
            let now = self.clock.now();
            if let Some(probe) = self.probe.as_ref().filter(|_| now >= next_recheck) {
                for target in tracker.faulted_targets() {
                    if probe.recheck(&target).await {
                        self.apply(
                            &mut tracker,
                            &HealthEvent {
                                target,
                                kind: HealthEventKind::Cleared,
                            },
                        );
                    }
                }
                next_recheck = now + self.policy.recheck_interval;
            }
            for transition in tracker.poll(now) {
                self.record(&transition);
            }
            publish(&out, tracker.overlay(&layout.borrow_and_update()));
        }
    }

    fn apply(&self, tracker: &mut HealthTracker, event: &HealthEvent) {
        if tracker.is_ignored(event.kind) {
            PluginMetrics::inc(&self.metrics.ignored_xids);
            tracing::debug!(target_device = %event.target, kind = ?event.kind, "ignoring application-class Xid");
            return;
        }
        if let Some(transition) = tracker.on_event(event, self.clock.now()) {
            self.record(&transition);
        }
    }

    fn record(&self, transition: &Transition) {
        match transition {
            Transition::Unhealthy { target, reason } => {
                PluginMetrics::inc(&self.metrics.health_unhealthy_transitions);
                tracing::warn!(target_device = %target, %reason, "marking unhealthy");
            }
            Transition::Refaulted { target, reason } => {
                tracing::warn!(target_device = %target, %reason, "new fault during hold-down; staying unhealthy");
            }
            Transition::HoldDown { target, .. } => {
                tracing::info!(
                    target_device = %target,
                    hold_down_s = self.policy.hold_down.as_secs_f64(),
                    "fault cleared; healthy again after the hold-down"
                );
            }
            Transition::Healthy {
                target,
                recovered_from,
            } => {
                PluginMetrics::inc(&self.metrics.health_healthy_transitions);
                tracing::info!(target_device = %target, %recovered_from, "healthy again after hold-down");
            }
        }
    }
}

fn publish(out: &watch::Sender<Advertisement>, next: Advertisement) {
    out.send_if_modified(|current| {
        if *current == next {
            false
        } else {
            *current = next;
            true
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> DeviceId {
        s.parse().unwrap()
    }

    fn ev(target: HealthTarget, kind: HealthEventKind) -> HealthEvent {
        HealthEvent { target, kind }
    }

    fn policy() -> HealthPolicy {
        HealthPolicy {
            hold_down: Duration::from_secs(60),
            ..HealthPolicy::default()
        }
    }

    #[test]
    fn which_events_fault() {
        let t0 = Instant::now();
        let cases = [
            (HealthEventKind::Xid(13), false),
            (HealthEventKind::Xid(31), false),
            (HealthEventKind::Xid(43), false),
            (HealthEventKind::Xid(45), false),
            (HealthEventKind::Xid(68), false),
            (HealthEventKind::Xid(109), false),
            (HealthEventKind::Xid(48), true),
            (HealthEventKind::Xid(79), true),
            (HealthEventKind::Xid(94), true),
            (HealthEventKind::DoubleBitEcc, true),
            (HealthEventKind::GpuLost, true),
            (HealthEventKind::Cleared, false),
        ];
        for (kind, faults) in cases {
            let mut tracker = HealthTracker::new(policy());
            let got = tracker.on_event(&ev(HealthTarget::Gpu(0), kind), t0);
            assert_eq!(got.is_some(), faults, "{kind:?}");
        }
    }

    #[test]
    fn ignored_xids_are_configurable() {
        let mut tracker = HealthTracker::new(HealthPolicy {
            ignored_xids: [48].into_iter().collect(),
            ..policy()
        });
        let t0 = Instant::now();
        assert_eq!(
            tracker.on_event(&ev(HealthTarget::Gpu(0), HealthEventKind::Xid(48)), t0),
            None
        );
        assert!(
            tracker
                .on_event(&ev(HealthTarget::Gpu(0), HealthEventKind::Xid(13)), t0)
                .is_some()
        );
    }

    #[test]
    fn recovers_only_after_hold_down_without_new_faults() {
        let t0 = Instant::now();
        let gpu = HealthTarget::Gpu(1);
        let mut tracker = HealthTracker::new(policy());
        assert_eq!(
            tracker.on_event(&ev(gpu.clone(), HealthEventKind::Xid(79)), t0),
            Some(Transition::Unhealthy {
                target: gpu.clone(),
                reason: FaultReason::Xid(79)
            })
        );
        // A second fault while faulted changes nothing.
        assert_eq!(
            tracker.on_event(&ev(gpu.clone(), HealthEventKind::DoubleBitEcc), t0),
            None
        );
        assert_eq!(tracker.faulted_targets(), vec![gpu.clone()]);

        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(
            tracker.on_event(&ev(gpu.clone(), HealthEventKind::Cleared), t1),
            Some(Transition::HoldDown {
                target: gpu.clone(),
                healthy_at: t1 + Duration::from_secs(60)
            })
        );
        assert!(tracker.faulted_targets().is_empty());
        // Repeated clears do not extend the hold-down.
        assert_eq!(
            tracker.on_event(
                &ev(gpu.clone(), HealthEventKind::Cleared),
                t1 + Duration::from_secs(5)
            ),
            None
        );
        assert!(tracker.poll(t1 + Duration::from_secs(59)).is_empty());

        // A flap during the hold-down sends it back to faulted.
        let t2 = t1 + Duration::from_secs(30);
        assert_eq!(
            tracker.on_event(&ev(gpu.clone(), HealthEventKind::Xid(94)), t2),
            Some(Transition::Refaulted {
                target: gpu.clone(),
                reason: FaultReason::Xid(94)
            })
        );
        assert!(tracker.poll(t1 + Duration::from_secs(61)).is_empty());
        assert_eq!(tracker.next_deadline(), None);

        let t3 = t2 + Duration::from_secs(1);
        tracker.on_event(&ev(gpu.clone(), HealthEventKind::Cleared), t3);
        assert_eq!(tracker.next_deadline(), Some(t3 + Duration::from_secs(60)));
        assert_eq!(
            tracker.poll(t3 + Duration::from_secs(60)),
            vec![Transition::Healthy {
                target: gpu.clone(),
                recovered_from: FaultReason::Xid(94)
            }]
        );
        assert_eq!(tracker.device_health(&id("GPU-1"), 1), Health::Healthy);
    }

    #[test]
    fn gpu_faults_cover_mig_devices_and_device_faults_do_not_spread() {
        let t0 = Instant::now();
        let mut tracker = HealthTracker::new(policy());
        tracker.on_event(&ev(HealthTarget::Gpu(0), HealthEventKind::GpuLost), t0);
        tracker.on_event(
            &ev(HealthTarget::Device(id("MIG-b")), HealthEventKind::Xid(94)),
            t0,
        );
        assert_eq!(
            tracker.device_health(&id("MIG-a"), 0),
            Health::Unhealthy {
                reason: "GPU lost from the bus".into()
            }
        );
        assert_eq!(
            tracker.device_health(&id("MIG-b"), 1),
            Health::Unhealthy {
                reason: "critical Xid 94".into()
            }
        );
        assert_eq!(tracker.device_health(&id("MIG-c"), 1), Health::Healthy);
    }

    #[tokio::test]
    async fn manual_clock_wakes_sleepers_when_advanced() {
        let clock = ManualClock::new();
        let deadline = clock.now() + Duration::from_secs(5);
        let mut sleep = clock.sleep_until(deadline);
        assert!(futures::poll!(&mut sleep).is_pending());
        clock.advance(Duration::from_secs(4));
        assert!(futures::poll!(&mut sleep).is_pending());
        clock.advance(Duration::from_secs(1));
        sleep.await;
        assert!(clock.now() >= deadline);
    }

    /// Says "cleared" for GPU targets once `healthy` is set.
    struct FlagProbe {
        healthy: std::sync::atomic::AtomicBool,
        calls: std::sync::atomic::AtomicU64,
    }

    impl HealthProbe for FlagProbe {
        fn recheck<'a>(&'a self, _target: &'a HealthTarget) -> BoxFuture<'a, bool> {
            use std::sync::atomic::Ordering;
            self.calls.fetch_add(1, Ordering::SeqCst);
            let healthy = self.healthy.load(Ordering::SeqCst);
            Box::pin(async move { healthy })
        }
    }

    fn layout() -> Advertisement {
        let device = crate::plugin::model::AdvertisedDevice {
            id: id("GPU-0"),
            cdi_name: "0".into(),
            health: Health::Healthy,
            numa_node: None,
            parent_gpu: 0,
            replica: None,
        };
        Advertisement {
            resources: [("nvidia.com/gpu".parse().unwrap(), vec![device])]
                .into_iter()
                .collect(),
            topology: Arc::default(),
        }
    }

    fn gpu0_health(rx: &watch::Receiver<Advertisement>) -> Health {
        rx.borrow().resources.values().next().unwrap()[0]
            .health
            .clone()
    }

    #[tokio::test]
    async fn monitor_rechecks_through_the_probe_and_recovers_after_hold_down() {
        use std::sync::atomic::Ordering;
        let clock = ManualClock::new();
        let probe = Arc::new(FlagProbe {
            healthy: false.into(),
            calls: 0.into(),
        });
        let metrics = Arc::new(PluginMetrics::default());
        let policy = HealthPolicy {
            hold_down: Duration::from_secs(60),
            recheck_interval: Duration::from_secs(10),
            ..HealthPolicy::default()
        };
        let (_layout_tx, layout_rx) = watch::channel(layout());
        let (events_tx, events_rx) = mpsc::channel(4);
        let (out_tx, mut out_rx) = watch::channel(layout());
        let cancel = CancellationToken::new();
        let monitor = HealthMonitor::new(policy, metrics.clone())
            .with_clock(clock.clone())
            .with_probe(probe.clone());
        let task = tokio::spawn(monitor.run(layout_rx, events_rx, out_tx, cancel.clone()));

        events_tx
            .send(ev(HealthTarget::Gpu(0), HealthEventKind::Xid(79)))
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), out_rx.wait_for(|a| a != &layout()))
            .await
            .expect("unhealthy published")
            .unwrap();
        assert!(!gpu0_health(&out_rx).is_healthy());

        // A recheck that still sees the fault keeps it faulted.
        clock.advance(Duration::from_secs(10));
        while probe.calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // The fault clears: the next recheck starts the hold-down, which then runs out.
        probe.healthy.store(true, Ordering::SeqCst);
        clock.advance(Duration::from_secs(10));
        while probe.calls.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        assert!(!gpu0_health(&out_rx).is_healthy(), "still in hold-down");
        clock.advance(Duration::from_secs(60));
        tokio::time::timeout(Duration::from_secs(10), out_rx.wait_for(|a| a == &layout()))
            .await
            .expect("recovery published")
            .unwrap();
        assert_eq!(metrics.snapshot().health_healthy_transitions, 1);
        cancel.cancel();
        task.await.unwrap();
    }
}
