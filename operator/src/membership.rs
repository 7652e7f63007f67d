//! Pool membership (pure): which of the nodes a pool's selector matches it owns, and which it
//! shares with other pools' selectors (held here, or held there). The controller reads the stores and hands their contents in.

use std::sync::Arc;

use gpupool_crds::GpuPool;
use kube::ResourceExt;

use crate::cache::CachedNode;
use crate::pool::{self, ConflictingNode};

/// What [`plan_membership`] found: owned nodes and conflicts.
pub struct Membership {
    /// Nodes this pool owns, sorted by name.
    pub members: Vec<Arc<CachedNode>>,
    /// Nodes matched here that other pools match too, held here or there.
    pub conflicts: Vec<ConflictingNode>,
}

/// Splits the nodes the pool matches into owned and conflicting (pure over the stores); see
/// [`pool::owner_of`] for who holds a node two pools match.
pub fn plan_membership(
    pool: &GpuPool,
    pools: &[Arc<GpuPool>],
    nodes: &[Arc<CachedNode>],
) -> Membership {
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
            Some(owner) if owner.uid() == uid => {
                members.push(node.clone());
                // Held here, and matched by others too: both sides say so.
                for other in pools
                    .iter()
                    .filter(|p| p.uid() != uid && pool::matches(p, labels))
                {
                    conflicts.push(ConflictingNode {
                        node: node.name_any(),
                        other: other.name_any(),
                        held_here: true,
                    });
                }
            }
            Some(owner) => conflicts.push(ConflictingNode {
                node: node.name_any(),
                other: owner.name_any(),
                held_here: false,
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
    use gpupool_crds::labels::POOL_LABEL;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn node(name: &str, kv: &[(&str, &str)]) -> Arc<CachedNode> {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(labels(kv));
        Arc::new(n.into())
    }

    fn names(nodes: &[Arc<CachedNode>]) -> Vec<String> {
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
                other: "old".into(),
                held_here: false,
            }]
        };
        let cases = [
            Case {
                name: "the older pool owns the shared node, and says the younger matches it too",
                pool: &old,
                pools: vec![old.clone(), young.clone()],
                members: &["n1"],
                conflicts: vec![ConflictingNode {
                    node: "n1".into(),
                    other: "young".into(),
                    held_here: true,
                }],
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

    /// An older pool whose selector widens over a node a younger pool holds does not take it
    /// (no re-layout, no drain): the holder keeps it and both report the overlap.
    #[test]
    fn a_held_node_stays_with_its_pool_when_an_older_selector_widens() {
        let old = Arc::new(pool("old", "2026-01-01T00:00:00Z", &[("gpu", "true")]));
        let young = Arc::new(pool("young", "2026-01-02T00:00:00Z", &[("team", "y")]));
        let held = node(
            "n1",
            &[("gpu", "true"), ("team", "y"), (POOL_LABEL, "young")],
        );
        let free = node("n2", &[("gpu", "true"), ("team", "y")]);
        let pools = vec![old.clone(), young.clone()];
        let nodes = [held, free];
        let young_view = plan_membership(&young, &pools, &nodes);
        assert_eq!(names(&young_view.members), ["n1"]);
        assert_eq!(
            young_view.conflicts,
            [
                ConflictingNode {
                    node: "n1".into(),
                    other: "old".into(),
                    held_here: true,
                },
                ConflictingNode {
                    node: "n2".into(),
                    other: "old".into(),
                    held_here: false,
                },
            ]
        );
        let old_view = plan_membership(&old, &pools, &nodes);
        assert_eq!(
            names(&old_view.members),
            ["n2"],
            "an unheld node goes to the oldest"
        );
        assert_eq!(
            old_view.conflicts,
            [
                ConflictingNode {
                    node: "n1".into(),
                    other: "young".into(),
                    held_here: false,
                },
                ConflictingNode {
                    node: "n2".into(),
                    other: "young".into(),
                    held_here: true,
                },
            ]
        );
        // Once the holder no longer matches the node, its label does not keep it.
        let moved = node("n1", &[("gpu", "true"), (POOL_LABEL, "young")]);
        let got = plan_membership(&old, &pools, &[moved]);
        assert_eq!(names(&got.members), ["n1"]);
        assert!(got.conflicts.is_empty());
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
