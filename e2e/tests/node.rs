//! A real node: the kubelet on containerd with runc (`e2e/kubelet` with
//! `GPUPOOL_E2E_RUNTIME=containerd`), our node agent on the fake NVML, and GPU pods that really
//! start. containerd resolves the CDI names our plugin hands out against the spec our agent
//! wrote, runc builds the containers, and a probe inside each container reports what it sees
//! (`e2e/tools/node/images/probe.c` and NVIDIA's Python bindings in `pyprobe.py`).
//!
//! The driver root is as a driver install leaves it: real character device nodes, real ELF
//! libraries carrying their sonames (the fake NVML as `libnvidia-ml.so.<version>`, the fake CUDA
//! driver as `libcuda.so.<version>`) and an `ld.so.cache`. Inside a container the fake NVML and
//! fake CUDA count only the GPUs whose `/dev/nvidia<minor>` the container has, as the real driver
//! does, so a count is a statement about the device nodes the spec gave it.
//!
//! One scenario, in order (one kubelet per machine):
//! 1. capacity: 1 whole GPU and three `1g.10gb` MIG slices;
//! 2. a pod asking for `nvidia.com/gpu: 1` on a Debian image with no environment of its own:
//!    exactly that GPU's node and the control nodes; `libcuda.so.1`, `libcuda.so` and
//!    `libnvidia-ml.so.1` load by soname; CUDA, NVML and nvidia-ml-py count one GPU, the one
//!    the agent reports the pod on; the driver files are read-only;
//! 3. the same with a read-only root file system and a non-root user;
//! 4. an image that sets `LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64` (as
//!    NVIDIA's CUDA images do): the variable is the image's, unchanged, and the driver loads from
//!    `/usr/local/nvidia/lib64`;
//! 5. a pod asking for `nvidia.com/mig-1g.10gb: 1`: the parent GPU's node and that slice's
//!    `nvidia-caps` nodes, no other GPU;
//! 6. the CDI spec deleted under the running agent: the agent reports it and writes it again,
//!    and a new GPU pod starts;
//! 7. the agent run again as a container laid out as the chart runs it (its own root file
//!    system and loader, the host's `/` read-only at `/host`, NVML loaded by full path from the
//!    driver root): the same spec, byte for byte, and a GPU pod starts through it;
//! 8. `helm install` of the chart and `helm test`: its test pod, on this node, finds the GPU's
//!    device node and NVML (the spec's `nvidia-smi -L`) lists that GPU and no other.
//!
//! Opt-in with the rest of the real-kubelet layer (`GPUPOOL_E2E_KUBELET=1`); `e2e/kubelet check`
//! with the containerd runtime says why it cannot run otherwise.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use gpupool_crds::node::{GpuMigSpec, MigState, NodeMigSpec};
use gpupool_crds::policy::MigStrategy;
use gpupool_e2e::agent::{wait_event, wait_status};
use gpupool_e2e::kubelet::{
    RealKubelet, Runtime, create_pod, delete_pod_and_wait, phase, skip_reason, wait_node_resources,
    wait_pod,
};
use gpupool_e2e::node::{FAKE_DIR, GpuNodeHost, PROBE_CUDA_ENV_IMAGE, PROBE_IMAGE, probe_pod};
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, crds, repo_root};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use serde_json::json;

const GPU: &str = "nvidia.com/gpu";
const MIG_1G: &str = "nvidia.com/mig-1g.10gb";
/// The C probe, then NVIDIA's Python bindings.
const PROBE_COMMAND: [&str; 3] = ["/bin/sh", "-c", "/probe && python3 /pyprobe.py"];

/// The probe's `key=value` lines; repeated keys keep every value.
#[derive(Debug, Default)]
struct Probe(BTreeMap<String, Vec<String>>);

impl Probe {
    fn parse(text: &str) -> Probe {
        let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for line in text.lines() {
            if let Some((k, v)) = line.split_once('=') {
                map.entry(k.to_owned()).or_default().push(v.to_owned());
            }
        }
        Probe(map)
    }

    fn one(&self, key: &str) -> Result<&str> {
        match self.0.get(key).map(Vec::as_slice) {
            Some([v]) => Ok(v),
            other => bail!("probe key {key}: want one value, got {other:?}; probe said {self:?}"),
        }
    }

    fn all(&self, key: &str) -> Vec<String> {
        self.0.get(key).cloned().unwrap_or_default()
    }

