//! What the operator's caches keep of each object (pure). At 5,000 nodes the caches are most
//! of the operator's memory, so each watched kind is cut, as it arrives, to the fields some
//! decision reads; everything else is dropped before it reaches a store.
//!
//! - **Pods** ([`CachedPod`]): only pods that ask for GPUs are kept at all ([`keep_pod`]):
//!   every decision about pods (drain, reclaim, pending demand, Job siblings, warnings)
//!   concerns GPU pods, and most pods of a GPU cluster hold none. Of those, [`trim_pod`] keeps
//!   identity, labels, the `gpupool.io/` annotations, owners, node, containers' GPU requests,
//!   priority class, phase and start time; the scheduling constraints only while the pod is
//!   unbound. A cached pod is stored flat, not as a `Pod` (whose empty spec, status and
//!   container structs alone take about 4.5 KiB), and is unfolded with [`CachedPod::to_pod`]
//!   only for the pods a decision looks at.
//! - **Nodes** ([`CachedNode`]): name, labels, taints and the Ready condition's status, stored
//!   flat.
//! - **GpuNodes** ([`trim_gpunode`]): the agent's status less what only the node itself uses:
//!   PCI bus IDs, MIG device UUIDs and CDI names, a healthy GPU's UUID (the pool names a GPU
//!   by UUID only when it is unhealthy), passed checks (the pool reads failed ones), the MIG
//!   devices no pod holds, and the healthy GPUs nothing holds: the operator reads a GPU or MIG
//!   device only for its holders (reclaim, drain, GPU-time accounting) or, unhealthy, to name
//!   it; GPU counts come from the agent's totals; the holders' container names, the CDI
//!   spec's path, the CUDA version and the agent's conditions but a CDI spec that is not
//!   ready are not read either. GPU models, MIG profiles and holders' namespaces are
//!   interned ([`crate::intern`]). Of the metadata, the UID,
//!   resource version and owners' names go (owners are compared by UID), and the usual
//!   labels, the pool label alone, are folded into an empty map ([`gpunode_pool`] reads it).
//!   The spec is kept whole: it is what the operator compares its desired state with. Its MIG
//!   layout, most of a spec's bytes, and its driver and CDI policies are shared
//!   ([`SharedSpecs`]): nodes of one kind carry equal layouts, a pool's nodes equal policies,
//!   and the cache keeps one copy of each.
//!
//! The operator never writes an object back from these copies: its writes are server-side
//! applies of its own fields and merge patches of annotations.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, Weak};

use gpupool_crds::GpuNode;
use gpupool_crds::labels::POOL_LABEL;
use gpupool_crds::node::{CDI_SPEC_READY, Health, NodeMigSpec};
use gpupool_crds::policy::{CdiPolicy, DriverPolicy};
use k8s_openapi::api::core::v1::{
    Affinity, Container, Node, Pod, PodSpec, PodStatus, ResourceRequirements, Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::ObjectMeta;
use kube::runtime::watcher;
use serde::Deserialize;

use crate::intern::intern;
use crate::uid::Uid;

/// Whether a resource name is a GPU resource gpupool serves: whole GPUs, MIG devices, and
/// their shared replicas under `renameByDefault` (`nvidia.com/gpu.shared`,
/// `nvidia.com/mig-1g.10gb.shared`).
pub fn is_gpu_resource(name: &str) -> bool {
    name == "nvidia.com/gpu"
        || name == "nvidia.com/gpu.shared"
        || name.starts_with("nvidia.com/mig-")
}

/// Annotations on pods the operator reads (reclaim opt-out, its own warnings, dry runs).
const POD_ANNOTATION_PREFIX: &str = "gpupool.io/";

/// Whether a watch event reaches the pod cache: GPU pods, and every deletion (deleting what the
/// cache never held is a no-op). A pod's container resources cannot change to or from a GPU
/// request, so a pod is either always kept or never.
pub fn keep_pod(event: &watcher::Event<CachedPod>) -> bool {
    match event {
        watcher::Event::Apply(p) | watcher::Event::InitApply(p) => p.requests_gpu(),
        watcher::Event::Delete(_) | watcher::Event::Init | watcher::Event::InitDone => true,
    }
}

/// Cuts a pod to the fields the operator's decisions read (see the module docs).
pub fn trim_pod(pod: &mut Pod) {
    let meta = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        creation_timestamp: meta.creation_timestamp,
        deletion_timestamp: meta.deletion_timestamp,
        labels: meta.labels,
        annotations: meta
            .annotations
            .map(|a| {
                a.into_iter()
                    .filter(|(k, _)| k.starts_with(POD_ANNOTATION_PREFIX))
                    .collect::<std::collections::BTreeMap<_, _>>()
            })
            .filter(|a| !a.is_empty()),
        owner_references: meta.owner_references,
        ..ObjectMeta::default()
    };
    if let Some(spec) = pod.spec.take() {
        let bound = spec.node_name.is_some();
        pod.spec = Some(PodSpec {
            containers: spec
                .containers
                .into_iter()
                .map(|c| Container {
                    name: c.name,
                    resources: c.resources.map(gpu_resources_only),
                    ..Container::default()
                })
                .collect(),
            node_name: spec.node_name,
            priority_class_name: spec.priority_class_name,
            // Read only for pods still waiting for a node (pending demand).
            node_selector: spec.node_selector.filter(|_| !bound),
            affinity: spec.affinity.filter(|_| !bound),
            tolerations: spec.tolerations.filter(|_| !bound),
            ..PodSpec::default()
        });
    }
    if let Some(status) = pod.status.take() {
        pod.status = Some(PodStatus {
            phase: status.phase,
            start_time: status.start_time,
            ..PodStatus::default()
        });
    }
}

/// A container's resources cut to the GPU ones (the only ones a decision reads).
fn gpu_resources_only(r: ResourceRequirements) -> ResourceRequirements {
    let gpu = |m: Option<BTreeMap<String, Quantity>>| {
        m.map(|m| {
            m.into_iter()
                .filter(|(k, _)| is_gpu_resource(k))
                .collect::<BTreeMap<_, _>>()
        })
        .filter(|m| !m.is_empty())
    };
    ResourceRequirements {
        limits: gpu(r.limits),
        requests: gpu(r.requests),
        claims: None,
    }
}

/// How the operator names a pod in its status, Events and logs: `namespace/name`.
pub fn pod_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// Whether an owner reference's API version and kind name a Job (of any `batch/` version).
pub fn is_job_owner(api_version: &str, kind: &str) -> bool {
    kind == "Job" && api_version.starts_with("batch/")
}

/// What the operator keeps of a pod: [`trim_pod`]'s cut, stored flat. The pod watch
/// deserializes into it (a `Pod` first, folded at once, see [`WatchedPod`]), so a pod costs
/// the cache a few strings: its metadata is a handful of fields, not an `ObjectMeta` (344
/// bytes inline however little it holds), the labels, annotations and GPU requests are packed
/// into one allocation each ([`PackedMap`]), and what only an unbound pod keeps sits behind one
/// optional box.
#[derive(Clone, Debug, Deserialize)]
#[serde(from = "Pod")]
pub struct CachedPod {
    meta: PodMeta,
    labels: Option<PackedMap>,
    spec: Option<Box<CachedSpec>>,
    phase: Option<Phase>,
    start_time: Option<Time>,
    has_status: bool,
}

/// A pod's phase: the five the API defines without an allocation, anything else as sent.
#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
    Other(Box<str>),
}

