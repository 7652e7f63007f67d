//! The real-kubelet layer for tests: `e2e/kubelet` brings up one kubelet (node `real-node-0`)
//! beside the kwok nodes, on the in-memory runtime ([`Runtime::FakeCri`]) or on containerd with
//! runc ([`Runtime::Containerd`]); [`Agent`] runs our node agent for it on the fake NVML, as a
//! host process or as a container laid out as the chart runs it. One kubelet per machine: its
//! device-plugin directory is compiled in.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::agent::agent_binaries;
use crate::wait::poll;
use crate::{Cluster, TestScope, repo_root};

/// The container runtime under the kubelet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// `e2e/tools/fakecri`: runs nothing, records every CreateContainer.
    FakeCri,
    /// containerd with runc and CDI: containers really start.
    Containerd,
}

impl Runtime {
    /// The value `e2e/kubelet` takes in `GPUPOOL_E2E_RUNTIME`.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::FakeCri => "fakecri",
            Runtime::Containerd => "containerd",
        }
    }
}

pub fn kubelet_script() -> PathBuf {
    repo_root().join("e2e/kubelet")
}

/// The cluster's state directory: `e2e/cluster` writes the kubeconfig into it.
fn cluster_dir(cluster: &Cluster) -> Result<PathBuf> {
    cluster
        .kubeconfig()
        .parent()
        .map(Path::to_path_buf)
        .context("the kubeconfig has no parent directory")
}

fn kubelet_cmd(cluster: &Cluster, runtime: Runtime, args: &[&str]) -> Result<Command> {
    let mut cmd = Command::new(kubelet_script());
    cmd.args(args)
        .env("GPUPOOL_E2E_DIR", cluster_dir(cluster)?)
        .env("GPUPOOL_E2E_RUNTIME", runtime.name())
        .stdin(Stdio::null());
    Ok(cmd)
}

