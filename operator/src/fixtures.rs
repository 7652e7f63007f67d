//! Reconcile tests against kube's mock service: each test states, request by request, what
//! the reconciler must send, and fails on anything else (controller-rs's `ApiServerVerifier`).

use std::sync::{Arc, Mutex};

use gpupool_crds::labels::{DRIVER_INVALID_TAINT, POOL_FINALIZER, POOL_LABEL};
use gpupool_crds::{GpuNode, GpuPool};
use http::{Method, Request, Response};
use k8s_openapi::api::core::v1::{Namespace, Node, NodeCondition, NodeSpec, NodeStatus, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::PartialObjectMeta;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::Value;
use tower_test::mock::{self, Handle};

use crate::context::{Context, Settings};
use crate::controller::reconcile;
use crate::error::ApiFailure;
use crate::liveness::AgentLiveness;
use crate::metrics::Metrics;
use crate::pool::tests::{labels, pool, ready_gpunode};
use crate::pool::{self, API_ERRORS, Member, StatusInput};
use crate::store;

type ApiHandle = Handle<Request<Body>, Response<Body>>;

/// One request the reconciler must make, and what the server answers.
struct Expect {
    method: Method,
    /// The path must end with this.
    path_suffix: String,
    /// Checks on the JSON body.
    check: Box<dyn Fn(&Value) + Send>,
    /// Answer: `None` echoes the request body back.
    answer: Option<Value>,
    /// The HTTP status of the answer.
    status: u16,
}

fn expect(method: Method, path_suffix: &str, check: impl Fn(&Value) + Send + 'static) -> Expect {
    Expect {
        method,
        path_suffix: path_suffix.to_owned(),
        check: Box::new(check),
        answer: None,
        status: 200,
    }
}

/// The Status an API server answers a request with when RBAC does not allow it.
fn forbidden(verb: &str, resource: &str, name: &str) -> Value {
    serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!(
            "{resource} \"{name}\" is forbidden: User \"system:serviceaccount:gpupool-system:gpupool-operator\" cannot {verb} resource \"{resource}\" in API group \"\" at the cluster scope"
        ),
        "reason": "Forbidden",
        "details": { "name": name, "kind": resource },
        "code": 403,
    })
}

/// The request, answered 403 Forbidden.
fn refused(method: Method, path_suffix: &str, verb: &str, resource: &str, name: &str) -> Expect {
    Expect {
        answer: Some(forbidden(verb, resource, name)),
        status: 403,
        ..expect(method, path_suffix, |_| {})
    }
}

/// Serves the expected requests in order, then asserts no other request comes.
async fn verify(mut handle: ApiHandle, expected: Vec<Expect>) {
    for (i, e) in expected.into_iter().enumerate() {
        let Some((request, send)) = handle.next_request().await else {
            panic!("request {i} ({} …{}) never came", e.method, e.path_suffix);
        };
        let path = request.uri().path().to_owned();
        assert_eq!(request.method(), e.method, "request {i}: {path}");
        assert!(
            path.ends_with(&e.path_suffix),
            "request {i}: {path} does not end with {}",
            e.path_suffix
        );
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (e.check)(&body);
        let answer = e.answer.unwrap_or(body);
        send.send_response(
            Response::builder()
                .status(e.status)
                .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                .unwrap(),
        );
    }
    if let Some((request, _)) = handle.next_request().await {
        panic!(
            "unexpected request {} {}",
            request.method(),
            request.uri().path()
        );
    }
}

struct Fixture {
    ctx: Arc<Context>,
    pools: Writer<DeserializeGuard<GpuPool>>,
    nodes: store::Writer<crate::cache::CachedNode>,
    gpunodes: store::Writer<GpuNode>,
    pods: store::Writer<crate::cache::CachedPod>,
    namespaces: store::Writer<PartialObjectMeta<Namespace>>,
}

impl Fixture {
    /// Every cache filled by its first list (empty), as after the operator's start.
    fn new(client: Client) -> Self {
        let mut f = Self::unsynced(client);
        f.pools.apply_watcher_event(&watcher::Event::InitDone);
        f.nodes.apply_watcher_event(&watcher::Event::InitDone);
        f.gpunodes.apply_watcher_event(&watcher::Event::InitDone);
        f.pods.apply_watcher_event(&watcher::Event::InitDone);
        f.namespaces.apply_watcher_event(&watcher::Event::InitDone);
        f
    }

