//! Pure decisions behind `Allocate` and `GetPreferredAllocation`.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use super::api::v1beta1::{
    CdiDevice, ContainerAllocateResponse, Device, ListAndWatchResponse, Mount, NumaNode,
    TopologyInfo,
};
use super::api::{HEALTHY, UNHEALTHY};
use super::model::{AdvertisedDevice, CdiKind, LinkKind, Placement, ResourceName, Topology};

/// The CDI annotation key prefix runtimes scan for (`cdi.k8s.io/<plugin>_<id>`).
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// Longest name part of an annotation key.
const MAX_ANNOTATION_NAME_LEN: usize = 63;
/// The environment variable the legacy NVIDIA runtime hook reads.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Names the shared replicas a container was given (comma-separated kubelet IDs), so the agent
/// can tell whose process on a shared GPU is whose: it reads this from the processes'
/// environment and judges each pod's idleness on its own processes.
pub const SHARE_ID_ENV: &str = "GPUPOOL_SHARE_ID";

/// One resource's devices as served to the kubelet, with a lookup index and
/// the `ListAndWatch` message prebuilt.
#[derive(Debug, Clone)]
pub struct ResourceView {
    /// The resource.
    pub resource: ResourceName,
    /// Increases on every change; lets the manager know when a list has been sent.
    pub generation: u64,
    /// The devices, in advertisement order.
    pub devices: Vec<AdvertisedDevice>,
    /// GPU links for preferred allocation.
    pub topology: Arc<Topology>,
    /// The `ListAndWatch` message for `devices`.
    pub list: ListAndWatchResponse,
    index: HashMap<String, usize>,
}

impl ResourceView {
    /// Builds the view and its wire form.
    pub fn new(
        resource: ResourceName,
        generation: u64,
        devices: Vec<AdvertisedDevice>,
        topology: Arc<Topology>,
    ) -> Self {
        let index = devices
            .iter()
            .enumerate()
            .map(|(i, d)| (d.id.as_str().to_owned(), i))
            .collect();
        let list = ListAndWatchResponse {
            devices: devices.iter().map(wire_device).collect(),
        };
        Self {
            resource,
            generation,
            devices,
            topology,
            list,
            index,
        }
    }

    /// The device with kubelet ID `id`.
    pub fn get(&self, id: &str) -> Option<&AdvertisedDevice> {
        self.index.get(id).and_then(|&i| self.devices.get(i))
    }
}

fn wire_device(device: &AdvertisedDevice) -> Device {
    Device {
        id: device.id.as_str().to_owned(),
        health: if device.health.is_healthy() {
            HEALTHY
        } else {
            UNHEALTHY
        }
        .to_owned(),
        // No topology (rather than an empty one) when the NUMA node is unknown.
        topology: device.numa_node.filter(|n| *n >= 0).map(|id| TopologyInfo {
            nodes: vec![NumaNode { id }],
        }),
    }
}

/// How `Allocate` describes devices to the container runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocateOptions {
    /// CDI kind of our spec, e.g. `gpupool.io/gpu`.
    pub cdi_kind: CdiKind,
    /// Plugin part of the CDI annotation key (`cdi.k8s.io/<plugin>_<resource>`).
    pub annotation_plugin: String,
}

impl Default for AllocateOptions {
    fn default() -> Self {
        Self {
            cdi_kind: CdiKind::default(),
            annotation_plugin: "gpupool".to_owned(),
        }
    }
}

