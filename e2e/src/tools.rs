//! The control-plane tool binaries, built (or found cached) by `e2e/tools/build.sh`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The repository root (the workspace holding this crate).
pub fn repo_root() -> PathBuf {
    // `cargo test` sets CARGO_MANIFEST_DIR (<repo>/e2e) when it runs the tests too;
    // prefer that to the compile-time value, which goes stale when two checkouts
    // share one target directory and cargo reuses a build made from the other.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or(manifest_dir)
}

/// Path of `e2e/tools/build.sh`.
pub fn build_script() -> PathBuf {
    repo_root().join("e2e/tools/build.sh")
}

/// Path of the `e2e/cluster` script.
pub fn cluster_script() -> PathBuf {
    repo_root().join("e2e/cluster")
}

/// The directory holding the built tools for the current pins.
#[derive(Debug, Clone)]
pub struct Tools {
    bin_dir: PathBuf,
}

impl Tools {
    /// Builds every tool that is not cached yet (progress goes to stderr) and
    /// returns where they are.
    pub fn ensure() -> Result<Self> {
        let script = build_script();
        let status = Command::new(&script)
            .stdin(Stdio::null())
            // build.sh prints progress on stdout; keep it visible under the
            // test harness, which only captures what tests print themselves.
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .status()
            .with_context(|| format!("running {}", script.display()))?;
        if !status.success() {
            bail!(
                "{} failed ({status}); its output above names the component and its log",
                script.display()
            );
        }
        let tools = Self::locate()?;
        for tool in ["kubectl", "helm", "kube-apiserver", "etcd", "kwok"] {
            let path = tools.bin(tool);
            if !path.is_file() {
                bail!(
                    "{} is missing after {} ran",
                    path.display(),
                    script.display()
                );
            }
        }
        Ok(tools)
    }

    /// The bin dir for the current pins, whether or not it is built.
    pub fn locate() -> Result<Self> {
        let script = build_script();
        let out = Command::new(&script)
            .arg("--print-bin-dir")
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {} --print-bin-dir", script.display()))?;
        if !out.status.success() {
            bail!(
                "{} --print-bin-dir failed: {}",
                script.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let dir = String::from_utf8(out.stdout)
            .context("build.sh printed a non-UTF-8 bin dir")?
            .trim()
            .to_owned();
        if dir.is_empty() {
            bail!("{} --print-bin-dir printed nothing", script.display());
        }
        Ok(Self {
            bin_dir: PathBuf::from(dir),
        })
    }

    /// The directory with every tool binary.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// Path of one tool binary, e.g. `bin("kubectl")`.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    /// Path of the built `kubectl`.
    pub fn kubectl(&self) -> PathBuf {
        self.bin("kubectl")
    }

    /// Path of the built `helm`.
    pub fn helm(&self) -> PathBuf {
        self.bin("helm")
    }
}
