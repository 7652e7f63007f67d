//! Scale benchmark: N kwok GPU nodes × 8 GPUs with their pods, one pool selecting all of them,
//! a fleet simulator writing GpuNode statuses as agents do (a full report once, then a
//! `heartbeatTime` stamp every minute), and the operator (a release build) measured from
//! outside.
//!
//! ```text
//! e2e/cluster up --nodes 0                             # a control plane with kwok
//! kubectl apply --server-side -f crds/
//! KUBECONFIG=target/e2e/kubeconfig SCALE_NODES=1000 cargo bench -p gpupool-operator --bench scale
//! ```
//!
//! Each node gets `SCALE_PODS_PER_NODE` (default 8) running pods, every other one holding a
//! `1g.10gb` MIG device; the agents' reports list 8 H100s × seven MIG devices and the pods on
//! them. During the steady state (`SCALE_STEADY_SECS`, default 60) `SCALE_CHURN_PER_SEC`
//! (default 10) pods a second are replaced.
//!
//! Prints: time from the pool's apply to Ready, and from the last node's report to Ready; API
//! writes per node (the operator's own `gpupool_api_writes_total`); reconcile duration p50 and
//! p99 (from its histogram); the operator's peak (VmHWM) and end (VmRSS) resident memory, and
//! its peak after the initial lists of pods and nodes, before the pool is applied; writes per
//! minute in steady state; then the operator is restarted into the full cluster, as an upgrade
//! or a new leader would be, once per way of listing (`--initial-list`), and its peak after the
//! initial lists (every pod, node and reported GpuNode) and by its first reconcile is printed. Without KUBECONFIG it says so and exits.
//! Environment also: `SCALE_NODES` (default 1000), `SCALE_TIMEOUT_SECS` (how long to wait for
//! the reports and for Ready; default 600; give 5,000 nodes 1500), `SCALE_DHAT=1` (build the
//! operator with dhat's heap profiler; the profile lands in `$CARGO_TARGET_DIR/dhat-heap.json`),
//! `GPUPOOL_OPERATOR_BIN` (default: `cargo build --release` of the operator, never a binary an
//! earlier build left), `SCALE_OPERATOR_LOG` (the operator's `--log`, default `warn`; its log
//! goes to the bench's stderr), `SCALE_INITIAL_LIST` (its `--initial-list` at the first start,
//! default `paged`), `SCALE_RESTART_LISTS` (the restarts' `--initial-list`s, comma-separated,
//! default `paged,cache,streaming`; empty for no restart). While it waits for Ready the bench prints the pool's Ready
//! condition once a minute, and the last one seen if Ready never comes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use gpupool_crds::testing::mig_node_status;
use gpupool_crds::{GpuNode, GpuPool};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use shapes::{
    BoxResult, LABEL, NAMESPACE, NODES_PER_JOB, POOL, gpu_holders, job_of, node, pod, pod_name,
};

mod shapes;

/// The operator binary: `GPUPOOL_OPERATOR_BIN`, else a release build made now (a no-op when
/// fresh), so the bench never measures a stale or unoptimized binary. `SCALE_DHAT=1` builds it
/// with dhat's heap profiler, which writes `dhat-heap.json` when the operator exits.
fn operator_binary() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("GPUPOOL_OPERATOR_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = target_dir();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut args = vec![
        "build",
        "--locked",
        "--release",
        "-p",
        "gpupool-operator",
        "--bin",
        "gpupool-operator",
    ];
    if dhat_wanted() {
        args.extend(["--features", "dhat-heap"]);
    }
    let status = Command::new(cargo)
        .args(&args)
        .current_dir(&manifest_dir)
        .env("CARGO_TARGET_DIR", &target)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("running cargo build for the operator: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build -p gpupool-operator failed ({status})"));
    }
    let bin = target.join("release/gpupool-operator");
    if !bin.is_file() {
        return Err(format!("{} was not built", bin.display()));
    }
    Ok(bin)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// Where a dhat build of the operator writes its heap profile.
