//! The device plugin against the kubelet stand-in, over real unix-socket gRPC.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpupool_device_plugin::plugin::api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Device,
    PreferredAllocationRequest,
};
use gpupool_device_plugin::plugin::api::{HEALTHY, UNHEALTHY};
use gpupool_device_plugin::plugin::testing::{KubeletEvent, KubeletStandin};
use gpupool_device_plugin::plugin::{
    Advertisement, CdiNaming, GpuDescription, HealthEvent, HealthEventKind, HealthMonitor,
    HealthPolicy, HealthTarget, LinkKind, ManualClock, MigDescription, MigStrategy, PluginConfig,
    PluginMetrics, Topology, resource_sets, run_plugins,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Generous bound for awaiting an event; only reached when something is broken.
const WAIT: Duration = Duration::from_secs(10);

fn gpu(index: u32, profiles: &[&str]) -> GpuDescription {
    GpuDescription {
        index,
        uuid: format!("GPU-{index:08}-0000-0000-0000-000000000000"),
        numa_node: Some(i64::from(index / 2)),
        mig_enabled: !profiles.is_empty(),
        mig_devices: profiles
            .iter()
            .enumerate()
            .map(|(j, p)| MigDescription {
                index: j as u32,
                uuid: format!("MIG-{index:08}-{j:04}-0000-0000-000000000000"),
                profile: (*p).to_owned(),
            })
            .collect(),
    }
}

fn uuid(index: u32) -> String {
    format!("GPU-{index:08}-0000-0000-0000-000000000000")
}

fn advertisement(
    gpus: &[GpuDescription],
    strategy: MigStrategy,
    topology: Topology,
) -> Advertisement {
    Advertisement {
        resources: resource_sets(gpus, strategy, CdiNaming::Index).expect("valid inventory"),
        topology: Arc::new(topology),
    }
}

fn test_config(dir: &Path) -> PluginConfig {
    PluginConfig {
        removal_timeout: Duration::from_secs(30),
        ..PluginConfig::with_plugin_dir(dir)
    }
}

struct Harness {
    dir: tempfile::TempDir,
    kubelet: KubeletStandin,
    advertise: watch::Sender<Advertisement>,
    cancel: CancellationToken,
    plugins: JoinHandle<Result<(), gpupool_device_plugin::plugin::PluginError>>,
    metrics: Arc<PluginMetrics>,
}

async fn start(adv: Advertisement) -> Harness {
    let dir = tempfile::tempdir().expect("temp dir");
    let kubelet = KubeletStandin::start(dir.path()).await.expect("stand-in");
    let (advertise, rx) = watch::channel(adv);
    let cancel = CancellationToken::new();
    let metrics = Arc::new(PluginMetrics::default());
    let plugins = tokio::spawn(run_plugins(
        test_config(dir.path()),
        rx,
        metrics.clone(),
        cancel.clone(),
    ));
    Harness {
        dir,
        kubelet,
        advertise,
        cancel,
        plugins,
        metrics,
    }
}

impl Harness {
    async fn stop(self) -> tempfile::TempDir {
        self.cancel.cancel();
        self.plugins.await.expect("join").expect("plugins");
        self.kubelet.shutdown().await;
        self.dir
    }
}

fn ids(devices: &[Device]) -> Vec<String> {
    devices.iter().map(|d| d.id.clone()).collect()
}

fn sockets(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[tokio::test]
async fn registers_every_resource_for_each_mig_strategy() {
    /// Strategy, inventory, expected (resource, device count).
    type Case = (MigStrategy, Vec<GpuDescription>, Vec<(&'static str, usize)>);
    let cases: Vec<Case> = vec![
        (
            MigStrategy::None,
            vec![gpu(0, &[]), gpu(1, &["1g.10gb"])],
            vec![("nvidia.com/gpu", 2)],
        ),
        (
            MigStrategy::Single,
            vec![gpu(0, &["1g.10gb", "1g.10gb"]), gpu(1, &["1g.10gb"])],
            vec![("nvidia.com/gpu", 3)],
        ),
        (
            MigStrategy::Mixed,
            vec![gpu(0, &["1g.10gb", "1g.10gb", "3g.40gb"]), gpu(1, &[])],
            vec![
                ("nvidia.com/gpu", 1),
                ("nvidia.com/mig-1g.10gb", 2),
                ("nvidia.com/mig-3g.40gb", 1),
            ],
        ),
    ];
    for (strategy, gpus, expected) in cases {
        let mut h = start(advertisement(&gpus, strategy, Topology::new())).await;
        let mut registered = BTreeSet::new();
        for _ in &expected {
            let request = h
                .kubelet
                .wait_for(WAIT, |e| match e {
                    KubeletEvent::Registered { request, options } => {
                        Some((request.clone(), *options))
                    }
                    _ => None,
                })
                .await
                .unwrap_or_else(|| panic!("{strategy}: registration"));
            let (request, options) = request;
            assert_eq!(request.version, "v1beta1");
            assert!(options.get_preferred_allocation_available && !options.pre_start_required);
            assert!(
                h.dir.path().join(&request.endpoint).exists(),
                "{strategy}: endpoint socket"
            );
            registered.insert(request.resource_name.clone());
        }
        let want: BTreeSet<String> = expected.iter().map(|(r, _)| (*r).to_owned()).collect();
        assert_eq!(registered, want, "{strategy}");
        for (resource, count) in expected {
            let devices = h
                .kubelet
                .wait_devices(resource, WAIT, |_| true)
                .await
                .unwrap_or_else(|| panic!("{strategy}: list for {resource}"));
            assert_eq!(devices.len(), count, "{strategy}: {resource}");
            assert!(devices.iter().all(|d| d.health == HEALTHY));
        }
        h.stop().await;
    }
}

#[tokio::test]
async fn health_fault_goes_unhealthy_then_recovers_after_hold_down() {
    let gpus = vec![gpu(0, &[]), gpu(1, &[]), gpu(2, &[])];
    let base = advertisement(&gpus, MigStrategy::None, Topology::new());
    let dir = tempfile::tempdir().expect("temp dir");
    let mut kubelet = KubeletStandin::start(dir.path()).await.expect("stand-in");
    let metrics = Arc::new(PluginMetrics::default());
    let cancel = CancellationToken::new();
    let (_layout_tx, layout_rx) = watch::channel(base.clone());
    let (events_tx, events_rx) = mpsc::channel(16);
    let (health_tx, health_rx) = watch::channel(base);
    let clock = ManualClock::new();
    let hold_down = Duration::from_secs(120);
    let monitor = HealthMonitor::new(
        HealthPolicy {
            hold_down,
            ..HealthPolicy::default()
        },
        metrics.clone(),
    )
    .with_clock(clock.clone());
    let monitor = tokio::spawn(monitor.run(layout_rx, events_rx, health_tx, cancel.clone()));
    let plugins = tokio::spawn(run_plugins(
        test_config(dir.path()),
        health_rx,
        metrics.clone(),
        cancel.clone(),
    ));
    let send = |target: u32, kind: HealthEventKind| {
        let tx = events_tx.clone();
        async move {
            tx.send(HealthEvent {
                target: HealthTarget::Gpu(target),
                kind,
            })
            .await
            .expect("send")
        }
    };
    let health_of =
        |list: &[Device]| -> Vec<String> { list.iter().map(|d| d.health.clone()).collect() };
    let (h, u) = (HEALTHY.to_owned(), UNHEALTHY.to_owned());

    let resource = "nvidia.com/gpu";
    kubelet
        .wait_devices(resource, WAIT, |d| d.iter().all(|d| d.health == HEALTHY))
        .await
        .expect("healthy list");

    // An application Xid changes nothing; a GPU-lost event takes GPU 1 out.
    send(1, HealthEventKind::Xid(13)).await;
    send(1, HealthEventKind::GpuLost).await;
    let list = kubelet
        .wait_devices(resource, WAIT, |d| d.iter().any(|d| d.health == UNHEALTHY))
        .await
        .expect("unhealthy list");
    assert_eq!(ids(&list), vec![uuid(0), uuid(1), uuid(2)]);
    assert_eq!(health_of(&list), vec![h.clone(), u.clone(), h.clone()]);

    // Allocate of the lost GPU fails; the others still work.
    let mut client = kubelet.client(resource).expect("client");
    let err = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![uuid(1)],
            }],
        })
        .await
        .expect_err("unhealthy");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains(&uuid(1)) && err.message().contains("GPU lost"),
        "{}",
        err.message()
    );
    client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![uuid(0)],
            }],
        })
        .await
        .expect("healthy GPU allocates");

    // The fault clears. A fault on GPU 2 afterwards marks the point where the
    // monitor has taken the clear (events are processed in order).
    send(1, HealthEventKind::Cleared).await;
    send(2, HealthEventKind::Xid(48)).await;
    let list = kubelet
        .wait_devices(resource, WAIT, |d| d[2].health == UNHEALTHY)
        .await
        .expect("GPU 2 faulted");
    assert_eq!(health_of(&list), vec![h.clone(), u.clone(), u.clone()]);

    // One second before the hold-down ends GPU 1 is still out (GPU 0 faulting marks the moment).
    clock.advance(hold_down - Duration::from_secs(1));
    send(0, HealthEventKind::DoubleBitEcc).await;
    let list = kubelet
        .wait_devices(resource, WAIT, |d| d[0].health == UNHEALTHY)
        .await
        .expect("GPU 0 faulted");
    assert_eq!(health_of(&list), vec![u.clone(), u.clone(), u.clone()]);

    // At the end of the hold-down GPU 1 is back, on its own; the others stay out.
    clock.advance(Duration::from_secs(1));
    let list = kubelet
        .wait_devices(resource, WAIT, |d| d[1].health == HEALTHY)
        .await
        .expect("GPU 1 recovered");
    assert_eq!(health_of(&list), vec![u.clone(), h.clone(), u.clone()]);
    let m = metrics.snapshot();
    assert_eq!(
        (
            m.health_unhealthy_transitions,
            m.health_healthy_transitions,
            m.ignored_xids
        ),
        (3, 1, 1)
    );

    cancel.cancel();
    plugins.await.expect("join").expect("plugins");
    monitor.await.expect("monitor");
    kubelet.shutdown().await;
}

