//! The project's own binaries the tests run: the operator, the node agent, the fake
//! `libnvidia-ml.so` and the fake `libcuda.so` (for probes in GPU pods' containers). Each is
//! either named by an environment variable (`e2e/artifacts.sh`, which `./test.sh` runs first,
//! builds all four and exports their paths, along with the demo's
//! `gpupool-fake-driver-root`, which no test runs: tests call its library directly) or built
//! here with one explicit cargo invocation per artifact, so that nothing depends on what an
//! earlier, unrelated build left in the target directory.
//!
//! One invocation per artifact on purpose: a `--bin` filter restricts cargo to binary targets
//! (a `cdylib` named beside it is silently not built), and building two packages together
//! unifies their dependencies' features, which is not how either ships.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, ensure};

use crate::repo_root;

/// The cargo target directory the tests were built into.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    // The test binary is <target>/debug/deps/<test>-<hash>.
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent()?.parent()?.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| repo_root().join("target"))
}

/// What one artifact is and how cargo builds it.
struct Artifact {
    /// Environment variable naming a prebuilt copy.
    env: &'static str,
    /// `cargo build` arguments after `build --locked`.
    cargo_args: &'static [&'static str],
    /// The file the build leaves under `<target>/debug/`.
    output: &'static str,
}

const OPERATOR: Artifact = Artifact {
    env: "GPUPOOL_OPERATOR_BIN",
    cargo_args: &["-p", "gpupool-operator", "--bin", "gpupool-operator"],
    output: "gpupool-operator",
};

const AGENT: Artifact = Artifact {
    env: "GPUPOOL_AGENT_BIN",
    cargo_args: &[
        "-p",
        "gpupool-device-plugin",
        "--bin",
        "gpupool-device-plugin",
    ],
    output: "gpupool-device-plugin",
};

const FAKE_NVML: Artifact = Artifact {
    env: "GPUPOOL_FAKE_NVML_LIB",
    // `--lib` selects the cdylib target.
    cargo_args: &["-p", "gpupool-fake-nvml", "--lib"],
    output: "libnvidia_ml.so",
};

const FAKE_CUDA: Artifact = Artifact {
    env: "GPUPOOL_FAKE_CUDA_LIB",
    // `--lib` selects the cdylib target.
    cargo_args: &["-p", "gpupool-fake-cuda", "--lib"],
    output: "libcuda_fake.so",
};

impl Artifact {
    fn resolve(&self) -> Result<PathBuf> {
        if let Some(path) = std::env::var_os(self.env) {
            let path = PathBuf::from(path);
            ensure!(
                path.is_file(),
                "{} names {}, which does not exist",
                self.env,
                path.display()
            );
            return Ok(path);
        }
        let target = target_dir();
        cargo_build(self.cargo_args, &target)?;
        let built = target.join("debug").join(self.output);
        ensure!(
            built.is_file(),
            "`cargo build {}` succeeded but left no {}",
            self.cargo_args.join(" "),
            built.display()
        );
        Ok(built)
    }
}

/// Runs `cargo build --locked <args>` in the repository against `target`.
fn cargo_build(args: &[&str], target: &Path) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(repo_root())
        .arg("build")
        .arg("--locked")
        .args(args)
        .env("CARGO_TARGET_DIR", target)
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("running cargo build {}", args.join(" ")))?;
    ensure!(
        status.success(),
        "cargo build {} failed ({status})",
        args.join(" ")
    );
    Ok(())
}

/// Builds once per test process (cargo is asked every time a process starts: a no-op when the
/// build is fresh, and a stale binary would test old code).
fn once(cell: &'static OnceLock<Result<PathBuf, String>>, what: &Artifact) -> Result<PathBuf> {
    cell.get_or_init(|| what.resolve().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

/// The operator binary.
pub fn operator_binary() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once(&CELL, &OPERATOR).context("operator binary")
}

/// The node agent binary.
pub fn agent_binary() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once(&CELL, &AGENT).context("agent binary")
}

/// The fake NVML library (`libnvidia_ml.so`; copy or link it as `libnvidia-ml.so.1`).
pub fn fake_nvml_library() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once(&CELL, &FAKE_NVML).context("fake libnvidia-ml")
}

/// The fake CUDA driver library (`libcuda_fake.so`, soname `libcuda.so.1`; install it under
/// that name).
pub fn fake_cuda_library() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    once(&CELL, &FAKE_CUDA).context("fake libcuda")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_artifact_is_built_by_its_own_filtered_invocation() {
        for a in [&OPERATOR, &AGENT, &FAKE_NVML, &FAKE_CUDA] {
            let p: Vec<_> = a.cargo_args.iter().filter(|x| **x == "-p").collect();
            assert_eq!(p.len(), 1, "{}: one package per invocation", a.env);
        }
        // The libraries need `--lib`, never `--bin` (which would skip the cdylib).
        for lib in [&FAKE_NVML, &FAKE_CUDA] {
            assert!(lib.cargo_args.contains(&"--lib"), "{}", lib.env);
            assert!(!lib.cargo_args.contains(&"--bin"), "{}", lib.env);
        }
    }

    #[test]
    fn a_named_artifact_that_does_not_exist_is_an_error() {
        let a = Artifact {
            env: "GPUPOOL_E2E_TEST_ARTIFACT_THAT_IS_NOT_THERE",
            cargo_args: &[],
            output: "x",
        };
        // SAFETY: only this test reads or writes this variable.
        unsafe { std::env::set_var(a.env, "/nonexistent/gpupool/artifact") };
        let err = a.resolve().unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
    }
}
