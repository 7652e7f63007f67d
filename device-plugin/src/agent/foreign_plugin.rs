//! Another device plugin for NVIDIA resources on this node, as a job of the agent: the device
//! plugin directory is scanned ([`crate::plugin::foreign`]) every [`SCAN_INTERVAL`] and whenever
//! the set of resources the agent serves changes. What it finds becomes the
//! `ForeignDevicePlugin` condition ([`condition`], pure), an Event when such a plugin appears or
//! goes, and a gauge in `/metrics`.
//!
//! The agent does not fight back (re-registering in a loop would only make the kubelet switch
//! between the two more often) nor stop serving: it keeps serving what is healthy and says what
//! the admin has to turn off.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use crate::plugin::ResourceName;
use crate::plugin::foreign::{self, Findings};

/// How often the directory is scanned.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Longest wait for one socket to accept a connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What to do about another plugin, for the condition and the Event.
const REMEDY: &str = "The agent keeps serving. Turn NVIDIA's device plugin off on this node: \
     with the GPU Operator, label the node nvidia.com/gpu.deploy.device-plugin=false (and \
     nvidia.com/gpu.deploy.mig-manager=false if gpupool manages MIG), or set \
     devicePlugin.enabled=false in its Helm values for every node; a standalone \
     nvidia-device-plugin DaemonSet must not select this node";

/// The scan's state: where, when next, and what it last found.
pub struct ForeignPluginJob {
    dir: PathBuf,
    prefix: String,
    next: Instant,
    /// The resources served at the last scan (a change makes a scan due).
    scanned_for: Option<BTreeSet<ResourceName>>,
    last: Option<Findings>,
}

impl ForeignPluginJob {
    /// A job scanning `dir`, where our sockets are named `<prefix>-…`; the first scan is due
    /// at `now`.
    pub fn new(dir: PathBuf, prefix: String, now: Instant) -> ForeignPluginJob {
        ForeignPluginJob {
            dir,
            prefix,
            next: now,
            scanned_for: None,
            last: None,
        }
    }

    /// When the next scan is due.
    pub fn next(&self) -> Instant {
        self.next
    }

    /// What the last successful scan found; `None` before the first.
    pub fn findings(&self) -> Option<&Findings> {
        self.last.as_ref()
    }

    /// Scans if due at `now` or if `served` changed since the last scan. A failed scan is
    /// logged and keeps what the last one found: the condition does not claim what nobody saw.
    pub async fn run_if_due(&mut self, served: BTreeSet<ResourceName>, now: Instant) {
        if now < self.next && self.scanned_for.as_ref() == Some(&served) {
            return;
        }
        self.next = now + SCAN_INTERVAL;
        match foreign::scan(&self.dir, &served, &self.prefix, PROBE_TIMEOUT).await {
            Ok(found) => {
                if self.last.as_ref() != Some(&found) && found.conflict() {
                    let (_, reason, message) = condition(&found);
                    tracing::warn!(reason, %message, "another device plugin serves NVIDIA resources");
                }
                self.last = Some(found);
            }
            Err(e) => tracing::warn!(error = %e, "scanning for other device plugins"),
        }
        self.scanned_for = Some(served);
    }
}

fn list(items: impl IntoIterator<Item = String>) -> String {
    items.into_iter().collect::<Vec<_>>().join(", ")
}

