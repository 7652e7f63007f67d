//! Pending GPU demand (pure): whether a pod waiting to be scheduled could land on one of a
//! pool's nodes, judged as the scheduler's node filters would by the pod's node selector, its
//! required node affinity, and its tolerations of the nodes' taints. `onlyUnderPressure`
//! reclaims only while such a pod exists.
//!
//! Resources are left out on purpose: the point of reclaiming is to free GPUs that are taken,
//! so a pod that does not fit a node today may well fit once an idle pod has left it.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec, ResourceRequirements, Taint,
    Toleration,
};

use crate::cache::{CachedNode, is_gpu_resource};

/// Whether a pod asks for GPUs (`nvidia.com/gpu` or `nvidia.com/mig-*`).
pub fn requests_gpu(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|spec| {
        spec.containers
            .iter()
            .any(|c| c.resources.as_ref().is_some_and(asks_gpu))
    })
}

/// Whether a container's limits or requests name a GPU resource.
fn asks_gpu(resources: &ResourceRequirements) -> bool {
    resources
        .limits
        .iter()
        .chain(resources.requests.iter())
        .flat_map(|m| m.keys())
        .any(|k| is_gpu_resource(k))
}

/// Whether some pod wants GPUs, waits to be scheduled, and could run on one of `nodes`.
pub fn demand_pending<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    nodes: &[Arc<CachedNode>],
) -> bool {
    pods.into_iter()
        .filter(|p| awaits_scheduling(p) && requests_gpu(p))
        .any(|p| nodes.iter().any(|n| could_run_on(p, n)))
}

/// Pending, not yet bound to a node, and not on its way out.
fn awaits_scheduling(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")
        && pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none()
        && pod.metadata.deletion_timestamp.is_none()
}

/// Whether the scheduler's node-level filters would let `pod` onto `node`: node selector,
/// required node affinity and taints.
pub fn could_run_on(pod: &Pod, node: &CachedNode) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let labels = node.labels();
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    selector_ok && affinity_allows(spec, node) && tolerates_taints(spec, node)
}

/// Required node affinity: at least one term matches (terms are ORed; an absent affinity
/// allows every node).
fn affinity_allows(spec: &PodSpec, node: &CachedNode) -> bool {
    let Some(required) = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
    else {
        return true;
    };
    required
        .node_selector_terms
        .iter()
        .any(|t| term_matches(t, node))
}

/// A term matches when all its expressions and fields do; an empty term matches no node.
fn term_matches(term: &NodeSelectorTerm, node: &CachedNode) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let labels = node.labels();
    exprs.iter().all(|r| label_requirement_matches(r, labels))
        && fields.iter().all(|r| field_requirement_matches(r, node))
}

/// `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt` on a node label. An operator this code
/// does not know matches nothing (the API server rejects such pods anyway).
pub fn label_requirement_matches(
    req: &NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> bool {
    let value = labels.get(&req.key);
    let values = req.values.as_deref().unwrap_or_default();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            // Exactly one integer to compare with, and a label that reads as one.
            let [bound] = values else {
                return false;
            };
            let (Some(Ok(have)), Ok(bound)) =
                (value.map(|v| v.parse::<i64>()), bound.parse::<i64>())
            else {
                return false;
            };
            if req.operator == "Gt" {
                have > bound
            } else {
                have < bound
            }
        }
        _ => false,
    }
}

/// `matchFields`: the only field Kubernetes supports is `metadata.name`, with `In`/`NotIn`.
pub fn field_requirement_matches(req: &NodeSelectorRequirement, node: &CachedNode) -> bool {
    if req.key != "metadata.name" {
        return false;
    }
    let name = node.name();
    let values = req.values.as_deref().unwrap_or_default();
    match req.operator.as_str() {
        "In" => values.iter().any(|v| v == name),
        "NotIn" => !values.iter().any(|v| v == name),
        _ => false,
    }
}

/// Every taint that keeps pods off (`NoSchedule`, `NoExecute`) is tolerated.
fn tolerates_taints(spec: &PodSpec, node: &CachedNode) -> bool {
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    node.taints()
        .iter()
        .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
        .all(|taint| tolerations.iter().any(|tol| tolerates(tol, taint)))
}

