//! Pool membership (pure): which of the nodes a pool's selector matches it owns, and which
//! belong to older pools. The controller reads the stores and hands their contents in.

use std::sync::Arc;

use gpupool_crds::GpuPool;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;

use crate::pool::{self, ConflictingNode};

/// What [`plan_membership`] found: owned nodes and conflicts.
pub struct Membership {
    /// Nodes this pool owns, sorted by name.
    pub members: Vec<Arc<Node>>,
    /// Nodes matched here that older pools own.
    pub conflicts: Vec<ConflictingNode>,
}

/// Splits the nodes the pool matches into owned and conflicting (pure over the stores).
pub fn plan_membership(pool: &GpuPool, pools: &[Arc<GpuPool>], nodes: &[Arc<Node>]) -> Membership {
    let mut members = Vec::new();
    let mut conflicts = Vec::new();
    let uid = pool.uid();
    for node in nodes {
        let labels = node.labels();
        if !pool::matches(pool, labels) {
            continue;
        }
        let candidates = pools
            .iter()
            .map(|p| p.as_ref())
            .filter(|p| p.uid() != uid)
            .chain(std::iter::once(pool));
        match pool::owner_of(labels, candidates) {
            Some(owner) if owner.uid() == uid => members.push(node.clone()),
            Some(owner) => conflicts.push(ConflictingNode {
                node: node.name_any(),
                owner: owner.name_any(),
            }),
            None => {}
        }
    }
    members.sort_by_key(|n| n.name_any());
    conflicts.sort();
    Membership { members, conflicts }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::tests::{labels, pool};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn node(name: &str, kv: &[(&str, &str)]) -> Arc<Node> {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(labels(kv));
        Arc::new(n)
    }

    fn names(nodes: &[Arc<Node>]) -> Vec<String> {
        nodes.iter().map(|n| n.name_any()).collect()
    }

    #[test]
    fn matched_nodes_split_into_owned_and_held_by_older_pools() {
        let old = Arc::new(pool("old", "2026-01-01T00:00:00Z", &[("team", "x")]));
        let young = Arc::new(pool("young", "2026-01-02T00:00:00Z", &[("gpu", "true")]));
        // Listed out of order: members come back sorted by name.
        let nodes = [
            node("n3", &[("gpu", "true")]),
            node("n1", &[("team", "x"), ("gpu", "true")]),
            node("n2", &[("gpu", "true")]),
            node("n4", &[("team", "z")]),
        ];
        struct Case<'a> {
            name: &'a str,
            pool: &'a GpuPool,
            pools: Vec<Arc<GpuPool>>,
            members: &'a [&'a str],
            conflicts: Vec<ConflictingNode>,
        }
        let held_by_old = || {
            vec![ConflictingNode {
                node: "n1".into(),
                owner: "old".into(),
            }]
        };
        let cases = [
            Case {
                name: "the older pool owns the shared node",
                pool: &old,
                pools: vec![old.clone(), young.clone()],
                members: &["n1"],
                conflicts: vec![],
            },
            Case {
                name: "the younger pool reports it as a conflict",
                pool: &young,
                pools: vec![old.clone(), young.clone()],
                members: &["n2", "n3"],
                conflicts: held_by_old(),
            },
            Case {
                name: "a pool not in the store yet still counts itself",
                pool: &young,
                pools: vec![old.clone()],
                members: &["n2", "n3"],
                conflicts: held_by_old(),
            },
            Case {
                name: "alone, the younger pool owns everything it matches",
                pool: &young,
                pools: vec![young.clone()],
                members: &["n1", "n2", "n3"],
                conflicts: vec![],
            },
        ];
        for c in cases {
            let got = plan_membership(c.pool, &c.pools, &nodes);
            assert_eq!(names(&got.members), c.members, "{}", c.name);
            assert_eq!(got.conflicts, c.conflicts, "{}", c.name);
        }
    }

    #[test]
    fn an_unusable_selector_matches_nothing() {
        let mut bad = pool("bad", "2026-01-01T00:00:00Z", &[("team", "x")]);
        bad.spec.node_selector.match_expressions = Some(vec![LabelSelectorRequirement {
            key: "team".into(),
            operator: "Resembles".into(),
            values: Some(vec!["x".into()]),
        }]);
        assert!(pool::selector(&bad).is_err());
        let got = plan_membership(&bad, &[], &[node("n1", &[("team", "x")])]);
        assert!(got.members.is_empty() && got.conflicts.is_empty());
    }
}
