//! The HTTP endpoints every gpupool binary serves: `/metrics` (a prometheus-client registry in
//! the OpenMetrics text format), `/healthz` and `/readyz`.
//!
//! The operator and the node agent both serve through [`serve`], so probes, content types and
//! error handling behave the same in both.
//!
//! Any pod that can reach the port can open connections, so the server bounds what they
//! cost ([`Limits`]): a cap on open connections, a header read timeout and a maximum
//! connection age. A failed `accept()` is retried after a short pause rather than ending the
//! server, since a dead server fails `/healthz` and gets the binary restarted.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

#[cfg(feature = "testing")]
pub mod testing;

/// The `Content-Type` of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
    /// The listening socket's address could not be read (failed accepts are retried, never
    /// returned).
    #[error("reading the local address of the metrics and health endpoint's listener: {0}")]
    LocalAddr(#[source] std::io::Error),
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

/// The most connections the server holds open at once, unless [`Limits`] say otherwise.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// A client that never finishes its request headers is dropped after this long, so idle or
/// slow connections cannot pile up. It also bounds an idle keep-alive connection: hyper starts
/// the same timer again as soon as a response is written.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// No connection stays open longer than this, whatever it does: a client that sends a request
/// and never reads the answer would otherwise hold its slot for good.
pub const DEFAULT_MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);

/// The first pause after a failed `accept()`; each further failure doubles it.
const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);

/// The longest pause between `accept()` attempts.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How much of the process one client can take. At most `max_connections` are open at once:
/// a new connection past the cap closes the oldest open one, so a flood of idle connections
/// cannot hold `/healthz` behind it (the kubelet's probe, a fresh connection that asks at once,
/// is answered before a flood could push it out), and memory stays bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most connections open at once (at least 1).
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers, first or next.
    pub header_read_timeout: Duration,
    /// How long a connection may stay open at all.
    pub max_connection_age: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_connection_age: DEFAULT_MAX_CONNECTION_AGE,
        }
    }
}

/// The pause before the next `accept()` after failures: 10 ms doubling to 1 s, back to 10 ms
/// after a success. A failed accept (EMFILE, ECONNABORTED, ENOBUFS) is nearly always
/// transient; retrying at once would spin on a full file table, and giving up would take
/// `/healthz` down with it.
#[derive(Debug)]
struct AcceptBackoff {
    next: Duration,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self {
            next: ACCEPT_BACKOFF_FIRST,
        }
    }
}

impl AcceptBackoff {
    /// Records a failure; returns how long to wait before trying again.
    fn failed(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(ACCEPT_BACKOFF_MAX);
        pause
    }

    /// Records a success: the next failure waits the shortest pause again.
    fn succeeded(&mut self) {
        self.next = ACCEPT_BACKOFF_FIRST;
    }
}

/// Where connections come from: a TCP listener in production, an in-memory queue in tests
/// (which can also hand out the errors a real listener gives under pressure).
trait Acceptor: Send {
    /// One accepted connection.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Waits for the next connection.
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

impl Acceptor for TcpListener {
    type Stream = TcpStream;

    async fn accept(&mut self) -> io::Result<TcpStream> {
        TcpListener::accept(self).await.map(|(stream, _)| stream)
    }
}

/// Binds `addr` and serves until `shutdown` is cancelled, within the default [`Limits`].
pub async fn serve(
    addr: SocketAddr,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    serve_with_limits(addr, state, shutdown, Limits::default()).await
}

/// [`serve`] within `limits`.
pub async fn serve_with_limits(
    addr: SocketAddr,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
    limits: Limits,
) -> Result<(), Error> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    serve_on_with_limits(listener, state, shutdown, limits).await
}

/// Serves on a bound listener until `shutdown` is cancelled, within the default [`Limits`];
/// connections already open finish their current request on their own.
pub async fn serve_on(
    listener: TcpListener,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    serve_on_with_limits(listener, state, shutdown, Limits::default()).await
}

