//! Scale benchmark: N kwok GPU nodes × 8 GPUs, one pool selecting all of them, a fleet
//! simulator writing GpuNode statuses, and the operator binary measured from outside.
//!
//! ```text
//! e2e/cluster up                                       # a control plane with kwok
//! kubectl apply --server-side -f crds/
//! KUBECONFIG=target/e2e/kubeconfig SCALE_NODES=1000 cargo bench -p gpupool-operator --bench scale
//! ```
//!
//! Prints: time from the pool's apply to Ready, and from the last node's report to Ready; API
//! writes per node (the operator's own `gpupool_api_writes_total`); the operator's peak RSS
//! (VmHWM); writes per minute in steady state. Without KUBECONFIG it says so and exits.
//! Environment: `SCALE_NODES` (default 1000), `SCALE_STEADY_SECS` (default 60),
//! `SCALE_TIMEOUT_SECS` (how long to wait for the reports and for Ready; default 600),
//! `GPUPOOL_OPERATOR_BIN` (default: built here with `cargo build -p gpupool-operator --bin
//! gpupool-operator` into `$CARGO_TARGET_DIR/debug/`, never a binary an earlier build left).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use gpupool_crds::testing::healthy_status;
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const LABEL: &str = "bench.gpupool.io/scale";

/// The operator binary: `GPUPOOL_OPERATOR_BIN`, else built now (a no-op when fresh), so the
/// bench never measures a stale binary or depends on an unrelated earlier build.
fn operator_binary() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("GPUPOOL_OPERATOR_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir.join("../target"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--locked",
            "-p",
            "gpupool-operator",
            "--bin",
            "gpupool-operator",
        ])
        .current_dir(&manifest_dir)
        .env("CARGO_TARGET_DIR", &target)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("running cargo build for the operator: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build -p gpupool-operator failed ({status})"));
    }
    let bin = target.join("debug/gpupool-operator");
    if !bin.is_file() {
        return Err(format!("{} was not built", bin.display()));
    }
    Ok(bin)
}
const POOL: &str = "scale-bench";
const PORT: u16 = 19480;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn node(i: u64) -> BoxResult<Node> {
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

async fn metric_sum(name: &str) -> BoxResult<f64> {
    let out = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{PORT}/metrics")])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn ready(pool: &GpuPool) -> bool {
    pool.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

fn status_for(gn: &GpuNode) -> serde_json::Value {
    // The bench pool's layout fits every node, so the fixture reports MIG applied.
    let status = healthy_status(gn);
    json!({ "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuNode", "status": status })
}

/// Removes the bench pool (dropping its finalizer: no operator runs) and its GpuNodes.
async fn clear_stale_pool(pools: &Api<GpuPool>, gpunodes: &Api<GpuNode>) -> BoxResult<()> {
    if pools.get_opt(POOL).await?.is_some() {
        println!("removing the pool {POOL} left by an earlier run");
        pools
            .patch(
                POOL,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "metadata": { "finalizers": null } })),
            )
            .await?;
        let _ = pools.delete(POOL, &DeleteParams::default()).await;
    }
    gpunodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("gpupool.io/pool={POOL}")),
        )
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    // `cargo test --all-targets` runs bench binaries too, without `--bench`: never start a
    // thousand-node run from there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("scale bench: run it with cargo bench -p gpupool-operator --bench scale");
        return Ok(());
    }
    if std::env::var_os("KUBECONFIG").is_none() {
        println!("scale bench: set KUBECONFIG to an e2e cluster (e2e/cluster up) to run it");
        return Ok(());
    }
    let n = env_num("SCALE_NODES", 1000);
    let steady = env_num("SCALE_STEADY_SECS", 60);
    let timeout = Duration::from_secs(env_num("SCALE_TIMEOUT_SECS", 600));
    let client = Client::try_default().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let pools: Api<GpuPool> = Api::all(client.clone());
    let gpunodes: Api<GpuNode> = Api::all(client.clone());

    // A run killed midway leaves its pool behind, finalizer and all, and its status would
    // read as Ready at once: start from nothing.
    clear_stale_pool(&pools, &gpunodes).await?;

    println!("creating {n} kwok nodes × 8 GPUs");
    stream::iter(0..n)
        .map(|i| {
            let nodes = nodes.clone();
            async move {
                match nodes.create(&PostParams::default(), &node(i)?).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                    Err(e) => Err(Box::new(e) as Box<dyn std::error::Error + Send + Sync>),
                }
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;

    let bin = operator_binary()?;
    let mut op = Command::new(&bin)
        .args([
            "--leader-elect",
            "false",
            "--http-addr",
            &format!("127.0.0.1:{PORT}"),
            "--pool-selector",
            &format!("{LABEL}=true"),
            "--log",
            "warn",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", bin.display()))?;
    let pid = op.id();

    let applied = Instant::now();
    let pool = json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "metadata": { "name": POOL, "labels": { LABEL: "true" } },
        "spec": {
            "nodeSelector": { "matchLabels": { LABEL: "true" } },
            "mig": { "strategy": "mixed", "layout": { "preset": "all-1g.10gb" } },
        },
    });
    pools
        .patch(
            POOL,
            &PatchParams::apply("scale-bench").force(),
            &Patch::Apply(&pool),
        )
        .await?;

    // Fleet simulator: report every GpuNode once it exists.
    let lp = ListParams::default().labels(&format!("gpupool.io/pool={POOL}"));
    let mut reported: BTreeMap<String, ()> = BTreeMap::new();
    let deadline = Instant::now() + timeout;
    while (reported.len() as u64) < n && Instant::now() < deadline {
        let list = gpunodes.list(&lp).await?;
        let todo: Vec<GpuNode> = list
            .items
            .into_iter()
            .filter(|g| !reported.contains_key(&g.name_any()))
            .collect();
        if todo.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let names: Vec<String> = todo.iter().map(|g| g.name_any()).collect();
        stream::iter(todo)
            .map(|g| {
                let api = gpunodes.clone();
                async move {
                    api.patch_status(
                        &g.name_any(),
                        &PatchParams::apply("scale-fleet").force(),
                        &Patch::Apply(&status_for(&g)),
                    )
                    .await
                }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<_>>()
            .await?;
        for name in names {
            reported.insert(name, ());
        }
    }
    let last_report = Instant::now();
    let mut became_ready = None;
    while Instant::now() < deadline {
        if ready(&pools.get(POOL).await?) {
            became_ready = Some(Instant::now());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let writes_at_ready = metric_sum("gpupool_api_writes_total").await?;
    tokio::time::sleep(Duration::from_secs(steady)).await;
    let writes_after = metric_sum("gpupool_api_writes_total").await?;
    let reconciles = metric_sum("gpupool_reconciles_total").await?;
    let rss_mib = vm_hwm_kib(pid) as f64 / 1024.0;

    println!(
        "nodes: {n} (8 GPUs each), GpuNodes reported: {}",
        reported.len()
    );
    match became_ready {
        Some(t) => {
            println!("apply → Ready: {:.1} s", (t - applied).as_secs_f64());
            println!(
                "last node report → Ready: {:.1} s",
                t.saturating_duration_since(last_report).as_secs_f64()
            );
        }
        None => println!(
            "the pool did not become Ready within {} s of the apply",
            timeout.as_secs()
        ),
    }
    println!(
        "operator API writes: {writes_at_ready} ({:.2} per node), reconciles: {reconciles}",
        writes_at_ready / n as f64
    );
    println!(
        "steady-state writes: {} in {steady} s ({:.1}/min)",
        writes_after - writes_at_ready,
        (writes_after - writes_at_ready) * 60.0 / steady as f64
    );
    println!("operator peak RSS (VmHWM): {rss_mib:.1} MiB");

    // Clean up: the pool (the operator finalizes it; given as long again as the run had),
    // then the nodes. A pool the operator could not finalize in time is cleared by hand.
    pools.delete(POOL, &DeleteParams::default()).await?;
    let cleanup_deadline = Instant::now() + timeout;
    while pools.get_opt(POOL).await?.is_some() && Instant::now() < cleanup_deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = op.kill();
    let _ = op.wait();
    clear_stale_pool(&pools, &gpunodes).await?;
    nodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("{LABEL}=true")),
        )
        .await?;
    Ok(())
}
