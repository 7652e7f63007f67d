//! Pod start on the real node: how long from creating a pod to its container running, for a GPU
//! pod (our plugin's Allocate, containerd resolving and applying our CDI spec, runc making the
//! device nodes and driver mounts) and for a CPU-only pod of the same image, and how much of the
//! difference is the CDI injection itself.
//!
//! ```text
//! GPUPOOL_E2E_KUBELET=1 cargo bench -p gpupool-e2e --bench pod_start     # root; builds what it needs
//! GPUPOOL_BENCH_ROUNDS=10 …                                                # rounds per kind (default 5)
//! ```
//!
//! Figures:
//! - **pod**: create → the kubelet reports the container running (the API's view, polled every
//!   20 ms), for each kind, alternating CPU and GPU pods;
//! - **CDI**: `ctr run` of the same image straight on containerd, with and without the GPU's
//!   fully qualified CDI name (`--device gpupool.io/gpu=<uuid>`: ctr resolves it against the
//!   agent's spec and runc applies it), `true` as the command; the difference is the cost of the
//!   CDI edits alone, which the report sets against the GPU pod's start time.
//!
//! The same setup as `tests/node.rs` (`gpupool_e2e::node`); skips with the reason when the real
//! node cannot run here.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpupool_crds::node::NodeMigSpec;
use gpupool_e2e::kubelet::{
    RealKubelet, Runtime, create_pod, delete_pod_and_wait, skip_reason, wait_node_resources,
};
use gpupool_e2e::node::{GpuNodeHost, PROBE_IMAGE, probe_pod};
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, crds};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;

const GPU: &str = "nvidia.com/gpu";
const SLEEP: [&str; 2] = ["sleep", "3600"];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn summary(name: &str, v: &mut [f64]) -> f64 {
    let m = median(v);
    let min = v.first().copied().unwrap_or(f64::NAN);
    let max = v.last().copied().unwrap_or(f64::NAN);
    println!(
        "{name:<44} median {:>7.0} ms   min {:>7.0} ms   max {:>7.0} ms   (n={})",
        m * 1e3,
        min * 1e3,
        max * 1e3,
        v.len()
    );
    m
}

fn running(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|c| {
            c.iter()
                .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        })
}

/// Seconds from creating `pod` to its container running.
async fn time_pod(client: &kube::Client, scope: &TestScope, pod: &Pod) -> Result<f64> {
    let name = pod.metadata.name.clone().context("pod without name")?;
    let api: Api<Pod> = Api::namespaced(client.clone(), scope.namespace());
    let start = Instant::now();
    create_pod(client, scope, pod).await?;
    poll(
        &format!("{name} running"),
        Duration::from_secs(120),
        Duration::from_millis(20),
        || {
            let api = api.clone();
            let name = name.clone();
            async move { Ok(running(&api.get(&name).await?).then_some(())) }
        },
    )
    .await?;
    let took = start.elapsed().as_secs_f64();
    delete_pod_and_wait(client, scope, &name).await?;
    Ok(took)
}

