//! Observability against a real Prometheus (Debian's `prometheus`, on a loopback port) that
//! scrapes a real operator and two real node agents (fake libnvidia-ml) with the chart's alerting
//! rules loaded (their `for:` shortened to 1 s, the expressions unchanged):
//!
//! - the GPU-seconds counters match what GpuNode status says: on a node whose status the test
//!   writes (three GPUs held by running pods, two of them idle for an hour), between two raw
//!   scrapes the idle counter grows by the idle GPUs × the time between them and the allocated
//!   one by the held GPUs × the same, to within one accounting interval per GPU;
//! - a fatal Xid injected through the fake NVML makes `GpupoolFatalXid` (and
//!   `GpupoolGpuUnhealthy`) fire for that node, read back through `/api/v1/alerts`;
//! - an agent killed makes `GpupoolAgentDown` fire for its target;
//! - every panel of the chart's Grafana dashboard has a query that returns data;
//! - the key series are drawn as an SVG (`target/e2e-tests/observability.svg`; with
//!   `GPUPOOL_WRITE_DOCS_PLOT=1` also `docs/observability.svg`, the picture in docs/observability.md).
//!
//! Without `prometheus` it fails under CI (which installs it) and skips with a message elsewhere.

#[path = "operator_support.rs"]
mod support;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpupool_crds::GpuNode;
use gpupool_crds::node::{Activity, GpuStatus, Idleness, PodRef};
use gpupool_e2e::agent::{agent_binaries, fake_driver_root};
use gpupool_e2e::plot::{Chart, Series, svg};
use gpupool_e2e::prometheus::{Prometheus, dashboard_file, find_tool, free_port, rules_with_hold};
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, crds, repo_root};
use gpupool_sim::{FaultFixture, FaultKind};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{Api, ResourceExt};
use serde_json::json;
use support::*;

/// The operator's `--accounting-interval`, seconds: the counters' resolution.
const ACCOUNTING_SECS: f64 = 1.0;

/// A node agent run as a host process on the fake NVML; killed on drop.
struct HostAgent {
    child: Child,
    /// `127.0.0.1:<port>` of its `/metrics`.
    addr: String,
    fixture: PathBuf,
    state: PathBuf,
    log: PathBuf,
}

impl HostAgent {
    fn start(cluster: &Cluster, dir: &Path, node: &str) -> Result<HostAgent> {
        let _ = fs::remove_dir_all(dir);
        let (agent, nvml) = agent_binaries(&dir.join("bin"))?;
        let driver = dir.join("driver");
        for d in ["kubelet/device-plugins", "cdi"] {
            fs::create_dir_all(dir.join(d))?;
        }
        fake_driver_root(&driver, "550.54.15", 2)?;
        let fixture = dir.join("fixture.yaml");
        fs::write(
            &fixture,
            format!(
                "node: {node}\ndevice_nodes: ignored\ndriver: {{version: \"550.54.15\", cuda: \"12.4\"}}\n\
                 gpus:\n  - model: H100-SXM5-80GB\n    count: 2\n"
            ),
        )?;
        fs::write(dir.join("kmsg"), "")?;
        let addr = format!("127.0.0.1:{}", free_port()?);
        let log = dir.join("agent.log");
        let out = fs::File::create(&log)?;
        let state = dir.join("nvml-state.json");
        let child = Command::new(agent)
            .args(["--node-name", node, "--metrics-addr", &addr])
            .arg("--kubelet-dir")
            .arg(dir.join("kubelet"))
            .arg("--cdi-dir")
            .arg(dir.join("cdi"))
            .arg("--driver-root")
            .arg(&driver)
            .arg("--proc-root")
            .arg(driver.join("proc"))
            .arg("--kmsg-path")
            .arg(dir.join("kmsg"))
            .args([
                "--validate-interval-secs",
                "1",
                "--backend",
                "nvml",
                "--nvml-lib",
            ])
            .arg(nvml)
            .env("GPUPOOL_FAKE_NVML_FIXTURE", &fixture)
            .env("GPUPOOL_FAKE_NVML_STATE", &state)
            .env("KUBECONFIG", cluster.kubeconfig())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting the agent")?;
        Ok(HostAgent {
            child,
            addr,
            fixture,
            state,
            log,
        })
    }

