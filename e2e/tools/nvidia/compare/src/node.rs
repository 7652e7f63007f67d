//! A simulated node both stacks look at: a fixture and its state file for the fake
//! `libnvidia-ml.so`, a MIG layout made through NVML, and a full fake driver root
//! (`gpupool_sim::driver_root::build_with`): character device nodes (nvidia-ctk rejects plain
//! files), ELF libraries with their soname links and `etc/ld.so.cache`, the fake library
//! installed as `libnvidia-ml.so.<driver version>`, and the `mig-minors` file.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use gpupool_device_plugin::backend::{GpuBackend, NvmlBackend, NvmlOptions};
use gpupool_sim as model;

/// Where the fake library finds its fixture (read by the library in every process).
pub const FIXTURE_ENV: &str = "GPUPOOL_FAKE_NVML_FIXTURE";
/// Where the fake library keeps its state.
pub const STATE_ENV: &str = "GPUPOOL_FAKE_NVML_STATE";
/// Driver library directory inside the driver root.
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The MIG layout the harness creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// No instances (whole GPUs, or MIG off).
    Whole,
    /// GPUs 4..7: 7 × 1g.10gb | 3g.40gb + 2g.20gb + 1g.10gb | 4g.40gb + 3g.40gb | 7g.80gb
    /// (13 MIG devices); GPUs 0..3 whole.
    Mixed,
    /// Every GPU: 7 × 1g.10gb.
    AllOneG,
}

impl Layout {
    /// Parses the name used on the command line.
    pub fn parse(name: &str) -> Result<Layout> {
        Ok(match name {
            "whole" => Layout::Whole,
            "mixed" => Layout::Mixed,
            "all-1g" => Layout::AllOneG,
            _ => bail!("unknown layout {name:?}"),
        })
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Whole => "whole",
            Layout::Mixed => "mixed",
            Layout::AllOneG => "all-1g",
        }
    }

    /// Profiles per GPU index, in creation order (largest first, so placements fit).
    fn profiles(self, gpu: u32) -> Vec<&'static str> {
        match (self, gpu) {
            (Layout::Whole, _) => vec![],
            (Layout::AllOneG, _) => vec!["1g.10gb"; 7],
            (Layout::Mixed, 4) => vec!["1g.10gb"; 7],
            (Layout::Mixed, 5) => vec!["3g.40gb", "2g.20gb", "1g.10gb"],
            (Layout::Mixed, 6) => vec!["4g.40gb", "3g.40gb"],
            (Layout::Mixed, 7) => vec!["7g.80gb"],
            (Layout::Mixed, _) => vec![],
        }
    }
}

/// One comparison scenario: simulated hardware plus a MIG layout.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// Short name used in the report.
    pub name: &'static str,
    /// Fixture, relative to the repository root.
    pub fixture: &'static str,
    /// MIG layout to create.
    pub layout: Layout,
    /// MIG strategies to compare the plugins under.
    pub strategies: &'static [&'static str],
}

/// The scenarios the issue asks for, plus a uniform MIG layout for strategy `single`.
pub const SCENARIOS: [Scenario; 4] = [
    Scenario {
        name: "h100-8x-mig-mixed",
        fixture: "e2e/tools/nvidia/fixtures/h100-8x-mig.yaml",
        layout: Layout::Mixed,
        strategies: &["none", "mixed"],
    },
    Scenario {
        name: "h100-8x-mig-all-1g",
        fixture: "e2e/tools/nvidia/fixtures/h100-8x-mig-all.yaml",
        layout: Layout::AllOneG,
        strategies: &["single", "mixed"],
    },
    Scenario {
        name: "a100-8x-whole",
        fixture: "device-plugin/fixtures/a100-8x.yaml",
        layout: Layout::Whole,
        strategies: &["none", "single", "mixed"],
    },
    Scenario {
        name: "l4-4x",
        fixture: "device-plugin/fixtures/l4-4x.yaml",
        layout: Layout::Whole,
        strategies: &["none", "single", "mixed"],
    },
];

/// A prepared node in its own directory.
#[derive(Debug, Clone)]
pub struct FakeNode {
    /// The node's directory.
    pub dir: PathBuf,
    /// Driver version from the fixture.
    pub driver_version: String,
    /// Number of GPUs.
    pub gpus: u32,
}

impl FakeNode {
    /// A node already prepared in `dir` (as the child commands see it).
    pub fn open(dir: &Path) -> Result<FakeNode> {
        let fixture: serde_yaml::Value = serde_yaml::from_str(
            &fs::read_to_string(dir.join("fixture.yaml")).context("reading fixture")?,
        )?;
        let driver_version = fixture["driver"]["version"]
            .as_str()
            .context("fixture has no driver version")?
            .to_owned();
        let gpus = fixture["gpus"]
            .as_sequence()
            .context("fixture has no gpus")?
            .iter()
            .map(|g| g["count"].as_u64().unwrap_or(1) as u32)
            .sum();
        Ok(FakeNode {
            dir: dir.to_path_buf(),
            driver_version,
            gpus,
        })
    }