impl From<String> for Phase {
    fn from(phase: String) -> Self {
        match phase.as_str() {
            "Pending" => Phase::Pending,
            "Running" => Phase::Running,
            "Succeeded" => Phase::Succeeded,
            "Failed" => Phase::Failed,
            "Unknown" => Phase::Unknown,
            _ => Phase::Other(phase.into_boxed_str()),
        }
    }
}

impl Phase {
    fn as_str(&self) -> &str {
        match self {
            Phase::Pending => "Pending",
            Phase::Running => "Running",
            Phase::Succeeded => "Succeeded",
            Phase::Failed => "Failed",
            Phase::Unknown => "Unknown",
            Phase::Other(p) => p,
        }
    }
}

/// The metadata [`trim_pod`] keeps, its labels aside: no resource version (the watch has read
/// it, and no decision does).
#[derive(Clone, Debug, PartialEq)]
struct PodMeta {
    name: Option<Box<str>>,
    /// Interned: a cluster's pods share a few namespaces.
    namespace: Option<Arc<str>>,
    uid: Option<Uid>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
    /// The `gpupool.io/` annotations.
    annotations: Option<PackedMap>,
    owner_references: Option<Box<[CachedOwner]>>,
}

/// An owner reference as a cached pod keeps it: the API version and kind interned (nearly
/// every owner is a `batch/v1` Job or an `apps/v1` ReplicaSet), the UID as a number.
#[derive(Clone, Debug, PartialEq)]
struct CachedOwner {
    api_version: Arc<str>,
    kind: Arc<str>,
    name: Box<str>,
    uid: Uid,
    controller: Option<bool>,
    block_owner_deletion: Option<bool>,
}

impl From<OwnerReference> for CachedOwner {
    fn from(o: OwnerReference) -> Self {
        CachedOwner {
            api_version: intern(&o.api_version),
            kind: intern(&o.kind),
            name: o.name.into_boxed_str(),
            uid: Uid::new(&o.uid),
            controller: o.controller,
            block_owner_deletion: o.block_owner_deletion,
        }
    }
}

impl CachedOwner {
    fn to_owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: self.api_version.to_string(),
            kind: self.kind.to_string(),
            name: self.name.to_string(),
            uid: self.uid.to_string(),
            controller: self.controller,
            block_owner_deletion: self.block_owner_deletion,
        }
    }
}

impl From<ObjectMeta> for PodMeta {
    fn from(meta: ObjectMeta) -> Self {
        PodMeta {
            name: meta.name.map(String::into_boxed_str),
            namespace: meta.namespace.as_deref().map(intern),
            uid: meta.uid.as_deref().map(Uid::new),
            creation_timestamp: meta.creation_timestamp,
            deletion_timestamp: meta.deletion_timestamp,
            annotations: meta
                .annotations
                .map(|a| PackedMap::pack(a.iter().map(|(k, v)| (k.as_str(), v.as_str())))),
            owner_references: meta
                .owner_references
                .map(|o| o.into_iter().map(CachedOwner::from).collect()),
        }
    }
}

impl PodMeta {
    fn to_meta(&self) -> ObjectMeta {
        ObjectMeta {
            name: self.name.as_deref().map(str::to_string),
            namespace: self.namespace.as_deref().map(str::to_string),
            uid: self.uid.as_ref().map(Uid::to_string),
            creation_timestamp: self.creation_timestamp.clone(),
            deletion_timestamp: self.deletion_timestamp.clone(),
            annotations: self.annotations.as_ref().map(|a| a.to_map(|v| v)),
            owner_references: self
                .owner_references
                .as_deref()
                .map(|o| o.iter().map(CachedOwner::to_owner).collect()),
            ..ObjectMeta::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
struct CachedSpec {
    /// Interned, as is the priority class: a node's pods share its name.
    node_name: Option<Arc<str>>,
    priority_class_name: Option<Arc<str>>,
    containers: Box<[CachedContainer]>,
    /// The scheduling constraints, kept only while the pod waits for a node.
    unbound: Option<Box<Unbound>>,
}

/// A container's GPU limits or requests, interned.
type Quantities = PackedMap<Arc<str>>;

/// A container's name and GPU requests and limits, all interned: a cluster's GPU containers
/// ask for a few distinct sets of GPUs, and the API server copies limits into requests.
#[derive(Clone, Debug, PartialEq)]
struct CachedContainer {
    name: Arc<str>,
    /// `(limits, requests)`, each of GPU resources only; `None` where the container had no
    /// resources at all.
    resources: Option<(Option<Quantities>, Option<Quantities>)>,
}

#[derive(Clone, Debug, PartialEq)]
struct Unbound {
    node_selector: Option<BTreeMap<String, String>>,
    affinity: Option<Affinity>,
    tolerations: Option<Vec<Toleration>>,
}

/// A small map of strings in one allocation: `key NUL value NUL key NUL value NUL ...` in key
/// order. For labels and resource quantities, which the API server never lets hold a NUL; a
/// `BTreeMap<String, String>` of a pod's few labels costs a 500-byte node and two allocations
/// an entry.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedMap<S = Box<str>>(S);

const SEP: char = '\0';

/// `entries` laid out as a [`PackedMap`] holds them.
fn packed<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut s = String::new();
    for (k, v) in entries {
        s.push_str(k);
        s.push(SEP);
        s.push_str(v);
        s.push(SEP);
    }
    s
}

impl PackedMap {
    fn pack<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        PackedMap(packed(entries).into_boxed_str())
    }
}

impl PackedMap<Arc<str>> {
    /// The shared copy ([`crate::intern`]) of the map of `entries`.
    fn interned<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        PackedMap(intern(&packed(entries)))
    }
}

impl<S: std::ops::Deref<Target = str>> PackedMap<S> {
    /// The entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut parts = self.0.split_terminator(SEP);
        std::iter::from_fn(move || Some((parts.next()?, parts.next()?)))
    }

    fn to_map<V>(&self, value: impl Fn(String) -> V) -> BTreeMap<String, V> {
        self.iter()
            .map(|(k, v)| (k.to_string(), value(v.to_string())))
            .collect()
    }
}

impl From<Pod> for CachedPod {
    fn from(mut pod: Pod) -> Self {
        trim_pod(&mut pod);
        let labels = pod
            .metadata
            .labels
            .take()
            .map(|l| PackedMap::pack(l.iter().map(|(k, v)| (k.as_str(), v.as_str()))));
        let pack_quantities = |m: Option<BTreeMap<String, Quantity>>| {
            m.map(|m| PackedMap::interned(m.iter().map(|(k, v)| (k.as_str(), v.0.as_str()))))
        };
        let spec = pod.spec.map(|s| {
            let unbound =
                (s.node_selector.is_some() || s.affinity.is_some() || s.tolerations.is_some())
                    .then(|| {
                        Box::new(Unbound {
                            node_selector: s.node_selector,
                            affinity: s.affinity,
                            tolerations: s.tolerations,
                        })
                    });
            Box::new(CachedSpec {
                node_name: s.node_name.as_deref().map(intern),
                priority_class_name: s.priority_class_name.as_deref().map(intern),
                containers: s
                    .containers
                    .into_iter()
                    .map(|c| CachedContainer {
                        name: intern(&c.name),
                        resources: c
                            .resources
                            .map(|r| (pack_quantities(r.limits), pack_quantities(r.requests))),
                    })
                    .collect(),
                unbound,
            })
        });
        let has_status = pod.status.is_some();
        let status = pod.status.unwrap_or_default();
        CachedPod {
            meta: pod.metadata.into(),
            labels,
            spec,
            phase: status.phase.map(Phase::from),
            start_time: status.start_time,
            has_status,
        }
    }
}

