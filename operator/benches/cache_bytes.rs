//! What the operator's caches hold per object at scale, measured in process, no cluster needed.
//!
//! The scale bench's shapes (`shapes`: a kwok node of 8 H100s, its GpuNode as the operator
//! writes it and its agent reports it, the node's pods) are serialized as the API server sends
//! them, then decoded, filtered and cut exactly as the operator's watches do (`CachedPod`
//! with `keep_pod`, `CachedNode`, `trim_gpunode`) and put into the operator's stores as an
//! initial list puts them. A counting allocator measures the bytes that stay: the heap the
//! caches cost, without the allocator's slack or the transient peaks (decoding, reconciles)
//! that the scale bench's resident-set figures also hold.
//!
//! `cargo bench -p gpupool-operator --bench cache_bytes` (release). `SCALE_NODES` (default
//! 5000) and `SCALE_PODS_PER_NODE` (default 8, half of them holding a MIG device) as in the
//! scale bench. Prints, per kind: objects, bytes held, bytes per object, and the heap of one
//! cached object's parts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use gpupool_crds::testing::mig_node_status;
use gpupool_crds::{GpuNode, GpuPool};
use gpupool_operator::cache::{CachedNode, CachedPod, SharedSpecs, keep_pod};
use gpupool_operator::pool::desired_gpunode;
use gpupool_operator::store::Writer;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::watcher::Event;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use shapes::{BoxResult, gpu_holders, node, pod};

mod shapes;

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// Live allocations: each costs glibc a header and rounding on top of its bytes.
static BLOCKS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter only adds.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        BLOCKS.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

fn blocks() -> usize {
    BLOCKS.load(Ordering::Relaxed)
}

/// What glibc's allocator has handed out, headers and rounding included: what the process
/// pays for the bytes [`live`] counts.
fn in_use() -> usize {
    gpupool_operator::heap::stats().map_or(0, |s| s.in_use as usize)
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What the API server adds to every object it stores.
fn stored<T: Serialize>(obj: &T, uid: u64) -> BoxResult<serde_json::Value> {
    let mut v = serde_json::to_value(obj)?;
    let meta = v
        .get_mut("metadata")
        .and_then(|m| m.as_object_mut())
        .ok_or("an object without metadata")?;
    meta.insert(
        "uid".into(),
        json!(format!("5b1e0c9a-2f4d-4e6b-9a71-{uid:012}")),
    );
    meta.insert(
        "resourceVersion".into(),
        json!(format!("{}", 1_000_000 + uid)),
    );
    meta.insert("creationTimestamp".into(), json!("2026-12-05T07:00:00Z"));
    Ok(v)
}

/// A bound pod as the API server sends it once kwok has it running.
fn running(pod: Pod, uid: u64) -> BoxResult<Vec<u8>> {
    let mut v = stored(&pod, uid)?;
    v["status"] = json!({
        "phase": "Running",
        "startTime": "2026-12-05T07:00:01Z",
        "podIP": "10.0.0.1",
        "hostIP": "10.0.0.2",
        "qosClass": "Guaranteed",
        "conditions": [
            { "type": "Initialized", "status": "True", "lastTransitionTime": "2026-12-05T07:00:01Z" },
            { "type": "Ready", "status": "True", "lastTransitionTime": "2026-12-05T07:00:02Z" },
            { "type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-12-05T07:00:02Z" },
            { "type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-05T07:00:00Z" },
        ],
        "containerStatuses": [{
            "name": "trainer", "ready": true, "restartCount": 0, "started": true,
            "image": "nvcr.io/nvidia/pytorch:24.10-py3", "imageID": "",
            "state": { "running": { "startedAt": "2026-12-05T07:00:02Z" } },
        }],
    });
    Ok(serde_json::to_vec(&v)?)
}

/// Bytes a store of `K` holds after an initial list of `objects`, each decoded from the JSON
/// `wire` makes, cut by `cut` and offered to the store if `keep` says so.
fn held<K, W>(
    objects: impl Iterator<Item = BoxResult<W>>,
    wire: impl Fn(W) -> BoxResult<Vec<u8>>,
    mut cut: impl FnMut(&mut K),
    keep: impl Fn(&Event<K>) -> bool,
) -> BoxResult<Held<K>>
where
    K: kube::runtime::reflector::Lookup + Clone + DeserializeOwned + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (before, blocks_before, in_use_before) = (live(), blocks(), in_use());
    let mut writer = Writer::<K>::default();
    writer.apply_watcher_event(&Event::Init);
    let mut first = None;
    for obj in objects {
        let bytes = wire(obj?)?;
        let decoding = live();
        let mut k: K = serde_json::from_slice(&bytes)?;
        first.get_or_insert((bytes.len(), live() - decoding));
        cut(&mut k);
        let event = Event::InitApply(k);
        if keep(&event) {
            writer.apply_watcher_event(&event);
        }
    }
    writer.apply_watcher_event(&Event::InitDone);
    let count = writer.as_reader().len();
    let (wire, decoded) = first.unwrap_or_default();
    Ok(Held {
        bytes: live() - before,
        blocks: blocks() - blocks_before,
        in_use: in_use().saturating_sub(in_use_before),
        writer,
        count,
        wire,
        decoded,
    })
}