    /// The driver root.
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }

    /// The fake library as NVIDIA's tools find it (`libnvidia-ml.so.1` in the driver root).
    pub fn nvml_library(&self) -> PathBuf {
        self.root().join(LIB_DIR).join("libnvidia-ml.so.1")
    }

    /// Environment every process that loads the fake library needs.
    pub fn env(&self) -> Vec<(&'static str, PathBuf)> {
        vec![
            (FIXTURE_ENV, self.dir.join("fixture.yaml")),
            (STATE_ENV, self.dir.join("state.json")),
        ]
    }

    /// Sets this node's environment on a command.
    pub fn apply_env<'a>(&self, command: &'a mut Command) -> &'a mut Command {
        for (k, v) in self.env() {
            command.env(k, v);
        }
        command
    }
}

/// Prepares `dir` for `scenario`: copies the fixture, builds the driver root with the fake
/// library from `fake_lib`, and runs `self_exe layout` (a child, so the fake library reads
/// this node's environment) to create the MIG layout.
pub fn prepare(
    repo: &Path,
    scenario: &Scenario,
    dir: &Path,
    fake_lib: &Path,
    self_exe: &Path,
) -> Result<FakeNode> {
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    fs::create_dir_all(dir)?;
    fs::copy(repo.join(scenario.fixture), dir.join("fixture.yaml"))
        .with_context(|| format!("copying {}", scenario.fixture))?;
    let node = FakeNode::open(dir)?;
    let root = node.root();
    // A full driver install as nvidia-ctk expects it: character device nodes (it rejects plain
    // files), ELF libraries carrying their sonames with the soname links and an ld.so.cache
    // made by ldconfig (so both generators find the libraries as on a real host), and the fake
    // library as libnvidia-ml. The builder's library of another version (`.so.1.0.0`) stays:
    // both generators should skip it.
    let options = gpupool_sim::driver_root::BuildOptions {
        elf_libraries: true,
        device_nodes: gpupool_sim::driver_root::DeviceNodes::CharDevices,
        nvml: Some(fake_lib.to_path_buf()),
        cuda: None,
        nvidia_smi: None,
        ldconfig: true,
    };
    gpupool_sim::driver_root::build_with(&root, &node.driver_version, node.gpus, &options)
        .context("building the driver root (needs root for mknod and ldconfig, and cc)")?;
    let status = node
        .apply_env(&mut Command::new(self_exe))
        .args(["layout"])
        .arg(dir)
        .arg(scenario.layout.name())
        .status()
        .context("running the layout step")?;
    ensure!(status.success(), "creating the MIG layout failed");
    make_proc_farm(&node)?;
    Ok(node)
}

/// Opens our NVML backend on this node's fake library (the environment must be this node's).
pub fn backend(node: &FakeNode) -> Result<NvmlBackend> {
    NvmlBackend::new(&NvmlOptions {
        library: Some(node.nvml_library()),
    })
    .map_err(|e| anyhow::anyhow!("loading {}: {e}", node.nvml_library().display()))
}

/// Creates the MIG layout through NVML (run in a child with the node's environment).
pub fn create_layout(node: &FakeNode, layout: Layout) -> Result<()> {
    let backend = backend(node)?;
    for gpu in 0..node.gpus {
        let wanted = layout.profiles(gpu);
        if wanted.is_empty() {
            continue;
        }
        let mode = backend
            .mig_mode(gpu)
            .map_err(|e| anyhow::anyhow!("GPU {gpu} MIG mode: {e}"))?;
        ensure!(mode.current, "GPU {gpu}: MIG is off in the fixture");
        let profiles = backend
            .gpu_instance_profiles(gpu)
            .map_err(|e| anyhow::anyhow!("GPU {gpu} profiles: {e}"))?;
        for name in wanted {
            let profile = profiles
                .iter()
                .find(|p| p.name.to_string() == name)
                .with_context(|| format!("GPU {gpu} has no profile {name}"))?;
            let gi = backend
                .create_gpu_instance(gpu, profile.id, None)
                .map_err(|e| anyhow::anyhow!("GPU {gpu} create {name}: {e}"))?;
            let ci = backend
                .compute_instance_profiles(gpu, gi.id)
                .map_err(|e| anyhow::anyhow!("GPU {gpu} CI profiles: {e}"))?
                .into_iter()
                .max_by_key(|p| p.slice_count)
                .context("no compute-instance profile")?;
            backend
                .create_compute_instance(gpu, gi.id, ci.id)
                .map_err(|e| anyhow::anyhow!("GPU {gpu} create CI: {e}"))?;
        }
    }
    Ok(())
}