    /// `device=/dev/x 195:0` lines as path -> "major:minor".
    fn devices(&self) -> BTreeMap<String, String> {
        self.all("device")
            .iter()
            .filter_map(|d| d.split_once(' '))
            .map(|(p, n)| (p.to_owned(), n.to_owned()))
            .collect()
    }
}

/// Runs a probe pod to completion and returns what it printed.
async fn run_probe(
    client: &Client,
    scope: &TestScope,
    kubelet: &RealKubelet,
    pod: &Pod,
) -> Result<(Probe, Pod)> {
    let name = pod.metadata.name.clone().context("pod without name")?;
    let created = Instant::now();
    create_pod(client, scope, pod).await?;
    let done = wait_pod(
        client,
        scope,
        &name,
        &format!("{name} to run to completion"),
        Duration::from_secs(120),
        |p| matches!(phase(p), "Succeeded" | "Failed"),
    )
    .await
    .with_context(|| format!("kubelet log: {}", kubelet.log.display()))?;
    let log = kubelet.container_log(&done, "probe")?;
    eprintln!(
        "e2e: {name} {} after {:.1}s; it printed:\n{log}",
        phase(&done),
        created.elapsed().as_secs_f64()
    );
    ensure!(
        phase(&done) == "Succeeded",
        "{name} ended {}: {:?}",
        phase(&done),
        done.status
    );
    Ok((Probe::parse(&log), done))
}

/// The checks every GPU container must pass: the driver loads by soname from read-only files
/// and CUDA, NVML and nvidia-ml-py count one GPU.
fn check_driver_loads(probe: &Probe, what: &str) -> Result<()> {
    for lib in ["libcuda", "libcuda_unversioned", "libnvml"] {
        ensure!(
            probe.one(&format!("{lib}_load"))? == "ok",
            "{what}: {lib} did not load: {probe:?}"
        );
        ensure!(
            probe.one(&format!("{lib}_writable"))?.starts_with("no"),
            "{what}: the mounted {lib} is writable: {probe:?}"
        );
    }
    ensure!(probe.one("cuInit")? == "0", "{what}: cuInit failed");
    ensure!(
        probe.one("cuDeviceGetCount")? == "0 count=1",
        "{what}: CUDA counts {}, want 1",
        probe.one("cuDeviceGetCount")?
    );
    ensure!(probe.one("nvmlInit")? == "0", "{what}: nvmlInit failed");
    ensure!(
        probe.one("nvmlDeviceGetCount")? == "0 count=1",
        "{what}: NVML counts {}, want 1",
        probe.one("nvmlDeviceGetCount")?
    );
    ensure!(
        probe.one("pynvml_count")? == "1",
        "{what}: nvidia-ml-py counts {}, want 1",
        probe.one("pynvml_count")?
    );
    Ok(())
}

/// The NVIDIA device nodes in the container: exactly `want` (path -> major:minor).
fn check_devices(probe: &Probe, what: &str, want: &BTreeMap<String, String>) -> Result<()> {
    let got = probe.devices();
    ensure!(
        &got == want,
        "{what}: device nodes {got:?}, want exactly {want:?}"
    );
    ensure!(
        probe.all("not_a_device").is_empty(),
        "{what}: NVIDIA paths that are not character devices: {:?}",
        probe.all("not_a_device")
    );
    Ok(())
}

/// The control nodes every GPU container gets (char 195:255, 195:254, 510:0, 510:1).
fn control_nodes() -> BTreeMap<String, String> {
    [
        ("/dev/nvidiactl", "195:255"),
        ("/dev/nvidia-modeset", "195:254"),
        ("/dev/nvidia-uvm", "510:0"),
        ("/dev/nvidia-uvm-tools", "510:1"),
    ]
    .into_iter()
    .map(|(p, n)| (p.to_owned(), n.to_owned()))
    .collect()
}

/// The MIG capability nodes' minors for GPU `gpu`'s GPU instance `gi` and compute instance `ci`,
/// from the driver root's `mig-minors`.
fn mig_cap_minors(driver_root: &Path, gpu: u32, gi: u32, ci: u32) -> Result<BTreeSet<String>> {
    let table = fs::read_to_string(driver_root.join("proc/driver/nvidia-caps/mig-minors"))?;
    let want = [
        format!("gpu{gpu}/gi{gi}/access"),
        format!("gpu{gpu}/gi{gi}/ci{ci}/access"),
    ];
    let minors: BTreeSet<String> = table
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| want.contains(&k.to_string()))
        .map(|(_, m)| m.trim().to_owned())
        .collect();
    ensure!(minors.len() == 2, "mig-minors lacks {want:?}");
    Ok(minors)
}

