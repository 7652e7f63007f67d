//! Safe by evidence (issue #38): the agent's disruptive actions — destroying MIG instances,
//! switching a GPU's sharing mode — wait for positive, fresh evidence that no pod holds the GPU,
//! read from a stand-in kubelet PodResources server on a real unix socket, against a simulated
//! node. An unreadable PodResources, or process lists from outside the host's PID namespace,
//! hold the change, and the hold says why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpupool_crds::node::{Activity, GpuMigSpec, MigState, NodeMigSpec, NodeMigStatus};
use gpupool_device_plugin::agent::reconfigure::{MigJob, MigProgress};
use gpupool_device_plugin::agent::sampling::SamplingJob;
use gpupool_device_plugin::backend::{GpuBackend, ManualSimClock, SimBackend};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::pidns::HostPidNamespace;
use gpupool_device_plugin::plugin::api::podresources_v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpupool_device_plugin::plugin::api::podresources_v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use gpupool_device_plugin::podresources::PodSource;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

/// What the stand-in kubelet answers `List` with: the pods, or (`None`) an error.
type Answer = Arc<Mutex<Option<Vec<PodResources>>>>;

struct Kubelet(Answer);

#[tonic::async_trait]
impl PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        match self.0.lock().unwrap().clone() {
            Some(pod_resources) => Ok(Response::new(ListPodResourcesResponse { pod_resources })),
            None => Err(Status::unavailable("the kubelet is restarting")),
        }
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }
}

/// A simulated node (an A30 with MIG on, an L4) and a kubelet serving PodResources.
struct Node {
    _tmp: tempfile::TempDir,
    socket: PathBuf,
    pods: Answer,
    backend: Arc<dyn GpuBackend>,
    server: JoinHandle<()>,
}

impl Node {
    fn start() -> Node {
        let tmp = tempfile::tempdir().unwrap();
        let socket = tmp.path().join("kubelet.sock");
        let pods: Answer = Arc::new(Mutex::new(Some(vec![])));
        let listener = UnixListener::bind(&socket).unwrap();
        let service = PodResourcesListerServer::new(Kubelet(pods.clone()));
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/mixed-small.yaml");
        let sim = SimBackend::from_file(&fixture, Arc::new(ManualSimClock::new())).unwrap();
        Node {
            _tmp: tmp,
            socket,
            pods,
            backend: Arc::new(sim),
            server,
        }
    }

    fn inventory(&self) -> Inventory {
        Inventory::read(self.backend.as_ref()).unwrap()
    }

    /// The A30's MIG devices' UUIDs.
    fn mig_uuids(&self) -> Vec<String> {
        self.inventory().gpus[0]
            .mig_devices
            .iter()
            .map(|m| m.uuid.to_string())
            .collect()
    }

    fn hold(&self, pods: Vec<PodResources>) {
        *self.pods.lock().unwrap() = Some(pods);
    }

    fn fail_pod_resources(&self) {
        *self.pods.lock().unwrap() = None;
    }

    fn mig_job(&self, drain_timeout: Duration) -> MigJob {
        MigJob::new(
            drain_timeout,
            Duration::ZERO,
            PodSource::Kubelet(self.socket.clone()),
            Instant::now(),
        )
    }

    /// Steps `job` towards `spec` (generation `generation`) until it waits, as the agent's
    /// pass does (the hardware read again after each operation); the last status.
    async fn pass(
        &self,
        job: &mut MigJob,
        spec: &NodeMigSpec,
        generation: i64,
        host: Result<(), &str>,
    ) -> NodeMigStatus {
        for _ in 0..64 {
            let inv = self.inventory();
            match job
                .advance(&self.backend, spec, Some(generation), &inv, host)
                .await
            {
                MigProgress::Waiting(_) | MigProgress::Failed => return job.status(),
                MigProgress::PhaseChanged | MigProgress::Executed => {}
            }
        }
        panic!("the MIG job never settled: {:?}", job.status());
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn a30_layout(profiles: &[(&str, u32)]) -> NodeMigSpec {
    NodeMigSpec {
        managed: true,
        gpus: vec![GpuMigSpec {
            index: 0,
            enabled: true,
            profiles: profiles
                .iter()
                .map(|(p, n)| ((*p).to_owned(), *n))
                .collect(),
        }],
        ..NodeMigSpec::default()
    }
}

fn pod(name: &str, resource: &str, ids: &[&str]) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
                topology: None,
            }],
            ..Default::default()
        }],
    }
}

