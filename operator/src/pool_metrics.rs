//! Pool-level gauges, read from the leader's caches at scrape time: what `kubectl get
//! gpupools` shows, as series an alert can match. Only the leader has the caches, so only the
//! leader exports these; a standby replica shows none.
//!
//! Cardinality: per pool a fixed number of series (conditions × 3 statuses, 3 MIG states,
//! problem reasons); per node of a pool the 5 MIG states. Node and pool names are bounded by
//! the cluster's nodes and pools; no pod name is ever a label.

use std::collections::BTreeMap;
use std::sync::{Mutex, RwLock};

use gpupool_crds::node::MigState;
use gpupool_crds::{GpuNode, GpuPool, GpuPoolStatus};
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::reclaim::HoldReason;

/// The caches the gauges are read from, set while this replica leads.
#[derive(Clone)]
pub struct Caches {
    /// GpuPools.
    pub pools: Store<DeserializeGuard<GpuPool>>,
    /// GpuNodes.
    pub gpunodes: crate::store::Store<GpuNode>,
}

/// What the pool collector reads.
#[derive(Default)]
pub struct PoolView {
    caches: RwLock<Option<Caches>>,
    /// Pods held in each pool's last reclaim pass, by reason.
    holds: Mutex<BTreeMap<String, BTreeMap<HoldReason, u32>>>,
}

impl std::fmt::Debug for PoolView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolView").finish_non_exhaustive()
    }
}

impl PoolView {
    /// Starts (`Some`) or stops (`None`) exporting from these caches.
    pub fn set_caches(&self, caches: Option<Caches>) {
        *self.caches.write().unwrap_or_else(|e| e.into_inner()) = caches;
    }

