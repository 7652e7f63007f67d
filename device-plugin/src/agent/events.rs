//! Events on the GpuNode, on transitions only: what the agent observed at its last report is
//! compared with what it observes now ([`transitions`], pure), and each difference worth telling
//! an admin becomes one Event.

use std::collections::BTreeMap;

use gpupool_crds::node::{CheckResult, GpuNode, MigState, NodeMigStatus, Verdict};
use kube::Resource;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder};

use super::cdi_spec::SpecProblem;
use super::foreign_plugin;
use crate::plugin::foreign::Findings;

/// The health of one GPU as the agent reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealthSeen {
    /// The GPU's UUID.
    pub uuid: String,
    /// Why it is unhealthy; `None` when healthy.
    pub fault: Option<String>,
}

/// What the agent's Events are about, as observed at one report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// The driver checks as last run (empty before the first run).
    pub checks: Vec<CheckResult>,
    /// The MIG state machine's status; `None` before the first report.
    pub mig: Option<NodeMigStatus>,
    /// Per GPU index; `None` when the inventory could not be read this time (nothing is said
    /// about the GPUs then, and what was seen before is kept).
    pub gpu_health: Option<BTreeMap<u32, GpuHealthSeen>>,
    /// The last PodResources call: `None` before the first.
    pub pod_resources: Option<Result<(), String>>,
    /// Why the CDI spec was last not written; `None` when it was.
    pub cdi_error: Option<String>,
    /// What the last check of the spec file found; `None` before the first write or with CDI
    /// off.
    pub cdi_spec: Option<Result<(), SpecProblem>>,
    /// What the last scan for other device plugins found; `None` before the first.
    pub foreign_plugin: Option<Findings>,
    /// Each MPS daemon by GPU index: serving, or why not (starting counts as not yet).
    pub mps: BTreeMap<u32, Result<(), String>>,
}

/// One Event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEvent {
    /// Warning, else Normal.
    pub warning: bool,
    /// The Event's reason.
    pub reason: &'static str,
    /// Its action: kube's recorder folds Events with the same reason and action into one
    /// series (keeping the first note), so an Event whose note matters names what differs here.
    pub action: String,
    /// What happened, for the admin.
    pub note: String,
}

impl AgentEvent {
    fn new(warning: bool, reason: &'static str, note: String) -> AgentEvent {
        AgentEvent {
            warning,
            reason,
            action: reason.to_owned(),
            note,
        }
    }

    fn with_action(mut self, action: String) -> AgentEvent {
        self.action = action;
        self
    }
}

/// Verdict of a set of checks: `None` when none ran.
fn passed(checks: &[CheckResult]) -> Option<bool> {
    match Verdict::of_checks(checks) {
        Verdict::True => Some(true),
        Verdict::False => Some(false),
        Verdict::Unknown => None,
    }
}

fn failures(checks: &[CheckResult]) -> Vec<String> {
    checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| format!("{}: {}", c.name, c.message))
        .collect()
}

fn mig_events(previous: Option<&NodeMigStatus>, now: &NodeMigStatus) -> Option<AgentEvent> {
    let prev = previous.map(|s| s.state);
    if prev == Some(now.state) {
        return None;
    }
    let gpus: Vec<String> = now.gpus.iter().map(u32::to_string).collect();
    let gpus = gpus.join(", ");
    match now.state {
        MigState::Draining => Some(AgentEvent::new(
            false,
            "MigDraining",
            format!("waiting for GPU pods to leave GPU {gpus} before changing MIG"),
        )),
        MigState::Applying => Some(AgentEvent::new(
            false,
            "MigApplying",
            format!("changing MIG on GPU {gpus}"),
        )),
        // Applied right after start, or after no change at all, is no news.
        MigState::Applied if prev.is_some() && prev != Some(MigState::Idle) => Some(
            AgentEvent::new(false, "MigApplied", "the MIG layout is applied".to_owned()),
        ),
        // The note names what failed (for a drain timeout, the pods still holding the GPUs),
        // so the action differs with it: a later failure naming other pods is an Event of its
        // own, not a repeat of the first one's note.
        MigState::Failed => {
            let note = now.message.clone().unwrap_or_default();
            let action = format!(
                "MigFailed:{}:{:016x}",
                now.reason.as_deref().unwrap_or("Unknown"),
                note_digest(&note)
            );
            Some(AgentEvent::new(true, "MigFailed", note).with_action(action))
        }
        _ => None,
    }
}

