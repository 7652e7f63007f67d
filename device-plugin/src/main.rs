//! `gpupool-device-plugin`: the gpupool node agent. Runs on every GPU node; see `agent/mod.rs`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::builder::{OsStringValueParser, TypedValueParser};
use clap::{Parser, ValueEnum};
use gpupool_device_plugin::agent::{Agent, AgentConfig};
use gpupool_device_plugin::backend::{
    GpuBackend, NvmlBackend, NvmlOptions, SimBackend, SystemSimClock,
};
use gpupool_device_plugin::cdi::root::NVML_SONAME;
use gpupool_device_plugin::cdi::{DriverRoot, find_nvml_library};
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
    #[arg(long, env = "NODE_NAME", required_unless_present = "stop_mps_daemons")]
    node_name: Option<String>,
    /// Stop the MPS control daemons recorded under `--mps-root` (told `quit`, killed if they
    /// linger) and exit: for uninstall, since the agent's shutdown leaves them running for the
    /// next agent to take over. Their clients lose their server.
    #[arg(long)]
    stop_mps_daemons: bool,
    /// GPU backend.
    #[arg(long, env = "GPUPOOL_BACKEND", value_enum, default_value = "nvml")]
    backend: BackendKind,
    /// Fixture for the simulated backend.
    #[arg(long, env = "GPUPOOL_FIXTURE", required_if_eq("backend", "sim"))]
    fixture: Option<PathBuf>,
    /// NVML library to load (path or file name). By default, with `--host-root`, the driver
    /// root's `libnvidia-ml.so.1` by full path (found through its ld.so.cache, else the usual
    /// library directories); without it, `libnvidia-ml.so.1` through the loader's path.
    #[arg(long, env = "GPUPOOL_NVML_LIBRARY")]
    nvml_lib: Option<PathBuf>,
    /// Kubelet root directory (device plugin sockets live in `<dir>/device-plugins`).
    #[arg(long, env = "GPUPOOL_KUBELET_DIR", default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// Kubelet PodResources socket; `<kubelet-dir>/pod-resources/kubelet.sock` by default.
    #[arg(long, env = "GPUPOOL_POD_RESOURCES_SOCKET")]
    pod_resources_socket: Option<PathBuf>,
    /// Declares that this host runs no kubelet (the demo's simulated nodes): no pod can hold a
    /// device, so MIG and sharing changes need not wait for PodResources. Never on a real
    /// node, where a missing socket is a fault that holds every such change.
    #[arg(
        long,
        env = "GPUPOOL_NO_KUBELET",
        conflicts_with = "pod_resources_socket"
    )]
    no_kubelet: bool,
    /// Overrides the GpuNode's `cdi.specDir`.
    #[arg(long, env = "GPUPOOL_CDI_DIR")]
    cdi_dir: Option<PathBuf>,
    /// Overrides the GpuNode's `cdi.driverRoot`.
    #[arg(long, env = "GPUPOOL_DRIVER_ROOT")]
    driver_root: Option<PathBuf>,
    /// The driver roots (comma-separated, plain absolute paths) a GpuNode's `cdi.driverRoot`
    /// may name on this node. The agent runs the driver's programs and mounts its libraries
    /// into every GPU container from that root, so any other is refused: the DriverRootTrusted
    /// check fails, an Event says why, and the node keeps the root it last trusted.
    /// `--driver-root` is trusted as it is.
    #[arg(long, env = "GPUPOOL_ALLOWED_DRIVER_ROOTS",
        default_value = gpupool_device_plugin::trust::DEFAULT_ALLOWED_DRIVER_ROOTS,
        value_parser = |s: &str| gpupool_device_plugin::trust::AllowedRoots::parse(s).map_err(|e| e.to_string()))]
    allowed_driver_roots: gpupool_device_plugin::trust::AllowedRoots,
    /// Where the host's `/` is mounted in this container (the chart: `/host`). The driver
    /// root is read under it, NVML is loaded from it, and the CDI spec still names host
    /// paths, so the agent runs on its own image's libraries whatever the host's are.
    #[arg(long, env = "GPUPOOL_HOST_ROOT")]
    host_root: Option<PathBuf>,
    /// Where the host's `/proc` is mounted.
    #[arg(long, env = "GPUPOOL_PROC_ROOT", default_value = "/proc")]
    proc_root: PathBuf,
    /// The host's `/proc`, where the agent reads its own `status` to tell whether it runs in
    /// the host's PID namespace (the GPU process lists are the host's only then: the chart's
    /// `agent.hostPID`). Default: `proc` under `--host-root` (else `/proc`). When it is not, or
    /// this cannot be read, the HostPIDNamespace check fails, activity is Unknown and MIG and
    /// sharing changes hold.
    #[arg(long, env = "GPUPOOL_HOST_PROC_ROOT")]
    host_proc_root: Option<PathBuf>,
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
    /// Seconds without progress of the agent's loop (a driver call that never returns) after
    /// which `/healthz` fails and the kubelet restarts the agent; at least 60.
    #[arg(long, env = "GPUPOOL_LIVENESS_STALL_SECS", default_value_t = 180)]
    liveness_stall_secs: u64,
    /// Longest time between two GpuNode status writes, in seconds, even when nothing changed:
    /// the heartbeat by which the operator tells a live agent from a dead or cut-off one (it
    /// calls an agent stale after 180 s without one). 10 to 60.
    #[arg(long, env = "GPUPOOL_HEARTBEAT_SECS", default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(10..=60))]
    heartbeat_secs: u64,
    /// Where the MPS control daemons keep their pipe, log and shared-memory directories, one
    /// directory per GPU, in the host's terms (mounted writable under the host root).
    #[arg(long, env = "GPUPOOL_MPS_ROOT", default_value = gpupool_device_plugin::agent::mps::DEFAULT_MPS_ROOT)]
    mps_root: PathBuf,
    /// The cgroup (v2), in the host's terms, that each MPS control daemon is moved into, so
    /// that stopping the agent's container (whose whole cgroup is killed) leaves the daemons
    /// and their clients running for the next agent to take over. Created beneath an existing
    /// cgroup. Default: `/sys/fs/cgroup/gpupool-mps` with `--host-root` (read under it), else
    /// none; an empty value turns it off. A daemon that cannot be moved still runs (logged).
    #[arg(long, env = "GPUPOOL_MPS_CGROUP",
        value_parser = OsStringValueParser::new().map(PathBuf::from))]
    mps_cgroup: Option<PathBuf>,
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
            library: nvml_library(cli)?,
        })
        .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
        .map_err(|e| e.to_string()),
    }
}

