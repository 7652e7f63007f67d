//! Another device plugin on the node for the resources we serve.
//!
//! The kubelet keeps one endpoint per resource name: the plugin that registered last. When
//! NVIDIA's k8s-device-plugin runs beside the agent, both register `nvidia.com/gpu` (or the
//! `nvidia.com/mig-*` resources) and each takes the resource from the other whenever it
//! registers again (a kubelet restart, a plugin restart), while both hand out the same GPUs.
//!
//! The evidence used is the socket: NVIDIA's plugin serves `nvidia.com/<name>` on
//! `<device-plugins dir>/nvidia-<name>.sock` (`internal/plugin/server.go`: `"nvidia-" + name +
//! ".sock"`, the name being the part of the resource after the `/`), and keeps it open for as
//! long as it runs. A socket file that refuses connections is a leftover of a plugin that
//! stopped without removing it: no conflict. The kubelet's own `kubelet_internal_checkpoint` is
//! not used: it maps resources to device IDs without saying which plugin registered them, and
//! NVIDIA's plugin uses the same GPU and MIG UUIDs as ours, so it cannot tell the two apart.
//!
//! [`assess`] decides from what was found (pure); [`scan`] reads the directory and probes the
//! sockets.

use std::collections::BTreeSet;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::model::ResourceName;

/// The domain of the resources NVIDIA's plugin serves.
pub const NVIDIA_DOMAIN: &str = "nvidia.com";

/// The socket file name prefix NVIDIA's plugin uses.
const NVIDIA_SOCKET_PREFIX: &str = "nvidia-";

/// Errors reading the device plugin directory.
#[derive(Debug, thiserror::Error)]
pub enum ForeignScanError {
    /// The directory could not be listed.
    #[error("listing device plugin directory {dir}: {source}")]
    ReadDir {
        /// The directory.
        dir: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The socket file NVIDIA's plugin would serve `resource` on, for an `nvidia.com` resource.
pub fn nvidia_socket_name(resource: &ResourceName) -> Option<String> {
    let (domain, name) = resource.as_str().split_once('/')?;
    (domain == NVIDIA_DOMAIN).then(|| format!("{NVIDIA_SOCKET_PREFIX}{name}.sock"))
}

/// The resource NVIDIA's plugin serves on socket file `file_name`, if it is named like one of
/// its sockets.
pub fn nvidia_resource_of(file_name: &str) -> Option<ResourceName> {
    let name = file_name
        .strip_prefix(NVIDIA_SOCKET_PREFIX)?
        .strip_suffix(".sock")?;
    format!("{NVIDIA_DOMAIN}/{name}").parse().ok()
}

/// What connecting to a socket file found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Something listens on it.
    Live,
    /// Nothing does (connection refused): a leftover file.
    Stale,
    /// The connection failed otherwise (permissions, ...): why.
    Failed(String),
}

/// A socket file in the device plugin directory and what probing it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketSeen {
    /// The file name.
    pub name: String,
    /// What connecting to it found.
    pub probe: Probe,
}

/// Another plugin's live socket for an NVIDIA resource.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ForeignSocket {
    /// The socket file name, e.g. `nvidia-gpu.sock`.
    pub socket: String,
    /// The resource it serves by NVIDIA's naming, e.g. `nvidia.com/gpu`.
    pub resource: ResourceName,
    /// Whether the agent serves that resource too (the kubelet keeps only one of the two);
    /// otherwise the same GPUs are handed out under two names.
    pub also_ours: bool,
}

/// What the scan of the device plugin directory found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    /// Other plugins' live sockets for NVIDIA resources.
    pub live: Vec<ForeignSocket>,
    /// NVIDIA-named socket files nobody listens on (not a conflict).
    pub stale: Vec<String>,
    /// NVIDIA-named socket files that could not be probed, and why.
    pub unprobed: Vec<(String, String)>,
}

impl Findings {
    /// Whether another plugin is live for NVIDIA resources.
    pub fn conflict(&self) -> bool {
        !self.live.is_empty()
    }

    /// Whether another plugin is live for a resource the agent serves too.
    pub fn same_resource(&self) -> bool {
        self.live.iter().any(|s| s.also_ours)
    }
}

