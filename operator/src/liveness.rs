//! Whether each node's agent is alive, and how far its clock is from ours.
//!
//! The agent stamps its GpuNode status with `heartbeatTime` at least once per heartbeat
//! interval, changed or not. Staleness is judged by this operator's clock alone: what counts is
//! when the operator last *saw* the stamp change (the GpuNode watch delivers each write), never
//! the stamp's value, which is the node's clock. A node whose clock runs behind or ahead is
//! therefore neither judged stale nor trusted forever for it. The stamp's value is used for
//! one thing: the skew between the node's clock and ours, measured when a new stamp arrives,
//! with which the node's `idleSince` times are read on the operator's clock.
//!
//! Everything here is a pure function of what was seen and when; [`Liveness`] only keeps the
//! last sighting per node.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use gpupool_crds::GpuNode;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

/// How often agents stamp their status (the agent's `--heartbeat-secs` default).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(60);

/// Skews smaller than this are the watch's delivery time and clock jitter, not a wrong clock.
pub const SKEW_TOLERANCE: Duration = Duration::from_secs(30);

/// The last stamp seen from one node's agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sighting {
    /// The stamp (the node's clock); `None` for an agent that writes none.
    pub heartbeat: Option<Timestamp>,
    /// When this operator saw it first (its own clock).
    pub seen_at: Timestamp,
    /// Node clock minus ours, measured when a stamp changed while we watched. `None` until
    /// then: a stamp found in the first list may be a minute old, which is no skew.
    pub skew: Option<SignedDuration>,
}

/// Records `heartbeat`, seen at `now`, after `prev`.
pub fn observe(prev: Option<&Sighting>, heartbeat: Option<Timestamp>, now: Timestamp) -> Sighting {
    match prev {
        Some(p) if p.heartbeat == heartbeat => p.clone(),
        Some(p) => Sighting {
            heartbeat,
            seen_at: now,
            skew: heartbeat.map(|hb| hb.duration_since(now)).or(p.skew),
        },
        None => Sighting {
            heartbeat,
            seen_at: now,
            skew: None,
        },
    }
}

/// What the operator can say of one node's agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentLiveness {
    /// Not seen yet (no GpuNode status, or the operator has just started).
    Unknown,
    /// Stamped within the staleness limit. `skew`: node clock minus ours, when measured and
    /// beyond [`SKEW_TOLERANCE`].
    Live { skew: Option<SignedDuration> },
    /// No new stamp for `silent_for`, longer than the limit.
    Stale { silent_for: Duration },
}

impl AgentLiveness {
    /// Whether what the agent reported can be acted on.
    pub fn is_live(&self) -> bool {
        matches!(self, AgentLiveness::Live { .. })
    }

    /// The measured skew beyond tolerance, if any.
    pub fn skew(&self) -> Option<SignedDuration> {
        match self {
            AgentLiveness::Live { skew } => *skew,
            _ => None,
        }
    }
}

/// Judges a sighting at `now`: stale once nothing new has been seen for `stale_after`.
pub fn judge(sighting: Option<&Sighting>, now: Timestamp, stale_after: Duration) -> AgentLiveness {
    let Some(s) = sighting else {
        return AgentLiveness::Unknown;
    };
    let silent = now.duration_since(s.seen_at);
    let limit = SignedDuration::try_from(stale_after).unwrap_or(SignedDuration::MAX);
    if silent > limit {
        return AgentLiveness::Stale {
            silent_for: Duration::try_from(silent).unwrap_or(stale_after),
        };
    }
    let tolerance = SignedDuration::try_from(SKEW_TOLERANCE).unwrap_or(SignedDuration::ZERO);
    AgentLiveness::Live {
        skew: s.skew.filter(|k| k.abs() > tolerance),
    }
}

/// A time on the node's clock, read on the operator's: `skew` is node minus operator.
pub fn on_operator_clock(t: Timestamp, skew: Option<SignedDuration>) -> Timestamp {
    match skew {
        Some(k) => t.checked_sub(k).unwrap_or(t),
        None => t,
    }
}

