//! What the chart's hooks run: `gpupool-operator uninstall` before `helm uninstall` removes the
//! operator, and `gpupool-operator apply-pool` for the chart's default pool.
//!
//! Uninstall deletes the pools while the operator still runs, so each is cleaned up the usual
//! way (its GpuNodes, the `gpupool.io/pool` label and the driver taint go, the finalizer is
//! released), and the agents, whose GpuNodes are gone, take their hardware-fact labels off.
//! What is still there after the timeout (no operator running, an agent that is down) it
//! removes itself, and says so: nothing is left on a finalizer or on a node.
//!
//! The default pool is applied server-side with its own field manager, so an upgrade changes
//! its spec in place: the pool, its status, its GpuNodes and its reclaim history stay.

use std::collections::BTreeSet;
use std::time::Duration;

use gpupool_crds::labels::{OPERATOR_TAINTS, POOL_FINALIZER, POOL_LABEL};
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::controller::{operator_taints, owned_by};
use crate::error::{Error, api_code};

/// Prefix of every label gpupool puts on Nodes (the operator's and the agents').
pub const LABEL_PREFIX: &str = "gpupool.io/";

/// Field manager of the chart's default pool.
pub const DEFAULT_POOL_MANAGER: &str = "gpupool-chart";

/// How `uninstall` runs.
#[derive(Debug, Clone)]
pub struct UninstallOptions {
    /// Only pools matching this label selector (the operator's `--pool-selector`).
    pub pool_selector: Option<String>,
    /// How long the operator and agents get to clean up before this does it itself.
    pub timeout: Duration,
    /// Pause between checks.
    pub poll: Duration,
}

/// What `uninstall` did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UninstallReport {
    /// Pools it deleted.
    pub pools_deleted: Vec<String>,
    /// Pools whose finalizer it had to release itself (the operator did not).
    pub finalizers_released: Vec<String>,
    /// GpuNodes it deleted itself.
    pub gpunodes_deleted: Vec<String>,
    /// Nodes it took labels or the driver taint off itself.
    pub nodes_cleaned: Vec<String>,
}

/// Deletes the pools and waits for the operator and agents to clean up; then removes what
/// is left itself.
pub async fn uninstall(client: Client, opts: &UninstallOptions) -> Result<UninstallReport, Error> {
    let pools: Api<GpuPool> = Api::all(client.clone());
    let mut lp = ListParams::default();
    if let Some(sel) = &opts.pool_selector {
        lp = lp.labels(sel);
    }
    let mut report = UninstallReport::default();
    let listed =
        pools
            .list(&lp)
            .await
            .map_err(Error::kube("list", "gpupools", "listing GpuPools"))?;
    let names: Vec<String> = listed.items.iter().map(ResourceExt::name_any).collect();
    // The nodes these pools hold, read before the pools are deleted: a running operator takes
    // its label off them within moments of the delete, and a node read after that would not
    // count as this release's, its agent labels left behind. With a pool selector (operators
    // sharded by it) only these are this release's; without one every node marked by gpupool is.
    let concerned = if opts.pool_selector.is_some() {
        Some(pool_nodes(&client, &names).await?)
    } else {
        None
    };
    for name in &names {
        match pools.delete(name, &DeleteParams::default()).await {
            Ok(_) => report.pools_deleted.push(name.clone()),
            Err(e) if api_code(&e) == Some(404) => {}
            Err(e) => {
                return Err(Error::kube(
                    "delete",
                    "gpupools",
                    format!("deleting GpuPool {name}"),
                )(e));
            }
        }
    }
    info!(pools = ?report.pools_deleted, "GpuPools deleted; waiting for the operator to clean up");

    let deadline = tokio::time::Instant::now() + opts.timeout;
    let left = loop {
        let left = pools
            .list(&lp)
            .await
            .map_err(Error::kube("list", "gpupools", "listing GpuPools"))?
            .items;
        let left: Vec<GpuPool> = left
            .into_iter()
            .filter(|p| names.contains(&p.name_any()))
            .collect();
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            break left;
        }
        tokio::time::sleep(opts.poll).await;
    };
    for pool in &left {
        release_pool(&client, pool, &mut report).await?;
    }

    // The agents take their labels off once their GpuNode is gone; wait for them too.
    let nodes: Api<Node> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + opts.timeout;
    loop {
        let marked: Vec<Node> = marked_nodes(&nodes)
            .await?
            .into_iter()
            .filter(|n| concerned.as_ref().is_none_or(|c| c.contains(&n.name_any())))
            .collect();
        if marked.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            for node in marked {
                clean_node(&nodes, &node).await?;
                report.nodes_cleaned.push(node.name_any());
            }
            break;
        }
        tokio::time::sleep(opts.poll).await;
    }
    if report.finalizers_released.is_empty() && report.nodes_cleaned.is_empty() {
        info!("uninstall: the operator and agents cleaned up everything");
    } else {
        warn!(
            finalizers = ?report.finalizers_released,
            gpunodes = ?report.gpunodes_deleted,
            nodes = ?report.nodes_cleaned,
            "uninstall: cleaned up what the operator or agents left after {:?}",
            opts.timeout
        );
    }
    Ok(report)
}

