//! `http_layer` on a real axum server.

use axum::Router;
use axum::routing::get;
use prometheus_client::registry::Registry;
use sandbolt_telemetry::{HttpMetrics, http_layer, request_id};
use tokio::net::TcpListener;

use crate::support::{is_generated_id, sample, scrape};

const REQUESTS: &str = "sandbolt_http_requests_total";
const DURATION_COUNT: &str = "sandbolt_http_request_duration_seconds_count";

async fn item_handler() -> String {
    // What the handler sees as the request's id, for the test to compare.
    request_id::current().unwrap_or_default()
}

#[tokio::test]
async fn labels_by_matched_route_and_echoes_the_request_id() {
    let mut registry = Registry::default();
    let metrics = HttpMetrics::register(&mut registry, "lifecycle");
    let app = Router::new()
        .route("/items/{id}", get(item_handler))
        .layer(http_layer(metrics));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let http = reqwest::Client::new();

    for item in ["42", "43"] {
        let reply = http
            .get(format!("{base}/items/{item}"))
            .header(request_id::HEADER, format!("rid-{item}"))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200);
        let echoed = reply.headers()[request_id::HEADER]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(echoed, format!("rid-{item}"));
        assert_eq!(
            reply.text().await.unwrap(),
            echoed,
            "handler's request_id::current()"
        );
    }
    let missing = http.post(format!("{base}/nowhere/7")).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let generated = missing.headers()[request_id::HEADER].to_str().unwrap();
    assert!(is_generated_id(generated), "{generated}");

    let text = scrape(&registry);
    let item_route = [
        ("component", "lifecycle"),
        ("route", "/items/{id}"),
        ("method", "GET"),
    ];
    let ok = [item_route.as_slice(), &[("status", "200")]].concat();
    assert_eq!(sample(&text, REQUESTS, &ok), Some(2.0), "{text}");
    assert_eq!(
        sample(&text, DURATION_COUNT, &item_route),
        Some(2.0),
        "{text}"
    );
    let unmatched = [
        ("route", "unmatched"),
        ("method", "POST"),
        ("status", "404"),
    ];
    assert_eq!(sample(&text, REQUESTS, &unmatched), Some(1.0), "{text}");
    assert!(!text.contains("nowhere"), "a path became a label: {text}");
    server.abort();
}
