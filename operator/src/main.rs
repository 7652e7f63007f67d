//! gpupool-operator: the cluster controller.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use gpupool_operator::context::{InitialList, Settings};
use gpupool_operator::controller;
use gpupool_operator::http::{self, HttpState};
use gpupool_operator::lifecycle::{self, UninstallOptions};
use gpupool_operator::metrics::Metrics;
use gpupool_operator::startup;
use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// gpupool operator: reconciles GpuPools, aggregates GpuNode status, reclaims idle GPU pods.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Log as JSON lines.
    #[arg(long, env = "GPUPOOL_LOG_JSON")]
    log_json: bool,
    /// Log filter (tracing-subscriber EnvFilter syntax).
    #[arg(long, env = "GPUPOOL_LOG", default_value = "info")]
    log: String,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = "GPUPOOL_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Elect a leader through a Lease, so only one replica acts.
    #[arg(long, env = "GPUPOOL_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Name of the Lease.
    #[arg(long, env = "GPUPOOL_LEASE_NAME", default_value = "gpupool-operator")]
    lease_name: String,
    /// Namespace of the Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "gpupool-system")]
    lease_namespace: String,
    /// Identity in the Lease (the pod name); random when absent.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease is held without renewal before another replica may take it.
    #[arg(long, env = "GPUPOOL_LEASE_DURATION", default_value_t = 10)]
    lease_duration: u64,
    /// Seconds before expiry at which the holder renews.
    #[arg(long, env = "GPUPOOL_LEASE_GRACE", default_value_t = 3)]
    lease_grace: u64,
    /// Seconds between reclaim passes over a pool (GpuNode changes trigger passes too).
    #[arg(long, env = "GPUPOOL_RECLAIM_INTERVAL", default_value_t = 30)]
    reclaim_interval: u64,
    /// Seconds between full re-reconciles when nothing happens.
    #[arg(long, env = "GPUPOOL_RESYNC", default_value_t = 300)]
    resync: u64,
    /// Manage only GpuPools matching this label selector (e.g. to shard pools between
    /// operators); all by default.
    #[arg(long, env = "GPUPOOL_POOL_SELECTOR")]
    pool_selector: Option<String>,
    /// Seconds without a new heartbeat from a node's agent (agents write one at least every
    /// 60 s) after which its report is stale: the node is not ready, its GPUs are not counted
    /// healthy and nothing is reclaimed on it. At least 10; keep it a few times the agents'
    /// `--heartbeat-secs`.
    #[arg(long, env = "GPUPOOL_AGENT_STALE_SECS", default_value_t = 180,
        value_parser = clap::value_parser!(u64).range(10..))]
    agent_stale_secs: u64,
    /// Seconds between the samples of GpuNode status that count GPU-seconds allocated and
    /// idle (`gpupool_gpu_{allocated,idle}_seconds_total`); a change is counted to within one
    /// interval.
    #[arg(long, env = "GPUPOOL_ACCOUNTING_INTERVAL", default_value_t = 15,
        value_parser = clap::value_parser!(u64).range(1..))]
    accounting_interval: u64,
    /// How the caches list the cluster at start and on a relist: `paged` (500 objects a
    /// request, GpuNodes 50, pods 100), `cache` (one unpaged answer from the API server's
    /// cache: fewer requests, the whole list in memory at once) or `streaming` (objects one by
    /// one over a watch; needs the API server's WatchList feature, on by default since
    /// Kubernetes 1.32).
    #[arg(long, env = "GPUPOOL_INITIAL_LIST", value_enum, default_value_t = InitialList::Paged)]
    initial_list: InitialList,
    /// Seconds between heap trims, which hand the allocator's free pages back to the kernel so
    /// the resident set follows the heap down after the initial lists and large reconciles
    /// (`gpupool_operator_heap_bytes` shows what is in use and what is free); 0, the default,
    /// never trims (the e2e observability test failed intermittently with trims on).
    #[arg(long, env = "GPUPOOL_HEAP_TRIM_SECS", default_value_t = 0)]
    heap_trim_secs: u64,
    /// Blocks of this many KiB or more get mappings of their own, returned to the kernel when
    /// freed (list pages being decoded are the largest); glibc would otherwise raise the
    /// threshold as large blocks are freed and keep their pages in its arenas. 0 leaves glibc's
    /// dynamic threshold.
    #[arg(long, env = "GPUPOOL_HEAP_MMAP_THRESHOLD_KIB", default_value_t = 128)]
    heap_mmap_threshold_kib: usize,
    /// Seconds to wait for the CRDs to be Established at start.
    #[arg(long, env = "GPUPOOL_CRD_TIMEOUT", default_value_t = 60)]
    crd_timeout: u64,
    /// A one-off task instead of the controller (the chart's hooks run these).
    #[command(subcommand)]
    command: Option<Command>,
}