/// The last sighting per node, fed by the GpuNode watch as events arrive.
#[derive(Debug, Default)]
pub struct Liveness {
    seen: Mutex<HashMap<String, Sighting>>,
}

impl Liveness {
    /// Records the stamp `node`'s GpuNode carries, as delivered at `now`.
    pub fn observe(&self, node: &str, heartbeat: Option<Timestamp>, now: Timestamp) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let next = observe(seen.get(node), heartbeat, now);
        seen.insert(node.to_owned(), next);
    }

    /// Records the stamp a GpuNode carries (none before its agent's first status), as delivered
    /// at `now`.
    pub fn observe_gpunode(&self, gn: &GpuNode, now: Timestamp) {
        let heartbeat = gn
            .status
            .as_ref()
            .and_then(|s| s.heartbeat_time.as_ref())
            .map(|t| t.0);
        self.observe(&gn.name_any(), heartbeat, now);
    }

    /// Forgets a node whose GpuNode is gone.
    pub fn forget(&self, node: &str) {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(node);
    }

    /// [`judge`] for `node`.
    pub fn judge(&self, node: &str, now: Timestamp, stale_after: Duration) -> AgentLiveness {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        judge(seen.get(node), now, stale_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }
    const LIMIT: Duration = Duration::from_secs(180);

    #[test]
    fn staleness_runs_on_the_operators_clock_from_the_last_change_seen() {
        // First seen at 0 with a stamp from 50 s before: fresh, no skew measured.
        let s0 = observe(None, Some(t(-50)), t(0));
        assert_eq!(
            judge(Some(&s0), t(100), LIMIT),
            AgentLiveness::Live { skew: None }
        );
        // The same stamp again changes nothing; past the limit it is stale.
        let s1 = observe(Some(&s0), Some(t(-50)), t(170));
        assert_eq!(s1, s0);
        assert_eq!(
            judge(Some(&s1), t(181), LIMIT),
            AgentLiveness::Stale {
                silent_for: Duration::from_secs(181)
            }
        );
        // A new stamp revives it.
        let s2 = observe(Some(&s1), Some(t(200)), t(200));
        assert_eq!(
            judge(Some(&s2), t(201), LIMIT),
            AgentLiveness::Live { skew: None }
        );
        assert_eq!(judge(None, t(0), LIMIT), AgentLiveness::Unknown);
    }

    #[test]
    fn a_wrong_node_clock_neither_stales_nor_freshens_the_agent() {
        // Ten minutes behind: every stamp looks old, yet each is new.
        let behind = observe(None, Some(t(-600)), t(0));
        let behind = observe(Some(&behind), Some(t(-540)), t(60));
        let live = judge(Some(&behind), t(120), LIMIT);
        assert!(live.is_live());
        assert_eq!(live.skew(), Some(SignedDuration::from_secs(-600)));
        // Ten minutes ahead, then silent: stale by our clock although its stamp is "future".
        let ahead = observe(None, Some(t(600)), t(0));
        let ahead = observe(Some(&ahead), Some(t(660)), t(60));
        assert_eq!(
            judge(Some(&ahead), t(100), LIMIT).skew(),
            Some(SignedDuration::from_secs(600))
        );
        assert!(!judge(Some(&ahead), t(241), LIMIT).is_live());
        // Delivery delay within tolerance is no skew.
        let near = observe(Some(&observe(None, Some(t(0)), t(0))), Some(t(60)), t(62));
        assert_eq!(judge(Some(&near), t(63), LIMIT).skew(), None);
    }

    #[test]
    fn node_times_are_read_on_the_operators_clock() {
        let skew = Some(SignedDuration::from_secs(-600));
        // The node says idle since its 10:00, which is our 10:10.
        assert_eq!(on_operator_clock(t(0), skew), t(600));
        assert_eq!(on_operator_clock(t(0), None), t(0));
    }

    #[test]
    fn the_tracker_forgets_removed_nodes() {
        let l = Liveness::default();
        l.observe("n1", Some(t(0)), t(0));
        assert!(l.judge("n1", t(10), LIMIT).is_live());
        l.forget("n1");
        assert_eq!(l.judge("n1", t(10), LIMIT), AgentLiveness::Unknown);
    }
}
