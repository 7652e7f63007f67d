//! One control plane shared by every test in a test binary.
//!
//! [`Cluster::shared`] decides, once per process, which cluster the tests use:
//!
//! * `GPUPOOL_E2E_REUSE=1` with `KUBECONFIG` set: that cluster, as it is. The
//!   harness never stops it. `e2e/run-tests.sh` works this way: it brings a
//!   cluster up, runs `cargo test -p gpupool-e2e` against it and always takes it
//!   down afterwards, whatever the tests did.
//! * otherwise the harness runs `e2e/cluster up` itself, in a state directory
//!   private to this process (`GPUPOOL_E2E_DIR`, or
//!   `target/e2e-tests/<binary>-<pid>`), and starts a small watchdog process
//!   that waits for the test process to exit — however it exits: success,
//!   failed assertions, a panic that aborts, a signal — and then runs
//!   `e2e/cluster down` on that directory. Rust's test harness has no hook
//!   that runs after the last test, so the cleanup lives outside the process.
//!   If that directory already holds a healthy cluster, it is reused and left
//!   running.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::kubectl::Kubectl;
use crate::tools::{Tools, cluster_script, repo_root};

/// The fake GPU nodes the cluster script creates carry this label.
pub const FAKE_NODE_LABEL: &str = "e2e.gpupool.io/fake-node";

/// A running control plane: its kubeconfig and the tools that talk to it.
#[derive(Debug)]
pub struct Cluster {
    kubeconfig: PathBuf,
    tools: Tools,
    /// The state directory when this process started the cluster.
    owned_state_dir: Option<PathBuf>,
}

static SHARED: OnceLock<Result<Cluster, String>> = OnceLock::new();

impl Cluster {
    /// The cluster for this test binary, brought up on first use (see the
    /// module docs). Every caller gets the same one; a failure to bring it up
    /// is returned to every caller.
    pub fn shared() -> Result<&'static Cluster> {
        SHARED
            .get_or_init(|| Self::bring_up().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("the e2e cluster is not available: {e}"))
    }

    fn bring_up() -> Result<Self> {
        let tools = Tools::ensure()?;
        if std::env::var("GPUPOOL_E2E_REUSE").is_ok_and(|v| v == "1") {
            let kubeconfig = std::env::var_os("KUBECONFIG")
                .map(PathBuf::from)
                .context("GPUPOOL_E2E_REUSE=1 needs KUBECONFIG to name the cluster to reuse")?;
            if !kubeconfig.is_file() {
                bail!("KUBECONFIG={} is not a file", kubeconfig.display());
            }
            eprintln!("e2e: reusing the cluster in {}", kubeconfig.display());
            return Ok(Self {
                kubeconfig,
                tools,
                owned_state_dir: None,
            });
        }

        let state_dir = match std::env::var_os("GPUPOOL_E2E_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => default_state_dir(),
        };
        let kubeconfig = state_dir.join("kubeconfig");
        if script(&state_dir, &["status"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            eprintln!(
                "e2e: reusing the healthy cluster in {} (left running)",
                state_dir.display()
            );
            return Ok(Self {
                kubeconfig,
                tools,
                owned_state_dir: None,
            });
        }

        let nodes = std::env::var("GPUPOOL_E2E_NODES").unwrap_or_else(|_| "3".to_owned());
        eprintln!(
            "e2e: starting a cluster in {} ({nodes} fake GPU nodes)",
            state_dir.display()
        );
        // Arm the watchdog first, so even a half-started cluster is taken down.
        start_teardown_watchdog(&state_dir)?;
        let status = script(&state_dir, &["up", "--nodes", &nodes])
            // stdout is only the `export KUBECONFIG=` line; progress and
            // errors go to stderr, which stays visible.
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .context("running e2e/cluster up")?;
        if !status.success() {
            bail!(
                "e2e/cluster up failed ({status}); its output above names the component and its log"
            );
        }
        Ok(Self {
            kubeconfig,
            tools,
            owned_state_dir: Some(state_dir),
        })
    }

    /// Path of the admin kubeconfig.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The tools built for this cluster.
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// Path of the built `kubectl`.
    pub fn kubectl_path(&self) -> PathBuf {
        self.tools.kubectl()
    }

    /// Path of the built `helm`.
    pub fn helm_path(&self) -> PathBuf {
        self.tools.helm()
    }

    /// The state directory, when this process started the cluster.
    pub fn owned_state_dir(&self) -> Option<&Path> {
        self.owned_state_dir.as_deref()
    }

    /// Stops kube-apiserver and starts it again on the same port and etcd, returning once it is
    /// ready (`e2e/cluster restart-apiserver`). Every client's connections drop: a fault test's
    /// tool. The state directory is the kubeconfig's.
    pub fn restart_apiserver(&self) -> Result<()> {
        let state_dir = self
            .kubeconfig
            .parent()
            .context("the kubeconfig has no directory")?;
        let status = script(state_dir, &["restart-apiserver"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .context("running e2e/cluster restart-apiserver")?;
        if !status.success() {
            bail!("e2e/cluster restart-apiserver failed ({status})");
        }
        Ok(())
    }

    /// kubectl bound to this cluster.
    pub fn kubectl(&self) -> Kubectl {
        Kubectl::new(self.tools.kubectl(), &self.kubeconfig)
    }

    /// A new client for this cluster.
    ///
    /// A `kube::Client` drives its connections on the Tokio runtime that
    /// created it, and each `#[tokio::test]` has its own runtime, so each test
    /// makes its own client rather than sharing one.
    pub async fn client(&self) -> Result<kube::Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("reading {}", self.kubeconfig.display()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading {}", self.kubeconfig.display()))?;
        kube::Client::try_from(config).context("building a kube client")
    }
}

fn default_state_dir() -> PathBuf {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        // Test binaries are named <target>-<hash>; the target is enough.
        .map(|s| s.split('-').next().unwrap_or("tests").to_owned())
        .unwrap_or_else(|| "tests".to_owned());
    repo_root()
        .join("target/e2e-tests")
        .join(format!("{binary}-{}", std::process::id()))
}

fn script(state_dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(cluster_script());
    cmd.args(args)
        .env("GPUPOOL_E2E_DIR", state_dir)
        .stdin(Stdio::null());
    cmd
}

/// Starts a detached process that waits for this process to exit and then
/// runs `e2e/cluster down` for `state_dir`.
fn start_teardown_watchdog(state_dir: &Path) -> Result<()> {
    use std::os::unix::process::CommandExt;

    let parent = state_dir
        .parent()
        .context("the e2e state directory has no parent")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let log_path = PathBuf::from(format!("{}.teardown.log", state_dir.display()));
    let log =
        fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let log_err = log
        .try_clone()
        .with_context(|| format!("duplicating {}", log_path.display()))?;
    // `tail --pid` returns once the test process is gone.
    let watchdog = r#"tail --pid="$1" -f /dev/null; "$2" down && rm -f "$3.teardown.log""#;
    Command::new("sh")
        .arg("-c")
        .arg(watchdog)
        .arg("gpupool-e2e-teardown")
        .arg(std::process::id().to_string())
        .arg(cluster_script())
        .arg(state_dir)
        .env("GPUPOOL_E2E_DIR", state_dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        // Its own process group: a Ctrl-C aimed at `cargo test` must not kill
        // the watchdog before it has cleaned up.
        .process_group(0)
        .spawn()
        .context("starting the teardown watchdog")?;
    Ok(())
}
