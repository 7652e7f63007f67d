//! `/metrics`, `/healthz` and `/readyz`: the operator serves its registry through the server
//! it shares with the node agent.

pub use gpupool_telemetry::{Error, HttpState, serve};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prometheus_client::registry::Registry;
    use tokio::net::TcpListener;
    use tokio_util::sync::CancellationToken;

    use crate::metrics::{ErrorLabels, Metrics, ReconcileLabels};

    use super::*;

    /// The series names dashboards and the e2e suite read (`gpupool_reclaims_total`,
    /// `gpupool_api_writes_total`, …) come out of the shared server unchanged.
    #[tokio::test]
    async fn operator_metrics_keep_their_names() {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        metrics
            .reconciles
            .get_or_create(&ReconcileLabels { controller: "pool" })
            .inc();
        metrics
            .errors
            .get_or_create(&ErrorLabels {
                controller: "pool",
                error: "api",
            })
            .inc();
        metrics.duration.observe(0.02);
        metrics.reclaim("training", "Suspend", "Succeeded");
        metrics.write("GpuNode", "apply");
        metrics.queue_depth.set(2);
        metrics.leader.set(1);
        let mut accrual = crate::accounting::Accrual::default();
        accrual
            .allocated
            .insert(("training".into(), "ml".into()), 90.0);
        accrual.idle.insert(("training".into(), "ml".into()), 30.5);
        metrics.account(&accrual);

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(gpupool_telemetry::serve_on(
            listener,
            Arc::new(HttpState::new(registry)),
            shutdown.clone(),
        ));
        let text = gpupool_telemetry::testing::request(addr, "GET /metrics HTTP/1.1")
            .await
            .unwrap();
        shutdown.cancel();
        server.await.unwrap().unwrap();

        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        for line in [
            "gpupool_reconciles_total{controller=\"pool\"} 1",
            "gpupool_reconcile_errors_total{controller=\"pool\",error=\"api\"} 1",
            "gpupool_reconcile_duration_seconds_count 1",
            "gpupool_reconcile_duration_seconds_bucket{le=\"0.05\"} 1",
            "gpupool_reclaims_total{pool=\"training\",action=\"Suspend\",result=\"Succeeded\"} 1",
            "gpupool_api_writes_total{kind=\"GpuNode\",verb=\"apply\"} 1",
            "gpupool_queue_depth 2",
            "gpupool_leader 1",
            "gpupool_gpu_allocated_seconds_total{pool=\"training\",namespace=\"ml\"} 90.0",
            "gpupool_gpu_idle_seconds_total{pool=\"training\",namespace=\"ml\"} 30.5",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
