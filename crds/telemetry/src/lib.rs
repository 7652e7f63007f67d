//! The HTTP endpoints every gpupool binary serves: `/metrics` (a prometheus-client registry in
//! the OpenMetrics text format), `/healthz` and `/readyz`.
//!
//! The operator and the node agent both serve through [`serve`], so probes, content types and
//! error handling behave the same in both.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

#[cfg(feature = "testing")]
pub mod testing;

/// The `Content-Type` of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A client that never finishes its request headers is dropped after this long, so idle or
/// slow connections cannot pile up.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What can fail while serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listening socket could not be opened.
    #[error("binding the metrics and health endpoint to {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The listening socket failed.
    #[error("accepting a connection on the metrics and health endpoint: {0}")]
    Accept(#[source] std::io::Error),
    /// A collector failed to encode its metrics.
    #[error("encoding the metrics registry in the OpenMetrics text format")]
    Encode(#[source] std::fmt::Error),
}

/// A check run on each `/readyz` request.
pub type Check = Box<dyn Fn() -> bool + Send + Sync>;

/// What the endpoints report.
pub struct HttpState {
    /// The metrics `/metrics` encodes.
    pub registry: Registry,
    /// Set once the binary can do its work; `/readyz` answers 503 until then (or until the
    /// check given to [`HttpState::ready_when`] passes).
    pub ready: AtomicBool,
    readiness: Option<Check>,
    liveness: Option<LiveCheck>,
}

/// A liveness check: `Err` says why the process should be restarted.
pub type LiveCheck = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

impl HttpState {
    /// A state with nothing ready yet and `/healthz` answering 200 (until a check given to
    /// [`HttpState::live_when`] fails).
    pub fn new(registry: Registry) -> Self {
        Self {
            registry,
            ready: AtomicBool::new(false),
            readiness: None,
            liveness: None,
        }
    }

    /// `/healthz` answers 503 with the check's message while `check` fails: for a binary
    /// whose work can hang (a stuck driver call) in a way only a restart cures.
    pub fn live_when(
        mut self,
        check: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.liveness = Some(Box::new(check));
        self
    }

    /// `/healthz`'s verdict.
    pub fn liveness(&self) -> Result<(), String> {
        self.liveness.as_ref().map_or(Ok(()), |check| check())
    }

    /// Also counts as ready whenever `check` passes: for a binary that keeps its readiness
    /// in its own state rather than in [`HttpState::ready`].
    pub fn ready_when(mut self, check: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.readiness = Some(Box::new(check));
        self
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) || self.readiness.as_ref().is_some_and(|check| check())
    }
}

/// The OpenMetrics text exposition of a registry, `# EOF` included.
pub fn encode(registry: &Registry) -> Result<String, Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).map_err(Error::Encode)?;
    Ok(out)
}