/// Installs the chart (CRDs already there, no images needed: its workloads land on kwok nodes),
/// runs `helm test` with the test pod on `node`, checks what it printed, and uninstalls.
async fn helm_test(
    cluster: &Cluster,
    client: &Client,
    kubelet: &RealKubelet,
    scope: &TestScope,
    node: &str,
    fake_dir: &Path,
    uuid: &str,
) -> Result<()> {
    let tools = cluster.tools();
    let release = scope.name("rel");
    let chart = repo_root().join("charts/gpupool");
    let kubeconfig = cluster.kubeconfig().display().to_string();
    let helm = |args: &[&str]| -> Result<String> {
        let out = std::process::Command::new(tools.helm())
            .args(args)
            .args(["-n", scope.namespace(), "--kubeconfig", &kubeconfig])
            .output()
            .context("running helm")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(
            out.status.success(),
            "helm {args:?}: {}\n{text}",
            out.status
        );
        Ok(text)
    };
    let sets = [
        ("tests.image.repository", json!("gpupool.local/e2e/probe")),
        ("tests.image.tag", json!("1")),
        ("tests.image.pullPolicy", json!("Never")),
        (
            "tests.nodeSelector",
            json!({"kubernetes.io/hostname": node}),
        ),
        (
            "tests.tolerations",
            json!([{"key": "e2e.gpupool.io/real-kubelet", "operator": "Exists", "effect": "NoSchedule"}]),
        ),
        (
            "tests.env",
            json!([
                {"name": "GPUPOOL_FAKE_NVML_FIXTURE", "value": format!("{FAKE_DIR}/fixture.yaml")},
                {"name": "GPUPOOL_FAKE_NVML_STATE", "value": format!("{FAKE_DIR}/nvml-state.json")},
            ]),
        ),
        (
            "tests.volumes",
            json!([{"name": "fake", "hostPath": {"path": fake_dir, "type": "Directory"}}]),
        ),
        (
            "tests.volumeMounts",
            json!([{"name": "fake", "mountPath": FAKE_DIR}]),
        ),
        ("crds.install", json!(false)),
    ];
    let sets: Vec<String> = sets.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let chart_arg = chart.display().to_string();
    let mut args = vec!["install", &release, &chart_arg];
    for set in &sets {
        args.extend(["--set-json", set]);
    }
    helm(&args)?;
    // `--logs` would fetch them through the kubelet's server, by a node name this test bed
    // cannot resolve; the container's log is read from the runtime instead.
    let tested = helm(&["test", &release, "--timeout", "3m"]);
    let pod_name = format!("{release}-gpupool-test-gpu");
    let log = match Api::<Pod>::namespaced(client.clone(), scope.namespace())
        .get(&pod_name)
        .await
    {
        Ok(pod) => kubelet.container_log(&pod, "gpu")?,
        Err(e) => format!("(test pod {pod_name}: {e})"),
    };
    let uninstalled = helm(&["uninstall", &release, "--wait", "--timeout", "3m"]);
    eprintln!("e2e: helm test's pod printed:\n{log}");
    let out = tested.with_context(|| format!("the test pod printed:\n{log}"))?;
    ensure!(out.contains("Succeeded"), "helm test did not pass:\n{out}");
    ensure!(
        log.contains("ok: nvidia.com/gpu gave 1 device node(s), NVML lists 1 GPU(s)"),
        "unexpected test output:\n{log}"
    );
    ensure!(
        log.contains(&format!("(UUID: {uuid})")),
        "the test pod's NVML did not list the allocated GPU {uuid}:\n{log}"
    );
    uninstalled?;
    Ok(())
}