/// One-off tasks.
#[derive(Debug, Subcommand)]
enum Command {
    /// Before the operator is removed: deletes the GpuPools (those `--pool-selector` matches)
    /// and waits for the operator and agents to clean up; whatever is left after the timeout
    /// (finalizers, GpuNodes, `gpupool.io/*` node labels, the driver taint) it removes itself.
    Uninstall {
        /// Seconds the operator and the agents get before this cleans up itself.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// Applies a GpuPool (JSON: metadata.name, labels, spec) server-side as the chart's field
    /// manager: created when missing, updated in place otherwise, so its status stays.
    ApplyPool {
        /// The pool, as JSON.
        #[arg(long, env = "GPUPOOL_POOL_JSON")]
        pool_json: String,
    },
}

/// Runs a one-off task.
async fn run_command(command: &Command, args: &Args) -> Result<()> {
    let client = Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster or KUBECONFIG)")?;
    match command {
        Command::Uninstall { timeout_secs } => {
            let opts = UninstallOptions {
                pool_selector: args.pool_selector.clone(),
                timeout: Duration::from_secs(*timeout_secs),
                poll: Duration::from_secs(1),
            };
            let report = lifecycle::uninstall(client, &opts)
                .await
                .context("uninstall cleanup")?;
            info!(?report, "uninstall cleanup done");
        }
        Command::ApplyPool { pool_json } => {
            let pool: serde_json::Value =
                serde_json::from_str(pool_json).context("--pool-json is not JSON")?;
            let applied = lifecycle::apply_pool(client, &pool)
                .await
                .context("applying the default pool")?;
            info!(pool = %kube::ResourceExt::name_any(&applied), "default pool applied");
        }
    }
    Ok(())
}

fn init_logs(args: &Args) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .with_context(|| format!("invalid --log filter {:?}", args.log))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if args.log_json {
        builder.json().with_current_span(true).init();
    } else {
        builder.init();
    }
    Ok(())
}

fn on_signal(token: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    warn!(error = %e, "cannot listen for SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = term => info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => info!("interrupt: shutting down"),
        }
        token.cancel();
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    // Heap profile of the whole run, written when main returns (after SIGTERM).
    #[cfg(feature = "dhat-heap")]
    let _profiler = dhat::Profiler::builder()
        .file_name(std::env::var_os("GPUPOOL_DHAT_FILE").unwrap_or_else(|| "dhat-heap.json".into()))
        .build();
    init_logs(&args)?;
    if args.heap_mmap_threshold_kib > 0
        && !gpupool_operator::heap::fix_mmap_threshold(
            args.heap_mmap_threshold_kib.saturating_mul(1024),
        )
    {
        warn!(
            kib = args.heap_mmap_threshold_kib,
            "the allocator did not take the mmap threshold (not glibc, or too large)"
        );
    }
    // kube uses ring; when this binary is built together with the node agent (one workspace
    // build), feature unification also compiles rustls's aws-lc-rs provider in, and rustls then
    // refuses to pick a default on its own. Choose ring explicitly, as the agent does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Some(command) = &args.command {
        return run_command(command, &args).await;
    }
    if args.lease_grace >= args.lease_duration {
        bail!("--lease-grace must be shorter than --lease-duration");
    }
    let config = kube::Config::infer()
        .await
        .context("loading Kubernetes client config (in-cluster or KUBECONFIG)")?;
    let client = Client::try_from(config.clone()).context("building a Kubernetes client")?;
    let mut no_retry = config;
    no_retry.default_retry = false;
    let evict_client = Client::try_from(no_retry).context("building the eviction client")?;

    let shutdown = CancellationToken::new();
    let signals = on_signal(shutdown.clone());
    let metrics = Arc::new(Metrics::default());
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let state = Arc::new(HttpState::new(registry));
    let server = tokio::spawn(http::serve(args.http_addr, state.clone(), shutdown.clone()));
    let trimmer = (args.heap_trim_secs > 0).then(|| {
        tokio::spawn(gpupool_operator::heap::trim_every(Duration::from_secs(
            args.heap_trim_secs,
        )))
    });

    startup::wait_for_crds(client.clone(), Duration::from_secs(args.crd_timeout))
        .await
        .context("the gpupool CRDs are not available")?;
    state.ready.store(true, Ordering::Relaxed);
    info!("CRDs established");

    let settings = Settings {
        reclaim_interval: Duration::from_secs(args.reclaim_interval),
        resync: Duration::from_secs(args.resync),
        pool_selector: args.pool_selector.clone(),
        agent_stale_after: Duration::from_secs(args.agent_stale_secs),
        accounting_interval: Duration::from_secs(args.accounting_interval),
        initial_list: args.initial_list,
        ..Settings::default()
    };

    let result = if args.leader_elect {
        run_as_leader(
            &args,
            client,
            evict_client,
            metrics,
            settings,
            shutdown.clone(),
        )
        .await
    } else {
        metrics.leader.set(1);
        controller::run(client, evict_client, metrics, settings, shutdown.clone())
            .await
            .map_err(anyhow::Error::from)
    };
    shutdown.cancel();
    if let Some(trimmer) = trimmer {
        trimmer.abort();
    }
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error = %e, "the HTTP server failed"),
        Err(e) => error!(error = %e, "the HTTP server task failed"),
    }
    signals.abort();
    result
}

