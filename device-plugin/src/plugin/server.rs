//! One resource's `DevicePlugin` gRPC server on a unix socket, and the unix
//! socket client used to self-dial and to register with the kubelet.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

use super::PluginError;
use super::allocate::{self, AllocateOptions, ResourceView};
use super::api::VERSION;
use super::api::v1beta1::device_plugin_client::DevicePluginClient;
use super::api::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use super::api::v1beta1::registration_client::RegistrationClient;
use super::api::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};
use super::metrics::PluginMetrics;

/// The options this plugin reports: preferred allocation on, no PreStartContainer.
pub fn plugin_options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// The `DevicePlugin` service for one resource.
pub(crate) struct DevicePluginService {
    pub view: watch::Receiver<Arc<ResourceView>>,
    /// Highest generation handed to a `ListAndWatch` stream.
    pub sent: Arc<watch::Sender<u64>>,
    pub options: Arc<AllocateOptions>,
    pub metrics: Arc<PluginMetrics>,
    /// Ends every `ListAndWatch` stream so the server can shut down.
    pub stop: CancellationToken,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.view.clone();
        // The first poll sends the current list at once.
        rx.mark_changed();
        let state = (
            rx,
            self.stop.clone(),
            self.sent.clone(),
            self.metrics.clone(),
        );
        let stream = futures::stream::unfold(state, |(mut rx, stop, sent, metrics)| async move {
            tokio::select! {
                biased;
                () = stop.cancelled() => return None,
                changed = rx.changed() => changed.ok()?,
            }
            let view = rx.borrow_and_update().clone();
            sent.send_if_modified(|g| {
                let newer = view.generation > *g;
                if newer {
                    *g = view.generation;
                }
                newer
            });
            PluginMetrics::inc(&metrics.list_and_watch_sends);
            tracing::debug!(resource = %view.resource, generation = view.generation, devices = view.devices.len(), "ListAndWatch send");
            Some((Ok(view.list.clone()), (rx, stop, sent, metrics)))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let view = self.view.borrow().clone();
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|req| ContainerPreferredAllocationResponse {
                device_i_ds: allocate::preferred_allocation(
                    &view,
                    &req.available_device_i_ds,
                    &req.must_include_device_i_ds,
                    usize::try_from(req.allocation_size).unwrap_or(0),
                ),
            })
            .collect();
        PluginMetrics::inc(&self.metrics.preferred_allocations);
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let view = self.view.borrow().clone();
        let mut container_responses = Vec::new();
        for req in &request.get_ref().container_requests {
            match allocate::container_response(&view, &req.devices_ids, &self.options) {
                Ok(resp) => container_responses.push(resp),
                Err(err) => {
                    PluginMetrics::inc(&self.metrics.allocation_errors);
                    tracing::warn!(resource = %view.resource, error = %err, "Allocate refused");
                    return Err(err.into());
                }
            }
        }
        PluginMetrics::inc(&self.metrics.allocations);
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A running server and the socket it listens on.
pub(crate) struct RunningServer {
    pub socket_path: PathBuf,
    /// Identity of the socket we bound, to notice it being deleted or replaced.
    pub identity: Option<FileIdentity>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

/// Device, inode and change time of a file. The change time matters because a
/// socket deleted and recreated at once often gets the freed inode number back.
pub(crate) type FileIdentity = (u64, u64, i64, i64);

/// The identity of `path`, or `None` if it does not exist.
pub(crate) fn file_identity(path: &Path) -> Option<FileIdentity> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

impl RunningServer {
    /// Removes a stale socket, binds `socket_path` and serves `service` on it.
    pub fn start(socket_path: PathBuf, service: DevicePluginService) -> Result<Self, PluginError> {
        match std::fs::remove_file(&socket_path) {
            Ok(()) => tracing::debug!(socket = %socket_path.display(), "removed stale socket"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(PluginError::Socket {
                    path: socket_path,
                    source,
                });
            }
        }
        let listener = UnixListener::bind(&socket_path).map_err(|source| PluginError::Socket {
            path: socket_path.clone(),
            source,
        })?;
        let identity = file_identity(&socket_path);
        let stop = service.stop.clone();
        let shutdown = stop.clone().cancelled_owned();
        let task = tokio::spawn(
            Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown),
        );
        Ok(Self {
            socket_path,
            identity,
            stop,
            task,
        })
    }

    /// True while our socket file is the one we bound.
    pub fn socket_intact(&self) -> bool {
        self.identity.is_some() && file_identity(&self.socket_path) == self.identity
    }

    /// Stops serving (ends `ListAndWatch` streams), waits up to `grace`, and
    /// removes the socket if it is still ours.
    pub async fn stop(self, grace: Duration) {
        self.stop.cancel();
        let mut task = self.task;
        match tokio::time::timeout(grace, &mut task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(socket = %self.socket_path.display(), error = %e, "plugin server ended with an error")
            }
            Ok(Err(e)) => {
                tracing::warn!(socket = %self.socket_path.display(), error = %e, "plugin server task failed")
            }
            Err(_) => {
                tracing::warn!(socket = %self.socket_path.display(), "plugin server did not stop in time; aborting");
                task.abort();
            }
        }
        // The kubelet may already have deleted it, or a new server may own the path.
        if self.identity.is_some()
            && file_identity(&self.socket_path) == self.identity
            && let Err(e) = std::fs::remove_file(&self.socket_path)
        {
            tracing::warn!(socket = %self.socket_path.display(), error = %e, "removing socket");
        }
    }
}

/// A gRPC channel over the unix socket at `path`.
pub async fn connect_unix(path: &Path, timeout: Duration) -> Result<Channel, PluginError> {
    let path_buf = path.to_path_buf();
    // The URI is required by tonic but unused: the connector ignores it.
    let endpoint = Endpoint::from_static("http://[::1]:50051")
        .connect_timeout(timeout)
        .timeout(timeout);
    endpoint
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path_buf.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| PluginError::Connect {
            path: path.to_path_buf(),
            source,
        })
}

/// Calls our own server to prove it answers before registering.
pub(crate) async fn self_dial(socket: &Path, timeout: Duration) -> Result<(), PluginError> {
    let channel = connect_unix(socket, timeout).await?;
    DevicePluginClient::new(channel)
        .get_device_plugin_options(Empty {})
        .await
        .map_err(|source| PluginError::Rpc {
            what: "self-dial GetDevicePluginOptions",
            path: socket.to_path_buf(),
            source,
        })?;
    Ok(())
}

/// Registers `resource` served on `endpoint` (a file name in the plugin dir) with the kubelet.
pub(crate) async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource: &str,
    timeout: Duration,
) -> Result<(), PluginError> {
    let channel = connect_unix(kubelet_socket, timeout).await?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: VERSION.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(plugin_options()),
        })
        .await
        .map_err(|source| PluginError::Rpc {
            what: "Register",
            path: kubelet_socket.to_path_buf(),
            source,
        })?;
    Ok(())
}
