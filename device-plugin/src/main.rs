//! `gpupool-device-plugin`: the gpupool node agent. Runs on every GPU node; see `agent/mod.rs`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use gpupool_device_plugin::agent::{Agent, AgentConfig};
use gpupool_device_plugin::backend::{
    GpuBackend, NvmlBackend, NvmlOptions, SimBackend, SystemSimClock,
};
use gpupool_device_plugin::kmsg;
use gpupool_device_plugin::metrics_http::{self, AgentMetrics};
use tokio_util::sync::CancellationToken;

/// Which GPUs the agent talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// The NVIDIA driver through NVML.
    Nvml,
    /// Simulated GPUs from a YAML fixture (tests, demos).
    Sim,
}

/// gpupool node agent: validates the driver, applies the MIG layout, writes the CDI spec, serves
/// the kubelet device plugins and reports GpuNode status for this node.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// This node's name (the GpuNode and Node the agent works on).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// GPU backend.
    #[arg(long, env = "GPUPOOL_BACKEND", value_enum, default_value = "nvml")]
    backend: BackendKind,
    /// Fixture for the simulated backend.
    #[arg(long, env = "GPUPOOL_FIXTURE", required_if_eq("backend", "sim"))]
    fixture: Option<PathBuf>,
    /// NVML library to load (path or file name); the driver's `libnvidia-ml.so` by default.
    #[arg(long, env = "GPUPOOL_NVML_LIBRARY")]
    nvml_lib: Option<PathBuf>,
    /// Kubelet root directory (device plugin sockets live in `<dir>/device-plugins`).
    #[arg(long, env = "GPUPOOL_KUBELET_DIR", default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// Kubelet PodResources socket; `<kubelet-dir>/pod-resources/kubelet.sock` by default.
    #[arg(long, env = "GPUPOOL_POD_RESOURCES_SOCKET")]
    pod_resources_socket: Option<PathBuf>,
    /// Overrides the GpuNode's `cdi.specDir`.
    #[arg(long, env = "GPUPOOL_CDI_DIR")]
    cdi_dir: Option<PathBuf>,
    /// Overrides the GpuNode's `cdi.driverRoot`.
    #[arg(long, env = "GPUPOOL_DRIVER_ROOT")]
    driver_root: Option<PathBuf>,
    /// Where the host's `/proc` is mounted.
    #[arg(long, env = "GPUPOOL_PROC_ROOT", default_value = "/proc")]
    proc_root: PathBuf,
    /// The kernel log, scanned (non-blocking) for NVIDIA Xid records since boot; when it cannot
    /// be read, the XidErrors check counts only Xids since the agent started, and says so.
    #[arg(long, env = "GPUPOOL_KMSG_PATH", default_value = kmsg::DEFAULT_KMSG_PATH)]
    kmsg_path: PathBuf,
    /// Address of `/metrics`, `/healthz`, `/readyz`.
    #[arg(long, env = "GPUPOOL_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Seconds between driver validation runs (health events also trigger one).
    #[arg(long, env = "GPUPOOL_VALIDATE_INTERVAL_SECS", default_value_t = 300)]
    validate_interval_secs: u64,
    /// Seconds to wait for GPU pods to leave before a MIG change fails.
    #[arg(long, env = "GPUPOOL_DRAIN_TIMEOUT_SECS", default_value_t = 600)]
    drain_timeout_secs: u64,
    /// Consecutive idle samples before a device counts as idle.
    #[arg(long, env = "GPUPOOL_IDLE_SAMPLES", default_value_t = 2)]
    idle_samples: u32,
    /// Seconds a device stays Unhealthy after its fault was seen to clear (a GPU reset, say)
    /// before it is advertised again; a new fault meanwhile starts it over.
    #[arg(
        long,
        env = "GPUPOOL_HEALTH_RECOVERY_HOLD_DOWN_SECS",
        alias = "health-recovery-hold-down",
        default_value_t = 300
    )]
    health_recovery_hold_down_secs: u64,
    /// Pause between MIG operations, in milliseconds (for tests that watch `Applying`).
    #[arg(
        long,
        env = "GPUPOOL_MIG_STEP_DELAY_MS",
        default_value_t = 0,
        hide = true
    )]
    mig_step_delay_ms: u64,
    /// Log as JSON lines.
    #[arg(long, env = "GPUPOOL_LOG_JSON")]
    log_json: bool,
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn open_backend(cli: &Cli) -> Result<Arc<dyn GpuBackend>, String> {
    match cli.backend {
        BackendKind::Sim => {
            let fixture = cli
                .fixture
                .as_deref()
                .ok_or("--fixture is required with --backend sim")?;
            SimBackend::from_file(fixture, Arc::new(SystemSimClock::new()))
                .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
                .map_err(|e| e.to_string())
        }
        BackendKind::Nvml => NvmlBackend::new(&NvmlOptions {
            library: cli.nvml_lib.clone(),
        })
        .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
        .map_err(|e| e.to_string()),
    }
}