/// The NVIDIA-named sockets in `seen` that are not ours (`<our_prefix>-…`, or the socket of one
/// of `served` under our prefix), classified: live ones are conflicts, for a resource in
/// `served` or not.
pub fn assess(seen: &[SocketSeen], served: &BTreeSet<ResourceName>, our_prefix: &str) -> Findings {
    let ours: BTreeSet<String> = served
        .iter()
        .map(|r| r.socket_file_name(our_prefix))
        .collect();
    let mut findings = Findings::default();
    for s in seen {
        if ours.contains(&s.name) || s.name.starts_with(&format!("{our_prefix}-")) {
            continue;
        }
        let Some(resource) = nvidia_resource_of(&s.name) else {
            continue;
        };
        match &s.probe {
            Probe::Live => findings.live.push(ForeignSocket {
                socket: s.name.clone(),
                also_ours: served.contains(&resource),
                resource,
            }),
            Probe::Stale => findings.stale.push(s.name.clone()),
            Probe::Failed(why) => findings.unprobed.push((s.name.clone(), why.clone())),
        }
    }
    findings.live.sort();
    findings.stale.sort();
    findings.unprobed.sort();
    findings
}

/// Connects to the socket at `path`, waiting at most `timeout` (a listener whose backlog is
/// full does not answer at once, but is there).
pub async fn probe(path: &Path, timeout: Duration) -> Probe {
    match tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path)).await {
        Ok(Ok(_)) | Err(_) => Probe::Live,
        Ok(Err(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            Probe::Stale
        }
        Ok(Err(e)) => Probe::Failed(e.to_string()),
    }
}