#[tokio::test]
async fn allocate_returns_cdi_names_annotations_and_env() {
    let gpus = vec![gpu(0, &["1g.10gb", "1g.10gb"]), gpu(1, &[])];
    let mut h = start(advertisement(&gpus, MigStrategy::Mixed, Topology::new())).await;
    let resource = "nvidia.com/mig-1g.10gb";
    h.kubelet
        .wait_registered(resource, WAIT)
        .await
        .expect("registered");
    let mut client = h.kubelet.client(resource).expect("client");
    let mig0 = "MIG-00000000-0000-0000-0000-000000000000".to_owned();
    let mig1 = "MIG-00000000-0001-0000-0000-000000000000".to_owned();
    let resp = client
        .allocate(AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest {
                    devices_ids: vec![mig1.clone()],
                },
                ContainerAllocateRequest {
                    devices_ids: vec![mig0.clone(), mig1.clone()],
                },
            ],
        })
        .await
        .expect("allocate")
        .into_inner();
    assert_eq!(resp.container_responses.len(), 2);
    let second = &resp.container_responses[1];
    let names: Vec<&str> = second.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["gpupool.io/gpu=0:0", "gpupool.io/gpu=0:1"]);
    assert_eq!(
        second
            .annotations
            .get("cdi.k8s.io/gpupool_nvidia.com_mig-1g.10gb")
            .map(String::as_str),
        Some("gpupool.io/gpu=0:0,gpupool.io/gpu=0:1")
    );
    assert_eq!(
        second.envs.get("NVIDIA_VISIBLE_DEVICES").cloned(),
        Some(format!("{mig0},{mig1}"))
    );
    let first = &resp.container_responses[0];
    assert_eq!(first.cdi_devices.len(), 1);
    assert_eq!(first.cdi_devices[0].name, "gpupool.io/gpu=0:1");
    assert_eq!(first.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&mig1));
    assert!(first.mounts.is_empty() && first.devices.is_empty());

    // A whole GPU under the other resource.
    let mut gpu_client = {
        h.kubelet.wait_registered("nvidia.com/gpu", WAIT).await;
        h.kubelet.client("nvidia.com/gpu").expect("gpu client")
    };
    let resp = gpu_client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![uuid(1)],
            }],
        })
        .await
        .expect("allocate gpu")
        .into_inner();
    assert_eq!(
        resp.container_responses[0].cdi_devices[0].name,
        "gpupool.io/gpu=1"
    );
    assert_eq!(h.metrics.snapshot().allocations, 2);
    h.stop().await;
}

