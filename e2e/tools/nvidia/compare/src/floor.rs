//! The transport floor: a device plugin server that does no work of its own, for the
//! benchmark's Allocate rows. It answers each Allocate at once with an answer shaped as ours
//! (a CDI name per device, `NVIDIA_VISIBLE_DEVICES`, the CDI annotation), built from the
//! request's IDs with no lookup, on the same stack as our plugin (tonic over a unix socket, a
//! single-threaded runtime) in a process of its own. What the benchmark client measures
//! against it is the cost of the client, the kernel and one gRPC server: no plugin, ours or
//! NVIDIA's, can answer below it on this client.

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;

use anyhow::{Context, Result};
use gpupool_device_plugin::plugin::api::v1beta1::device_plugin_server::{
    DevicePlugin, DevicePluginServer,
};
use gpupool_device_plugin::plugin::api::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use tokio::net::UnixListener;
use tokio_stream::Stream;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

struct Floor;

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
        Ok(Response::new(Box::pin(tokio_stream::pending())))
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
            .add_service(DevicePluginServer::new(Floor))
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .context("serving the floor")
    })
}
