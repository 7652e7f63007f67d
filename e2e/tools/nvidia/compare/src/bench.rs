//! The benchmark: both stacks driven the same way, in one run, on the same fake node
//! (8 × H100 with the mixed MIG layout, strategy `mixed`), as processes.
//!
//! - CDI generation: wall time of `nvidia-ctk cdi generate` and of our `ours-cdi` child
//!   (NVML through the fake, inventory, spec, validation, atomic write), each a fresh process.
//! - start → registered: spawn to the first device list of the last resource registered.
//! - Allocate p50/p99: 10,000 Allocates of 2 whole GPUs (`nvidia.com/gpu`) over a unix-socket
//!   gRPC client of their own, on a single-threaded runtime (see `allocate_loop`).
//! - health event → ListAndWatch: an Xid 79 raised in the fake's state file (as the driver
//!   would raise it) until the stand-in sees that GPU Unhealthy. The new state is staged
//!   beside the file first and the clock starts at its rename, the one step any reader can
//!   see (staged, the harness's own read, encode and write of the state are not in the
//!   figure; the time they took is printed). Both plugins learn of it through
//!   `nvmlEventSetWait` on the fake, which wakes on the rename (inotify), so the figures
//!   measure the plugins and the library's delivery, not a poll interval.
//!   NVIDIA's plugin never marks a device healthy again, so each GPU gives one sample per
//!   plugin run; [`HEALTH_RUNS`] plugin runs give each side [`HEALTH_SAMPLES`] samples a bench
//!   (four a side were too few: the p50 ratio moved widely between runs; see RESULTS.md).
//! - VmRSS of the plugin process after registration and after the 10,000 Allocates.
//! - the Allocate transport floor: the same client against a server that answers at once
//!   (`crate::floor`), the least any plugin can take here.
//! - the health floor: the same Xids against a server that sends the new device list the
//!   moment the NVML wait returns (`crate::floor`), the least any plugin can take here; what
//!   is left of each side's figure above it is the plugin's own time.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::Tools;
use crate::cdi_cmp;
use crate::node::{self, SCENARIOS};
use crate::plugins::{self, Side, vm_rss_kib};