/// Pins the fake library's clock in the state file, so every process (ours, NVIDIA's, this
/// harness) sees the same `now` and a fault injected "now" is seen by all of them.
pub fn pin_clock(node: &FakeNode) -> Result<()> {
    let (sim, state) = sim_state(node)?;
    state
        .update(&sim, |s| {
            s.clock_s = Some(0.0);
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("pinning the clock: {e}"))
}

fn sim_state(node: &FakeNode) -> Result<(model::Node, model::StateFile)> {
    let sim = model::Node::load(&node.dir.join("fixture.yaml"))
        .map_err(|e| anyhow::anyhow!("loading fixture: {e}"))?;
    Ok((sim, model::StateFile::at(node.dir.join("state.json"))))
}

/// Injects faults through the state file, as another process on the node would see a driver
/// event. The fixture is loaded once, and a fault is staged before it is raised, so a timed
/// injection is the state file's rename (the moment the driver would raise the event), not the
/// fixture's parse or the state's read, encode and write.
pub struct FaultInjector {
    sim: model::Node,
    state: model::StateFile,
}

impl FaultInjector {
    /// Loads the node's fixture.
    pub fn open(node: &FakeNode) -> Result<FaultInjector> {
        let (sim, state) = sim_state(node)?;
        Ok(FaultInjector { sim, state })
    }

    /// Stages an Xid on a GPU "now": the changed state is written beside the state file, and
    /// the fault is raised (seen by any reader) when the returned change is committed.
    pub fn stage_xid(&self, gpu: u32, xid: u64) -> Result<model::Staged> {
        let sim = &self.sim;
        let (staged, _) = self
            .state
            .stage(sim, |s| {
                let now = s.clock_s.unwrap_or(0.0);
                s.inject(
                    sim,
                    model::FaultFixture {
                        at: now,
                        gpu,
                        fault: model::FaultKind::Xid(xid),
                        gpu_instance: None,
                        compute_instance: None,
                    },
                    now,
                )
            })
            .map_err(|e| anyhow::anyhow!("injecting Xid {xid} on GPU {gpu}: {e}"))?;
        Ok(staged)
    }
}

/// Clears every injected fault (a GPU reset of each GPU).
pub fn reset_all(node: &FakeNode) -> Result<()> {
    let (sim, state) = sim_state(node)?;
    state
        .update(&sim, |s| {
            let now = s.clock_s.unwrap_or(0.0);
            for gpu in 0..node.gpus {
                s.reset_gpu(&sim, gpu, now)?;
            }
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("resetting GPUs: {e}"))
}

/// The host files NVIDIA's tools read outside the driver root: `/proc/driver/nvidia-caps/
/// mig-minors` (nvidia-ctk's and the plugin's MIG capability minors) and
/// `/proc/driver/nvidia/…`. A GPU-less host has no `/proc/driver`, and procfs takes no new
/// directories, so NVIDIA's binaries run in a private mount namespace whose `/proc` is a
/// directory of symlinks into the real procfs (mounted at `realproc`) plus `driver` →
/// the driver root's `proc/driver`. Made once per node.
fn make_proc_farm(node: &FakeNode) -> Result<()> {
    let farm = node.dir.join("proc");
    let real = node.dir.join("realproc");
    fs::create_dir_all(&farm)?;
    fs::create_dir_all(&real)?;
    for entry in fs::read_dir("/proc")?.flatten() {
        let name = entry.file_name();
        if name == "driver" {
            continue;
        }
        std::os::unix::fs::symlink(real.join(&name), farm.join(&name))?;
    }
    std::os::unix::fs::symlink(node.root().join("proc/driver"), farm.join("driver"))?;
    Ok(())
}

/// `unshare` arguments that run `program` with the node's `/proc/driver` (see
/// [`make_proc_farm`]) and the extra bind mounts `(source, target)`.
pub fn host_namespace_args(
    node: &FakeNode,
    binds: &[(PathBuf, &str)],
    program: &Path,
) -> Vec<std::ffi::OsString> {
    let script = r#"set -e
d=$1; shift
mount --bind /proc "$d/realproc"
mount --bind "$d/proc" /proc
while [ "$1" != -- ]; do mount --bind "$1" "$2"; shift 2; done
shift
exec "$@""#;
    let mut args: Vec<std::ffi::OsString> = vec![
        "-m".into(),
        "--propagation".into(),
        "private".into(),
        "sh".into(),
        "-c".into(),
        script.into(),
        "sh".into(),
        node.dir.clone().into(),
    ];
    for (source, target) in binds {
        args.push(source.clone().into());
        args.push((*target).into());
    }
    args.push("--".into());
    args.push(program.into());
    args
}