/// Why a container's allocation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// IDs this resource does not advertise.
    #[error("unknown device IDs for {resource}: {}", ids.join(", "))]
    Unknown {
        /// The resource asked for.
        resource: String,
        /// The unknown IDs.
        ids: Vec<String>,
    },
    /// IDs of devices that are currently Unhealthy.
    #[error("unhealthy devices for {resource}: {}", ids.iter().map(|(id, why)| format!("{id} ({why})")).collect::<Vec<_>>().join(", "))]
    Unhealthy {
        /// The resource asked for.
        resource: String,
        /// The IDs and why each is unhealthy.
        ids: Vec<(String, String)>,
    },
    /// More than one replica of a time-sliced resource for one container, where the pool
    /// says such requests fail (they would get no more compute than one).
    #[error(
        "{resource} is shared ({mode}): {asked} replicas would give this container no more GPU than 1; request 1, or set the pool's sharing.{field}.failRequestsGreaterThanOne to false"
    )]
    SharedRequestTooLarge {
        /// The resource asked for.
        resource: String,
        /// How many replicas the container asked for.
        asked: usize,
        /// `time-sliced` or `MPS`.
        mode: &'static str,
        /// The pool's sharing field: `timeSlicing` or `mps`.
        field: &'static str,
    },
}

impl From<AllocateError> for tonic::Status {
    fn from(err: AllocateError) -> Self {
        match &err {
            AllocateError::Unknown { .. } => tonic::Status::invalid_argument(err.to_string()),
            AllocateError::Unhealthy { .. } => tonic::Status::failed_precondition(err.to_string()),
            AllocateError::SharedRequestTooLarge { .. } => {
                tonic::Status::invalid_argument(err.to_string())
            }
        }
    }
}

/// The CDI annotation key for a resource: `cdi.k8s.io/<plugin>_<resource>` with
/// `/` as `_`, shortened to the 63-character name limit when needed. One key per
/// resource keeps the keys of a container requesting several resources distinct.
pub fn annotation_key(plugin: &str, resource: &ResourceName) -> String {
    let mut name = format!("{plugin}_{}", resource.as_str().replace('/', "_"));
    if name.len() > MAX_ANNOTATION_NAME_LEN {
        name = format!("{plugin}_{}", resource.short_name());
        name.truncate(MAX_ANNOTATION_NAME_LEN);
        while name.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
            name.pop();
        }
    }
    format!("{CDI_ANNOTATION_PREFIX}{name}")
}

/// The response for one container asking for `ids`: CDI device names in
/// `cdi_devices`, the same names in the CDI annotation, and the device UUIDs in
/// `NVIDIA_VISIBLE_DEVICES` for runtimes without CDI.
pub fn container_response(
    view: &ResourceView,
    ids: &[String],
    options: &AllocateOptions,
) -> Result<ContainerAllocateResponse, AllocateError> {
    let mut unknown = Vec::new();
    let mut unhealthy = Vec::new();
    let mut devices = Vec::with_capacity(ids.len());
    for id in ids {
        match view.get(id) {
            None => unknown.push(id.clone()),
            Some(device) => match &device.health {
                super::model::Health::Healthy => devices.push(device),
                super::model::Health::Unhealthy { reason } => {
                    unhealthy.push((id.clone(), reason.clone()));
                }
            },
        }
    }
    if !unknown.is_empty() {
        return Err(AllocateError::Unknown {
            resource: view.resource.to_string(),
            ids: unknown,
        });
    }
    if !unhealthy.is_empty() {
        return Err(AllocateError::Unhealthy {
            resource: view.resource.to_string(),
            ids: unhealthy,
        });
    }
    let strict = devices.iter().find_map(|d| {
        d.replica
            .as_ref()
            .filter(|r| r.fail_requests_greater_than_one)
    });
    if let (true, Some(replica)) = (devices.len() > 1, strict) {
        let (mode, field) = match replica.client {
            Some(_) => ("MPS", "mps"),
            None => ("time-sliced", "timeSlicing"),
        };
        return Err(AllocateError::SharedRequestTooLarge {
            resource: view.resource.to_string(),
            asked: devices.len(),
            mode,
            field,
        });
    }
    let replicas: Vec<&str> = devices
        .iter()
        .filter(|d| d.replica.is_some())
        .map(|d| d.id.as_str())
        .collect();
    // Replicas of one device are that device, once.
    let mut seen = HashSet::new();
    devices.retain(|d| seen.insert(d.underlying().clone()));
    let names: Vec<String> = devices
        .iter()
        .map(|d| options.cdi_kind.qualify(&d.cdi_name))
        .collect();
    let annotations = [(
        annotation_key(&options.annotation_plugin, &view.resource),
        names.join(","),
    )]
    .into_iter()
    .collect();
    let mut envs: HashMap<String, String> = [(
        NVIDIA_VISIBLE_DEVICES.to_owned(),
        devices
            .iter()
            .map(|d| d.underlying().as_str())
            .collect::<Vec<_>>()
            .join(","),
    )]
    .into_iter()
    .collect();
    if !replicas.is_empty() {
        envs.insert(SHARE_ID_ENV.to_owned(), replicas.join(","));
    }
    // An MPS replica brings what reaches its GPU's server: the pipe directory, the shared
    // memory and the client limits.
    let mut mounts: Vec<Mount> = Vec::new();
    for client in devices
        .iter()
        .filter_map(|d| d.replica.as_ref()?.client.as_ref())
    {
        envs.extend(client.envs.clone());
        for m in &client.mounts {
            if !mounts.iter().any(|x| x.container_path == m.container_path) {
                mounts.push(Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    read_only: m.read_only,
                });
            }
        }
    }
    Ok(ContainerAllocateResponse {
        envs,
        mounts,
        devices: Vec::new(),
        annotations,
        cdi_devices: names.into_iter().map(|name| CdiDevice { name }).collect(),
    })
}