/// `e2e/kubelet env`, parsed.
fn kubelet_env(cluster: &Cluster, runtime: Runtime) -> Result<BTreeMap<String, String>> {
    let out = kubelet_cmd(cluster, runtime, &["env"])?.output()?;
    ensure!(out.status.success(), "e2e/kubelet env failed");
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// The running kubelet; `e2e/kubelet down` on drop, and from a watchdog process if this process
/// dies without unwinding.
pub struct RealKubelet {
    cluster: &'static Cluster,
    runtime: Runtime,
    /// The Node's name.
    pub node: String,
    /// The kubelet's device-plugin directory (where `kubelet.sock` is).
    pub device_plugin_dir: PathBuf,
    /// The PodResources socket.
    pub pod_resources: PathBuf,
    /// fakecri's CreateContainer record (JSON lines); absent on containerd.
    pub record: PathBuf,
    /// The kubelet's log.
    pub log: PathBuf,
    /// `e2e/kubelet`'s state directory.
    pub state_dir: PathBuf,
    /// The only directory the runtime reads CDI specs from (containerd).
    pub cdi_dir: PathBuf,
    /// The CRI socket.
    pub cri_socket: PathBuf,
    /// containerd's `ctr` (containerd only).
    pub ctr: Option<PathBuf>,
}

impl RealKubelet {
    /// `e2e/kubelet up` on `runtime`.
    pub fn up(cluster: &'static Cluster, runtime: Runtime) -> Result<RealKubelet> {
        let watchdog = r#"tail --pid="$1" -f /dev/null; "$2" down"#;
        let log = repo_root().join(format!(
            "target/e2e-kubelet-teardown-{}.log",
            std::process::id()
        ));
        fs::create_dir_all(log.parent().context("no parent")?)?;
        let out = fs::File::create(&log)?;
        {
            use std::os::unix::process::CommandExt;
            Command::new("sh")
                .arg("-c")
                .arg(watchdog)
                .arg("gpupool-e2e-kubelet-teardown")
                .arg(std::process::id().to_string())
                .arg(kubelet_script())
                .env("GPUPOOL_E2E_DIR", cluster_dir(cluster)?)
                .env("GPUPOOL_E2E_RUNTIME", runtime.name())
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .process_group(0)
                .spawn()
                .context("starting the kubelet teardown watchdog")?;
        }
        let status = kubelet_cmd(cluster, runtime, &["up"])?
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()?;
        ensure!(
            status.success(),
            "e2e/kubelet up failed ({status}); its output above names the step and the log"
        );
        let env = kubelet_env(cluster, runtime)?;
        let get = |k: &str| -> Result<String> {
            env.get(k)
                .cloned()
                .with_context(|| format!("e2e/kubelet env has no {k}"))
        };
        Ok(RealKubelet {
            cluster,
            runtime,
            node: get("KUBELET_NODE")?,
            device_plugin_dir: get("KUBELET_DEVICE_PLUGIN_DIR")?.into(),
            pod_resources: get("KUBELET_POD_RESOURCES_SOCKET")?.into(),
            record: get("KUBELET_CREATE_CONTAINER_RECORD")?.into(),
            log: get("KUBELET_LOG")?.into(),
            state_dir: get("KUBELET_STATE_DIR")?.into(),
            cdi_dir: get("KUBELET_CDI_DIR")?.into(),
            cri_socket: get("KUBELET_CRI_SOCKET")?.into(),
            ctr: env
                .get("KUBELET_CTR")
                .filter(|c| !c.is_empty())
                .map(PathBuf::from),
        })
    }

    /// `e2e/kubelet restart`: the kubelet only.
    pub fn restart(&self) -> Result<()> {
        let status = kubelet_cmd(self.cluster, self.runtime, &["restart"])?
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()?;
        ensure!(status.success(), "e2e/kubelet restart failed ({status})");
        Ok(())
    }

    /// What a container of a pod wrote to stdout and stderr, from the log file the runtime keeps
    /// for the kubelet (`<podLogsDir>/<ns>_<pod>_<uid>/<container>/<attempt>.log`, CRI format:
    /// `<time> <stream> <P|F> <text>`, partial lines joined). The API server cannot proxy logs
    /// here: the kubelet has no resolvable address.
    ///
    /// The latest attempt's file is read. The pod's phase can reach the API a moment before the
    /// runtime's log file is where this looks, so a missing file is waited for (a few seconds)
    /// before it is an error, and the error lists what the pod's log directory holds.
    pub fn container_log(&self, pod: &Pod, container: &str) -> Result<String> {
        let meta = &pod.metadata;
        let (ns, name, uid) = (
            meta.namespace.as_deref().context("pod without namespace")?,
            meta.name.as_deref().context("pod without name")?,
            meta.uid.as_deref().context("pod without uid")?,
        );
        let pod_dir = self
            .state_dir
            .join("pod-logs")
            .join(format!("{ns}_{name}_{uid}"));
        let dir = pod_dir.join(container);
        let deadline = std::time::Instant::now() + CONTAINER_LOG_WAIT;
        let path = loop {
            if let Some(path) = latest_attempt_log(&dir) {
                break path;
            }
            if std::time::Instant::now() >= deadline {
                bail!(
                    "no container log for {ns}/{name} container {container} in {} after {:?}; \
                     the pod's log directory holds: {}",
                    dir.display(),
                    CONTAINER_LOG_WAIT,
                    list_tree(&pod_dir)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = fs::read_to_string(&path)
            .with_context(|| format!("reading container log {}", path.display()))?;
        Ok(parse_cri_log(&text))
    }

    /// The kubelet's root directory: its device-plugin directory is `<root>/device-plugins`.
    pub fn kubelet_dir(&self) -> Result<&Path> {
        self.device_plugin_dir
            .parent()
            .context("device-plugin dir has no parent")
    }

    /// The kubelet's registration socket.
    pub fn kubelet_socket(&self) -> PathBuf {
        self.device_plugin_dir.join("kubelet.sock")
    }

    /// The kubelet log's length now (for [`RealKubelet::log_since`]).
    pub fn log_len(&self) -> u64 {
        fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0)
    }

    /// The kubelet log from `offset` on.
    pub fn log_since(&self, offset: u64) -> String {
        let mut text = String::new();
        if let Ok(mut f) = fs::File::open(&self.log)
            && f.seek(SeekFrom::Start(offset)).is_ok()
        {
            let _ = f.read_to_string(&mut text);
        }
        text
    }

    /// The CreateContainer records of one pod.
    /// fakecri's CreateContainer records of one pod.
    pub fn creates_of(&self, namespace: &str, pod: &str) -> Result<Vec<Value>> {
        let text = fs::read_to_string(&self.record).unwrap_or_default();
        let mut out = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line)
                .with_context(|| format!("a bad line in {}: {line}", self.record.display()))?;
            if v["podNamespace"] == namespace && v["podName"] == pod {
                out.push(v);
            }
        }
        Ok(out)
    }
}

impl Drop for RealKubelet {
    fn drop(&mut self) {
        // `down` removes the state directory; keep what explains a failure.
        let keep = repo_root().join(format!("target/e2e-kubelet-logs/{}", std::process::id()));
        if fs::create_dir_all(&keep).is_ok() {
            for f in [
                "kubelet.log",
                "fakecri.log",
                "containerd.log",
                "create-container.jsonl",
            ] {
                let _ = fs::copy(self.state_dir.join(f), keep.join(f));
            }
            eprintln!("e2e: kubelet logs kept in {}", keep.display());
        }
        match kubelet_cmd(self.cluster, self.runtime, &["down"]).and_then(|mut c| Ok(c.status()?)) {
            Ok(s) if s.success() => {}
            other => eprintln!("e2e: e2e/kubelet down: {other:?}"),
        }
    }
}

// --- the agent ---------------------------------------------------------------------------------

/// The agent for `real-node-0`; SIGKILLed on drop.
pub struct Agent {
    child: Child,
    /// Set when the agent runs as a container (its task is killed on drop).
    container: Option<AgentContainer>,
    /// The agent's log.
    pub log: PathBuf,
    /// The fake NVML's state file.
    pub state: PathBuf,
    /// The CDI spec the agent writes.
    pub cdi_spec: PathBuf,
    /// The fake NVML's fixture.
    pub fixture: PathBuf,
    /// The MPS root the agent keeps its daemons' directories in (host terms).
    pub mps_root: PathBuf,
}

impl Agent {
    /// Starts the agent for `kubelet`'s node with its files in `dir`: the fake NVML answers from
    /// `setup.fixture` (YAML), the driver root is `setup.driver_root` (built by the caller) and
    /// the CDI spec goes to `setup.cdi_dir`.
    pub fn start(
        dir: &Path,
        kubelet: &RealKubelet,
        cluster: &Cluster,
        setup: &AgentSetup,
    ) -> Result<Agent> {
        let (agent, nvml) = agent_binaries(dir)?;
        let files = AgentFiles::prepare(dir, setup)?;
        let AgentFiles {
            fixture,
            kmsg,
            log,
            state,
            ..
        } = &files;
        let driver_root = &setup.driver_root;
        let out = fs::File::create(log)?;
        let kubelet_dir = kubelet.kubelet_dir()?;
        let child = Command::new(agent)
            .arg("--node-name")
            .arg(&kubelet.node)
            .arg("--kubelet-dir")
            .arg(kubelet_dir)
            .arg("--pod-resources-socket")
            .arg(&kubelet.pod_resources)
            .arg("--cdi-dir")
            .arg(&setup.cdi_dir)
            .arg("--driver-root")
            .arg(driver_root)
            .arg("--mps-root")
            .arg(dir.join("mps"))
            .arg("--proc-root")
            .arg(driver_root.join("proc"))
            // An empty kernel log: the host's own /dev/kmsg is not this fake GPU node's.
            .arg("--kmsg-path")
            .arg(kmsg)
            .args(["--backend", "nvml", "--nvml-lib"])
            .arg(&nvml)
            .args([
                "--metrics-addr",
                "127.0.0.1:0",
                "--validate-interval-secs",
                "2",
                // The recovery hold-down (5 min by default) is the shipped behaviour; 20 s keeps
                // step 7 short and still shows that a reset GPU is held back before it returns.
                "--health-recovery-hold-down-secs",
                "20",
            ])
            .env("GPUPOOL_FAKE_NVML_FIXTURE", fixture)
            .env("GPUPOOL_FAKE_NVML_STATE", state)
            .envs(
                setup
                    .nvml_dev_dir
                    .iter()
                    .map(|d| ("GPUPOOL_FAKE_NVML_DEV_DIR", d.as_os_str())),
            )
            .env("KUBECONFIG", cluster.kubeconfig())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting the agent")?;
        Ok(files.into_agent(child, None, setup))
    }

    /// Starts the agent as a container on containerd, laid out as the chart runs it: a root
    /// file system of its own (the agent binary, and the loader and libraries it links, taken
    /// from this machine), the host's `/` read-only at `/host` with `--host-root=/host` (so
    /// nothing of the host is mounted over the image's `/usr` or `/lib`), the kubelet's
    /// directories and the CDI directory at their own paths, privileged, in the host's PID
    /// namespace. No `--nvml-lib`: NVML is loaded by full path from the driver root, found
    /// through its ld.so.cache. The host network stands in for the cluster's service network,
    /// which this test bed has no proxy for.
    pub fn start_in_container(
        dir: &Path,
        kubelet: &RealKubelet,
        cluster: &Cluster,
        setup: &AgentSetup,
    ) -> Result<Agent> {
        let ctr = kubelet
            .ctr
            .clone()
            .context("the agent runs as a container on containerd only")?;
        let (agent, nvml) = agent_binaries(dir)?;
        let rootfs = dir.join("agent-rootfs");
        image_root(&rootfs, &agent, &[&nvml])?;
        let files = AgentFiles::prepare(dir, setup)?;
        let AgentFiles {
            fixture,
            kmsg,
            log,
            state,
            mps_root,
        } = &files;
        let kubelet_dir = kubelet.kubelet_dir()?;
        let pod_resources_dir = kubelet
            .pod_resources
            .parent()
            .context("pod-resources socket has no parent")?;
        let at_host = |p: &Path| Path::new("/host").join(p.strip_prefix("/").unwrap_or(p));
        let id = format!("gpupool-agent-{}", std::process::id());
        let mount = |src: &Path, dst: &Path, options: &str| {
            format!(
                "type=bind,src={},dst={},options={options}",
                src.display(),
                dst.display()
            )
        };
        let driver_root = &setup.driver_root;
        let mut cmd = Command::new(&ctr);
        cmd.arg("--address")
            .arg(&kubelet.cri_socket)
            .args(["run", "--rm", "--privileged", "--net-host"])
            // The host's PID namespace (hostPID), named by this process's: PID 1 may be
            // another security context's, whose namespace links runc cannot open.
            .arg(format!("--with-ns=pid:/proc/{}/ns/pid", std::process::id()))
            .arg("--mount")
            .arg(mount(Path::new("/"), Path::new("/host"), "rbind:ro:rslave"))
            .arg("--mount")
            .arg(mount(
                &kubelet.device_plugin_dir,
                &kubelet.device_plugin_dir,
                "rbind:rw",
            ))
            .arg("--mount")
            .arg(mount(pod_resources_dir, pod_resources_dir, "rbind:ro"))
            .arg("--mount")
            .arg(mount(&setup.cdi_dir, &setup.cdi_dir, "rbind:rw"))
            // The fake NVML keeps its state in a file it rewrites.
            .arg("--mount")
            .arg(mount(dir, dir, "rbind:rw"))
            // The MPS root, writable under /host as the chart mounts it.
            .arg("--mount")
            .arg(mount(mps_root, &at_host(mps_root), "rbind:rw"));
        let env = [
            ("GPUPOOL_FAKE_NVML_FIXTURE", fixture.clone()),
            ("GPUPOOL_FAKE_NVML_STATE", state.clone()),
            ("KUBECONFIG", at_host(cluster.kubeconfig())),
            ("RUST_LOG", PathBuf::from("info")),
        ];
        for (k, v) in env.iter().chain(
            setup
                .nvml_dev_dir
                .as_ref()
                .map(|d| ("GPUPOOL_FAKE_NVML_DEV_DIR", at_host(d)))
                .iter(),
        ) {
            cmd.arg("--env").arg(format!("{k}={}", v.display()));
        }
        cmd.arg("--rootfs")
            .arg(&rootfs)
            .arg(&id)
            .arg("/gpupool-device-plugin")
            .arg(format!("--node-name={}", kubelet.node))
            .arg(format!("--kubelet-dir={}", kubelet_dir.display()))
            .arg(format!(
                "--pod-resources-socket={}",
                kubelet.pod_resources.display()
            ))
            .arg(format!("--cdi-dir={}", setup.cdi_dir.display()))
            .arg("--host-root=/host")
            .arg(format!("--mps-root={}", mps_root.display()))
            .arg(format!("--driver-root={}", driver_root.display()))
            .arg(format!(
                "--proc-root={}",
                at_host(&driver_root.join("proc")).display()
            ))
            .arg(format!("--kmsg-path={}", at_host(kmsg).display()))
            .args([
                "--backend=nvml",
                "--metrics-addr=127.0.0.1:0",
                "--validate-interval-secs=2",
            ]);
        let out = fs::File::create(log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting the agent's container with ctr")?;
        let container = AgentContainer {
            ctr,
            address: kubelet.cri_socket.clone(),
            id,
        };
        Ok(files.into_agent(child, Some(container), setup))
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Read-modify-write of the fake NVML's state file under its lock, as the library does.
    pub fn update_nvml_state(&self, change: impl FnOnce(&mut Value) -> Result<()>) -> Result<()> {
        crate::agent::update_nvml_state(&self.state, change)
    }

    /// Injects a fault now (`at: 0` is always in the past of the library's clock).
    pub fn inject_fault(&self, gpu: u32, fault: Value) -> Result<()> {
        crate::agent::inject_nvml_fault(&self.state, gpu, fault)
    }

    /// A GPU reset: clears every fault injected so far on `gpu`.
    pub fn reset_gpu(&self, gpu: u32) -> Result<()> {
        self.update_nvml_state(|s| {
            let seq = s["next_seq"].as_u64().unwrap_or(0);
            if !s["clears"].is_object() {
                s["clears"] = json!({});
            }
            s["clears"][gpu.to_string()] = json!({"at": 0.0, "seq": seq});
            Ok(())
        })
    }
}

/// What an [`Agent`] runs on.
pub struct AgentSetup {
    /// The fake NVML's fixture, as YAML.
    pub fixture: String,
    /// The driver root (see [`crate::agent::fake_driver_root`]).
    pub driver_root: PathBuf,
    /// Where the agent writes its CDI spec.
    pub cdi_dir: PathBuf,
    /// Where the agent's fake NVML looks for `/dev/nvidia<minor>` (`GPUPOOL_FAKE_NVML_DEV_DIR`):
    /// the driver root's `dev` when its nodes are real, since the host's `/dev` has none.
    pub nvml_dev_dir: Option<PathBuf>,
}

/// The agent's files in its directory: the fake NVML's fixture and state, an empty kernel log
/// (the host's is not this fake node's), and the agent's log.
struct AgentFiles {
    fixture: PathBuf,
    kmsg: PathBuf,
    log: PathBuf,
    state: PathBuf,
    mps_root: PathBuf,
}

impl AgentFiles {
    /// Writes the fixture and the empty kernel log under `dir`.
    fn prepare(dir: &Path, setup: &AgentSetup) -> Result<AgentFiles> {
        let files = AgentFiles {
            fixture: dir.join("fixture.yaml"),
            kmsg: dir.join("kmsg"),
            log: dir.join("agent.log"),
            state: dir.join("nvml-state.json"),
            mps_root: dir.join("mps"),
        };
        fs::create_dir_all(&files.mps_root)?;
        fs::write(&files.fixture, &setup.fixture)?;
        fs::write(&files.kmsg, "")?;
        Ok(files)
    }

    fn into_agent(
        self,
        child: Child,
        container: Option<AgentContainer>,
        setup: &AgentSetup,
    ) -> Agent {
        Agent {
            child,
            container,
            log: self.log,
            state: self.state,
            cdi_spec: setup.cdi_dir.join("gpupool-nvidia.yaml"),
            fixture: self.fixture,
            mps_root: self.mps_root,
        }
    }
}

/// The agent's container: `ctr`, containerd's socket and the container's id.
struct AgentContainer {
    ctr: PathBuf,
    address: PathBuf,
    id: String,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Agent {
    /// Kills the agent (its container's task too) and waits for it; again is a no-op.
    pub fn stop(&mut self) {
        if let Some(c) = self.container.take() {
            // Killing the `ctr run` client would leave the task running.
            for args in [
                &["task", "kill", "--signal", "SIGKILL"][..],
                &["container", "rm"][..],
            ] {
                let _ = Command::new(&c.ctr)
                    .arg("--address")
                    .arg(&c.address)
                    .args(args)
                    .arg(&c.id)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
                std::thread::sleep(Duration::from_millis(300));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lays out a root file system at `root` for `binary` (copied to `/<file name>`): the
/// dynamic loader and every library that it and `also` (libraries it loads at run time)
/// link, as `ldd` finds them on this machine, at the same paths. Nothing else: no shell,
/// no `/usr/bin`; an image as bare as the distroless one the agent ships in.
pub fn image_root(root: &Path, binary: &Path, also: &[&Path]) -> Result<()> {
    let _ = fs::remove_dir_all(root);
    for d in ["etc", "tmp", "proc", "sys", "dev", "host"] {
        fs::create_dir_all(root.join(d))?;
    }
    let name = binary.file_name().context("binary has no file name")?;
    fs::copy(binary, root.join(name)).with_context(|| format!("copying {}", binary.display()))?;
    for object in std::iter::once(binary).chain(also.iter().copied()) {
        let out = Command::new("ldd")
            .arg(object)
            .output()
            .context("running ldd")?;
        ensure!(
            out.status.success(),
            "ldd {}: {}",
            object.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or `/lib64/ld-linux-x86-64.so.2 (0x…)`.
            let path = line
                .split("=>")
                .last()
                .and_then(|p| p.split_whitespace().next())
                .filter(|p| p.starts_with('/'));
            let Some(path) = path else { continue };
            let dest = root.join(path.trim_start_matches('/'));
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent)?;
            }
            // The file the path leads to, under the name the loader asks for.
            fs::copy(path, &dest).with_context(|| format!("copying {path}"))?;
        }
    }
    fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/sbin/nologin\n")?;
    Ok(())
}

// --- cluster helpers ---------------------------------------------------------------------------

/// (capacity, allocatable) of `resource` on the Node; absent resources are `None`.
pub async fn node_resource(
    client: &Client,
    node: &str,
    resource: &str,
) -> Result<(Option<i64>, Option<i64>)> {
    let n = Api::<Node>::all(client.clone()).get(node).await?;
    let status = n.status.unwrap_or_default();
    let get =
        |m: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
            m.and_then(|m| m.get(resource))
                .and_then(|q| q.0.parse::<i64>().ok())
        };
    Ok((
        get(status.capacity.as_ref()),
        get(status.allocatable.as_ref()),
    ))
}

/// Waits until every `(resource, capacity, allocatable)` holds on the Node (`None` = absent).
pub async fn wait_node_resources(
    client: &Client,
    node: &str,
    what: &str,
    timeout: Duration,
    want: &[(&str, Option<i64>, Option<i64>)],
) -> Result<()> {
    poll(what, timeout, Duration::from_millis(100), || async move {
        let mut seen = Vec::new();
        let mut all = true;
        for (resource, cap, alloc) in want {
            let got = node_resource(client, node, resource).await?;
            all &= got == (*cap, *alloc);
            seen.push(format!("{resource}={got:?}"));
        }
        if all {
            Ok(Some(()))
        } else {
            bail!("node has {}", seen.join(", "))
        }
    })
    .await
}

/// Creates `pod`, retrying while the namespace's default ServiceAccount is not there yet.
pub async fn create_pod(client: &Client, scope: &TestScope, pod: &Pod) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), scope.namespace());
    // The namespace's default ServiceAccount appears shortly after the namespace.
    poll(
        "the pod to be created",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            match api.create(&PostParams::default(), pod).await {
                Ok(_) => Ok(Some(())),
                Err(e) => Err(e.into()),
            }
        },
    )
    .await
}

/// Waits until pod `name` satisfies `pred`.
pub async fn wait_pod(
    client: &Client,
    scope: &TestScope,
    name: &str,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&Pod) -> bool,
) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), scope.namespace());
    let pred = &pred;
    poll(what, timeout, Duration::from_millis(100), || {
        let api = api.clone();
        async move {
            let pod = api.get(name).await?;
            Ok(pred(&pod).then_some(pod))
        }
    })
    .await
}