#[tokio::test]
async fn bad_ids_are_rejected_with_invalid_argument() {
    let gpus = vec![gpu(0, &[]), gpu(1, &[])];
    let mut h = start(advertisement(&gpus, MigStrategy::None, Topology::new())).await;
    h.kubelet
        .wait_registered("nvidia.com/gpu", WAIT)
        .await
        .expect("registered");
    let mut client = h.kubelet.client("nvidia.com/gpu").expect("client");
    let err = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![uuid(0), "GPU-nope".into()],
            }],
        })
        .await
        .expect_err("unknown id");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("GPU-nope"), "{}", err.message());
    assert!(!err.message().contains(&uuid(0)), "{}", err.message());
    assert_eq!(h.metrics.snapshot().allocation_errors, 1);
    h.stop().await;
}

#[tokio::test]
async fn preferred_allocation_picks_the_nvlink_pair() {
    let gpus: Vec<_> = (0..4).map(|i| gpu(i, &[])).collect();
    // GPUs 1 and 3 are NVLink-bridged; 0-1 and 2-3 share a PCIe switch.
    let topology = Topology::new()
        .with_link(1, 3, LinkKind::NvLink(4))
        .with_link(0, 1, LinkKind::SamePcieSwitch)
        .with_link(2, 3, LinkKind::SamePcieSwitch);
    let mut h = start(advertisement(&gpus, MigStrategy::None, topology)).await;
    h.kubelet
        .wait_registered("nvidia.com/gpu", WAIT)
        .await
        .expect("registered");
    let mut client = h.kubelet.client("nvidia.com/gpu").expect("client");
    let all: Vec<String> = (0..4).map(uuid).collect();
    let resp = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![
                ContainerPreferredAllocationRequest {
                    available_device_i_ds: all.clone(),
                    must_include_device_i_ds: vec![],
                    allocation_size: 2,
                },
                ContainerPreferredAllocationRequest {
                    available_device_i_ds: [all.clone(), vec!["GPU-lost".into()]].concat(),
                    must_include_device_i_ds: vec![uuid(2)],
                    allocation_size: 2,
                },
            ],
        })
        .await
        .expect("preferred")
        .into_inner();
    assert_eq!(
        resp.container_responses[0].device_i_ds,
        vec![uuid(1), uuid(3)]
    );
    assert_eq!(
        resp.container_responses[1].device_i_ds,
        vec![uuid(2), uuid(3)]
    );
    h.stop().await;
}