/// Shared replicas for one container (more than one is allowed when the pool does not fail
/// such requests), one at a time. Spread: from the device this container has the fewest of,
/// then the one with the most replicas still free (the least used by other pods), so the
/// container gets as many distinct GPUs as it can, on the quietest ones. Pack: from the device
/// this container already has, then the busiest one with a replica free, so that whole GPUs
/// stay free for pods that need them.
fn place_replicas(
    view: &ResourceView,
    chosen: &[String],
    candidates: &[&AdvertisedDevice],
    need: usize,
    pack: bool,
) -> Vec<String> {
    let mut mine: HashMap<String, usize> = HashMap::new();
    for id in chosen {
        if let Some(d) = view.get(id) {
            *mine.entry(d.underlying().to_string()).or_default() += 1;
        }
    }
    let mut free: HashMap<String, usize> = HashMap::new();
    for d in candidates {
        *free.entry(d.underlying().to_string()).or_default() += 1;
    }
    let mut left: Vec<&AdvertisedDevice> = candidates.to_vec();
    let mut picked = Vec::with_capacity(need);
    for _ in 0..need {
        let Some((i, _)) = left.iter().enumerate().min_by_key(|(_, d)| {
            let device = d.underlying().to_string();
            let mine = mine.get(&device).copied().unwrap_or(0) as i64;
            let free = free.get(&device).copied().unwrap_or(0) as i64;
            let (first, second) = if pack { (-mine, free) } else { (mine, -free) };
            (first, second, d.parent_gpu, d.id.clone())
        }) else {
            break;
        };
        let d = left.remove(i);
        let device = d.underlying().to_string();
        *mine.entry(device.clone()).or_default() += 1;
        if let Some(n) = free.get_mut(&device) {
            *n = n.saturating_sub(1);
        }
        picked.push(d.id.as_str().to_owned());
    }
    picked
}

/// Above this many candidate sets, preferred allocation is greedy instead of exhaustive.
const EXHAUSTIVE_LIMIT: u128 = 20_000;