fn dhat_file() -> PathBuf {
    target_dir().join("dhat-heap.json")
}

fn dhat_wanted() -> bool {
    std::env::var("SCALE_DHAT").is_ok_and(|v| v == "1")
}

const PORT: u16 = 19480;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Creates `pods` with 32 requests in flight; an existing pod counts as created. The first
/// requests of a new namespace may meet its default ServiceAccount missing: retried.
async fn create_pods(api: &Api<Pod>, pods: Vec<Pod>) -> BoxResult<()> {
    stream::iter(pods)
        .map(|p| {
            let api = api.clone();
            async move {
                for attempt in 0..50 {
                    match api.create(&PostParams::default(), &p).await {
                        Ok(_) => return Ok(()),
                        Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
                        Err(kube::Error::Api(s))
                            if s.message.contains("serviceaccount") && attempt < 49 =>
                        {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => {
                            return Err(Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
                        }
                    }
                }
                Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Creates the Jobs that own `nodes` nodes' pods, 32 requests in flight, and returns their
/// UIDs in order; a Job that exists already is read back.
async fn create_jobs(api: &Api<Job>, nodes: u64) -> BoxResult<Vec<String>> {
    stream::iter(0..nodes.div_ceil(NODES_PER_JOB))
        .map(|j| {
            let api = api.clone();
            async move {
                let job: Job = serde_json::from_value(shapes::job(j))?;
                let made = match api.create(&PostParams::default(), &job).await {
                    Ok(made) => made,
                    Err(kube::Error::Api(s)) if s.code == 409 => api.get(&job.name_any()).await?,
                    Err(e) => return Err(e.into()),
                };
                made.uid()
                    .ok_or_else(|| format!("Job {} has no UID", job.name_any()).into())
            }
        })
        .buffered(32)
        .try_collect()
        .await
}

/// The UID of the Job that owns node `i`'s pods.
fn job_uid(uids: &[String], i: u64) -> BoxResult<&str> {
    usize::try_from(job_of(i))
        .ok()
        .and_then(|j| uids.get(j))
        .map(String::as_str)
        .ok_or_else(|| format!("no Job for node {i}").into())
}

/// Replaces `per_sec` pods a second for `secs` seconds, cycling over the nodes: each step
/// deletes one generation's pod and creates the next generation's in its place. Returns the
/// pods replaced.
async fn churn(
    api: &Api<Pod>,
    job_uids: &[String],
    nodes: u64,
    per_node: u64,
    per_sec: u64,
    secs: u64,
) -> BoxResult<u64> {
    let slots = nodes * per_node;
    let mut next = 0u64;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    for _ in 0..secs {
        tick.tick().await;
        let batch: Vec<u64> = (next..next + per_sec.min(slots)).collect();
        next += batch.len() as u64;
        let mut fresh = Vec::with_capacity(batch.len());
        for &slot in &batch {
            let (i, k) = ((slot % slots) / per_node, (slot % slots) % per_node);
            let generation = slot / slots;
            let old = pod_name(i, k, generation);
            let _ = api
                .delete(&old, &DeleteParams::default().grace_period(0))
                .await;
            fresh.push(pod(i, k, generation + 1, job_uid(job_uids, i)?)?);
        }
        create_pods(api, fresh).await?;
    }
    Ok(next)
}

/// `q` (0..1) of a Prometheus histogram read from the operator's /metrics, interpolated
/// within its bucket as Prometheus' `histogram_quantile` does.
async fn histogram_quantile(name: &str, q: f64) -> BoxResult<Option<f64>> {
    let text = scrape()?;
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(_, total)) = buckets.last() else {
        return Ok(None);
    };
    if total == 0.0 {
        return Ok(None);
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for (le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Ok(Some(lower));
            }
            let within = if count > below {
                (rank - below) / (count - below)
            } else {
                1.0
            };
            return Ok(Some(lower + (le - lower) * within));
        }
        (lower, below) = (le, count);
    }
    Ok(None)
}

/// Bytes in a MiB, for printing byte counts read from the operator's metrics.
const MIB: f64 = 1024.0 * 1024.0;

fn vm_rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// The operator's /metrics page.
fn scrape() -> BoxResult<String> {
    let out = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{PORT}/metrics")])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn metric_sum(name: &str) -> BoxResult<f64> {
    let text = scrape()?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// Waits until the operator's peak RSS has not grown for [`SETTLED_FOR`] (its initial lists of
/// the cluster's pods and nodes are done), at most [`SETTLE_MAX`]; how long that took and the
/// peak then. The pool is applied after this, so the figure parts what the lists cost from what
/// the pool's reports and reconciles cost.
async fn settle(pid: u32) -> (Duration, u64) {
    let start = Instant::now();
    let (mut hwm, mut since) = (vm_hwm_kib(pid), Instant::now());
    while start.elapsed() < SETTLE_MAX && since.elapsed() < SETTLED_FOR {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = vm_hwm_kib(pid);
        if now != hwm {
            (hwm, since) = (now, Instant::now());
        }
    }
    (start.elapsed(), hwm)
}

const SETTLED_FOR: Duration = Duration::from_secs(10);
const SETTLE_MAX: Duration = Duration::from_secs(120);

fn vm_hwm_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:")
}

/// A `kB` field of /proc/<pid>/status; 0 when the process or the field is gone.
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
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

/// How often the wait for Ready says where the pool stands.
const PROGRESS_EVERY: Duration = Duration::from_secs(60);

/// The pool's Ready condition and first problems, cut short, for a run that waits or gives up.
fn ready_summary(pool: &GpuPool) -> String {
    let Some(s) = &pool.status else {
        return "no status".into();
    };
    let cut = |t: &str| t.chars().take(300).collect::<String>();
    let ready = s
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map_or("no Ready condition".into(), |c| {
            format!("Ready={} {}: {}", c.status, c.reason, cut(&c.message))
        });
    let problems: Vec<String> = s
        .problems
        .iter()
        .take(3)
        .map(|p| format!("{} {}: {}", p.node, p.reason, cut(&p.message)))
        .collect();
    format!(
        "{ready}; ready nodes {}/{}; mig {}/{} applied, {} pending; problems: [{}]",
        s.ready_nodes,
        s.selected_nodes,
        s.mig.applied,
        s.selected_nodes,
        s.mig.pending,
        problems.join("; ")
    )
}

/// What the node's agent reports: 8 GPUs × seven 1g.10gb MIG devices, the node's GPU pods on
/// them (`per_node` pods, every other one holding a device).
fn status_for(gn: &GpuNode, per_node: u64) -> serde_json::Value {
    // The bench pool's layout fits every node, so the fixture reports MIG applied.
    let i: u64 = gn
        .name_any()
        .trim_start_matches("scale-")
        .parse()
        .unwrap_or_default();
    let mut status = mig_node_status(gn, &gpu_holders(i, per_node));
    status.heartbeat_time = Some(Time(Timestamp::now()));
    json!({ "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuNode", "status": status })
}

/// How often the simulated agents stamp their status, as real ones do (the agent's
/// `--heartbeat-secs` default). Without the stamps the operator judges an agent stale 180 s
/// after its report, and a pool whose reports take longer than that to write never becomes
/// Ready.
const HEARTBEAT: Duration = Duration::from_secs(60);

/// The simulated agents: when each node's status was last stamped, and the stamps written.
#[derive(Default)]
struct Fleet {
    stamped: Mutex<BTreeMap<String, Instant>>,
    beats: AtomicU64,
    failed: AtomicU64,
}

impl Fleet {
    fn reported(&self) -> usize {
        self.stamped.lock().map_or(0, |m| m.len())
    }

    fn has(&self, name: &str) -> bool {
        self.stamped.lock().is_ok_and(|m| m.contains_key(name))
    }

    fn stamp(&self, name: String) {
        if let Ok(mut m) = self.stamped.lock() {
            m.insert(name, Instant::now());
        }
    }
}

/// Stamps each reported node's `heartbeatTime` once per [`HEARTBEAT`], until aborted. A merge
/// patch of the stamp alone: the operator's watch delivers the whole object either way, and the
/// API server, sharing the machine with the operator, is spared re-applying every status.
async fn heartbeats(api: Api<GpuNode>, fleet: Arc<Fleet>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let due: Vec<String> = fleet.stamped.lock().map_or_else(
            |_| Vec::new(),
            |m| {
                m.iter()
                    .filter(|(_, at)| at.elapsed() >= HEARTBEAT)
                    .map(|(name, _)| name.clone())
                    .collect()
            },
        );
        stream::iter(due)
            .for_each_concurrent(16, |name| {
                let (api, fleet) = (api.clone(), fleet.clone());
                async move {
                    let patch = json!({ "status": { "heartbeatTime": Time(Timestamp::now()) } });
                    match api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => {
                            fleet.beats.fetch_add(1, Ordering::Relaxed);
                            fleet.stamp(name);
                        }
                        Err(_) => {
                            fleet.failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
            .await;
    }
}

/// Starts the operator on the bench's pool and port; a dhat build writes its profile to
/// `dhat_to` when it exits.
fn spawn_operator(
    bin: &std::path::Path,
    dhat_to: &std::path::Path,
    initial_list: &str,
) -> BoxResult<std::process::Child> {
    let log = std::env::var("SCALE_OPERATOR_LOG").unwrap_or_else(|_| "warn".into());
    Ok(Command::new(bin)
        .args([
            "--leader-elect",
            "false",
            "--http-addr",
            &format!("127.0.0.1:{PORT}"),
            "--pool-selector",
            &format!("{LABEL}=true"),
            "--log",
            &log,
            "--initial-list",
            initial_list,
        ])
        .env("GPUPOOL_DHAT_FILE", dhat_to)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", bin.display()))?)
}

/// The operator's `--initial-list` at its first start: `SCALE_INITIAL_LIST`, default `paged`.
fn first_list() -> String {
    std::env::var("SCALE_INITIAL_LIST").unwrap_or_else(|_| "paged".into())
}

/// The `--initial-list` of each restart, in order: `SCALE_RESTART_LISTS` (comma-separated;
/// empty for none), default all three.
fn restart_lists() -> Vec<String> {
    std::env::var("SCALE_RESTART_LISTS")
        .unwrap_or_else(|_| "paged,cache,streaming".into())
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// SIGTERM, so the operator shuts down cleanly (and a dhat build writes its profile), then
/// waits for it.
fn stop_operator(op: &mut std::process::Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &op.id().to_string()])
        .status();
    let _ = op.wait();
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
    let per_node = env_num("SCALE_PODS_PER_NODE", 8);
    let churn_per_sec = env_num("SCALE_CHURN_PER_SEC", 10);
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

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({ "metadata": { "name": NAMESPACE } }))?;
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    let started = Instant::now();
    let job_uids = create_jobs(&Api::namespaced(client.clone(), NAMESPACE), n).await?;
    println!(
        "{} Jobs ({NODES_PER_JOB} nodes' pods each, suspended) created in {:.1} s",
        job_uids.len(),
        started.elapsed().as_secs_f64()
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    let all: Vec<Pod> = (0..n)
        .flat_map(|i| (0..per_node).map(move |k| (i, k)))
        .map(|(i, k)| pod(i, k, 0, job_uid(&job_uids, i)?))
        .collect::<BoxResult<_>>()?;
    println!(
        "creating {} pods ({per_node} per node, half holding a GPU)",
        all.len()
    );
    create_pods(&pods, all).await?;
    println!("pods created in {:.1} s", started.elapsed().as_secs_f64());

    let bin = operator_binary()?;
    let mut op = spawn_operator(&bin, &dhat_file(), &first_list())?;
    let pid = op.id();
    let (settled, listed_hwm) = settle(pid).await;
    println!(
        "operator after its initial lists ({:.1} s after its start, no pool yet): peak RSS \
         {:.1} MiB, RSS {:.1} MiB",
        settled.as_secs_f64(),
        listed_hwm as f64 / 1024.0,
        vm_rss_kib(pid) as f64 / 1024.0
    );

    let applied = Instant::now();
    let pool = shapes::pool();
    pools
        .patch(
            POOL,
            &PatchParams::apply("scale-bench").force(),
            &Patch::Apply(&pool),
        )
        .await?;

    // Fleet simulator: report every GpuNode once it exists, then stamp it every minute.
    let lp = ListParams::default().labels(&format!("gpupool.io/pool={POOL}"));
    let fleet = Arc::new(Fleet::default());
    let beating = tokio::spawn(heartbeats(gpunodes.clone(), fleet.clone()));
    let deadline = Instant::now() + timeout;
    while (fleet.reported() as u64) < n && Instant::now() < deadline {
        // The API server is loaded at this scale: a call it drops is tried again, not the end
        // of the run.
        let list = match gpunodes.list(&lp).await {
            Ok(list) => list,
            Err(e) => {
                eprintln!("fleet: listing GpuNodes failed, trying again: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let todo: Vec<GpuNode> = list
            .items
            .into_iter()
            .filter(|g| !fleet.has(&g.name_any()))
            .collect();
        if todo.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let reported: Vec<String> = stream::iter(todo)
            .map(|g| {
                let api = gpunodes.clone();
                async move {
                    let name = g.name_any();
                    let written = api
                        .patch_status(
                            &name,
                            &PatchParams::apply("scale-fleet").force(),
                            &Patch::Apply(&status_for(&g, per_node)),
                        )
                        .await;
                    match written {
                        Ok(_) => Some(name),
                        Err(e) => {
                            eprintln!("fleet: reporting {name} failed, trying again: {e}");
                            None
                        }
                    }
                }
            })
            .buffer_unordered(32)
            .filter_map(std::future::ready)
            .collect()
            .await;
        for name in reported {
            fleet.stamp(name);
        }
    }
    let last_report = Instant::now();
    println!(
        "all reports written {:.1} s after the apply",
        (last_report - applied).as_secs_f64()
    );
    let mut became_ready = None;
    let mut last_seen = None;
    let mut next_progress = Instant::now() + PROGRESS_EVERY;
    while Instant::now() < deadline {
        let pool = match pools.get(POOL).await {
            Ok(pool) => pool,
            Err(e) => {
                eprintln!("reading the pool failed, trying again: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if ready(&pool) {
            became_ready = Some(Instant::now());
            break;
        }
        if Instant::now() >= next_progress {
            println!("waiting for Ready: {}", ready_summary(&pool));
            next_progress += PROGRESS_EVERY;
        }
        last_seen = Some(pool);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let writes_at_ready = metric_sum("gpupool_api_writes_total").await?;
    // Steady state: pods keep coming and going.
    let replaced = churn(&pods, &job_uids, n, per_node, churn_per_sec, steady).await?;
    let writes_after = metric_sum("gpupool_api_writes_total").await?;
    let reconciles = metric_sum("gpupool_reconciles_total").await?;
    let rss_mib = vm_hwm_kib(pid) as f64 / 1024.0;
    let steady_mib = vm_rss_kib(pid) as f64 / 1024.0;
    let heap_in_use = metric_sum("gpupool_operator_heap_bytes{state=\"in_use\"}").await?;
    let heap_free = metric_sum("gpupool_operator_heap_bytes{state=\"free\"}").await?;
    let p50 = histogram_quantile("gpupool_reconcile_duration_seconds", 0.5).await?;
    let p99 = histogram_quantile("gpupool_reconcile_duration_seconds", 0.99).await?;

    println!(
        "nodes: {n} (8 GPUs each), GpuNodes reported: {}, heartbeats written: {} ({} failed)",
        fleet.reported(),
        fleet.beats.load(Ordering::Relaxed),
        fleet.failed.load(Ordering::Relaxed)
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
            "the pool did not become Ready within {} s of the apply; last seen: {}",
            timeout.as_secs(),
            last_seen.as_ref().map_or("-".into(), ready_summary)
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
    println!(
        "pods: {} ({per_node} per node), replaced in steady state: {replaced}",
        n * per_node
    );
    let ms = |q: Option<f64>| q.map_or("-".to_string(), |s| format!("{:.1} ms", s * 1000.0));
    println!(
        "reconcile duration p50: {}, p99: {} (histogram_quantile)",
        ms(p50),
        ms(p99)
    );
    println!(
        "operator peak RSS (VmHWM): {rss_mib:.1} MiB, steady RSS (VmRSS at the end): {steady_mib:.1} MiB"
    );
    println!(
        "operator heap at the end: {:.1} MiB in use, {:.1} MiB freed and still held by the allocator",
        heap_in_use / MIB,
        heap_free / MIB
    );

    beating.abort();
    // Restarts into the full cluster (an upgrade, a new leader): the new process lists every
    // pod, node and reported GpuNode at once, which a start before the pool never does. One
    // restart per way of listing, side by side; the last one stays up for the cleanup.
    for list in restart_lists() {
        stop_operator(&mut op);
        let restarted = Instant::now();
        op = spawn_operator(
            &bin,
            &target_dir().join(format!("dhat-heap-restart-{list}.json")),
            &list,
        )?;
        let pid = op.id();
        let (settled, restart_hwm) = settle(pid).await;
        let reconciled_again = loop {
            if metric_sum("gpupool_reconciles_total").await? >= 1.0 {
                break Some(restarted.elapsed());
            }
            if restarted.elapsed() > timeout {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        println!(
            "operator restarted into the full cluster, --initial-list {list}: peak RSS {:.1} MiB \
             after its initial lists ({:.1} s), {:.1} MiB by its first reconcile ({}), RSS {:.1} MiB",
            restart_hwm as f64 / 1024.0,
            settled.as_secs_f64(),
            vm_hwm_kib(pid) as f64 / 1024.0,
            reconciled_again.map_or("none".into(), |t| format!(
                "{:.1} s after the start",
                t.as_secs_f64()
            )),
            vm_rss_kib(pid) as f64 / 1024.0
        );
    }

    // Clean up: the pool (the operator finalizes it; given as long again as the run had),
    // then the nodes. A pool the operator could not finalize in time is cleared by hand.
    pools.delete(POOL, &DeleteParams::default()).await?;
    let cleanup_deadline = Instant::now() + timeout;
    while pools.get_opt(POOL).await?.is_some() && Instant::now() < cleanup_deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_operator(&mut op);
    if dhat_wanted() {
        println!(
            "heap profiles: {} (first start), dhat-heap-restart-<list>.json beside it (restarts)",
            dhat_file().display()
        );
    }
    clear_stale_pool(&pools, &gpunodes).await?;
    // One delete-collection may stop short on tens of thousands of pods, or outlast the
    // connection: repeat until none is left.
    for _ in 0..60 {
        if pods
            .list_metadata(&ListParams::default().limit(1))
            .await?
            .items
            .is_empty()
        {
            break;
        }
        if let Err(e) = pods
            .delete_collection(
                &DeleteParams::default().grace_period(0),
                &ListParams::default(),
            )
            .await
        {
            println!("deleting the bench pods: {e}; trying again");
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
    nodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("{LABEL}=true")),
        )
        .await?;
    Ok(())
}
