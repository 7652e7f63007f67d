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
//! A stamp the operator has not *seen change* vouches for nothing: the first sighting of a
//! GpuNode (at start, after a leader change) may carry a stamp hours old from an agent that has
//! crash-looped since, and the node's clock cannot be read against ours until a change was
//! seen. Such an agent is [`AgentLiveness::Unconfirmed`] until its next stamp arrives (within
//! one heartbeat interval for a live agent): its report still describes the node, but nothing
//! disruptive (evict, suspend, deactivate, drain) is done on it. A GpuNode that carries no stamp
//! at all is never live.
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
    /// Whether this operator saw the stamp change to its current value while it watched: only
    /// then is the stamp known to have been written recently.
    pub confirmed: bool,
}

/// Records `heartbeat`, seen at `now`, after `prev`.
pub fn observe(prev: Option<&Sighting>, heartbeat: Option<Timestamp>, now: Timestamp) -> Sighting {
    match prev {
        Some(p) if p.heartbeat == heartbeat => p.clone(),
        Some(p) => Sighting {
            heartbeat,
            seen_at: now,
            skew: heartbeat.map(|hb| hb.duration_since(now)).or(p.skew),
            confirmed: heartbeat.is_some(),
        },
        None => Sighting {
            heartbeat,
            seen_at: now,
            skew: None,
            confirmed: false,
        },
    }
}

/// What the operator can say of one node's agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentLiveness {
    /// Not seen yet (no GpuNode status, or the operator has just started).
    Unknown,
    /// Seen, but no stamp change seen yet: the first sighting after this operator started, or
    /// a GpuNode with no stamp at all. Its report describes the node; nothing is done on it.
    Unconfirmed {
        /// Whether the GpuNode carries a stamp at all.
        stamped: bool,
        /// How long the operator has waited for a new stamp.
        waited: Duration,
    },
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

    /// Whether the agent's last report may be shown as the node's state (counted healthy,
    /// ready): live, or stamped and waiting for its first change after this operator started.
    /// Acting on it needs [`AgentLiveness::is_live`].
    pub fn describes_node(&self) -> bool {
        matches!(
            self,
            AgentLiveness::Live { .. } | AgentLiveness::Unconfirmed { stamped: true, .. }
        )
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
    if !s.confirmed {
        return AgentLiveness::Unconfirmed {
            stamped: s.heartbeat.is_some(),
            waited: Duration::try_from(silent).unwrap_or_default(),
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
        // First seen at 0 with a stamp from 50 s before: not yet confirmed, no skew measured.
        let s0 = observe(None, Some(t(-50)), t(0));
        assert_eq!(
            judge(Some(&s0), t(100), LIMIT),
            AgentLiveness::Unconfirmed {
                stamped: true,
                waited: Duration::from_secs(100)
            }
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

    /// An operator (re)started into a cluster finds a report whose stamp is two hours old: the
    /// agent behind it has been dead all that time. That first sighting vouches for nothing,
    /// whatever the stamp says, until a new stamp is seen arrive; a GpuNode with no stamp at
    /// all is never live, however often it is written.
    #[test]
    fn a_first_sighting_or_a_missing_stamp_is_never_live() {
        let hours_old = observe(None, Some(t(-7200)), t(0));
        for at in [0, 1, 60, 179] {
            let j = judge(Some(&hours_old), t(at), LIMIT);
            assert!(!j.is_live(), "live at {at}s on a first sighting: {j:?}");
            assert!(matches!(
                j,
                AgentLiveness::Unconfirmed { stamped: true, .. }
            ));
        }
        // Recent-looking stamps are no better: the node's clock is not known yet.
        let recent = observe(None, Some(t(0)), t(0));
        assert!(!judge(Some(&recent), t(1), LIMIT).is_live());
        // No new stamp within the limit: stale, as for any silent agent.
        assert!(matches!(
            judge(Some(&hours_old), t(181), LIMIT),
            AgentLiveness::Stale { .. }
        ));
        // A new stamp, seen arrive: live from then on.
        let beat = observe(Some(&hours_old), Some(t(30)), t(30));
        assert_eq!(
            judge(Some(&beat), t(31), LIMIT),
            AgentLiveness::Live { skew: None }
        );
        // Written again and again, but never stamped: never live.
        let unstamped = observe(None, None, t(0));
        let rewritten = observe(Some(&unstamped), None, t(10));
        assert_eq!(
            judge(Some(&rewritten), t(11), LIMIT),
            AgentLiveness::Unconfirmed {
                stamped: false,
                waited: Duration::from_secs(11)
            }
        );
        // A stamp replaced by none (a writer that drops it) is not live either.
        let dropped = observe(Some(&beat), None, t(40));
        assert!(!judge(Some(&dropped), t(41), LIMIT).is_live());
        // From none to a stamp, seen while watching: the agent wrote it just now.
        let first_beat = observe(Some(&unstamped), Some(t(50)), t(50));
        assert!(judge(Some(&first_beat), t(51), LIMIT).is_live());
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
        l.observe("n1", Some(t(5)), t(5));
        assert!(l.judge("n1", t(10), LIMIT).is_live());
        l.forget("n1");
        assert_eq!(l.judge("n1", t(10), LIMIT), AgentLiveness::Unknown);
    }
}