    /// No cache has had its first list yet.
    fn unsynced(client: Client) -> Self {
        let (pool_store, pools) = reflector::store();
        let (node_store, nodes) = store::store();
        let (gn_store, gpunodes) = store::store();
        let (pod_store, pods) = store::store();
        let (ns_store, namespaces) = store::store();
        let ctx = Arc::new(Context {
            client: client.clone(),
            evict_client: client.clone(),
            pools: pool_store,
            nodes: node_store,
            gpunodes: gn_store,
            pods: pod_store,
            namespaces: ns_store,
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: "gpupool-operator".into(),
                    instance: None,
                },
            ),
            metrics: Arc::new(Metrics::default()),
            settings: Settings::default(),
            failures: Mutex::default(),
            evict_retry: Mutex::default(),
            liveness: Arc::default(),
            written: Mutex::default(),
            acting: tokio_util::sync::CancellationToken::new(),
            ledger: crate::context::ActionLedger::default(),
        });
        Self {
            ctx,
            pools,
            nodes,
            gpunodes,
            pods,
            namespaces,
        }
    }

    fn pool(&mut self, p: &GpuPool) {
        self.pools
            .apply_watcher_event(&watcher::Event::Apply(DeserializeGuard(Ok(p.clone()))));
    }

    fn node(&mut self, n: &Node) {
        self.nodes
            .apply_watcher_event(&watcher::Event::Apply(n.clone().into()));
    }

    /// A GpuNode, delivered now. Its agent counts as live when its status carries a stamp: the
    /// operator saw the GpuNode before that stamp (as when it created it), then the stamp arrive.
    fn gpunode(&mut self, g: &GpuNode) {
        self.gpunodes
            .apply_watcher_event(&watcher::Event::Apply(g.clone()));
        let now = Timestamp::now();
        self.ctx.liveness.observe(&g.name_any(), None, now);
        self.ctx.liveness.observe_gpunode(g, now);
    }
}

