//! Helpers shared by the chart and RBAC e2e tests (included with `#[path]`): running the built
//! helm against the test cluster, releases that uninstall themselves, and kubeconfigs that
//! authenticate as a ServiceAccount with a token from `kubectl create token`.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use gpupool_e2e::{Cluster, Tools, repo_root};
use kube::config::Kubeconfig;

/// The chart under test.
pub fn chart_dir() -> PathBuf {
    repo_root().join("charts/gpupool")
}

/// What a finished helm run printed.
#[derive(Debug)]
pub struct HelmRun {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs the built helm (against `kubeconfig` when given), whatever its exit status.
pub fn helm_try(tools: &Tools, kubeconfig: Option<&Path>, args: &[&str]) -> Result<HelmRun> {
    let mut cmd = Command::new(tools.helm());
    cmd.args(args)
        .stdin(Stdio::null())
        // Keep helm's caches and repository config out of the user's home.
        .env("HELM_CACHE_HOME", repo_root().join("target/e2e-helm/cache"))
        .env(
            "HELM_CONFIG_HOME",
            repo_root().join("target/e2e-helm/config"),
        )
        .env("HELM_DATA_HOME", repo_root().join("target/e2e-helm/data"));
    if let Some(kc) = kubeconfig {
        cmd.env("KUBECONFIG", kc);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running helm {}", args.join(" ")))?;
    Ok(HelmRun {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs helm and returns its stdout; a non-zero exit is an error carrying its stderr.
pub fn helm(tools: &Tools, kubeconfig: Option<&Path>, args: &[&str]) -> Result<String> {
    let run = helm_try(tools, kubeconfig, args)?;
    if !run.success {
        bail!("helm {} failed: {}", args.join(" "), run.stderr.trim());
    }
    Ok(run.stdout)
}

/// A helm release in the test cluster; uninstalled (and its agent namespace deleted) on drop.
pub struct Release {
    cluster: &'static Cluster,
    /// Release name.
    pub name: String,
    /// Release namespace (the operator's).
    pub namespace: String,
    /// The node agent's namespace.
    pub agent_namespace: String,
}

impl Release {
    /// `helm install <name> charts/gpupool -n <namespace> --wait` with `--set` values `sets`.
    /// The agent namespace is `<name>-node` unless `sets` name one.
    pub fn install(
        cluster: &'static Cluster,
        name: &str,
        namespace: &str,
        sets: &[&str],
    ) -> Result<Self> {
        Self::install_with_args(cluster, name, namespace, &[], sets)
    }

    /// Like [`Release::install`], with extra helm arguments.
    pub fn install_with_args(
        cluster: &'static Cluster,
        name: &str,
        namespace: &str,
        extra: &[&str],
        sets: &[&str],
    ) -> Result<Self> {
        Self::install_chart(cluster, &chart_dir(), name, namespace, extra, sets)
    }

    /// Like [`Release::install_with_args`], from the chart at `chart` (e.g. an earlier
    /// version of ours).
    pub fn install_chart(
        cluster: &'static Cluster,
        chart: &std::path::Path,
        name: &str,
        namespace: &str,
        extra: &[&str],
        sets: &[&str],
    ) -> Result<Self> {
        let mut args = vec![
            "install",
            name,
            chart.to_str().context("chart path is not UTF-8")?,
            "-n",
            namespace,
            "--wait",
            "--timeout",
            "120s",
        ];
        args.extend(extra);
        for s in sets {
            args.extend(["--set", s]);
        }
        let agent_namespace = sets
            .iter()
            .find_map(|s| s.strip_prefix("agent.namespace.name="))
            .map(str::to_owned)
            .unwrap_or_else(|| format!("{name}-node"));
        // Armed before the install, so a half-done install is cleaned up too.
        let release = Self {
            cluster,
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            agent_namespace,
        };
        helm(cluster.tools(), Some(cluster.kubeconfig()), &args)?;
        Ok(release)
    }

    /// `helm upgrade` with `--reuse-values` and more `--set` values.
    pub fn upgrade(&self, sets: &[&str]) -> Result<String> {
        self.upgrade_with("--reuse-values", sets)
    }

    /// `helm upgrade` to this chart, keeping the values as `values_flag` says
    /// (`--reuse-values`, or `--reset-then-reuse-values` from an older chart whose values
    /// lack this one's new keys).
    pub fn upgrade_with(&self, values_flag: &str, sets: &[&str]) -> Result<String> {
        let chart = chart_dir();
        let mut args = vec![
            "upgrade",
            &self.name,
            chart.to_str().context("chart path is not UTF-8")?,
            "-n",
            &self.namespace,
            values_flag,
            "--wait",
            "--timeout",
            "120s",
        ];
        for s in sets {
            args.extend(["--set", s]);
        }
        helm(self.cluster.tools(), Some(self.cluster.kubeconfig()), &args)
    }

    /// The operator's ServiceAccount (and Deployment) name.
    pub fn operator_name(&self) -> String {
        format!("{}-operator", fullname(&self.name))
    }

    /// The agent's ServiceAccount (and DaemonSet) name.
    pub fn agent_name(&self) -> String {
        format!("{}-agent", fullname(&self.name))
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let tools = self.cluster.tools();
        let kc = Some(self.cluster.kubeconfig());
        let _ = helm_try(
            tools,
            kc,
            &[
                "uninstall",
                &self.name,
                "-n",
                &self.namespace,
                "--wait=false",
            ],
        );
        let _ = self.cluster.kubectl().run([
            "delete",
            "namespace",
            &self.agent_namespace,
            "--ignore-not-found",
            "--wait=false",
        ]);
    }
}

/// The chart's `gpupool.fullname` for a release name.
pub fn fullname(release: &str) -> String {
    let name = if release.contains("gpupool") {
        release.to_owned()
    } else {
        format!("{release}-gpupool")
    };
    name.chars()
        .take(40)
        .collect::<String>()
        .trim_end_matches('-')
        .to_owned()
}

/// Writes a kubeconfig for the test cluster that authenticates with a token of the
/// ServiceAccount `sa` in `namespace` (`kubectl create token`), bound to `bound_pod` when given
/// (the apiserver then names that pod's node in the token). Returns its path.
pub fn service_account_kubeconfig(
    cluster: &Cluster,
    namespace: &str,
    sa: &str,
    bound_pod: Option<&str>,
    path: &Path,
) -> Result<PathBuf> {
    let mut args = vec![
        "create".to_owned(),
        "token".to_owned(),
        sa.to_owned(),
        "-n".to_owned(),
        namespace.to_owned(),
        "--duration=1h".to_owned(),
    ];
    if let Some(pod) = bound_pod {
        args.extend([
            "--bound-object-kind=Pod".to_owned(),
            format!("--bound-object-name={pod}"),
        ]);
    }
    let token = cluster.kubectl().run(&args)?.trim().to_owned();
    let admin = Kubeconfig::read_from(cluster.kubeconfig())
        .with_context(|| format!("reading {}", cluster.kubeconfig().display()))?;
    let cluster_entry = admin
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref())
        .context("the admin kubeconfig has no cluster")?;
    let server = cluster_entry
        .server
        .clone()
        .context("the admin kubeconfig names no server")?;
    let ca = cluster_entry
        .certificate_authority_data
        .clone()
        .context("the admin kubeconfig has no CA data")?;
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: {sa}\n  user:\n    token: {token}\ncontexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {sa}\ncurrent-context: e2e\n"
    );
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_owned())
}
