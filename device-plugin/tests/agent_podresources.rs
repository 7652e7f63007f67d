//! Device → pod mapping through a stand-in kubelet PodResources server on a unix socket, and
//! idleness samples from a simulated node.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpupool_crds::node::{Activity, PodRef};
use gpupool_device_plugin::backend::{ManualSimClock, SimBackend};
use gpupool_device_plugin::inventory::Inventory;
use gpupool_device_plugin::plugin::api::podresources_v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpupool_device_plugin::plugin::api::podresources_v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use gpupool_device_plugin::podresources::{self, PodResourcesError};
use gpupool_device_plugin::utilization::{self, IdleTracker};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

struct Kubelet;

fn pod(ns: &str, name: &str, container: &str, resource: &str, ids: &[&str]) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: ns.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
                topology: None,
            }],
            ..Default::default()
        }],
    }
}

#[tonic::async_trait]
impl PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "ml",
                    "train-0",
                    "main",
                    "nvidia.com/gpu",
                    &["GPU-a", "GPU-b"],
                ),
                pod(
                    "ml",
                    "infer-0",
                    "server",
                    "nvidia.com/mig-1g.10gb",
                    &["MIG-c"],
                ),
                pod("net", "sriov", "c", "intel.com/sriov", &["GPU-a"]),
                pod("nb", "one", "lab", "nvidia.com/gpu.shared", &["GPU-d::0"]),
                pod("nb", "two", "lab", "nvidia.com/gpu.shared", &["GPU-d::1"]),
            ],
        }))
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

#[tokio::test]
async fn maps_devices_to_pods_from_the_kubelet() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("kubelet.sock");
    let missing = podresources::list_pod_devices(&socket, Duration::from_secs(1)).await;
    assert!(
        matches!(missing, Err(PodResourcesError::Missing(_))),
        "{missing:?}"
    );

    let listener = UnixListener::bind(&socket).unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PodResourcesListerServer::new(Kubelet))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let map = podresources::list_pod_devices(&socket, Duration::from_secs(5))
        .await
        .unwrap();
    let holder = |ns: &str, name: &str, c: &str| PodRef {
        namespace: ns.into(),
        name: name.into(),
        container: Some(c.into()),
    };
    assert_eq!(
        map.get("GPU-a"),
        Some(&vec![holder("ml", "train-0", "main")]),
        "non-GPU resources are ignored"
    );
    assert_eq!(
        map.get("GPU-b"),
        Some(&vec![holder("ml", "train-0", "main")])
    );
    assert_eq!(
        map.get("MIG-c"),
        Some(&vec![holder("ml", "infer-0", "server")])
    );
    // Shared replicas: the device is held by both pods, each replica by its own.
    assert_eq!(
        map.get("GPU-d"),
        Some(&vec![
            holder("nb", "one", "lab"),
            holder("nb", "two", "lab")
        ])
    );
    assert_eq!(map.get("GPU-d::1"), Some(&vec![holder("nb", "two", "lab")]));
    assert_eq!(map.len(), 6);
    server.abort();
}

#[test]
fn samples_whole_gpus_by_utilization_and_never_calls_unknown_idle() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/faults.yaml");
    let clock = ManualSimClock::new();
    let backend = SimBackend::from_file(&fixture, Arc::new(clock.clone())).unwrap();
    let inv = Inventory::read(&backend).unwrap();
    clock.set(10.0);
    let samples = utilization::sample(&backend, &inv, 5);
    let by_index = |i: usize| samples[inv.gpus[i].device.uuid.as_str()];
    // GPU 0 busy (88 %) with a process; GPU 1 idle; GPU 2 idle until 50 s.
    assert_eq!(by_index(0).activity, Activity::Busy);
    assert_eq!(by_index(0).utilization_percent, Some(88));
    assert_eq!(by_index(0).memory_used_mib, Some(4096));
    assert_eq!(by_index(1).activity, Activity::Idle);
    assert_eq!(by_index(2).activity, Activity::Idle);
    clock.set(60.0);
    let later = utilization::sample(&backend, &inv, 5);
    assert_eq!(
        later[inv.gpus[2].device.uuid.as_str()].activity,
        Activity::Busy
    );

    let mut tracker = IdleTracker::new(2);
    let now = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap();
    let acts: BTreeMap<String, Activity> = samples
        .iter()
        .map(|(k, s)| (k.clone(), s.activity))
        .collect();
    tracker.observe(&acts, now, std::time::Duration::from_secs(60));
    tracker.observe(&acts, now, std::time::Duration::from_secs(60));
    assert!(
        tracker
            .idleness(inv.gpus[1].device.uuid.as_str(), vec![])
            .idle_since
            .is_some()
    );
    assert!(
        tracker
            .idleness(inv.gpus[0].device.uuid.as_str(), vec![])
            .idle_since
            .is_none()
    );
}