impl CachedPod {
    /// The pod as [`trim_pod`] leaves it, for the decisions that read pods.
    pub fn to_pod(&self) -> Pod {
        let quantities = |m: &Option<Quantities>| m.as_ref().map(|m| m.to_map(Quantity));
        let mut metadata = self.meta.to_meta();
        metadata.labels = self.labels.as_ref().map(|l| l.to_map(|v| v));
        Pod {
            metadata,
            spec: self.spec.as_deref().map(|s| {
                let unbound = s.unbound.as_deref();
                PodSpec {
                    node_name: s.node_name.as_deref().map(str::to_string),
                    priority_class_name: s.priority_class_name.as_deref().map(str::to_string),
                    containers: s
                        .containers
                        .iter()
                        .map(|c| Container {
                            name: c.name.to_string(),
                            resources: c.resources.as_ref().map(|(limits, requests)| {
                                ResourceRequirements {
                                    limits: quantities(limits),
                                    requests: quantities(requests),
                                    claims: None,
                                }
                            }),
                            ..Container::default()
                        })
                        .collect(),
                    node_selector: unbound.and_then(|u| u.node_selector.clone()),
                    affinity: unbound.and_then(|u| u.affinity.clone()),
                    tolerations: unbound.and_then(|u| u.tolerations.clone()),
                    ..PodSpec::default()
                }
            }),
            status: self.has_status.then(|| PodStatus {
                phase: self.phase().map(str::to_string),
                start_time: self.start_time.clone(),
                ..PodStatus::default()
            }),
        }
    }

    /// The pod's name.
    pub fn pod_name(&self) -> &str {
        self.meta.name.as_deref().unwrap_or_default()
    }

    /// The pod's namespace.
    pub fn pod_namespace(&self) -> &str {
        self.meta.namespace.as_deref().unwrap_or_default()
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        pod_key(self.pod_namespace(), self.pod_name())
    }

    /// Whether the pod is being deleted.
    pub fn is_deleting(&self) -> bool {
        self.meta.deletion_timestamp.is_some()
    }

    /// The UID of the Job that owns the pod, if a Job does.
    pub fn job_uid(&self) -> Option<&Uid> {
        self.meta
            .owner_references
            .iter()
            .flatten()
            .find(|o| is_job_owner(&o.api_version, &o.kind))
            .map(|o| &o.uid)
    }

    /// Whether the pod carries the (`gpupool.io/`) annotation `key`.
    pub fn has_annotation(&self, key: &str) -> bool {
        self.meta
            .annotations
            .as_ref()
            .is_some_and(|a| a.iter().any(|(k, _)| k == key))
    }

    /// The node the pod is bound to.
    pub fn node_name(&self) -> Option<&str> {
        self.spec.as_deref().and_then(|s| s.node_name.as_deref())
    }

    /// The pod's phase.
    pub fn phase(&self) -> Option<&str> {
        self.phase.as_ref().map(Phase::as_str)
    }

    /// Whether a container asks for GPUs ([`crate::demand::requests_gpu`] of the pod, read from
    /// the packed requests without unpacking them).
    pub fn requests_gpu(&self) -> bool {
        self.spec.as_deref().is_some_and(|s| {
            s.containers
                .iter()
                .filter_map(|c| c.resources.as_ref())
                .flat_map(|(limits, requests)| limits.iter().chain(requests))
                .flat_map(PackedMap::iter)
                .any(|(k, _)| is_gpu_resource(k))
        })
    }
}

/// The cache finds a pod by its namespace and name; a cached pod is no `Resource`, since it
/// holds no `ObjectMeta`.
impl kube::runtime::reflector::Lookup for CachedPod {
    type DynamicType = ();

    fn kind(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
    }
    fn name(&self) -> Option<Cow<'_, str>> {
        self.meta.name.as_deref().map(Cow::Borrowed)
    }
    fn namespace(&self) -> Option<Cow<'_, str>> {
        self.meta.namespace.as_deref().map(Cow::Borrowed)
    }
    fn resource_version(&self) -> Option<Cow<'_, str>> {
        None
    }
    fn uid(&self) -> Option<Cow<'_, str>> {
        self.meta.uid.as_ref().map(|u| Cow::Owned(u.to_string()))
    }
}

/// What a watch of `K` decodes when its cache keeps `T`, a flat copy that is no `Resource`:
/// the copy, and beside it the name and resource version the watcher reads (to resume from,
/// and to log), until the event reaches the cache ([`cached_event`]).
#[derive(Clone, Debug, Deserialize)]
#[serde(
    from = "K",
    bound(
        deserialize = "K: serde::de::DeserializeOwned + k8s_openapi::Metadata<Ty = ObjectMeta>, T: From<K>"
    )
)]
pub struct Watched<K, T> {
    metadata: ObjectMeta,
    cached: T,
    kind: PhantomData<fn() -> K>,
}

/// The pod watch's objects.
pub type WatchedPod = Watched<Pod, CachedPod>;
/// The Node watch's objects.
pub type WatchedNode = Watched<Node, CachedNode>;

impl<K: k8s_openapi::Metadata<Ty = ObjectMeta>, T: From<K>> From<K> for Watched<K, T> {
    fn from(obj: K) -> Self {
        let meta = obj.metadata();
        let metadata = ObjectMeta {
            name: meta.name.clone(),
            resource_version: meta.resource_version.clone(),
            ..ObjectMeta::default()
        };
        Watched {
            metadata,
            cached: obj.into(),
            kind: PhantomData,
        }
    }
}

/// A watch event as the cache takes it.
pub fn cached_event<K, T>(event: watcher::Event<Watched<K, T>>) -> watcher::Event<T> {
    match event {
        watcher::Event::Apply(w) => watcher::Event::Apply(w.cached),
        watcher::Event::InitApply(w) => watcher::Event::InitApply(w.cached),
        watcher::Event::Delete(w) => watcher::Event::Delete(w.cached),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

impl<K: k8s_openapi::Resource, T> kube::Resource for Watched<K, T> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(_: &()) -> Cow<'_, str> {
        K::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        K::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        K::VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        K::URL_PATH_SEGMENT.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What the operator keeps of a Node: its name, resource version and labels, its taints, and
/// the status of its Ready condition. The Node watch deserializes into it (a `Node` first,
/// folded at once, see [`Watched`]), so the cache holds none of a `Node`'s metadata, spec and
/// status structs, which take about 1.5 KiB inline however little they carry.
#[derive(Clone, Debug, Deserialize)]
#[serde(from = "Node")]
pub struct CachedNode {
    name: Box<str>,
    /// The taint patch's guard.
    resource_version: Option<Box<str>>,
    labels: BTreeMap<String, String>,
    taints: Vec<Taint>,
    ready: Option<Readiness>,
}

/// The status of a Node's Ready condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Readiness {
    True,
    False,
    /// `Unknown`, and any status the API adds later.
    Unknown,
}

impl From<Node> for CachedNode {
    fn from(node: Node) -> Self {
        let meta = node.metadata;
        let ready = node
            .status
            .and_then(|s| s.conditions)
            .and_then(|cs| cs.into_iter().find(|c| c.type_ == "Ready"))
            .map(|c| match c.status.as_str() {
                "True" => Readiness::True,
                "False" => Readiness::False,
                _ => Readiness::Unknown,
            });
        CachedNode {
            name: meta.name.unwrap_or_default().into_boxed_str(),
            resource_version: meta.resource_version.map(String::into_boxed_str),
            labels: meta.labels.unwrap_or_default(),
            taints: node.spec.and_then(|s| s.taints).unwrap_or_default(),
            ready,
        }
    }
}

impl CachedNode {
    /// The Node's name.
    pub fn name_any(&self) -> String {
        self.name.to_string()
    }

    /// The Node's name, borrowed.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Node's labels.
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.labels
    }

    /// The resource version it was cached at.
    pub fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }

    /// The Node's taints.
    pub fn taints(&self) -> &[Taint] {
        &self.taints
    }

    /// The status of its Ready condition (`True`, `False` or `Unknown`), if it has one.
    pub fn ready_status(&self) -> Option<&'static str> {
        self.ready.map(|r| match r {
            Readiness::True => "True",
            Readiness::False => "False",
            Readiness::Unknown => "Unknown",
        })
    }

    /// Whether its Ready condition is `True`.
    pub fn is_ready(&self) -> bool {
        self.ready == Some(Readiness::True)
    }
}