/// The A30 carrying two 2g.12gb instances, applied with no pod on the node, and the MIG job
/// (giving up draining after `drain_timeout`) that applied them.
async fn node_with_two_instances(drain_timeout: Duration) -> (Node, MigJob) {
    let node = Node::start();
    let mut job = node.mig_job(drain_timeout);
    let status = node
        .pass(&mut job, &a30_layout(&[("2g.12gb", 2)]), 1, Ok(()))
        .await;
    assert_eq!(status.state, MigState::Applied, "{status:?}");
    assert_eq!(node.mig_uuids().len(), 2);
    (node, job)
}

const HOLD: Duration = Duration::from_secs(600);

/// (a) A pod holds a MIG device but runs no process: the layout change for its GPU drains
/// (naming the pod) and leaves the instance alone until the pod is gone.
#[tokio::test]
async fn a_pod_holding_a_mig_device_without_a_process_keeps_its_instance() {
    let (node, mut job) = node_with_two_instances(HOLD).await;
    let before = node.mig_uuids();
    node.hold(vec![pod(
        "infer-0",
        "nvidia.com/mig-2g.12gb",
        &[&before[0]],
    )]);
    assert!(
        node.backend.processes(0).unwrap().is_empty(),
        "no CUDA context: NVML lists no process"
    );

    let change = a30_layout(&[("4g.24gb", 1)]);
    for _ in 0..3 {
        let status = node.pass(&mut job, &change, 2, Ok(())).await;
        assert_eq!(status.state, MigState::Draining, "{status:?}");
        assert!(
            status
                .message
                .as_deref()
                .unwrap_or_default()
                .contains("pod ml/infer-0"),
            "the holding pod is named: {status:?}"
        );
        assert_eq!(node.mig_uuids(), before, "the instances are intact");
    }

    node.hold(vec![]);
    let status = node.pass(&mut job, &change, 2, Ok(())).await;
    assert_eq!(status.state, MigState::Applied, "{status:?}");
    let inv = node.inventory();
    assert_eq!(inv.gpus[0].mig_devices.len(), 1, "the new layout");
}

/// (a) A pod that never leaves: the drain times out with the instance intact, and the
/// failure (status message and so the MigFailed Event) names the pod.
#[tokio::test]
async fn a_drain_that_times_out_names_the_pod_and_keeps_the_instance() {
    let (node, mut job) = node_with_two_instances(Duration::ZERO).await;
    let before = node.mig_uuids();
    node.hold(vec![pod("stuck", "nvidia.com/mig-2g.12gb", &[&before[1]])]);
    let change = a30_layout(&[("4g.24gb", 1)]);
    let status = node.pass(&mut job, &change, 2, Ok(())).await;
    assert_eq!(
        (status.state, status.reason.as_deref()),
        (MigState::Failed, Some("DrainTimeout")),
        "{status:?}"
    );
    let message = status.message.unwrap_or_default();
    assert!(message.contains("GPU 0: pod ml/stuck"), "{message}");
    assert_eq!(node.mig_uuids(), before, "the instances are intact");
    // The pod leaving does not restart a failed change on its own (a new spec does).
    node.hold(vec![]);
    let status = node.pass(&mut job, &change, 2, Ok(())).await;
    assert_eq!(status.state, MigState::Failed);
    assert_eq!(node.mig_uuids(), before);
}

/// (c) PodResources cannot be read: nobody can tell which pods hold the GPU, so it counts as
/// held, and the hold says why.
#[tokio::test]
async fn an_unreadable_pod_resources_holds_the_mig_change() {
    let (node, mut job) = node_with_two_instances(HOLD).await;
    let before = node.mig_uuids();
    node.fail_pod_resources();
    let change = a30_layout(&[("4g.24gb", 1)]);
    for _ in 0..3 {
        let status = node.pass(&mut job, &change, 2, Ok(())).await;
        assert_eq!(status.state, MigState::Draining, "{status:?}");
        let message = status.message.unwrap_or_default();
        assert!(
            message.contains("the pods holding it are unknown"),
            "{message}"
        );
        assert_eq!(node.mig_uuids(), before, "the instances are intact");
    }
    // The kubelet answers again, with nothing held: the change goes through.
    node.hold(vec![]);
    let status = node.pass(&mut job, &change, 2, Ok(())).await;
    assert_eq!(status.state, MigState::Applied, "{status:?}");
}