/// The pod's phase ("" before it has one).
pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// Deletes a pod at once and waits until it is gone.
pub async fn delete_pod_and_wait(client: &Client, scope: &TestScope, name: &str) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), scope.namespace());
    api.delete(name, &DeleteParams::default().grace_period(0))
        .await?;
    poll(
        &format!("pod {name} to be gone"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let api = api.clone();
            async move { Ok(api.get_opt(name).await?.is_none().then_some(())) }
        },
    )
    .await
}

/// Whether this layer runs, and why not.
///
/// # Panics
/// When the check itself fails (an exit status other than 0 or 3): a broken script must fail
/// the tests, not skip them.
///
/// Under `GPUPOOL_E2E_STRICT=1` (CI sets it: it installs everything this layer needs) a reason
/// to skip is a failure too, so a layer that silently stopped running cannot pass for green.
pub fn skip_reason(runtime: Runtime) -> Option<String> {
    let why = skip_reason_lax(runtime)?;
    if crate::strict() {
        panic!("GPUPOOL_E2E_STRICT=1, so this layer must run, but it would skip: {why}");
    }
    Some(why)
}

fn skip_reason_lax(runtime: Runtime) -> Option<String> {
    if std::env::var("GPUPOOL_E2E_KUBELET").as_deref() != Ok("1") {
        return Some("the real-kubelet layer is opt-in: set GPUPOOL_E2E_KUBELET=1".to_owned());
    }
    match Command::new(kubelet_script())
        .arg("check")
        .env("GPUPOOL_E2E_RUNTIME", runtime.name())
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => None,
        // 3: this machine cannot run a kubelet, and stdout says why.
        Ok(out) if out.status.code() == Some(3) => {
            Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        }
        // Anything else is the script failing, which must not pass for a skip.
        Ok(out) => panic!(
            "e2e/kubelet check failed ({}), which is no reason to skip:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("e2e/kubelet check could not run: {e}"),
    }
}