/// What [`held`] measured.
struct Held<K: kube::runtime::reflector::Lookup + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    writer: Writer<K>,
    /// Heap the store holds, as asked of the allocator.
    bytes: usize,
    /// Allocations the store holds.
    blocks: usize,
    /// Heap the store holds as glibc counts it (headers, rounding); 0 elsewhere.
    in_use: usize,
    /// Objects stored.
    count: usize,
    /// The first object's JSON, and the heap it took decoded, before the cut: what a page of a
    /// paged list holds per object while it is decoded.
    wire: usize,
    decoded: usize,
}

/// The first object in a store.
fn first<K>(writer: &Writer<K>) -> BoxResult<std::sync::Arc<K>>
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    Ok(writer
        .as_reader()
        .state()
        .into_iter()
        .next()
        .ok_or("an empty store")?)
}

/// The heap a clone of `value` takes, in its own allocation (the inline size counted).
fn bytes_of<T: Clone>(value: &T) -> usize {
    let before = live();
    let copy = Box::new(value.clone());
    let bytes = live() - before;
    drop(copy);
    bytes
}

fn row(kind: &str, count: usize, bytes: usize, blocks: usize, in_use: usize, nodes: u64) {
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!(
        "| {kind} | {count} | {:.1} MiB | {} B | {:.1} | {:.1} MiB | {} B | {:.1} MiB |",
        mib(bytes),
        bytes / count.max(1),
        blocks as f64 / count.max(1) as f64,
        mib(in_use),
        in_use / count.max(1),
        mib(in_use) * 1000.0 / nodes as f64,
    );
}