/// Lists the NVIDIA-named unix sockets in `dir`, probes each and [`assess`]es them.
pub async fn scan(
    dir: &Path,
    served: &BTreeSet<ResourceName>,
    our_prefix: &str,
    timeout: Duration,
) -> Result<Findings, ForeignScanError> {
    let read_err = |source| ForeignScanError::ReadDir {
        dir: dir.to_path_buf(),
        source,
    };
    let mut entries = tokio::fs::read_dir(dir).await.map_err(read_err)?;
    let mut seen = Vec::new();
    while let Some(entry) = entries.next_entry().await.map_err(read_err)? {
        let name = entry.file_name().to_string_lossy().into_owned();
        if nvidia_resource_of(&name).is_none() {
            continue;
        }
        // A file that vanished or is not a socket is nothing to probe.
        let is_socket = entry.file_type().await.is_ok_and(|t| t.is_socket());
        if !is_socket {
            continue;
        }
        let probe = probe(&entry.path(), timeout).await;
        seen.push(SocketSeen { name, probe });
    }
    Ok(assess(&seen, served, our_prefix))
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    fn resources(names: &[&str]) -> BTreeSet<ResourceName> {
        names.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn nvidia_names_round_trip() {
        for (resource, socket) in [
            ("nvidia.com/gpu", Some("nvidia-gpu.sock")),
            ("nvidia.com/mig-1g.10gb", Some("nvidia-mig-1g.10gb.sock")),
            ("nvidia.com/gpu.shared", Some("nvidia-gpu.shared.sock")),
            ("example.com/gpu", None),
        ] {
            let r: ResourceName = resource.parse().unwrap();
            assert_eq!(nvidia_socket_name(&r).as_deref(), socket, "{resource}");
            if let Some(socket) = socket {
                assert_eq!(nvidia_resource_of(socket), Some(r), "{socket}");
            }
        }
        for not_nvidia in [
            "kubelet.sock",
            "gpupool-nvidia.com-gpu.sock",
            "nvidia-gpu",
            "nvidia-.sock",
            "sriov-net.sock",
        ] {
            assert_eq!(nvidia_resource_of(not_nvidia), None, "{not_nvidia}");
        }
    }

    #[test]
    fn assess_table() {
        let seen = |name: &str, probe: Probe| SocketSeen {
            name: name.to_owned(),
            probe,
        };
        let served = resources(&["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]);
        // name, sockets found, (live socket, also ours) pairs, stale names
        type Case<'a> = (&'a str, Vec<SocketSeen>, Vec<(&'a str, bool)>, Vec<&'a str>);
        let cases: Vec<Case<'_>> = vec![
            ("nothing", vec![], vec![], vec![]),
            (
                "our own sockets and the kubelet's",
                vec![
                    seen("kubelet.sock", Probe::Live),
                    seen("gpupool-nvidia.com-gpu.sock", Probe::Live),
                    seen("gpupool-nvidia.com-mig-1g.10gb.sock", Probe::Live),
                ],
                vec![],
                vec![],
            ),
            (
                "NVIDIA's plugin live for nvidia.com/gpu",
                vec![seen("nvidia-gpu.sock", Probe::Live)],
                vec![("nvidia-gpu.sock", true)],
                vec![],
            ),
            (
                "a leftover socket file is no conflict",
                vec![seen("nvidia-gpu.sock", Probe::Stale)],
                vec![],
                vec!["nvidia-gpu.sock"],
            ),
            (
                "live for a resource we do not serve: the same GPUs under another name",
                vec![
                    seen("nvidia-mig-1g.10gb.sock", Probe::Live),
                    seen("nvidia-mig-3g.40gb.sock", Probe::Live),
                ],
                vec![
                    ("nvidia-mig-1g.10gb.sock", true),
                    ("nvidia-mig-3g.40gb.sock", false),
                ],
                vec![],
            ),
            (
                "other vendors' plugins are not ours to judge",
                vec![
                    seen("sriov-net.sock", Probe::Live),
                    seen("amd.com-gpu.sock", Probe::Live),
                ],
                vec![],
                vec![],
            ),
        ];
        for (name, seen, live, stale) in cases {
            let got = assess(&seen, &served, "gpupool");
            let got_live: Vec<(&str, bool)> = got
                .live
                .iter()
                .map(|s| (s.socket.as_str(), s.also_ours))
                .collect();
            assert_eq!(got_live, live, "{name}");
            assert_eq!(got.stale, stale, "{name}");
            assert_eq!(got.conflict(), !live.is_empty(), "{name}");
        }
    }

    /// Real sockets in a temp dir: a listening one named like NVIDIA's is a conflict, a socket
    /// file nobody listens on is not, and neither are ours or the kubelet's.
    #[tokio::test]
    async fn scan_probes_real_sockets() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let _kubelet = UnixListener::bind(dir.join("kubelet.sock")).unwrap();
        let _ours = UnixListener::bind(dir.join("gpupool-nvidia.com-gpu.sock")).unwrap();
        let _nvidia = UnixListener::bind(dir.join("nvidia-gpu.sock")).unwrap();
        // Bound then closed: the file stays, connections are refused.
        drop(UnixListener::bind(dir.join("nvidia-mig-1g.10gb.sock")).unwrap());
        // Named like a socket, but a plain file.
        std::fs::write(dir.join("nvidia-mig-2g.20gb.sock"), b"").unwrap();
        let served = resources(&["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]);

        let found = scan(dir, &served, "gpupool", Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(
            found.live,
            [ForeignSocket {
                socket: "nvidia-gpu.sock".into(),
                resource: "nvidia.com/gpu".parse().unwrap(),
                also_ours: true,
            }]
        );
        assert_eq!(found.stale, ["nvidia-mig-1g.10gb.sock"]);
        assert!(found.unprobed.is_empty(), "{:?}", found.unprobed);
        assert!(found.same_resource());

        // NVIDIA's plugin stops but leaves its socket file behind: no conflict any more.
        drop(_nvidia);
        let found = scan(dir, &served, "gpupool", Duration::from_secs(2))
            .await
            .unwrap();
        assert!(!found.conflict(), "{found:?}");
        assert_eq!(found.stale, ["nvidia-gpu.sock", "nvidia-mig-1g.10gb.sock"]);
    }

    #[tokio::test]
    async fn a_missing_directory_is_an_error_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("device-plugins");
        let err = scan(&dir, &BTreeSet::new(), "gpupool", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("device-plugins"), "{err}");
    }
}
