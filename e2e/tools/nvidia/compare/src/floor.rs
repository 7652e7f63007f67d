//! The floors: device plugin servers that do no work of their own, for the benchmark's
//! Allocate and health rows, on the same stack as our plugin (tonic over a unix socket, a
//! single-threaded runtime), each in a process of its own.
//!
//! - `serve-floor`: answers each Allocate at once with an answer shaped as ours (a CDI name per
//!   device, `NVIDIA_VISIBLE_DEVICES`, the CDI annotation), built from the request's IDs with no
//!   lookup. What the benchmark client measures against it is the cost of the client, the
//!   kernel and one gRPC server: no plugin, ours or NVIDIA's, can answer below it on this
//!   client.
//! - `serve-health-floor`: registers `nvidia.com/gpu` (one device per GPU) with the kubelet
//!   stand-in and sends a new device list the moment an NVML event wait returns, straight from
//!   the waiting thread, with no health policy, monitor or hop between tasks. What the
//!   benchmark measures against it is the fake library's delivery (the state file's wake-up,
//!   read and parse), the stand-in and one ListAndWatch send: no plugin can report Unhealthy
//!   below it here.

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;

use std::time::Duration;

use anyhow::{Context, Result};
use gpupool_device_plugin::backend::GpuBackend;
use gpupool_device_plugin::plugin::api::VERSION;
use gpupool_device_plugin::plugin::api::v1beta1::device_plugin_server::{
    DevicePlugin, DevicePluginServer,
};
use gpupool_device_plugin::plugin::api::v1beta1::registration_client::RegistrationClient;
use gpupool_device_plugin::plugin::api::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    RegisterRequest,
};
use gpupool_device_plugin::plugin::{connect_unix, plugin_options};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::node::{self, FakeNode};

/// The socket the health floor serves, in the stand-in's directory.
const HEALTH_SOCKET: &str = "gpupool-health-floor.sock";
/// The resource the health floor registers.
const HEALTH_RESOURCE: &str = "nvidia.com/gpu";

/// A floor server: the Allocate floor streams no device list; the health floor streams the
/// list its NVML thread keeps.
struct Floor {
    devices: Option<watch::Receiver<Vec<Device>>>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Floor {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        match &self.devices {
            None => Ok(Response::new(Box::pin(tokio_stream::pending()))),
            Some(rx) => Ok(Response::new(Box::pin(
                WatchStream::new(rx.clone()).map(|devices| Ok(ListAndWatchResponse { devices })),
            ))),
        }
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(PreferredAllocationResponse::default()))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let container_responses = request
            .get_ref()
            .container_requests
            .iter()
            .map(|c| {
                let names: Vec<String> = c
                    .devices_ids
                    .iter()
                    .map(|id| format!("gpupool.io/gpu={id}"))
                    .collect();
                ContainerAllocateResponse {
                    envs: HashMap::from([(
                        "NVIDIA_VISIBLE_DEVICES".to_owned(),
                        c.devices_ids.join(","),
                    )]),
                    annotations: HashMap::from([(
                        "cdi.k8s.io/gpupool-floor_nvidia.com-gpu".to_owned(),
                        names.join(","),
                    )]),
                    cdi_devices: names.into_iter().map(|name| CdiDevice { name }).collect(),
                    ..Default::default()
                }
            })
            .collect();
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Serves the floor on `socket` until killed (the `serve-floor` child).
pub fn serve(socket: &Path) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let _ = std::fs::remove_file(socket);
        let listener =
            UnixListener::bind(socket).with_context(|| format!("binding {}", socket.display()))?;
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(Floor { devices: None }))
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .context("serving the floor")
    })
}

/// Serves the health floor for the fake node in `node_dir`, registered with the stand-in whose
/// `kubelet.sock` is in `plugin_dir`, until killed (the `serve-health-floor` child).
pub fn serve_health(node_dir: &Path, plugin_dir: &Path) -> Result<()> {
    let node = FakeNode::open(node_dir)?;
    let backend = node::backend(&node)?;
    let devices: Vec<Device> = (0..node.gpus)
        .map(|gpu| Device {
            id: gpu.to_string(),
            health: "Healthy".to_owned(),
            topology: None,
        })
        .collect();
    let (tx, rx) = watch::channel(devices);
    // The wait blocks, so it has a thread of its own, as in every plugin; the list is sent
    // from that thread the moment the wait returns.
    let (subscribed_tx, subscribed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut events = match backend.health_events() {
            Ok(events) => {
                let _ = subscribed_tx.send(Ok(()));
                events
            }
            Err(e) => {
                let _ = subscribed_tx.send(Err(e.to_string()));
                return;
            }
        };
        loop {
            match events.wait(Duration::from_millis(500)) {
                Ok(batch) => {
                    for event in batch {
                        tx.send_modify(|list| {
                            if let Some(d) = list.get_mut(event.gpu as usize) {
                                d.health = "Unhealthy".to_owned();
                            }
                        });
                    }
                }
                Err(e) => {
                    eprintln!("health floor: waiting for NVML events: {e}");
                    return;
                }
            }
        }
    });
    subscribed
        .recv()
        .context("the NVML thread ended before subscribing")?
        .map_err(|e| anyhow::anyhow!("subscribing to NVML events: {e}"))?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let socket = plugin_dir.join(HEALTH_SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener =
            UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(Floor { devices: Some(rx) }))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        let kubelet = connect_unix(&plugin_dir.join("kubelet.sock"), Duration::from_secs(5))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        RegistrationClient::new(kubelet)
            .register(RegisterRequest {
                version: VERSION.to_owned(),
                endpoint: HEALTH_SOCKET.to_owned(),
                resource_name: HEALTH_RESOURCE.to_owned(),
                options: Some(plugin_options()),
            })
            .await
            .context("registering the health floor")?;
        server
            .await
            .context("the health floor's server task")?
            .context("serving the health floor")
    })
}