/// The cache finds a Node by its name; a cached Node is no `Resource`, since it holds no
/// `ObjectMeta`.
impl kube::runtime::reflector::Lookup for CachedNode {
    type DynamicType = ();

    fn kind(_: &()) -> Cow<'_, str> {
        <Node as k8s_openapi::Resource>::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        <Node as k8s_openapi::Resource>::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        <Node as k8s_openapi::Resource>::VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        <Node as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
    }
    fn name(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.name))
    }
    fn namespace(&self) -> Option<Cow<'_, str>> {
        None
    }
    fn resource_version(&self) -> Option<Cow<'_, str>> {
        self.resource_version.as_deref().map(Cow::Borrowed)
    }
    fn uid(&self) -> Option<Cow<'_, str>> {
        None
    }
}

/// Drops from a GpuNode what only its node uses (see the module docs).
pub fn trim_gpunode(gn: &mut GpuNode) {
    let meta = &mut gn.metadata;
    meta.managed_fields = None;
    // The watch has read the resource version by now; the cache finds a GpuNode by name.
    meta.uid = None;
    meta.resource_version = None;
    // A map of one entry still takes a 544-byte B-tree node: the usual labels, the pool label
    // naming the spec's pool and nothing else, are folded into an empty map, which the API
    // never sends (it omits empty labels) and which allocates nothing; see [`gpunode_pool`].
    if let Some(labels) = meta.labels.as_mut()
        && labels.len() == 1
        && labels.get(POOL_LABEL) == Some(&gn.spec.pool)
    {
        labels.clear();
    }
    // Owners are compared by UID and controller flag only.
    for owner in meta.owner_references.iter_mut().flatten() {
        owner.api_version = String::new();
        owner.kind = String::new();
        owner.name = String::new();
    }
    let Some(status) = gn.status.as_mut() else {
        return;
    };
    status.cuda_version = None;
    // The pool reads the failed checks only, and of the agent's conditions a CDI spec that is
    // not ready (the others, PodResources answering and no foreign device plugin found, are
    // for the admin reading the GpuNode).
    status.checks.retain(|c| !c.passed);
    status.checks.shrink_to_fit();
    status
        .conditions
        .retain(|c| c.type_ == CDI_SPEC_READY && c.status == "False");
    status.conditions.shrink_to_fit();
    if let Some(cdi) = status.cdi.as_mut() {
        cdi.digest = String::new();
        cdi.path = String::new();
    }
    // GPU models, MIG profiles and holders' namespaces repeat across thousands of nodes: the
    // cache keeps one copy of each.
    let share = |s: &mut Arc<str>| *s = intern(s);
    for gpu in &mut status.gpus {
        gpu.pci_bus_id = String::new();
        if gpu.health == Health::Healthy {
            gpu.uuid = String::new();
        }
        share(&mut gpu.model);
        gpu.mig_devices.retain(|m| !m.idleness.pods.is_empty());
        for m in &mut gpu.mig_devices {
            m.uuid = String::new();
            m.cdi_name = String::new();
            share(&mut m.profile);
        }
        let idleness = gpu
            .mig_devices
            .iter_mut()
            .map(|m| &mut m.idleness)
            .chain(gpu.shares.iter_mut())
            .chain(std::iter::once(&mut gpu.idleness));
        for holder in idleness.flat_map(|i| i.pods.iter_mut()) {
            holder.container = None;
            share(&mut holder.namespace);
        }
        gpu.mig_devices.shrink_to_fit();
    }
    // A healthy GPU that nothing holds, whole or in part, tells no decision anything.
    status.gpus.retain(|g| {
        g.health == Health::Unhealthy
            || !g.idleness.pods.is_empty()
            || !g.mig_devices.is_empty()
            || g.shares.iter().any(|s| !s.pods.is_empty())
    });
    status.gpus.shrink_to_fit();
}

/// The pool a GpuNode's `gpupool.io/pool` label names, read from a cached GpuNode as
/// [`trim_gpunode`] left it (or from any GpuNode).
pub fn gpunode_pool(gn: &GpuNode) -> Option<&str> {
    match gn.metadata.labels.as_ref()? {
        labels if labels.is_empty() => Some(&gn.spec.pool),
        labels => labels.get(POOL_LABEL).map(String::as_str),
    }
}

/// The parts of GpuNode specs the cache holds one copy of: thousands of nodes of a few kinds
/// carry a few distinct MIG layouts (each about 3 KiB, a profile map per GPU), and every node
/// of a pool carries the pool's driver and CDI policies, which every GpuNode would otherwise
/// hold a copy of. Parts no cached GpuNode holds any more are forgotten.
#[derive(Debug, Default)]
pub struct SharedSpecs {
    layouts: Shared<NodeMigSpec>,
    drivers: Shared<DriverPolicy>,
    cdi: Shared<CdiPolicy>,
}

impl SharedSpecs {
    /// [`trim_gpunode`], then points the GpuNode's MIG layout, driver policy and CDI policy at
    /// the copies already held of equal ones, or holds them as the first of their kind. For the
    /// GpuNode watch, before the store.
    pub fn trim(&mut self, gn: &mut GpuNode) {
        trim_gpunode(gn);
        self.layouts.share(&mut gn.spec.mig);
        self.drivers.share(&mut gn.spec.driver);
        self.cdi.share(&mut gn.spec.cdi);
    }

    /// How many distinct MIG layouts are held.
    pub fn layouts(&self) -> usize {
        self.layouts.len()
    }

    /// How many distinct driver and CDI policies are held.
    pub fn policies(&self) -> (usize, usize) {
        (self.drivers.len(), self.cdi.len())
    }
}

/// One copy of each distinct value of `T` that something still holds.
#[derive(Debug)]
struct Shared<T> {
    held: Vec<Weak<T>>,
}

impl<T> Default for Shared<T> {
    fn default() -> Self {
        Self { held: Vec::new() }
    }
}

impl<T: PartialEq> Shared<T> {
    fn share(&mut self, value: &mut Arc<T>) {
        self.held.retain(|h| h.strong_count() > 0);
        match self
            .held
            .iter()
            .filter_map(Weak::upgrade)
            .find(|h| **h == **value)
        {
            Some(same) => *value = same,
            None => self.held.push(Arc::downgrade(value)),
        }
    }

