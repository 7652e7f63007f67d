//! CDI: `nvidia-ctk cdi generate` against our generator (`device-plugin/src/cdi.rs`) on the
//! same fake node.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpupool_crds::policy::CdiDeviceNameStrategy;
use gpupool_device_plugin::cdi::{CdiOptions, DriverRoot, SPEC_FILE_NAME, generate_and_write};
use gpupool_device_plugin::inventory::Inventory;
use serde_yaml::Value;

use crate::node::{FakeNode, backend};
use crate::report::Report;

/// Hook binary path written into NVIDIA's spec (it need not exist).
pub const HOOK_PATH: &str = "/usr/bin/nvidia-cdi-hook";

/// A device node as a set member: container path and host path.
pub type NodeEdit = (String, String);

/// A spec reduced to what both generators are compared on.
#[derive(Debug, Default)]
pub struct Normalized {
    /// `vendor/class`.
    pub kind: String,
    /// Device name → its device nodes.
    pub devices: BTreeMap<String, BTreeSet<NodeEdit>>,
    /// Spec-level device nodes.
    pub nodes: BTreeSet<NodeEdit>,
    /// Spec-level mounts: container path, host path.
    pub mounts: BTreeSet<(String, String)>,
    /// Spec-level env.
    pub env: BTreeSet<String>,
    /// Hooks anywhere in the spec: hook name and arguments after the binary.
    pub hooks: BTreeSet<String>,
    /// Device-node attributes written besides path/hostPath (e.g. `major`, `fileMode`).
    pub node_attributes: BTreeSet<String>,
}

fn str_of(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_owned)
}

fn seq<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    v.get(key)
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
}

fn node_edits(edits: &Value, attributes: &mut BTreeSet<String>) -> BTreeSet<NodeEdit> {
    seq(edits, "deviceNodes")
        .filter_map(|n| {
            if let Some(map) = n.as_mapping() {
                for k in map.keys().filter_map(Value::as_str) {
                    if k != "path" && k != "hostPath" {
                        attributes.insert(k.to_owned());
                    }
                }
            }
            let path = str_of(n, "path")?;
            let host = str_of(n, "hostPath").unwrap_or_else(|| path.clone());
            Some((path, host))
        })
        .collect()
}

fn hooks(edits: &Value, out: &mut BTreeSet<String>) {
    for h in seq(edits, "hooks") {
        let args: Vec<String> = seq(h, "args")
            .skip(1)
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect();
        out.insert(format!(
            "{}: {}",
            str_of(h, "hookName").unwrap_or_default(),
            args.join(" ")
        ));
    }
}

/// Reduces a CDI spec (YAML or JSON text).
pub fn normalize(text: &str) -> Result<Normalized> {
    let spec: Value = serde_yaml::from_str(text).context("parsing CDI spec")?;
    let mut n = Normalized {
        kind: str_of(&spec, "kind").unwrap_or_default(),
        ..Normalized::default()
    };
    for d in seq(&spec, "devices") {
        let name = str_of(d, "name").context("device without a name")?;
        let edits = d.get("containerEdits").cloned().unwrap_or(Value::Null);
        let nodes = node_edits(&edits, &mut n.node_attributes);
        hooks(&edits, &mut n.hooks);
        n.devices.insert(name, nodes);
    }
    let edits = spec.get("containerEdits").cloned().unwrap_or(Value::Null);
    n.nodes = node_edits(&edits, &mut n.node_attributes);
    hooks(&edits, &mut n.hooks);
    n.env = seq(&edits, "env")
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect();
    n.mounts = seq(&edits, "mounts")
        .filter_map(|m| Some((str_of(m, "containerPath")?, str_of(m, "hostPath")?)))
        .collect();
    Ok(n)
}