#[tokio::test]
async fn kubelet_restart_triggers_re_registration() {
    let gpus = vec![gpu(0, &["1g.10gb"]), gpu(1, &[])];
    let mut h = start(advertisement(&gpus, MigStrategy::Mixed, Topology::new())).await;
    for r in ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"] {
        h.kubelet
            .wait_registered(r, WAIT)
            .await
            .expect("first registration");
    }
    h.kubelet.restart().await.expect("restart");
    let mut again = BTreeSet::new();
    while again.len() < 2 {
        let req = h
            .kubelet
            .wait_for(WAIT, |e| match e {
                KubeletEvent::Registered { request, .. } => Some(request.clone()),
                _ => None,
            })
            .await
            .expect("re-registration");
        assert!(
            h.dir.path().join(&req.endpoint).exists(),
            "socket recreated"
        );
        again.insert(req.resource_name);
    }
    assert_eq!(
        again,
        BTreeSet::from([
            "nvidia.com/gpu".to_owned(),
            "nvidia.com/mig-1g.10gb".to_owned()
        ])
    );
    assert_eq!(h.kubelet.registrations().len(), 4);
    // The new kubelet gets the device lists and can allocate.
    h.kubelet
        .wait_devices("nvidia.com/gpu", WAIT, |d| d.len() == 1)
        .await
        .expect("list after restart");
    let mut client = h.kubelet.client("nvidia.com/gpu").expect("client");
    client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![uuid(1)],
            }],
        })
        .await
        .expect("allocate after restart");
    assert_eq!(h.metrics.snapshot().kubelet_restarts, 1);
    h.stop().await;
}

#[tokio::test]
async fn waits_for_a_missing_kubelet_then_registers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_tx, rx) = watch::channel(advertisement(
        &[gpu(0, &[])],
        MigStrategy::None,
        Topology::new(),
    ));
    let cancel = CancellationToken::new();
    let metrics = Arc::new(PluginMetrics::default());
    let plugins = tokio::spawn(run_plugins(
        test_config(dir.path()),
        rx,
        metrics.clone(),
        cancel.clone(),
    ));
    // The plugin serves, but cannot register yet.
    let socket = dir.path().join("gpupool-nvidia.com-gpu.sock");
    let deadline = tokio::time::Instant::now() + WAIT;
    while metrics.snapshot().registration_failures == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed attempt recorded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(socket.exists());
    let mut kubelet = KubeletStandin::start(dir.path()).await.expect("stand-in");
    kubelet
        .wait_registered("nvidia.com/gpu", WAIT)
        .await
        .expect("registration once kubelet is up");
    cancel.cancel();
    plugins.await.expect("join").expect("plugins");
    kubelet.shutdown().await;
}

