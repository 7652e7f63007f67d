//! MIG drain coordination: while a node's agent reports `Draining`, the GPU pods on it are
//! evicted through the Eviction API (PodDisruptionBudgets apply), each with an Event saying why.

use gpupool_crds::node::MigState;
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::context::Context;
use crate::demand::requests_gpu;
use crate::error::{Failures, api_code};

/// The GPU pods still to leave a node (pure over the pods given).
pub fn pods_to_drain<'a>(node: &str, pods: impl IntoIterator<Item = &'a Pod>) -> Vec<&'a Pod> {
    pods.into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded") | Some("Failed")
            )
        })
        .filter(|p| requests_gpu(p))
        .collect()
}

/// Evicts the GPU pods of draining nodes; returns how many are still to go. Evictions the API
/// server refuses (RBAC) are noted in `failures` for the pool's status.
pub async fn run(
    pool: &GpuPool,
    gpunodes: &[&GpuNode],
    ctx: &Context,
    _now: Timestamp,
    failures: &mut Failures,
) -> u32 {
    let draining: Vec<String> = gpunodes
        .iter()
        .filter(|g| {
            g.status
                .as_ref()
                .is_some_and(|s| s.mig.state == MigState::Draining)
        })
        .map(|g| g.name_any())
        .collect();
    if draining.is_empty() {
        return 0;
    }
    let all = ctx.pods.state();
    let mut remaining = 0u32;
    for node in &draining {
        for pod in pods_to_drain(node, all.iter().map(|p| p.as_ref())) {
            remaining += 1;
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let ns = pod.namespace().unwrap_or_default();
            let name = pod.name_any();
            let api: Api<Pod> = Api::namespaced(ctx.evict_client.clone(), &ns);
            let (type_, reason, note) = match crate::context::evict(&api, pod, false).await {
                Ok(_) => {
                    ctx.metrics.write("Pod", "evict");
                    info!(pod = %format!("{ns}/{name}"), node = %node, "evicted for MIG reconfiguration");
                    (
                        EventType::Normal,
                        "EvictedForMIGChange",
                        format!(
                            "evicted: pool {} is changing the MIG layout of node {node}, which needs its GPUs free",
                            pool.name_any()
                        ),
                    )
                }
                Err(e) if api_code(&e) == Some(429) => (
                    EventType::Warning,
                    "MIGDrainBlockedByPDB",
                    format!(
                        "pool {} must change the MIG layout of node {node}, but a PodDisruptionBudget does not allow evicting this pod now; retrying",
                        pool.name_any()
                    ),
                ),
                // Gone, or replaced by a pod of the same name (UID precondition).
                Err(e) if matches!(api_code(&e), Some(404 | 409)) => continue,
                Err(e) => {
                    warn!(pod = %format!("{ns}/{name}"), error = %e, "eviction for MIG drain failed");
                    failures.note(
                        "create",
                        "pods/eviction",
                        format!("evicting pod {ns}/{name} for the MIG change on node {node}"),
                        &e,
                    );
                    (
                        EventType::Warning,
                        "MIGDrainFailed",
                        format!("evicting for the MIG change on node {node} failed: {e}"),
                    )
                }
            };
            ctx.event(
                &pod.object_ref(&()),
                Event {
                    type_,
                    reason: reason.into(),
                    note: Some(note),
                    action: "Drain".into(),
                    secondary: Some(pool.object_ref(&())),
                },
            )
            .await;
        }
    }
    remaining
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use std::collections::BTreeMap;

    fn pod(node: &str, resource: Option<&str>, phase: &str) -> Pod {
        Pod {
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                containers: vec![Container {
                    resources: resource.map(|r| ResourceRequirements {
                        limits: Some(BTreeMap::from([(r.to_owned(), Quantity("1".into()))])),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_gpu_pods_on_the_node_that_still_run() {
        let pods = [
            pod("n1", Some("nvidia.com/gpu"), "Running"),
            pod("n1", Some("nvidia.com/mig-1g.10gb"), "Pending"),
            pod("n1", Some("cpu"), "Running"),
            pod("n1", None, "Running"),
            pod("n1", Some("nvidia.com/gpu"), "Succeeded"),
            pod("n2", Some("nvidia.com/gpu"), "Running"),
        ];
        assert_eq!(pods_to_drain("n1", pods.iter()).len(), 2);
    }
}
