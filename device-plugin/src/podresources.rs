//! The kubelet's PodResources API: which pods hold which GPU and MIG devices.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpupool_crds::node::PodRef;

use crate::plugin::api::podresources_v1::ListPodResourcesRequest;
use crate::plugin::api::podresources_v1::pod_resources_lister_client::PodResourcesListerClient;

/// Why the PodResources API could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// No socket (kubelet not running, or the feature gate off).
    #[error("PodResources socket {0} not found")]
    Missing(String),
    /// Connecting or calling failed.
    #[error("PodResources List on {path}: {detail}")]
    Call {
        /// The socket.
        path: String,
        /// What went wrong.
        detail: String,
    },
}

/// Where the agent learns which pods hold the node's devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodSource {
    /// The kubelet's PodResources socket: every real node. A missing or failing socket is
    /// reported and counts as "pods unknown", which holds every MIG and sharing change.
    Kubelet(PathBuf),
    /// The host runs no kubelet (the demo's and the tests' simulated nodes, `--no-kubelet`):
    /// no pod can hold a device there, so the answer is "none". Never right on a real node.
    NoKubelet,
}

impl PodSource {
    /// Device ID → pods holding it ([`list_pod_devices`] on the kubelet's socket).
    pub async fn list(
        &self,
        timeout: Duration,
    ) -> Result<BTreeMap<String, Vec<PodRef>>, PodResourcesError> {
        match self {
            PodSource::Kubelet(socket) => list_pod_devices(socket, timeout).await,
            PodSource::NoKubelet => Ok(BTreeMap::new()),
        }
    }
}

/// Device ID (UUID) → pods holding it, for `nvidia.com/*` resources, from the kubelet's
/// PodResources `List`; each shared replica's ID (`<UUID>::<n>`) → the pod holding it, too.
pub async fn list_pod_devices(
    socket: &Path,
    timeout: Duration,
) -> Result<BTreeMap<String, Vec<PodRef>>, PodResourcesError> {
    let path = socket.display().to_string();
    if !socket.exists() {
        return Err(PodResourcesError::Missing(path));
    }
    let channel = crate::plugin::connect_unix(socket, timeout)
        .await
        .map_err(|e| PodResourcesError::Call {
            path: path.clone(),
            detail: e.to_string(),
        })?;
    let mut client = PodResourcesListerClient::new(channel);
    let response = tokio::time::timeout(timeout, client.list(ListPodResourcesRequest {}))
        .await
        .map_err(|_| PodResourcesError::Call {
            path: path.clone(),
            detail: "timed out".into(),
        })?
        .map_err(|e| PodResourcesError::Call {
            path: path.clone(),
            detail: e.to_string(),
        })?
        .into_inner();
    let mut out: BTreeMap<String, Vec<PodRef>> = BTreeMap::new();
    for pod in response.pod_resources {
        for container in pod.containers {
            for devices in container.devices {
                if !devices.resource_name.starts_with("nvidia.com/") {
                    continue;
                }
                for id in devices.device_ids {
                    // A shared replica (`<device>::<n>`) is held on its device: the pods
                    // sharing a GPU are all that GPU's holders. The replica is kept too, held
                    // by its one pod, for per-share idleness.
                    let device = match id.split_once(crate::plugin::sharing::REPLICA_SEPARATOR) {
                        Some((device, _)) => {
                            out.entry(id.clone()).or_default().push(PodRef {
                                namespace: pod.namespace.as_str().into(),
                                name: pod.name.clone(),
                                container: Some(container.name.clone()),
                            });
                            device.to_owned()
                        }
                        None => id,
                    };
                    let holders = out.entry(device).or_default();
                    let r = PodRef {
                        namespace: pod.namespace.as_str().into(),
                        name: pod.name.clone(),
                        container: Some(container.name.clone()),
                    };
                    if !holders.contains(&r) {
                        holders.push(r);
                    }
                }
            }
        }
    }
    for holders in out.values_mut() {
        holders.sort();
    }
    Ok(out)
}