/// (d) The agent is not in the host's PID namespace: the check fails, every device's activity
/// is Unknown (never Idle, so nothing is reclaimed), and a MIG change holds in Draining.
#[tokio::test]
async fn a_foreign_pid_namespace_fails_its_check_reports_unknown_and_holds_mig() {
    // The agent's own status in the host's procfs: PIDs in two namespaces, so not the host's.
    let host_proc = tempfile::tempdir().unwrap();
    std::fs::create_dir(host_proc.path().join("self")).unwrap();
    std::fs::write(
        host_proc.path().join("self/status"),
        "Name:\tgpupool-device-plugin\nNSpid:\t81234\t7\n",
    )
    .unwrap();
    let found = HostPidNamespace::read(host_proc.path());
    let check = found.check();
    assert_eq!(check.name.as_str(), "HostPIDNamespace");
    assert!(!check.passed, "{}", check.message);
    let why = found.sees_host_processes().unwrap_err();

    let (node, mut job) = node_with_two_instances(HOLD).await;
    let before = node.mig_uuids();

    // Utilization: with nothing running, every device would read Idle; here all are Unknown.
    let inv = node.inventory();
    let sample = |seen: bool| {
        let mut sampling = SamplingJob::new(
            PodSource::Kubelet(node.socket.clone()),
            PathBuf::from("/proc"),
            PathBuf::from("/nonexistent/device-plugins"),
            1,
            Instant::now(),
        );
        let backend = node.backend.clone();
        let inv = inv.clone();
        async move {
            sampling
                .run_if_due(
                    Some(&backend),
                    Some(&inv),
                    5,
                    Duration::from_secs(1),
                    seen,
                    Instant::now(),
                )
                .await;
            let mut ids: Vec<String> = inv.gpus.iter().map(|g| g.device.uuid.to_string()).collect();
            ids.extend(inv.gpus[0].mig_devices.iter().map(|m| m.uuid.to_string()));
            ids.into_iter()
                .map(|id| {
                    let a = sampling.idle.idleness(&id, vec![]).activity;
                    (id, a)
                })
                .collect::<BTreeMap<String, Activity>>()
        }
    };
    let seen = sample(true).await;
    assert!(
        seen.values().any(|a| *a == Activity::Idle),
        "in the host's namespace the idle devices read Idle: {seen:?}"
    );
    let blind = sample(false).await;
    assert!(
        blind.values().all(|a| *a == Activity::Unknown),
        "outside it every device is Unknown: {blind:?}"
    );

    // MIG: nothing holds the A30 by PodResources, yet the change holds with the reason.
    let change = a30_layout(&[("4g.24gb", 1)]);
    for _ in 0..3 {
        let status = node.pass(&mut job, &change, 2, Err(why.as_str())).await;
        assert_eq!(status.state, MigState::Draining, "{status:?}");
        let message = status.message.unwrap_or_default();
        assert!(message.contains("PID namespace"), "{message}");
        assert_eq!(node.mig_uuids(), before, "the instances are intact");
    }
}

mod sharing {
    use super::*;
    use gpupool_crds::node::GpuStatus;
    use gpupool_crds::policy::{MigStrategy, SharingPolicy, TimeSlicingPolicy};
    use gpupool_device_plugin::agent::advertise::MpsView;
    use gpupool_device_plugin::agent::advertisement;
    use gpupool_device_plugin::agent::sharing_gate::SharingGate;
    use gpupool_device_plugin::plugin::Topology;
    use gpupool_device_plugin::podresources;

    fn time_sliced_l4(replicas: u32) -> SharingPolicy {
        SharingPolicy {
            time_slicing: Some(TimeSlicingPolicy {
                replicas,
                rename_by_default: false,
                fail_requests_greater_than_one: true,
                placement: Default::default(),
                resources: None,
                gpus: Some(vec![1]),
                models: None,
            }),
            mps: None,
        }
    }