/// The scheduler's rule: an empty effect or key is a wildcard; `Exists` ignores the value,
/// `Equal` (the default) needs it equal.
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    fn set(s: &Option<String>) -> Option<&str> {
        s.as_deref().filter(|s| !s.is_empty())
    }
    if set(&tol.effect).is_some_and(|e| e != taint.effect) {
        return false;
    }
    if set(&tol.key).is_some_and(|k| k != taint.key) {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => set(&tol.value) == set(&taint.value),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Affinity, Container, Node, NodeAffinity, NodeSelector, NodeSpec, PodStatus,
        ResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn node(
        name: &str,
        labels: &[(&str, &str)],
        taints: &[(&str, Option<&str>, &str)],
    ) -> CachedNode {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        );
        n.spec = Some(NodeSpec {
            taints: Some(
                taints
                    .iter()
                    .map(|(key, value, effect)| Taint {
                        key: (*key).into(),
                        value: value.map(Into::into),
                        effect: (*effect).into(),
                        time_added: None,
                    })
                    .collect(),
            ),
            ..Default::default()
        });
        n.into()
    }

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| (*v).into()).collect()),
        }
    }

    fn exprs(reqs: Vec<NodeSelectorRequirement>) -> NodeSelectorTerm {
        NodeSelectorTerm {
            match_expressions: Some(reqs),
            match_fields: None,
        }
    }

    fn fields(reqs: Vec<NodeSelectorRequirement>) -> NodeSelectorTerm {
        NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(reqs),
        }
    }

    fn tol(
        key: Option<&str>,
        op: Option<&str>,
        value: Option<&str>,
        effect: Option<&str>,
    ) -> Toleration {
        Toleration {
            key: key.map(Into::into),
            operator: op.map(Into::into),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
            toleration_seconds: None,
        }
    }

    /// A pending GPU pod with these scheduling constraints.
    fn pending(
        selector: &[(&str, &str)],
        terms: Option<Vec<NodeSelectorTerm>>,
        tolerations: Vec<Toleration>,
    ) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("wants".into());
        p.spec = Some(PodSpec {
            node_selector: (!selector.is_empty()).then(|| {
                selector
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect()
            }),
            affinity: terms.map(|node_selector_terms| Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            containers: vec![Container {
                name: "main".into(),
                resources: Some(ResourceRequirements {
                    limits: Some(BTreeMap::from([(
                        "nvidia.com/gpu".to_owned(),
                        Quantity("1".into()),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        p.status = Some(PodStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        });
        p
    }

    fn pool_nodes() -> Vec<Arc<CachedNode>> {
        vec![
            Arc::new(node(
                "h100-a",
                &[("gpu", "h100"), ("zone", "a"), ("gpu.count", "8")],
                &[],
            )),
            Arc::new(node(
                "l4-b",
                &[("gpu", "l4"), ("zone", "b"), ("gpu.count", "4")],
                &[("dedicated", Some("inference"), "NoSchedule")],
            )),
        ]
    }

    #[test]
    fn gpu_requests_by_resource_name_in_limits_or_requests() {
        let with = |limits: &[&str], requests: &[&str]| {
            let map = |names: &[&str]| {
                (!names.is_empty()).then(|| {
                    names
                        .iter()
                        .map(|n| ((*n).to_owned(), Quantity("1".into())))
                        .collect()
                })
            };
            let mut p = pending(&[], None, vec![]);
            if let Some(spec) = p.spec.as_mut() {
                spec.containers[0].resources = Some(ResourceRequirements {
                    limits: map(limits),
                    requests: map(requests),
                    ..Default::default()
                });
            }
            p
        };
        let cases: [(&str, Pod, bool); 6] = [
            ("whole GPU", with(&["nvidia.com/gpu"], &[]), true),
            ("MIG device", with(&["nvidia.com/mig-1g.10gb"], &[]), true),
            ("in requests only", with(&[], &["nvidia.com/gpu"]), true),
            ("CPU only", with(&["cpu"], &["memory"]), false),
            (
                "another vendor's prefix",
                with(&["nvidia.com/gpumem"], &[]),
                false,
            ),
            ("no resources", with(&[], &[]), false),
        ];
        for (name, pod, want) in cases {
            assert_eq!(requests_gpu(&pod), want, "{name}");
        }
    }

    #[test]
    fn label_operators() {
        let labels = BTreeMap::from([
            ("gpu".to_owned(), "h100".to_owned()),
            ("count".to_owned(), "8".to_owned()),
            ("odd".to_owned(), "eight".to_owned()),
        ]);
        let cases = [
            (req("gpu", "In", &["a100", "h100"]), true),
            (req("gpu", "In", &["a100"]), false),
            (req("absent", "In", &["h100"]), false),
            (req("gpu", "NotIn", &["l4"]), true),
            (req("gpu", "NotIn", &["h100"]), false),
            (req("absent", "NotIn", &["h100"]), true),
            (req("gpu", "Exists", &[]), true),
            (req("absent", "Exists", &[]), false),
            (req("gpu", "DoesNotExist", &[]), false),
            (req("absent", "DoesNotExist", &[]), true),
            (req("count", "Gt", &["4"]), true),
            (req("count", "Gt", &["8"]), false),
            (req("count", "Lt", &["16"]), true),
            (req("count", "Lt", &["8"]), false),
            (req("count", "Gt", &["-1"]), true),
            (req("absent", "Gt", &["4"]), false),
            (req("odd", "Gt", &["4"]), false),
            (req("count", "Gt", &["four"]), false),
            (req("count", "Gt", &["4", "5"]), false),
            (req("count", "Lt", &[]), false),
            (req("gpu", "Matches", &["h100"]), false),
        ];
        for (r, want) in cases {
            assert_eq!(
                label_requirement_matches(&r, &labels),
                want,
                "{} {} {:?}",
                r.key,
                r.operator,
                r.values
            );
        }
    }

    #[test]
    fn field_operators() {
        let n = node("h100-a", &[], &[]);
        let cases = [
            (req("metadata.name", "In", &["h100-a", "x"]), true),
            (req("metadata.name", "In", &["x"]), false),
            (req("metadata.name", "NotIn", &["x"]), true),
            (req("metadata.name", "NotIn", &["h100-a"]), false),
            (req("metadata.name", "Exists", &[]), false),
            (req("spec.unschedulable", "In", &["h100-a"]), false),
        ];
        for (r, want) in cases {
            assert_eq!(
                field_requirement_matches(&r, &n),
                want,
                "{} {}",
                r.key,
                r.operator
            );
        }
    }

    #[test]
    fn toleration_rules() {
        let taint = Taint {
            key: "dedicated".into(),
            value: Some("inference".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        };
        let cases = [
            (tol(Some("dedicated"), None, Some("inference"), None), true),
            (
                tol(
                    Some("dedicated"),
                    Some("Equal"),
                    Some("inference"),
                    Some("NoSchedule"),
                ),
                true,
            ),
            (
                tol(Some("dedicated"), Some("Equal"), Some("training"), None),
                false,
            ),
            (tol(Some("dedicated"), Some("Exists"), None, None), true),
            (
                tol(Some("dedicated"), Some("Exists"), None, Some("NoExecute")),
                false,
            ),
            (tol(Some("other"), Some("Exists"), None, None), false),
            (tol(None, Some("Exists"), None, None), true),
            (tol(None, Some("Exists"), None, Some("NoSchedule")), true),
            (tol(Some("dedicated"), Some("Gt"), Some("1"), None), false),
        ];
        for (t, want) in cases {
            assert_eq!(tolerates(&t, &taint), want, "{t:?}");
        }
    }

    #[test]
    fn a_pending_gpu_pod_is_demand_if_one_pool_node_could_take_it() {
        let nodes = pool_nodes();
        let no_tol = Vec::new;
        let tolerate_inference = || {
            vec![tol(
                Some("dedicated"),
                Some("Equal"),
                Some("inference"),
                Some("NoSchedule"),
            )]
        };
        struct Case {
            name: &'static str,
            pod: Pod,
            want: bool,
        }
        let cases = [
            Case {
                name: "no constraints: the untainted node takes it",
                pod: pending(&[], None, no_tol()),
                want: true,
            },
            Case {
                name: "node selector matching a node",
                pod: pending(&[("gpu", "h100")], None, no_tol()),
                want: true,
            },
            Case {
                name: "node selector matching no node",
                pod: pending(&[("gpu", "a100")], None, no_tol()),
                want: false,
            },
            Case {
                name: "affinity In on a label of one node",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("zone", "In", &["a"])])]),
                    no_tol(),
                ),
                want: true,
            },
            Case {
                name: "affinity NotIn every pool node's value",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("gpu", "NotIn", &["h100", "l4"])])]),
                    no_tol(),
                ),
                want: false,
            },
            Case {
                name: "affinity Exists on a label no node has",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("fpga", "Exists", &[])])]),
                    no_tol(),
                ),
                want: false,
            },
            Case {
                name: "affinity DoesNotExist on a label no node has",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("fpga", "DoesNotExist", &[])])]),
                    no_tol(),
                ),
                want: true,
            },
            Case {
                name: "affinity Gt more GPUs than any node has",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("gpu.count", "Gt", &["8"])])]),
                    no_tol(),
                ),
                want: false,
            },
            Case {
                name: "affinity Lt fits the small node only, which is tainted",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("gpu.count", "Lt", &["8"])])]),
                    no_tol(),
                ),
                want: false,
            },
            Case {
                name: "affinity Lt fits the small node, and the pod tolerates its taint",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![req("gpu.count", "Lt", &["8"])])]),
                    tolerate_inference(),
                ),
                want: true,
            },
            Case {
                name: "expressions of a term are ANDed",
                pod: pending(
                    &[],
                    Some(vec![exprs(vec![
                        req("gpu", "In", &["h100"]),
                        req("zone", "In", &["b"]),
                    ])]),
                    tolerate_inference(),
                ),
                want: false,
            },
            Case {
                name: "terms are ORed",
                pod: pending(
                    &[],
                    Some(vec![
                        exprs(vec![req("gpu", "In", &["a100"])]),
                        exprs(vec![req("zone", "In", &["a"])]),
                    ]),
                    no_tol(),
                ),
                want: true,
            },
            Case {
                name: "matchFields naming a pool node",
                pod: pending(
                    &[],
                    Some(vec![fields(vec![req("metadata.name", "In", &["h100-a"])])]),
                    no_tol(),
                ),
                want: true,
            },
            Case {
                name: "matchFields naming a node outside the pool",
                pod: pending(
                    &[],
                    Some(vec![fields(vec![req("metadata.name", "In", &["cpu-1"])])]),
                    no_tol(),
                ),
                want: false,
            },
            Case {
                name: "an empty term matches nothing",
                pod: pending(&[], Some(vec![NodeSelectorTerm::default()]), no_tol()),
                want: false,
            },
            Case {
                name: "no terms at all matches nothing",
                pod: pending(&[], Some(vec![]), no_tol()),
                want: false,
            },
            Case {
                name: "selector and affinity both have to hold",
                pod: pending(
                    &[("gpu", "h100")],
                    Some(vec![exprs(vec![req("zone", "In", &["b"])])]),
                    tolerate_inference(),
                ),
                want: false,
            },
        ];
        for c in cases {
            assert_eq!(demand_pending([&c.pod], &nodes), c.want, "{}", c.name);
        }
    }

    #[test]
    fn only_unscheduled_pending_gpu_pods_count() {
        let nodes = pool_nodes();
        let base = || pending(&[], None, vec![]);
        assert!(demand_pending([&base()], &nodes));
        let mut bound = base();
        if let Some(s) = bound.spec.as_mut() {
            s.node_name = Some("h100-a".into());
        }
        let mut running = base();
        if let Some(s) = running.status.as_mut() {
            s.phase = Some("Running".into());
        }
        let mut leaving = base();
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let mut cpu_only = base();
        if let Some(s) = cpu_only.spec.as_mut() {
            s.containers[0].resources = None;
        }
        for (name, p) in [
            ("bound", bound),
            ("running", running),
            ("being deleted", leaving),
            ("no GPU asked", cpu_only),
        ] {
            assert!(!demand_pending([&p], &nodes), "{name}");
        }
        assert!(!demand_pending([&base()], &[]), "a pool without nodes");
    }

    #[test]
    fn prefer_no_schedule_taints_do_not_keep_pods_off() {
        let soft = node("soft", &[], &[("busy", None, "PreferNoSchedule")]);
        let hard = node("hard", &[], &[("busy", None, "NoExecute")]);
        let p = pending(&[], None, vec![]);
        assert!(could_run_on(&p, &soft));
        assert!(!could_run_on(&p, &hard));
        let p = pending(
            &[],
            None,
            vec![tol(Some("busy"), Some("Exists"), None, None)],
        );
        assert!(could_run_on(&p, &hard));
    }
}