/// Picks `size` devices from `available`, always including `must_include`,
/// preferring the most tightly connected set. Sets are compared by, in order:
/// MIG siblings on one GPU, total NVLink links between the GPUs, fewest NUMA
/// nodes spanned, pairs behind one PCIe switch, pairs on one NUMA node; ties go
/// to the lowest GPU indices. Unknown or unhealthy IDs in `available` are
/// skipped, never an error, so one lost GPU does not block the others.
pub fn preferred_allocation(
    view: &ResourceView,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::new();
    let mut seen = HashSet::new();
    for id in must_include {
        if seen.insert(id.as_str()) {
            chosen.push(id.clone());
        }
    }
    if chosen.len() >= size {
        return chosen;
    }
    let mut candidates: Vec<&AdvertisedDevice> = available
        .iter()
        .filter(|id| !seen.contains(id.as_str()))
        .filter_map(|id| view.get(id))
        .filter(|d| d.health.is_healthy())
        .collect();
    candidates.sort_by(|a, b| (a.parent_gpu, &a.id).cmp(&(b.parent_gpu, &b.id)));
    candidates.dedup_by(|a, b| a.id == b.id);
    let need = size - chosen.len();
    if let Some(replica) = candidates.iter().find_map(|d| d.replica.as_ref()) {
        let pack = replica.placement == Placement::Pack;
        chosen.extend(place_replicas(view, &chosen, &candidates, need, pack));
        return chosen;
    }
    if candidates.len() <= need {
        chosen.extend(candidates.iter().map(|d| d.id.as_str().to_owned()));
        return chosen;
    }
    let fixed: Vec<&AdvertisedDevice> = chosen.iter().filter_map(|id| view.get(id)).collect();
    let picked = if combinations(candidates.len(), need) <= EXHAUSTIVE_LIMIT {
        best_exhaustive(&view.topology, &fixed, &candidates, need)
    } else {
        best_greedy(&view.topology, &fixed, &candidates, need)
    };
    chosen.extend(
        picked
            .into_iter()
            .map(|i| candidates[i].id.as_str().to_owned()),
    );
    chosen
}

type Score = (u32, u32, Reverse<usize>, u32, u32);

fn score(topology: &Topology, devices: &[&AdvertisedDevice]) -> Score {
    let (mut siblings, mut nvlinks, mut pcie, mut numa_pairs) = (0u32, 0u32, 0u32, 0u32);
    for (i, a) in devices.iter().enumerate() {
        for b in &devices[i + 1..] {
            match topology.link(a.parent_gpu, b.parent_gpu) {
                None => siblings += 1,
                Some(LinkKind::NvLink(n)) => nvlinks += n,
                Some(LinkKind::SamePcieSwitch) => pcie += 1,
                Some(LinkKind::SameNuma) => numa_pairs += 1,
                Some(LinkKind::Cross) => {}
            }
        }
    }
    let numa_nodes: BTreeSet<i64> = devices.iter().filter_map(|d| d.numa_node).collect();
    (
        siblings,
        nvlinks,
        Reverse(numa_nodes.len()),
        pcie,
        numa_pairs,
    )
}

fn combinations(n: usize, k: usize) -> u128 {
    let k = k.min(n - k);
    let mut acc: u128 = 1;
    for i in 0..k {
        acc = acc.saturating_mul((n - i) as u128) / (i as u128 + 1);
        if acc > EXHAUSTIVE_LIMIT {
            return acc;
        }
    }
    acc
}

fn best_exhaustive(
    topology: &Topology,
    fixed: &[&AdvertisedDevice],
    candidates: &[&AdvertisedDevice],
    need: usize,
) -> Vec<usize> {
    let mut pick: Vec<usize> = (0..need).collect();
    let mut best: Option<(Score, Vec<usize>)> = None;
    let mut set: Vec<&AdvertisedDevice> = Vec::with_capacity(fixed.len() + need);
    loop {
        set.clear();
        set.extend_from_slice(fixed);
        set.extend(pick.iter().map(|&i| candidates[i]));
        let s = score(topology, &set);
        // Strictly better only, so the first (lowest-index) set wins ties.
        if best.as_ref().is_none_or(|(b, _)| s > *b) {
            best = Some((s, pick.clone()));
        }
        // Next combination in lexicographic order.
        let n = candidates.len();
        let Some(pos) = (0..need).rev().find(|&i| pick[i] != i + n - need) else {
            break;
        };
        pick[pos] += 1;
        for j in pos + 1..need {
            pick[j] = pick[j - 1] + 1;
        }
    }
    best.map(|(_, p)| p).unwrap_or_default()
}