/// The agent's settings from the command line.
fn agent_config(cli: &Cli) -> AgentConfig {
    AgentConfig {
        node_name: cli.node_name.clone(),
        pod_resources_socket: cli
            .pod_resources_socket
            .clone()
            .unwrap_or_else(|| cli.kubelet_dir.join("pod-resources/kubelet.sock")),
        kubelet_dir: cli.kubelet_dir.clone(),
        cdi_dir: cli.cdi_dir.clone(),
        driver_root: cli.driver_root.clone(),
        proc_root: cli.proc_root.clone(),
        kmsg_path: cli.kmsg_path.clone(),
        validate_interval: Duration::from_secs(cli.validate_interval_secs.max(1)),
        drain_timeout: Duration::from_secs(cli.drain_timeout_secs),
        mig_step_delay: Duration::from_millis(cli.mig_step_delay_ms),
        idle_samples: cli.idle_samples,
        health_hold_down: Duration::from_secs(cli.health_recovery_hold_down_secs),
    }
}

async fn shutdown_signal(cancel: CancellationToken) {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
    tracing::info!("shutting down");
    cancel.cancel();
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_json);
    // The CDI crate's schema validator brings rustls with aws-lc-rs next to kube's ring; with
    // two providers compiled in, rustls needs the process default chosen explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();

    let backend = open_backend(&cli);
    if let Err(e) = &backend {
        tracing::error!(error = %e, "GPU backend unavailable; reporting it as a failed NVMLInit check");
    }
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (KUBECONFIG or in-cluster config)")?;
    let config = agent_config(&cli);
    let metrics = Arc::new(AgentMetrics::default());
    let cancel = CancellationToken::new();
    tokio::spawn(shutdown_signal(cancel.clone()));
    let http = tokio::spawn(metrics_http::serve(
        cli.metrics_addr,
        metrics.clone(),
        cancel.clone(),
    ));
    let agent = Agent::new(config, client, backend, metrics);
    let result = agent.run(cancel.clone()).await;
    cancel.cancel();
    match http.await {
        Ok(Err(e)) => tracing::warn!(error = %e, "metrics endpoint"),
        Err(e) => tracing::warn!(error = %e, "metrics task"),
        Ok(Ok(())) => {}
    }
    result.context("node agent")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        let argv = ["gpupool-device-plugin", "--node-name", "gpu-0"]
            .iter()
            .chain(args)
            .copied();
        Cli::try_parse_from(argv).unwrap()
    }

    #[test]
    fn health_recovery_hold_down_reaches_the_health_policy() {
        let default = agent_config(&parse(&[])).health_policy();
        assert_eq!(default.hold_down, Duration::from_secs(300));
        assert_eq!(default.recheck_interval, Duration::from_secs(30));
        for flag in [
            "--health-recovery-hold-down-secs",
            "--health-recovery-hold-down",
        ] {
            let policy = agent_config(&parse(&[flag, "45"])).health_policy();
            assert_eq!(policy.hold_down, Duration::from_secs(45), "{flag}");
            // Only the hold-down changes.
            assert_eq!(policy.ignored_xids, default.ignored_xids);
            assert_eq!(policy.recheck_interval, default.recheck_interval);
        }
        assert_eq!(
            agent_config(&parse(&["--health-recovery-hold-down-secs", "0"]))
                .health_policy()
                .hold_down,
            Duration::ZERO
        );
        let bad = Cli::try_parse_from([
            "gpupool-device-plugin",
            "--node-name",
            "gpu-0",
            "--health-recovery-hold-down-secs",
            "5m",
        ]);
        assert!(bad.is_err());
    }

    #[test]
    fn kmsg_path_defaults_to_dev_kmsg() {
        assert_eq!(
            agent_config(&parse(&[])).kmsg_path,
            PathBuf::from("/dev/kmsg")
        );
        assert_eq!(
            agent_config(&parse(&["--kmsg-path", "/host/dev/kmsg"])).kmsg_path,
            PathBuf::from("/host/dev/kmsg")
        );
    }
}