fn gpu_node(name: &str, pool_label: Option<&str>, tainted: bool) -> Node {
    let mut l = labels(&[
        ("team", "ml"),
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.count", "8"),
    ]);
    if let Some(p) = pool_label {
        l.insert(POOL_LABEL.into(), p.into());
    }
    let mut n = Node::default();
    n.metadata.name = Some(name.into());
    n.metadata.labels = Some(l);
    n.metadata.resource_version = Some("7".into());
    n.spec = Some(NodeSpec {
        taints: tainted.then(|| {
            vec![Taint {
                key: DRIVER_INVALID_TAINT.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]
        }),
        ..Default::default()
    });
    n.status = Some(NodeStatus {
        conditions: Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: "True".into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    n
}

fn with_finalizer(mut p: GpuPool) -> GpuPool {
    p.metadata.finalizers = Some(vec![POOL_FINALIZER.into()]);
    p.metadata.resource_version = Some("1".into());
    p
}

fn guard(p: &GpuPool) -> Arc<DeserializeGuard<GpuPool>> {
    Arc::new(DeserializeGuard(Ok(p.clone())))
}

async fn run(fixture: Fixture, p: &GpuPool, expected: Vec<Expect>, handle: ApiHandle) {
    let verifier = tokio::spawn(verify(handle, expected));
    let result = reconcile(guard(p), fixture.ctx.clone()).await;
    // Dropping every client ends the request stream, so the verifier sees no further request.
    drop(fixture);
    assert!(result.is_ok(), "reconcile failed: {result:?}");
    verifier.await.unwrap();
}

#[tokio::test]
async fn an_unchanged_pool_writes_nothing() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let mut p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    let node = gpu_node("n1", Some("train"), false);
    let gn = ready_gpunode(&p, "n1");
    p.status = Some(pool::pool_status(&StatusInput {
        pool: &p,
        members: vec![Member {
            node: "n1",
            gpunode: Some(&gn),
            layout_problem: None,
            node_ready: true,
            agent: AgentLiveness::Live { skew: None },
            mig_waiting: false,
        }],
        conflicts: vec![],
        selector_error: None,
        pods_to_drain: 0,
        reclaim: Default::default(),
        api_failures: vec![],
        now: "2026-03-01T00:00:00Z".parse::<Timestamp>().unwrap(),
    }));
    f.pool(&p);
    f.node(&node);
    f.gpunode(&gn);
    run(f, &p, vec![], handle).await;
}

/// After an API server restart the pool cache can lag behind this operator's own last status
/// write. A reconcile then reads the pool afresh and builds on what it finds there: here the
/// server's copy records an eviction the cached copy has not seen, and the reconcile keeps it
/// (an unchanged status: nothing is written) instead of writing the stale history back.
#[tokio::test]
async fn a_cache_behind_our_own_status_write_is_read_afresh_and_not_written_back() {
    use gpupool_crds::pool::ReclaimRecord;
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (f, stale) = train_fixture(Client::new(service, "default"), true, vec![]);
    let mut current = stale.clone();
    current.metadata.resource_version = Some("2".into());
    if let Some(st) = current.status.as_mut() {
        st.reclaim.reclaimed = 1;
        st.reclaim.history = vec![ReclaimRecord {
            pod: "ml/w".into(),
            owner: None,
            action: "Evict".into(),
            result: "Succeeded".into(),
            time: Time("2026-03-01T00:00:00Z".parse().unwrap()),
        }];
    }
    f.ctx.status_written("train", Some("2".into()));
    let expected = vec![Expect {
        answer: Some(serde_json::to_value(&current).unwrap()),
        ..expect(Method::GET, "/gpupools/train", |_| {})
    }];
    run(f, &stale, expected, handle).await;
}

/// At start or failover the Node list can arrive after the GpuNode list. A reconcile then must
/// not take every member for gone: it waits (requeues) and sends nothing, where it used to
/// delete each GpuNode as "left the pool".
#[tokio::test]
async fn nothing_is_done_before_every_cache_has_its_first_list() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::unsynced(Client::new(service, "default"));
    let p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    let gn = ready_gpunode(&p, "n1");
    f.pools.apply_watcher_event(&watcher::Event::InitDone);
    f.gpunodes.apply_watcher_event(&watcher::Event::InitDone);
    f.pods.apply_watcher_event(&watcher::Event::InitDone);
    f.namespaces.apply_watcher_event(&watcher::Event::InitDone);
    f.pool(&p);
    f.gpunode(&gn);
    assert_eq!(f.ctx.unsynced_cache(), Some("Nodes"));
    let verifier = tokio::spawn(verify(handle, vec![]));
    let action = reconcile(guard(&p), f.ctx.clone()).await;
    assert_eq!(
        action.ok(),
        Some(kube::runtime::controller::Action::requeue(
            std::time::Duration::from_secs(1)
        ))
    );
    // Once the Node list is in, the same reconcile acts (here: nothing to change).
    f.nodes.apply_watcher_event(&watcher::Event::InitDone);
    assert_eq!(f.ctx.unsynced_cache(), None);
    drop(f);
    verifier.await.unwrap();
}

#[tokio::test]
async fn a_younger_pool_reports_the_conflict_and_leaves_the_node_alone() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let old = with_finalizer(pool("old", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    let young = with_finalizer(pool("young", "2026-02-01T00:00:00Z", &[("team", "ml")]));
    f.pool(&old);
    f.pool(&young);
    f.node(&gpu_node("n1", Some("old"), false));
    f.gpunode(&ready_gpunode(&old, "n1"));
    let answer = serde_json::to_value(&young).unwrap();
    let expected = vec![
        // No GpuNode apply and no node patch: only the status, with the conflict named.
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/young/status", |body| {
                let conds = body["status"]["conditions"].as_array().unwrap();
                let conflict = conds.iter().find(|c| c["type"] == "Conflict").unwrap();
                assert_eq!(conflict["status"], "True");
                let msg = conflict["message"].as_str().unwrap();
                assert!(msg.contains("old (n1)"), "{msg}");
                let ready = conds.iter().find(|c| c["type"] == "Ready").unwrap();
                assert_eq!(ready["status"], "False");
                assert_eq!(body["status"]["nodes"], "0/0");
            })
        },
        // Events for the two transitions.
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyFalse")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictTrue")
        }),
    ];
    run(f, &young, expected, handle).await;
}

#[tokio::test]
async fn deleting_a_pool_removes_its_gpunodes_labels_taints_then_the_finalizer() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let mut p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    p.metadata.deletion_timestamp = Some(Time("2026-03-01T00:00:00Z".parse().unwrap()));
    let gn = ready_gpunode(&p, "n1");
    f.pool(&p);
    f.node(&gpu_node("n1", Some("train"), true));
    f.node(&gpu_node("n2", Some("other"), true));
    f.gpunode(&gn);
    let status = serde_json::json!({
        "apiVersion": "v1", "kind": "Status", "status": "Success", "code": 200,
        "metadata": {}, "message": "", "reason": ""
    });
    let mut done = serde_json::to_value(&p).unwrap();
    done["metadata"]["finalizers"] = serde_json::json!([]);
    let expected = vec![
        Expect {
            answer: Some(status),
            ..expect(Method::DELETE, "/gpunodes/n1", |_| {})
        },
        Expect {
            answer: Some(serde_json::to_value(gpu_node("n1", None, false)).unwrap()),
            ..expect(Method::PATCH, "/nodes/n1", |body| {
                assert_eq!(body["metadata"]["labels"][POOL_LABEL], Value::Null);
                assert_eq!(body["spec"]["taints"], serde_json::json!([]));
                assert_eq!(body["metadata"]["resourceVersion"], "7");
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "CleanedUp")
        }),
        Expect {
            answer: Some(done),
            ..expect(Method::PATCH, "/gpupools/train", |body| {
                // kube's finalizer helper: a JSON patch testing and removing our entry.
                let ops = body.as_array().unwrap();
                assert!(ops.iter().any(|op| op["op"] == "remove"), "{body}");
            })
        },
    ];
    assert_eq!(gn.owner_references()[0].uid, p.meta().uid.clone().unwrap());
    assert_eq!(p.name_any(), "train");
    run(f, &p, expected, handle).await;
}