#[tokio::test]
async fn gpu_pods_start_on_containerd_with_our_cdi_spec() -> Result<()> {
    if let Some(why) = skip_reason(Runtime::Containerd) {
        eprintln!("e2e: SKIPPED gpu_pods_start_on_containerd_with_our_cdi_spec: {why}");
        return Ok(());
    }
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "node")?;
    let kubelet = RealKubelet::up(cluster, Runtime::Containerd)?;
    let node = kubelet.node.clone();
    // GPU 0 split into three 1g.10gb slices, GPU 1 whole.
    let mig = NodeMigSpec {
        strategy: MigStrategy::Mixed,
        managed: true,
        layout_name: Some("gpu0-1g".into()),
        gpus: vec![GpuMigSpec {
            index: 0,
            enabled: true,
            profiles: BTreeMap::from([("1g.10gb".to_owned(), 3)]),
        }],
    };
    let mut host = GpuNodeHost::start(cluster, &scope, &kubelet, 2, mig, |s| {
        s.mig.state == MigState::Applied && s.gpus.first().is_some_and(|g| g.mig_devices.len() == 3)
    })
    .await?;
    let (agent, dir, driver) = (&host.agent, &host.dir, &host.driver_root);

    // 1. Capacity.
    wait_node_resources(
        &client,
        &node,
        "1 GPU and 3 × 1g.10gb in allocatable",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1)), (MIG_1G, Some(3), Some(3))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let gpu1_uuid = host
        .status
        .gpus
        .get(1)
        .map(|g| g.uuid.clone())
        .context("no GPU 1 in status")?;

    let mut whole = control_nodes();
    whole.insert("/dev/nvidia1".into(), "195:1".into());

    // 2. A whole GPU on a plain Debian image.
    let name = scope.name("whole");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    check_devices(&probe, &name, &whole)?;
    check_driver_loads(&probe, &name)?;
    ensure!(
        probe.one("ld_library_path")?.is_empty(),
        "{name}: LD_LIBRARY_PATH was set to {:?}; the image sets none and the spec must not",
        probe.one("ld_library_path")?
    );
    ensure!(
        probe.all("pynvml_uuid") == [gpu1_uuid.clone()],
        "{name}: nvidia-ml-py sees {:?}, want [{gpu1_uuid}]",
        probe.all("pynvml_uuid")
    );
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 3. The same, read-only root file system and a non-root user.
    let name = scope.name("restricted");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        true,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    ensure!(probe.one("uid")? == "1000", "{name}: not running as 1000");
    check_devices(&probe, &name, &whole)?;
    check_driver_loads(&probe, &name)?;
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 4. An image with NVIDIA's CUDA-image LD_LIBRARY_PATH: kept as the image set it, and the
    // loader takes the driver from /usr/local/nvidia/lib64.
    let name = scope.name("cuda-env");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_CUDA_ENV_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    check_driver_loads(&probe, &name)?;
    ensure!(
        probe.one("ld_library_path")? == "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
        "{name}: the image's LD_LIBRARY_PATH became {:?}",
        probe.one("ld_library_path")?
    );
    for lib in ["libcuda", "libnvml"] {
        let path = probe.one(&format!("{lib}_path"))?;
        ensure!(
            path.starts_with("/usr/local/nvidia/lib64/"),
            "{name}: {lib} loaded from {path}, want /usr/local/nvidia/lib64 (first in LD_LIBRARY_PATH)"
        );
    }
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 5. A MIG slice: the parent's node and the slice's capability nodes only.
    let name = scope.name("mig");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(MIG_1G),
        dir,
        false,
    )?;
    create_pod(&client, &scope, &pod).await?;
    let done = wait_pod(
        &client,
        &scope,
        &name,
        "the MIG pod to finish",
        Duration::from_secs(120),
        |p| matches!(phase(p), "Succeeded" | "Failed"),
    )
    .await?;
    let log = kubelet.container_log(&done, "probe")?;
    eprintln!("e2e: {name} {}; it printed:\n{log}", phase(&done));
    ensure!(phase(&done) == "Succeeded", "{name} failed");
    let probe = Probe::parse(&log);
    // The slice's capability nodes: one GPU instance's and one of its compute instances'
    // (mig-minors), of GPU 0.
    let caps: Vec<(String, String)> = probe
        .devices()
        .into_iter()
        .filter(|(p, _)| p.starts_with("/dev/nvidia-caps/"))
        .collect();
    ensure!(
        caps.len() == 2,
        "{name}: want the slice's two capability nodes (GPU instance and compute instance), got {caps:?}"
    );
    let mut slices = Vec::new();
    for gi in 0..15 {
        slices.push(mig_cap_minors(driver, 0, gi, 0)?);
    }
    let got: BTreeSet<String> = caps
        .iter()
        .filter_map(|(_, n)| n.split_once(':').map(|(_, m)| m.to_owned()))
        .collect();
    ensure!(
        slices.contains(&got),
        "{name}: capability minors {got:?} are no slice of GPU 0"
    );
    let mut mig = control_nodes();
    mig.insert("/dev/nvidia0".into(), "195:0".into());
    for (p, n) in &caps {
        mig.insert(p.clone(), n.clone());
    }
    check_devices(&probe, &name, &mig)?;
    check_driver_loads(&probe, &name)?;
    ensure!(
        probe.all("pynvml_mig_mode") == ["1"],
        "{name}: nvidia-ml-py sees MIG mode {:?} on the parent, want [1]",
        probe.all("pynvml_mig_mode")
    );
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 6. The spec deleted under the running agent: reported, rewritten, and pods start again.
    fs::remove_file(&agent.cdi_spec)
        .with_context(|| format!("removing {}", agent.cdi_spec.display()))?;
    let removed = Instant::now();
    poll(
        "the agent to write the CDI spec again",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { Ok(agent.cdi_spec.exists().then_some(())) },
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!(
        "e2e: the agent rewrote the deleted CDI spec after {:.1}s",
        removed.elapsed().as_secs_f64()
    );
    // Reported, not only healed: a Warning Event saying the spec went missing, then the
    // Normal one when it is back, and the condition True again.
    let missing = wait_event(&client, &node, "CdiSpecMissing")
        .await
        .with_context(|| agent.log_text())?;
    ensure!(
        missing.type_.as_deref() == Some("Warning"),
        "CdiSpecMissing is a {:?} Event",
        missing.type_
    );
    wait_event(&client, &node, "CdiSpecRestored").await?;
    wait_status(
        &client,
        &node,
        "CdiSpecReady=True after the rewrite",
        Duration::from_secs(30),
        |s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "CdiSpecReady" && c.status == "True")
        },
    )
    .await?;
    let name = scope.name("after-delete");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod).await?;
    check_driver_loads(&probe, &name)?;
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 7. The agent as the chart runs it: a container with a root file system of its own, the
    // host's `/` read-only at /host and nothing mounted over its /usr or /lib, NVML loaded by
    // full path from the driver root (whose /lib holds no loader at all). It writes the very
    // spec the host process wrote, naming host paths, and a GPU pod starts through it.
    let dir = dir.clone();
    let spec_path = host.agent.cdi_spec.clone();
    let spec_before = fs::read_to_string(&spec_path)?;
    host.agent.stop();
    fs::remove_file(&spec_path)?;
    ensure!(
        !host.driver_root.join("lib64/ld-linux-x86-64.so.2").exists()
            && !host.driver_root.join("lib/ld-2.31.so").exists(),
        "the driver root has a loader of its own"
    );
    host.agent_in_container(cluster, &kubelet)?;
    let agent = &host.agent;
    poll(
        "the agent's container to write the CDI spec",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async { Ok(spec_path.exists().then_some(())) },
    )
    .await
    .with_context(|| agent.log_text())?;
    let spec_after = fs::read_to_string(&spec_path)?;
    ensure!(
        spec_after == spec_before,
        "the containerized agent wrote another spec:\n--- host process\n{spec_before}\n--- container\n{spec_after}"
    );
    let log = agent.log_text();
    let nvml = format!(
        "/host{}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15",
        host.driver_root.display()
    );
    ensure!(
        log.contains("NVML found") && log.contains(&nvml),
        "the agent did not load NVML from the driver root by full path ({nvml}):\n{log}"
    );
    wait_node_resources(
        &client,
        &node,
        "1 GPU and 3 × 1g.10gb in allocatable from the containerized agent",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1)), (MIG_1G, Some(3), Some(3))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let name = scope.name("agent-container");
    let pod = probe_pod(
        &scope,
        &name,
        &node,
        PROBE_IMAGE,
        &PROBE_COMMAND,
        Some(GPU),
        &dir,
        false,
    )?;
    let (probe, _) = run_probe(&client, &scope, &kubelet, &pod)
        .await
        .with_context(|| agent.log_text())?;
    check_devices(&probe, &name, &whole)?;
    check_driver_loads(&probe, &name)?;
    delete_pod_and_wait(&client, &scope, &name).await?;

    // 8. `helm test`: the chart installed with its own templates, and its test pod (placed on
    // this node, with the probe image and the fake NVML's files) checks inside its container
    // that the GPU was injected and that NVML, through the spec's nvidia-smi and
    // libnvidia-ml.so.1, lists exactly that GPU.
    helm_test(cluster, &client, &kubelet, &scope, &node, &dir, &gpu1_uuid)
        .await
        .with_context(|| host.agent.log_text())?;

    drop(host);
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}