#[tokio::test]
async fn removed_resource_sends_empty_list_then_its_socket_goes() {
    let gpus = vec![gpu(0, &["1g.10gb", "2g.20gb"])];
    let mut h = start(advertisement(&gpus, MigStrategy::Mixed, Topology::new())).await;
    let removed = "nvidia.com/mig-2g.20gb";
    h.kubelet
        .wait_devices(removed, WAIT, |d| d.len() == 1)
        .await
        .expect("initial list");
    h.kubelet
        .wait_devices("nvidia.com/mig-1g.10gb", WAIT, |d| d.len() == 1)
        .await
        .expect("initial list");
    let socket = h.dir.path().join("gpupool-nvidia.com-mig-2g.20gb.sock");
    assert!(socket.exists());

    // The MIG layout loses the 2g profile.
    let gpus = vec![gpu(0, &["1g.10gb"])];
    h.advertise
        .send_replace(advertisement(&gpus, MigStrategy::Mixed, Topology::new()));
    let empty = h
        .kubelet
        .wait_devices(removed, WAIT, |_| true)
        .await
        .expect("a list after removal");
    assert!(
        empty.is_empty(),
        "first list after removal is empty: {:?}",
        ids(&empty)
    );
    h.kubelet
        .wait_for(WAIT, |e| {
            matches!(e, KubeletEvent::StreamClosed { resource } if resource == removed)
                .then_some(())
        })
        .await
        .expect("stream closed");
    let deadline = tokio::time::Instant::now() + WAIT;
    while socket.exists() {
        assert!(tokio::time::Instant::now() < deadline, "socket still there");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The remaining resource is untouched.
    assert!(
        h.dir
            .path()
            .join("gpupool-nvidia.com-mig-1g.10gb.sock")
            .exists()
    );
    h.stop().await;
}

#[tokio::test]
async fn graceful_shutdown_removes_the_sockets() {
    let gpus = vec![gpu(0, &["1g.10gb"]), gpu(1, &[])];
    let mut h = start(advertisement(&gpus, MigStrategy::Mixed, Topology::new())).await;
    for r in ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"] {
        h.kubelet
            .wait_registered(r, WAIT)
            .await
            .expect("registered");
    }
    let before = sockets(h.dir.path());
    assert!(
        before.contains("gpupool-nvidia.com-gpu.sock")
            && before.contains("gpupool-nvidia.com-mig-1g.10gb.sock")
    );
    h.cancel.cancel();
    h.plugins.await.expect("join").expect("plugins");
    let after = sockets(h.dir.path());
    assert_eq!(after, BTreeSet::from(["kubelet.sock".to_owned()]));
    h.kubelet.shutdown().await;
}

#[tokio::test]
async fn a_hung_kubelet_delays_neither_device_updates_nor_shutdown() {
    use gpupool_device_plugin::plugin::api::v1beta1::Empty;
    use gpupool_device_plugin::plugin::api::v1beta1::device_plugin_client::DevicePluginClient;
    use gpupool_device_plugin::plugin::connect_unix;

    let dir = tempfile::tempdir().expect("temp dir");
    // A kubelet.sock that accepts connections into its backlog but never answers.
    let _hung = tokio::net::UnixListener::bind(dir.path().join("kubelet.sock")).expect("bind");
    let (tx, rx) = watch::channel(advertisement(
        &[gpu(0, &[])],
        MigStrategy::None,
        Topology::new(),
    ));
    let cancel = CancellationToken::new();
    let config = PluginConfig {
        rpc_timeout: Duration::from_secs(3600),
        ..test_config(dir.path())
    };
    let plugins = tokio::spawn(run_plugins(
        config,
        rx,
        Arc::new(PluginMetrics::default()),
        cancel.clone(),
    ));

    let socket = dir.path().join("gpupool-nvidia.com-gpu.sock");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !socket.exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "plugin socket never appeared"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let channel = connect_unix(&socket, WAIT).await.expect("connect");
    let mut stream = DevicePluginClient::new(channel)
        .list_and_watch(Empty {})
        .await
        .expect("stream")
        .into_inner();
    let first = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("first list")
        .expect("ok")
        .expect("some");
    assert_eq!(first.devices.len(), 1);

    // Registration is stuck inside Register; a new GPU must still reach the stream.
    tx.send_replace(advertisement(
        &[gpu(0, &[]), gpu(1, &[])],
        MigStrategy::None,
        Topology::new(),
    ));
    let second = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("second list")
        .expect("ok")
        .expect("some");
    assert_eq!(ids(&second.devices), vec![uuid(0), uuid(1)]);

    cancel.cancel();
    tokio::time::timeout(WAIT, plugins)
        .await
        .expect("prompt shutdown")
        .expect("join")
        .expect("plugins");
    assert!(!socket.exists());
}