/// A pool reclaiming in Enforce mode, its ready node n1, and on it the pod ml/w of Job
/// ml/train, idle for years and warned with a deadline long past.
fn idle_job_fixture(client: Client) -> (Fixture, GpuPool) {
    use gpupool_crds::labels::{IDLE_SINCE_ANNOTATION, RECLAIM_AT_ANNOTATION};
    use gpupool_crds::node::{Activity, GpuStatus, Idleness, PodRef};
    use gpupool_crds::policy::ReclaimMode;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus, Pod, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    let (pod_store, mut pods) = store::store::<crate::cache::CachedPod>();
    // Its first (empty) list is in; the pod arrives after.
    pods.apply_watcher_event(&watcher::Event::InitDone);
    let mut f = Fixture::new(client);
    // The fixture's pod store is empty; give this test one with the pod in it.
    if let Some(ctx) = Arc::get_mut(&mut f.ctx) {
        ctx.pods = pod_store;
    }
    let mut p = with_finalizer(pool("p", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    p.spec.reclaim.mode = ReclaimMode::Enforce;
    let mut node = gpu_node("n1", Some("p"), false);
    node.status = Some(NodeStatus {
        conditions: Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: "True".into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    let mut gn = ready_gpunode(&p, "n1");
    if let Some(s) = gn.status.as_mut() {
        s.gpus = vec![GpuStatus {
            index: 0,
            uuid: "GPU-0".into(),
            idleness: Idleness {
                activity: Activity::Idle,
                idle_since: Some(Time("2020-01-01T00:00:00Z".parse().unwrap())),
                pods: vec![PodRef {
                    namespace: "ml".into(),
                    name: "w".into(),
                    container: None,
                }],
            },
            ..Default::default()
        }];
    }
    let mut pod = Pod {
        spec: Some(PodSpec {
            node_name: Some("n1".into()),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            start_time: Some(Time("2019-06-01T00:00:00Z".parse().unwrap())),
            ..Default::default()
        }),
        ..Default::default()
    };
    pod.metadata.name = Some("w".into());
    pod.metadata.namespace = Some("ml".into());
    pod.metadata.uid = Some("pod-w-uid".into());
    pod.metadata.annotations = Some(
        [
            (IDLE_SINCE_ANNOTATION, "2020-01-01T00:00:00Z"),
            (RECLAIM_AT_ANNOTATION, "2020-01-02T00:00:00Z"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    );
    pod.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "batch/v1".into(),
        kind: "Job".into(),
        name: "train".into(),
        uid: "job-uid".into(),
        controller: Some(true),
        ..Default::default()
    }]);
    pods.apply_watcher_event(&watcher::Event::Apply(pod.into()));
    f.pool(&p);
    f.node(&node);
    f.gpunode(&gn);
    (f, p)
}

fn job_train() -> Value {
    serde_json::json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": { "name": "train", "namespace": "ml" },
        "spec": { "suspend": false, "template": { "spec": { "containers": [] } } },
    })
}

/// An idle pod evicted at its deadline is evicted as the object that was judged: the
/// eviction carries its UID, so a pod of the same name created since is left alone.
#[tokio::test]
async fn an_eviction_names_the_pods_uid() {
    use gpupool_crds::policy::ReclaimAction;
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (mut f, mut p) = idle_job_fixture(Client::new(service, "default"));
    p.spec.reclaim.action = ReclaimAction::Evict;
    f.pool(&p);
    let answer = serde_json::to_value(&p).unwrap();
    let success = serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"});
    let expected = vec![
        Expect {
            answer: Some(success),
            ..expect(Method::POST, "/namespaces/ml/pods/w/eviction", |body| {
                assert_eq!(
                    body["deleteOptions"]["preconditions"]["uid"], "pod-w-uid",
                    "{body}"
                );
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "Reclaimed");
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReclaimAction")
        }),
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/p/status", |body| {
                let r = &body["status"]["reclaim"];
                assert_eq!(r["history"][0]["action"], "Evict");
                assert_eq!(r["history"][0]["result"], "Succeeded");
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyTrue")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictFalse")
        }),
    ];
    run(f, &p, expected, handle).await;
}