    /// One agent pass over sharing, as `reconcile` does it: PodResources read now, the gate,
    /// then the devices the kubelet plugins would advertise (withheld GPUs left out). Returns
    /// the replica IDs advertised on the L4 (GPU 1) and whether it is advertised at all.
    async fn pass(node: &Node, gate: &mut SharingGate, desired: &SharingPolicy) -> (usize, bool) {
        let inv = node.inventory();
        let pods = podresources::list_pod_devices(&node.socket, Duration::from_secs(5))
            .await
            .map_err(|e| e.to_string());
        let applied = gate.step(
            &inv,
            desired,
            MigStrategy::None,
            pods.as_ref().map_err(String::as_str),
        );
        let mut shown = inv.clone();
        shown
            .gpus
            .retain(|g| !gate.withheld().contains(&g.device.index));
        let adv = advertisement(
            &shown,
            MigStrategy::None,
            &[],
            &applied,
            &MpsView::default(),
            Arc::new(Topology::new()),
        );
        let on_l4: Vec<_> = adv
            .resources
            .values()
            .flatten()
            .filter(|d| d.parent_gpu == 1)
            .collect();
        let replicas = on_l4.iter().filter(|d| d.replica.is_some()).count();
        (replicas, !on_l4.is_empty())
    }

    /// (b) The agent restarts halfway through an exclusive → time-sliced change on the L4,
    /// which a pod holds exclusively: the new agent does not switch the mode under the pod,
    /// from the pod's evidence alone and from the last published status alike.
    #[tokio::test]
    async fn a_restarted_agent_does_not_switch_the_mode_under_an_exclusive_pod() {
        let node = Node::start();
        let l4 = node.inventory().gpus[1].device.uuid.to_string();
        node.hold(vec![pod("train-0", "nvidia.com/gpu", &[&l4])]);
        let desired = time_sliced_l4(4);
        let published = vec![
            GpuStatus {
                index: 0,
                ..Default::default()
            },
            GpuStatus {
                index: 1,
                ..Default::default()
            },
        ];
        for status in [None, Some(published)] {
            // A fresh gate: what a restarted agent starts with.
            let mut gate = SharingGate::default();
            if let Some(gpus) = &status {
                gate.restore(gpus);
            }
            for _ in 0..3 {
                let (replicas, shown) = pass(&node, &mut gate, &desired).await;
                assert_eq!(replicas, 0, "no replicas while the pod holds the L4");
                assert!(shown, "the L4 stays advertised, exclusive");
                assert_eq!(gate.draining(), [1]);
                let held = gate.status(NodeMigStatus::default());
                assert_eq!(held.state, MigState::Draining);
                assert_eq!(held.reason.as_deref(), Some("SharingChange"));
            }
        }
        // The pod left: the change goes through.
        let mut gate = SharingGate::default();
        node.hold(vec![]);
        assert_eq!(pass(&node, &mut gate, &desired).await, (4, true));
        assert!(gate.draining().is_empty());
    }

    /// (c) PodResources fails: no sharing switch, after a restart or not, and the hold says
    /// why.
    #[tokio::test]
    async fn an_unreadable_pod_resources_switches_no_sharing_mode() {
        let node = Node::start();
        node.fail_pod_resources();
        let desired = time_sliced_l4(4);
        // A restarted agent whose last status shows the L4 exclusive.
        let mut gate = SharingGate::default();
        gate.restore(&[GpuStatus {
            index: 1,
            ..Default::default()
        }]);
        let (replicas, _) = pass(&node, &mut gate, &desired).await;
        assert_eq!(replicas, 0, "not switched on unknown pods");
        let held = gate.status(NodeMigStatus::default());
        assert_eq!(held.state, MigState::Draining);
        assert!(
            held.message.unwrap_or_default().contains("cannot be read"),
            "the hold says why"
        );
        // A running agent with the L4 exclusive and a change arriving while the kubelet fails.
        node.hold(vec![]);
        let mut gate = SharingGate::default();
        assert_eq!(
            pass(&node, &mut gate, &SharingPolicy::default()).await,
            (0, true)
        );
        node.fail_pod_resources();
        assert_eq!(pass(&node, &mut gate, &desired).await.0, 0);
        assert_eq!(gate.draining(), [1]);
        node.hold(vec![]);
        assert_eq!(pass(&node, &mut gate, &desired).await, (4, true));
    }
}
