//! The device plugin against a real kubelet: `e2e/kubelet` starts one (node `real-node-0`) on an
//! in-memory container runtime (`e2e/tools/fakecri`, which records every CRI `CreateContainer`),
//! beside the kwok nodes; our node agent runs unchanged against the kubelet's device-plugin
//! directory with the NVML backend on the fake `libnvidia-ml.so` and a MIG layout.
//!
//! One scenario, in order, because there is one kubelet per machine (its device-plugin directory
//! is compiled in):
//! - Node capacity and allocatable show `nvidia.com/gpu` and `nvidia.com/mig-1g.10gb` with the
//!   counts the layout gives;
//! - a pod asking for `nvidia.com/mig-1g.10gb: 1` is scheduled, admitted and "runs"; the recorded
//!   `CreateContainer` carries exactly the CDI device name of the device the agent reports the
//!   pod on (PodResources → GpuNode status `pods`); a pod asking for more than is free stays
//!   Pending;
//! - an uncorrectable ECC error injected through the fake NVML's state file makes the whole GPU
//!   Unhealthy and `nvidia.com/gpu` allocatable drops by one; a GPU reset brings it back after
//!   the agent's hold-down;
//! - restarting the kubelet (which wipes the plugin sockets): the plugin re-registers, capacity
//!   returns and a new pod is admitted; the gaps are printed;
//! - a MIG layout change takes the old `nvidia.com/mig-*` resource's count to 0 in capacity and
//!   allocatable (the kubelet keeps a device-plugin resource's name at 0 once it has seen it), and
//!   no stale count comes back when the kubelet restarts;
//! - time-slicing GPU 1 four ways: capacity 4, four pods admitted on its CDI device and
//!   reported on it as shared (isolation None), a fifth Pending, a request for two replicas
//!   refused at admission with the reason;
//! - MPS on GPU 1: the agent runs its (fake) control daemon and sends it exactly the limit
//!   commands; two clients admitted, each container given the server's pipe directory, shared
//!   memory and limits; a killed daemon takes the replicas out of allocatable until its restart.
//!
//! Opt-in: runs when `GPUPOOL_E2E_KUBELET=1`; otherwise (or when `e2e/kubelet check` says this
//! machine cannot run a kubelet) it prints why and passes without doing anything.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, ensure};
use gpupool_crds::node::{GpuMigSpec, GpuNodeStatus, MigState, NodeMigSpec, UtilizationSpec};
use gpupool_crds::policy::{DriverPolicy, MigStrategy};
use gpupool_crds::{GpuNode, GpuNodeSpec};
use gpupool_e2e::agent::{fake_driver_root, wait_status};
use gpupool_e2e::kubelet::{
    Agent, AgentSetup, RealKubelet, Runtime, create_pod, delete_pod_and_wait, node_resource, phase,
    skip_reason, wait_node_resources, wait_pod,
};
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, crds, repo_root};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const DRIVER: &str = "550.54.15";
const GPU: &str = "nvidia.com/gpu";
const MIG_1G: &str = "nvidia.com/mig-1g.10gb";
const MIG_3G: &str = "nvidia.com/mig-3g.40gb";

fn gpu_pod(scope: &TestScope, name: &str, node: &str, resource: &str, count: u32) -> Result<Pod> {
    let (k, v) = scope.label();
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": scope.namespace(), "labels": {k: v}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"key": "e2e.gpupool.io/real-kubelet", "operator": "Exists", "effect": "NoSchedule"}],
            // No token volume: nothing to mount for a pod that never runs.
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "cuda",
                "image": "registry.invalid/gpupool/cuda-e2e:1",
                "resources": {"limits": {resource: count.to_string()}},
            }],
        },
    }))?)
}

/// The MIG device (or whole GPU) the agent reports `pod` on: (kubelet device ID, CDI name).
fn device_of_pod(status: &GpuNodeStatus, namespace: &str, pod: &str) -> Option<(String, String)> {
    let holds = |pods: &[gpupool_crds::node::PodRef]| {
        pods.iter()
            .any(|p| *p.namespace == *namespace && p.name == pod)
    };
    status.gpus.iter().find_map(|g| {
        g.mig_devices
            .iter()
            .find(|m| holds(&m.idleness.pods))
            .map(|m| (m.uuid.clone(), m.cdi_name.clone()))
    })
}