#[tokio::test]
async fn an_idle_job_pod_past_its_deadline_gets_its_job_suspended_once() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (f, p) = idle_job_fixture(Client::new(service, "default"));
    let answer = serde_json::to_value(&p).unwrap();
    let expected = vec![
        Expect {
            answer: Some(job_train()),
            ..expect(Method::GET, "/namespaces/ml/jobs/train", |_| {})
        },
        Expect {
            answer: Some(job_train()),
            ..expect(Method::PATCH, "/namespaces/ml/jobs/train", |body| {
                assert_eq!(body["spec"]["suspend"], true)
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "Reclaimed");
            assert_eq!(body["regarding"]["name"], "w");
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReclaimAction")
        }),
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/p/status", |body| {
                let r = &body["status"]["reclaim"];
                assert_eq!(r["reclaimed"], 1);
                assert_eq!(r["warned"], 0);
                assert_eq!(r["history"][0]["action"], "Suspend");
                assert_eq!(r["history"][0]["owner"], "Job/train");
                assert_eq!(r["history"][0]["result"], "Succeeded");
                assert_eq!(r["history"][0]["pod"], "ml/w");
                assert_eq!(condition_of(body, API_ERRORS)["status"], "False");
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyTrue")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictFalse")
        }),
    ];
    run(f, &p, expected, handle).await;
}

/// The condition of this type in a status patch.
fn condition_of<'a>(body: &'a Value, type_: &str) -> &'a Value {
    body["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {body}"))
}

/// Like [`run`], for a reconcile that must fail; returns its error.
async fn run_failing(
    fixture: Fixture,
    p: &GpuPool,
    expected: Vec<Expect>,
    handle: ApiHandle,
) -> crate::Error {
    let verifier = tokio::spawn(verify(handle, expected));
    let result = reconcile(guard(p), fixture.ctx.clone()).await;
    drop(fixture);
    verifier.await.unwrap();
    match result {
        Ok(action) => panic!("the reconcile succeeded: {action:?}"),
        Err(e) => e,
    }
}

/// Pool `train` with its GpuNode on n1 reported ready, and a status computed with these
/// failures; n1 carries the pool label only when `labelled`.
fn train_fixture(client: Client, labelled: bool, failures: Vec<ApiFailure>) -> (Fixture, GpuPool) {
    let mut f = Fixture::new(client);
    let mut p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    let gn = ready_gpunode(&p, "n1");
    p.status = Some(pool::pool_status(&StatusInput {
        pool: &p,
        members: vec![Member {
            node: "n1",
            gpunode: Some(&gn),
            layout_problem: None,
            node_ready: true,
            agent: AgentLiveness::Live { skew: None },
            mig_waiting: false,
        }],
        conflicts: vec![],
        selector_error: None,
        pods_to_drain: 0,
        reclaim: Default::default(),
        api_failures: failures,
        now: "2026-03-01T00:00:00Z".parse::<Timestamp>().unwrap(),
    }));
    f.pool(&p);
    f.node(&gpu_node("n1", labelled.then_some("train"), false));
    f.gpunode(&gn);
    (f, p)
}

/// The failure the refused node patch of [`train_fixture`]'s n1 makes.
fn node_patch_refused() -> ApiFailure {
    let status: kube::core::Status =
        serde_json::from_value(forbidden("patch", "nodes", "n1")).unwrap();
    ApiFailure::new(
        "patch",
        "nodes",
        "labelling/tainting node n1",
        &kube::Error::Api(Box::new(status)),
    )
}