/// Does the operator's cleanup for `pool` (its GpuNodes, its nodes' label and taint) and
/// releases the finalizer.
async fn release_pool(
    client: &Client,
    pool: &GpuPool,
    report: &mut UninstallReport,
) -> Result<(), Error> {
    let name = pool.name_any();
    warn!(pool = %name, "the operator did not clean the pool up; doing it here");
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let owned = gpunodes
        .list(&ListParams::default())
        .await
        .map_err(Error::kube("list", "gpunodes", "listing GpuNodes"))?;
    for gn in owned.items {
        if !(owned_by(&gn, pool) || gn.spec.pool == name) {
            continue;
        }
        let gn_name = gn.name_any();
        match gpunodes.delete(&gn_name, &DeleteParams::default()).await {
            Ok(_) => report.gpunodes_deleted.push(gn_name),
            Err(e) if api_code(&e) == Some(404) => {}
            Err(e) => {
                return Err(Error::kube(
                    "delete",
                    "gpunodes",
                    format!("deleting GpuNode {gn_name}"),
                )(e));
            }
        }
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let members = nodes
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await
        .map_err(Error::kube("list", "nodes", "listing the pool's Nodes"))?;
    for node in members.items {
        clean_node(&nodes, &node).await?;
        report.nodes_cleaned.push(node.name_any());
    }
    let finalizers: Vec<String> = pool
        .finalizers()
        .iter()
        .filter(|f| f.as_str() != POOL_FINALIZER)
        .cloned()
        .collect();
    let patch = json!({"metadata": {"finalizers": finalizers}});
    match Api::<GpuPool>::all(client.clone())
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => report.finalizers_released.push(name),
        Err(e) if api_code(&e) == Some(404) => {}
        Err(e) => {
            return Err(Error::kube(
                "patch",
                "gpupools",
                format!("releasing the finalizer of GpuPool {name}"),
            )(e));
        }
    }
    Ok(())
}

/// The nodes the pools `names` hold: labelled with one of them, or with a GpuNode of one.
async fn pool_nodes(client: &Client, names: &[String]) -> Result<BTreeSet<String>, Error> {
    let mut found = BTreeSet::new();
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(Error::kube("list", "nodes", "listing Nodes"))?;
    for node in nodes.items {
        if node
            .labels()
            .get(POOL_LABEL)
            .is_some_and(|p| names.contains(p))
        {
            found.insert(node.name_any());
        }
    }
    let gpunodes = Api::<GpuNode>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(Error::kube("list", "gpunodes", "listing GpuNodes"))?;
    for gn in gpunodes.items {
        if names.contains(&gn.spec.pool) {
            found.insert(gn.name_any());
        }
    }
    Ok(found)
}

/// Nodes with a `gpupool.io/` label or the driver taint.
async fn marked_nodes(nodes: &Api<Node>) -> Result<Vec<Node>, Error> {
    let all = nodes
        .list(&ListParams::default())
        .await
        .map_err(Error::kube("list", "nodes", "listing Nodes"))?;
    Ok(all.items.into_iter().filter(is_marked).collect())
}

/// Whether `node` carries anything of gpupool's.
pub fn is_marked(node: &Node) -> bool {
    node.labels().keys().any(|k| k.starts_with(LABEL_PREFIX))
        || !operator_taints(node_taints(node)).is_empty()
}

