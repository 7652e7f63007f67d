//! A kubelet stand-in for tests and benchmarks: a real `Registration` gRPC
//! server on `kubelet.sock` in a temp directory. Like the kubelet, on each
//! `Register` it dials the plugin's socket back, asks `GetDevicePluginOptions`
//! and opens `ListAndWatch`; every registration and device list is reported as a
//! [`KubeletEvent`]. Tests then call `Allocate` / `GetPreferredAllocation` through
//! [`KubeletStandin::client`].

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

use super::api::v1beta1::device_plugin_client::DevicePluginClient;
use super::api::v1beta1::registration_server::{Registration, RegistrationServer};
use super::api::v1beta1::{Device, DevicePluginOptions, Empty, RegisterRequest};
use super::api::{KUBELET_SOCKET, VERSION};
use super::server::connect_unix;

/// What the stand-in saw.
#[derive(Debug, Clone, PartialEq)]
pub enum KubeletEvent {
    /// A plugin registered (after the dial-back and options call succeeded).
    Registered {
        /// The request as received.
        request: RegisterRequest,
        /// What `GetDevicePluginOptions` returned.
        options: DevicePluginOptions,
    },
    /// A `ListAndWatch` message for a resource.
    Devices {
        /// Resource name.
        resource: String,
        /// The full device list.
        devices: Vec<Device>,
    },
    /// The `ListAndWatch` stream of a resource ended.
    StreamClosed {
        /// Resource name.
        resource: String,
    },
}

struct Shared {
    dir: PathBuf,
    events: mpsc::UnboundedSender<KubeletEvent>,
    clients: Mutex<HashMap<String, DevicePluginClient<Channel>>>,
    registrations: Mutex<Vec<RegisterRequest>>,
    /// Stops the ListAndWatch readers of this kubelet "process".
    streams: Mutex<CancellationToken>,
}

struct RegistrationService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                request.version
            )));
        }
        if request
            .resource_name
            .parse::<super::model::ResourceName>()
            .is_err()
        {
            return Err(Status::invalid_argument(format!(
                "invalid resource name {:?}",
                request.resource_name
            )));
        }
        // As the kubelet does: dial back inside Register, ask the options, start ListAndWatch.
        let socket = self.shared.dir.join(&request.endpoint);
        let channel = connect_unix(&socket, Duration::from_secs(5))
            .await
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(Empty {})
            .await?
            .into_inner();
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        let resource = request.resource_name.clone();
        if let Ok(mut clients) = self.shared.clients.lock() {
            clients.insert(resource.clone(), client);
        }
        if let Ok(mut regs) = self.shared.registrations.lock() {
            regs.push(request.clone());
        }
        let _ = self
            .shared
            .events
            .send(KubeletEvent::Registered { request, options });
        let events = self.shared.events.clone();
        let stop = self
            .shared
            .streams
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => break,
                    m = stream.message() => m,
                };
                match message {
                    Ok(Some(list)) => {
                        let _ = events.send(KubeletEvent::Devices {
                            resource: resource.clone(),
                            devices: list.devices,
                        });
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = events.send(KubeletEvent::StreamClosed { resource });
        });
        Ok(Response::new(Empty {}))
    }
}