#[tokio::test]
async fn a_forbidden_node_patch_is_named_in_the_status_with_a_warning_event() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (f, p) = train_fixture(Client::new(service, "default"), false, vec![]);
    assert_eq!(
        pool::condition_status(p.status.as_ref().unwrap(), "Ready"),
        Some("True")
    );
    let answer = serde_json::to_value(&p).unwrap();
    let expected = vec![
        refused(Method::PATCH, "/nodes/n1", "patch", "nodes", "n1"),
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/train/status", |body| {
                let c = condition_of(body, API_ERRORS);
                assert_eq!(c["status"], "True");
                assert_eq!(c["reason"], "Forbidden");
                let msg = c["message"].as_str().unwrap();
                for part in [
                    "the operator cannot patch nodes: forbidden",
                    "check the chart's ClusterRole",
                    "labelling/tainting node n1",
                    "cannot patch resource \"nodes\"",
                ] {
                    assert!(msg.contains(part), "{part:?} not in {msg}");
                }
                let ready = condition_of(body, "Ready");
                assert_eq!(ready["status"], "False");
                assert_eq!(ready["reason"], API_ERRORS);
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyFalse");
            assert_eq!(body["type"], "Warning");
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "APIErrorsTrue");
            assert_eq!(body["type"], "Warning");
            assert_eq!(body["regarding"]["kind"], "GpuPool");
            let note = body["note"].as_str().unwrap();
            assert!(note.contains("cannot patch nodes: forbidden"), "{note}");
        }),
    ];
    let error = run_failing(f, &p, expected, handle).await;
    // The reconcile still fails, so it is retried with backoff and logged as before.
    let text = error.to_string();
    assert!(text.contains("labelling/tainting node n1"), "{text}");
    assert!(text.contains("forbidden"), "{text}");
}

#[tokio::test]
async fn a_failure_already_reported_writes_nothing_more() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (f, p) = train_fixture(
        Client::new(service, "default"),
        false,
        vec![node_patch_refused()],
    );
    let expected = vec![refused(Method::PATCH, "/nodes/n1", "patch", "nodes", "n1")];
    run_failing(f, &p, expected, handle).await;
}

#[tokio::test]
async fn the_condition_clears_with_an_event_once_the_call_succeeds() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (f, p) = train_fixture(
        Client::new(service, "default"),
        false,
        vec![node_patch_refused()],
    );
    let st = p.status.as_ref().unwrap();
    assert_eq!(pool::condition_status(st, API_ERRORS), Some("True"));
    assert_eq!(pool::condition_status(st, "Ready"), Some("False"));
    let answer = serde_json::to_value(&p).unwrap();
    let expected = vec![
        Expect {
            answer: Some(serde_json::to_value(gpu_node("n1", Some("train"), false)).unwrap()),
            ..expect(Method::PATCH, "/nodes/n1", |body| {
                assert_eq!(body["metadata"]["labels"][POOL_LABEL], "train")
            })
        },
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/train/status", |body| {
                let c = condition_of(body, API_ERRORS);
                assert_eq!(c["status"], "False");
                assert_eq!(c["reason"], "NoErrors");
                assert_eq!(condition_of(body, "Ready")["status"], "True");
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyTrue")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "APIErrorsFalse");
            assert_eq!(body["type"], "Normal");
        }),
    ];
    run(f, &p, expected, handle).await;
}

#[tokio::test]
async fn a_forbidden_finalizer_patch_is_reported_in_the_status() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let mut p = pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]);
    p.metadata.resource_version = Some("1".into());
    f.pool(&p);
    let answer = serde_json::to_value(&p).unwrap();
    let expected = vec![
        refused(
            Method::PATCH,
            "/gpupools/train",
            "patch",
            "gpupools",
            "train",
        ),
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/train/status", |body| {
                let c = condition_of(body, API_ERRORS);
                assert_eq!(c["status"], "True");
                let msg = c["message"].as_str().unwrap();
                assert!(
                    msg.contains("cannot patch gpupools: forbidden")
                        && msg.contains("adding the finalizer"),
                    "{msg}"
                );
                assert_eq!(condition_of(body, "Ready")["reason"], API_ERRORS);
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyFalse")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "APIErrorsTrue")
        }),
    ];
    run_failing(f, &p, expected, handle).await;
}

#[tokio::test]
async fn a_refused_job_suspension_is_recorded_and_named_without_failing_the_reconcile() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (f, p) = idle_job_fixture(Client::new(service, "default"));
    let answer = serde_json::to_value(&p).unwrap();
    let expected = vec![
        Expect {
            answer: Some(job_train()),
            ..expect(Method::GET, "/namespaces/ml/jobs/train", |_| {})
        },
        refused(
            Method::PATCH,
            "/namespaces/ml/jobs/train",
            "patch",
            "jobs",
            "train",
        ),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReclaimBlocked");
            assert_eq!(body["type"], "Warning");
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReclaimAction")
        }),
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/p/status", |body| {
                let r = &body["status"]["reclaim"];
                assert_eq!(r["reclaimed"], 0);
                assert_eq!(r["history"][0]["action"], "Suspend");
                assert_eq!(r["history"][0]["result"], "Failed");
                let c = condition_of(body, API_ERRORS);
                assert_eq!(c["status"], "True");
                let msg = c["message"].as_str().unwrap();
                assert!(
                    msg.contains("cannot patch jobs: forbidden")
                        && msg.contains("suspending Job ml/train"),
                    "{msg}"
                );
                // The nodes are fine: a refused reclaim does not make the pool unready.
                assert_eq!(condition_of(body, "Ready")["status"], "True");
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyTrue")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictFalse")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "APIErrorsTrue");
            assert_eq!(body["type"], "Warning");
        }),
    ];
    run(f, &p, expected, handle).await;
}

