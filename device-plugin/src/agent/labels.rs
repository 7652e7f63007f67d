//! The hardware-fact labels the agent owns on its Node (GPU count, product, memory, driver,
//! MIG capability), applied with server-side apply when they change.

use std::collections::BTreeMap;

use gpupool_crds::labels;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use super::FIELD_MANAGER;
use crate::inventory::Inventory;

/// A label value from free text: characters outside `[A-Za-z0-9._-]` become `-`, trimmed to
/// 63 characters and to alphanumeric ends.
pub fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// The hardware-fact labels the agent owns on its Node.
pub fn node_labels(inventory: &Inventory) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    out.insert(
        labels::COUNT_LABEL.to_owned(),
        inventory.gpus.len().to_string(),
    );
    out.insert(
        labels::DRIVER_LABEL.to_owned(),
        label_value(&inventory.driver.driver_version),
    );
    if let Some(first) = inventory.gpus.first() {
        out.insert(
            labels::PRODUCT_LABEL.to_owned(),
            label_value(&first.device.name),
        );
        out.insert(
            labels::MEMORY_LABEL.to_owned(),
            first.device.memory_mib.to_string(),
        );
    }
    let capable = !inventory.gpus.is_empty() && inventory.gpus.iter().all(|g| g.device.mig_capable);
    out.insert(labels::MIG_CAPABLE_LABEL.to_owned(), capable.to_string());
    out
}

/// Applies [`node_labels`] to the agent's Node, only when they differ from what was applied.
pub struct NodeLabeler {
    nodes: Api<Node>,
    node_name: String,
    applied: Option<BTreeMap<String, String>>,
}

impl NodeLabeler {
    /// A labeler for Node `node_name`.
    pub fn new(client: Client, node_name: String) -> NodeLabeler {
        NodeLabeler {
            nodes: Api::all(client),
            node_name,
            applied: None,
        }
    }

    /// Applies the labels `inventory` calls for, unless they are the ones last applied. A failed
    /// write is logged and tried again next time.
    pub async fn apply(&mut self, inventory: &Inventory) {
        self.write(node_labels(inventory)).await;
    }

    /// Takes the agent's labels off the Node (its GpuNode is gone: the node left every pool,
    /// or gpupool is being uninstalled). An apply with no labels releases the ones this field
    /// manager owned, and the API server removes them; labels others set stay.
    pub async fn clear(&mut self) {
        self.write(BTreeMap::new()).await;
    }

    async fn write(&mut self, labels: BTreeMap<String, String>) {
        if self.applied.as_ref() == Some(&labels) {
            return;
        }
        let patch = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": self.node_name, "labels": labels },
        });
        match self
            .nodes
            .patch(
                &self.node_name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => self.applied = Some(labels),
            Err(e) => tracing::warn!(error = %e, "labelling the Node"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::testing::{ApiMock, Expect, inventory};

    #[test]
    fn label_values_are_valid() {
        assert_eq!(
            label_value("NVIDIA H100 80GB HBM3"),
            "NVIDIA-H100-80GB-HBM3"
        );
        assert_eq!(label_value("550.54.15"), "550.54.15");
        assert_eq!(label_value(" (x) "), "x");
        assert_eq!(label_value(&"a".repeat(80)).len(), 63);
    }

    #[tokio::test]
    async fn labels_are_applied_once_and_again_after_a_failed_write() {
        let (client, mock) = ApiMock::new();
        let apply = |status| Expect {
            method: "PATCH",
            path: "/api/v1/nodes/node-a",
            query: &["fieldManager=gpupool-agent", "force=true"],
            status,
            check: Box::new(|body: &serde_json::Value| {
                let labels = &body["metadata"]["labels"];
                assert_eq!(labels["gpupool.io/gpu.count"], "2", "{body}");
                assert_eq!(labels["gpupool.io/gpu.product"], "NVIDIA-A30", "{body}");
                assert_eq!(labels["gpupool.io/mig.capable"], "false", "{body}");
            }),
            reply: Some(serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": { "name": "node-a" },
            })),
        };
        let server = mock.serve(vec![apply(500), apply(200)]);
        let mut labeler = NodeLabeler::new(client, "node-a".into());
        let inv = inventory();
        labeler.apply(&inv).await; // refused: not remembered
        labeler.apply(&inv).await; // applied
        labeler.apply(&inv).await; // unchanged: no request
        drop(labeler);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn clearing_applies_no_labels_once() {
        let (client, mock) = ApiMock::new();
        let apply = |count: Option<&'static str>| Expect {
            method: "PATCH",
            path: "/api/v1/nodes/node-a",
            query: &["fieldManager=gpupool-agent", "force=true"],
            status: 200,
            check: Box::new(move |body: &serde_json::Value| {
                let labels = &body["metadata"]["labels"];
                match count {
                    Some(c) => assert_eq!(labels["gpupool.io/gpu.count"], c, "{body}"),
                    // Owned labels left out of an apply are removed by the API server.
                    None => assert_eq!(labels, &serde_json::json!({}), "{body}"),
                }
            }),
            reply: Some(serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": { "name": "node-a" },
            })),
        };
        let server = mock.serve(vec![apply(Some("2")), apply(None), apply(Some("2"))]);
        let mut labeler = NodeLabeler::new(client, "node-a".into());
        let inv = inventory();
        labeler.apply(&inv).await;
        labeler.clear().await;
        labeler.clear().await; // already cleared: no request
        labeler.apply(&inv).await; // back in a pool: labelled again
        drop(labeler);
        server.await.unwrap();
    }
}
