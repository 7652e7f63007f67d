//! gpupool side by side with NVIDIA's stack (`nvidia-ctk`, `k8s-device-plugin`) on the same
//! simulated hardware (the fake `libnvidia-ml.so` from `e2e/fake-nvml`). For benchmarking and
//! conformance only; NVIDIA's binaries are never a runtime dependency of gpupool.
//!
//! ```text
//! gpupool-nvidia-compare conformance <work-dir>   the conformance report (exit 1 on a finding)
//! gpupool-nvidia-compare bench <work-dir>         the benchmark table
//! ```
//! Tools come from the environment (`../compare.sh` sets them): `NVIDIA_CTK`,
//! `NVIDIA_DEVICE_PLUGIN` (built by `../build.sh`), `GPUPOOL_FAKE_NVML_LIB` (the fake
//! library, `e2e/fake-nvml/build.sh`) and `GPUPOOL_REPO` (the repository root).
//!
//! Internal children (each loads the fake library with one node's environment):
//! `layout <node-dir> <layout>`, `ours-cdi <node-dir> <spec-dir>`,
//! `serve-ours <node-dir> <kubelet-dir> <strategy>`, `serve-floor <socket>` and
//! `serve-health-floor <node-dir> <kubelet-dir>` (see [`floor`]).

mod bench;
mod cdi_cmp;
mod conformance;
mod floor;
mod node;
mod plugins;
mod report;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Paths of everything the comparison runs.
#[derive(Debug, Clone)]
pub struct Tools {
    /// Repository root.
    pub repo: PathBuf,
    /// `nvidia-ctk`.
    pub ctk: PathBuf,
    /// `nvidia-device-plugin`.
    pub plugin: PathBuf,
    /// The fake `libnvidia-ml.so`.
    pub fake_lib: PathBuf,
    /// This binary.
    pub self_exe: PathBuf,
}

impl Tools {
    fn from_env() -> Result<Tools> {
        let var = |k: &str| -> Result<PathBuf> {
            let p = PathBuf::from(std::env::var_os(k).with_context(|| format!("{k} is not set"))?);
            if !p.exists() {
                bail!("{k}={} does not exist", p.display());
            }
            Ok(p)
        };
        Ok(Tools {
            repo: var("GPUPOOL_REPO")?,
            ctk: var("NVIDIA_CTK")?,
            plugin: var("NVIDIA_DEVICE_PLUGIN")?,
            fake_lib: var("GPUPOOL_FAKE_NVML_LIB")?,
            self_exe: std::env::current_exe()?,
        })
    }
}

fn arg(args: &[String], i: usize, what: &str) -> Result<String> {
    args.get(i)
        .cloned()
        .with_context(|| format!("missing argument: {what}"))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let command = arg(&args, 1, "command (conformance | bench)")?;
    match command.as_str() {
        "conformance" => {
            let work = PathBuf::from(arg(&args, 2, "work dir")?);
            let tools = Tools::from_env()?;
            let unexpected = runtime()?.block_on(conformance::run(&tools, &work))?;
            if unexpected > 0 {
                bail!("{unexpected} unexpected difference(s)");
            }
            Ok(())
        }
        "bench" => {
            let work = PathBuf::from(arg(&args, 2, "work dir")?);
            let tools = Tools::from_env()?;
            runtime()?.block_on(bench::run(&tools, &work))
        }
        "layout" => {
            let node = node::FakeNode::open(Path::new(&arg(&args, 2, "node dir")?))?;
            node::create_layout(&node, node::Layout::parse(&arg(&args, 3, "layout")?)?)
        }
        "ours-cdi" => {
            let path = cdi_cmp::ours_cdi(
                Path::new(&arg(&args, 2, "node dir")?),
                Path::new(&arg(&args, 3, "spec dir")?),
            )?;
            println!("{}", path.display());
            Ok(())
        }
        "serve-ours" => runtime()?.block_on(plugins::serve_ours(
            Path::new(&arg(&args, 2, "node dir")?),
            Path::new(&arg(&args, 3, "kubelet dir")?),
            &arg(&args, 4, "strategy")?,
        )),
        "serve-floor" => floor::serve(Path::new(&arg(&args, 2, "socket")?)),
        "serve-health-floor" => floor::serve_health(
            Path::new(&arg(&args, 2, "node dir")?),
            Path::new(&arg(&args, 3, "kubelet dir")?),
        ),
        other => bail!("unknown command {other:?}"),
    }
}