    /// An Xid on `gpu` now, through the fake NVML's state file (as the kernel driver would
    /// report it to NVML).
    fn inject_xid(&self, gpu: u32, xid: u64) -> Result<()> {
        let fail = |e: gpupool_sim::SimError| anyhow::anyhow!("injecting Xid {xid}: {e}");
        let node = gpupool_sim::Node::load(&self.fixture).map_err(fail)?;
        let fault = FaultFixture {
            at: 0.0,
            gpu,
            fault: FaultKind::Xid(xid),
            gpu_instance: None,
            compute_instance: None,
        };
        // `at: 0` is in the past of the library's clock, so the fault is current at once.
        gpupool_sim::StateFile::at(self.state.clone())
            .update(&node, |s| s.inject(&node, fault, 0.0))
            .map_err(fail)?;
        Ok(())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A GPU held by `pod`, idle for an hour or busy.
fn held_gpu(index: u32, pod: &Pod, idle: bool) -> GpuStatus {
    let hour_ago = Timestamp::now()
        .checked_sub(SignedDuration::from_hours(1))
        .unwrap_or(Timestamp::UNIX_EPOCH);
    GpuStatus {
        index,
        uuid: format!("GPU-obs-{index}"),
        model: "NVIDIA H100 80GB HBM3".into(),
        memory_mib: 81559,
        pci_bus_id: format!("0000:{index:02x}:00.0"),
        idleness: Idleness {
            activity: if idle { Activity::Idle } else { Activity::Busy },
            idle_since: idle.then_some(Time(hour_ago)),
            pods: vec![PodRef {
                namespace: pod.namespace().unwrap_or_default().into(),
                name: pod.name_any(),
                container: Some("main".into()),
            }],
        },
        ..Default::default()
    }
}

/// (GPUs held, GPUs held and idle) in `namespace` by the GpuNode's status, as the operator's
/// accounting reads it (whole GPUs, one pod each here).
fn held_and_idle(gn: &GpuNode, namespace: &str) -> (f64, f64) {
    let gpus = gn.status.as_ref().map(|s| s.gpus.as_slice()).unwrap_or(&[]);
    let held: Vec<&GpuStatus> = gpus
        .iter()
        .filter(|g| g.idleness.pods.iter().any(|p| *p.namespace == *namespace))
        .collect();
    let idle = held
        .iter()
        .filter(|g| {
            g.idleness
                .idle_since
                .as_ref()
                .is_some_and(|t| t.0 < Timestamp::now())
        })
        .count();
    (held.len() as f64, idle as f64)
}

/// The counter's growth between two raw scrapes at least `span` seconds apart, and the time
/// between them.
async fn growth(prom: &Prometheus, selector: &str, span: f64) -> Result<(f64, f64)> {
    poll(
        &format!("{span} s of scrapes of {selector}"),
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let samples = prom.raw_samples(selector, "2m").unwrap_or_default();
            let Some(last) = samples.last() else {
                return Ok(None);
            };
            // From the last sample back to the first at least `span` before it.
            let from = samples
                .iter()
                .rev()
                .find(|(t, _)| last.0 - t >= span)
                .copied();
            Ok(from.map(|(t0, v0)| (last.1 - v0, last.0 - t0)))
        },
    )
    .await
}

/// Replaces the dashboard's variables with what the test's Prometheus can answer.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "30s")
        .replace("$__range", "1h")
        .replace("$pool", ".*")
}

