//! Device plugin figures over real unix-socket gRPC against the kubelet stand-in.
//!
//! Run: `cargo bench -p gpupool-device-plugin --bench plugin`
//!
//! Prints: time from start to registered, Allocate latency p50/p99 over 10,000
//! calls, health-event-to-ListAndWatch latency p50/p99, and VmRSS of this process
//! (which also holds the stand-in kubelet and the benchmark client).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool_device_plugin::plugin::api::v1beta1::{AllocateRequest, ContainerAllocateRequest};
use gpupool_device_plugin::plugin::api::{HEALTHY, UNHEALTHY};
use gpupool_device_plugin::plugin::testing::KubeletStandin;
use gpupool_device_plugin::plugin::{
    Advertisement, CdiNaming, GpuDescription, HealthEvent, HealthEventKind, HealthMonitor,
    HealthPolicy, HealthTarget, MigDescription, MigStrategy, PluginConfig, PluginMetrics, Topology,
    resource_sets, run_plugins,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

const ALLOCATE_CALLS: usize = 10_000;
const HEALTH_EVENTS: usize = 1_000;
const STARTS: usize = 20;
const WAIT: Duration = Duration::from_secs(10);

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// An 8-GPU node in mixed MIG mode: 4 whole GPUs, 4 GPUs with 7 × 1g.10gb each.
fn inventory() -> Vec<GpuDescription> {
    (0..8u32)
        .map(|i| GpuDescription {
            index: i,
            uuid: format!("GPU-{i:08}-0000-0000-0000-000000000000"),
            numa_node: Some(i64::from(i / 4)),
            mig_enabled: i >= 4,
            mig_devices: if i >= 4 {
                (0..7u32)
                    .map(|j| MigDescription {
                        index: j,
                        uuid: format!("MIG-{i:08}-{j:04}-0000-0000-000000000000"),
                        profile: "1g.10gb".into(),
                    })
                    .collect()
            } else {
                Vec::new()
            },
        })
        .collect()
}

fn advertisement() -> BenchResult<Advertisement> {
    Ok(Advertisement {
        resources: resource_sets(&inventory(), MigStrategy::Mixed, CdiNaming::Index)?,
        topology: Arc::new(Topology::new()),
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name}: n={} p50={:.1} µs p99={:.1} µs max={:.1} µs",
        samples.len(),
        percentile(&samples, 0.50).as_secs_f64() * 1e6,
        percentile(&samples, 0.99).as_secs_f64() * 1e6,
        samples.last().map_or(0.0, |d| d.as_secs_f64() * 1e6),
    );
}

fn vm_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

async fn time_to_registered() -> BenchResult<Vec<Duration>> {
    let mut samples = Vec::with_capacity(STARTS);
    for _ in 0..STARTS {
        let dir = tempfile::tempdir()?;
        let mut kubelet = KubeletStandin::start(dir.path()).await?;
        let (_tx, rx) = watch::channel(advertisement()?);
        let cancel = CancellationToken::new();
        let started = Instant::now();
        let plugins = tokio::spawn(run_plugins(
            PluginConfig::with_plugin_dir(dir.path()),
            rx,
            Arc::new(PluginMetrics::default()),
            cancel.clone(),
        ));
        // Registered = every resource (nvidia.com/gpu and nvidia.com/mig-1g.10gb) registered.
        for resource in ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"] {
            kubelet
                .wait_registered(resource, WAIT)
                .await
                .ok_or("registration timed out")?;
        }
        samples.push(started.elapsed());
        cancel.cancel();
        plugins.await??;
        kubelet.shutdown().await;
    }
    Ok(samples)
}

async fn allocate_and_health() -> BenchResult<(Vec<Duration>, Vec<Duration>, Option<u64>)> {
    let dir = tempfile::tempdir()?;
    let mut kubelet = KubeletStandin::start(dir.path()).await?;
    let base = advertisement()?;
    let metrics = Arc::new(PluginMetrics::default());
    let cancel = CancellationToken::new();
    let (_layout_tx, layout_rx) = watch::channel(base.clone());
    let (events_tx, events_rx) = mpsc::channel(64);
    let (health_tx, health_rx) = watch::channel(base);
    let policy = HealthPolicy {
        hold_down: Duration::ZERO,
        ..HealthPolicy::default()
    };
    let monitor = tokio::spawn(HealthMonitor::new(policy, metrics.clone()).run(
        layout_rx,
        events_rx,
        health_tx,
        cancel.clone(),
    ));
    let plugins = tokio::spawn(run_plugins(
        PluginConfig::with_plugin_dir(dir.path()),
        health_rx,
        metrics.clone(),
        cancel.clone(),
    ));
    let resource = "nvidia.com/gpu";
    kubelet
        .wait_devices(resource, WAIT, |_| true)
        .await
        .ok_or("no device list")?;
    let rss_registered = vm_rss_kib();

    let mut client = kubelet.client(resource).ok_or("no client")?;
    let ids: Vec<String> = (0..4u32)
        .map(|i| format!("GPU-{i:08}-0000-0000-0000-000000000000"))
        .collect();
    let mut allocate = Vec::with_capacity(ALLOCATE_CALLS);
    for n in 0..ALLOCATE_CALLS {
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![ids[n % 4].clone(), ids[(n + 1) % 4].clone()],
            }],
        };
        let t = Instant::now();
        client.allocate(request).await?;
        allocate.push(t.elapsed());
    }

    let mut health = Vec::with_capacity(HEALTH_EVENTS);
    for n in 0..HEALTH_EVENTS {
        let (kind, want) = if n % 2 == 0 {
            (HealthEventKind::GpuLost, UNHEALTHY)
        } else {
            (HealthEventKind::Cleared, HEALTHY)
        };
        let t = Instant::now();
        events_tx
            .send(HealthEvent {
                target: HealthTarget::Gpu(2),
                kind,
            })
            .await?;
        kubelet
            .wait_devices(resource, WAIT, |d| {
                d.get(2).is_some_and(|d| d.health == want)
            })
            .await
            .ok_or("health change not seen")?;
        health.push(t.elapsed());
    }
    cancel.cancel();
    plugins.await??;
    monitor.await?;
    kubelet.shutdown().await;
    Ok((allocate, health, rss_registered))
}

fn main() -> BenchResult<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let starts = time_to_registered().await?;
        let (allocate, health, rss_registered) = allocate_and_health().await?;
        summary("start → registered (all resources)", starts);
        summary("Allocate (2 GPUs, 1 container)", allocate);
        summary("health event → ListAndWatch", health);
        if let Some(kib) = rss_registered {
            println!("VmRSS after registration: {:.1} MiB", kib as f64 / 1024.0);
        }
        if let Some(kib) = vm_rss_kib() {
            println!(
                "VmRSS at end (plugin + stand-in kubelet + client): {:.1} MiB",
                kib as f64 / 1024.0
            );
        }
        Ok(())
    })
}