fn response(code: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn text(code: StatusCode, body: &str) -> Response<Full<Bytes>> {
    response(code, "text/plain; charset=utf-8", format!("{body}\n"))
}

/// Answers one request; only the method and the path matter (a query string is ignored).
fn respond(state: &HttpState, method: &Method, path: &str) -> Response<Full<Bytes>> {
    // Probes and scrapers only read; anything else is a client mistake worth telling apart
    // from a missing path.
    if method != Method::GET && method != Method::HEAD {
        let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, "GET only");
        resp.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    match path {
        "/metrics" => match encode(&state.registry) {
            Ok(body) => response(StatusCode::OK, METRICS_CONTENT_TYPE, body),
            Err(e) => {
                warn!(error = %e, "serving /metrics");
                text(StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed")
            }
        },
        "/healthz" => match state.liveness() {
            Ok(()) => text(StatusCode::OK, "ok"),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, &why),
        },
        "/readyz" if state.is_ready() => text(StatusCode::OK, "ok"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready"),
        _ => text(StatusCode::NOT_FOUND, "not found"),
    }
}

/// Binds `addr` and serves until `shutdown` is cancelled.
pub async fn serve(
    addr: SocketAddr,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    serve_on(listener, state, shutdown).await
}

/// Serves on a bound listener until `shutdown` is cancelled; connections already open finish
/// their current request on their own.
pub async fn serve_on(
    listener: TcpListener,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let addr = listener.local_addr().map_err(Error::Accept)?;
    // The e2e harness finds a server's port by this message and its `addr=` field.
    info!(addr = %addr, "serving /metrics, /healthz, /readyz");
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted.map_err(Error::Accept)?,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let resp = respond(&state, req.method(), req.uri().path());
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use http_body_util::BodyExt;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;

    use super::*;
    use crate::testing::request;

    async fn body(resp: Response<Full<Bytes>>) -> String {
        let bytes = resp.into_body().collect().await.map(|b| b.to_bytes());
        String::from_utf8(bytes.unwrap_or_default().to_vec()).unwrap()
    }

    fn content_type(resp: &Response<Full<Bytes>>) -> &str {
        resp.headers()[CONTENT_TYPE].to_str().unwrap()
    }

    #[test]
    fn endpoints() {
        let state = HttpState::new(Registry::default());
        assert_eq!(
            respond(&state, &Method::GET, "/healthz").status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&state, &Method::GET, "/readyz").status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        state.ready.store(true, Ordering::Relaxed);
        assert_eq!(
            respond(&state, &Method::GET, "/readyz").status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&state, &Method::GET, "/metrics").status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&state, &Method::GET, "/nope").status(),
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let mut registry = Registry::default();
        let hits: Counter = Counter::default();
        let depth: Gauge = Gauge::default();
        registry.register("gpupool_test_hits", "Hits", hits.clone());
        registry.register("gpupool_test_depth", "Depth", depth.clone());
        hits.inc();
        depth.set(3);
        let state = HttpState::new(registry);
        let resp = respond(&state, &Method::GET, "/metrics");
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(content_type(&resp), METRICS_CONTENT_TYPE);
        assert_eq!(
            body(resp).await,
            "# HELP gpupool_test_hits Hits.\n\
             # TYPE gpupool_test_hits counter\n\
             gpupool_test_hits_total 1\n\
             # HELP gpupool_test_depth Depth.\n\
             # TYPE gpupool_test_depth gauge\n\
             gpupool_test_depth 3\n\
             # EOF\n"
        );
    }

    #[test]
    fn only_reads_are_allowed() {
        let state = HttpState::new(Registry::default());
        let resp = respond(&state, &Method::POST, "/metrics");
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(resp.headers()[ALLOW], "GET, HEAD");
        assert_eq!(
            respond(&state, &Method::HEAD, "/healthz").status(),
            StatusCode::OK
        );
    }

    #[test]
    fn a_hook_decides_readiness() {
        let flag = Arc::new(AtomicU64::new(0));
        let r = flag.clone();
        let state =
            HttpState::new(Registry::default()).ready_when(move || r.load(Ordering::Relaxed) >= 1);
        let status = |path| respond(&state, &Method::GET, path).status();
        assert_eq!(status("/readyz"), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status("/healthz"), StatusCode::OK);
        flag.store(1, Ordering::Relaxed);
        assert_eq!(status("/readyz"), StatusCode::OK);
        assert_eq!(status("/healthz"), StatusCode::OK);
    }

    #[tokio::test]
    async fn a_hook_decides_liveness_and_says_why() {
        let flag = Arc::new(AtomicU64::new(0));
        let r = flag.clone();
        let state = HttpState::new(Registry::default()).live_when(move || {
            if r.load(Ordering::Relaxed) == 0 {
                Ok(())
            } else {
                Err("stuck for 200s".into())
            }
        });
        assert_eq!(
            respond(&state, &Method::GET, "/healthz").status(),
            StatusCode::OK
        );
        flag.store(1, Ordering::Relaxed);
        let resp = respond(&state, &Method::GET, "/healthz");
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body(resp).await, "stuck for 200s\n");
        // Liveness is not readiness.
        assert_eq!(
            respond(&state, &Method::GET, "/readyz").status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[tokio::test]
    async fn serves_over_tcp_until_cancelled() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(HttpState::new(Registry::default()));
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_on(listener, state.clone(), shutdown.clone()));

        let metrics = request(addr, "GET /metrics?x=1 HTTP/1.1").await.unwrap();
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(
            metrics
                .to_ascii_lowercase()
                .contains(&format!("content-type: {METRICS_CONTENT_TYPE}")),
            "{metrics}"
        );
        assert!(metrics.ends_with("# EOF\n"), "{metrics}");
        let healthz = request(addr, "GET /healthz HTTP/1.1").await.unwrap();
        assert!(healthz.starts_with("HTTP/1.1 200"), "{healthz}");
        let readyz = request(addr, "GET /readyz HTTP/1.1").await.unwrap();
        assert!(readyz.starts_with("HTTP/1.1 503"), "{readyz}");
        state.ready.store(true, Ordering::Relaxed);
        let readyz = request(addr, "GET /readyz HTTP/1.1").await.unwrap();
        assert!(readyz.starts_with("HTTP/1.1 200"), "{readyz}");
        let missing = request(addr, "GET /nope HTTP/1.1").await.unwrap();
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = request(addr, "POST /metrics HTTP/1.1").await.unwrap();
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let head = request(addr, "HEAD /healthz HTTP/1.1").await.unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.ends_with("\r\n\r\n"),
            "a HEAD answer has no body: {head}"
        );

        shutdown.cancel();
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn bind_failure_names_the_address() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();
        let err = serve(
            addr,
            Arc::new(HttpState::new(Registry::default())),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