#[tokio::test]
async fn prometheus_scrapes_fires_alerts_and_counts_idle_gpu_time() -> Result<()> {
    let Some(prometheus_bin) = find_tool("prometheus")? else {
        eprintln!(
            "e2e: SKIPPED prometheus_scrapes_fires_alerts_and_counts_idle_gpu_time: prometheus \
             not found (apt-get install prometheus)"
        );
        return Ok(());
    };
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "obs")?;
    let client = cluster.client().await?;
    crds::install(cluster).await?;
    let ns = scope.namespace().to_owned();
    let (k, v) = scope.label();
    let prefix = scope.prefix();
    let xid_node = create_node(
        cluster,
        &scope,
        &format!("{prefix}-xid"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let kill_node = create_node(
        cluster,
        &scope,
        &format!("{prefix}-kill"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let idle_node = create_node(
        cluster,
        &scope,
        &format!("{prefix}-idle"),
        "NVIDIA-H100-80GB-HBM3",
        &[],
    )?;
    let pool = format!("{prefix}-pool");
    apply_pool(
        &client,
        &scope,
        &pool,
        json!({
            "nodeSelector": {"matchLabels": {k: v}},
            "reclaim": {"mode": "DryRun", "idleAfter": "5m", "startupGracePeriod": "0s"},
        }),
    )
    .await?;
    let operator = Operator::start_with(
        cluster,
        &scope,
        "obs",
        &scope.name("lease"),
        &["--accounting-interval", "1"],
    )?;
    for node in [&xid_node, &kill_node, &idle_node] {
        wait_gpunode(&client, node, |_| true).await?;
    }

    // The node the test reports for: three GPUs held by running pods, two idle for an hour.
    let mut pods = Vec::new();
    for name in ["idle-a", "idle-b", "busy-c"] {
        pods.push(running_gpu_pod(&client, &scope, name, &idle_node, &[], &[]).await?);
    }
    let gpus = vec![
        held_gpu(0, &pods[0], true),
        held_gpu(1, &pods[1], true),
        held_gpu(2, &pods[2], false),
    ];
    report_status(&client, &idle_node, move |s| {
        s.gpu_count = 3;
        s.healthy_gpus = 3;
        s.gpus = gpus;
    })
    .await?;

    let work = repo_root()
        .join("target/e2e-tests")
        .join(format!("obs-{}", std::process::id()));
    let xid_agent = HostAgent::start(cluster, &work.join("xid"), &xid_node)?;
    let mut kill_agent = HostAgent::start(cluster, &work.join("kill"), &kill_node)?;
    let operator_addr = poll("the operator's metrics address", REACT, POLL, || async {
        Ok(operator.metrics_addr().ok())
    })
    .await?;
    let jobs = BTreeMap::from([
        ("gpupool-operator", vec![operator_addr]),
        (
            "gpupool-agent",
            vec![xid_agent.addr.clone(), kill_agent.addr.clone()],
        ),
    ]);
    let prom = Prometheus::start(
        &prometheus_bin,
        &work.join("prometheus"),
        &jobs,
        &rules_with_hold("1s")?,
        "1s",
    )
    .await?;
    eprintln!(
        "e2e: Prometheus at {} (log {})",
        prom.url,
        prom.log.display()
    );
    let started = Timestamp::now().as_millisecond() as f64 / 1000.0;

    let pool_sel = format!("{{pool=\"{pool}\"}}");
    poll("the pool's gauges in Prometheus", REACT, POLL, || async {
        let gpus = prom.query(&format!("gpupool_pool_gpus{pool_sel}"))?;
        Ok(gpus.first().filter(|s| s.value > 0.0).map(|_| ()))
    })
    .await
    .with_context(|| operator.log_tail())?;
    for agent in [&xid_agent, &kill_agent] {
        let addr = agent.addr.clone();
        let log = agent.log.clone();
        poll(&format!("agent {addr} up"), REACT, POLL, || async {
            let up = prom.query(&format!("up{{job=\"gpupool-agent\",instance=\"{addr}\"}}"))?;
            Ok(up.first().filter(|s| s.value == 1.0).map(|_| ()))
        })
        .await
        .with_context(|| fs::read_to_string(&log).unwrap_or_default())?;
    }

    // Idle accounting against GpuNode status.
    let gn: GpuNode = Api::<GpuNode>::all(client.clone()).get(&idle_node).await?;
    let (held, idle) = held_and_idle(&gn, &ns);
    ensure!(
        (held, idle) == (3.0, 2.0),
        "the GpuNode says {held} held, {idle} idle"
    );
    let counter = |name: &str| format!("{name}{{pool=\"{pool}\",namespace=\"{ns}\"}}");
    let (idle_growth, idle_span) =
        growth(&prom, &counter("gpupool_gpu_idle_seconds_total"), 10.0).await?;
    let (alloc_growth, alloc_span) =
        growth(&prom, &counter("gpupool_gpu_allocated_seconds_total"), 10.0).await?;
    // Each scrape reads the counters as of the operator's last sample, up to one interval
    // before the scrape: the difference of two readings is off by at most one interval per GPU.
    let tolerance = |gpus: f64| gpus * (ACCOUNTING_SECS + 0.25);
    eprintln!(
        "e2e: idle GPU-seconds +{idle_growth:.2} over {idle_span:.2} s (status: {idle} idle GPUs); \
         allocated +{alloc_growth:.2} over {alloc_span:.2} s (status: {held} held GPUs)"
    );
    ensure!(
        (idle_growth - idle * idle_span).abs() <= tolerance(idle),
        "idle GPU-seconds grew {idle_growth} over {idle_span} s; the status says {idle} idle GPUs"
    );
    ensure!(
        (alloc_growth - held * alloc_span).abs() <= tolerance(held),
        "allocated GPU-seconds grew {alloc_growth} over {alloc_span} s; the status says {held} held GPUs"
    );

    // A fatal Xid on the agent's GPU 0.
    let xid_at = Timestamp::now().as_millisecond() as f64 / 1000.0;
    xid_agent.inject_xid(0, 79)?;
    let fired = prom
        .wait_firing("GpupoolFatalXid", &[("node", &xid_node)], REACT)
        .await
        .with_context(|| fs::read_to_string(&xid_agent.log).unwrap_or_default())?;
    ensure!(
        fired.get("xid").map(String::as_str) == Some("79"),
        "{fired:?}"
    );
    prom.wait_firing("GpupoolGpuUnhealthy", &[("node", &xid_node)], REACT)
        .await?;

    // An agent killed.
    let killed_at = Timestamp::now().as_millisecond() as f64 / 1000.0;
    kill_agent.kill();
    prom.wait_firing(
        "GpupoolAgentDown",
        &[("job", "gpupool-agent"), ("instance", &kill_agent.addr)],
        REACT,
    )
    .await?;

    // A few evaluations with the agent down, so the picture shows it.
    poll("5 s of GpupoolAgentDown firing", REACT, POLL, || async {
        let firing = prom
            .raw_samples(
                "ALERTS{alertname=\"GpupoolAgentDown\",alertstate=\"firing\"}",
                "1m",
            )
            .unwrap_or_default();
        Ok((firing.len() >= 5).then_some(()))
    })
    .await?;

    // Every dashboard panel has a query that returns data.
    let dashboard: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dashboard_file())?)?;
    let mut empty_panels = Vec::new();
    let mut report = Vec::new();
    for panel in dashboard["panels"].as_array().context("no panels")? {
        let Some(targets) = panel["targets"].as_array() else {
            continue;
        };
        let title = panel["title"].as_str().unwrap_or_default();
        let mut any = false;
        for t in targets {
            let expr = substitute(t["expr"].as_str().context("a target without expr")?);
            let n = prom
                .query(&expr)
                .with_context(|| format!("panel {title:?}: {expr}"))?
                .len();
            report.push(format!("{n:>3} series  {title}: {expr}"));
            any |= n > 0;
        }
        if !any {
            empty_panels.push(title.to_owned());
        }
    }
    eprintln!("e2e: dashboard queries:\n{}", report.join("\n"));
    ensure!(
        empty_panels.is_empty(),
        "panels without data: {empty_panels:?}"
    );

    // The picture.
    let end = Timestamp::now().as_millisecond() as f64 / 1000.0;
    let range = |expr: &str, legend: &dyn Fn(&BTreeMap<String, String>) -> String| {
        prom.query_range(expr, started, end, 1.0).map(|rs| {
            rs.into_iter()
                .map(|(labels, points)| Series {
                    name: legend(&labels),
                    points,
                })
                .collect::<Vec<_>>()
        })
    };
    let mut accounting = range(
        &format!("sum(gpupool_gpu_allocated_seconds_total{pool_sel})"),
        &|_| "GPU-seconds allocated".into(),
    )?;
    accounting.extend(range(
        &format!("sum(gpupool_gpu_idle_seconds_total{pool_sel})"),
        &|_| "GPU-seconds idle".into(),
    )?);
    let mut health = range("sum(gpupool_gpu_healthy)", &|_| {
        "healthy GPUs (agents)".into()
    })?;
    health.extend(range("sum(up{job=\"gpupool-agent\"})", &|_| {
        "agents up".into()
    })?);
    let fired: Vec<String> = range(
        "count by (alertname) (ALERTS{alertstate=\"firing\",alertname=~\"Gpupool.*\"})",
        &|l| l.get("alertname").cloned().unwrap_or_default(),
    )?
    .into_iter()
    .map(|s| s.name)
    .collect();
    let alerts = range(
        "count(ALERTS{alertstate=\"firing\",alertname=~\"Gpupool.*\"})",
        &|_| "firing gpupool alerts".into(),
    )?;
    let picture = svg(
        "gpupool in a real Prometheus (e2e/tests/observability.rs)",
        &[
            Chart {
                title: format!("pool {pool}: GPU time (3 GPUs held, 2 idle)"),
                unit: "GPU-seconds".into(),
                series: accounting,
            },
            Chart {
                title: "GPU health and agents".into(),
                unit: "count".into(),
                series: health,
            },
            Chart {
                title: format!(
                    "firing alerts: Gpupool{{{}}}",
                    fired
                        .iter()
                        .map(|a| a.trim_start_matches("Gpupool"))
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                unit: "alerts".into(),
                series: alerts,
            },
        ],
        &[
            (xid_at, "Xid 79 injected".into()),
            (killed_at, "agent killed".into()),
        ],
        started,
        end,
    );
    let out = repo_root().join("target/e2e-tests/observability.svg");
    fs::write(&out, &picture)?;
    eprintln!("e2e: plot written to {}", out.display());
    if std::env::var("GPUPOOL_WRITE_DOCS_PLOT").is_ok_and(|v| v == "1") {
        let docs = repo_root().join("docs/observability.svg");
        fs::create_dir_all(docs.parent().context("docs dir")?)?;
        fs::write(&docs, &picture)?;
        eprintln!("e2e: plot written to {}", docs.display());
    }
    drop(xid_agent);
    drop(prom);
    let _ = fs::remove_dir_all(&work);
    Ok(())
}