/// Errors starting the stand-in.
#[derive(Debug, thiserror::Error)]
pub enum StandinError {
    /// Binding `kubelet.sock`.
    #[error("binding {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The kubelet stand-in.
pub struct KubeletStandin {
    shared: Arc<Shared>,
    events: mpsc::UnboundedReceiver<KubeletEvent>,
    /// Events skipped by a `wait_for`, kept for later waits in arrival order.
    backlog: VecDeque<KubeletEvent>,
    server: Option<(
        CancellationToken,
        JoinHandle<Result<(), tonic::transport::Error>>,
    )>,
}

impl KubeletStandin {
    /// Serves `Registration` on `<dir>/kubelet.sock`.
    pub async fn start(dir: &Path) -> Result<Self, StandinError> {
        let (tx, events) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            events: tx,
            clients: Mutex::new(HashMap::new()),
            registrations: Mutex::new(Vec::new()),
            streams: Mutex::new(CancellationToken::new()),
        });
        let mut standin = Self {
            shared,
            events,
            backlog: VecDeque::new(),
            server: None,
        };
        standin.serve()?;
        Ok(standin)
    }

    fn serve(&mut self) -> Result<(), StandinError> {
        let path = self.socket_path();
        let listener = UnixListener::bind(&path).map_err(|source| StandinError::Bind {
            path: path.clone(),
            source,
        })?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(
            Server::builder()
                .add_service(RegistrationServer::new(RegistrationService {
                    shared: self.shared.clone(),
                }))
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listener),
                    stop.clone().cancelled_owned(),
                ),
        );
        self.server = Some((stop, task));
        Ok(())
    }

    /// Path of the stand-in's `kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.shared.dir.join(KUBELET_SOCKET)
    }

    /// The next event, or `None` if none arrives within `timeout`.
    pub async fn next_event(&mut self, timeout: Duration) -> Option<KubeletEvent> {
        if let Some(event) = self.backlog.pop_front() {
            return Some(event);
        }
        tokio::time::timeout(timeout, self.events.recv())
            .await
            .ok()
            .flatten()
    }

    /// The first event (oldest first) for which `pick` returns `Some`, waiting
    /// up to `timeout`. Events it passes over stay queued for later calls.
    pub async fn wait_for<T>(
        &mut self,
        timeout: Duration,
        mut pick: impl FnMut(&KubeletEvent) -> Option<T>,
    ) -> Option<T> {
        if let Some((i, found)) = self
            .backlog
            .iter()
            .enumerate()
            .find_map(|(i, e)| pick(e).map(|f| (i, f)))
        {
            self.backlog.remove(i);
            return Some(found);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let event = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .ok()
                .flatten()?;
            if let Some(found) = pick(&event) {
                return Some(found);
            }
            self.backlog.push_back(event);
        }
    }

    /// Waits for the next registration of `resource`.
    pub async fn wait_registered(
        &mut self,
        resource: &str,
        timeout: Duration,
    ) -> Option<RegisterRequest> {
        self.wait_for(timeout, |e| match e {
            KubeletEvent::Registered { request, .. } if request.resource_name == resource => {
                Some(request.clone())
            }
            _ => None,
        })
        .await
    }

    /// Waits for the next device list of `resource` that satisfies `accept`.
    pub async fn wait_devices(
        &mut self,
        resource: &str,
        timeout: Duration,
        mut accept: impl FnMut(&[Device]) -> bool,
    ) -> Option<Vec<Device>> {
        self.wait_for(timeout, |e| match e {
            KubeletEvent::Devices {
                resource: r,
                devices,
            } if r == resource && accept(devices) => Some(devices.clone()),
            _ => None,
        })
        .await
    }

    /// A client connected to the plugin registered for `resource`.
    pub fn client(&self, resource: &str) -> Option<DevicePluginClient<Channel>> {
        self.shared.clients.lock().ok()?.get(resource).cloned()
    }

    /// Every registration received so far.
    pub fn registrations(&self) -> Vec<RegisterRequest> {
        self.shared
            .registrations
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// Simulates a kubelet restart: stop serving, drop the plugin streams,
    /// delete every socket in the directory (as a starting kubelet does), and
    /// serve a fresh `kubelet.sock`.
    pub async fn restart(&mut self) -> Result<(), StandinError> {
        self.stop_server().await;
        if let Ok(mut streams) = self.shared.streams.lock() {
            streams.cancel();
            *streams = CancellationToken::new();
        }
        if let Ok(mut clients) = self.shared.clients.lock() {
            clients.clear();
        }
        if let Ok(entries) = std::fs::read_dir(&self.shared.dir) {
            for entry in entries.flatten() {
                let is_socket = entry
                    .file_type()
                    .map(|t| std::os::unix::fs::FileTypeExt::is_socket(&t))
                    .unwrap_or(false);
                if is_socket {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        self.serve()
    }

    async fn stop_server(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }

    /// Stops serving and removes `kubelet.sock`.
    pub async fn shutdown(mut self) {
        self.stop_server().await;
        if let Ok(streams) = self.shared.streams.lock() {
            streams.cancel();
        }
        let _ = std::fs::remove_file(self.socket_path());
    }
}
