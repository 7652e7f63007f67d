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
use k8s_openapi::api::core::v1::Event;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::{Value, json};

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
/// module's version file, driver libraries named by `version`, `nvidia-smi` and GSP firmware.
/// The one builder the device-plugin tests and the demo use too ([`gpupool_sim::driver_root`]).
pub fn fake_driver_root(root: &Path, version: &str, gpus: u32) -> Result<()> {
    gpupool_sim::driver_root::build(root, version, gpus)
        .with_context(|| format!("building a fake driver root in {}", root.display()))
}

/// The Events about object `name` (a cluster-scoped object: they live in `default`) with
/// `reason`.
pub async fn events_for(client: &Client, name: &str, reason: &str) -> Result<Vec<Event>> {
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let list = events
        .list(&ListParams::default().fields(&format!("involvedObject.name={name},reason={reason}")))
        .await?;
    Ok(list.items)
}

/// Waits up to 30 s for an Event about `name` with `reason`.
pub async fn wait_event(client: &Client, name: &str, reason: &str) -> Result<Event> {
    poll(
        &format!("a {reason} Event on {name}"),
        Duration::from_secs(30),
        Duration::from_millis(250),
        || async move { Ok(events_for(client, name, reason).await?.into_iter().next()) },
    )
    .await
}

/// Read-modify-write of the fake NVML's state file under its lock, as the library does.
pub fn update_nvml_state(
    state: &Path,
    change: impl FnOnce(&mut Value) -> Result<()>,
) -> Result<()> {
    let mut lock_path = state.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)?;
    lock.lock()?;
    let mut value: Value = serde_json::from_str(&fs::read_to_string(state)?)?;
    change(&mut value)?;
    let mut tmp = state.as_os_str().to_owned();
    tmp.push(".e2e.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(&value)?)?;
    fs::rename(&tmp, state)?;
    drop(lock);
    Ok(())
}

/// Injects a fault now (`at: 0` is always in the past of the library's clock).
pub fn inject_nvml_fault(state: &Path, gpu: u32, fault: Value) -> Result<()> {
    update_nvml_state(state, |s| {
        let seq = s["next_seq"].as_u64().unwrap_or(0);
        s["next_seq"] = json!(seq + 1);
        let injected = s["injected"]
            .as_array_mut()
            .context("state has no injected list")?;
        injected.push(json!({"seq": seq, "fault": {"at": 0.0, "gpu": gpu, "fault": fault}}));
        Ok(())
    })
}