fn main() -> BoxResult<()> {
    let n = env_num("SCALE_NODES", 5000);
    let per_node = env_num("SCALE_PODS_PER_NODE", 8);
    let pool: GpuPool = serde_json::from_value({
        let mut p = shapes::pool();
        p["metadata"]["uid"] = json!("7d3f1c2e-0a9b-4c8d-b6e5-000000000001");
        p
    })?;
    let (baseline, blocks_baseline, in_use_baseline) = (live(), blocks(), in_use());

    let nodes = held::<CachedNode, _>(
        (0..n).map(node),
        |node| Ok(serde_json::to_vec(&stored(&node, 0)?)?),
        |_| {},
        |_| true,
    )?;

    let labels: BTreeMap<String, String> = node(0)?.labels().clone();
    let desired = (0..n).map(|i| -> BoxResult<(u64, GpuNode)> {
        let name = format!("scale-{i:05}");
        Ok((i, desired_gpunode(&pool, &name, &labels).0))
    });
    let gpunodes = held::<GpuNode, _>(
        desired,
        |(i, mut gn)| {
            gn.metadata.generation = Some(1);
            let mut status = mig_node_status(&gn, &gpu_holders(i, per_node));
            status.heartbeat_time = Some(Time(Timestamp::now()));
            gn.status = Some(status);
            Ok(serde_json::to_vec(&stored(&gn, i)?)?)
        },
        {
            let mut shared = SharedSpecs::default();
            move |gn| shared.trim(gn)
        },
        |_| true,
    )?;
    let gn_parts = {
        let one = first(&gpunodes.writer)?;
        [
            ("metadata", bytes_of(&one.metadata)),
            ("spec", bytes_of(&one.spec)),
            (
                "its MIG layout, held once for all",
                bytes_of(&*one.spec.mig),
            ),
            ("status", bytes_of(&one.status)),
        ]
    };
    let each_pod = (0..n).flat_map(|i| (0..per_node).map(move |k| (i, k)));
    let pods = held::<CachedPod, _>(
        each_pod.map(|(i, k)| -> BoxResult<(u64, Pod)> {
            // The UID the API server would have given the Job of node `i`'s pods.
            let job_uid = format!("5f0c2a1e-3b4d-4c6e-9a8b-{:012}", shapes::job_of(i));
            Ok((i * per_node + k, pod(i, k, 0, &job_uid)?))
        }),
        |(uid, pod)| running(pod, uid),
        |_| {},
        keep_pod,
    )?;

    println!(
        "operator caches after the initial lists, {n} nodes × 8 GPUs, {} pods ({} \
         holding GPUs): heap held by the stores (counting allocator)\n",
        n * per_node,
        pods.count
    );
    println!(
        "| cache | objects | held | per object | allocations per object | glibc in use | per \
         object | per 1,000 nodes |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (kind, h) in [
        (
            "Node (CachedNode)",
            (nodes.count, nodes.bytes, nodes.blocks, nodes.in_use),
        ),
        (
            "GpuNode (trim_gpunode)",
            (
                gpunodes.count,
                gpunodes.bytes,
                gpunodes.blocks,
                gpunodes.in_use,
            ),
        ),
        (
            "GPU pods (CachedPod)",
            (pods.count, pods.bytes, pods.blocks, pods.in_use),
        ),
        (
            "all three",
            (
                nodes.count + gpunodes.count + pods.count,
                live() - baseline,
                blocks() - blocks_baseline,
                in_use().saturating_sub(in_use_baseline),
            ),
        ),
    ] {
        row(kind, h.0, h.1, h.2, h.3, n);
    }
    let node_parts = {
        let one = first(&nodes.writer)?;
        [
            ("all of it", bytes_of(&*one)),
            ("labels", bytes_of(one.labels())),
            ("taints", bytes_of(&one.taints().to_vec())),
        ]
    };
    let pod_parts = [("all of it", bytes_of(&*first(&pods.writer)?))];
    println!("\nheap of one cached object's parts (a clone of each, measured):");
    for (kind, parts) in [
        ("Node", &node_parts[..]),
        ("GpuNode", &gn_parts[..]),
        ("GPU pod", &pod_parts[..]),
    ] {
        let parts: Vec<String> = parts.iter().map(|(p, b)| format!("{p} {b} B")).collect();
        println!("- {kind}: {}", parts.join(", "));
    }
    println!(
        "\none object on the wire, and decoded before the cut (a paged list holds a page of these):"
    );
    for (kind, wire, decoded) in [
        (
            "Node (folded into a CachedNode as it is decoded)",
            nodes.wire,
            nodes.decoded,
        ),
        ("GpuNode", gpunodes.wire, gpunodes.decoded),
        (
            "pod (folded into a CachedPod as it is decoded)",
            pods.wire,
            pods.decoded,
        ),
    ] {
        println!("- {kind}: {wire} B of JSON, {decoded} B decoded");
    }
    Ok(())
}