/// The NVML library to load: `--nvml-lib`, else (with `--host-root`) the driver root's, by
/// full path, so that it is never looked for on the image's own loader path. The driver root
/// is `--driver-root`, else the first of the node's trusted roots (`--allowed-driver-roots`,
/// `/` last: a containerized driver before one on the host) that holds NVML.
fn nvml_library(cli: &Cli) -> Result<Option<PathBuf>, String> {
    if let Some(lib) = &cli.nvml_lib {
        return Ok(Some(lib.clone()));
    }
    let Some(host_root) = &cli.host_root else {
        return Ok(None);
    };
    let candidates: Vec<PathBuf> = match &cli.driver_root {
        Some(root) => vec![root.clone()],
        None => cli
            .allowed_driver_roots
            .containerized_first()
            .filter_map(|r| cli.allowed_driver_roots.check(r, Some(host_root)).ok())
            .map(|r| r.path().to_path_buf())
            .collect(),
    };
    let mut looked = Vec::new();
    for driver_root in &candidates {
        let root = DriverRoot::new(Some(host_root), driver_root).map_err(|e| e.to_string())?;
        if let Some(lib) = find_nvml_library(root.local()) {
            tracing::info!(driver_root = %driver_root.display(), library = %lib.display(), "NVML found");
            return Ok(Some(lib));
        }
        looked.push(format!(
            "{} (read at {})",
            driver_root.display(),
            root.local().display()
        ));
    }
    Err(format!(
        "no {NVML_SONAME} in driver root {}: neither its ld.so.cache nor the usual library \
         directories lead to one; is the driver installed there (else set --driver-root, the \
         chart's agent.hostPaths.driverRoot)?",
        looked.join(" or ")
    ))
}

/// The agent's settings from the command line.
fn agent_config(cli: &Cli) -> AgentConfig {
    AgentConfig {
        // Required by the parser unless --stop-mps-daemons, which builds no AgentConfig.
        node_name: cli.node_name.clone().unwrap_or_default(),
        pod_source: if cli.no_kubelet {
            gpupool_device_plugin::podresources::PodSource::NoKubelet
        } else {
            gpupool_device_plugin::podresources::PodSource::Kubelet(
                cli.pod_resources_socket
                    .clone()
                    .unwrap_or_else(|| cli.kubelet_dir.join("pod-resources/kubelet.sock")),
            )
        },
        kubelet_dir: cli.kubelet_dir.clone(),
        cdi_dir: cli.cdi_dir.clone(),
        driver_root: cli.driver_root.clone(),
        allowed_driver_roots: cli.allowed_driver_roots.clone(),
        host_root: cli.host_root.clone(),
        proc_root: cli.proc_root.clone(),
        host_proc_root: cli.host_proc_root.clone().unwrap_or_else(|| {
            gpupool_device_plugin::pidns::default_host_proc(cli.host_root.as_deref())
        }),
        kmsg_path: cli.kmsg_path.clone(),
        validate_interval: Duration::from_secs(cli.validate_interval_secs.max(1)),
        drain_timeout: Duration::from_secs(cli.drain_timeout_secs),
        mig_step_delay: Duration::from_millis(cli.mig_step_delay_ms),
        idle_samples: cli.idle_samples,
        health_hold_down: Duration::from_secs(cli.health_recovery_hold_down_secs),
        heartbeat: Duration::from_secs(cli.heartbeat_secs),
        mps_root: cli.mps_root.clone(),
        mps_cgroup: mps_cgroup(cli),
    }
}