/// [`serve_on`] within `limits`.
pub async fn serve_on_with_limits(
    listener: TcpListener,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
    limits: Limits,
) -> Result<(), Error> {
    let addr = listener.local_addr().map_err(Error::LocalAddr)?;
    // The e2e harness finds a server's port by this message and its `addr=` field.
    info!(
        addr = %addr,
        max_connections = limits.max_connections,
        "serving /metrics, /healthz, /readyz"
    );
    serve_accepted(listener, state, shutdown, limits).await;
    Ok(())
}

/// The open connections, oldest first, each with the token that closes it.
#[derive(Debug, Default)]
struct Open {
    next_id: u64,
    connections: VecDeque<(u64, CancellationToken)>,
}

impl Open {
    /// Registers a new connection; past `cap`, closes the oldest ones to make room.
    fn admit(&mut self, cap: usize) -> (u64, CancellationToken) {
        while self.connections.len() >= cap.max(1) {
            let Some((_, oldest)) = self.connections.pop_front() else {
                break;
            };
            oldest.cancel();
        }
        let id = self.next_id;
        self.next_id += 1;
        let token = CancellationToken::new();
        self.connections.push_back((id, token.clone()));
        (id, token)
    }

    /// Forgets a connection that ended.
    fn forget(&mut self, id: u64) {
        if let Some(at) = self.connections.iter().position(|(i, _)| *i == id) {
            self.connections.remove(at);
        }
    }
}

/// The accept loop. Every connection is accepted at once; past the cap the oldest open one is
/// closed to make room, so whoever floods the port only pushes out its own older connections,
/// and the timeouts close the rest. A failed accept is logged and retried after
/// [`AcceptBackoff`]'s pause; only `shutdown` ends the loop.
async fn serve_accepted<A: Acceptor>(
    mut acceptor: A,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
    limits: Limits,
) {
    let open = Arc::new(Mutex::new(Open::default()));
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = acceptor.accept() => accepted,
        };
        let stream = match accepted {
            Ok(stream) => {
                backoff.succeeded();
                stream
            }
            Err(error) => {
                let pause = backoff.failed();
                warn!(
                    error = %error,
                    retry_in_ms = pause.as_millis(),
                    "accepting a connection on the metrics and health endpoint failed; retrying"
                );
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(pause) => continue,
                }
            }
        };
        let (id, closed) = open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(limits.max_connections);
        let open = open.clone();
        let state = state.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = serve_connection(stream, state, limits) => {}
                () = closed.cancelled() => debug!(
                    max_connections = limits.max_connections,
                    "closed the oldest connection to the metrics and health endpoint to make room"
                ),
            }
            open.lock().unwrap_or_else(|e| e.into_inner()).forget(id);
        });
    }
}

