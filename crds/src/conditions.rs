//! Status conditions as both status writers (operator and node agent) keep them: the
//! transition time moves only when the status does, and times are whole seconds.
//!
//! Whole seconds because that is all the API server stores of a `metav1.Time`: a condition
//! built with a finer `now` would never equal the one read back, and a writer that compares
//! before writing would see a change on every pass.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// What a condition says now, before its transition time is settled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed<'a> {
    /// Condition type, e.g. `Ready`.
    pub type_: &'a str,
    /// `True` when the condition holds.
    pub status: bool,
    /// CamelCase reason.
    pub reason: &'a str,
    /// Human-readable details.
    pub message: String,
    /// The generation of the object this was computed from.
    pub observed_generation: Option<i64>,
}

/// The Kubernetes spelling of a condition status.
pub fn status_str(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

/// `now` without its fraction of a second, as the API server stores it.
pub fn whole_seconds(now: Timestamp) -> Timestamp {
    // Cannot fail: a whole second of a valid timestamp is itself in range.
    Timestamp::from_second(now.as_second()).unwrap_or(now)
}

/// The condition `observed` describes, keeping the `lastTransitionTime` of the condition of
/// the same type in `previous` when its status is unchanged, else `now` in whole seconds.
pub fn condition(previous: &[Condition], observed: Observed<'_>, now: Timestamp) -> Condition {
    let status = status_str(observed.status);
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == observed.type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(whole_seconds(now)));
    Condition {
        type_: observed.type_.to_owned(),
        status: status.to_owned(),
        reason: observed.reason.to_owned(),
        message: observed.message,
        observed_generation: observed.observed_generation,
        last_transition_time,
    }
}

/// Sets the condition `observed` describes in `conditions` (see [`condition`]): replaced in
/// place when one of its type exists, appended otherwise, so the order of the others holds.
pub fn set_condition(conditions: &mut Vec<Condition>, observed: Observed<'_>, now: Timestamp) {
    let updated = condition(conditions, observed, now);
    match conditions.iter_mut().find(|c| c.type_ == updated.type_) {
        Some(existing) => *existing = updated,
        None => conditions.push(updated),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn observed<'a>(type_: &'a str, status: bool, reason: &'a str) -> Observed<'a> {
        Observed {
            type_,
            status,
            reason,
            message: format!("{reason} message"),
            observed_generation: Some(2),
        }
    }

    fn existing(type_: &str, status: &str, since: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: "Before".into(),
            message: "before".into(),
            observed_generation: Some(1),
            last_transition_time: Time(t(since)),
        }
    }

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let now = t("2026-03-01T12:00:30.75Z");
        let since = "2026-03-01T11:00:00Z";
        struct Case<'a> {
            name: &'a str,
            previous: Vec<Condition>,
            status: bool,
            want_since: &'a str,
        }
        let cases = [
            Case {
                name: "new condition: now, whole seconds",
                previous: vec![],
                status: true,
                want_since: "2026-03-01T12:00:30Z",
            },
            Case {
                name: "same status: kept",
                previous: vec![existing("Ready", "True", since)],
                status: true,
                want_since: since,
            },
            Case {
                name: "status flips: now",
                previous: vec![existing("Ready", "True", since)],
                status: false,
                want_since: "2026-03-01T12:00:30Z",
            },
            Case {
                name: "another type's time is not borrowed",
                previous: vec![existing("Degraded", "True", since)],
                status: true,
                want_since: "2026-03-01T12:00:30Z",
            },
            Case {
                name: "Unknown before: a transition",
                previous: vec![existing("Ready", "Unknown", since)],
                status: true,
                want_since: "2026-03-01T12:00:30Z",
            },
        ];
        for c in cases {
            let got = condition(&c.previous, observed("Ready", c.status, "Why"), now);
            assert_eq!(
                got.last_transition_time,
                Time(t(c.want_since)),
                "{}",
                c.name
            );
            assert_eq!(got.status, status_str(c.status), "{}", c.name);
            // Everything but the transition time is what was observed, whatever came before.
            assert_eq!(
                (
                    got.type_.as_str(),
                    got.reason.as_str(),
                    got.message.as_str(),
                    got.observed_generation
                ),
                ("Ready", "Why", "Why message", Some(2)),
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn set_replaces_in_place_and_appends_new_types() {
        let since = "2026-03-01T11:00:00Z";
        let mut conditions = vec![
            existing("Ready", "True", since),
            existing("Degraded", "False", since),
        ];
        let now = t("2026-03-01T12:00:00Z");
        set_condition(&mut conditions, observed("Degraded", true, "Hot"), now);
        set_condition(&mut conditions, observed("Ready", true, "Fine"), now);
        set_condition(&mut conditions, observed("APIErrors", false, "None"), now);
        let got: Vec<(&str, &str, &str, Time)> = conditions
            .iter()
            .map(|c| {
                (
                    c.type_.as_str(),
                    c.status.as_str(),
                    c.reason.as_str(),
                    c.last_transition_time.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("Ready", "True", "Fine", Time(t(since))),
                ("Degraded", "True", "Hot", Time(now)),
                ("APIErrors", "False", "None", Time(now)),
            ]
        );
    }

    #[test]
    fn setting_the_same_twice_changes_nothing() {
        let mut once = Vec::new();
        set_condition(
            &mut once,
            observed("Ready", false, "Wait"),
            t("2026-03-01T12:00:00.5Z"),
        );
        let mut twice = once.clone();
        set_condition(
            &mut twice,
            observed("Ready", false, "Wait"),
            t("2026-03-01T12:05:00Z"),
        );
        assert_eq!(once, twice);
    }
}
