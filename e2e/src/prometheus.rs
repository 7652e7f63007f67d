//! A real Prometheus (Debian's `prometheus` package) for the tests: started on a free loopback
//! port with a scrape config naming the jobs as the chart's ServiceMonitors do
//! (`gpupool-operator`, `gpupool-agent`), the chart's alerting rules loaded, and read back
//! through its HTTP API with `curl`. Also `promtool`, for the rules' unit tests.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::repo_root;

/// A series' or alert's labels from Prometheus' JSON (an object of strings).
fn label_map(labels: &Value) -> BTreeMap<String, String> {
    labels
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}
use crate::wait::poll;

/// The chart's alerting rules: the one file the chart, promtool and these tests read.
pub fn rules_file() -> PathBuf {
    repo_root().join("charts/gpupool/files/prometheus-rules.yaml")
}

/// The promtool unit tests of [`rules_file`].
pub fn rules_test_file() -> PathBuf {
    repo_root().join("e2e/prometheus/prometheus-rules.test.yaml")
}

/// The chart's Grafana dashboard.
pub fn dashboard_file() -> PathBuf {
    repo_root().join("charts/gpupool/files/grafana-dashboard.json")
}

/// Where `tool` is: `$GPUPOOL_<TOOL>` or the `PATH`. Missing, it is an error under CI (which
/// installs Debian's `prometheus` package) and `None` elsewhere, so a developer machine without
/// it skips these tests with a message rather than failing on a tool it never installed.
pub fn find_tool(tool: &str) -> Result<Option<PathBuf>> {
    let var = format!("GPUPOOL_{}", tool.to_ascii_uppercase());
    if let Some(path) = std::env::var_os(&var) {
        return Ok(Some(PathBuf::from(path)));
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    });
    match found {
        Some(p) => Ok(Some(p)),
        None if crate::strict() || std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
            bail!(
                "{tool} not found (CI=true): install Debian's `prometheus` package (.ci/run does) \
             or set {var}"
            )
        }
        None => Ok(None),
    }
}

/// The rules with every `for:` replaced by `hold`: the same expressions, so alerts fire within
/// a test's time instead of after minutes.
pub fn rules_with_hold(hold: &str) -> Result<String> {
    let text = fs::read_to_string(rules_file())
        .with_context(|| format!("reading {}", rules_file().display()))?;
    let mut out = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("for:") {
            let indent = &line[..line.len() - trimmed.len()];
            writeln!(out, "{indent}for: {hold}")?;
        } else {
            writeln!(out, "{line}")?;
        }
    }
    Ok(out)
}

/// A free loopback port (bound, then released for the process that will use it).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A running Prometheus; killed on drop.
pub struct Prometheus {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Its log.
    pub log: PathBuf,
}

/// One sample of an instant query: its labels and value.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Labels, `__name__` included.
    pub labels: BTreeMap<String, String>,
    /// Evaluation time, Unix seconds.
    pub at: f64,
    /// The value.
    pub value: f64,
}