/// Serves one connection until it ends, times out or reaches its maximum age.
async fn serve_connection<S>(stream: S, state: Arc<HttpState>, limits: Limits)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = service_fn(move |req: Request<Incoming>| {
        let resp = respond(&state, req.method(), req.uri().path());
        async move { Ok::<_, Infallible>(resp) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(stream), svc);
    match tokio::time::timeout(limits.max_connection_age, connection).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => debug!(error = %e, "HTTP connection ended with an error"),
        Err(_) => debug!(
            max_age_s = limits.max_connection_age.as_secs(),
            "closed an HTTP connection open past its maximum age"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize};

    use http_body_util::BodyExt;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio::sync::mpsc;

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

    /// An [`Acceptor`] fed by the test: streams or errors, in order; it counts the
    /// connections the server has taken.
    struct QueueAcceptor {
        queue: mpsc::UnboundedReceiver<io::Result<DuplexStream>>,
        taken: Arc<AtomicUsize>,
    }

    impl Acceptor for QueueAcceptor {
        type Stream = DuplexStream;

        async fn accept(&mut self) -> io::Result<DuplexStream> {
            match self.queue.recv().await {
                Some(accepted) => {
                    if accepted.is_ok() {
                        self.taken.fetch_add(1, Ordering::SeqCst);
                    }
                    accepted
                }
                // Like a listener nobody connects to.
                None => std::future::pending().await,
            }
        }
    }

    /// A server on a [`QueueAcceptor`]: the queue's sender, the taken count, the shutdown
    /// token and the server's task.
    fn queue_server(
        limits: Limits,
    ) -> (
        mpsc::UnboundedSender<io::Result<DuplexStream>>,
        Arc<AtomicUsize>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, queue) = mpsc::unbounded_channel();
        let taken = Arc::new(AtomicUsize::new(0));
        let acceptor = QueueAcceptor {
            queue,
            taken: taken.clone(),
        };
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_accepted(
            acceptor,
            Arc::new(HttpState::new(Registry::default())),
            shutdown.clone(),
            limits,
        ));
        (tx, taken, shutdown, server)
    }

    /// Queues a new in-memory connection (buffers of `buffer` bytes each way) and returns the
    /// client's end.
    fn connect(
        tx: &mpsc::UnboundedSender<io::Result<DuplexStream>>,
        buffer: usize,
    ) -> DuplexStream {
        let (client, server) = tokio::io::duplex(buffer);
        tx.send(Ok(server)).unwrap();
        client
    }

    /// Sends `GET path` with `Connection: close` and reads the whole answer.
    async fn ask(client: &mut DuplexStream, path: &str) -> String {
        client
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.unwrap();
        answer
    }

    fn test_limits(max_connections: usize) -> Limits {
        Limits {
            max_connections,
            header_read_timeout: Duration::from_secs(5),
            max_connection_age: Duration::from_secs(60),
        }
    }

    /// Far beyond every timeout the tests configure; time is paused, so waiting costs
    /// nothing and a `timeout` fires only when the server can make no further progress.
    const VIRTUAL_DEADLINE: Duration = Duration::from_secs(3600);

    #[test]
    fn accept_backoff_doubles_to_a_second_and_resets_on_success() {
        let mut backoff = AcceptBackoff::default();
        let pauses: Vec<u128> = (0..9).map(|_| backoff.failed().as_millis()).collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        backoff.succeeded();
        assert_eq!(backoff.failed(), Duration::from_millis(10));
    }

    /// EMFILE (too many open files) and ECONNABORTED are what a listener returns under
    /// pressure; the server waits and accepts again rather than ending, so the next client
    /// is served.
    #[tokio::test(start_paused = true)]
    async fn a_failed_accept_does_not_end_the_server() {
        let (tx, taken, shutdown, server) = queue_server(test_limits(8));
        tx.send(Err(io::Error::from_raw_os_error(24))).unwrap();
        tx.send(Err(io::Error::from(io::ErrorKind::ConnectionAborted)))
            .unwrap();
        let mut client = connect(&tx, 4096);

        let answer = tokio::time::timeout(VIRTUAL_DEADLINE, ask(&mut client, "/healthz"))
            .await
            .expect("the connection queued after the failed accepts was never served");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(taken.load(Ordering::SeqCst), 1);
        assert!(!server.is_finished(), "the server ended");

        shutdown.cancel();
        server.await.unwrap();
    }

    /// A flood of connections that send nothing: each is accepted, the oldest are closed to
    /// stay within `max_connections`, and the probe that comes after them all is answered at
    /// once, long before any timeout could have cut the flood.
    #[tokio::test(start_paused = true)]
    async fn a_flood_past_the_cap_pushes_out_its_oldest_and_the_probe_is_answered_at_once() {
        let cap = 8;
        let (tx, taken, shutdown, server) = queue_server(test_limits(cap));
        let mut idle: Vec<DuplexStream> = (0..200).map(|_| connect(&tx, 1024)).collect();
        let mut probe = connect(&tx, 4096);

        let limits = test_limits(cap);
        let answer =
            tokio::time::timeout(limits.header_read_timeout / 2, ask(&mut probe, "/healthz"))
                .await
                .expect("the probe waited behind the idle connections");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(taken.load(Ordering::SeqCst), idle.len() + 1);
        // The oldest idle connections were closed to make room; the newest are still open.
        let mut byte = [0u8; 1];
        let pushed_out = idle.len() - cap;
        for old in &mut idle[..pushed_out] {
            let closed = tokio::time::timeout(limits.header_read_timeout / 2, old.read(&mut byte))
                .await
                .expect("an old connection is still open");
            assert_eq!(closed.unwrap(), 0);
        }
        let newest = idle.last_mut().unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(1), newest.read(&mut byte))
                .await
                .is_err(),
            "the newest idle connection was closed before its timeout"
        );

        shutdown.cancel();
        server.await.unwrap();
    }

    /// A connection left idle after a keep-alive request gives its slot back once the header
    /// read timeout passes, long before its maximum age.
    #[tokio::test(start_paused = true)]
    async fn an_idle_keep_alive_connection_gives_its_slot_back() {
        let limits = Limits {
            max_connection_age: VIRTUAL_DEADLINE * 2,
            ..test_limits(1)
        };
        let (tx, taken, shutdown, server) = queue_server(limits);
        let mut kept = connect(&tx, 4096);
        kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        while !answer.ends_with(b"\r\n\r\nok\n") {
            let mut chunk = [0u8; 256];
            let n = kept.read(&mut chunk).await.unwrap();
            assert_ne!(n, 0, "closed before the answer: {answer:?}");
            answer.extend_from_slice(&chunk[..n]);
        }
        assert!(answer.starts_with(b"HTTP/1.1 200"));

        let mut probe = connect(&tx, 4096);
        let answer = tokio::time::timeout(VIRTUAL_DEADLINE, ask(&mut probe, "/healthz"))
            .await
            .expect("the idle keep-alive connection kept the only slot");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(taken.load(Ordering::SeqCst), 2);

        shutdown.cancel();
        server.await.unwrap();
    }

    /// A client that sends a request and never reads the answer stalls the server's write,
    /// where no read timeout applies; the maximum connection age still closes it.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_reads_is_cut_at_the_maximum_age() {
        let limits = test_limits(8);
        let (tx, taken, shutdown, server) = queue_server(limits);
        // 16 bytes each way: the answer cannot fit, so the server's write waits on the client.
        let mut stalled = connect(&tx, 16);
        stalled
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        // Past the maximum age, unread: the server gave up on the write and closed, so what
        // is left to read is the part of the answer that fit, then the end.
        tokio::time::sleep(limits.max_connection_age + Duration::from_secs(1)).await;
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(1), stalled.read_to_end(&mut got))
            .await
            .expect("the stalled connection is still open past its maximum age")
            .unwrap();
        assert!(got.len() <= 16, "the whole answer was sent: {got:?}");
        assert_eq!(taken.load(Ordering::SeqCst), 1);

        shutdown.cancel();
        server.await.unwrap();
    }

    /// The same flood over real TCP: 2,000 connections that send nothing against a cap of 8,
    /// with timeouts too long to help, and `/healthz` is still answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_tcp_connections_do_not_starve_healthz() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        // Timeouts far beyond the test: only closing the oldest makes room.
        let limits = Limits {
            max_connections: 8,
            header_read_timeout: Duration::from_secs(3600),
            max_connection_age: Duration::from_secs(3600),
        };
        let server = tokio::spawn(serve_on_with_limits(
            listener,
            Arc::new(HttpState::new(Registry::default())),
            shutdown.clone(),
            limits,
        ));
        let mut idle = Vec::new();
        for _ in 0..2000 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }

        let answer = tokio::time::timeout(
            Duration::from_secs(60),
            request(addr, "GET /healthz HTTP/1.1"),
        )
        .await
        .expect("/healthz not answered behind 2,000 idle connections")
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        drop(idle);

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