/// The recorded CreateContainer's CDI device names, its CDI annotation values and its
/// `NVIDIA_VISIBLE_DEVICES`.
fn recorded_devices(record: &Value) -> (Vec<String>, Vec<String>, Option<String>) {
    let config = &record["config"];
    let cdi = record["cdiDevices"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| d.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let annotations = config["annotations"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.starts_with("cdi.k8s.io/"))
                .filter_map(|(_, v)| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let visible = record["env"]["NVIDIA_VISIBLE_DEVICES"]
        .as_str()
        .map(str::to_owned);
    (cdi, annotations, visible)
}

/// Checks that `pod` was admitted on the device the agent reports it on, and that the container
/// the kubelet asked the runtime for carries exactly that device's CDI name.
async fn check_admitted(
    client: &Client,
    scope: &TestScope,
    kubelet: &RealKubelet,
    agent: &Agent,
    pod: &str,
) -> Result<String> {
    wait_pod(
        client,
        scope,
        pod,
        &format!("{pod} Running"),
        Duration::from_secs(60),
        |p| phase(p) == "Running",
    )
    .await
    .with_context(|| format!("kubelet log: {}", kubelet.log.display()))?;
    let gn = wait_status(
        client,
        &kubelet.node,
        &format!("the agent to report {pod} on a device (PodResources)"),
        Duration::from_secs(60),
        |s| device_of_pod(s, scope.namespace(), pod).is_some(),
    )
    .await
    .with_context(|| agent.log_text())?;
    let status = gn.status.unwrap_or_default();
    let (uuid, status_cdi_name) =
        device_of_pod(&status, scope.namespace(), pod).context("device vanished")?;
    // With the default CDI name strategies (index and UUID) the plugin hands out UUID names.
    let want = format!("gpupool.io/gpu={uuid}");
    let creates = kubelet.creates_of(scope.namespace(), pod)?;
    ensure!(
        creates.len() == 1,
        "{pod}: {} CreateContainer records: {creates:?}",
        creates.len()
    );
    let (cdi, annotations, visible) = recorded_devices(&creates[0]);
    ensure!(
        cdi == [want.clone()],
        "{pod}: CreateContainer CDI devices {cdi:?}; the pod holds {uuid}, so want [{want}]"
    );
    ensure!(
        annotations == [want.clone()],
        "{pod}: CDI annotation {annotations:?}, want {want}"
    );
    ensure!(
        visible.as_deref() == Some(uuid.as_str()),
        "{pod}: NVIDIA_VISIBLE_DEVICES {visible:?}, want {uuid}"
    );
    // The runtime could resolve it: the agent's CDI spec defines that device.
    let spec: serde_yaml::Value = serde_yaml::from_str(&fs::read_to_string(&agent.cdi_spec)?)?;
    let defined = spec["devices"]
        .as_sequence()
        .is_some_and(|d| d.iter().any(|d| d["name"].as_str() == Some(uuid.as_str())));
    ensure!(
        defined,
        "{want} is not defined in {}",
        agent.cdi_spec.display()
    );
    ensure!(
        status_cdi_name == want,
        "GpuNode status gives this MIG device cdiName {status_cdi_name}, while Allocate handed out {want}"
    );
    eprintln!("e2e: {pod} admitted on {uuid}; CreateContainer carried CDI device {want}");
    Ok(want)
}

/// The time a file was last changed (a socket's creation time).
fn ctime(path: &Path) -> Option<SystemTime> {
    let m = fs::metadata(path).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(
        u64::try_from(m.ctime()).ok()?,
        u32::try_from(m.ctime_nsec()).ok()?,
    ))
}

fn since(later: SystemTime, earlier: SystemTime) -> String {
    match later.duration_since(earlier) {
        Ok(d) => format!("{:.3}s", d.as_secs_f64()),
        Err(e) => format!("-{:.3}s", e.duration().as_secs_f64()),
    }
}

/// Creates a pod asking for one `nvidia.com/gpu` per name on the kubelet's node, waits for each
/// to run, and checks the one CreateContainer recorded for it carries exactly the CDI device and
/// UUID of GPU `uuid`; returns those records, in `names` order.
async fn admit_on_gpu(
    client: &Client,
    scope: &TestScope,
    kubelet: &RealKubelet,
    names: &[String],
    uuid: &str,
) -> Result<Vec<Value>> {
    let node = &kubelet.node;
    let want = format!("gpupool.io/gpu={uuid}");
    for name in names {
        create_pod(client, scope, &gpu_pod(scope, name, node, GPU, 1)?).await?;
    }
    let mut records = Vec::with_capacity(names.len());
    for name in names {
        wait_pod(
            client,
            scope,
            name,
            &format!("{name} Running"),
            Duration::from_secs(60),
            |p| phase(p) == "Running",
        )
        .await?;
        let mut creates = kubelet.creates_of(scope.namespace(), name)?;
        ensure!(creates.len() == 1, "{name}: {creates:?}");
        let record = creates.remove(0);
        let (cdi, _, visible) = recorded_devices(&record);
        ensure!(
            cdi == [want.clone()] && visible.as_deref() == Some(uuid),
            "{name}: CDI devices {cdi:?}, NVIDIA_VISIBLE_DEVICES {visible:?}; want {want} and {uuid}"
        );
        records.push(record);
    }
    Ok(records)
}

/// Step 8: GPU 1 time-sliced four ways. Capacity becomes 4; four pods are admitted, each
/// container given GPU 1's CDI device and UUID; the agent reports all four on GPU 1, shared with
/// isolation `None`; a fifth pod stays Pending; a pod asking for two replicas is refused by the
/// plugin's Allocate with the reason (failRequestsGreaterThanOne).
async fn time_slicing(
    client: &Client,
    scope: &TestScope,
    kubelet: &RealKubelet,
    agent: &Agent,
    gpunodes: &Api<GpuNode>,
    driver_root: &Path,
) -> Result<()> {
    let node = &kubelet.node;
    let patch = json!({"spec": {"sharing": {"timeSlicing": {
        "replicas": 4, "gpus": [1], "resources": [GPU],
    }}}});
    gpunodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_node_resources(
        client,
        node,
        "GPU 1 as four replicas",
        Duration::from_secs(60),
        &[(GPU, Some(4), Some(4))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let gn = gpunodes.get(node).await?;
    let uuid = gn
        .status
        .as_ref()
        .and_then(|s| s.gpus.get(1))
        .map(|g| g.uuid.clone())
        .context("no GPU 1 in status")?;
    let want = format!("gpupool.io/gpu={uuid}");
    let names: Vec<String> = (0..4).map(|i| scope.name(&format!("shared-{i}"))).collect();
    admit_on_gpu(client, scope, kubelet, &names, &uuid).await?;
    let status = wait_status(
        client,
        node,
        "the four pods reported on GPU 1, shared",
        Duration::from_secs(60),
        |s| {
            s.gpus.get(1).is_some_and(|g| {
                g.sharing.is_some()
                    && names
                        .iter()
                        .all(|n| g.idleness.pods.iter().any(|p| &p.name == n))
            })
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    let sharing = status
        .status
        .and_then(|s| s.gpus.get(1).and_then(|g| g.sharing.clone()));
    ensure!(
        sharing
            .as_ref()
            .is_some_and(|s| s.mode == "TimeSlicing" && s.replicas == 4 && s.isolation == "None"),
        "GPU 1 sharing in status: {sharing:?}"
    );
    eprintln!("e2e: GPU 1 time-sliced: four pods admitted on {want}");
    per_share_idleness(client, kubelet, agent, scope, &names, driver_root).await?;

    // A fifth finds no replica free.
    let fifth = scope.name("shared-4");
    create_pod(client, scope, &gpu_pod(scope, &fifth, node, GPU, 1)?).await?;
    wait_pod(
        client,
        scope,
        &fifth,
        "the fifth pod unschedulable",
        Duration::from_secs(60),
        |p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| {
                    c.iter().any(|c| {
                        c.type_ == "PodScheduled" && c.reason.as_deref() == Some("Unschedulable")
                    })
                })
        },
    )
    .await?;
    delete_pod_and_wait(client, scope, &fifth).await?;

    // Two replicas for one container: scheduled (two are free), refused at admission.
    for name in &names[..2] {
        delete_pod_and_wait(client, scope, name).await?;
    }
    let greedy = scope.name("two-replicas");
    create_pod(client, scope, &gpu_pod(scope, &greedy, node, GPU, 2)?).await?;
    let refused = wait_pod(
        client,
        scope,
        &greedy,
        "the two-replica pod refused",
        Duration::from_secs(60),
        |p| phase(p) == "Failed",
    )
    .await?;
    let message = refused
        .status
        .as_ref()
        .and_then(|s| s.message.clone())
        .unwrap_or_default();
    ensure!(
        message.contains("time-sliced") && message.contains("failRequestsGreaterThanOne"),
        "the refusal does not say why: {:?}",
        refused.status
    );
    eprintln!("e2e: a request for 2 replicas refused: {message}");
    for name in names[2..].iter().chain([&greedy]) {
        delete_pod_and_wait(client, scope, name).await?;
    }
    let patch = json!({"spec": {"sharing": null}});
    gpunodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Per-share idleness on time-sliced GPU 1: the first pod's container runs a busy process (80 %
/// SM), the second's an idle one; they are told apart by their pods' cgroups (in the fake
/// `/proc` the agent reads) and the real kubelet's device checkpoint, not by the share IDs in
/// their environment: the busy process claims its idle neighbour's share too, and that changes
/// nothing. GpuNode status reports the first share busy and the second and third idle while
/// the GPU as a whole is busy, which is what lets the reclaimer take one idle tenant and leave
/// its working neighbour.
async fn per_share_idleness(
    client: &Client,
    kubelet: &RealKubelet,
    agent: &Agent,
    scope: &TestScope,
    names: &[String],
    driver_root: &Path,
) -> Result<()> {
    let share_of = |name: &str| -> Result<String> {
        let creates = kubelet.creates_of(scope.namespace(), name)?;
        creates
            .first()
            .and_then(|c| c["env"]["GPUPOOL_SHARE_ID"].as_str())
            .map(str::to_owned)
            .with_context(|| format!("{name}: no GPUPOOL_SHARE_ID in {creates:?}"))
    };
    let (busy_share, idle_share) = (share_of(&names[0])?, share_of(&names[1])?);
    let pods: Api<Pod> = Api::namespaced(client.clone(), scope.namespace());
    for (pid, name, declared) in [
        (7001, &names[0], format!("{busy_share},{idle_share}")),
        (7002, &names[1], idle_share.clone()),
    ] {
        let uid = pods.get(name).await?.metadata.uid.unwrap_or_default();
        let dir = driver_root.join("proc").join(pid.to_string());
        fs::create_dir_all(&dir)?;
        fs::write(
            dir.join("cgroup"),
            format!("0::/kubepods/besteffort/pod{uid}/0123456789abcdef\n"),
        )?;
        fs::write(
            dir.join("environ"),
            format!("PATH=/bin\0GPUPOOL_SHARE_ID={declared}\0"),
        )?;
    }
    agent.update_nvml_state(|state| {
        state["processes"] = json!({"1": [
            {"pid": 7001, "sm_util": 80, "used_memory_mib": 2048},
            {"pid": 7002, "sm_util": 0, "used_memory_mib": 1024},
        ]});
        Ok(())
    })?;
    let activity_of = |g: &gpupool_crds::node::GpuStatus, name: &str| {
        g.shares
            .iter()
            .find(|s| s.pods.iter().any(|p| p.name == name))
            .map(|s| (s.activity, s.idle_since.is_some()))
    };
    use gpupool_crds::node::Activity;
    wait_status(
        client,
        &kubelet.node,
        "each tenant of GPU 1 judged on its own processes",
        Duration::from_secs(60),
        |s| {
            s.gpus.get(1).is_some_and(|g| {
                g.idleness.activity == Activity::Busy
                    && activity_of(g, &names[0]) == Some((Activity::Busy, false))
                    && activity_of(g, &names[1]) == Some((Activity::Idle, true))
                    && activity_of(g, &names[2]) == Some((Activity::Idle, true))
            })
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!(
        "e2e: GPU 1 busy; its tenants judged on their own processes: {} busy, {} and {} idle",
        names[0], names[1], names[2]
    );
    agent.update_nvml_state(|state| {
        state["processes"] = json!({});
        Ok(())
    })?;
    Ok(())
}

/// The PIDs of the MPS control daemons (`nvidia-cuda-mps-control -f`) run from `driver_root`.
fn mps_daemon_pids(driver_root: &Path) -> Vec<i32> {
    let program = driver_root.join("usr/bin/nvidia-cuda-mps-control");
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            args.iter()
                .any(|a| *a == program.as_os_str().as_encoded_bytes())
                && args.iter().any(|a| *a == b"-f")
        })
        .collect()
}

/// Step 9: GPU 1 under MPS, two clients of 4 GiB and 50 % of the threads each. The agent starts
/// the (fake) control daemon on GPU 1 and sends it exactly the two limit commands; capacity
/// becomes 2; both pods' containers get GPU 1's CDI device, its server's pipe directory and
/// shared memory, and the limits as environment; GPU 1 reports isolation `Memory (tenants trusted)`. Killing the
/// daemon takes both replicas out of allocatable until the agent's restart is up.
async fn mps(
    client: &Client,
    scope: &TestScope,
    kubelet: &RealKubelet,
    agent: &Agent,
    gpunodes: &Api<GpuNode>,
    driver_root: &Path,
) -> Result<()> {
    let node = &kubelet.node;
    let patch = json!({"spec": {"sharing": {"mps": {
        "replicas": 2, "gpus": [1], "memoryLimit": "4Gi", "activeThreadPercentage": 50,
    }}}});
    gpunodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let status = wait_status(
        client,
        node,
        "GPU 1 under MPS, its daemon running",
        Duration::from_secs(60),
        |s| {
            s.gpus.get(1).is_some_and(|g| {
                g.sharing
                    .as_ref()
                    .is_some_and(|s| s.mode == "MPS" && s.daemon.as_deref() == Some("Running"))
            })
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    let gpu = status
        .status
        .as_ref()
        .and_then(|s| s.gpus.get(1))
        .context("no GPU 1 in status")?;
    let sharing = gpu.sharing.clone().context("GPU 1 not shared")?;
    ensure!(
        sharing.isolation == "Memory (tenants trusted)"
            && sharing.replicas == 2
            && sharing.memory_limit_mib == Some(4096)
            && sharing.active_thread_percentage == Some(50),
        "GPU 1 sharing in status: {sharing:?}"
    );
    let uuid = gpu.uuid.clone();
    wait_node_resources(
        client,
        node,
        "GPU 1 as two MPS clients",
        Duration::from_secs(60),
        &[(GPU, Some(2), Some(2))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let gpu_dir = agent.mps_root.join(&uuid);
    let log = gpu_dir.join("log/control.log");
    // The control client returns once its input is in the pipe; the daemon writes it down
    // right after.
    let commands = poll(
        "the daemon's record of its limits",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let text = fs::read_to_string(&log).unwrap_or_default();
            Ok((text.lines().count() >= 3).then_some(text))
        },
    )
    .await?;
    ensure!(
        commands.lines().collect::<Vec<_>>()
            == [
                format!("start devices={uuid}").as_str(),
                "set_default_active_thread_percentage 50",
                "set_default_device_pinned_mem_limit 0 4096M",
            ],
        "the daemon was told: {commands:?}"
    );

    let names: Vec<String> = (0..2).map(|i| scope.name(&format!("mps-{i}"))).collect();
    let records = admit_on_gpu(client, scope, kubelet, &names, &uuid).await?;
    for (name, record) in names.iter().zip(&records) {
        let env = &record["env"];
        ensure!(
            env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpupool/mps-pipe"
                && env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
                && env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50",
            "{name}: env {env}"
        );
        let mounts: Vec<(String, String)> = record["config"]["mounts"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                (
                    m["hostPath"].as_str().unwrap_or_default().to_owned(),
                    m["containerPath"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        for (host, container) in [
            (gpu_dir.join("pipe"), "/run/gpupool/mps-pipe"),
            (gpu_dir.join("shm"), "/dev/shm"),
        ] {
            ensure!(
                mounts.contains(&(host.display().to_string(), container.to_owned())),
                "{name}: no {} at {container} in {mounts:?}",
                host.display()
            );
        }
    }
    eprintln!("e2e: GPU 1 under MPS: two clients admitted with its pipe, shm and limits");

    // The daemon dies: both replicas leave allocatable until its restart is up.
    let pids = mps_daemon_pids(driver_root);
    ensure!(pids.len() == 1, "MPS daemons running: {pids:?}");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()?;
    ensure!(killed.success(), "kill -KILL {}: {killed}", pids[0]);
    wait_node_resources(
        client,
        node,
        "GPU 1's replicas unhealthy while its daemon is down",
        Duration::from_secs(60),
        &[(GPU, Some(2), Some(0))],
    )
    .await
    .with_context(|| agent.log_text())?;
    wait_node_resources(
        client,
        node,
        "GPU 1's replicas back once the daemon is restarted",
        Duration::from_secs(90),
        &[(GPU, Some(2), Some(2))],
    )
    .await
    .with_context(|| agent.log_text())?;
    let starts = fs::read_to_string(&log)?
        .lines()
        .filter(|l| l.starts_with("start "))
        .count();
    ensure!(starts == 2, "the daemon was started {starts} times");
    eprintln!("e2e: a dead MPS daemon took GPU 1's replicas down until its restart");

    for name in &names {
        delete_pod_and_wait(client, scope, name).await?;
    }
    let patch = json!({"spec": {"sharing": null}});
    gpunodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    poll(
        "the MPS daemon told to quit",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let text = fs::read_to_string(&log).unwrap_or_default();
            let quit =
                text.lines().last() == Some("quit") && mps_daemon_pids(driver_root).is_empty();
            Ok(quit.then_some(()))
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn real_kubelet_admits_gpu_pods_through_the_plugin() -> Result<()> {
    if let Some(why) = skip_reason(Runtime::FakeCri) {
        eprintln!("e2e: SKIPPED real_kubelet_admits_gpu_pods_through_the_plugin: {why}");
        return Ok(());
    }
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "kubelet")?;
    let kubelet = RealKubelet::up(cluster, Runtime::FakeCri)?;
    let node = kubelet.node.clone();
    let dir = repo_root()
        .join("target/e2e-kubelet-agent")
        .join(scope.prefix());
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;

    // The GpuNode the operator would make: GPU 0 split into three 1g.10gb, GPU 1 whole.
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    if gpunodes.get_opt(&node).await?.is_some() {
        gpunodes.delete(&node, &DeleteParams::default()).await?;
        poll(
            "an old GpuNode to go",
            Duration::from_secs(30),
            Duration::from_millis(200),
            || {
                let api = gpunodes.clone();
                let node = node.clone();
                async move { Ok(api.get_opt(&node).await?.is_none().then_some(())) }
            },
        )
        .await?;
    }
    let layout = |profile: &str, count: u32| NodeMigSpec {
        strategy: MigStrategy::Mixed,
        managed: true,
        layout_name: Some(format!("gpu0-{profile}")),
        gpus: vec![GpuMigSpec {
            index: 0,
            enabled: true,
            profiles: BTreeMap::from([(profile.to_owned(), count)]),
        }],
    };
    let mut gn = GpuNode::new(
        &node,
        GpuNodeSpec {
            sharing: Default::default(),
            pool: scope.prefix().to_owned(),
            driver: DriverPolicy {
                min_version: Some("550".into()),
                cuda_version: Some("12.4".into()),
                ..DriverPolicy::default()
            }
            .into(),
            cdi: Default::default(),
            mig: layout("1g.10gb", 3).into(),
            utilization: UtilizationSpec {
                idle_threshold: 5,
                sample_interval: Duration::from_secs(1).into(),
            },
        },
    );
    let (k, v) = scope.label();
    gn.metadata.labels = Some(BTreeMap::from([(k.to_owned(), v.to_owned())]));
    scope.track_kind("gpunodes.gpupool.io");
    gpunodes.create(&PostParams::default(), &gn).await?;
    let driver_root = dir.join("driver");
    fake_driver_root(&driver_root, DRIVER, 2)?;
    let setup = AgentSetup {
        fixture: format!(
            "node: {node}\ndevice_nodes: ignored\ndriver: {{version: \"{DRIVER}\", cuda: \"12.4\"}}\ngpus:\n  - model: H100-SXM5-80GB\n    count: 2\n"
        ),
        driver_root: driver_root.clone(),
        cdi_dir: dir.join("cdi"),
        nvml_dev_dir: None,
    };
    let agent = Agent::start(&dir, &kubelet, cluster, &setup)?;

    // 1. Capacity and allocatable from the plugin's ListAndWatch.
    wait_status(
        &client,
        &node,
        "MIG Applied on GPU 0",
        Duration::from_secs(90),
        |s| {
            s.mig.state == MigState::Applied
                && s.gpus.first().is_some_and(|g| g.mig_devices.len() == 3)
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    wait_node_resources(
        &client,
        &node,
        "capacity and allocatable: 1 GPU, 3 × 1g.10gb",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1)), (MIG_1G, Some(3), Some(3))],
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!("e2e: node {node}: {GPU}=1, {MIG_1G}=3 in capacity and allocatable");

    // 2. A pod asking for one MIG device is admitted on it; the CDI name reaches the runtime.
    let pod_a = scope.name("a");
    create_pod(&client, &scope, &gpu_pod(&scope, &pod_a, &node, MIG_1G, 1)?).await?;
    let cdi_a = check_admitted(&client, &scope, &kubelet, &agent, &pod_a).await?;

    // 3. More than is free (3 asked, 2 free) stays Pending, unschedulable.
    let pod_b = scope.name("too-many");
    create_pod(&client, &scope, &gpu_pod(&scope, &pod_b, &node, MIG_1G, 3)?).await?;
    let b = wait_pod(
        &client,
        &scope,
        &pod_b,
        "the scheduler to refuse the pod",
        Duration::from_secs(60),
        |p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| {
                    c.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.status == "False"
                            && c.reason.as_deref() == Some("Unschedulable")
                    })
                })
        },
    )
    .await?;
    ensure!(phase(&b) == "Pending", "{:?}", b.status);
    ensure!(
        b.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none(),
        "bound anyway"
    );
    ensure!(
        kubelet.creates_of(scope.namespace(), &pod_b)?.is_empty(),
        "a container was created for the pending pod"
    );
    delete_pod_and_wait(&client, &scope, &pod_b).await?;

    // 4. An uncorrectable ECC error on GPU 1: Unhealthy, allocatable drops by one.
    agent.inject_fault(1, json!({"double_bit_ecc": 1}))?;
    wait_node_resources(
        &client,
        &node,
        "GPU 1 unhealthy: allocatable 0 of capacity 1",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(0)), (MIG_1G, Some(3), Some(3))],
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!("e2e: double-bit ECC on GPU 1: {GPU} allocatable 1 → 0, capacity stays 1");
    // A GPU reset clears it; the agent brings the GPU back after its hold-down (checked below).
    agent.reset_gpu(1)?;
    let reset_at = Instant::now();

    // 5. Kubelet restart: it wipes the plugin sockets; the plugin re-registers.
    let mig_socket = kubelet
        .device_plugin_dir
        .join("gpupool-nvidia.com-mig-1g.10gb.sock");
    let offset = kubelet.log_len();
    let restart_started = SystemTime::now();
    kubelet.restart()?;
    let registered = poll(
        "the plugin to re-register with the restarted kubelet",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || {
            let log = kubelet.log_since(offset);
            async move {
                let all = [GPU, MIG_1G].iter().all(|r| {
                    log.lines().any(|l| {
                        l.contains("Got registration request from device plugin")
                            && l.contains(&format!("resourceName=\"{r}\""))
                    })
                });
                Ok(all.then(SystemTime::now))
            }
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    // (Inode numbers get reused; the change time says the socket is new.)
    ensure!(
        ctime(&kubelet.kubelet_socket()).is_some_and(|t| t >= restart_started),
        "kubelet.sock was not recreated"
    );
    wait_node_resources(
        &client,
        &node,
        "capacity back after the kubelet restart",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(0)), (MIG_1G, Some(3), Some(3))],
    )
    .await?;
    let capacity_back = SystemTime::now();
    let kubelet_sock = ctime(&kubelet.kubelet_socket()).context("no kubelet.sock")?;
    let plugin_sock = ctime(&mig_socket).context("no mig plugin socket")?;
    eprintln!(
        "e2e: kubelet restart: kubelet.sock recreated {} after the restart began; our socket \
         recreated {} after kubelet.sock; registration seen (log poll, 50 ms) {} after kubelet.sock; \
         Node allocatable back (API poll, 100 ms) {} after kubelet.sock",
        since(kubelet_sock, restart_started),
        since(plugin_sock, kubelet_sock),
        since(registered, kubelet_sock),
        since(capacity_back, kubelet_sock),
    );
    // The pod admitted before the restart is still there, and a new one is admitted.
    let a = Api::<Pod>::namespaced(client.clone(), scope.namespace())
        .get(&pod_a)
        .await?;
    ensure!(
        phase(&a) == "Running",
        "{pod_a} after restart: {:?}",
        a.status
    );
    let pod_c = scope.name("after-restart");
    create_pod(&client, &scope, &gpu_pod(&scope, &pod_c, &node, MIG_1G, 1)?).await?;
    let cdi_c = check_admitted(&client, &scope, &kubelet, &agent, &pod_c).await?;
    ensure!(cdi_c != cdi_a, "two pods on one device: {cdi_a}");

    // 6. A MIG layout change: 1g.10gb goes away from the Node, 3g.40gb appears.
    delete_pod_and_wait(&client, &scope, &pod_a).await?;
    delete_pod_and_wait(&client, &scope, &pod_c).await?;
    let patch = json!({"spec": {"mig": layout("3g.40gb", 1)}});
    gpunodes
        .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_status(
        &client,
        &node,
        "the new layout Applied",
        Duration::from_secs(90),
        |s| {
            s.mig.state == MigState::Applied
                && s.gpus.first().is_some_and(|g| {
                    g.mig_devices.len() == 1 && &*g.mig_devices[0].profile == "3g.40gb"
                })
        },
    )
    .await
    .with_context(|| agent.log_text())?;
    wait_node_resources(
        &client,
        &node,
        "3g.40gb advertised, 1g.10gb down to nothing",
        Duration::from_secs(60),
        &[(MIG_3G, Some(1), Some(1)), (MIG_1G, Some(0), Some(0))],
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!("e2e: MIG re-layout: {MIG_3G}=1, {MIG_1G} capacity and allocatable 0");
    // The kubelet never deletes a device-plugin resource from Node capacity: 5 minutes after
    // its plugin stops it reports it as 0 ("had been registered before"). So 0 is what "gone"
    // looks like; it must stay 0 across a kubelet restart (no count from the checkpoint).
    kubelet.restart()?;
    poll(
        "after another kubelet restart: 3g.40gb back, 1g.10gb still 0 or absent",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let new = node_resource(&client, &node, MIG_3G).await?;
            let old = node_resource(&client, &node, MIG_1G).await?;
            ensure!(
                matches!(old, (None | Some(0), None | Some(0))),
                "stale {MIG_1G} count after the restart: {old:?}"
            );
            Ok((new == (Some(1), Some(1))).then_some(()))
        },
    )
    .await?;

    // 7. The GPU reset from step 4 brings GPU 1 back after a re-check (every 30 s) sees it clear
    // and the agent's hold-down (20 s here) has passed.
    wait_node_resources(
        &client,
        &node,
        "GPU 1 healthy again after the reset and the agent's hold-down",
        Duration::from_secs(180),
        &[(GPU, Some(1), Some(1))],
    )
    .await
    .with_context(|| agent.log_text())?;
    eprintln!(
        "e2e: GPU 1 back in allocatable {:.0}s after the reset",
        reset_at.elapsed().as_secs_f64()
    );

    // 8. GPU 1 time-sliced four ways.
    time_slicing(&client, &scope, &kubelet, &agent, &gpunodes, &driver_root).await?;
    // 9. GPU 1 under MPS.
    mps(&client, &scope, &kubelet, &agent, &gpunodes, &driver_root).await?;
    let _ = fs::remove_dir_all(&dir);
    drop(agent);
    Ok(())
}
