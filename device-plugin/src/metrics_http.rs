//! The agent's metrics and its `/metrics`, `/healthz` and `/readyz` endpoint, served by the
//! server the operator uses too ([`gpupool_telemetry`]).
//!
//! The agent loop computes its figures (per-GPU samples, Xid counts, write counts) once per
//! reconcile and hands them over whole with [`AgentMetrics::set`]; a prometheus-client
//! collector encodes that latest snapshot at scrape time, so a scrape never sees half of one
//! reconcile and half of the next, and a value the agent does not have (a GPU without a
//! utilization sample) is simply absent. The kubelet plugin's counters are ordinary
//! prometheus-client counters ([`PluginMetrics::register`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use gpupool_telemetry::HttpState;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::plugin::PluginMetrics;

/// Per-GPU figures for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuFigures {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// SM utilization, percent.
    pub utilization_percent: Option<u32>,
    /// Memory used by compute processes, MiB.
    pub memory_used_mib: Option<u64>,
    /// 1 healthy, 0 not.
    pub healthy: bool,
    /// Temperature, °C.
    pub temperature_c: Option<u32>,
}

/// Per-MIG-device figures for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MigFigures {
    /// Parent GPU index.
    pub gpu: u32,
    /// Profile, e.g. `1g.10gb`.
    pub profile: String,
    /// 1 healthy, 0 not.
    pub healthy: bool,
    /// Memory used by compute processes on this device, MiB.
    pub memory_used_mib: Option<u64>,
    /// Idle by the last sample (`Some(false)`: busy; `None`: unknown).
    pub idle: Option<bool>,
}

/// What `/metrics` shows; the agent loop replaces it after each reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    /// The node the agent runs on: the `node` label of every figure series, so alerts and
    /// dashboards name the node whatever the scrape's own target labels are.
    pub node: String,
    /// By GPU index.
    pub gpus: BTreeMap<u32, GpuFigures>,
    /// By `MIG-…` UUID.
    pub mig_devices: BTreeMap<String, MigFigures>,
    /// When a utilization sample last returned figures; `None` before the first.
    pub last_sample: Option<Instant>,
    /// When the GpuNode status was last written (a change or a heartbeat); `None` before the
    /// first write.
    pub last_status_write: Option<Instant>,
    /// Xid events seen, by (GPU index, Xid).
    pub xids: BTreeMap<(u32, u64), u64>,
    /// 1 when every driver check passed.
    pub validated: bool,
    /// GpuNode status writes.
    pub status_writes: u64,
    /// CDI spec writes.
    pub cdi_writes: u64,
    /// 1 when the CDI spec the runtime reads is the agent's and resolvable; absent with CDI
    /// off or before the first write.
    pub cdi_spec_ready: Option<bool>,
    /// Other device plugins' live sockets for NVIDIA resources on the node; absent before the
    /// first scan.
    pub foreign_device_plugins: Option<u32>,
}

/// State shared between the agent loop and the HTTP server.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    /// Latest figures.
    pub figures: RwLock<Figures>,
    /// Set once the agent has reconciled and reported at least once.
    pub ready: AtomicBool,
    /// Plugin counters.
    pub plugin: Arc<PluginMetrics>,
    /// The agent loop's progress, which `/healthz` follows.
    pub heartbeat: Heartbeat,
}

/// The agent loop beats after every pass, and at least every [`Heartbeat::INTERVAL`] when
/// nothing happens. A pass that never ends (an NVML call hung on a sick GPU or driver blocks
/// the loop) stops the beats, and `/healthz` then answers 503 so the kubelet restarts the
/// agent: the watchdog is the liveness probe.
#[derive(Debug)]
pub struct Heartbeat {
    origin: std::time::Instant,
    /// Milliseconds since `origin` at the last beat, plus one; 0 before the first.
    last: std::sync::atomic::AtomicU64,
    /// Milliseconds without a beat after which the agent counts as stuck.
    stall_after: std::sync::atomic::AtomicU64,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            origin: std::time::Instant::now(),
            last: 0.into(),
            stall_after: (Heartbeat::DEFAULT_STALL_AFTER.as_millis() as u64).into(),
        }
    }
}