const CDI_RUNS: usize = 10;
const STARTS: usize = 5;
const ALLOCATES: usize = 10_000;
/// Whole GPUs of the mixed layout that get an Xid 79 (one sample each).
const HEALTH_GPUS: [u32; 4] = [0, 1, 2, 3];
/// Plugin runs that each mark [`HEALTH_GPUS`] Unhealthy: the first is the one the Allocates ran
/// against, the others start on reset GPUs.
const HEALTH_RUNS: usize = 5;
const HEALTH_SAMPLES: usize = HEALTH_GPUS.len() * HEALTH_RUNS;
const HEALTH_TIMEOUT: Duration = Duration::from_secs(30);
const STRATEGY: &str = "mixed";
const RESOURCE: &str = "nvidia.com/gpu";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[derive(Debug, Default)]
struct Figures {
    cdi: Vec<Duration>,
    start: Vec<Duration>,
    start_retried: usize,
    allocate: Vec<Duration>,
    health: Vec<Duration>,
    health_note: Option<String>,
    /// How long staging each Xid took (the harness's part, outside `health`).
    health_staging: Vec<Duration>,
    rss_registered_kib: Option<u64>,
    rss_after_kib: Option<u64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn p(samples: &[Duration], q: f64) -> Option<Duration> {
    let mut s = samples.to_vec();
    s.sort();
    (!s.is_empty()).then(|| percentile(&s, q))
}

/// Runs the benchmark and prints the table.
pub async fn run(tools: &Tools, work: &Path) -> Result<()> {
    let scenario = &SCENARIOS[0];
    let dir = work.join("bench");
    let node = node::prepare(
        &tools.repo,
        scenario,
        &dir.join("node"),
        &tools.fake_lib,
        &tools.self_exe,
    )?;
    node::pin_clock(&node)?;
    let mut figures: BTreeMap<Side, Figures> = BTreeMap::new();

    // CDI generation, alternating so both see the same machine load.
    for _ in 0..CDI_RUNS {
        let (_, t) = cdi_cmp::run_nvidia_ctk(&tools.ctk, &node, &dir)?;
        figures.entry(Side::Nvidia).or_default().cdi.push(t);
        let (_, t) = cdi_cmp::run_ours(&tools.self_exe, &node, &dir)?;
        figures.entry(Side::Gpupool).or_default().cdi.push(t);
    }

    // Start → registered.
    for _ in 0..STARTS {
        for side in [Side::Nvidia, Side::Gpupool] {
            let work = dir.join(format!("start-{}", side.name()));
            let mut running =
                plugins::start(side, &node, STRATEGY, &work, &tools.plugin, &tools.self_exe)
                    .await?;
            let registered = running.registered().await?;
            if let Some(exit) = &registered.exited {
                anyhow::bail!("{} plugin exited: {exit}", side.name());
            }
            let f = figures.entry(side).or_default();
            if registered.retries > 0 {
                // A registration round failed and was retried 30 s later: not a start time.
                f.start_retried += 1;
            } else {
                f.start.push(registered.took);
            }
            running.stop().await;
        }
    }

    // Allocate, memory, health: one long-running plugin per side.
    for side in [Side::Nvidia, Side::Gpupool] {
        node::reset_all(&node)?;
        let f = figures.entry(side).or_default();
        let work = dir.join(format!("run-{}", side.name()));
        let mut running =
            plugins::start(side, &node, STRATEGY, &work, &tools.plugin, &tools.self_exe).await?;
        let registered = running.registered().await?;
        let devices = registered
            .resources
            .get(RESOURCE)
            .with_context(|| format!("{} registered no {RESOURCE}", side.name()))?
            .clone();
        f.rss_registered_kib = vm_rss_kib(running.pid);
        let mut ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        ids.sort();
        let registration = running
            .kubelet
            .registrations()
            .into_iter()
            .find(|r| r.resource_name == RESOURCE)
            .context("no registration for nvidia.com/gpu")?;
        let socket = running
            .kubelet
            .socket_path()
            .parent()
            .context("kubelet socket without a directory")?
            .join(&registration.endpoint);
        f.allocate = tokio::task::spawn_blocking(move || allocate_loop(&socket, &ids)).await??;
        f.rss_after_kib = vm_rss_kib(running.pid);

        f.health_note = health_samples(&mut running, &node, f).await?;
        running.stop().await;
        for _ in 1..HEALTH_RUNS {
            if f.health_note.is_some() {
                break;
            }
            node::reset_all(&node)?;
            let mut running =
                plugins::start(side, &node, STRATEGY, &work, &tools.plugin, &tools.self_exe)
                    .await?;
            running.registered().await?;
            f.health_note = health_samples(&mut running, &node, f).await?;
            running.stop().await;
        }
    }
    node::reset_all(&node)?;
    let floor = floor_allocates(tools, &dir).await?;
    let mut health_floor = Figures::default();
    for _ in 0..HEALTH_RUNS {
        if health_floor.health_note.is_some() {
            break;
        }
        node::reset_all(&node)?;
        let mut running =
            plugins::start_health_floor(&node, &dir.join("health-floor"), &tools.self_exe).await?;
        running.registered().await?;
        health_floor.health_note = health_samples(&mut running, &node, &mut health_floor).await?;
        running.stop().await;
    }
    node::reset_all(&node)?;
    print_table(&figures, &floor, &health_floor);
    Ok(())
}

/// One Xid 79 on each of [`HEALTH_GPUS`] in turn, each staged, then timed from its commit
/// until the stand-in's device list shows one more device Unhealthy (the advertised IDs carry
/// no GPU index, so Unhealthy devices are counted). A timeout ends the samples, and its note
/// is returned.
async fn health_samples(
    running: &mut plugins::Running,
    node: &node::FakeNode,
    f: &mut Figures,
) -> Result<Option<String>> {
    let unhealthy = |list: &[gpupool_device_plugin::plugin::api::v1beta1::Device]| {
        list.iter().filter(|d| d.health == "Unhealthy").count()
    };
    let injector = node::FaultInjector::open(node)?;
    for (n, gpu) in HEALTH_GPUS.into_iter().enumerate() {
        let staging = Instant::now();
        let staged = injector.stage_xid(gpu, 79)?;
        f.health_staging.push(staging.elapsed());
        let t = Instant::now();
        staged
            .commit()
            .map_err(|e| anyhow::anyhow!("raising Xid 79 on GPU {gpu}: {e}"))?;
        let seen = running
            .kubelet
            .wait_devices(RESOURCE, HEALTH_TIMEOUT, |list| unhealthy(list) > n)
            .await;
        match seen {
            Some(_) => f.health.push(t.elapsed()),
            None => {
                return Ok(Some(format!(
                    "Xid 79 on GPU {gpu} not reported Unhealthy within {HEALTH_TIMEOUT:?}"
                )));
            }
        }
    }
    Ok(None)
}

/// [`ALLOCATES`] Allocates against the transport floor (`serve-floor`, see `crate::floor`), a
/// process of its own, from the same client as the plugins'.
async fn floor_allocates(tools: &Tools, dir: &Path) -> Result<Vec<Duration>> {
    let socket = dir.join("floor.sock");
    let _ = std::fs::remove_file(&socket);
    let mut child = tokio::process::Command::new(&tools.self_exe)
        .arg("serve-floor")
        .arg(&socket)
        .kill_on_drop(true)
        .spawn()
        .context("starting serve-floor")?;
    let up = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        if Instant::now() > up {
            anyhow::bail!("serve-floor made no socket in 10 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ids: Vec<String> = (0..4).map(|i| i.to_string()).collect();
    let samples = tokio::task::spawn_blocking(move || allocate_loop(&socket, &ids)).await??;
    let _ = child.kill().await;
    Ok(samples)
}

/// [`ALLOCATES`] Allocates of two GPUs each, timed one by one, from a client of its own on a
/// single-threaded runtime on this thread (the same for both plugins): the stand-in's client
/// lives on the multi-threaded runtime, where each call also hops between its worker threads,
/// a cost that would sit in both figures alike and hide the servers' difference.
fn allocate_loop(socket: &Path, ids: &[String]) -> Result<Vec<Duration>> {
    use gpupool_device_plugin::plugin::api::v1beta1::device_plugin_client::DevicePluginClient;
    use gpupool_device_plugin::plugin::api::v1beta1::{AllocateRequest, ContainerAllocateRequest};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let channel = gpupool_device_plugin::plugin::connect_unix(socket, Duration::from_secs(5))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut client = DevicePluginClient::new(channel);
        let mut samples = Vec::with_capacity(ALLOCATES);
        for n in 0..ALLOCATES {
            let request = AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: vec![ids[n % ids.len()].clone(), ids[(n + 1) % ids.len()].clone()],
                }],
            };
            let t = Instant::now();
            client.allocate(request).await?;
            samples.push(t.elapsed());
        }
        Ok(samples)
    })
}