/// The text of a CRI container log: each line is `<time> <stream> <tag> <text>`, where tag `P`
/// marks a partial line continued by the next one.
pub fn parse_cri_log(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (_time, _stream, tag) = (parts.next(), parts.next(), parts.next());
        let body = parts.next().unwrap_or("");
        out.push_str(body);
        if tag != Some("P") {
            out.push('\n');
        }
    }
    out
}

/// How long [`RealKubelet::container_log`] waits for a container's log file to appear.
const CONTAINER_LOG_WAIT: Duration = Duration::from_secs(10);

/// The `<attempt>.log` with the highest attempt in a container's log directory.
fn latest_attempt_log(dir: &Path) -> Option<PathBuf> {
    fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let attempt: u32 = name.to_str()?.strip_suffix(".log")?.parse().ok()?;
            Some((attempt, e.path()))
        })
        .max_by_key(|(attempt, _)| *attempt)
        .map(|(_, path)| path)
}

/// Every path under `dir`, relative to it, for an error message ("(missing)" when `dir` is).
fn list_tree(dir: &Path) -> String {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let path = e.path();
            out.push(
                path.strip_prefix(base)
                    .unwrap_or(&path)
                    .display()
                    .to_string(),
            );
            if path.is_dir() {
                walk(&path, base, out);
            }
        }
    }
    if !dir.exists() {
        return format!("{} (missing)", dir.display());
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    if out.is_empty() {
        "(nothing)".into()
    } else {
        out.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_log_lines_are_joined_at_partial_tags() {
        let text = "2026-12-03T12:22:48.1Z stdout F a=1\n\
                    2026-12-03T12:22:48.2Z stderr P par\n\
                    2026-12-03T12:22:48.3Z stderr F tial\n\
                    2026-12-03T12:22:48.4Z stdout F with spaces = x y\n";
        assert_eq!(parse_cri_log(text), "a=1\npartial\nwith spaces = x y\n");
    }

    #[test]
    fn the_latest_attempt_log_is_read_and_others_ignored() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(latest_attempt_log(&dir.path().join("absent")), None);
        assert_eq!(latest_attempt_log(dir.path()), None);
        for f in ["0.log", "2.log", "10.log", "11.log.20261204-1", "x.log"] {
            fs::write(dir.path().join(f), "").unwrap();
        }
        assert_eq!(
            latest_attempt_log(dir.path()),
            Some(dir.path().join("10.log"))
        );
        assert!(list_tree(dir.path()).contains("10.log"));
        assert!(list_tree(&dir.path().join("absent")).ends_with("(missing)"));
    }
}