#[tokio::test]
async fn a_refused_gpunode_write_does_not_stop_the_rest_of_the_reconcile() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    f.pool(&p);
    f.node(&gpu_node("n1", None, false));
    let answer = serde_json::to_value(&p).unwrap();
    let expected = vec![
        refused(Method::PATCH, "/gpunodes/n1", "patch", "gpunodes", "n1"),
        // No NodeJoined Event: the node has not joined until its GpuNode exists. The label
        // still goes on.
        Expect {
            answer: Some(serde_json::to_value(gpu_node("n1", Some("train"), false)).unwrap()),
            ..expect(Method::PATCH, "/nodes/n1", |body| {
                assert_eq!(body["metadata"]["labels"][POOL_LABEL], "train")
            })
        },
        Expect {
            answer: Some(answer),
            ..expect(Method::PATCH, "/gpupools/train/status", |body| {
                let c = condition_of(body, API_ERRORS);
                assert_eq!(c["status"], "True");
                let msg = c["message"].as_str().unwrap();
                assert!(msg.contains("cannot patch gpunodes: forbidden"), "{msg}");
                assert_eq!(body["status"]["problems"][0]["reason"], "NotReported");
            })
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyFalse")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictFalse")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "APIErrorsTrue")
        }),
    ];
    let error = run_failing(f, &p, expected, handle).await;
    assert!(error.to_string().contains("applying GpuNode n1"), "{error}");
}

/// The requests of a reconcile that ends well with a status write: the write (checked by
/// `check`, answered with `pool`), then the Ready and Conflict condition Events.
fn status_write_then_conditions(
    pool: &GpuPool,
    check: impl Fn(&Value) + Send + 'static,
) -> Vec<Expect> {
    vec![
        Expect {
            answer: Some(serde_json::to_value(pool).unwrap()),
            ..expect(Method::PATCH, "/gpupools/p/status", check)
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyTrue")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictFalse")
        }),
    ]
}

/// An eviction whose status write the API server then refuses: the history that carries it is
/// lost with the write, but the next pass does not spend the rate limit again. It finds the
/// action in the ledger, leaves the still-listed pod alone (one action allowed per window) and
/// writes the history back.
#[tokio::test]
async fn a_refused_status_write_after_an_eviction_does_not_spend_the_rate_limit_twice() {
    use gpupool_crds::policy::ReclaimAction;
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (mut f, mut p) = idle_job_fixture(Client::new(service, "default"));
    p.spec.reclaim.action = ReclaimAction::Evict;
    p.spec.reclaim.rate_limit.max_actions = 1;
    f.pool(&p);
    let success = serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"});
    let unavailable = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "etcdserver: request timed out", "reason": "InternalError", "code": 500,
    });
    let first = vec![
        Expect {
            answer: Some(success),
            ..expect(Method::POST, "/namespaces/ml/pods/w/eviction", |_| {})
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "Reclaimed");
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReclaimAction")
        }),
        Expect {
            answer: Some(unavailable),
            status: 500,
            ..expect(Method::PATCH, "/gpupools/p/status", |_| {})
        },
    ];
    let verifier = tokio::spawn(verify(handle, first));
    let result = reconcile(guard(&p), f.ctx.clone()).await;
    assert!(result.is_err(), "the refused status write is an error");

    // The pod is still listed (its eviction has not reached the cache) and its warning is
    // long past: only the ledger knows it was already acted on.
    let (service, handle2) = mock::pair::<Request<Body>, Response<Body>>();
    if let Some(ctx) = Arc::get_mut(&mut f.ctx) {
        ctx.client = Client::new(service.clone(), "default");
        ctx.evict_client = Client::new(service.clone(), "default");
        ctx.recorder = Recorder::new(
            Client::new(service, "default"),
            Reporter {
                controller: "gpupool-operator".into(),
                instance: None,
            },
        );
    } else {
        panic!("the context is shared");
    }
    verifier.await.unwrap();
    let second = status_write_then_conditions(&p, |body| {
        let h = body["status"]["reclaim"]["history"].as_array().unwrap();
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h[0]["pod"], "ml/w");
        assert_eq!(h[0]["result"], "Succeeded");
        assert_eq!(body["status"]["reclaim"]["reclaimed"], 1);
    });
    run(f, &p, second, handle2).await;
}

