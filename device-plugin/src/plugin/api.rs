//! Generated bindings for the kubelet gRPC APIs (`proto/`), plus the constants
//! the kubelet defines next to them (`constants.go` in k8s.io/kubelet).

/// `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`: Registration and DevicePlugin services.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// `k8s.io/kubelet/pkg/apis/podresources/v1`: the PodResourcesLister service.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod podresources_v1 {
    tonic::include_proto!("v1");
}

/// The device plugin API version this plugin speaks.
pub const VERSION: &str = "v1beta1";
/// `Device.health` value for a usable device.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` value for a device the kubelet must not hand out.
pub const UNHEALTHY: &str = "Unhealthy";
/// The kubelet's device plugin directory on a standard node.
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// File name of the kubelet's Registration socket inside the plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Longest `Device.ID` the kubelet accepts.
pub const MAX_DEVICE_ID_LEN: usize = 63;
