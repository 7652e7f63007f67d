//! `/metrics` (Prometheus text), `/healthz` and `/readyz` on a small HTTP/1.1 listener.
//!
//! Three fixed GET endpoints do not need a web framework: requests are read up to the end of
//! their headers (capped), answered, and the connection closed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::plugin::PluginMetrics;

/// Per-GPU figures for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuFigures {
    /// SM utilization, percent.
    pub utilization_percent: Option<u32>,
    /// Memory used by compute processes, MiB.
    pub memory_used_mib: Option<u64>,
    /// 1 healthy, 0 not.
    pub healthy: bool,
    /// Temperature, °C.
    pub temperature_c: Option<u32>,
}

/// What `/metrics` shows; the agent loop replaces it after each reconcile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    /// By GPU index.
    pub gpus: BTreeMap<u32, GpuFigures>,
    /// Xid events seen, by (GPU index, Xid).
    pub xids: BTreeMap<(u32, u64), u64>,
    /// 1 when every driver check passed.
    pub validated: bool,
    /// GpuNode status writes.
    pub status_writes: u64,
    /// CDI spec writes.
    pub cdi_writes: u64,
}

/// State shared between the agent loop and the HTTP server.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    /// Latest figures.
    pub figures: RwLock<Figures>,
    /// Set once the agent has reconciled and reported at least once.
    pub ready: AtomicBool,
    /// Plugin counters.
    pub plugin: Arc<PluginMetrics>,
}

impl AgentMetrics {
    /// Replaces the figures.
    pub fn set(&self, figures: Figures) {
        if let Ok(mut f) = self.figures.write() {
            *f = figures;
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let f = self.figures.read().map(|f| f.clone()).unwrap_or_default();
        let mut out = String::new();
        let mut family = |name: &str, help: &str, kind: &str, rows: Vec<(String, String)>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in rows {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let per_gpu = |pick: &dyn Fn(&GpuFigures) -> Option<String>| -> Vec<(String, String)> {
            f.gpus
                .iter()
                .filter_map(|(i, g)| pick(g).map(|v| (format!("{{gpu=\"{i}\"}}"), v)))
                .collect()
        };
        family(
            "gpupool_gpu_utilization_percent",
            "SM utilization of a whole GPU.",
            "gauge",
            per_gpu(&|g| g.utilization_percent.map(|v| v.to_string())),
        );
        family(
            "gpupool_gpu_memory_used_bytes",
            "GPU memory used by compute processes.",
            "gauge",
            per_gpu(&|g| g.memory_used_mib.map(|v| (v * 1024 * 1024).to_string())),
        );
        family(
            "gpupool_gpu_healthy",
            "1 when the GPU has no health fault.",
            "gauge",
            per_gpu(&|g| Some(u8::from(g.healthy).to_string())),
        );
        family(
            "gpupool_gpu_temperature_celsius",
            "GPU temperature.",
            "gauge",
            per_gpu(&|g| g.temperature_c.map(|v| v.to_string())),
        );
        family(
            "gpupool_gpu_xid_errors_total",
            "Xid events seen since the agent started.",
            "counter",
            f.xids
                .iter()
                .map(|((g, x), n)| (format!("{{gpu=\"{g}\",xid=\"{x}\"}}"), n.to_string()))
                .collect(),
        );
        family(
            "gpupool_driver_validated",
            "1 when every driver check passed.",
            "gauge",
            vec![(String::new(), u8::from(f.validated).to_string())],
        );
        family(
            "gpupool_status_writes_total",
            "GpuNode status writes.",
            "counter",
            vec![(String::new(), f.status_writes.to_string())],
        );
        family(
            "gpupool_cdi_spec_writes_total",
            "CDI spec file writes.",
            "counter",
            vec![(String::new(), f.cdi_writes.to_string())],
        );
        let p = self.plugin.snapshot();
        for (name, v) in [
            ("registrations", p.registrations),
            ("registration_failures", p.registration_failures),
            ("allocations", p.allocations),
            ("allocation_errors", p.allocation_errors),
            (
                "health_unhealthy_transitions",
                p.health_unhealthy_transitions,
            ),
            ("health_healthy_transitions", p.health_healthy_transitions),
        ] {
            family(
                &format!("gpupool_plugin_{name}_total"),
                "Kubelet device plugin counter.",
                "counter",
                vec![(String::new(), v.to_string())],
            );
        }
        out
    }
}

fn response(status: &str, content_type: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Answers one request line.
pub fn answer(metrics: &AgentMetrics, request_line: &str) -> String {
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return response("405 Method Not Allowed", "text/plain", "GET only\n");
    }
    match path.split('?').next().unwrap_or("") {
        "/metrics" => response("200 OK", "text/plain; version=0.0.4", &metrics.render()),
        "/healthz" => response("200 OK", "text/plain", "ok\n"),
        "/readyz" if metrics.ready.load(Ordering::Relaxed) => {
            response("200 OK", "text/plain", "ready\n")
        }
        "/readyz" => response("503 Service Unavailable", "text/plain", "not ready\n"),
        _ => response("404 Not Found", "text/plain", "not found\n"),
    }
}

/// Binds `addr` and serves until `cancel`.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<AgentMetrics>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    loop {
        let (mut stream, _) = tokio::select! {
            () = cancel.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted?,
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let text = String::from_utf8_lossy(&buf);
            let line = text.lines().next().unwrap_or_default();
            let reply = answer(&metrics, line);
            let _ = stream.write_all(reply.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let m = AgentMetrics::default();
        let mut f = Figures::default();
        f.gpus.insert(
            0,
            GpuFigures {
                utilization_percent: Some(42),
                memory_used_mib: Some(1),
                healthy: true,
                temperature_c: Some(38),
            },
        );
        f.xids.insert((0, 79), 2);
        m.set(f);
        let body = answer(&m, "GET /metrics HTTP/1.1");
        assert!(body.starts_with("HTTP/1.1 200"));
        for line in [
            "gpupool_gpu_utilization_percent{gpu=\"0\"} 42",
            "gpupool_gpu_memory_used_bytes{gpu=\"0\"} 1048576",
            "gpupool_gpu_healthy{gpu=\"0\"} 1",
            "gpupool_gpu_temperature_celsius{gpu=\"0\"} 38",
            "gpupool_gpu_xid_errors_total{gpu=\"0\",xid=\"79\"} 2",
        ] {
            assert!(body.contains(line), "{line} missing in {body}");
        }
        assert!(answer(&m, "GET /healthz HTTP/1.1").starts_with("HTTP/1.1 200"));
        assert!(answer(&m, "GET /readyz HTTP/1.1").starts_with("HTTP/1.1 503"));
        m.ready.store(true, Ordering::Relaxed);
        assert!(answer(&m, "GET /readyz HTTP/1.1").starts_with("HTTP/1.1 200"));
        assert!(answer(&m, "GET /nope HTTP/1.1").starts_with("HTTP/1.1 404"));
        assert!(answer(&m, "POST /metrics HTTP/1.1").starts_with("HTTP/1.1 405"));
    }
}