fn node_taints(node: &Node) -> &[Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

/// The merge patch that takes gpupool's labels and taint off `node` (`None`: nothing to do).
pub fn cleaning_patch(node: &Node) -> Option<serde_json::Value> {
    if !is_marked(node) {
        return None;
    }
    let labels: serde_json::Map<String, serde_json::Value> = node
        .labels()
        .keys()
        .filter(|k| k.starts_with(LABEL_PREFIX))
        .map(|k| (k.clone(), serde_json::Value::Null))
        .collect();
    let mut patch = json!({"metadata": {"labels": labels}});
    let taints = node_taints(node);
    if !operator_taints(taints).is_empty() {
        let kept: Vec<_> = taints
            .iter()
            .filter(|t| !OPERATOR_TAINTS.contains(&t.key.as_str()))
            .collect();
        patch["spec"] = json!({ "taints": kept });
    }
    Some(patch)
}

async fn clean_node(nodes: &Api<Node>, node: &Node) -> Result<(), Error> {
    let Some(patch) = cleaning_patch(node) else {
        return Ok(());
    };
    let name = node.name_any();
    match nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if api_code(&e) == Some(404) => Ok(()),
        Err(e) => Err(Error::kube(
            "patch",
            "nodes",
            format!("taking gpupool's labels and taint off Node {name}"),
        )(e)),
    }
}

/// Applies `pool` (a whole GpuPool object: name, labels, spec) server-side as the chart's field
/// manager: created if missing, its spec updated in place otherwise.
pub async fn apply_pool(client: Client, pool: &serde_json::Value) -> Result<GpuPool, Error> {
    let name = pool["metadata"]["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Error::MissingField("the default pool".into(), "metadata.name"))?
        .to_owned();
    let mut object = pool.clone();
    object["apiVersion"] = json!("gpupool.io/v1alpha1");
    object["kind"] = json!("GpuPool");
    let api: Api<GpuPool> = Api::all(client);
    let params = PatchParams::apply(DEFAULT_POOL_MANAGER).force();
    api.patch(&name, &params, &Patch::Apply(&object))
        .await
        .map_err(Error::kube(
            "patch",
            "gpupools",
            format!("applying GpuPool {name}"),
        ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_crds::labels::{DRIVER_INVALID_TAINT, MIG_RECONFIGURING_TAINT};
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};

    fn node(labels: &[(&str, &str)], taints: &[&str]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("gpu-0".into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        n.spec = Some(NodeSpec {
            taints: Some(
                taints
                    .iter()
                    .map(|k| Taint {
                        key: (*k).to_owned(),
                        effect: "NoSchedule".into(),
                        ..Taint::default()
                    })
                    .collect(),
            ),
            ..NodeSpec::default()
        });
        n
    }

    #[test]
    fn cleaning_takes_only_gpupools_labels_and_taint() {
        let n = node(
            &[
                ("gpupool.io/pool", "training"),
                ("gpupool.io/gpu.product", "H100"),
                ("nvidia.com/gpu.present", "true"),
                ("gpupool.iox/other", "kept"),
            ],
            &[DRIVER_INVALID_TAINT, "dedicated", MIG_RECONFIGURING_TAINT],
        );
        let patch = cleaning_patch(&n).unwrap();
        assert_eq!(
            patch,
            json!({
                "metadata": {"labels": {"gpupool.io/pool": null, "gpupool.io/gpu.product": null}},
                "spec": {"taints": [{"key": "dedicated", "effect": "NoSchedule"}]},
            })
        );
        // Labels only: the taints are not touched.
        let patch = cleaning_patch(&node(&[("gpupool.io/pool", "a")], &["dedicated"])).unwrap();
        assert!(patch.get("spec").is_none(), "{patch}");
        // A taint only.
        let patch = cleaning_patch(&node(&[], &[DRIVER_INVALID_TAINT])).unwrap();
        assert_eq!(patch["spec"]["taints"], json!([]));
        let patch = cleaning_patch(&node(&[], &[MIG_RECONFIGURING_TAINT])).unwrap();
        assert_eq!(patch["spec"]["taints"], json!([]));
        // Nothing of ours: nothing to do.
        assert_eq!(
            cleaning_patch(&node(&[("nvidia.com/gpu.present", "true")], &["dedicated"])),
            None
        );
    }
}