impl Heartbeat {
    /// The longest the loop sleeps between beats.
    pub const INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
    /// The default silence after which the agent counts as stuck.
    pub const DEFAULT_STALL_AFTER: std::time::Duration = std::time::Duration::from_secs(180);

    /// The loop made progress now.
    pub fn beat(&self) {
        let now = self.origin.elapsed().as_millis() as u64;
        self.last.store(now.saturating_add(1), Ordering::Relaxed);
    }

    /// Sets how long a silence counts as stuck (at least two beat intervals).
    pub fn set_stall_after(&self, d: std::time::Duration) {
        let d = d.max(Heartbeat::INTERVAL * 2);
        self.stall_after
            .store(d.as_millis() as u64, Ordering::Relaxed);
    }

    /// `/healthz`: an error once the loop has been silent for longer than allowed. Before the
    /// first beat the agent is starting, and alive.
    pub fn check(&self) -> Result<(), String> {
        self.check_at(self.origin.elapsed())
    }

    fn check_at(&self, now: std::time::Duration) -> Result<(), String> {
        let last = self.last.load(Ordering::Relaxed);
        if last == 0 {
            return Ok(());
        }
        let silent = (now.as_millis() as u64).saturating_sub(last - 1);
        let limit = self.stall_after.load(Ordering::Relaxed);
        if silent > limit {
            Err(format!(
                "the agent loop has made no progress for {}s (limit {}s): a call into the \
                 driver may be hung; restarting the agent",
                silent / 1000,
                limit / 1000
            ))
        } else {
            Ok(())
        }
    }
}

impl AgentMetrics {
    /// Replaces the figures.
    pub fn set(&self, figures: Figures) {
        if let Ok(mut f) = self.figures.write() {
            *f = figures;
        }
    }

