//! The shapes of the scale benches' cluster, shared by `scale` (which creates them on a real API
//! server) and `cache_bytes` (which feeds them to the operator's caches in process): kwok
//! nodes of 8 H100s, a training Job's pods, the pool, and the pods an agent reports on a node's
//! MIG devices.

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

/// The label on everything the benches create.
pub const LABEL: &str = "bench.gpupool.io/scale";
/// The benches' GpuPool.
pub const POOL: &str = "scale-bench";

pub type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The benches' GpuPool: every labelled node, seven `1g.10gb` MIG devices per GPU, strategy
/// mixed.
pub fn pool() -> serde_json::Value {
    json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "metadata": { "name": POOL, "labels": { LABEL: "true" } },
        "spec": {
            "nodeSelector": { "matchLabels": { LABEL: "true" } },
            "mig": { "strategy": "mixed", "layout": { "preset": "all-1g.10gb" } },
        },
    })
}

/// The GPU pods (namespace, name) node `i`'s agent reports on its MIG devices: of its
/// `per_node` pods of the first generation, those that hold a device.
pub fn gpu_holders(i: u64, per_node: u64) -> Vec<(String, String)> {
    (0..per_node)
        .filter(|k| k.is_multiple_of(2))
        .map(|k| (NAMESPACE.to_string(), pod_name(i, k, 0)))
        .collect()
}

/// Kwok node `i`: 8 H100s, labelled as GPU feature discovery labels them.
pub fn node(i: u64) -> BoxResult<Node> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": format!("scale-{i:05}"),
            "annotations": { "kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0" },
            "labels": {
                LABEL: "true",
                "type": "kwok",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": "8",
            },
        },
        "status": {
            "capacity": { "cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8" },
            "allocatable": { "cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8" },
        },
    }))?)
}

/// kwok completes pods at once unless they carry this label (see `e2e/cluster`).
pub const KEEP_RUNNING_LABEL: &str = "e2e.gpupool.io/keep-running";
/// The namespace of the bench's pods.
pub const NAMESPACE: &str = "scale-bench";

/// How many nodes' pods one training Job owns: a Job of 800 pods, as large training runs are.
/// Fewer, larger Jobs also spare the bench's kube-controller-manager: its Job controller looks
/// for an owner of each pod event among all the namespace's Jobs, which at one Job a node kept
/// it at a full core through the 5,000-node run.
pub const NODES_PER_JOB: u64 = 100;

/// Which Job owns node `i`'s pods.
pub fn job_of(i: u64) -> u64 {
    i / NODES_PER_JOB
}

/// Training Job `j`: created suspended, so that it starts no pods of its own; it is there so
/// that its pods' owner exists, as the garbage collector requires.
#[allow(
    dead_code,
    reason = "cache_bytes needs only the Job's UID, not the Job"
)]
pub fn job(j: u64) -> serde_json::Value {
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": { "name": job_name(j), "namespace": NAMESPACE, "labels": { LABEL: "true" } },
        "spec": {
            "suspend": true,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{ "name": "trainer", "image": "nvcr.io/nvidia/pytorch:24.10-py3" }],
                },
            },
        },
    })
}

fn job_name(j: u64) -> String {
    format!("train-{j:03}")
}

/// The name of pod `k` of node `i` in generation `generation`.
pub fn pod_name(i: u64, k: u64, generation: u64) -> String {
    format!("train-{i:05}-{k}-{generation}-x7k2p")
}

/// Pod `k` of node `i` in generation `generation` (churn makes new generations): a pod of the
/// node's training Job ([`job_of`], UID `job_uid`), shaped as a Job controller and the API server's
/// admission leave one (owner reference, labels, env, volumes, a service account token),
/// bound to its node; even `k` hold one 1g.10gb MIG device, odd ones are CPU-only
/// sidecar-style workers, so half the pods hold GPUs. The owner reference is not marked
/// controller, and the controller-uid label is not the Job's: the Job controller of the
/// bench's cluster would otherwise adopt the pods and, its Job suspended, delete them. Neither
/// changes what the operator keeps of a pod.
pub fn pod(i: u64, k: u64, generation: u64, job_uid: &str) -> BoxResult<Pod> {
    let job = job_name(job_of(i));
    let mut limits = json!({ "cpu": "8", "memory": "64Gi" });
    if k.is_multiple_of(2) {
        limits["nvidia.com/mig-1g.10gb"] = json!("1");
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(i, k, generation),
            "namespace": NAMESPACE,
            "ownerReferences": [{
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": job,
                "uid": job_uid,
                "blockOwnerDeletion": true,
            }],
            "labels": {
                LABEL: "true",
                KEEP_RUNNING_LABEL: "true",
                "batch.kubernetes.io/job-name": job,
                "job-name": job,
                "batch.kubernetes.io/controller-uid": format!("0c6f3a52-9d1e-4b7a-8f21-{i:08}{k:02}{generation:02}"),
                "app.kubernetes.io/name": "trainer",
                "team": "research",
            },
            "annotations": { "batch.kubernetes.io/job-tracking": "" },
        },
        "spec": {
            "nodeName": format!("scale-{i:05}"),
            "restartPolicy": "Never",
            "tolerations": [
                { "key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule" },
            ],
            "containers": [{
                "name": "trainer",
                "image": "nvcr.io/nvidia/pytorch:24.10-py3",
                "command": ["torchrun", "--nproc-per-node=1", "/workspace/train.py"],
                "args": ["--config", "/config/run.yaml", "--checkpoint-dir", "/ckpt"],
                "env": [
                    { "name": "NCCL_DEBUG", "value": "WARN" },
                    { "name": "OMP_NUM_THREADS", "value": "8" },
                    { "name": "WANDB_PROJECT", "value": "scale-bench" },
                    { "name": "POD_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } },
                ],
                "resources": { "limits": limits, "requests": limits },
                "volumeMounts": [
                    { "name": "config", "mountPath": "/config" },
                    { "name": "ckpt", "mountPath": "/ckpt" },
                ],
            }],
            "volumes": [
                { "name": "config", "configMap": { "name": "trainer-config" } },
                { "name": "ckpt", "emptyDir": {} },
            ],
        },
    }))?)
}