fn best_greedy(
    topology: &Topology,
    fixed: &[&AdvertisedDevice],
    candidates: &[&AdvertisedDevice],
    need: usize,
) -> Vec<usize> {
    let mut set: Vec<&AdvertisedDevice> = fixed.to_vec();
    let mut picked: Vec<usize> = Vec::with_capacity(need);
    while picked.len() < need {
        let mut best: Option<(Score, usize)> = None;
        for (i, c) in candidates.iter().enumerate() {
            if picked.contains(&i) {
                continue;
            }
            set.push(c);
            let s = score(topology, &set);
            set.pop();
            if best.as_ref().is_none_or(|(b, _)| s > *b) {
                best = Some((s, i));
            }
        }
        let Some((_, i)) = best else { break };
        picked.push(i);
        set.push(candidates[i]);
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::model::{DeviceId, Health};

    fn dev(id: &str, gpu: u32, numa: Option<i64>, cdi: &str) -> AdvertisedDevice {
        AdvertisedDevice {
            id: id.parse::<DeviceId>().unwrap(),
            cdi_name: cdi.to_owned(),
            health: Health::Healthy,
            numa_node: numa,
            parent_gpu: gpu,
            replica: None,
        }
    }

    fn gpus_view(topology: Topology) -> ResourceView {
        ResourceView::new(
            "nvidia.com/gpu".parse().unwrap(),
            1,
            (0..4)
                .map(|i| {
                    dev(
                        &format!("GPU-{i}"),
                        i,
                        Some(i64::from(i / 2)),
                        &i.to_string(),
                    )
                })
                .collect(),
            Arc::new(topology),
        )
    }

    fn s(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    fn shared_view(fail_greater_than_one: bool) -> ResourceView {
        shared_view_with(crate::plugin::sharing::Share {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: fail_greater_than_one,
            gpus: None,
            resources: None,
            clients: Default::default(),
            placement: Placement::Spread,
        })
    }

    fn shared_view_with(rule: crate::plugin::sharing::Share) -> ResourceView {
        let resources = std::collections::BTreeMap::from([(
            "nvidia.com/gpu".parse().unwrap(),
            vec![dev("GPU-0", 0, None, "0"), dev("GPU-1", 1, None, "1")],
        )]);
        let shared = crate::plugin::sharing::share(resources, &rule).unwrap();
        let (name, devices) = shared.into_iter().next().unwrap();
        ResourceView::new(name, 1, devices, Arc::default())
    }

    #[test]
    fn packed_replicas_fill_the_busiest_device_first() {
        let view = shared_view_with(crate::plugin::sharing::Share {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: false,
            gpus: None,
            resources: None,
            clients: Default::default(),
            placement: Placement::Pack,
        });
        // GPU-0 has one replica free (three are in use), GPU-1 all four.
        let available = s(&["GPU-0::3", "GPU-1::0", "GPU-1::1", "GPU-1::2", "GPU-1::3"]);
        assert_eq!(
            preferred_allocation(&view, &available, &[], 1),
            ["GPU-0::3"],
            "the busiest device first, keeping GPU-1 free for a whole-GPU tenant"
        );
        assert_eq!(
            preferred_allocation(&view, &available, &[], 2),
            ["GPU-0::3", "GPU-1::0"]
        );
    }

    #[test]
    fn an_mps_replica_brings_its_servers_pipe_shared_memory_and_limits() {
        use crate::plugin::model::{HostMount, ShareClient};
        let client = Arc::new(ShareClient {
            envs: std::collections::BTreeMap::from([
                ("CUDA_MPS_PIPE_DIRECTORY".into(), "/tmp/nvidia-mps".into()),
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), "25".into()),
            ]),
            mounts: vec![
                HostMount {
                    host_path: "/run/gpupool/mps/GPU-1/pipe".into(),
                    container_path: "/tmp/nvidia-mps".into(),
                    read_only: false,
                },
                HostMount {
                    host_path: "/run/gpupool/mps/GPU-1/shm".into(),
                    container_path: "/dev/shm".into(),
                    read_only: false,
                },
            ],
        });
        let view = shared_view_with(crate::plugin::sharing::Share {
            replicas: 4,
            rename_by_default: false,
            fail_requests_greater_than_one: true,
            gpus: None,
            resources: None,
            clients: std::collections::BTreeMap::from([(1, client)]),
            placement: Placement::Spread,
        });
        let r = container_response(&view, &s(&["GPU-1::2"]), &AllocateOptions::default()).unwrap();
        assert_eq!(r.envs["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/nvidia-mps");
        assert_eq!(r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        assert_eq!(r.envs[NVIDIA_VISIBLE_DEVICES], "GPU-1");
        let mounts: Vec<(&str, &str)> = r
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
            .collect();
        assert_eq!(
            mounts,
            [
                ("/run/gpupool/mps/GPU-1/pipe", "/tmp/nvidia-mps"),
                ("/run/gpupool/mps/GPU-1/shm", "/dev/shm")
            ]
        );
        let err = container_response(&view, &s(&["GPU-1::0", "GPU-1::1"]), &Default::default())
            .unwrap_err();
        assert!(
            err.to_string().contains("shared (MPS)")
                && err
                    .to_string()
                    .contains("sharing.mps.failRequestsGreaterThanOne"),
            "{err}"
        );
        // GPU 0 has no server here: whole, and nothing MPS about it.
        let r = container_response(&view, &s(&["GPU-0"]), &AllocateOptions::default()).unwrap();
        assert!(r.mounts.is_empty() && !r.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"));
    }

    #[test]
    fn replicas_are_preferred_on_distinct_and_quiet_devices() {
        let view = shared_view(false);
        // GPU-0 has one replica free (three are in use), GPU-1 all four.
        let available = s(&["GPU-0::3", "GPU-1::0", "GPU-1::1", "GPU-1::2", "GPU-1::3"]);
        assert_eq!(
            preferred_allocation(&view, &available, &[], 1),
            ["GPU-1::0"],
            "the quietest device first"
        );
        assert_eq!(
            preferred_allocation(&view, &available, &[], 2),
            ["GPU-1::0", "GPU-0::3"],
            "then another device"
        );
        assert_eq!(
            preferred_allocation(&view, &available, &s(&["GPU-1::2"]), 2),
            ["GPU-1::2", "GPU-0::3"],
            "must-include counts as this container's"
        );
        assert_eq!(preferred_allocation(&view, &available, &[], 3).len(), 3);
    }

    #[test]
    fn a_replica_is_allocated_as_its_device() {
        let view = shared_view(true);
        let r = container_response(&view, &s(&["GPU-1::2"]), &AllocateOptions::default()).unwrap();
        let names: Vec<&str> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpupool.io/gpu=1"]);
        assert_eq!(r.envs[NVIDIA_VISIBLE_DEVICES], "GPU-1");
        assert_eq!(
            r.envs[SHARE_ID_ENV], "GPU-1::2",
            "the share, for per-share idleness"
        );
        let whole = container_response(
            &gpus_view(Topology::new()),
            &s(&["GPU-0"]),
            &AllocateOptions::default(),
        )
        .unwrap();
        assert!(!whole.envs.contains_key(SHARE_ID_ENV));
    }

    #[test]
    fn more_than_one_replica_is_refused_or_given_each_device_once() {
        let err = container_response(
            &shared_view(true),
            &s(&["GPU-0::0", "GPU-0::1"]),
            &AllocateOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            err,
            AllocateError::SharedRequestTooLarge {
                resource: "nvidia.com/gpu".into(),
                asked: 2,
                mode: "time-sliced",
                field: "timeSlicing",
            }
        );
        assert!(
            err.to_string()
                .contains("sharing.timeSlicing.failRequestsGreaterThanOne"),
            "{err}"
        );
        // Allowed: two replicas of one GPU are that GPU once; of two GPUs, both.
        let view = shared_view(false);
        let r = container_response(
            &view,
            &s(&["GPU-0::0", "GPU-0::1"]),
            &AllocateOptions::default(),
        )
        .unwrap();
        assert_eq!(r.cdi_devices.len(), 1);
        assert_eq!(r.envs[NVIDIA_VISIBLE_DEVICES], "GPU-0");
        let r = container_response(
            &view,
            &s(&["GPU-0::0", "GPU-1::3"]),
            &AllocateOptions::default(),
        )
        .unwrap();
        assert_eq!(r.envs[NVIDIA_VISIBLE_DEVICES], "GPU-0,GPU-1");
    }

    #[test]
    fn allocate_returns_cdi_names_annotation_and_env() {
        let view = gpus_view(Topology::new());
        let resp = container_response(&view, &s(&["GPU-2", "GPU-0"]), &AllocateOptions::default())
            .unwrap();
        let names: Vec<_> = resp.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpupool.io/gpu=2", "gpupool.io/gpu=0"]);
        assert_eq!(
            resp.annotations
                .get("cdi.k8s.io/gpupool_nvidia.com_gpu")
                .map(String::as_str),
            Some("gpupool.io/gpu=2,gpupool.io/gpu=0")
        );
        assert_eq!(resp.annotations.len(), 1);
        assert_eq!(
            resp.envs.get(NVIDIA_VISIBLE_DEVICES).map(String::as_str),
            Some("GPU-2,GPU-0")
        );
    }

    #[test]
    fn allocate_rejects_unknown_then_unhealthy() {
        let mut view = gpus_view(Topology::new());
        view.devices[1].health = Health::Unhealthy {
            reason: "critical Xid 79".into(),
        };
        let view = ResourceView::new(
            view.resource.clone(),
            2,
            view.devices.clone(),
            view.topology.clone(),
        );
        let opts = AllocateOptions::default();
        let err = container_response(&view, &s(&["GPU-1", "GPU-9"]), &opts).unwrap_err();
        assert_eq!(
            err,
            AllocateError::Unknown {
                resource: "nvidia.com/gpu".into(),
                ids: s(&["GPU-9"])
            }
        );
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::InvalidArgument
        );
        let err = container_response(&view, &s(&["GPU-0", "GPU-1"]), &opts).unwrap_err();
        assert!(err.to_string().contains("GPU-1 (critical Xid 79)"), "{err}");
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::FailedPrecondition
        );
        // The healthy one still allocates.
        assert!(container_response(&view, &s(&["GPU-0"]), &opts).is_ok());
    }

    #[test]
    fn annotation_keys_follow_cdi_rules() {
        let long: ResourceName = format!("nvidia.com/mig-{}", "x".repeat(55))
            .parse()
            .unwrap();
        let cases = [
            (
                "nvidia.com/mig-1g.10gb".parse().unwrap(),
                "cdi.k8s.io/gpupool_nvidia.com_mig-1g.10gb",
            ),
            (
                long,
                "cdi.k8s.io/gpupool_mig-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
            ),
        ];
        for (resource, want) in cases {
            let key = annotation_key("gpupool", &resource);
            assert_eq!(key, want);
            let name = key.trim_start_matches(CDI_ANNOTATION_PREFIX);
            assert!(name.len() <= 63);
            assert!(name.ends_with(|c: char| c.is_ascii_alphanumeric()));
        }
    }

    fn nvlink_fixture() -> Topology {
        // 0<->2 and 1<->3 NVLink-bridged; 0,1 and 2,3 share a PCIe switch.
        Topology::new()
            .with_link(0, 2, LinkKind::NvLink(4))
            .with_link(1, 3, LinkKind::NvLink(4))
            .with_link(0, 1, LinkKind::SamePcieSwitch)
            .with_link(2, 3, LinkKind::SamePcieSwitch)
    }

    #[test]
    fn preferred_allocation_table() {
        let all = s(&["GPU-0", "GPU-1", "GPU-2", "GPU-3"]);
        /// Name, topology, available, must-include, size, expected.
        type Case = (
            &'static str,
            Topology,
            Vec<String>,
            Vec<String>,
            usize,
            Vec<String>,
        );
        let cases: Vec<Case> = vec![
            (
                "NVLink pair first",
                nvlink_fixture(),
                all.clone(),
                vec![],
                2,
                s(&["GPU-0", "GPU-2"]),
            ),
            (
                "must-include pulls its NVLink peer",
                nvlink_fixture(),
                all.clone(),
                s(&["GPU-3"]),
                2,
                s(&["GPU-3", "GPU-1"]),
            ),
            (
                "PCIe switch breaks a NUMA tie",
                Topology::new().with_link(2, 3, LinkKind::SamePcieSwitch),
                all.clone(),
                vec![],
                2,
                s(&["GPU-2", "GPU-3"]),
            ),
            (
                "same NUMA when no links",
                Topology::new(),
                s(&["GPU-1", "GPU-2", "GPU-3"]),
                vec![],
                2,
                s(&["GPU-2", "GPU-3"]),
            ),
            (
                "unknown IDs skipped",
                nvlink_fixture(),
                s(&["GPU-7", "GPU-1", "GPU-3"]),
                vec![],
                2,
                s(&["GPU-1", "GPU-3"]),
            ),
            (
                "short of candidates returns what exists",
                nvlink_fixture(),
                s(&["GPU-1", "GPU-lost"]),
                vec![],
                2,
                s(&["GPU-1"]),
            ),
            (
                "must-include alone fills the size",
                nvlink_fixture(),
                all.clone(),
                s(&["GPU-1", "GPU-2"]),
                2,
                s(&["GPU-1", "GPU-2"]),
            ),
        ];
        for (name, topology, available, must, size, want) in cases {
            let view = gpus_view(topology);
            assert_eq!(
                preferred_allocation(&view, &available, &must, size),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn preferred_allocation_skips_unhealthy() {
        let mut devices = gpus_view(nvlink_fixture()).devices;
        devices[2].health = Health::Unhealthy {
            reason: "GPU lost from the bus".into(),
        };
        let view = ResourceView::new(
            "nvidia.com/gpu".parse().unwrap(),
            1,
            devices,
            Arc::new(nvlink_fixture()),
        );
        let got = preferred_allocation(&view, &s(&["GPU-0", "GPU-1", "GPU-2", "GPU-3"]), &[], 2);
        assert_eq!(got, s(&["GPU-1", "GPU-3"]));
    }

    #[test]
    fn greedy_matches_on_large_sets() {
        // 32 GPUs choose 16 is far above the exhaustive limit.
        let mut topology = Topology::new();
        for i in (0..32).step_by(2) {
            topology.set_link(i, i + 1, LinkKind::NvLink(2));
        }
        let devices = (0..32)
            .map(|i| dev(&format!("GPU-{i}"), i, Some(i64::from(i / 16)), "x"))
            .collect();
        let view = ResourceView::new(
            "nvidia.com/gpu".parse().unwrap(),
            1,
            devices,
            Arc::new(topology),
        );
        let available: Vec<String> = (0..32).map(|i| format!("GPU-{i}")).collect();
        let got = preferred_allocation(&view, &available, &[], 16);
        assert_eq!(got.len(), 16);
        // Greedy keeps NVLink pairs together and stays on one NUMA node.
        let want: Vec<String> = (0..16).map(|i| format!("GPU-{i}")).collect();
        let mut sorted = got.clone();
        sorted.sort_by_key(|id| id.trim_start_matches("GPU-").parse::<u32>().unwrap());
        assert_eq!(sorted, want);
    }

    #[test]
    fn wire_devices_carry_health_and_numa() {
        let mut d = dev("GPU-0", 0, Some(1), "0");
        d.health = Health::Unhealthy { reason: "x".into() };
        let view = ResourceView::new(
            "nvidia.com/gpu".parse().unwrap(),
            1,
            vec![d, dev("GPU-1", 1, None, "1")],
            Arc::default(),
        );
        assert_eq!(view.list.devices[0].health, UNHEALTHY);
        assert_eq!(
            view.list.devices[0]
                .topology
                .as_ref()
                .map(|t| t.nodes[0].id),
            Some(1)
        );
        assert_eq!(view.list.devices[1].health, HEALTHY);
        assert!(view.list.devices[1].topology.is_none());
    }
}