/// Seconds for `ctr run --rm` of the probe image running `true`, with `device` if given. ctr
/// resolves CDI names against /etc/cdi and /var/run/cdi only, so it runs in a mount namespace
/// where /run is a fresh tmpfs and /run/cdi the agent's spec directory.
fn time_ctr(
    ctr: &Path,
    socket: &str,
    cdi_dir: &Path,
    id: &str,
    device: Option<&str>,
) -> Result<f64> {
    let fifo_dir = Path::new(socket)
        .parent()
        .context("socket path without parent")?
        .join("fifo");
    let mut script = String::from(
        "set -e; mount -t tmpfs none /run; mkdir -p /run/cdi; mount --bind \"$1\" /run/cdi; shift; exec \"$@\"",
    );
    script.push('\n');
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(&script)
        .arg("ctr-cdi")
        .arg(cdi_dir)
        .arg(ctr)
        .args([
            "--address",
            socket,
            "-n",
            "k8s.io",
            "run",
            "--rm",
            "--fifo-dir",
        ])
        // Beside the socket: the shim, in containerd's namespace, must see the fifos.
        .arg(fifo_dir);
    if let Some(d) = device {
        cmd.args(["--device", d]);
    }
    cmd.args([PROBE_IMAGE, id, "true"]);
    let start = Instant::now();
    let out = cmd.output().context("running ctr")?;
    let took = start.elapsed().as_secs_f64();
    ensure!(
        out.status.success(),
        "ctr run {id} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(took)
}

#[tokio::main]
async fn main() -> Result<()> {
    if let Some(why) = skip_reason(Runtime::Containerd) {
        println!("pod_start: SKIPPED: {why}");
        return Ok(());
    }
    let rounds: usize = std::env::var("GPUPOOL_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "podstart")?;
    let kubelet = RealKubelet::up(cluster, Runtime::Containerd)?;
    let node = kubelet.node.clone();
    let host = GpuNodeHost::start(cluster, &scope, &kubelet, 1, NodeMigSpec::default(), |s| {
        s.gpus.len() == 1
    })
    .await?;
    wait_node_resources(
        &client,
        &node,
        "1 GPU in allocatable",
        Duration::from_secs(60),
        &[(GPU, Some(1), Some(1))],
    )
    .await?;
    let uuid = host.status.gpus[0].uuid.clone();

    // One of each first, untimed: the first container of an image pays for its snapshot.
    for (i, resource) in [None, Some(GPU)].into_iter().enumerate() {
        let pod = probe_pod(
            &scope,
            &scope.name(&format!("warm-{i}")),
            &node,
            PROBE_IMAGE,
            &SLEEP,
            resource,
            &host.dir,
            false,
        )?;
        time_pod(&client, &scope, &pod).await?;
    }
    let (mut cpu, mut gpu) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let pod = probe_pod(
            &scope,
            &scope.name(&format!("cpu-{round}")),
            &node,
            PROBE_IMAGE,
            &SLEEP,
            None,
            &host.dir,
            false,
        )?;
        cpu.push(time_pod(&client, &scope, &pod).await?);
        let pod = probe_pod(
            &scope,
            &scope.name(&format!("gpu-{round}")),
            &node,
            PROBE_IMAGE,
            &SLEEP,
            Some(GPU),
            &host.dir,
            false,
        )?;
        gpu.push(time_pod(&client, &scope, &pod).await?);
    }

    let ctr = kubelet.ctr.clone().context("e2e/kubelet env gave no ctr")?;
    let socket = kubelet.cri_socket.to_string_lossy().into_owned();
    let device = format!("gpupool.io/gpu={uuid}");
    let (mut plain, mut with_cdi) = (Vec::new(), Vec::new());
    time_ctr(&ctr, &socket, &kubelet.cdi_dir, "bench-warm", Some(&device))?;
    for round in 0..rounds {
        plain.push(time_ctr(
            &ctr,
            &socket,
            &kubelet.cdi_dir,
            &format!("bench-plain-{round}"),
            None,
        )?);
        with_cdi.push(time_ctr(
            &ctr,
            &socket,
            &kubelet.cdi_dir,
            &format!("bench-cdi-{round}"),
            Some(&device),
        )?);
    }

    println!("\npod start on the real node (containerd + runc, {rounds} rounds; one GPU, whole)");
    let c = summary("CPU pod: create → running", &mut cpu);
    let g = summary("GPU pod (nvidia.com/gpu: 1): create → running", &mut gpu);
    println!(
        "{:<44} {:>+7.0} ms",
        "GPU pod − CPU pod (medians)",
        (g - c) * 1e3
    );
    let p = summary("ctr run, no device", &mut plain);
    let d = summary("ctr run, CDI device", &mut with_cdi);
    println!(
        "{:<44} {:>+7.0} ms = {:.1} % of the GPU pod's start",
        "CDI injection (ctr with − without, medians)",
        (d - p) * 1e3,
        (d - p) / g * 100.0
    );
    drop(host);
    Ok(())
}