/// A digest of an Event's note (64-bit FNV-1a: the same in every build), for an action that
/// must differ when the note does.
fn note_digest(note: &str) -> u64 {
    note.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The Event for another device plugin appearing, changing sockets, or going away.
fn foreign_plugin_event(previous: Option<&Findings>, now: &Findings) -> Option<AgentEvent> {
    let live_before = previous.map(|p| p.live.as_slice()).unwrap_or_default();
    if now.conflict() && now.live != live_before {
        let (_, _, message) = foreign_plugin::condition(now);
        let sockets: Vec<&str> = now.live.iter().map(|s| s.socket.as_str()).collect();
        return Some(
            AgentEvent::new(true, "ForeignDevicePlugin", message)
                .with_action(format!("ForeignPlugin:{}", sockets.join(","))),
        );
    }
    if !now.conflict() && !live_before.is_empty() {
        return Some(AgentEvent::new(
            false,
            "ForeignDevicePluginGone",
            "no other device plugin serves NVIDIA resources on this node any more".to_owned(),
        ));
    }
    None
}

/// The Events that going from `previous` to `now` calls for, in the order they happened within
/// a pass: MIG, CDI (write, then the file check), validation, PodResources, device health,
/// other device plugins, MPS daemons.
pub fn transitions(previous: &Observed, now: &Observed) -> Vec<AgentEvent> {
    let mut out = Vec::new();
    if let Some(mig) = &now.mig {
        out.extend(mig_events(previous.mig.as_ref(), mig));
    }
    if let Some(msg) = &now.cdi_error
        && previous.cdi_error.as_ref() != Some(msg)
    {
        out.push(AgentEvent::new(true, "CdiSpecFailed", msg.clone()));
    }
    match (&previous.cdi_spec, &now.cdi_spec) {
        (before, Some(Err(problem))) if before.as_ref() != now.cdi_spec.as_ref() => out.push(
            AgentEvent::new(true, problem.kind.event_reason(), problem.message.clone()),
        ),
        (Some(Err(_)), Some(Ok(()))) => out.push(AgentEvent::new(
            false,
            "CdiSpecRestored",
            "the CDI spec is as the agent wrote it again and no other spec claims its devices"
                .to_owned(),
        )),
        _ => {}
    }
    match (passed(&previous.checks), passed(&now.checks)) {
        (prev, Some(false)) => {
            let failed = failures(&now.checks);
            if prev != Some(false) || failed != failures(&previous.checks) {
                let names: Vec<String> = now
                    .checks
                    .iter()
                    .filter(|c| !c.passed)
                    .map(|c| c.name.to_string())
                    .collect();
                out.push(
                    AgentEvent::new(true, "ValidationFailed", failed.join("; "))
                        .with_action(format!("Validate:{}", names.join(","))),
                );
            }
        }
        (prev, Some(true)) if prev != Some(true) => out.push(AgentEvent::new(
            false,
            "ValidationPassed",
            format!("all {} driver checks passed", now.checks.len()),
        )),
        _ => {}
    }
    if let Some(Err(msg)) = &now.pod_resources
        && previous.pod_resources.as_ref().map(Result::is_ok) != Some(false)
    {
        out.push(AgentEvent::new(
            true,
            "PodResourcesUnavailable",
            format!("{msg}; pods holding GPUs are not reported until it is back"),
        ));
    }
    if let Some(gpus) = &now.gpu_health {
        let before = previous.gpu_health.as_ref();
        for (index, gpu) in gpus {
            let was_healthy = before.and_then(|b| b.get(index)).map(|g| g.fault.is_none());
            let action = format!("Health:GPU{index}");
            match (was_healthy, &gpu.fault) {
                (Some(true) | None, Some(reason)) => out.push(
                    AgentEvent::new(
                        true,
                        "DeviceUnhealthy",
                        format!("GPU {index} ({}): {reason}", gpu.uuid),
                    )
                    .with_action(action),
                ),
                (Some(false), None) => out.push(
                    AgentEvent::new(
                        false,
                        "DeviceRecovered",
                        format!("GPU {index} ({}) is healthy again", gpu.uuid),
                    )
                    .with_action(action),
                ),
                _ => {}
            }
        }
    }
    if let Some(found) = &now.foreign_plugin {
        out.extend(foreign_plugin_event(
            previous.foreign_plugin.as_ref(),
            found,
        ));
    }
    for (index, state) in &now.mps {
        let action = format!("MPS:GPU{index}");
        match (previous.mps.get(index), state) {
            // A daemon that fails where it served before, or fails to come up at all.
            (Some(Ok(())), Err(why)) | (Some(Err(_)) | None, Err(why))
                if !why.contains("starting") && previous.mps.get(index) != Some(state) =>
            {
                out.push(
                    AgentEvent::new(
                        true,
                        "MPSDaemonDown",
                        format!(
                            "GPU {index}: {why}; its MPS replicas are Unhealthy until it is back"
                        ),
                    )
                    .with_action(action),
                );
            }
            (Some(Err(before)), Ok(())) if !before.contains("starting") => out.push(
                AgentEvent::new(
                    false,
                    "MPSDaemonRunning",
                    format!("GPU {index}: the MPS control daemon serves again"),
                )
                .with_action(action),
            ),
            _ => {}
        }
    }
    out
}

/// What to remember after reporting `now`: GPUs not seen this time keep what was seen before.
fn remember(previous: Observed, now: Observed) -> Observed {
    let gpu_health = match (previous.gpu_health, now.gpu_health) {
        (Some(mut before), Some(now)) => {
            before.extend(now);
            Some(before)
        }
        (before, now) => now.or(before),
    };
    let foreign_plugin = now.foreign_plugin.or(previous.foreign_plugin);
    Observed {
        gpu_health,
        foreign_plugin,
        ..now
    }
}

/// Publishes the agent's Events on its GpuNode, remembering what it last reported.
pub struct Events {
    recorder: Recorder,
    previous: Observed,
}

impl Events {
    /// Events published through `recorder`.
    pub fn new(recorder: Recorder) -> Events {
        Events {
            recorder,
            previous: Observed::default(),
        }
    }

    /// Publishes the Events going from the last observation to `now`. A failed publish is
    /// logged: Events are best effort, status says the same.
    pub async fn observe(&mut self, gpunode: &GpuNode, now: Observed) {
        for ev in transitions(&self.previous, &now) {
            self.publish(gpunode, ev).await;
        }
        self.previous = remember(std::mem::take(&mut self.previous), now);
    }

    async fn publish(&self, gpunode: &GpuNode, ev: AgentEvent) {
        let event = KubeEvent {
            type_: if ev.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: ev.reason.to_owned(),
            note: Some(ev.note.chars().take(1000).collect()),
            action: ev.action.chars().take(128).collect(),
            secondary: None,
        };
        if let Err(e) = self
            .recorder
            .publish(&event, &gpunode.object_ref(&()))
            .await
        {
            tracing::warn!(error = %e, reason = ev.reason, "publishing an Event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::cdi_spec::ProblemKind;

    fn spec_problem(kind: ProblemKind, message: &str) -> SpecProblem {
        SpecProblem {
            kind,
            message: message.to_owned(),
        }
    }

    /// Findings with these (socket, resource) live, all resources the agent serves too.
    fn foreign(live: &[(&str, &str)]) -> Findings {
        Findings {
            live: live
                .iter()
                .map(|(socket, resource)| crate::plugin::foreign::ForeignSocket {
                    socket: (*socket).to_owned(),
                    resource: resource.parse().unwrap(),
                    also_ours: true,
                })
                .collect(),
            ..Findings::default()
        }
    }

    /// A drain that times out is a Warning naming the pods still holding the GPUs, and a later
    /// one naming another pod is an Event of its own (kube's recorder folds Events of one
    /// reason and action into a series that keeps the first note).
    #[test]
    fn a_drain_timeout_is_a_warning_naming_the_pod_each_time() {
        let o = |state: MigState, message: Option<&str>| Observed {
            mig: Some(NodeMigStatus {
                state,
                reason: message.map(|_| "DrainTimeout".to_owned()),
                message: message.map(str::to_owned),
                gpus: vec![0],
                observed_generation: Some(2),
            }),
            ..Observed::default()
        };
        let first = "still held after 300s: pod team-a/notebook-0 holds GPU 0; MIG layout not \
                     applied, the instances are intact";
        let events = transitions(
            &o(MigState::Draining, None),
            &o(MigState::Failed, Some(first)),
        );
        let [event] = events.as_slice() else {
            panic!("one Event: {:?}", said(&events))
        };
        assert!(event.warning);
        assert_eq!(event.reason, "MigFailed");
        assert!(event.note.contains("team-a/notebook-0"), "{}", event.note);
        assert!(
            event.note.contains("instances are intact"),
            "{}",
            event.note
        );
        assert!(event.action.starts_with("MigFailed:DrainTimeout:"));
        let second = first.replace("team-a/notebook-0", "team-b/server-1");
        let again = transitions(
            &o(MigState::Draining, None),
            &o(MigState::Failed, Some(&second)),
        );
        assert_eq!(again.len(), 1);
        assert!(again[0].note.contains("team-b/server-1"));
        assert_ne!(
            again[0].action, event.action,
            "a failure naming other pods must not fold into the first one's series"
        );
        assert!(again[0].action.len() <= 128, "the Events API's limit");
    }

    #[test]
    fn mps_daemon_transitions() {
        let o = |states: &[(u32, Result<(), &str>)]| Observed {
            mps: states
                .iter()
                .map(|(i, s)| (*i, s.map_err(str::to_owned)))
                .collect(),
            ..Observed::default()
        };
        let starting = Err("MPS control daemon starting");
        let died = Err("MPS control daemon not running: the daemon exited (signal: 9)");
        let cases: Vec<(&str, Observed, Observed, Vec<&str>)> = vec![
            ("starting: no news", o(&[]), o(&[(1, starting)]), vec![]),
            (
                "came up: no news",
                o(&[(1, starting)]),
                o(&[(1, Ok(()))]),
                vec![],
            ),
            (
                "died",
                o(&[(1, Ok(()))]),
                o(&[(1, died)]),
                vec!["Warning MPSDaemonDown [MPS:GPU1]"],
            ),
            (
                "still down: no news",
                o(&[(1, died)]),
                o(&[(1, died)]),
                vec![],
            ),
            (
                "restarting: no news",
                o(&[(1, died)]),
                o(&[(1, starting)]),
                vec![],
            ),
            (
                "back",
                o(&[(1, died)]),
                o(&[(1, Ok(()))]),
                vec!["Normal MPSDaemonRunning [MPS:GPU1]"],
            ),
            (
                "never started",
                o(&[]),
                o(&[(
                    0,
                    Err("MPS control daemon not running: nvidia-cuda-mps-control not found"),
                )]),
                vec!["Warning MPSDaemonDown [MPS:GPU0]"],
            ),
        ];
        for (name, previous, now, want) in cases {
            let got: Vec<String> = said(&transitions(&previous, &now));
            assert_eq!(got.len(), want.len(), "{name}: {got:?}");
            for (g, w) in got.iter().zip(&want) {
                assert!(g.starts_with(w), "{name}: {g}");
            }
        }
    }

    #[test]
    fn foreign_plugin_transitions() {
        let gpu = || Some(foreign(&[("nvidia-gpu.sock", "nvidia.com/gpu")]));
        let both = || {
            Some(foreign(&[
                ("nvidia-gpu.sock", "nvidia.com/gpu"),
                ("nvidia-mig-1g.10gb.sock", "nvidia.com/mig-1g.10gb"),
            ]))
        };
        let none = || Some(Findings::default());
        let o = |foreign_plugin| Observed {
            foreign_plugin,
            ..Observed::default()
        };
        let cases: Vec<(&str, Observed, Observed, Vec<&str>)> = vec![
            (
                "none at the first scan: no news",
                o(None),
                o(none()),
                vec![],
            ),
            (
                "found at the first scan",
                o(None),
                o(gpu()),
                vec!["Warning ForeignDevicePlugin [ForeignPlugin:nvidia-gpu.sock]"],
            ),
            (
                "appears later",
                o(none()),
                o(gpu()),
                vec!["Warning ForeignDevicePlugin [ForeignPlugin:nvidia-gpu.sock]"],
            ),
            ("still there: no news", o(gpu()), o(gpu()), vec![]),
            (
                "serves one more resource",
                o(gpu()),
                o(both()),
                vec![
                    "Warning ForeignDevicePlugin [ForeignPlugin:nvidia-gpu.sock,nvidia-mig-1g.10gb.sock]",
                ],
            ),
            (
                "gone",
                o(gpu()),
                o(none()),
                vec!["Normal ForeignDevicePluginGone [ForeignDevicePluginGone]"],
            ),
            ("scan not run this time: no news", o(gpu()), o(None), vec![]),
        ];
        for (name, previous, now, want) in cases {
            let got: Vec<String> = said(&transitions(&previous, &now));
            assert_eq!(got.len(), want.len(), "{name}: {got:?}");
            for (g, w) in got.iter().zip(&want) {
                assert!(g.starts_with(w), "{name}: {g}");
            }
        }
        let warning = &transitions(&o(none()), &o(gpu()))[0];
        assert!(
            warning.note.contains("nvidia-gpu.sock (nvidia.com/gpu)")
                && warning
                    .note
                    .contains("nvidia.com/gpu.deploy.device-plugin=false"),
            "{}",
            warning.note
        );
    }

    fn check(name: &str, passed: bool, message: &str) -> CheckResult {
        CheckResult {
            name: name.into(),
            passed,
            message: message.to_owned(),
        }
    }

    fn mig(state: MigState, gpus: &[u32], message: Option<&str>) -> Option<NodeMigStatus> {
        Some(NodeMigStatus {
            state,
            gpus: gpus.to_vec(),
            message: message.map(str::to_owned),
            ..NodeMigStatus::default()
        })
    }

    fn health(faults: &[(u32, Option<&str>)]) -> Option<BTreeMap<u32, GpuHealthSeen>> {
        Some(
            faults
                .iter()
                .map(|(i, f)| {
                    (
                        *i,
                        GpuHealthSeen {
                            uuid: format!("GPU-{i}"),
                            fault: f.map(str::to_owned),
                        },
                    )
                })
                .collect(),
        )
    }

    fn said(events: &[AgentEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| {
                format!(
                    "{} {} [{}] {}",
                    if e.warning { "Warning" } else { "Normal" },
                    e.reason,
                    e.action,
                    e.note
                )
            })
            .collect()
    }

    #[test]
    fn transitions_table() {
        let ok = || {
            vec![
                check("DriverVersion", true, "ok"),
                check("CUDAVersion", true, "ok"),
            ]
        };
        let cuda_bad = |m: &str| {
            vec![
                check("DriverVersion", true, "ok"),
                check("CUDAVersion", false, m),
            ]
        };
        let o = Observed::default;
        let cases: Vec<(&str, Observed, Observed, Vec<&str>)> = vec![
            ("nothing observed yet", o(), o(), vec![]),
            (
                "first validation passes",
                o(),
                Observed {
                    checks: ok(),
                    ..o()
                },
                vec!["Normal ValidationPassed [ValidationPassed] all 2 driver checks passed"],
            ),
            (
                "still passing: no news",
                Observed {
                    checks: ok(),
                    ..o()
                },
                Observed {
                    checks: ok(),
                    ..o()
                },
                vec![],
            ),
            (
                "a check fails",
                Observed {
                    checks: ok(),
                    ..o()
                },
                Observed {
                    checks: cuda_bad("too old"),
                    ..o()
                },
                vec!["Warning ValidationFailed [Validate:CUDAVersion] CUDAVersion: too old"],
            ),
            (
                "the same failure again: no news",
                Observed {
                    checks: cuda_bad("too old"),
                    ..o()
                },
                Observed {
                    checks: cuda_bad("too old"),
                    ..o()
                },
                vec![],
            ),
            (
                "a failure that says something new",
                Observed {
                    checks: cuda_bad("too old"),
                    ..o()
                },
                Observed {
                    checks: cuda_bad("older"),
                    ..o()
                },
                vec!["Warning ValidationFailed [Validate:CUDAVersion] CUDAVersion: older"],
            ),
            (
                "fixed",
                Observed {
                    checks: cuda_bad("too old"),
                    ..o()
                },
                Observed {
                    checks: ok(),
                    ..o()
                },
                vec!["Normal ValidationPassed [ValidationPassed] all 2 driver checks passed"],
            ),
            (
                "MIG starts draining",
                Observed {
                    mig: mig(MigState::Idle, &[], None),
                    ..o()
                },
                Observed {
                    mig: mig(MigState::Draining, &[0, 1], None),
                    ..o()
                },
                vec![
                    "Normal MigDraining [MigDraining] waiting for GPU pods to leave GPU 0, 1 before changing MIG",
                ],
            ),
            (
                "MIG drains with other GPUs: the state is the same, no news",
                Observed {
                    mig: mig(MigState::Draining, &[0], None),
                    ..o()
                },
                Observed {
                    mig: mig(MigState::Draining, &[0, 1], None),
                    ..o()
                },
                vec![],
            ),
            (
                "MIG applying",
                Observed {
                    mig: mig(MigState::Draining, &[0], None),
                    ..o()
                },
                Observed {
                    mig: mig(MigState::Applying, &[0], None),
                    ..o()
                },
                vec!["Normal MigApplying [MigApplying] changing MIG on GPU 0"],
            ),
            (
                "MIG applied after applying",
                Observed {
                    mig: mig(MigState::Applying, &[0], None),
                    ..o()
                },
                Observed {
                    mig: mig(MigState::Applied, &[], None),
                    ..o()
                },
                vec!["Normal MigApplied [MigApplied] the MIG layout is applied"],
            ),
            (
                "MIG found applied at start: no news",
                o(),
                Observed {
                    mig: mig(MigState::Applied, &[], None),
                    ..o()
                },
                vec![],
            ),
            (
                "MIG applied from idle (nothing to change): no news",
                Observed {
                    mig: mig(MigState::Idle, &[], None),
                    ..o()
                },
                Observed {
                    mig: mig(MigState::Applied, &[], None),
                    ..o()
                },
                vec![],
            ),
            (
                "MIG fails",
                Observed {
                    mig: mig(MigState::Draining, &[0], None),
                    ..o()
                },
                Observed {
                    mig: mig(MigState::Failed, &[0], Some("drain timed out")),
                    ..o()
                },
                vec!["Warning MigFailed [MigFailed:Unknown:0fb440058f5218aa] drain timed out"],
            ),
            (
                "CDI spec fails",
                o(),
                Observed {
                    cdi_error: Some("no driver".into()),
                    ..o()
                },
                vec!["Warning CdiSpecFailed [CdiSpecFailed] no driver"],
            ),
            (
                "CDI spec fails the same way: no news",
                Observed {
                    cdi_error: Some("no driver".into()),
                    ..o()
                },
                Observed {
                    cdi_error: Some("no driver".into()),
                    ..o()
                },
                vec![],
            ),
            (
                "CDI spec deleted: one Warning",
                Observed {
                    cdi_spec: Some(Ok(())),
                    ..o()
                },
                Observed {
                    cdi_spec: Some(Err(spec_problem(ProblemKind::Missing, "gone"))),
                    ..o()
                },
                vec!["Warning CdiSpecMissing [CdiSpecMissing] gone"],
            ),
            (
                "CDI spec still in conflict, same words: no news",
                Observed {
                    cdi_spec: Some(Err(spec_problem(ProblemKind::Conflict, "x.yaml"))),
                    ..o()
                },
                Observed {
                    cdi_spec: Some(Err(spec_problem(ProblemKind::Conflict, "x.yaml"))),
                    ..o()
                },
                vec![],
            ),
            (
                "CDI spec problem changes: a Warning for the new one",
                Observed {
                    cdi_spec: Some(Err(spec_problem(ProblemKind::Missing, "gone"))),
                    ..o()
                },
                Observed {
                    cdi_spec: Some(Err(spec_problem(ProblemKind::Modified, "edited"))),
                    ..o()
                },
                vec!["Warning CdiSpecModified [CdiSpecModified] edited"],
            ),
            (
                "CDI spec healthy again: Normal",
                Observed {
                    cdi_spec: Some(Err(spec_problem(ProblemKind::Invalid, "not YAML"))),
                    ..o()
                },
                Observed {
                    cdi_spec: Some(Ok(())),
                    ..o()
                },
                vec![
                    "Normal CdiSpecRestored [CdiSpecRestored] the CDI spec is as the agent wrote it again and no other spec claims its devices",
                ],
            ),
            (
                "CDI spec fine from the first write: no news",
                o(),
                Observed {
                    cdi_spec: Some(Ok(())),
                    ..o()
                },
                vec![],
            ),
            (
                "PodResources unavailable at start",
                o(),
                Observed {
                    pod_resources: Some(Err("socket missing".into())),
                    ..o()
                },
                vec![
                    "Warning PodResourcesUnavailable [PodResourcesUnavailable] socket missing; pods holding GPUs are not reported until it is back",
                ],
            ),
            (
                "PodResources still unavailable, other words: no news",
                Observed {
                    pod_resources: Some(Err("a".into())),
                    ..o()
                },
                Observed {
                    pod_resources: Some(Err("b".into())),
                    ..o()
                },
                vec![],
            ),
            (
                "PodResources back: no Event (status says it)",
                Observed {
                    pod_resources: Some(Err("a".into())),
                    ..o()
                },
                Observed {
                    pod_resources: Some(Ok(())),
                    ..o()
                },
                vec![],
            ),
            (
                "a GPU unhealthy at start",
                o(),
                Observed {
                    gpu_health: health(&[(0, None), (1, Some("Xid 79"))]),
                    ..o()
                },
                vec!["Warning DeviceUnhealthy [Health:GPU1] GPU 1 (GPU-1): Xid 79"],
            ),
            (
                "a GPU recovers",
                Observed {
                    gpu_health: health(&[(1, Some("Xid 79"))]),
                    ..o()
                },
                Observed {
                    gpu_health: health(&[(1, None)]),
                    ..o()
                },
                vec!["Normal DeviceRecovered [Health:GPU1] GPU 1 (GPU-1) is healthy again"],
            ),
            (
                "still unhealthy, other reason: no news",
                Observed {
                    gpu_health: health(&[(1, Some("Xid 79"))]),
                    ..o()
                },
                Observed {
                    gpu_health: health(&[(1, Some("ECC"))]),
                    ..o()
                },
                vec![],
            ),
            (
                "inventory unreadable: nothing said about GPUs",
                Observed {
                    gpu_health: health(&[(1, None)]),
                    ..o()
                },
                Observed {
                    gpu_health: None,
                    ..o()
                },
                vec![],
            ),
        ];
        for (name, previous, now, want) in cases {
            assert_eq!(said(&transitions(&previous, &now)), want, "{name}");
        }
    }

    #[test]
    fn several_transitions_come_in_pass_order() {
        let now = Observed {
            checks: vec![check("XidErrors", false, "GPU 0: Xid 79")],
            mig: mig(MigState::Failed, &[0], Some("m")),
            gpu_health: health(&[(0, Some("lost"))]),
            pod_resources: Some(Err("p".into())),
            cdi_error: Some("c".into()),
            cdi_spec: Some(Err(spec_problem(ProblemKind::Missing, "s"))),
            foreign_plugin: Some(foreign(&[("nvidia-gpu.sock", "nvidia.com/gpu")])),
            mps: BTreeMap::from([(1, Err("MPS control daemon not running: gone".into()))]),
        };
        let reasons: Vec<&str> = transitions(&Observed::default(), &now)
            .iter()
            .map(|e| e.reason)
            .collect();
        assert_eq!(
            reasons,
            [
                "MigFailed",
                "CdiSpecFailed",
                "CdiSpecMissing",
                "ValidationFailed",
                "PodResourcesUnavailable",
                "DeviceUnhealthy",
                "ForeignDevicePlugin",
                "MPSDaemonDown"
            ]
        );
    }

    #[test]
    fn gpus_unseen_this_time_keep_what_was_seen() {
        let first = Observed {
            gpu_health: health(&[(0, Some("lost")), (1, None)]),
            ..Observed::default()
        };
        let blind = Observed::default();
        let kept = remember(first.clone(), blind);
        assert_eq!(kept.gpu_health, first.gpu_health);
        // GPU 0 is back in a later pass: that is a recovery, not a first sighting.
        let later = Observed {
            gpu_health: health(&[(0, None)]),
            ..Observed::default()
        };
        assert_eq!(
            said(&transitions(&kept, &later)),
            ["Normal DeviceRecovered [Health:GPU0] GPU 0 (GPU-0) is healthy again"]
        );
        let merged = remember(kept, later);
        assert_eq!(merged.gpu_health.map(|m| m.len()), Some(2));
    }

    /// Another plugin found by a real scan of a temp dir reaches the API as one Warning Event
    /// on the GpuNode, and its going away as one Normal Event.
    #[tokio::test]
    async fn a_foreign_plugin_is_posted_as_an_event_on_the_gpunode() {
        use crate::agent::testing::{ApiMock, Expect};
        use kube::runtime::events::Reporter;
        use std::collections::BTreeSet;
        use std::time::Duration;
        let tmp = tempfile::tempdir().unwrap();
        let listener =
            std::os::unix::net::UnixListener::bind(tmp.path().join("nvidia-gpu.sock")).unwrap();
        let served: BTreeSet<crate::plugin::ResourceName> =
            ["nvidia.com/gpu".parse().unwrap()].into();
        let scan =
            || crate::plugin::foreign::scan(tmp.path(), &served, "gpupool", Duration::from_secs(2));
        let event = |type_: &'static str, reason: &'static str, says: &'static str| Expect {
            method: "POST",
            path: "/apis/events.k8s.io/v1/namespaces/default/events",
            query: &[],
            status: 201,
            check: Box::new(move |body: &serde_json::Value| {
                assert_eq!(body["type"], type_, "{body}");
                assert_eq!(body["reason"], reason, "{body}");
                assert!(body["note"].as_str().unwrap().contains(says), "{body}");
                assert_eq!(body["regarding"]["kind"], "GpuNode", "{body}");
                assert_eq!(body["regarding"]["name"], "node-a", "{body}");
            }),
            reply: None,
        };
        let (client, mock) = ApiMock::new();
        let server = mock.serve(vec![
            event(
                "Warning",
                "ForeignDevicePlugin",
                "live on nvidia-gpu.sock (nvidia.com/gpu)",
            ),
            event("Normal", "ForeignDevicePluginGone", "any more"),
        ]);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: "gpupool-agent".into(),
                instance: Some("node-a".into()),
            },
        );
        let mut events = Events::new(recorder);
        let gn = crate::agent::testing::gpunode("node-a");
        let observe = |found| Observed {
            foreign_plugin: Some(found),
            ..Observed::default()
        };
        events.observe(&gn, observe(scan().await.unwrap())).await;
        events.observe(&gn, observe(scan().await.unwrap())).await; // no news: no request
        drop(listener); // NVIDIA's plugin stops; its socket file stays behind
        events.observe(&gn, observe(scan().await.unwrap())).await;
        drop(events);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_transition_is_posted_once_as_an_event_on_the_gpunode() {
        use crate::agent::testing::{ApiMock, Expect};
        use kube::runtime::events::Reporter;
        let (client, mock) = ApiMock::new();
        let server = mock.serve(vec![Expect {
            method: "POST",
            path: "/apis/events.k8s.io/v1/namespaces/default/events",
            query: &[],
            status: 201,
            check: Box::new(|body: &serde_json::Value| {
                assert_eq!(body["type"], "Warning", "{body}");
                assert_eq!(body["reason"], "ValidationFailed", "{body}");
                assert_eq!(body["action"], "Validate:CUDAVersion", "{body}");
                assert_eq!(body["note"], "CUDAVersion: too old", "{body}");
                assert_eq!(body["regarding"]["kind"], "GpuNode", "{body}");
                assert_eq!(body["regarding"]["name"], "node-a", "{body}");
                assert_eq!(body["reportingController"], "gpupool-agent", "{body}");
            }),
            reply: None,
        }]);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: "gpupool-agent".into(),
                instance: Some("node-a".into()),
            },
        );
        let mut events = Events::new(recorder);
        let gn = crate::agent::testing::gpunode("node-a");
        let failing = Observed {
            checks: vec![check("CUDAVersion", false, "too old")],
            ..Observed::default()
        };
        events.observe(&gn, failing.clone()).await;
        events.observe(&gn, failing).await; // no news: no request
        drop(events);
        server.await.unwrap();
    }
}
