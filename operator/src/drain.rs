//! MIG drain coordination: while a node's agent reports `Draining`, the GPU pods on the GPUs
//! whose layout changes are evicted through the Eviction API (PodDisruptionBudgets apply),
//! each with an Event saying why.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_crds::node::MigState;
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tracing::{debug, info, warn};

use crate::context::Context;
use crate::demand::requests_gpu;
use crate::error::{Failures, api_code};

/// The GPU pods still to leave a node: those the agent reports on a GPU whose layout changes
/// (`status.mig.gpus`), and those it cannot place on any GPU (they may be on one). A pod the
/// agent places only on GPUs that keep their layout stays. Without a list of changing GPUs,
/// every GPU pod on the node goes. Pure over the GpuNode and pods given.
pub fn pods_to_drain<'a>(gn: &GpuNode, pods: impl IntoIterator<Item = &'a Pod>) -> Vec<&'a Pod> {
    let node = gn.name_any();
    let placed = placements(gn);
    let changing: BTreeSet<u32> = gn
        .status
        .as_ref()
        .map(|s| s.mig.gpus.iter().copied().collect())
        .unwrap_or_default();
    pods.into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str()))
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded") | Some("Failed")
            )
        })
        .filter(|p| requests_gpu(p))
        .filter(|p| {
            let key = (p.namespace().unwrap_or_default(), p.name_any());
            match placed.get(&key) {
                Some(gpus) if !changing.is_empty() => !gpus.is_disjoint(&changing),
                _ => true,
            }
        })
        .collect()
}

/// The GPU indices each pod holds on the node (its whole GPU or a MIG device on it), as the
/// agent reports them.
fn placements(gn: &GpuNode) -> BTreeMap<(String, String), BTreeSet<u32>> {
    let mut out: BTreeMap<(String, String), BTreeSet<u32>> = BTreeMap::new();
    for gpu in gn.status.iter().flat_map(|s| s.gpus.iter()) {
        let holders = gpu
            .idleness
            .pods
            .iter()
            .chain(gpu.mig_devices.iter().flat_map(|m| m.idleness.pods.iter()));
        for p in holders {
            out.entry((p.namespace.to_string(), p.name.clone()))
                .or_default()
                .insert(gpu.index);
        }
    }
    out
}

/// Evicts the GPU pods of draining nodes; returns how many are still to go. Evictions the API
/// server refuses (RBAC) are noted in `failures` for the pool's status. Pods are evicted only
/// from nodes in `vouched` (Node Ready, agent live): a `Draining` report nobody can vouch for
/// (an agent dead since, an operator just started) counts its pods as still to go and evicts
/// none.
pub async fn run(
    pool: &GpuPool,
    gpunodes: &[&GpuNode],
    vouched: &BTreeSet<&str>,
    ctx: &Context,
    _now: Timestamp,
    failures: &mut Failures,
) -> u32 {
    let draining: Vec<&GpuNode> = gpunodes
        .iter()
        .copied()
        .filter(|g| {
            g.status
                .as_ref()
                .is_some_and(|s| s.mig.state == MigState::Draining)
        })
        .collect();
    if draining.is_empty() {
        return 0;
    }
    let all = ctx.pods.state();
    let mut remaining = 0u32;
    for gn in draining {
        let node = &gn.name_any();
        let on_node: Vec<Pod> = all
            .iter()
            .filter(|p| p.node_name() == Some(node.as_str()))
            .map(|p| p.to_pod())
            .collect();
        let act = vouched.contains(node.as_str());
        if !act {
            debug!(node = %node, "draining, but its report is not vouched for: holding");
        }
        for pod in pods_to_drain(gn, &on_node) {
            remaining += 1;
            if !act || pod.metadata.deletion_timestamp.is_some() || !ctx.may_act() {
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
            metadata: kube::api::ObjectMeta {
                namespace: Some("ml".into()),
                name: Some(format!("{node}-{}-{phase}", resource.unwrap_or("none"))),
                ..Default::default()
            },
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
        }
    }

    fn gpunode(changing: &[u32], placed: &[(u32, &Pod)]) -> GpuNode {
        use gpupool_crds::node::{GpuNodeStatus, GpuStatus, Idleness, NodeMigStatus, PodRef};
        let mut gn = GpuNode::new(
            "n1",
            gpupool_crds::GpuNodeSpec {
                sharing: Default::default(),
                pool: "p".into(),
                driver: Default::default(),
                cdi: Default::default(),
                mig: Default::default(),
                utilization: Default::default(),
            },
        );
        let gpus = (0..8)
            .map(|index| GpuStatus {
                index,
                idleness: Idleness {
                    pods: placed
                        .iter()
                        .filter(|(i, _)| *i == index)
                        .map(|(_, p)| PodRef {
                            namespace: p.namespace().unwrap_or_default().into(),
                            name: p.name_any(),
                            container: None,
                        })
                        .collect(),
                    ..Default::default()
                },
                ..Default::default()
            })
            .collect();
        gn.status = Some(GpuNodeStatus {
            gpus,
            mig: NodeMigStatus {
                state: MigState::Draining,
                gpus: changing.to_vec(),
                ..Default::default()
            },
            ..Default::default()
        });
        gn
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
        // No list of changing GPUs: every GPU pod that still runs goes.
        assert_eq!(pods_to_drain(&gpunode(&[], &[]), pods.iter()).len(), 2);
    }

    #[test]
    fn only_pods_on_the_changing_gpus_or_unplaced_go() {
        let on_changing = pod("n1", Some("nvidia.com/gpu"), "Running");
        let mut on_kept = pod("n1", Some("nvidia.com/gpu"), "Running");
        on_kept.metadata.name = Some("kept".into());
        let mut unplaced = pod("n1", Some("nvidia.com/gpu"), "Running");
        unplaced.metadata.name = Some("unplaced".into());
        let gn = gpunode(&[0, 1], &[(1, &on_changing), (5, &on_kept)]);
        let pods = [on_changing.clone(), on_kept.clone(), unplaced.clone()];
        let names: Vec<String> = pods_to_drain(&gn, pods.iter())
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, [on_changing.name_any(), "unplaced".to_owned()]);
    }
}