impl Prometheus {
    /// Starts `prometheus` in `dir`, scraping `jobs` (job name → `host:port` targets) every
    /// `scrape` with `rules` (the rule file's text) evaluated as often.
    pub async fn start(
        binary: &Path,
        dir: &Path,
        jobs: &BTreeMap<&str, Vec<String>>,
        rules: &str,
        scrape: &str,
    ) -> Result<Prometheus> {
        fs::create_dir_all(dir)?;
        fs::write(dir.join("rules.yaml"), rules)?;
        let mut config = format!(
            "global:\n  scrape_interval: {scrape}\n  evaluation_interval: {scrape}\n\
             rule_files:\n  - rules.yaml\nscrape_configs:\n"
        );
        for (job, targets) in jobs {
            let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
            writeln!(
                config,
                "  - job_name: {job}\n    honor_labels: true\n    static_configs:\n      - targets: [{}]",
                targets.join(", ")
            )?;
        }
        let config_path = dir.join("prometheus.yml");
        fs::write(&config_path, config)?;
        let port = free_port()?;
        let log = dir.join("prometheus.log");
        let out = fs::File::create(&log)?;
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--web.enable-lifecycle")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let prometheus = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        poll(
            "Prometheus ready",
            Duration::from_secs(60),
            Duration::from_millis(250),
            || async { Ok(prometheus.get("/-/ready", &[]).ok().map(|_| ())) },
        )
        .await
        .with_context(|| prometheus.log_tail())?;
        Ok(prometheus)
    }

    /// The end of its log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// GET `path` with URL-encoded `params`; the body.
    fn get(&self, path: &str, params: &[(&str, &str)]) -> Result<String> {
        let mut cmd = Command::new("curl");
        cmd.args(["-sf", "--max-time", "10", "-G"])
            .arg(format!("{}{path}", self.url));
        for (k, v) in params {
            cmd.arg("--data-urlencode").arg(format!("{k}={v}"));
        }
        let out = cmd.output().context("running curl")?;
        if !out.status.success() {
            bail!(
                "GET {path} {params:?}: curl exit {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// `data` of a successful API answer.
    fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value> {
        let body: Value = serde_json::from_str(&self.get(path, params)?)
            .with_context(|| format!("GET {path}: not JSON"))?;
        if body["status"] != "success" {
            bail!("GET {path} {params:?}: {body}");
        }
        Ok(body["data"].clone())
    }

    /// An instant query (a vector result).
    pub fn query(&self, expr: &str) -> Result<Vec<Sample>> {
        let data = self.api("/api/v1/query", &[("query", expr)])?;
        let result = data["result"].as_array().cloned().unwrap_or_default();
        result
            .iter()
            .map(|r| {
                let labels = label_map(&r["metric"]);
                let at = r["value"][0].as_f64().context("no sample time")?;
                let value = r["value"][1]
                    .as_str()
                    .context("no sample value")?
                    .parse()
                    .context("sample value")?;
                Ok(Sample { labels, at, value })
            })
            .collect()
    }

    /// The raw samples of the one series `selector` matches over the last `window` (e.g.
    /// `30s`): `(scrape time, value)`, as scraped, nothing interpolated.
    pub fn raw_samples(&self, selector: &str, window: &str) -> Result<Vec<(f64, f64)>> {
        let data = self.api(
            "/api/v1/query",
            &[("query", &format!("{selector}[{window}]"))],
        )?;
        let result = data["result"].as_array().cloned().unwrap_or_default();
        if result.len() != 1 {
            bail!("{selector}: {} series, expected one", result.len());
        }
        Ok(result[0]["values"]
            .as_array()
            .map(|vs| {
                vs.iter()
                    .filter_map(|v| Some((v[0].as_f64()?, v[1].as_str()?.parse::<f64>().ok()?)))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// A range query: per series, its labels and `(time, value)` points.
    #[allow(clippy::type_complexity)]
    pub fn query_range(
        &self,
        expr: &str,
        start: f64,
        end: f64,
        step: f64,
    ) -> Result<Vec<(BTreeMap<String, String>, Vec<(f64, f64)>)>> {
        let (start, end, step) = (start.to_string(), end.to_string(), step.to_string());
        let data = self.api(
            "/api/v1/query_range",
            &[
                ("query", expr),
                ("start", &start),
                ("end", &end),
                ("step", &step),
            ],
        )?;
        let result = data["result"].as_array().cloned().unwrap_or_default();
        Ok(result
            .iter()
            .map(|r| {
                let labels = label_map(&r["metric"]);
                let points = r["values"]
                    .as_array()
                    .map(|vs| {
                        vs.iter()
                            .filter_map(|v| {
                                Some((v[0].as_f64()?, v[1].as_str()?.parse::<f64>().ok()?))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                (labels, points)
            })
            .collect())
    }

    /// The alerts Prometheus holds now (pending and firing), with their labels and state.
    pub fn alerts(&self) -> Result<Vec<(BTreeMap<String, String>, String)>> {
        let data = self.api("/api/v1/alerts", &[])?;
        Ok(data["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|a| {
                let labels = label_map(&a["labels"]);
                (labels, a["state"].as_str().unwrap_or_default().to_owned())
            })
            .collect())
    }

    /// Waits until alert `name` fires with every label in `labels`.
    pub async fn wait_firing(
        &self,
        name: &str,
        labels: &[(&str, &str)],
        within: Duration,
    ) -> Result<BTreeMap<String, String>> {
        poll(
            &format!("alert {name} {labels:?} firing"),
            within,
            Duration::from_millis(500),
            || async {
                Ok(self.alerts()?.into_iter().find_map(|(l, state)| {
                    let matches = l.get("alertname").map(String::as_str) == Some(name)
                        && labels
                            .iter()
                            .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v));
                    (matches && state == "firing").then_some(l)
                }))
            },
        )
        .await
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