/// `--stop-mps-daemons`: stops the daemons recorded under the MPS root.
async fn stop_mps_daemons(cli: &Cli) -> Result<()> {
    use gpupool_device_plugin::agent::mps::{MpsJob, MpsPaths, Takeover};
    let mut job = MpsJob::new(MpsPaths {
        root: cli.mps_root.clone(),
        host_root: cli.host_root.clone(),
        driver_root: cli
            .driver_root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/")),
        private_shm: true,
    });
    job.set_takeover(Takeover {
        proc_root: cli.proc_root.clone(),
        cgroup: None,
    });
    let (stopped, not) = job.stop_recorded().await;
    tracing::info!(?stopped, ?not, "MPS control daemons stopped");
    Ok(())
}

/// The default MPS daemons' cgroup: a container's (`--host-root`) must leave its own.
const DEFAULT_MPS_CGROUP: &str = "/sys/fs/cgroup/gpupool-mps";

/// `--mps-cgroup`, defaulted (see its help).
fn mps_cgroup(cli: &Cli) -> Option<PathBuf> {
    match &cli.mps_cgroup {
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p.clone()),
        None => cli
            .host_root
            .as_ref()
            .map(|_| PathBuf::from(DEFAULT_MPS_CGROUP)),
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

    if cli.stop_mps_daemons {
        return stop_mps_daemons(&cli).await;
    }
    let backend = open_backend(&cli);
    if let Err(e) = &backend {
        tracing::error!(error = %e, "GPU backend unavailable; reporting it as a failed NVMLInit check");
    }
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (KUBECONFIG or in-cluster config)")?;
    let config = agent_config(&cli);
    let metrics = Arc::new(AgentMetrics::default());
    metrics
        .heartbeat
        .set_stall_after(Duration::from_secs(cli.liveness_stall_secs));
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
    fn mps_daemons_leave_a_containers_cgroup_unless_told_otherwise() {
        assert_eq!(agent_config(&parse(&[])).mps_cgroup, None);
        assert_eq!(
            agent_config(&parse(&["--host-root", "/host"])).mps_cgroup,
            Some(PathBuf::from("/sys/fs/cgroup/gpupool-mps"))
        );
        assert_eq!(
            agent_config(&parse(&["--host-root", "/host", "--mps-cgroup", ""])).mps_cgroup,
            None
        );
        assert_eq!(
            agent_config(&parse(&["--mps-cgroup", "/sys/fs/cgroup/mps"])).mps_cgroup,
            Some(PathBuf::from("/sys/fs/cgroup/mps"))
        );
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

    #[test]
    fn nvml_comes_from_the_driver_root_under_the_host_root() {
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path();
        let lib_dir = host.join("run/nvidia/driver/usr/lib64");
        std::fs::create_dir_all(&lib_dir).unwrap();
        let host_arg = host.to_str().unwrap();
        let flags = [
            "--host-root",
            host_arg,
            "--driver-root",
            "/run/nvidia/driver",
        ];
        // Nothing there: a clear error naming the driver root, not a fall back to the
        // image's own loader path.
        let err = nvml_library(&parse(&flags)).unwrap_err();
        assert!(err.contains("/run/nvidia/driver"), "{err}");
        std::fs::write(lib_dir.join("libnvidia-ml.so.550.54.15"), b"").unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.550.54.15", lib_dir.join(NVML_SONAME)).unwrap();
        let found = nvml_library(&parse(&flags)).unwrap().unwrap();
        assert_eq!(
            found,
            std::fs::canonicalize(lib_dir.join("libnvidia-ml.so.550.54.15")).unwrap()
        );
        // An explicit library wins; without a host root the loader finds it by name.
        let explicit = [&flags[..], &["--nvml-lib", "/opt/libnvidia-ml.so.1"]].concat();
        assert_eq!(
            nvml_library(&parse(&explicit)).unwrap(),
            Some(PathBuf::from("/opt/libnvidia-ml.so.1"))
        );
        assert_eq!(nvml_library(&parse(&[])).unwrap(), None);
        // Without --driver-root: a containerized driver's root first, then the host's.
        let auto = ["--host-root", host_arg];
        assert_eq!(nvml_library(&parse(&auto)).unwrap(), Some(found.clone()));
        let host_lib = host.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&host_lib).unwrap();
        std::fs::write(host_lib.join(NVML_SONAME), b"").unwrap();
        assert_eq!(nvml_library(&parse(&auto)).unwrap(), Some(found.clone()));
        std::fs::remove_dir_all(host.join("run")).unwrap();
        assert_eq!(
            nvml_library(&parse(&auto)).unwrap(),
            Some(std::fs::canonicalize(host_lib.join(NVML_SONAME)).unwrap())
        );
        std::fs::remove_file(host_lib.join(NVML_SONAME)).unwrap();
        let err = nvml_library(&parse(&auto)).unwrap_err();
        assert!(
            err.contains("/run/nvidia/driver (read at") && err.contains(" or / (read at"),
            "{err}"
        );
        assert_eq!(
            agent_config(&parse(&flags)).host_root,
            Some(host.to_path_buf())
        );
    }
}
