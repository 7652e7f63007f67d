//! Running the built `kubectl` against the test cluster.

use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail};

/// A `kubectl` bound to one kubeconfig.
#[derive(Debug, Clone)]
pub struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
}

/// What a finished `kubectl` run printed.
#[derive(Debug, Clone)]
pub struct Run {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl Kubectl {
    /// A kubectl at `bin` that talks to the cluster in `kubeconfig`.
    pub fn new(bin: impl Into<PathBuf>, kubeconfig: impl Into<PathBuf>) -> Self {
        Self {
            bin: bin.into(),
            kubeconfig: kubeconfig.into(),
        }
    }

    /// Path of the kubectl binary.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// A `Command` for kubectl with the kubeconfig set, for callers that need
    /// more control than [`Kubectl::run`].
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig);
        cmd
    }

    /// Runs kubectl and returns what it printed, whatever its exit status.
    pub fn try_run<I, S>(&self, args: I, stdin: Option<&str>) -> Result<Run>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
        let shown = shown(&args);
        let mut cmd = self.command();
        cmd.args(&args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} {shown}", self.bin.display()))?;
        if let Some(input) = stdin {
            let mut pipe = child
                .stdin
                .take()
                .context("kubectl's stdin was not piped")?;
            pipe.write_all(input.as_bytes())
                .with_context(|| format!("writing stdin of kubectl {shown}"))?;
        }
        let Output {
            status,
            stdout,
            stderr,
        } = child
            .wait_with_output()
            .with_context(|| format!("waiting for kubectl {shown}"))?;
        Ok(Run {
            success: status.success(),
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        })
    }

    /// Runs kubectl and returns its stdout; a non-zero exit is an error that
    /// carries its stderr.
    pub fn run<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.run_with_stdin(args, None)
    }

    /// Like [`Kubectl::run`], feeding `stdin` (e.g. for `apply -f -`).
    pub fn run_with_stdin<I, S>(&self, args: I, stdin: Option<&str>) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
        let run = self.try_run(&args, stdin)?;
        if !run.success {
            let shown = shown(&args);
            bail!("kubectl {shown} failed: {}", run.stderr.trim());
        }
        Ok(run.stdout)
    }

    /// Runs kubectl and expects the API server to refuse the call with `message` (an admission
    /// policy's, say): an error when the call goes through or is refused for another reason.
    pub fn expect_refused<I, S>(&self, args: I, message: &str) -> Result<()>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
        let shown = shown(&args);
        let run = self.try_run(&args, None)?;
        if run.success {
            bail!("kubectl {shown} went through; it should have been refused with {message:?}");
        }
        if !run.stderr.contains(message) {
            bail!(
                "kubectl {shown} was refused, but not with {message:?}: {}",
                run.stderr.trim()
            );
        }
        Ok(())
    }
}

/// Arguments as a command line shows them, for messages.
fn shown(args: &[std::ffi::OsString]) -> String {
    args.iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}
