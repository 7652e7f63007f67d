//! A GPU node on a real runtime, shared by the real-node test and the pod-start bench: the
//! kubelet on containerd ([`RealKubelet`] with [`Runtime::Containerd`]), a driver root as a
//! driver install leaves it (character device nodes, ELF libraries carrying their sonames, the
//! fake NVML as `libnvidia-ml` and the fake CUDA driver as `libcuda`, an `ld.so.cache`), the
//! GpuNode the operator would write, and our agent writing its CDI spec where containerd reads
//! specs. Pods built by [`probe_pod`] run the images `e2e/tools/node/build.sh` makes.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use gpupool_crds::node::{GpuNodeStatus, NodeMigSpec, UtilizationSpec};
use gpupool_crds::policy::DriverPolicy;
use gpupool_crds::{GpuNode, GpuNodeSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::agent::wait_status;
use crate::kubelet::{Agent, AgentSetup, RealKubelet};
use crate::wait::poll;
use crate::{Cluster, TestScope, artifacts, repo_root};

/// The driver version of the fake driver root and fixture.
pub const DRIVER: &str = "550.54.15";
/// Debian bookworm with python3, nvidia-ml-py and `/probe`; no environment of its own.
pub const PROBE_IMAGE: &str = "gpupool.local/e2e/probe:1";
/// The same files with NVIDIA's CUDA-image `LD_LIBRARY_PATH`.
pub const PROBE_CUDA_ENV_IMAGE: &str = "gpupool.local/e2e/probe-cuda-env:1";
/// Where pods find the fake NVML's fixture and state (a hostPath volume of the agent's files).
pub const FAKE_DIR: &str = "/gpupool-fake";

/// Builds the driver root at `root` with `gpus` GPUs: character device nodes, ELF libraries
/// with their sonames (the fake NVML and fake CUDA driver installed as the driver's), the soname
/// links and `etc/ld.so.cache`. Needs root (mknod, ldconfig) and a C compiler.
pub fn real_driver_root(root: &Path, gpus: u32) -> Result<()> {
    let smi = root.with_file_name("nvidia-smi");
    fake_nvidia_smi(&smi)?;
    let options = gpupool_sim::driver_root::BuildOptions {
        elf_libraries: true,
        device_nodes: gpupool_sim::driver_root::DeviceNodes::CharDevices,
        nvml: Some(artifacts::fake_nvml_library()?),
        cuda: Some(artifacts::fake_cuda_library()?),
        nvidia_smi: Some(smi),
        ldconfig: true,
    };
    gpupool_sim::driver_root::build_with(root, DRIVER, gpus, &options)
        .with_context(|| format!("building the driver root {}", root.display()))
}

/// Compiles `e2e/fake-nvml/nvidia-smi.c` to `out`: `nvidia-smi -L` through the driver's NVML.
pub fn fake_nvidia_smi(out: &Path) -> Result<()> {
    let source = repo_root().join("e2e/fake-nvml/nvidia-smi.c");
    let status = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-o"])
        .arg(out)
        .arg(&source)
        .arg("-ldl")
        .status()
        .context("running cc for the fake nvidia-smi")?;
    anyhow::ensure!(status.success(), "cc {}: {status}", source.display());
    Ok(())
}

/// The kubelet's node, its agent and their files.
pub struct GpuNodeHost {
    /// The agent (killed on drop).
    pub agent: Agent,
    /// The agent's files: fixture, fake NVML state, log; pods mount it at [`FAKE_DIR`].
    pub dir: PathBuf,
    /// The driver root.
    pub driver_root: PathBuf,
    /// The status the agent first reported once `ready` held.
    pub status: GpuNodeStatus,
    /// What the agent runs on (to start it again).
    setup: AgentSetup,
}

impl GpuNodeHost {
    /// Makes `gpus` H100s on `kubelet`'s node with MIG layout `mig`, starts the agent and waits
    /// until its status satisfies `ready`.
    pub async fn start(
        cluster: &'static Cluster,
        scope: &TestScope,
        kubelet: &RealKubelet,
        gpus: u32,
        mig: NodeMigSpec,
        ready: impl Fn(&GpuNodeStatus) -> bool,
    ) -> Result<GpuNodeHost> {
        let client = cluster.client().await?;
        let node = &kubelet.node;
        let dir = repo_root()
            .join("target/e2e-node-agent")
            .join(scope.prefix());
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        let driver_root = dir.join("driver");
        real_driver_root(&driver_root, gpus)?;

        let gpunodes: Api<GpuNode> = Api::all(client.clone());
        if gpunodes.get_opt(node).await?.is_some() {
            gpunodes.delete(node, &DeleteParams::default()).await?;
        }
        let mut gn = GpuNode::new(
            node,
            GpuNodeSpec {
                sharing: Default::default(),
                pool: scope.prefix().to_owned(),
                driver: DriverPolicy {
                    min_version: Some("550".into()),
                    ..DriverPolicy::default()
                }
                .into(),
                cdi: Default::default(),
                mig: mig.into(),
                utilization: UtilizationSpec {
                    idle_threshold: 5,
                    sample_interval: Duration::from_secs(1).into(),
                },
            },
        );
        let (k, v) = scope.label();
        gn.metadata.labels = Some(BTreeMap::from([(k.to_owned(), v.to_owned())]));
        scope.track_kind("gpunodes.gpupool.io");
        // A GpuNode deleted just before may still be going.
        poll(
            "the GpuNode to be created",
            Duration::from_secs(30),
            Duration::from_millis(200),
            || async {
                Ok(gpunodes
                    .create(&PostParams::default(), &gn)
                    .await
                    .ok()
                    .map(|_| ()))
            },
        )
        .await?;
        let setup = AgentSetup {
            fixture: format!(
                "node: {node}\ndriver: {{version: \"{DRIVER}\", cuda: \"12.4\"}}\ngpus:\n  - model: H100-SXM5-80GB\n    count: {gpus}\n"
            ),
            driver_root: driver_root.clone(),
            cdi_dir: kubelet.cdi_dir.clone(),
            // The host's /dev has no GPU nodes; the agent sees the driver root's. In containers
            // the fake NVML looks at their /dev, like the real driver.
            nvml_dev_dir: Some(driver_root.join("dev")),
        };
        let agent = Agent::start(&dir, kubelet, cluster, &setup)?;
        let gn = wait_status(
            &client,
            node,
            "the agent's first status",
            Duration::from_secs(90),
            ready,
        )
        .await
        .with_context(|| agent.log_text())?;
        // Pods (one as uid 1000) share the fake NVML's state and lock with the agent.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777))?;
        for f in ["nvml-state.json", "nvml-state.json.lock"] {
            if dir.join(f).exists() {
                fs::set_permissions(dir.join(f), fs::Permissions::from_mode(0o666))?;
            }
        }
        Ok(GpuNodeHost {
            agent,
            dir,
            driver_root,
            status: gn.status.unwrap_or_default(),
            setup,
        })
    }

    /// Stops the agent and starts it again as a container laid out as the chart runs it
    /// ([`Agent::start_in_container`]), on the same fake NVML state and driver root.
    pub fn agent_in_container(&mut self, cluster: &Cluster, kubelet: &RealKubelet) -> Result<()> {
        // The host process goes first: two agents would fight over the plugin sockets.
        self.agent.stop();
        self.agent = Agent::start_in_container(&self.dir, kubelet, cluster, &self.setup)?;
        Ok(())
    }

    /// Chart values (`--set-json` pairs) that run the chart's agent DaemonSet on this node in
    /// place of [`Self::agent`], on the same fake NVML state and driver root. Only what this
    /// test bed lays out unlike a GPU node is set; security context, the host's `/` at `/host`,
    /// hostPID, the device-plugin directory and `--host-root` stay the chart's:
    /// * placement: this node only (the kwok nodes run no containers), with its taint tolerated;
    /// * `hostPaths`: the driver root, containerd's CDI directory (no pool may name it, hence
    ///   also `--cdi-dir`) and the kubelet's PodResources directory under its `--root-dir`;
    /// * the fake NVML's files (fixture, state, kernel log, the driver root's `dev`), mounted
    ///   read-write at their own paths, and `--proc-root` for its process table.
    pub fn chart_agent_values(&self, kubelet: &RealKubelet) -> Result<Vec<(String, Value)>> {
        let node = &kubelet.node;
        let pod_resources = kubelet
            .pod_resources
            .parent()
            .context("the PodResources socket has no directory")?;
        let at_host = |p: &Path| format!("/host{}", p.display());
        let cdi = kubelet.cdi_dir.display().to_string();
        let mut env = vec![
            json!({"name": "GPUPOOL_FAKE_NVML_FIXTURE", "value": self.agent.fixture}),
            json!({"name": "GPUPOOL_FAKE_NVML_STATE", "value": self.agent.state}),
        ];
        if let Some(dev) = &self.setup.nvml_dev_dir {
            env.push(json!({"name": "GPUPOOL_FAKE_NVML_DEV_DIR", "value": dev}));
        }
        let values = [
            (
                "agent.gpuNodeLabels",
                json!([{"key": "kubernetes.io/hostname", "value": node}]),
            ),
            (
                "agent.tolerations",
                json!([{"key": "e2e.gpupool.io/real-kubelet", "operator": "Exists", "effect": "NoSchedule"}]),
            ),
            ("agent.hostPaths.driverRoot", json!(self.driver_root)),
            ("agent.hostPaths.cdiDir", json!(cdi)),
            ("agent.hostPaths.podResources", json!(pod_resources)),
            (
                "agent.kmsgPath",
                json!(self.dir.join("kmsg").display().to_string()),
            ),
            (
                "agent.extraArgs",
                json!([
                    format!("--cdi-dir={cdi}"),
                    format!("--proc-root={}", at_host(&self.driver_root.join("proc"))),
                ]),
            ),
            ("agent.env", Value::Array(env)),
            (
                "agent.volumes",
                json!([{"name": "fake-node", "hostPath": {"path": self.dir, "type": "Directory"}}]),
            ),
            (
                "agent.volumeMounts",
                json!([{"name": "fake-node", "mountPath": self.dir}]),
            ),
        ];
        Ok(values.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }
}

/// A pod on `node` running `command` in `image`, asking for one `resource` (none: a CPU pod),
/// with the fake NVML's files at [`FAKE_DIR`]. `restricted`: read-only root file system, uid
/// and gid 1000, no capabilities.
#[allow(clippy::too_many_arguments)]
pub fn probe_pod(
    scope: &TestScope,
    name: &str,
    node: &str,
    image: &str,
    command: &[&str],
    resource: Option<&str>,
    fake_dir: &Path,
    restricted: bool,
) -> Result<Pod> {
    let (k, v) = scope.label();
    let limits = resource.map(|r| json!({ r: "1" })).unwrap_or(json!({}));
    let security = if restricted {
        json!({
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "runAsNonRoot": true,
            "capabilities": {"drop": ["ALL"]},
        })
    } else {
        json!({"allowPrivilegeEscalation": false})
    };
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": scope.namespace(), "labels": {k: v}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"key": "e2e.gpupool.io/real-kubelet", "operator": "Exists", "effect": "NoSchedule"}],
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "restartPolicy": "Never",
            "containers": [{
                "name": "probe",
                "image": image,
                "imagePullPolicy": "Never",
                "command": command,
                "env": [
                    {"name": "GPUPOOL_FAKE_NVML_FIXTURE", "value": format!("{FAKE_DIR}/fixture.yaml")},
                    {"name": "GPUPOOL_FAKE_NVML_STATE", "value": format!("{FAKE_DIR}/nvml-state.json")},
                ],
                "resources": {"limits": limits},
                "securityContext": security,
                "volumeMounts": [{"name": "fake", "mountPath": FAKE_DIR}],
            }],
            "volumes": [{"name": "fake", "hostPath": {"path": fake_dir, "type": "Directory"}}],
        },
    }))?)
}
