//! A stand-in for Kueue's Workload CRD: what the operator writes to a Workload (deactivation)
//! is checked without a Kueue controller.

use anyhow::Result;
use kube::discovery::ApiResource;

use crate::cluster::Cluster;

const WORKLOAD_CRD: &str = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: workloads.kueue.x-k8s.io
spec:
  group: kueue.x-k8s.io
  names: {kind: Workload, listKind: WorkloadList, plural: workloads, singular: workload}
  scope: Namespaced
  versions:
    - name: v1beta1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"#;

/// Applies the Workload CRD (idempotent: tests running side by side apply the same object)
/// and waits until it is Established.
pub fn install_workload_crd(cluster: &Cluster) -> Result<()> {
    cluster
        .kubectl()
        .run_with_stdin(["apply", "-f", "-"], Some(WORKLOAD_CRD))?;
    cluster.kubectl().run([
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/workloads.kueue.x-k8s.io",
    ])?;
    Ok(())
}

/// The Workload resource, for a dynamic `Api`.
pub fn workload_resource() -> ApiResource {
    ApiResource {
        group: "kueue.x-k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "kueue.x-k8s.io/v1beta1".into(),
        kind: "Workload".into(),
        plural: "workloads".into(),
    }
}
