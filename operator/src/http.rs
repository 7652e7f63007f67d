//! `/metrics`, `/healthz` and `/readyz`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

/// What the endpoints report.
pub struct HttpState {
    /// The metrics registry.
    pub registry: Registry,
    /// Set once the operator can do its work (CRDs established); a standby replica is ready.
    pub ready: AtomicBool,
}

impl HttpState {
    /// A state with nothing ready yet.
    pub fn new(registry: Registry) -> Self {
        Self {
            registry,
            ready: AtomicBool::new(false),
        }
    }
}

fn respond(state: &HttpState, path: &str) -> Response<Full<Bytes>> {
    let (code, body, content_type) = match path {
        "/metrics" => (
            StatusCode::OK,
            crate::metrics::encode(&state.registry),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        "/healthz" => (StatusCode::OK, "ok".to_owned(), "text/plain"),
        "/readyz" if state.ready.load(Ordering::Relaxed) => {
            (StatusCode::OK, "ok".to_owned(), "text/plain")
        }
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready".to_owned(),
            "text/plain",
        ),
        _ => (StatusCode::NOT_FOUND, "not found".to_owned(), "text/plain"),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = code;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

/// Serves until `shutdown` is cancelled.
pub async fn serve(
    addr: SocketAddr,
    state: Arc<HttpState>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted?,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let resp = respond(&state, req.uri().path());
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = http1::Builder::new()
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
    use super::*;

    #[test]
    fn endpoints() {
        let state = HttpState::new(Registry::default());
        assert_eq!(respond(&state, "/healthz").status(), StatusCode::OK);
        assert_eq!(
            respond(&state, "/readyz").status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        state.ready.store(true, Ordering::Relaxed);
        assert_eq!(respond(&state, "/readyz").status(), StatusCode::OK);
        assert_eq!(respond(&state, "/metrics").status(), StatusCode::OK);
        assert_eq!(respond(&state, "/nope").status(), StatusCode::NOT_FOUND);
    }
}