fn print_table(figures: &BTreeMap<Side, Figures>, floor: &[Duration], health_floor: &Figures) {
    let (n, o) = (&figures[&Side::Nvidia], &figures[&Side::Gpupool]);
    let row = |name: &str, a: Option<f64>, b: Option<f64>, unit: &str| {
        let fmt = |v: Option<f64>| v.map_or("n/a".to_owned(), |v| format!("{v:.2} {unit}"));
        let ratio = match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
            _ => "n/a".to_owned(),
        };
        println!("| {name} | {} | {} | {ratio} |", fmt(a), fmt(b));
    };
    let q = |s: &[Duration], x: f64| p(s, x).map(ms);
    let mib = |k: Option<u64>| k.map(|k| k as f64 / 1024.0);
    println!(
        "\n8 × H100 80GB, GPUs 4-7 in MIG (13 MIG devices), strategy mixed; ratio = NVIDIA / gpupool (> 1: gpupool faster or smaller)\n"
    );
    println!(
        "| figure | NVIDIA (nvidia-ctk v1.20.2, k8s-device-plugin v0.19.3) | gpupool | ratio |"
    );
    println!("|---|---|---|---|");
    row(
        &format!("CDI generation, p50 of {CDI_RUNS} (process wall time)"),
        q(&n.cdi, 0.5),
        q(&o.cdi, 0.5),
        "ms",
    );
    row(
        &format!("plugin start → all resources registered, p50 of {STARTS}"),
        q(&n.start, 0.5),
        q(&o.start, 0.5),
        "ms",
    );
    row(
        &format!("Allocate (2 GPUs) p50, n={ALLOCATES}"),
        q(&n.allocate, 0.5).map(|v| v * 1e3),
        q(&o.allocate, 0.5).map(|v| v * 1e3),
        "µs",
    );
    row(
        &format!("Allocate (2 GPUs) p99, n={ALLOCATES}"),
        q(&n.allocate, 0.99).map(|v| v * 1e3),
        q(&o.allocate, 0.99).map(|v| v * 1e3),
        "µs",
    );
    row(
        &format!("Xid 79 → ListAndWatch Unhealthy, p50 of {HEALTH_SAMPLES}"),
        q(&n.health, 0.5),
        q(&o.health, 0.5),
        "ms",
    );
    row(
        &format!("Xid 79 → ListAndWatch Unhealthy, p90 of {HEALTH_SAMPLES}"),
        q(&n.health, 0.9),
        q(&o.health, 0.9),
        "ms",
    );
    row(
        "Xid 79 → ListAndWatch Unhealthy, max",
        q(&n.health, 1.0),
        q(&o.health, 1.0),
        "ms",
    );
    row(
        "plugin VmRSS after registration",
        mib(n.rss_registered_kib),
        mib(o.rss_registered_kib),
        "MiB",
    );
    row(
        &format!("plugin VmRSS after {ALLOCATES} Allocates"),
        mib(n.rss_after_kib),
        mib(o.rss_after_kib),
        "MiB",
    );
    // The floor bounds what any server can show on this client: NVIDIA's figure over the
    // floor's is the best ratio a plugin answering in no time would reach, and each side's
    // figure less the floor is its server's own time.
    for (name, x) in [("p50", 0.5), ("p99", 0.99)] {
        let (Some(f), Some(nv), Some(us)) = (q(floor, x), q(&n.allocate, x), q(&o.allocate, x))
        else {
            continue;
        };
        println!(
            "\nAllocate {name} transport floor (the same client against a server that answers at \
             once, a process of its own, n={}): {:.2} µs; above it NVIDIA {:.2} µs, gpupool \
             {:.2} µs; the best ratio any plugin could show here: {:.2}×",
            floor.len(),
            f * 1e3,
            (nv - f) * 1e3,
            (us - f) * 1e3,
            nv / f
        );
    }
    // The same for health: the floor's figure is the fake's delivery, the stand-in and one send.
    for (name, x) in [("p50", 0.5), ("p90", 0.9)] {
        let hf = &health_floor.health;
        let (Some(f), Some(nv), Some(us)) = (q(hf, x), q(&n.health, x), q(&o.health, x)) else {
            continue;
        };
        println!(
            "\nXid 79 → Unhealthy {name} floor (the same Xids against a server that sends the new \
             list the moment the NVML wait returns, a process of its own, n={}): {f:.2} ms; \
             above it NVIDIA {:.2} ms, gpupool {:.2} ms; the best ratio any plugin could show \
             here: {:.2}×",
            hf.len(),
            nv - f,
            us - f,
            nv / f
        );
    }
    let staging: Vec<Duration> = figures
        .values()
        .chain([health_floor])
        .flat_map(|f| f.health_staging.iter().copied())
        .collect();
    if let (Some(p50), Some(max)) = (q(&staging, 0.5), q(&staging, 1.0)) {
        println!(
            "\nstaging each Xid (read, change, encode and write the state beside the file; not in \
             the health figures), n={}: p50 {p50:.2} ms, max {max:.2} ms",
            staging.len()
        );
    }
    if let Some(note) = &health_floor.health_note {
        println!("\nnote (health floor): {note}");
    }
    for (side, f) in figures {
        if f.start_retried > 0 {
            println!(
                "\nnote ({}): {} start(s) left out: a registration round failed and was retried",
                side.name(),
                f.start_retried
            );
        }
        if let Some(note) = &f.health_note {
            println!("\nnote ({}): {note}", side.name());
        }
    }
}
