//! Start-up checks: the CRDs must be Established before any watch starts.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client};

/// The CRDs the operator watches.
pub const CRDS: [&str; 2] = ["gpupools.gpupool.io", "gpunodes.gpupool.io"];

/// Why the CRDs are not usable.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// Not Established in time.
    #[error(
        "CRD {0} was not Established within {1:?}: install the gpupool CRDs (helm chart with crds.install=true, or kubectl apply -f crds/)"
    )]
    Timeout(&'static str, Duration),
    /// The watch failed.
    #[error("waiting for CRD {0}: {1}")]
    Wait(&'static str, kube::runtime::wait::Error),
}

/// Waits until every CRD is Established, or fails after `timeout`.
pub async fn wait_for_crds(client: Client, timeout: Duration) -> Result<(), CrdError> {
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for name in CRDS {
        let cond = await_condition(api.clone(), name, conditions::is_crd_established());
        match tokio::time::timeout(timeout, cond).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(CrdError::Wait(name, e)),
            Err(_) => return Err(CrdError::Timeout(name, timeout)),
        }
    }
    Ok(())
}
