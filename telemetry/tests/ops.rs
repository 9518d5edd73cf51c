//! `ops_router` served by `serve_ops`: what a scraper and kubelet probes get.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use sandbolt_telemetry::{
    GrpcMetrics, HttpMetrics, Readiness, grpc_layer, http_layer, ops_router, serve_ops,
};
use serde_json::{Value, json};

use crate::support::{PROBE_PATH, Probe, call, echo_client, start_echo};

#[tokio::test]
async fn serves_openmetrics_health_and_readiness() {
    let mut registry = Registry::default();
    let grpc_metrics = GrpcMetrics::register(&mut registry, "controller");
    let http_metrics = HttpMetrics::register(&mut registry, "controller");
    let scans: Counter = Counter::default();
    registry.register("sandbolt_test_scans", "Scans done", scans.clone());
    scans.inc_by(3);
    let store_open = Arc::new(AtomicBool::new(false));
    let ready = Readiness::from_fn({
        let store_open = store_open.clone();
        move || {
            let open = store_open.load(Ordering::SeqCst);
            async move {
                if open {
                    Ok(())
                } else {
                    Err("store not open".to_owned())
                }
            }
        }
    });
    let server = serve_ops(
        "127.0.0.1:0".parse().unwrap(),
        ops_router(Arc::new(registry), ready).layer(http_layer(http_metrics)),
    )
    .await
    .unwrap();
    let base = format!("http://{}", server.local_addr());
    let http = reqwest::Client::new();

    // Samples in every family: openmetrics-parser 0.5 (unlike Prometheus)
    // rejects a family with no samples, which the spec allows.
    let (grpc_addr, grpc_server) = start_echo(grpc_layer(grpc_metrics)).await;
    call(
        &mut echo_client(grpc_addr).await,
        PROBE_PATH,
        Probe::default(),
        &[],
    )
    .await
    .unwrap();
    grpc_server.abort();
    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(
        health.json::<Value>().await.unwrap(),
        json!({"status": "ok"})
    );

    let metrics = http.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), 200);
    assert_eq!(
        metrics.headers()["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    let text = metrics.text().await.unwrap();
    let exposition = openmetrics_parser::openmetrics::parse_openmetrics(&text)
        .unwrap_or_else(|e| panic!("not OpenMetrics ({e:?}):\n{text}"));
    for family in [
        "sandbolt_test_scans",
        "sandbolt_grpc_server_requests",
        "sandbolt_grpc_server_request_duration_seconds",
        "sandbolt_http_requests",
        "sandbolt_http_request_duration_seconds",
    ] {
        assert!(
            exposition.families.contains_key(family),
            "{family} missing:\n{text}"
        );
    }
    assert!(text.contains("sandbolt_test_scans_total 3\n"), "{text}");
    assert!(
        text.contains(r#"sandbolt_http_requests_total{component="controller",route="/healthz",method="GET",status="200"} 1"#),
        "{text}"
    );

    let unready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(unready.status(), 503);
    assert_eq!(
        unready.json::<Value>().await.unwrap(),
        json!({"status": "unready", "reason": "store not open"})
    );
    store_open.store(true, Ordering::SeqCst);
    let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);

    let addr = server.local_addr();
    drop(http); // its idle keep-alive connection would hold the graceful shutdown
    server.shutdown().await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still listening"
    );
}