    /// Records the holds of `pool`'s last reclaim pass.
    pub fn set_holds(&self, pool: &str, holds: BTreeMap<HoldReason, u32>) {
        self.holds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pool.to_owned(), holds);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabels {
    pool: String,
    condition: String,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    pool: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    pool: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeStateLabels {
    pool: String,
    node: String,
    state: &'static str,
}

/// The `state` label of a MIG state, as the GpuNode status spells it.
fn mig_state_label(state: MigState) -> &'static str {
    match state {
        MigState::Idle => "Idle",
        MigState::Draining => "Draining",
        MigState::Applying => "Applying",
        MigState::Applied => "Applied",
        MigState::Failed => "Failed",
    }
}

/// One gauge family from `samples`.
fn gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, i64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The pools with a status, by name.
fn statuses(pools: &Store<DeserializeGuard<GpuPool>>) -> Vec<(String, GpuPoolStatus)> {
    let mut out: Vec<(String, GpuPoolStatus)> = pools
        .state()
        .iter()
        .filter_map(|p| {
            let pool = p.0.as_ref().ok()?;
            Some((pool.name_any(), pool.status.clone()?))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Encodes the pool gauges from the caches, when this replica has them.
pub struct PoolCollector(pub std::sync::Arc<PoolView>);

impl std::fmt::Debug for PoolCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolCollector")
    }
}

impl Collector for PoolCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let caches = self
            .0
            .caches
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(caches) = caches else {
            return Ok(());
        };
        let pools = statuses(&caches.pools);
        let pool = |name: &String| PoolLabels { pool: name.clone() };
        let each = |f: fn(&GpuPoolStatus) -> u32| {
            pools
                .iter()
                .map(move |(n, s)| (pool(n), i64::from(f(s))))
                .collect::<Vec<_>>()
        };
        gauges(
            &mut encoder,
            "gpupool_pool_selected_nodes",
            "Nodes the pool's selector matches",
            each(|s| s.selected_nodes),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_ready_nodes",
            "Nodes of the pool that are ready for GPU work",
            each(|s| s.ready_nodes),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_gpus",
            "GPUs on the pool's nodes",
            each(|s| s.gpus.total),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_gpus_healthy",
            "GPUs of the pool with no health fault",
            each(|s| s.gpus.healthy),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_mig_pods_to_drain",
            "GPU pods that must leave before the pool's MIG layout can be applied",
            each(|s| s.mig.pods_to_drain),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_reclaim_warned_pods",
            "Pods the reclaimer has warned and not yet acted on",
            each(|s| s.reclaim.warned),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_mig_nodes",
            "The pool's nodes by MIG layout state (applied, pending, failed)",
            pools.iter().flat_map(|(n, s)| {
                [
                    ("applied", s.mig.applied),
                    ("pending", s.mig.pending),
                    ("failed", s.mig.failed),
                ]
                .map(|(state, v)| {
                    (
                        StateLabels {
                            pool: n.clone(),
                            state,
                        },
                        i64::from(v),
                    )
                })
            }),
        )?;
        gauges(
            &mut encoder,
            "gpupool_pool_condition",
            "1 for the status each pool condition has (kube-state-metrics style: one series per status)",
            pools.iter().flat_map(|(n, s)| {
                s.conditions.iter().flat_map(move |c| {
                    ["True", "False", "Unknown"].map(|status| {
                        (
                            ConditionLabels {
                                pool: n.clone(),
                                condition: c.type_.clone(),
                                status,
                            },
                            i64::from(c.status == status),
                        )
                    })
                })
            }),
        )?;
        let mut problems: BTreeMap<(String, String), i64> = BTreeMap::new();
        for (n, s) in &pools {
            for p in &s.problems {
                *problems.entry((n.clone(), p.reason.clone())).or_default() += 1;
            }
        }
        gauges(
            &mut encoder,
            "gpupool_pool_node_problems",
            "Per-node problems the pool reports, by reason (status.problems)",
            problems
                .into_iter()
                .map(|((pool, reason), v)| (ReasonLabels { pool, reason }, v)),
        )?;
        let holds = self
            .0
            .holds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        gauges(
            &mut encoder,
            "gpupool_reclaim_held_pods",
            "Pods the reclaimer's last pass held (could not decide on), by reason",
            holds
                .iter()
                .filter(|(p, _)| pools.iter().any(|(n, _)| n == *p))
                .flat_map(|(p, by)| {
                    by.iter().map(|(r, v)| {
                        (
                            ReasonLabels {
                                pool: p.clone(),
                                reason: r.label().to_owned(),
                            },
                            i64::from(*v),
                        )
                    })
                }),
        )?;
        let mut nodes: Vec<(String, String, MigState)> = caches
            .gpunodes
            .state()
            .iter()
            .map(|gn| {
                let state = gn.status.as_ref().map(|s| s.mig.state).unwrap_or_default();
                (gn.spec.pool.clone(), gn.name_any(), state)
            })
            .collect();
        nodes.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        // One series a node, for the state it is in: the other four, each 0, would make five
        // series a node (25,000 at 5,000 nodes, 2 MB of text a scrape) to say the same.
        gauges(
            &mut encoder,
            "gpupool_node_mig_state",
            "1 for each GpuNode, labelled with the MIG state it reports",
            nodes.iter().map(|(pool, node, current)| {
                (
                    NodeStateLabels {
                        pool: pool.clone(),
                        node: node.clone(),
                        state: mig_state_label(*current),
                    },
                    1,
                )
            }),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpupool_crds::node::{GpuNodeStatus, NodeMigStatus};
    use gpupool_crds::pool::NodeProblem;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;
    use prometheus_client::registry::Registry;

    use super::*;

    fn lines(view: &Arc<PoolView>) -> Vec<String> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(PoolCollector(view.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn pool_status_becomes_gauges_only_while_leading() {
        let (pools, mut pool_writer) = reflector::store::<DeserializeGuard<GpuPool>>();
        let (gpunodes, mut gn_writer) = crate::store::store::<GpuNode>();
        let mut pool: GpuPool =
            serde_json::from_value(serde_json::json!({"apiVersion": "gpupool.io/v1alpha1",
                "kind": "GpuPool", "metadata": {"name": "training"},
                "spec": {"nodeSelector": {}}}))
            .unwrap();
        let mut status = GpuPoolStatus {
            selected_nodes: 2,
            ready_nodes: 1,
            ..Default::default()
        };
        status.gpus.total = 16;
        status.gpus.healthy = 15;
        status.mig.pending = 1;
        status.conditions = vec![Condition {
            type_: "Ready".into(),
            status: "False".into(),
            reason: "NodesNotReady".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
        }];
        status.problems = vec![
            NodeProblem {
                node: "a".into(),
                reason: "DriverCheckFailed".into(),
                message: String::new(),
            },
            NodeProblem {
                node: "b".into(),
                reason: "DriverCheckFailed".into(),
                message: String::new(),
            },
        ];
        pool.status = Some(status);
        let value = serde_json::to_value(&pool).unwrap();
        pool_writer.apply_watcher_event(&Event::Apply(serde_json::from_value(value).unwrap()));
        let mut gn = GpuNode::new(
            "a",
            serde_json::from_value(serde_json::json!({"pool": "training"})).unwrap(),
        );
        gn.status = Some(GpuNodeStatus {
            mig: NodeMigStatus {
                state: MigState::Draining,
                ..Default::default()
            },
            ..Default::default()
        });
        gn_writer.apply_watcher_event(&Event::Apply(gn));

        let view = Arc::new(PoolView::default());
        assert!(lines(&view).is_empty(), "a standby exports no pool series");
        view.set_caches(Some(Caches { pools, gpunodes }));
        view.set_holds("training", BTreeMap::from([(HoldReason::StaleData, 2)]));
        view.set_holds("gone", BTreeMap::from([(HoldReason::NoDevices, 1)]));
        let got = lines(&view);
        for want in [
            r#"gpupool_pool_selected_nodes{pool="training"} 2"#,
            r#"gpupool_pool_ready_nodes{pool="training"} 1"#,
            r#"gpupool_pool_gpus{pool="training"} 16"#,
            r#"gpupool_pool_gpus_healthy{pool="training"} 15"#,
            r#"gpupool_pool_mig_nodes{pool="training",state="pending"} 1"#,
            r#"gpupool_pool_mig_nodes{pool="training",state="failed"} 0"#,
            r#"gpupool_pool_condition{pool="training",condition="Ready",status="True"} 0"#,
            r#"gpupool_pool_condition{pool="training",condition="Ready",status="False"} 1"#,
            r#"gpupool_pool_node_problems{pool="training",reason="DriverCheckFailed"} 2"#,
            r#"gpupool_reclaim_held_pods{pool="training",reason="StaleData"} 2"#,
            r#"gpupool_node_mig_state{pool="training",node="a",state="Draining"} 1"#,
        ] {
            assert!(got.iter().any(|l| l == want), "no {want} in {got:#?}");
        }
        let node_a: Vec<_> = got
            .iter()
            .filter(|l| l.starts_with(r#"gpupool_node_mig_state{pool="training",node="a","#))
            .collect();
        assert_eq!(
            node_a.len(),
            1,
            "one series a node, its state's: {node_a:#?}"
        );
        assert!(
            !got.iter().any(|l| l.contains("gone")),
            "holds of a pool that is gone are dropped: {got:#?}"
        );
        view.set_caches(None);
        assert!(lines(&view).is_empty(), "losing the lead stops the export");
    }

    #[test]
    fn mig_state_labels_are_spelt_as_the_status_spells_them() {
        use MigState::*;
        for state in [Idle, Draining, Applying, Applied, Failed] {
            assert_eq!(
                serde_json::to_value(state).unwrap(),
                serde_json::json!(mig_state_label(state))
            );
        }
    }
}