    fn len(&self) -> usize {
        self.held.iter().filter(|h| h.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use gpupool_crds::testing::mig_node_status;
    use k8s_openapi::api::core::v1::{
        Affinity, EnvVar, PodCondition, ResourceRequirements, Toleration, Volume,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use k8s_openapi::jiff::Timestamp;
    use kube::ResourceExt;

    use super::*;
    use crate::demand::requests_gpu;
    use crate::reclaim::{job_owner, pod_start, warning};

    fn pod(resource: &str, node: Option<&str>) -> Pod {
        let mut limits = BTreeMap::new();
        limits.insert(resource.to_string(), Quantity("1".into()));
        limits.insert("memory".to_string(), Quantity("64Gi".into()));
        Pod {
            metadata: ObjectMeta {
                name: Some("trainer-0".into()),
                namespace: Some("ml".into()),
                uid: Some("u-1".into()),
                resource_version: Some("42".into()),
                creation_timestamp: Some(Time(Timestamp::from_second(1_000).unwrap())),
                labels: Some(BTreeMap::from([("team".into(), "research".into())])),
                annotations: Some(BTreeMap::from([
                    (
                        "gpupool.io/idle-since".into(),
                        "2026-12-01T00:00:00Z".into(),
                    ),
                    (
                        "gpupool.io/reclaim-at".into(),
                        "2026-12-01T01:00:00Z".into(),
                    ),
                    (
                        "kubectl.kubernetes.io/last-applied-configuration".into(),
                        "x".repeat(4096),
                    ),
                ])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "batch/v1".into(),
                    kind: "Job".into(),
                    name: "trainer".into(),
                    uid: "j-1".into(),
                    ..OwnerReference::default()
                }]),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_string),
                priority_class_name: Some("batch-low".into()),
                node_selector: Some(BTreeMap::from([("gpu".into(), "h100".into())])),
                affinity: Some(Affinity::default()),
                tolerations: Some(vec![Toleration {
                    key: Some("nvidia.com/gpu".into()),
                    operator: Some("Exists".into()),
                    ..Toleration::default()
                }]),
                volumes: Some(vec![Volume {
                    name: "data".into(),
                    ..Volume::default()
                }]),
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("nvcr.io/nvidia/pytorch:24.10-py3".into()),
                    env: Some(vec![EnvVar {
                        name: "A".into(),
                        value: Some("b".into()),
                        ..EnvVar::default()
                    }]),
                    resources: Some(ResourceRequirements {
                        limits: Some(limits),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                start_time: Some(Time(Timestamp::from_second(2_000).unwrap())),
                pod_ip: Some("10.0.0.1".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    #[test]
    fn only_gpu_pods_and_every_deletion_reach_the_cache() {
        let cached = |resource: &str| CachedPod::from(pod(resource, Some("n1")));
        assert!(keep_pod(&watcher::Event::Apply(cached("nvidia.com/gpu"))));
        assert!(keep_pod(&watcher::Event::InitApply(cached(
            "nvidia.com/mig-1g.10gb"
        ))));
        assert!(!keep_pod(&watcher::Event::Apply(cached("cpu"))));
        assert!(!keep_pod(&watcher::Event::InitApply(cached("cpu"))));
        assert!(keep_pod(&watcher::Event::Apply(cached(
            "nvidia.com/gpu.shared"
        ))));
        assert!(keep_pod(&watcher::Event::Apply(cached(
            "nvidia.com/mig-1g.10gb.shared"
        ))));
        assert!(!keep_pod(&watcher::Event::Apply(cached(
            "nvidia.com/gpu-other"
        ))));
        assert!(keep_pod(&watcher::Event::Delete(cached("cpu"))));
        assert!(keep_pod(&watcher::Event::InitDone));
    }

    #[test]
    fn the_watch_folds_a_pod_into_its_trimmed_cached_form() {
        for node in [Some("n1"), None] {
            let full = pod("nvidia.com/gpu", node);
            let json = serde_json::to_string(&full).unwrap();
            let cached: CachedPod = serde_json::from_str(&json).unwrap();
            let mut trimmed = full.clone();
            trim_pod(&mut trimmed);
            assert_eq!(cached.to_pod(), trimmed);
            assert_eq!(cached.node_name(), node);
            assert_eq!(cached.phase(), Some("Running"));
            assert!(cached.requests_gpu());
        }
        let cpu: CachedPod =
            serde_json::from_value(serde_json::to_value(pod("cpu", Some("n1"))).unwrap()).unwrap();
        assert!(!cpu.requests_gpu());
        assert!(CachedPod::from(Pod::default()).to_pod() == Pod::default());
    }

    #[test]
    fn cached_pods_share_their_repeated_strings_and_read_back_as_sent() {
        let mut a = pod("nvidia.com/mig-1g.10gb", Some("n1"));
        let uid = "0c6f3a52-9d1e-4b7a-8f21-000000010203";
        a.metadata.uid = Some(uid.into());
        a.metadata.owner_references.as_mut().unwrap()[0].uid = uid.replace("0102", "0909");
        let resources = a.spec.as_mut().unwrap().containers[0]
            .resources
            .as_mut()
            .unwrap();
        resources.requests = resources.limits.clone();
        let mut b = a.clone();
        b.metadata.name = Some("trainer-1".into());
        let (ca, cb) = (CachedPod::from(a.clone()), CachedPod::from(b));
        let spec = |p: &CachedPod| p.spec.as_deref().unwrap().clone();
        let (sa, sb) = (spec(&ca), spec(&cb));
        let shared = |x: &Option<Arc<str>>, y: &Option<Arc<str>>| {
            Arc::ptr_eq(x.as_ref().unwrap(), y.as_ref().unwrap())
        };
        assert!(shared(&ca.meta.namespace, &cb.meta.namespace));
        assert!(shared(&sa.node_name, &sb.node_name));
        assert!(shared(&sa.priority_class_name, &sb.priority_class_name));
        assert!(Arc::ptr_eq(&sa.containers[0].name, &sb.containers[0].name));
        let (owner_a, owner_b) = (
            &ca.meta.owner_references.as_deref().unwrap()[0],
            &cb.meta.owner_references.as_deref().unwrap()[0],
        );
        assert!(Arc::ptr_eq(&owner_a.kind, &owner_b.kind));
        assert!(matches!(owner_a.uid, Uid::Uuid(_)));
        assert!(Arc::ptr_eq(&owner_a.api_version, &owner_b.api_version));
        // The API server copies limits into requests: one shared map serves both.
        let (limits, requests) = sa.containers[0].resources.as_ref().unwrap();
        assert!(Arc::ptr_eq(
            &limits.as_ref().unwrap().0,
            &requests.as_ref().unwrap().0
        ));
        // The UIDs, held as numbers, and everything else read back exactly as sent.
        assert!(matches!(ca.meta.uid, Some(Uid::Uuid(_))));
        assert_eq!(
            ca.job_uid(),
            Some(&Uid::new("0c6f3a52-9d1e-4b7a-8f21-000000090903"))
        );
        let mut trimmed = a;
        trim_pod(&mut trimmed);
        assert_eq!(ca.to_pod(), trimmed);
    }

    #[test]
    fn the_pod_watch_reads_its_resume_point_and_the_cache_takes_the_flat_pod() {
        use kube::runtime::reflector::Lookup;

        let mut full = pod("nvidia.com/gpu", Some("n1"));
        full.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(3_000).unwrap()));
        let watched: WatchedPod =
            serde_json::from_value(serde_json::to_value(&full).unwrap()).unwrap();
        assert_eq!(
            kube::Resource::meta(&watched).resource_version.as_deref(),
            Some("42")
        );
        assert_eq!(
            kube::Resource::meta(&watched).name.as_deref(),
            Some("trainer-0")
        );
        let watcher::Event::Apply(cached) = cached_event(watcher::Event::Apply(watched)) else {
            panic!("an Apply stays an Apply");
        };
        assert_eq!(cached.pod_name(), "trainer-0");
        assert_eq!(cached.pod_namespace(), "ml");
        assert_eq!(cached.key(), "ml/trainer-0");
        assert!(cached.is_deleting());
        assert_eq!(cached.job_uid(), Some(&Uid::new("j-1")));
        assert!(cached.has_annotation("gpupool.io/idle-since"));
        assert!(!cached.has_annotation("kubectl.kubernetes.io/last-applied-configuration"));
        assert!(
            !cached.has_annotation("gpupool.io/idle"),
            "a whole key, not a prefix"
        );
        // The cache finds it by namespace and name.
        assert_eq!(Lookup::name(&cached).as_deref(), Some("trainer-0"));
        assert_eq!(Lookup::namespace(&cached).as_deref(), Some("ml"));
        assert_eq!(Lookup::uid(&cached).as_deref(), Some("u-1"));
        let mut trimmed = full;
        trim_pod(&mut trimmed);
        assert_eq!(cached.to_pod(), trimmed);
        assert!(matches!(
            cached_event::<Pod, CachedPod>(watcher::Event::Init),
            watcher::Event::Init
        ));
        assert!(matches!(
            cached_event::<Pod, CachedPod>(watcher::Event::InitDone),
            watcher::Event::InitDone
        ));
    }

    #[test]
    fn a_cached_pod_gives_back_every_phase_as_sent() {
        for phase in [
            "Pending",
            "Running",
            "Succeeded",
            "Failed",
            "Unknown",
            "Evicted",
        ] {
            let mut p = pod("nvidia.com/gpu", Some("n1"));
            p.status.as_mut().unwrap().phase = Some(phase.into());
            let cached = CachedPod::from(p.clone());
            assert_eq!(cached.phase(), Some(phase));
            trim_pod(&mut p);
            assert_eq!(cached.to_pod(), p);
        }
    }

    #[test]
    fn a_trimmed_bound_pod_answers_every_question_as_before() {
        let full = pod("nvidia.com/gpu", Some("n1"));
        let mut trimmed = full.clone();
        trim_pod(&mut trimmed);
        assert!(requests_gpu(&trimmed));
        assert_eq!(pod_start(&trimmed), pod_start(&full));
        assert_eq!(job_owner(&trimmed), Some("trainer".into()));
        assert_eq!(warning(&trimmed), warning(&full));
        assert!(warning(&trimmed).is_some());
        assert_eq!(trimmed.metadata.labels, full.metadata.labels);
        assert_eq!(trimmed.metadata.uid.as_deref(), Some("u-1"));
        assert_eq!(
            trimmed.metadata.resource_version, None,
            "read by no decision"
        );
        let spec = trimmed.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert_eq!(spec.priority_class_name.as_deref(), Some("batch-low"));
        assert_eq!(
            trimmed.status.as_ref().unwrap().phase.as_deref(),
            Some("Running")
        );
        // What no decision reads is gone.
        let annotations = trimmed.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations.len(), 2, "{annotations:?}");
        assert!(spec.volumes.is_none() && spec.containers[0].env.is_none());
        let limits = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref();
        assert_eq!(
            limits.map(|l| l.len()),
            Some(1),
            "only the GPU resource stays"
        );
        assert!(spec.containers[0].image.is_none());
        assert!(spec.tolerations.is_none() && spec.node_selector.is_none());
        assert!(trimmed.status.as_ref().unwrap().pod_ip.is_none());
        // Serialized, the copy is a fraction of the pod.
        let size = |p: &Pod| serde_json::to_vec(p).unwrap().len();
        assert!(
            size(&trimmed) * 4 < size(&full),
            "{} vs {}",
            size(&trimmed),
            size(&full)
        );
    }

    #[test]
    fn a_packed_map_gives_back_its_entries_in_key_order() {
        let map = BTreeMap::from([
            ("team".to_string(), "research".to_string()),
            (
                "batch.kubernetes.io/job-name".to_string(),
                "train-1".to_string(),
            ),
            ("empty".to_string(), String::new()),
        ]);
        let packed = PackedMap::pack(map.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        assert_eq!(packed.to_map(|v| v), map);
        assert_eq!(
            packed.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ["batch.kubernetes.io/job-name", "empty", "team"]
        );
        assert_eq!(packed.iter().nth(1), Some(("empty", "")));
        let none = PackedMap::pack([]);
        assert_eq!(none.iter().count(), 0);
        assert_eq!(none.to_map(|v| v), BTreeMap::new());
    }

    #[test]
    fn a_cached_pod_keeps_empty_and_missing_labels_apart() {
        let mut p = pod("nvidia.com/gpu", Some("n1"));
        p.metadata.labels = Some(BTreeMap::new());
        assert_eq!(
            CachedPod::from(p.clone()).to_pod().metadata.labels,
            Some(BTreeMap::new())
        );
        p.metadata.labels = None;
        assert_eq!(CachedPod::from(p).to_pod().metadata.labels, None);
    }

    #[test]
    fn an_unbound_pod_keeps_what_pending_demand_reads() {
        let mut trimmed = pod("nvidia.com/gpu", None);
        trim_pod(&mut trimmed);
        let spec = trimmed.spec.as_ref().unwrap();
        assert!(spec.node_selector.is_some());
        assert!(spec.affinity.is_some());
        assert_eq!(spec.tolerations.as_ref().map(Vec::len), Some(1));
    }

    #[test]
    fn a_pod_without_gpupool_annotations_keeps_none() {
        let mut p = pod("nvidia.com/gpu", Some("n1"));
        p.metadata.annotations = Some(BTreeMap::from([("a".into(), "b".into())]));
        trim_pod(&mut p);
        assert_eq!(p.metadata.annotations, None);
    }

    /// A Node as the API server sends one: everything a kubelet reports, and a Ready condition
    /// among others.
    fn full_node(ready: &str) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "gpu-1",
                "uid": "0c1d",
                "resourceVersion": "42",
                "labels": { "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "zone": "a" },
                "annotations": { "node.alpha.kubernetes.io/ttl": "0" },
                "managedFields": [{ "manager": "kubelet", "operation": "Update" }],
            },
            "spec": {
                "podCIDR": "10.0.0.0/24",
                "providerID": "kwok://gpu-1",
                "taints": [
                    { "key": "gpupool.io/driver-invalid", "effect": "NoSchedule" },
                    { "key": "dedicated", "value": "ml", "effect": "NoExecute",
                      "timeAdded": "2026-12-05T10:00:00Z" },
                ],
            },
            "status": {
                "capacity": { "cpu": "96", "nvidia.com/gpu": "8" },
                "conditions": [
                    { "type": "MemoryPressure", "status": "False" },
                    { "type": "Ready", "status": ready, "reason": "KubeletReady" },
                ],
                "nodeInfo": { "kubeletVersion": "v1.36.0", "architecture": "amd64",
                  "bootID": "", "containerRuntimeVersion": "", "kernelVersion": "",
                  "kubeProxyVersion": "", "machineID": "", "operatingSystem": "linux",
                  "osImage": "", "systemUUID": "" },
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_cached_node_keeps_its_labels_taints_and_readiness() {
        let node = full_node("True");
        let wire = serde_json::to_vec(&node).unwrap();
        let cached: CachedNode = serde_json::from_slice(&wire).unwrap();

        assert_eq!(cached.name_any(), "gpu-1");
        assert_eq!(cached.resource_version(), Some("42"));
        assert_eq!(cached.labels(), node.labels());
        // Taints are kept whole: a taint patch replaces the list and must not lose timeAdded.
        assert_eq!(
            cached.taints(),
            node.spec.as_ref().unwrap().taints.as_deref().unwrap()
        );
        assert_eq!(cached.ready_status(), Some("True"));
        assert!(cached.is_ready());
        // The watch decodes the same, with its resume point beside it.
        let watched: WatchedNode = serde_json::from_slice(&wire).unwrap();
        assert_eq!(
            kube::Resource::meta(&watched).resource_version.as_deref(),
            Some("42")
        );
        let watcher::Event::Delete(from_watch) = cached_event(watcher::Event::Delete(watched))
        else {
            panic!("a Delete stays a Delete");
        };
        assert_eq!(from_watch.name(), "gpu-1");
        assert_eq!(from_watch.labels(), cached.labels());
        assert_eq!(from_watch.taints(), cached.taints());
        assert_eq!(
            kube::runtime::reflector::Lookup::name(&from_watch).as_deref(),
            Some("gpu-1")
        );
        assert_eq!(
            kube::runtime::reflector::Lookup::namespace(&from_watch),
            None
        );
    }

    #[test]
    fn a_cached_node_tells_each_readiness_apart() {
        for (status, want) in [
            ("True", Some("True")),
            ("False", Some("False")),
            ("Unknown", Some("Unknown")),
            ("Degraded", Some("Unknown")),
        ] {
            let cached = CachedNode::from(full_node(status));
            assert_eq!(cached.ready_status(), want, "{status}");
            assert_eq!(cached.is_ready(), status == "True", "{status}");
        }
        let mut bare = full_node("True");
        bare.status = None;
        bare.spec = None;
        let cached = CachedNode::from(bare);
        assert_eq!(cached.ready_status(), None);
        assert!(!cached.is_ready());
        assert!(cached.taints().is_empty());
    }

    #[test]
    fn a_trimmed_gpunode_keeps_what_the_pool_reads() {
        let mut gn = GpuNode::new(
            "n1",
            gpupool_crds::GpuNodeSpec {
                pool: "p".into(),
                driver: Default::default(),
                cdi: Default::default(),
                mig: Default::default(),
                utilization: Default::default(),
                sharing: Default::default(),
            },
        );
        let mut status = mig_node_status(&gn, &[("ml".into(), "trainer-0".into())]);
        status.checks[0].passed = false;
        status.checks[0].message = "driver 535 is older than 550".into();
        status.gpus[2].health = Health::Unhealthy;
        gn.status = Some(status);
        let full = gn.clone();
        trim_gpunode(&mut gn);
        let (a, b) = (gn.status.as_ref().unwrap(), full.status.as_ref().unwrap());
        assert_eq!(
            a.checks.len(),
            1,
            "passed checks are dropped: {:?}",
            a.checks
        );
        assert_eq!(a.checks[0].message, "driver 535 is older than 550");
        assert_eq!(a.healthy_gpus, b.healthy_gpus);
        assert_eq!(a.mig, b.mig);
        // GPU 0 holds the pod, GPU 2 is unhealthy; the other six are dropped.
        assert_eq!(a.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0, 2]);
        assert_eq!((a.gpu_count, a.healthy_gpus), (b.gpu_count, b.healthy_gpus));
        for g in &a.gpus {
            let f = &b.gpus[g.index as usize];
            assert_eq!((&g.model, g.health), (&f.model, f.health));
            // The pool names an unhealthy GPU by its UUID; a healthy one's is dropped.
            match f.health {
                Health::Healthy => assert!(g.uuid.is_empty()),
                Health::Unhealthy => assert_eq!(g.uuid, f.uuid),
            }
            assert_eq!(holders(&g.idleness), holders(&f.idleness));
            // Only the held MIG devices stay, with their holders and idleness.
            let held: Vec<_> = f
                .mig_devices
                .iter()
                .filter(|m| !m.idleness.pods.is_empty())
                .collect();
            assert_eq!(g.mig_devices.len(), held.len());
            for (m, n) in g.mig_devices.iter().zip(held) {
                assert_eq!((&m.profile, m.health), (&n.profile, n.health));
                assert_eq!(holders(&m.idleness), holders(&n.idleness));
                assert!(m.uuid.is_empty() && m.cdi_name.is_empty());
                assert!(
                    m.idleness.pods.iter().all(|p| p.container.is_none()),
                    "no decision reads the holder's container"
                );
            }
        }
        assert_eq!(a.gpus[0].mig_devices.len(), 1);
        assert_eq!(gn.spec, full.spec);
        assert_eq!(b.conditions.len(), 3, "the agent's usual conditions");
        assert!(
            a.conditions.is_empty(),
            "none the pool reads: {:?}",
            a.conditions
        );

        // A CDI spec that is not ready is kept, message and all: the pool reports it.
        let mut not_ready = full.clone();
        let conditions = &mut not_ready.status.as_mut().unwrap().conditions;
        let cdi = conditions
            .iter_mut()
            .find(|c| c.type_ == CDI_SPEC_READY)
            .unwrap();
        cdi.status = "False".into();
        cdi.message = "/var/run/cdi/gpupool-nvidia.yaml was edited by hand".into();
        let expected = cdi.clone();
        trim_gpunode(&mut not_ready);
        assert_eq!(not_ready.status.unwrap().conditions, [expected]);
    }

    #[test]
    fn trimmed_gpunodes_share_models_profiles_and_namespaces() {
        let (mut a, mut b) = (
            decoded("n1", layout("1g.10gb", 7)),
            decoded("n2", layout("1g.10gb", 7)),
        );
        for (gn, pod) in [(&mut a, "trainer-0"), (&mut b, "trainer-1")] {
            let status = mig_node_status(gn, &[("ml".into(), pod.into())]);
            gn.status =
                Some(serde_json::from_value(serde_json::to_value(status).unwrap()).unwrap());
        }
        let before = a.clone();
        trim_gpunode(&mut a);
        trim_gpunode(&mut b);
        let (ga, gb) = (
            &a.status.as_ref().unwrap().gpus[0],
            &b.status.as_ref().unwrap().gpus[0],
        );
        let (ma, mb) = (&ga.mig_devices[0], &gb.mig_devices[0]);
        let (pa, pb) = (&ma.idleness.pods[0], &mb.idleness.pods[0]);
        assert!(Arc::ptr_eq(&ga.model, &gb.model));
        assert!(Arc::ptr_eq(&ma.profile, &mb.profile));
        assert!(Arc::ptr_eq(&pa.namespace, &pb.namespace));
        let kept = &before.status.as_ref().unwrap().gpus[0];
        assert_eq!(
            (&*ga.model, &*ma.profile, &*pa.namespace, pa.name.as_str()),
            (&*kept.model, "1g.10gb", "ml", "trainer-0"),
            "sharing changes no value"
        );
    }

    /// An idleness as the pool reads it: activity, idle time and the holders by namespace and
    /// name.
    fn holders(i: &gpupool_crds::node::Idleness) -> impl PartialEq + std::fmt::Debug {
        (
            format!("{:?}", i.activity),
            i.idle_since.clone(),
            i.pods
                .iter()
                .map(|p| (p.namespace.clone(), p.name.clone()))
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn a_trimmed_gpunode_folds_its_pool_label_and_keeps_its_owner() {
        let pool: gpupool_crds::GpuPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuPool",
            "metadata": {"name": "train", "uid": "pool-uid"},
            "spec": {"nodeSelector": {}}
        }))
        .unwrap();
        let written = crate::pool::desired_gpunode(&pool, "n1", &BTreeMap::new()).0;
        let mut cached = written.clone();
        cached.metadata.uid = Some("gn-uid".into());
        cached.metadata.resource_version = Some("7".into());
        cached.status = Some(mig_node_status(&cached, &[]));
        trim_gpunode(&mut cached);

        // The pool label alone is folded, and still read as the pool's.
        assert_eq!(cached.metadata.labels, Some(BTreeMap::new()));
        assert_eq!(gpunode_pool(&cached), Some("train"));
        assert_eq!(gpunode_pool(&written), Some("train"));
        assert!(crate::pool::gpunode_up_to_date(&cached, &written));
        // What the reconcile asks of a cached GpuNode.
        let wanted =
            |gn: &GpuNode| crate::pool::gpunode_wanted(gn, &pool, &written.spec, &written.spec.mig);
        assert!(wanted(&cached));
        // Owned by the pool, compared by UID; the owner's other strings are gone.
        assert!(crate::controller::owned_by(&cached, &pool));
        let owner = &cached.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller),
            ("pool-uid", Some(true))
        );
        assert!(owner.name.is_empty() && owner.kind.is_empty());
        assert_eq!(
            (
                cached.metadata.uid.as_ref(),
                cached.metadata.resource_version.as_ref()
            ),
            (None, None)
        );
        let status = cached.status.as_ref().unwrap();
        assert!(status.cuda_version.is_none());
        assert!(
            status
                .cdi
                .as_ref()
                .is_some_and(|c| c.path.is_empty() && c.devices > 0)
        );

        // Labels beside the pool label, or a label naming another pool, are kept as they are.
        for labels in [
            BTreeMap::from([
                (POOL_LABEL.to_string(), "train".to_string()),
                ("team".to_string(), "ml".to_string()),
            ]),
            BTreeMap::from([(POOL_LABEL.to_string(), "other".to_string())]),
        ] {
            let mut gn = written.clone();
            gn.metadata.labels = Some(labels.clone());
            trim_gpunode(&mut gn);
            assert_eq!(gn.metadata.labels.as_ref(), Some(&labels));
            assert_eq!(
                gpunode_pool(&gn),
                labels.get(POOL_LABEL).map(String::as_str)
            );
        }
        // A GpuNode without labels names no pool, and one whose pool label is elsewhere shows.
        let mut bare = written.clone();
        bare.metadata.labels = None;
        trim_gpunode(&mut bare);
        assert_eq!(gpunode_pool(&bare), None);
        assert!(!crate::pool::gpunode_up_to_date(&bare, &written));
        assert!(!wanted(&bare));
    }

    fn layout(profile: &str, count: u32) -> NodeMigSpec {
        NodeMigSpec {
            managed: true,
            layout_name: Some(format!("all-{profile}")),
            gpus: (0..8)
                .map(|index| gpupool_crds::node::GpuMigSpec {
                    index,
                    enabled: true,
                    profiles: BTreeMap::from([(profile.to_owned(), count)]),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// A GpuNode as the watch decodes it: its own copy of every field.
    fn decoded(name: &str, mig: NodeMigSpec) -> GpuNode {
        let mut gn = GpuNode::new(
            name,
            gpupool_crds::GpuNodeSpec {
                pool: "p".into(),
                driver: Default::default(),
                cdi: Default::default(),
                mig: Arc::new(mig),
                utilization: Default::default(),
                sharing: Default::default(),
            },
        );
        gn.status = Some(mig_node_status(&gn, &[]));
        serde_json::from_value(serde_json::to_value(&gn).unwrap()).unwrap()
    }

    #[test]
    fn gpunodes_of_one_layout_share_one_copy() {
        let mut specs = SharedSpecs::default();
        let (mut a, mut b, mut c) = (
            decoded("n1", layout("1g.10gb", 7)),
            decoded("n2", layout("1g.10gb", 7)),
            decoded("n3", layout("3g.40gb", 2)),
        );
        assert!(!Arc::ptr_eq(&a.spec.mig, &b.spec.mig));
        let b_before = b.clone();
        for gn in [&mut a, &mut b, &mut c] {
            specs.trim(gn);
        }
        assert!(Arc::ptr_eq(&a.spec.mig, &b.spec.mig));
        assert!(!Arc::ptr_eq(&a.spec.mig, &c.spec.mig));
        assert_eq!(b.spec, b_before.spec, "sharing changes no value");
        assert_eq!(specs.layouts(), 2);
        // A layout no GpuNode holds any more is let go; an edited one is a new layout.
        drop(c);
        assert_eq!(specs.layouts(), 1);
        let mut d = decoded("n4", layout("1g.10gb", 7));
        Arc::make_mut(&mut d.spec.mig).managed = false;
        specs.trim(&mut d);
        assert!(!Arc::ptr_eq(&a.spec.mig, &d.spec.mig));
        assert_eq!(specs.layouts(), 2);
    }

    #[test]
    fn gpunodes_of_one_pool_share_its_driver_and_cdi_policies() {
        let mut specs = SharedSpecs::default();
        let (mut a, mut b, mut c) = (
            decoded("n1", layout("1g.10gb", 7)),
            decoded("n2", layout("3g.40gb", 2)),
            decoded("n3", layout("1g.10gb", 7)),
        );
        // Another pool's policies: a driver minimum and another spec directory.
        Arc::make_mut(&mut c.spec.driver).min_version = Some("550".into());
        Arc::make_mut(&mut c.spec.cdi).spec_dir = "/etc/cdi".into();
        assert!(!Arc::ptr_eq(&a.spec.driver, &b.spec.driver));
        let before = [a.clone(), b.clone(), c.clone()];
        for gn in [&mut a, &mut b, &mut c] {
            specs.trim(gn);
        }
        assert!(Arc::ptr_eq(&a.spec.driver, &b.spec.driver));
        assert!(Arc::ptr_eq(&a.spec.cdi, &b.spec.cdi));
        assert!(!Arc::ptr_eq(&a.spec.driver, &c.spec.driver));
        assert!(!Arc::ptr_eq(&a.spec.cdi, &c.spec.cdi));
        for (after, before) in [&a, &b, &c].into_iter().zip(&before) {
            assert_eq!(after.spec, before.spec, "sharing changes no value");
        }
        assert_eq!(specs.policies(), (2, 2));
        // `before` holds c's policies too (a clone shares them).
        drop((c, before));
        assert_eq!(specs.policies(), (1, 1));
    }

    #[test]
    fn a_shared_layout_is_trimmed_like_any_gpunode() {
        let mut specs = SharedSpecs::default();
        let mut shared = decoded("n1", layout("1g.10gb", 7));
        let mut plain = shared.clone();
        specs.trim(&mut shared);
        trim_gpunode(&mut plain);
        assert_eq!(
            (&shared.metadata, &shared.spec, &shared.status),
            (&plain.metadata, &plain.spec, &plain.status)
        );
    }
}