/// Leadership lost (or shutdown begun) while a reconcile runs: it writes nothing disruptive
/// from then on, though the pod is past its deadline.
#[tokio::test]
async fn a_lost_lease_stops_disruptive_writes_at_once() {
    use gpupool_crds::policy::ReclaimAction;
    for action in [ReclaimAction::Evict, ReclaimAction::Auto] {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let (mut f, mut p) = idle_job_fixture(Client::new(service, "default"));
        p.spec.reclaim.action = action;
        f.pool(&p);
        f.ctx.acting.cancel();
        let expected = status_write_then_conditions(&p, |body| {
            assert_eq!(body["status"]["reclaim"]["history"], Value::Null, "{body}");
        });
        run(f, &p, expected, handle).await;
    }
}

/// A reconcile of `p` by a replica that lost its lease: only the pool status is written
/// (checked by `check`), with its Ready and Conflict Events, and the reconcile fails naming
/// `what` as not written.
async fn run_without_lease(
    f: Fixture,
    p: &GpuPool,
    handle: ApiHandle,
    check: impl Fn(&Value) + Send + 'static,
    what: &str,
) {
    f.ctx.acting.cancel();
    let expected = vec![
        Expect {
            answer: Some(serde_json::to_value(p).unwrap()),
            ..expect(Method::PATCH, "/gpupools/train/status", check)
        },
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ReadyFalse")
        }),
        expect(Method::POST, "/events", |body| {
            assert_eq!(body["reason"], "ConflictFalse")
        }),
    ];
    let error = run_failing(f, p, expected, handle).await;
    assert!(
        error.to_string().contains(&format!(
            "{what}: not written, this replica no longer leads"
        )),
        "{error}"
    );
}

/// A replica that lost its lease hands no node a new desired state: a node the pool has just
/// selected gets no GpuNode (which would carry a MIG layout and a sharing mode to drain for)
/// and no pool label or fence. Only the pool status is written, and the reconcile fails, so
/// it is retried by whoever leads next.
#[tokio::test]
async fn a_lost_lease_hands_no_node_a_new_desired_state() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    f.pool(&p);
    f.node(&gpu_node("n1", None, false));
    run_without_lease(
        f,
        &p,
        handle,
        |body| assert_eq!(body["status"]["problems"][0]["reason"], "NotReported"),
        "applying GpuNode n1",
    )
    .await;
}

/// A replica that lost its lease takes no node out of its pool either: the GpuNode of a node
/// the selector no longer matches stays until whoever leads next deletes it.
#[tokio::test]
async fn a_lost_lease_deletes_no_gpunode() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut f = Fixture::new(Client::new(service, "default"));
    let p = with_finalizer(pool("train", "2026-01-01T00:00:00Z", &[("team", "ml")]));
    f.pool(&p);
    // n1 no longer matches the pool's selector (nor carries its label), but still has the
    // pool's GpuNode.
    let mut node = gpu_node("n1", None, false);
    node.metadata.labels.get_or_insert_default().remove("team");
    f.node(&node);
    f.gpunode(&ready_gpunode(&p, "n1"));
    run_without_lease(f, &p, handle, |_| {}, "deleting GpuNode n1").await;
}

/// An operator (re)started into a cluster whose agent last wrote two hours ago, "idle": the
/// report is shown (Ready, with the node named as unconfirmed) but nothing is done on it, not
/// even with the pod long past its deadline.
#[tokio::test]
async fn a_report_first_seen_after_a_restart_is_not_acted_on() {
    use gpupool_crds::policy::ReclaimAction;
    use k8s_openapi::jiff::SignedDuration;
    for action in [ReclaimAction::Evict, ReclaimAction::Auto] {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let (mut f, mut p) = idle_job_fixture(Client::new(service, "default"));
        p.spec.reclaim.action = action;
        f.pool(&p);
        let now = Timestamp::now();
        let two_hours_ago = now.checked_sub(SignedDuration::from_hours(2)).unwrap();
        f.ctx.liveness.forget("n1");
        f.ctx.liveness.observe("n1", Some(two_hours_ago), now);
        let expected = status_write_then_conditions(&p, |body| {
            assert_eq!(body["status"]["reclaim"]["history"], Value::Null, "{body}");
            let problems = body["status"]["problems"].as_array().unwrap();
            assert!(
                problems
                    .iter()
                    .any(|pr| pr["node"] == "n1" && pr["reason"] == "AgentUnconfirmed"),
                "{problems:?}"
            );
        });
        run(f, &p, expected, handle).await;
    }
}