/// The `ForeignDevicePlugin` condition for `findings`: (status, reason, message).
pub fn condition(findings: &Findings) -> (bool, &'static str, String) {
    if findings.conflict() {
        let sockets = list(findings.live.iter().map(|s| {
            if s.also_ours {
                format!("{} ({})", s.socket, s.resource)
            } else {
                format!("{} ({}, not served by gpupool)", s.socket, s.resource)
            }
        }));
        let (reason, effect) = if findings.same_resource() {
            (
                "SameResource",
                "the kubelet keeps only the plugin that registered a resource last, so the two \
                 take it from each other at every restart while handing out the same GPUs",
            )
        } else {
            (
                "OtherResource",
                "the same GPUs can be handed out twice, once under each resource name",
            )
        };
        let message = format!(
            "another device plugin (NVIDIA's, by its socket names) is live on {sockets}: \
             {effect}. {REMEDY}"
        );
        return (true, reason, message);
    }
    let mut message = "no other device plugin serves NVIDIA resources on this node".to_owned();
    if !findings.stale.is_empty() {
        message.push_str(&format!(
            "; {} left behind by a plugin that stopped: nothing listens, so no conflict (safe \
             to delete)",
            list(findings.stale.iter().cloned())
        ));
    }
    if !findings.unprobed.is_empty() {
        message.push_str(&format!(
            "; could not connect to {}",
            list(
                findings
                    .unprobed
                    .iter()
                    .map(|(name, why)| format!("{name} ({why})"))
            )
        ));
    }
    (false, "NoneFound", message)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;
    use crate::plugin::foreign::ForeignSocket;

    fn live(socket: &str, resource: &str, also_ours: bool) -> ForeignSocket {
        ForeignSocket {
            socket: socket.into(),
            resource: resource.parse().unwrap(),
            also_ours,
        }
    }

    #[test]
    fn condition_table() {
        let cases = [
            (
                Findings::default(),
                false,
                "NoneFound",
                "no other device plugin",
            ),
            (
                Findings {
                    stale: vec!["nvidia-gpu.sock".into()],
                    ..Findings::default()
                },
                false,
                "NoneFound",
                "nvidia-gpu.sock left behind by a plugin that stopped: nothing listens, so no \
                 conflict",
            ),
            (
                Findings {
                    live: vec![live("nvidia-gpu.sock", "nvidia.com/gpu", true)],
                    ..Findings::default()
                },
                true,
                "SameResource",
                "live on nvidia-gpu.sock (nvidia.com/gpu): the kubelet keeps only",
            ),
            (
                Findings {
                    live: vec![live("nvidia-gpu.sock", "nvidia.com/gpu", false)],
                    ..Findings::default()
                },
                true,
                "OtherResource",
                "nvidia-gpu.sock (nvidia.com/gpu, not served by gpupool): the same GPUs",
            ),
        ];
        for (findings, status, reason, says) in cases {
            let (s, r, m) = condition(&findings);
            assert_eq!((s, r), (status, reason), "{m}");
            assert!(m.contains(says), "{m}");
            if status {
                assert!(
                    m.contains("nvidia.com/gpu.deploy.device-plugin=false"),
                    "says what to do: {m}"
                );
            }
        }
    }

    /// Scans on its interval, and at once when the served resources change.
    #[tokio::test]
    async fn scans_when_due_or_when_the_resources_change() {
        let tmp = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let mut job = ForeignPluginJob::new(tmp.path().to_path_buf(), "gpupool".into(), start);
        let gpu: BTreeSet<ResourceName> = ["nvidia.com/gpu".parse().unwrap()].into();
        job.run_if_due(gpu.clone(), start).await;
        assert_eq!(job.findings(), Some(&Findings::default()));
        assert_eq!(job.next(), start + SCAN_INTERVAL);

        let _nvidia = UnixListener::bind(tmp.path().join("nvidia-gpu.sock")).unwrap();
        job.run_if_due(gpu.clone(), start + Duration::from_secs(1))
            .await;
        assert!(!job.findings().unwrap().conflict(), "not due yet");
        job.run_if_due(BTreeSet::new(), start + Duration::from_secs(2))
            .await;
        let found = job.findings().unwrap();
        assert_eq!(
            found.live,
            [live("nvidia-gpu.sock", "nvidia.com/gpu", false)]
        );
        job.run_if_due(gpu, start + Duration::from_secs(2) + SCAN_INTERVAL)
            .await;
        assert!(job.findings().unwrap().same_resource());
    }
}
