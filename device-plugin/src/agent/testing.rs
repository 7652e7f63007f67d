//! Test support for the agent's API writes: kube's mock service, answering the requests a test
//! expects in order and failing on any other (the operator's fixtures do the same).

use std::collections::BTreeSet;
use std::sync::Arc;

use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::Value;
use tokio::task::JoinHandle;
use tower_test::mock::{self, Handle};

use crate::backend::{ManualSimClock, SimBackend};
use crate::inventory::Inventory;

/// An A30 and an L4 (fixtures/mixed-small.yaml), MIG off.
pub fn inventory() -> Inventory {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join("mixed-small.yaml");
    let sim = SimBackend::from_file(&fixture, Arc::new(ManualSimClock::new())).unwrap();
    Inventory::read(&sim).unwrap()
}

/// A GpuNode named `name` of pool `p`, with default policies.
pub fn gpunode(name: &str) -> gpupool_crds::GpuNode {
    gpupool_crds::GpuNode::new(
        name,
        gpupool_crds::GpuNodeSpec {
            sharing: Default::default(),
            pool: "p".into(),
            driver: Default::default(),
            cdi: Default::default(),
            mig: Default::default(),
            utilization: Default::default(),
        },
    )
}

/// One request the agent must make, and the HTTP status it is answered with (the request body
/// echoed back on success, a Status on failure).
pub struct Expect {
    /// HTTP method.
    pub method: &'static str,
    /// The exact path.
    pub path: &'static str,
    /// Query parameters that must be present (`key=value`).
    pub query: &'static [&'static str],
    /// The answer's status code.
    pub status: u16,
    /// Checks on the JSON body.
    pub check: Box<dyn Fn(&Value) + Send>,
    /// The object answered on success; `None` echoes the request body.
    pub reply: Option<Value>,
}

/// The mock API server.
pub struct ApiMock {
    handle: Handle<Request<Body>, Response<Body>>,
}

impl ApiMock {
    /// A client talking to the mock, and the mock.
    pub fn new() -> (Client, ApiMock) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        (Client::new(service, "default"), ApiMock { handle })
    }

    /// Serves `expected` in order, then asserts that no other request comes (once every client
    /// is dropped). Await the handle to surface a failed assertion.
    pub fn serve(mut self, expected: Vec<Expect>) -> JoinHandle<()> {
        tokio::spawn(async move {
            for (i, e) in expected.into_iter().enumerate() {
                let Some((request, send)) = self.handle.next_request().await else {
                    panic!("request {i} ({} {}) never came", e.method, e.path);
                };
                let path = request.uri().path().to_owned();
                let query = request.uri().query().unwrap_or_default().to_owned();
                assert_eq!(request.method().as_str(), e.method, "request {i}: {path}");
                assert_eq!(path, e.path, "request {i}");
                let params: BTreeSet<&str> = query.split('&').collect();
                for q in e.query {
                    assert!(params.contains(q), "request {i}: {q} not in ?{query}");
                }
                let bytes = request.into_body().collect_bytes().await.unwrap();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                (e.check)(&body);
                let answer = if e.status < 300 {
                    e.reply.unwrap_or(body)
                } else {
                    serde_json::json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "message": "refused by the test", "code": e.status,
                    })
                };
                send.send_response(
                    Response::builder()
                        .status(e.status)
                        .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                        .unwrap(),
                );
            }
            if let Some((request, _)) = self.handle.next_request().await {
                panic!("unexpected request {} {}", request.method(), request.uri());
            }
        })
    }
}