/// Leads whenever it holds the Lease: waits for it, runs the controller while it is held, and
/// when it is lost (another replica took it, say after a renewal the API answered too late)
/// stops the controller and stands by again. Standing by in the process, rather than exiting
/// for the supervisor to restart it, keeps a replica on hand: a process that exits can leave
/// none while its restart backs off, and nothing restarts a replica run outside a pod.
async fn run_as_leader(
    args: &Args,
    client: Client,
    evict_client: Client,
    metrics: Arc<Metrics>,
    settings: Settings,
    shutdown: CancellationToken,
) -> Result<()> {
    loop {
        let term = lead_once(
            args,
            client.clone(),
            evict_client.clone(),
            metrics.clone(),
            settings.clone(),
            shutdown.clone(),
        )
        .await?;
        match term {
            Term::Done => return Ok(()),
            Term::Lost => warn!("lost the leader Lease; the controller stopped, standing by"),
        }
    }
}

/// How one term of leadership ended.
enum Term {
    /// Shut down (or the controller finished): the process is done.
    Done,
    /// The Lease went to another identity; the controller has stopped.
    Lost,
}

/// One term: waits for the Lease and runs the controller until the Lease is lost or the
/// process shuts down.
async fn lead_once(
    args: &Args,
    client: Client,
    evict_client: Client,
    metrics: Arc<Metrics>,
    settings: Settings,
    shutdown: CancellationToken,
) -> Result<Term> {
    let mut builder = LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&args.lease_namespace)
        .with_duration(args.lease_duration)
        .with_grace(args.lease_grace)
        .with_field_manager("gpupool-operator-lease");
    if let Some(id) = &args.identity {
        builder = builder.with_identity(id);
    }
    let manager = builder
        .build()
        .await
        .context("setting up leader election")?;
    let (mut leading, lease_task) = manager.watch().await;
    info!(lease = %args.lease_name, namespace = %args.lease_namespace, "waiting to lead");
    loop {
        if *leading.borrow_and_update() {
            break;
        }
        tokio::select! {
            _ = shutdown.cancelled() => {
                drop(leading);
                let _ = lease_task.await;
                return Ok(Term::Done);
            }
            changed = leading.changed() => {
                changed.context("the leader election task stopped")?;
            }
        }
    }
    info!("leading: starting the controller");
    metrics.leader.set(1);
    let controller_stop = shutdown.child_token();
    let mut controller = tokio::spawn(controller::run(
        client,
        evict_client,
        metrics.clone(),
        settings,
        controller_stop.clone(),
    ));
    let outcome = tokio::select! {
        done = &mut controller => match done {
            Ok(r) => r.map(|()| Term::Done).map_err(anyhow::Error::from),
            Err(e) => Err(anyhow::Error::from(e).context("the controller task failed")),
        },
        () = async {
            loop {
                if leading.changed().await.is_err() || !*leading.borrow() {
                    break;
                }
            }
        } => {
            controller_stop.cancel();
            let _ = controller.await;
            Ok(Term::Lost)
        }
    };
    metrics.leader.set(0);
    // Dropping the receiver makes the lease task release the Lease (if this replica still
    // holds it), so a standby takes over at once instead of after the Lease expires.
    drop(leading);
    match tokio::time::timeout(Duration::from_secs(5), lease_task).await {
        Ok(Ok(Ok(_))) => info!("released the leader Lease"),
        Ok(Ok(Err(e))) => warn!(error = %e, "releasing the leader Lease failed"),
        Ok(Err(e)) => warn!(error = %e, "the lease task failed"),
        Err(_) => warn!("releasing the leader Lease timed out"),
    }
    outcome
}
