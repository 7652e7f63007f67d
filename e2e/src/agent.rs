//! What the tests that run the node agent as a host process share: the agent binary and the
//! fake NVML library (built once, copied out of the shared target directory), and a fake
//! driver root for the agent's validation and CDI spec.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use gpupool_crds::GpuNode;
use gpupool_crds::node::GpuNodeStatus;
use kube::{Api, Client};

use crate::artifacts;
use crate::wait::poll;

/// The agent binary and the fake NVML library (as `libnvidia-ml.so.1`), copied to `dir`, since
/// the shared target directory may be rebuilt by others meanwhile. `GPUPOOL_AGENT_BIN` and
/// `GPUPOOL_FAKE_NVML_LIB` name prebuilt ones; otherwise cargo builds each (see [`artifacts`]).
///
/// The e2e crate does not depend on the device-plugin crate: that would build a kube client
/// with two rustls providers into every test binary.
///
/// [`artifacts`]: crate::artifacts
pub fn agent_binaries(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let agent = artifacts::agent_binary()?;
    let nvml = artifacts::fake_nvml_library()?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let agent_copy = dir.join("gpupool-device-plugin");
    let nvml_copy = dir.join("libnvidia-ml.so.1");
    fs::copy(&agent, &agent_copy).with_context(|| format!("copying {}", agent.display()))?;
    fs::copy(&nvml, &nvml_copy).with_context(|| format!("copying {}", nvml.display()))?;
    fs::set_permissions(&agent_copy, fs::Permissions::from_mode(0o755))?;
    Ok((agent_copy, nvml_copy))
}

/// Waits until the status the agent wrote on GpuNode `name` satisfies `pred`.
pub async fn wait_status(
    client: &Client,
    name: &str,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&GpuNodeStatus) -> bool,
) -> Result<GpuNode> {
    let api: Api<GpuNode> = Api::all(client.clone());
    let pred = &pred;
    poll(what, timeout, Duration::from_millis(250), || {
        let api = api.clone();
        async move {
            let gn = api.get(name).await?;
            Ok(gn.status.as_ref().is_some_and(pred).then_some(gn))
        }
    })
    .await
}

/// A driver root as a driver installs it, with device nodes as plain files: control nodes, one
/// `/dev/nvidiaN` per GPU, MIG capability nodes with their `mig-minors` table, the kernel
/// module's version file, driver libraries named by `version`, and `nvidia-smi`.
pub fn fake_driver_root(root: &Path, version: &str, gpus: u32) -> Result<()> {
    let write = |rel: &str, content: &str| -> Result<()> {
        let path = root.join(rel);
        fs::create_dir_all(path.parent().context("no parent")?)?;
        fs::write(&path, content).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    };
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia-modeset",
    ] {
        write(&format!("dev/{n}"), "")?;
    }
    let mut minors = String::from("config 1\nmonitor 2\n");
    let mut next = 3;
    for gpu in 0..gpus {
        write(&format!("dev/nvidia{gpu}"), "")?;
        for gi in 0..15 {
            minors.push_str(&format!("gpu{gpu}/gi{gi}/access {next}\n"));
            write(&format!("dev/nvidia-caps/nvidia-cap{next}"), "")?;
            next += 1;
            for ci in 0..8 {
                minors.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {next}\n"));
                write(&format!("dev/nvidia-caps/nvidia-cap{next}"), "")?;
                next += 1;
            }
        }
    }
    write("proc/driver/nvidia-caps/mig-minors", &minors)?;
    write(
        "proc/driver/nvidia/version",
        &format!("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}\n"),
    )?;
    for lib in ["libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler"] {
        write(&format!("usr/lib/x86_64-linux-gnu/{lib}.so.{version}"), "")?;
    }
    write("usr/bin/nvidia-smi", "")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_driver_root_has_nodes_minors_and_versioned_libraries() {
        let dir =
            std::env::temp_dir().join(format!("gpupool-e2e-driver-root-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fake_driver_root(&dir, "550.54.15", 2).expect("driver root");
        for path in [
            "dev/nvidiactl",
            "dev/nvidia1",
            "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
        ] {
            assert!(dir.join(path).exists(), "{path}");
        }
        assert!(!dir.join("dev/nvidia2").exists());
        let minors =
            fs::read_to_string(dir.join("proc/driver/nvidia-caps/mig-minors")).expect("minors");
        // 2 GPUs × 15 GPU instances × (1 + 8 compute instances) capability nodes, after config/monitor.
        assert_eq!(minors.lines().count(), 2 + 2 * 15 * 9);
        assert!(minors.contains("gpu1/gi14/ci7/access 272\n"), "{minors}");
        assert!(dir.join("dev/nvidia-caps/nvidia-cap272").exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