/// Per-share idleness on a shared GPU: each pod judged on its own processes, told apart by
/// their cgroups (a fake `/proc`) and the kubelet's device checkpoint, not by the share IDs in
/// their environment, which a tenant can rewrite.
#[test]
fn shares_are_judged_on_their_own_processes() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/faults.yaml");
    let clock = ManualSimClock::new();
    let backend = SimBackend::from_file(&fixture, Arc::new(clock.clone())).unwrap();
    let inv = Inventory::read(&backend).unwrap();
    // GPU 2 at 60 s: process 3001 at 30 % SM, 3002 running but using none.
    clock.set(60.0);
    let uuid = inv.gpus[2].device.uuid.to_string();
    let share = |n: u32| format!("{uuid}::{n}");
    let held =
        std::collections::BTreeMap::from([(uuid.clone(), vec![share(0), share(1), share(2)])]);
    let proc = tempfile::tempdir().unwrap();
    let plugins = tempfile::tempdir().unwrap();
    let pod_uid = |n: u32| format!("00000000-0000-4000-8000-00000000000{n}");
    // Pod n holds share n (the kubelet's checkpoint, NUMA-keyed as kubelets write it).
    let entries: Vec<String> = (0..3)
        .map(|n| {
            format!(
                r#"{{"PodUID":"{}","ContainerName":"main","ResourceName":"nvidia.com/gpu","DeviceIDs":{{"-1":["{}"]}},"AllocResp":""}}"#,
                pod_uid(n),
                share(n)
            )
        })
        .collect();
    std::fs::write(
        plugins
            .path()
            .join(gpupool_device_plugin::attribution::CHECKPOINT_FILE),
        format!(
            r#"{{"Data":{{"PodDeviceEntries":[{}],"RegisteredDevices":{{}}}},"Checksum":0}}"#,
            entries.join(",")
        ),
    )
    .unwrap();
    // Each process in its pod's cgroup; each declares some share in its environment, which
    // counts for nothing.
    let process = |pid: u32, pod: Option<u32>, env: &str| {
        let dir = proc.path().join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let cgroup = match pod {
            Some(n) => format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-1.scope\n",
                pod_uid(n).replace('-', "_")
            ),
            None => "0::/system.slice/some.service\n".to_owned(),
        };
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
        std::fs::write(dir.join("environ"), env).unwrap();
    };
    let attribution =
        || gpupool_device_plugin::attribution::Attribution::read(proc.path(), plugins.path());
    // The busy process claims pod 1's share as well as its own: it still counts as pod 0's.
    process(
        3001,
        Some(0),
        &format!("GPUPOOL_SHARE_ID={},{}\0", share(0), share(1)),
    );
    process(3002, Some(1), &format!("GPUPOOL_SHARE_ID={}\0", share(1)));
    let act = utilization::sample_shares(&backend, &inv, &held, &attribution(), 5);
    assert_eq!(act[&share(0)], Activity::Busy, "its process works");
    assert_eq!(
        act[&share(1)],
        Activity::Idle,
        "its process runs but uses nothing"
    );
    assert_eq!(act[&share(2)], Activity::Idle, "no process at all");
    assert_eq!(act.len(), 3, "only the held shares");
    // Above its 30 %, the busy tenant counts as idle too.
    assert_eq!(
        utilization::sample_shares(&backend, &inv, &held, &attribution(), 40)[&share(0)],
        Activity::Idle
    );
    // The busy process is in no pod (or its cgroup cannot be read), whatever its environment
    // says: whose it is cannot be told, so nobody can be called idle.
    process(3001, None, &format!("GPUPOOL_SHARE_ID={}\0", share(0)));
    let act = utilization::sample_shares(&backend, &inv, &held, &attribution(), 5);
    assert!(act.values().all(|a| *a == Activity::Unknown), "{act:?}");
    std::fs::remove_file(proc.path().join("3001/cgroup")).unwrap();
    let act = utilization::sample_shares(&backend, &inv, &held, &attribution(), 5);
    assert!(act.values().all(|a| *a == Activity::Unknown), "{act:?}");
    // Without the kubelet's checkpoint no process can be attributed either.
    process(3001, Some(0), "");
    std::fs::remove_file(
        plugins
            .path()
            .join(gpupool_device_plugin::attribution::CHECKPOINT_FILE),
    )
    .unwrap();
    let act = utilization::sample_shares(&backend, &inv, &held, &attribution(), 5);
    assert!(act.values().all(|a| *a == Activity::Unknown), "{act:?}");
}