    /// A registry holding every agent metric: the figures (read at each scrape) and the
    /// plugin counters.
    pub fn registry(self: &Arc<Self>) -> Registry {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(FiguresCollector(self.clone())));
        self.plugin.register(&mut registry);
        registry
    }

    /// What the endpoints serve: [`AgentMetrics::registry`], and `/readyz` following
    /// [`AgentMetrics::ready`].
    pub fn http_state(self: &Arc<Self>) -> HttpState {
        let metrics = self.clone();
        let live = self.clone();
        HttpState::new(self.registry())
            .ready_when(move || metrics.ready.load(Ordering::Relaxed))
            .live_when(move || live.heartbeat.check())
    }
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` until `cancel`.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<AgentMetrics>,
    cancel: CancellationToken,
) -> Result<(), gpupool_telemetry::Error> {
    gpupool_telemetry::serve(addr, Arc::new(metrics.http_state()), cancel).await
}

/// The labels of per-GPU series: one series per physical GPU, so their number is bounded by
/// the node's GPUs.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    node: String,
    gpu: u32,
    uuid: String,
    model: String,
}

/// The labels of per-MIG-device series (at most 7 per GPU).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigLabels {
    node: String,
    gpu: u32,
    uuid: String,
    profile: String,
}

/// The labels of the Xid counter; `fatal` is the agent's own verdict (`xid::is_fatal`), so
/// an alert need not repeat the list.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    node: String,
    gpu: u32,
    uuid: String,
    xid: u64,
    fatal: bool,
}

/// The label of node-level agent series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

/// Encodes the latest [`Figures`] on each scrape.
#[derive(Debug)]
struct FiguresCollector(Arc<AgentMetrics>);

/// One gauge family with a sample per GPU that has a value.
fn per_gpu<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    f: &Figures,
    name: &str,
    help: &str,
    value: impl Fn(&GpuFigures) -> Option<V>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (&gpu, g) in &f.gpus {
        if let Some(value) = value(g) {
            let labels = GpuLabels {
                node: f.node.clone(),
                gpu,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
            };
            ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// One gauge family with a sample per MIG device that has a value.
fn per_mig<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    f: &Figures,
    name: &str,
    help: &str,
    value: impl Fn(&MigFigures) -> Option<V>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (uuid, m) in &f.mig_devices {
        if let Some(value) = value(m) {
            let labels = MigLabels {
                node: f.node.clone(),
                gpu: m.gpu,
                uuid: uuid.clone(),
                profile: m.profile.clone(),
            };
            ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// One node-level gauge.
fn node_gauge<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    node: &str,
    name: &str,
    help: &str,
    value: V,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    let labels = NodeLabels {
        node: node.to_owned(),
    };
    ConstGauge::new(value).encode(family.encode_family(&labels)?)
}

/// One node-level counter.
fn node_counter(
    encoder: &mut DescriptorEncoder,
    node: &str,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    let labels = NodeLabels {
        node: node.to_owned(),
    };
    ConstCounter::new(value).encode(family.encode_family(&labels)?)
}

// Names and help texts are the ones the agent has always exposed. Counters are described
// without their `_total`: prometheus-client's encoder appends it to every counter sample, so
// `gpupool_status_writes` is scraped as `gpupool_status_writes_total`, as before. Help texts
// are passed whole because a collector's help is written as given (unlike
// `Registry::register`, which appends a period).
impl Collector for FiguresCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // A poisoned lock means a writer panicked between two whole assignments; the value
        // left behind is still one complete snapshot.
        let f = match self.0.figures.read() {
            Ok(f) => f,
            Err(poisoned) => poisoned.into_inner(),
        };
        let node = f.node.as_str();
        per_gpu(
            &mut encoder,
            &f,
            "gpupool_gpu_utilization_percent",
            "SM utilization of a whole GPU.",
            |g| g.utilization_percent,
        )?;
        per_gpu(
            &mut encoder,
            &f,
            "gpupool_gpu_memory_used_bytes",
            "GPU memory used by compute processes.",
            |g| g.memory_used_mib.map(|v| v.saturating_mul(1024 * 1024)),
        )?;
        per_gpu(
            &mut encoder,
            &f,
            "gpupool_gpu_healthy",
            "1 when the GPU has no health fault.",
            |g| Some(u32::from(g.healthy)),
        )?;
        per_gpu(
            &mut encoder,
            &f,
            "gpupool_gpu_temperature_celsius",
            "GPU temperature.",
            |g| g.temperature_c,
        )?;
        per_mig(
            &mut encoder,
            &f,
            "gpupool_mig_device_healthy",
            "1 when the MIG device has no health fault.",
            |m| Some(u32::from(m.healthy)),
        )?;
        per_mig(
            &mut encoder,
            &f,
            "gpupool_mig_device_memory_used_bytes",
            "MIG device memory used by compute processes.",
            |m| m.memory_used_mib.map(|v| v.saturating_mul(1024 * 1024)),
        )?;
        per_mig(
            &mut encoder,
            &f,
            "gpupool_mig_device_idle",
            "1 when the last sample found the MIG device idle, 0 busy; absent when unknown.",
            |m| m.idle.map(u32::from),
        )?;

        let mut xids = encoder.encode_descriptor(
            "gpupool_gpu_xid_errors",
            "Xid events seen since the agent started.",
            None,
            MetricType::Counter,
        )?;
        for (&(gpu, xid), &n) in &f.xids {
            let labels = XidLabels {
                node: node.to_owned(),
                gpu,
                uuid: f.gpus.get(&gpu).map(|g| g.uuid.clone()).unwrap_or_default(),
                xid,
                fatal: crate::xid::is_fatal(xid),
            };
            ConstCounter::new(n).encode(xids.encode_family(&labels)?)?;
        }

        node_gauge(
            &mut encoder,
            node,
            "gpupool_driver_validated",
            "1 when every driver check passed.",
            u32::from(f.validated),
        )?;
        node_counter(
            &mut encoder,
            node,
            "gpupool_status_writes",
            "GpuNode status writes.",
            f.status_writes,
        )?;
        node_counter(
            &mut encoder,
            node,
            "gpupool_cdi_spec_writes",
            "CDI spec file writes.",
            f.cdi_writes,
        )?;
        if let Some(ready) = f.cdi_spec_ready {
            node_gauge(
                &mut encoder,
                node,
                "gpupool_cdi_spec_ready",
                "1 when the CDI spec the runtime reads is as the agent wrote it and no other spec claims its devices.",
                u32::from(ready),
            )?;
        }
        if let Some(n) = f.foreign_device_plugins {
            node_gauge(
                &mut encoder,
                node,
                "gpupool_foreign_device_plugins",
                "Sockets of other device plugins live on the node for NVIDIA resources (0 when gpupool is the only one).",
                n,
            )?;
        }
        // Ages are taken at scrape time, so they keep growing while the loop is stuck.
        if let Some(at) = f.last_sample {
            node_gauge(
                &mut encoder,
                node,
                "gpupool_agent_last_sample_age_seconds",
                "Seconds since a utilization sample last returned figures.",
                at.elapsed().as_secs_f64(),
            )?;
        }
        if let Some(at) = f.last_status_write {
            node_gauge(
                &mut encoder,
                node,
                "gpupool_agent_last_status_write_age_seconds",
                "Seconds since the agent last wrote its GpuNode status (a change or a heartbeat).",
                at.elapsed().as_secs_f64(),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use gpupool_telemetry::testing::request;
    use tokio::net::TcpListener;

    use super::*;

    fn sample() -> Figures {
        let mut f = Figures {
            node: "gpu-node-0".into(),
            ..Figures::default()
        };
        f.gpus.insert(
            0,
            GpuFigures {
                uuid: "GPU-0".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                utilization_percent: Some(42),
                memory_used_mib: Some(1),
                healthy: true,
                temperature_c: Some(38),
            },
        );
        f.xids.insert((0, 79), 2);
        f
    }

    /// Serves `metrics` on a free loopback port until the returned token is cancelled.
    async fn start(metrics: &Arc<AgentMetrics>) -> (SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        tokio::spawn(gpupool_telemetry::serve_on(
            listener,
            Arc::new(metrics.http_state()),
            cancel.clone(),
        ));
        (addr, cancel)
    }

    #[test]
    fn a_silent_loop_fails_liveness() {
        use std::time::Duration;
        let h = Heartbeat::default();
        h.set_stall_after(Duration::from_secs(120));
        // Starting: no beat yet.
        assert_eq!(h.check_at(Duration::from_secs(10_000)), Ok(()));
        h.beat();
        let at = h.origin.elapsed();
        assert_eq!(h.check_at(at + Duration::from_secs(120)), Ok(()));
        let err = h.check_at(at + Duration::from_secs(181)).unwrap_err();
        assert!(
            err.contains("no progress for 181s") && err.contains("limit 120s"),
            "{err}"
        );
        // A beat brings it back.
        h.beat();
        assert_eq!(h.check_at(h.origin.elapsed()), Ok(()));
        // The limit is never under two beat intervals.
        h.set_stall_after(Duration::from_secs(1));
        let at = h.origin.elapsed();
        assert_eq!(h.check_at(at + Duration::from_secs(59)), Ok(()));
    }

    #[tokio::test]
    async fn endpoints() {
        let m = Arc::new(AgentMetrics::default());
        m.set(sample());
        let (addr, cancel) = start(&m).await;
        let answer = |line: &'static str| async move { request(addr, line).await.unwrap() };
        let body = answer("GET /metrics HTTP/1.1").await;
        assert!(body.starts_with("HTTP/1.1 200"));
        let gpu = r#"node="gpu-node-0",gpu="0",uuid="GPU-0",model="NVIDIA H100 80GB HBM3""#;
        for line in [
            format!("gpupool_gpu_utilization_percent{{{gpu}}} 42"),
            format!("gpupool_gpu_memory_used_bytes{{{gpu}}} 1048576"),
            format!("gpupool_gpu_healthy{{{gpu}}} 1"),
            format!("gpupool_gpu_temperature_celsius{{{gpu}}} 38"),
            r#"gpupool_gpu_xid_errors_total{node="gpu-node-0",gpu="0",uuid="GPU-0",xid="79",fatal="true"} 2"#.into(),
        ] {
            assert!(body.contains(line.as_str()), "{line} missing in {body}");
        }
        assert!(
            body.to_ascii_lowercase().contains(&format!(
                "content-type: {}",
                gpupool_telemetry::METRICS_CONTENT_TYPE
            )),
            "{body}"
        );
        assert!(
            answer("GET /healthz HTTP/1.1")
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(
            answer("GET /readyz HTTP/1.1")
                .await
                .starts_with("HTTP/1.1 503")
        );
        m.ready.store(true, Ordering::Relaxed);
        assert!(
            answer("GET /readyz HTTP/1.1")
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(
            answer("GET /nope HTTP/1.1")
                .await
                .starts_with("HTTP/1.1 404")
        );
        assert!(
            answer("POST /metrics HTTP/1.1")
                .await
                .starts_with("HTTP/1.1 405")
        );
        cancel.cancel();
    }

    /// Every agent metric, byte for byte: the sample names and labels are the ones the agent
    /// exposed before it used prometheus-client.
    #[test]
    fn renders_every_metric() {
        let m = Arc::new(AgentMetrics::default());
        let mut f = sample();
        f.gpus.insert(
            1,
            GpuFigures {
                uuid: "GPU-1".into(),
                model: "NVIDIA A100-SXM4-80GB".into(),
                utilization_percent: Some(0),
                memory_used_mib: Some(40_960),
                healthy: false,
                temperature_c: Some(71),
            },
        );
        f.xids.insert((1, 48), 1);
        f.xids.insert((1, 13), 4);
        f.mig_devices.insert(
            "MIG-a".into(),
            MigFigures {
                gpu: 1,
                profile: "1g.10gb".into(),
                healthy: true,
                memory_used_mib: Some(2),
                idle: Some(true),
            },
        );
        f.mig_devices.insert(
            "MIG-b".into(),
            MigFigures {
                gpu: 1,
                profile: "3g.40gb".into(),
                healthy: false,
                memory_used_mib: None,
                idle: None,
            },
        );
        f.validated = true;
        f.status_writes = 3;
        f.cdi_writes = 1;
        f.cdi_spec_ready = Some(true);
        f.foreign_device_plugins = Some(1);
        m.set(f);
        PluginMetrics::inc(&m.plugin.registrations);
        PluginMetrics::inc(&m.plugin.allocations);
        PluginMetrics::inc(&m.plugin.allocations);
        PluginMetrics::inc(&m.plugin.allocation_errors);
        PluginMetrics::inc(&m.plugin.health_unhealthy_transitions);
        // Not exposed: only the six counters above ever were.
        PluginMetrics::inc(&m.plugin.server_starts);

        let text = gpupool_telemetry::encode(&m.registry()).unwrap();
        let expected = "\
# HELP gpupool_plugin_registrations Kubelet device plugin counter.
# TYPE gpupool_plugin_registrations counter
gpupool_plugin_registrations_total 1
# HELP gpupool_plugin_registration_failures Kubelet device plugin counter.
# TYPE gpupool_plugin_registration_failures counter
gpupool_plugin_registration_failures_total 0
# HELP gpupool_plugin_allocations Kubelet device plugin counter.
# TYPE gpupool_plugin_allocations counter
gpupool_plugin_allocations_total 2
# HELP gpupool_plugin_allocation_errors Kubelet device plugin counter.
# TYPE gpupool_plugin_allocation_errors counter
gpupool_plugin_allocation_errors_total 1
# HELP gpupool_plugin_health_unhealthy_transitions Kubelet device plugin counter.
# TYPE gpupool_plugin_health_unhealthy_transitions counter
gpupool_plugin_health_unhealthy_transitions_total 1
# HELP gpupool_plugin_health_healthy_transitions Kubelet device plugin counter.
# TYPE gpupool_plugin_health_healthy_transitions counter
gpupool_plugin_health_healthy_transitions_total 0
# HELP gpupool_gpu_utilization_percent SM utilization of a whole GPU.
# TYPE gpupool_gpu_utilization_percent gauge
gpupool_gpu_utilization_percent{node=\"gpu-node-0\",gpu=\"0\",uuid=\"GPU-0\",model=\"NVIDIA H100 80GB HBM3\"} 42
gpupool_gpu_utilization_percent{node=\"gpu-node-0\",gpu=\"1\",uuid=\"GPU-1\",model=\"NVIDIA A100-SXM4-80GB\"} 0
# HELP gpupool_gpu_memory_used_bytes GPU memory used by compute processes.
# TYPE gpupool_gpu_memory_used_bytes gauge
gpupool_gpu_memory_used_bytes{node=\"gpu-node-0\",gpu=\"0\",uuid=\"GPU-0\",model=\"NVIDIA H100 80GB HBM3\"} 1048576
gpupool_gpu_memory_used_bytes{node=\"gpu-node-0\",gpu=\"1\",uuid=\"GPU-1\",model=\"NVIDIA A100-SXM4-80GB\"} 42949672960
# HELP gpupool_gpu_healthy 1 when the GPU has no health fault.
# TYPE gpupool_gpu_healthy gauge
gpupool_gpu_healthy{node=\"gpu-node-0\",gpu=\"0\",uuid=\"GPU-0\",model=\"NVIDIA H100 80GB HBM3\"} 1
gpupool_gpu_healthy{node=\"gpu-node-0\",gpu=\"1\",uuid=\"GPU-1\",model=\"NVIDIA A100-SXM4-80GB\"} 0
# HELP gpupool_gpu_temperature_celsius GPU temperature.
# TYPE gpupool_gpu_temperature_celsius gauge
gpupool_gpu_temperature_celsius{node=\"gpu-node-0\",gpu=\"0\",uuid=\"GPU-0\",model=\"NVIDIA H100 80GB HBM3\"} 38
gpupool_gpu_temperature_celsius{node=\"gpu-node-0\",gpu=\"1\",uuid=\"GPU-1\",model=\"NVIDIA A100-SXM4-80GB\"} 71
# HELP gpupool_mig_device_healthy 1 when the MIG device has no health fault.
# TYPE gpupool_mig_device_healthy gauge
gpupool_mig_device_healthy{node=\"gpu-node-0\",gpu=\"1\",uuid=\"MIG-a\",profile=\"1g.10gb\"} 1
gpupool_mig_device_healthy{node=\"gpu-node-0\",gpu=\"1\",uuid=\"MIG-b\",profile=\"3g.40gb\"} 0
# HELP gpupool_mig_device_memory_used_bytes MIG device memory used by compute processes.
# TYPE gpupool_mig_device_memory_used_bytes gauge
gpupool_mig_device_memory_used_bytes{node=\"gpu-node-0\",gpu=\"1\",uuid=\"MIG-a\",profile=\"1g.10gb\"} 2097152
# HELP gpupool_mig_device_idle 1 when the last sample found the MIG device idle, 0 busy; absent when unknown.
# TYPE gpupool_mig_device_idle gauge
gpupool_mig_device_idle{node=\"gpu-node-0\",gpu=\"1\",uuid=\"MIG-a\",profile=\"1g.10gb\"} 1
# HELP gpupool_gpu_xid_errors Xid events seen since the agent started.
# TYPE gpupool_gpu_xid_errors counter
gpupool_gpu_xid_errors_total{node=\"gpu-node-0\",gpu=\"0\",uuid=\"GPU-0\",xid=\"79\",fatal=\"true\"} 2
gpupool_gpu_xid_errors_total{node=\"gpu-node-0\",gpu=\"1\",uuid=\"GPU-1\",xid=\"13\",fatal=\"false\"} 4
gpupool_gpu_xid_errors_total{node=\"gpu-node-0\",gpu=\"1\",uuid=\"GPU-1\",xid=\"48\",fatal=\"true\"} 1
# HELP gpupool_driver_validated 1 when every driver check passed.
# TYPE gpupool_driver_validated gauge
gpupool_driver_validated{node=\"gpu-node-0\"} 1
# HELP gpupool_status_writes GpuNode status writes.
# TYPE gpupool_status_writes counter
gpupool_status_writes_total{node=\"gpu-node-0\"} 3
# HELP gpupool_cdi_spec_writes CDI spec file writes.
# TYPE gpupool_cdi_spec_writes counter
gpupool_cdi_spec_writes_total{node=\"gpu-node-0\"} 1
# HELP gpupool_cdi_spec_ready 1 when the CDI spec the runtime reads is as the agent wrote it and no other spec claims its devices.
# TYPE gpupool_cdi_spec_ready gauge
gpupool_cdi_spec_ready{node=\"gpu-node-0\"} 1
# HELP gpupool_foreign_device_plugins Sockets of other device plugins live on the node for NVIDIA resources (0 when gpupool is the only one).
# TYPE gpupool_foreign_device_plugins gauge
gpupool_foreign_device_plugins{node=\"gpu-node-0\"} 1
# EOF
";
        assert_eq!(text, expected);
    }

    /// The ages grow at scrape time: a stuck loop that sets no new figures still shows them
    /// growing.
    #[test]
    fn ages_are_taken_at_scrape_time() {
        let m = Arc::new(AgentMetrics::default());
        let long_ago = Instant::now()
            .checked_sub(std::time::Duration::from_secs(600))
            .unwrap();
        m.set(Figures {
            node: "n".into(),
            last_sample: Some(long_ago),
            last_status_write: Some(Instant::now()),
            ..Figures::default()
        });
        let text = gpupool_telemetry::encode(&m.registry()).unwrap();
        let age = |name: &str| -> f64 {
            let prefix = format!("{name}{{node=\"n\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .unwrap_or_else(|| panic!("no {name} in {text}"))
                .parse()
                .unwrap()
        };
        assert!(age("gpupool_agent_last_sample_age_seconds") >= 600.0);
        assert!(age("gpupool_agent_last_status_write_age_seconds") < 600.0);
    }

    /// A value the agent does not have is absent, not zero; `gpupool_gpu_healthy` is always
    /// there for a known GPU.
    #[test]
    fn absent_values_are_absent() {
        let m = Arc::new(AgentMetrics::default());
        let mut f = Figures::default();
        f.gpus.insert(
            3,
            GpuFigures {
                healthy: true,
                ..GpuFigures::default()
            },
        );
        m.set(f);
        let text = gpupool_telemetry::encode(&m.registry()).unwrap();
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpupool_gpu_"))
            .collect();
        assert_eq!(
            samples,
            ["gpupool_gpu_healthy{node=\"\",gpu=\"3\",uuid=\"\",model=\"\"} 1"]
        );

        // The figures are replaced whole: a GPU gone from the inventory leaves no series.
        m.set(Figures::default());
        let text = gpupool_telemetry::encode(&m.registry()).unwrap();
        assert!(!text.contains("gpu=\""), "{text}");
        assert!(
            text.contains("gpupool_driver_validated{node=\"\"} 0\n"),
            "{text}"
        );
        // No sample and no write yet: no age.
        assert!(!text.contains("_age_seconds"), "{text}");
    }
}