/// Runs `nvidia-ctk cdi generate` for the node; returns the spec text and the wall time.
pub fn run_nvidia_ctk(ctk: &Path, node: &FakeNode, out: &Path) -> Result<(String, Duration)> {
    let file = out.join("nvidia-ctk.yaml");
    let started = Instant::now();
    let output = node
        .apply_env(&mut Command::new("unshare"))
        .args(crate::node::host_namespace_args(node, &[], ctk))
        .args(["--quiet", "cdi", "generate", "--format", "yaml"])
        .arg("--driver-root")
        .arg(node.root())
        .args(["--nvidia-cdi-hook-path", HOOK_PATH])
        .arg("--output")
        .arg(&file)
        .output()
        .context("running nvidia-ctk")?;
    let took = started.elapsed();
    ensure!(
        output.status.success(),
        "nvidia-ctk cdi generate failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((fs::read_to_string(&file)?, took))
}

/// Runs our generator in a child (`ours-cdi`), as a process like nvidia-ctk; returns the spec
/// text and the wall time.
pub fn run_ours(self_exe: &Path, node: &FakeNode, out: &Path) -> Result<(String, Duration)> {
    let dir = out.join("gpupool-cdi");
    fs::create_dir_all(&dir)?;
    let started = Instant::now();
    let output = node
        .apply_env(&mut Command::new(self_exe))
        .arg("ours-cdi")
        .arg(&node.dir)
        .arg(&dir)
        .output()
        .context("running ours-cdi")?;
    let took = started.elapsed();
    ensure!(
        output.status.success(),
        "ours-cdi failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((fs::read_to_string(dir.join(SPEC_FILE_NAME))?, took))
}

/// The `ours-cdi` child: our NVML backend on the fake library, inventory, spec written to
/// `spec_dir` with the agent's default options (kind `gpupool.io/gpu`, index + UUID names).
pub fn ours_cdi(node_dir: &Path, spec_dir: &Path) -> Result<PathBuf> {
    let node = FakeNode::open(node_dir)?;
    let backend = backend(&node)?;
    let inventory = Inventory::read(&backend).map_err(|e| anyhow::anyhow!("inventory: {e}"))?;
    let options = CdiOptions {
        kind: "gpupool.io/gpu"
            .parse()
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        naming: CdiDeviceNameStrategy::all(),
    };
    let outcome = generate_and_write(
        &inventory,
        &DriverRoot::direct(node.root()),
        spec_dir,
        &options,
    )?;
    for s in &outcome.skipped {
        eprintln!("ours-cdi: skipped {s}");
    }
    Ok(spec_dir.join(SPEC_FILE_NAME))
}

/// Mounts nvidia-ctk adds that are not driver files: `/dev/null` over
/// `/var/run/nvidia-container-devices/void`, paired with `NVIDIA_VISIBLE_DEVICES=void`.
fn is_void_mount(m: &(String, String)) -> bool {
    m.0 == "/var/run/nvidia-container-devices/void"
}

/// Driver files one side mounts and the other does not, by design: the host path's file
/// name (or its end) and why.
const DELIBERATE_FILES: [(&str, &str, &str); 3] = [
    (
        "nvidia",
        "/dev/null",
        "nvidia-ctk bind-mounts /dev/null at /var/run/nvidia-container-devices/void, its marker \
         for the legacy runtime hook; we set only NVIDIA_VISIBLE_DEVICES=void",
    ),
    (
        "gpupool",
        "/etc/OpenCL/vendors/nvidia.icd",
        "we also mount the OpenCL ICD file, without which an OpenCL loader in the image cannot \
         find libnvidia-opencl; nvidia-ctk mounts no OpenCL ICD",
    ),
    (
        "nvidia",
        "/usr/bin/nvidia-cuda-mps-control",
        "nvidia-ctk mounts the MPS control program into every container; we mount it into none, \
         so a tenant cannot quit or reconfigure the node's MPS daemon (docs/security.md)",
    ),
];

/// Mounts nvidia-ctk makes that our spec leaves out of tenants' containers on purpose.
fn is_withheld_from_tenants(m: &(String, String)) -> bool {
    m.0.ends_with("/nvidia-cuda-mps-control")
}

/// The reasons that explain every item of `diff` (host paths) on `side`, or `None` if one is
/// not explained.
fn explain_files(side: &str, diff: &BTreeSet<String>) -> Option<Vec<&'static str>> {
    let mut reasons = Vec::new();
    for path in diff {
        let (_, _, why) = DELIBERATE_FILES
            .iter()
            .find(|(s, end, _)| *s == side && path.ends_with(end))?;
        if !reasons.contains(why) {
            reasons.push(*why);
        }
    }
    Some(reasons)
}

/// Mounts, in three rows: which host files each mounts; whether every mount nvidia-ctk makes
/// is in our spec at the same container path; and the container paths only we use (the soname
/// names that stand in for nvidia-ctk's symlink and ldcache hooks).
fn compare_mounts(report: &mut Report, s: &str, nvidia: &Normalized, ours: &Normalized) {
    let hosts = |n: &Normalized| {
        n.mounts
            .iter()
            .map(|(_, h)| h.clone())
            .collect::<BTreeSet<_>>()
    };
    report.compare_sets(
        s,
        "driver files mounted (hostPath)",
        &hosts(nvidia),
        &hosts(ours),
        |n, o| {
            let mut reasons = explain_files("nvidia", n)?;
            reasons.extend(explain_files("gpupool", o)?);
            Some(reasons.join("; "))
        },
    );
    let nvidia_paths: BTreeSet<&String> = nvidia.mounts.iter().map(|(c, _)| c).collect();
    let ours_at_nvidia_paths: BTreeSet<(String, String)> = ours
        .mounts
        .iter()
        .filter(|(c, _)| nvidia_paths.contains(c))
        .cloned()
        .collect();
    let nvidia_mounts: BTreeSet<(String, String)> = nvidia
        .mounts
        .iter()
        .filter(|m| !is_void_mount(m) && !is_withheld_from_tenants(m))
        .cloned()
        .collect();
    report.compare_sets(
        s,
        "nvidia-ctk's mounts in our spec (containerPath, hostPath)",
        &nvidia_mounts,
        &ours_at_nvidia_paths,
        |_, _| None,
    );
    let extra: BTreeSet<(String, String)> = ours
        .mounts
        .iter()
        .filter(|(c, _)| !nvidia_paths.contains(c))
        .cloned()
        .collect();
    report.compare_sets(
        s,
        "container paths only our spec uses (containerPath, hostPath)",
        &BTreeSet::new(),
        &extra,
        |_, o| {
            let stem = |p: &str| {
                let name = p.rsplit('/').next().unwrap_or("");
                name.split_once(".so").map(|(s, _)| s.to_owned())
            };
            let explained = o.iter().all(|(c, h)| {
                (stem(c).is_some() && stem(c) == stem(h))
                    || c == "/etc/OpenCL/vendors/nvidia.icd"
            });
            explained.then(|| {
                "each driver library is also mounted under its soname (and libcuda.so) in \
                 /usr/local/nvidia/lib64 (on the LD_LIBRARY_PATH of NVIDIA's CUDA and pytorch \
                 images) and in /usr/lib/<multiarch> and /usr/lib64 (glibc's default search), \
                 where nvidia-ctk mounts host paths only and relies on its create-symlinks and \
                 update-ldcache hooks; plus the OpenCL ICD file (see the hostPath row)"
                    .to_owned()
            })
        },
    );
}

/// Compares the two specs of one scenario, row by row.
pub fn compare(report: &mut Report, scenario: &str, nvidia: &Normalized, ours: &Normalized) {
    let s = scenario;
    let kinds = |k: &str| BTreeSet::from([k.to_owned()]);
    report.compare_sets(
        s,
        "CDI kind",
        &kinds(&nvidia.kind),
        &kinds(&ours.kind),
        |n, o| {
            (n.contains("nvidia.com/gpu") && o.contains("gpupool.io/gpu")).then(|| {
                "our kind is gpupool.io/gpu by design, so our spec never collides with one \
                 nvidia-ctk wrote on the same node (DESIGN.md, Conventions)"
                    .to_owned()
            })
        },
    );
    // Parent device nodes of MIG-enabled GPUs (those with `<gpu>:<mig>` names).
    let mig_parents: BTreeSet<String> = ours
        .devices
        .keys()
        .filter_map(|n| {
            n.split_once(':')
                .map(|(gpu, _)| format!("/dev/nvidia{gpu}"))
        })
        .collect();
    let whole_mig_gpu = |name: &str| {
        !name.contains(':')
            && !name.starts_with("MIG-")
            && name != "all"
            && ours
                .devices
                .get(name)
                .is_some_and(|nodes| nodes.iter().all(|(p, _)| mig_parents.contains(p)))
    };
    let whole_mig_reason = "we also name MIG-enabled GPUs as whole devices (`<index>`, \
         `GPU-<uuid>`: the parent /dev/nvidiaN only); nvidia-ctk leaves them out. MIG strategy \
         `none` advertises those GPUs as nvidia.com/gpu (NVIDIA's plugin does too, see the \
         strategy=none rows), so our Allocate answer must resolve in our spec; NVIDIA's plugin's \
         own spec also lacks them, so its strategy-none answer for such a GPU names a device \
         that is in no spec";
    let names = |n: &Normalized| n.devices.keys().cloned().collect::<BTreeSet<_>>();
    report.compare_sets(
        s,
        "CDI device names",
        &names(nvidia),
        &names(ours),
        |n, o| {
            (n.is_empty() && o.iter().all(|x| whole_mig_gpu(x)))
                .then(|| whole_mig_reason.to_owned())
        },
    );
    let per_device = |n: &Normalized| {
        n.devices
            .iter()
            .flat_map(|(name, nodes)| {
                nodes
                    .iter()
                    .map(move |(p, h)| (name.clone(), p.clone(), h.clone()))
            })
            .collect::<BTreeSet<_>>()
    };
    report.compare_sets(
        s,
        "device nodes of each device (name, path, hostPath)",
        &per_device(nvidia),
        &per_device(ours),
        |n, o| {
            (n.is_empty() && o.iter().all(|(x, _, _)| whole_mig_gpu(x)))
                .then(|| whole_mig_reason.to_owned())
        },
    );
    report.compare_sets(
        s,
        "spec-level device nodes (path, hostPath)",
        &nvidia.nodes,
        &ours.nodes,
        |_, _| None,
    );
    compare_mounts(report, s, nvidia, ours);
    report.compare_sets(s, "spec-level env", &nvidia.env, &ours.env, |n, o| {
        (n.iter().all(|e| e.starts_with("NVIDIA_CTK_LIBCUDA_DIR="))
            && o.iter().all(|e| e.starts_with("TRITON_LIBCUDA_PATH=")))
        .then(|| {
            "NVIDIA_CTK_LIBCUDA_DIR is read only by nvidia-cdi-hook, and our spec has no hooks; \
             we set TRITON_LIBCUDA_PATH (read only by Triton, which otherwise looks for libcuda \
             in the image's ld.so.cache) to the directory holding our libcuda.so names"
                .to_owned()
        })
    });
    report.compare_sets(s, "hooks", &nvidia.hooks, &ours.hooks, |_, o| {
        o.is_empty().then(|| {
            "our spec has zero hooks by design (no binary from the host runs in the container's \
             namespaces; CVE-2024-0132/CVE-2025-23266 class): soname mounts stand in for \
             create-symlinks and update-ldcache (see the container-path rows); CUDA forward \
             compatibility (enable-cuda-compat) is left to the image"
                .to_owned()
        })
    });
    report.compare_sets(
        s,
        "device-node attributes besides path/hostPath",
        &nvidia.node_attributes,
        &ours.node_attributes,
        |n, o| {
            let explained = n
                .iter()
                .all(|a| ["major", "minor", "fileMode", "permissions"].contains(&a.as_str()))
                && o.iter().all(|a| a == "permissions");
            explained.then(|| {
                "nvidia-ctk copies type/major/minor/fileMode from the host node and writes \
                 permissions rwm; we write permissions rw only (no mknod in the container) and \
                 let the runtime read the rest from the host node"
                    .to_owned()
            })
        },
    );
}
