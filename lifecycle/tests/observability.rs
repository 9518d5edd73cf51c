//! The lifecycle's observability on a real controller and agent: request ids
//! from the REST edge into the controller's log lines, `/healthz` and
//! `/readyz` without a key, the metrics events the official SDK posts after
//! a create (counted, observed, logged with their request id; malformed ones
//! refused as the contract says), and the HTTP families on the ops port.

use crate::common;

use std::io::Write;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};

use reqwest::{Method, StatusCode};
use sandbolt_lifecycle::{Lifecycle, LifecycleMetrics};
use sandbolt_telemetry::prometheus_client::registry::Registry;
use sandbolt_telemetry::{ops_router, serve_ops};
use serde_json::{Value, json};

/// Every log line of this test process (lifecycle and controller run in it),
/// without colours, for the assertions to search.
#[derive(Clone, Default)]
struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    /// Installs the process's subscriber (before the test bed's own, which
    /// then leaves it be): debug for lifecycle and controller, and the
    /// request spans of `sandbolt_telemetry` (a span filtered out would
    /// take its `request_id` field out of every line beneath it).
    fn install() -> Self {
        let capture = LogCapture::default();
        let writer = capture.clone();
        tracing_subscriber::fmt()
            .with_env_filter(
                "warn,sandbolt_telemetry=info,sandbolt_lifecycle=debug,sandbolt_controller=debug",
            )
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .try_init()
            .expect("the first subscriber of this test process");
        capture
    }

    /// The lines holding every one of `needles`.
    fn lines_with(&self, needles: &[&str]) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned)
            .collect()
    }
}

/// One sample of a scrape: `name{labels...} value`, all of `labels` among
/// the sample's.
fn sample(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (series_name, series_labels) = series.split_once('{').unwrap_or((series, ""));
        (series_name == name
            && labels
                .iter()
                .all(|(k, v)| series_labels.contains(&format!("{k}=\"{v}\""))))
        .then(|| value.parse().ok())?
    })
}

async fn scrape(ops: SocketAddr) -> String {
    let r = reqwest::get(format!("http://{ops}/metrics")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let content_type = r.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    r.text().await.unwrap()
}

/// A request without a key: status and JSON body.
async fn probe(url: String) -> (StatusCode, Value) {
    let (s, _, v) = common::call_as(Method::GET, url, None, None).await;
    (s, v)
}

/// Runs lifecycle/tests/python/sdk_metrics_event.py against the lifecycle
/// at `addr`, every SDK request carrying `request_id`.
async fn sdk_create(addr: SocketAddr, image: &str, request_id: &str) {
    let python =
        sandbolt_testbed::python().expect("the repo's venv python (scripts/python-env.sh)");
    let root = sandbolt_testbed::workspace_root();
    let mut cmd = Command::new(python);
    cmd.arg(root.join("lifecycle/tests/python/sdk_metrics_event.py"))
        .env("PYTHONPATH", root.join("tests/python"))
        .env("LIFECYCLE_DOMAIN", addr.to_string())
        .env("LIFECYCLE_API_KEY", common::API_KEY)
        .env("SANDBOLT_IMAGE", image)
        .env("OBS_REQUEST_ID", request_id);
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("python runs"))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "the SDK create failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_probes_and_sdk_metrics_events_on_the_controller_backend() {
    let logs = LogCapture::install();
    let mut env = common::controller_env(2).await;
    let data = tempfile::tempdir().unwrap();
    let mut registry = Registry::default();
    let mut config = env.lifecycle_config(data.path());
    config.metrics = Some(LifecycleMetrics::register(&mut registry));
    let lifecycle = Lifecycle::start(config).await.expect("lifecycle starts");
    let ops = serve_ops(
        "127.0.0.1:0".parse().unwrap(),
        ops_router(Arc::new(registry), lifecycle.readiness()),
    )
    .await
    .expect("ops endpoint serves");
    let base = format!("http://{}", lifecycle.addr());
    let ops_addr = ops.local_addr();

    probes_answer_without_a_key(&base, ops_addr).await;
    rest_request_id_reaches_the_controller(&base, &env.image, &logs).await;
    sdk_events_are_counted_and_logged(&lifecycle.addr(), &env.image, &logs, ops_addr).await;
    malformed_events_are_refused(&base, ops_addr).await;

    // The backend gone: not ready (both ports say why), still alive.
    env.controller.take().unwrap().shutdown().await;
    for url in [
        format!("{base}/readyz"),
        format!("http://{ops_addr}/readyz"),
    ] {
        let (s, v) = probe(url.clone()).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{url}: {v}");
        assert_eq!(v["status"], "unready", "{url}: {v}");
        assert!(
            v["reason"].as_str().unwrap_or("").contains("controller"),
            "{url}: {v}"
        );
    }
    assert_eq!(probe(format!("{base}/healthz")).await.0, StatusCode::OK);

    ops.shutdown().await;
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

/// `/healthz` and `/readyz` on the API port and the ops port, no key; the
/// metrics stay on the ops port.
async fn probes_answer_without_a_key(base: &str, ops: SocketAddr) {
    for url in [
        format!("{base}/healthz"),
        format!("{base}/readyz"),
        format!("http://{ops}/healthz"),
        format!("http://{ops}/readyz"),
    ] {
        let (s, v) = probe(url.clone()).await;
        assert_eq!(s, StatusCode::OK, "{url}: {v}");
        assert!(
            matches!(v["status"].as_str(), Some("ok" | "ready")),
            "{url}: {v}"
        );
    }
    let (s, v) = common::call(Method::GET, format!("{base}/metrics"), None).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("NOT_FOUND"))
    );
    // Other routes still want the key.
    assert_eq!(
        probe(format!("{base}/v1/sandboxes")).await.0,
        StatusCode::UNAUTHORIZED
    );
}

/// A REST create with `X-Request-ID`: echoed, and found in the controller's
/// log lines (it crossed the gRPC hop in metadata); ids that are missing or
/// unusable are replaced.
async fn rest_request_id_reaches_the_controller(base: &str, image: &str, logs: &LogCapture) {
    let id = format!("rest-{}", uuid::Uuid::new_v4().simple());
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/sandboxes"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .header("X-Request-ID", &id)
        .json(&json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 600,
            "resourceLimits": {},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], id.as_str());
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let created: Value = r.json().await.unwrap();
    let controller_lines = logs.lines_with(&[&id, " sandbolt_controller"]);
    assert!(
        !controller_lines.is_empty(),
        "no controller log line carries request id {id}; lines with it:\n{}",
        logs.lines_with(&[&id]).join("\n")
    );
    let sandbox = created["id"].as_str().unwrap();
    let (s, v) = common::call(
        Method::DELETE,
        format!("{base}/v1/sandboxes/{sandbox}"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");

    for sent in [None, Some("has space"), Some(&*"x".repeat(129))] {
        let mut rb = reqwest::Client::new().get(format!("{base}/health"));
        if let Some(sent) = sent {
            rb = rb.header("X-Request-ID", sent);
        }
        let r = rb.send().await.unwrap();
        let got = r.headers()["x-request-id"].to_str().unwrap();
        assert_eq!(got.len(), 32, "{sent:?} -> {got}");
        assert!(got.bytes().all(|b| b.is_ascii_hexdigit()), "{got}");
    }
}

/// The SDK's own `POST /metrics/events` after a create: counted, its
/// duration observed, logged at debug with the request id it carried.
async fn sdk_events_are_counted_and_logged(
    addr: &SocketAddr,
    image: &str,
    logs: &LogCapture,
    ops: SocketAddr,
) {
    let before = scrape(ops).await;
    let ok = [("event", "sandbox.create"), ("outcome", "ok")];
    assert_eq!(
        sample(&before, "sandbolt_lifecycle_sdk_events_total", &ok),
        None
    );
    let id = format!("sdk-{}", uuid::Uuid::new_v4().simple());
    sdk_create(*addr, image, &id).await;

    let after = scrape(ops).await;
    assert_eq!(
        sample(&after, "sandbolt_lifecycle_sdk_events_total", &ok),
        Some(1.0),
        "{after}"
    );
    let outcome = [("outcome", "ok")];
    let count = "sandbolt_lifecycle_sdk_create_duration_seconds_count";
    assert_eq!(sample(&after, count, &outcome), Some(1.0), "{after}");
    let sum = sample(
        &after,
        "sandbolt_lifecycle_sdk_create_duration_seconds_sum",
        &outcome,
    )
    .expect("a duration sum");
    assert!(
        sum > 0.0 && sum < 600.0,
        "create took {sum} s as the SDK saw it"
    );
    let event_lines = logs.lines_with(&["SDK metrics event", &id]);
    assert_eq!(event_lines.len(), 1, "{event_lines:?}");
    assert!(
        event_lines[0].contains("success=true"),
        "{}",
        event_lines[0]
    );
    assert!(
        !logs.lines_with(&[&id, " sandbolt_controller"]).is_empty(),
        "the SDK's request id {id} never reached the controller"
    );
    // The SDK's calls, by matched route: its create and its event.
    for (route, method, status) in [
        ("/v1/sandboxes", "POST", "202"),
        ("/v1/metrics/events", "POST", "204"),
        ("/v1/sandboxes/{id}", "DELETE", "204"),
    ] {
        let labels = [
            ("component", "lifecycle"),
            ("route", route),
            ("method", method),
            ("status", status),
        ];
        let n = sample(&after, "sandbolt_http_requests_total", &labels).unwrap_or(0.0);
        assert!(n >= 1.0, "{route} {method} {status}: {n}\n{after}");
    }
}

/// Bodies that are not a `MetricsEvent`: 422 with the contract's
/// `HTTPValidationError` (401 without a key, as every route), counting
/// nothing.
async fn malformed_events_are_refused(base: &str, ops: SocketAddr) {
    let url = format!("{base}/metrics/events");
    let (s, v) = common::call(
        Method::POST,
        url.clone(),
        Some(json!({"eventType": "sandbox.create", "success": "yes"})),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let locs: Vec<_> = v["detail"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|d| (d["loc"].to_string(), d["type"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(
        locs,
        [
            (
                r#"["body","createDurationMs"]"#.to_owned(),
                "missing".to_owned()
            ),
            (r#"["body","success"]"#.to_owned(), "bool_type".to_owned()),
        ]
    );
    let r = reqwest::Client::new()
        .post(&url)
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["detail"][0]["type"], "json_invalid", "{v}");
    let event = json!({"eventType": "sandbox.create", "createDurationMs": 5, "success": true});
    let (s, _, _) = common::call_as(Method::POST, url, None, Some(event)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);

    let scrape = scrape(ops).await;
    let ok = [("event", "sandbox.create"), ("outcome", "ok")];
    assert_eq!(
        sample(&scrape, "sandbolt_lifecycle_sdk_events_total", &ok),
        Some(1.0)
    );
    let refused = [
        ("route", "/metrics/events"),
        ("method", "POST"),
        ("status", "422"),
    ];
    assert_eq!(
        sample(&scrape, "sandbolt_http_requests_total", &refused),
        Some(2.0),
        "{scrape}"
    );
}

/// The Docker backend is ready while its engine answers `/_ping`; an event
/// posted by hand (outcome error) is counted under its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_backend_probes_and_events() {
    let env = common::docker_env();
    let mut registry = Registry::default();
    let mut config = env.config();
    config.metrics = Some(LifecycleMetrics::register(&mut registry));
    let lifecycle = Lifecycle::start(config).await.expect("lifecycle starts");
    let ops = serve_ops(
        "127.0.0.1:0".parse().unwrap(),
        ops_router(Arc::new(registry), lifecycle.readiness()),
    )
    .await
    .unwrap();
    let base = format!("http://{}", lifecycle.addr());
    probes_answer_without_a_key(&base, ops.local_addr()).await;
    let event = json!({"eventType": "sandbox.create", "createDurationMs": 2500, "success": false});
    let (s, v) = common::call(
        Method::POST,
        format!("{base}/v1/metrics/events"),
        Some(event),
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let scrape = scrape(ops.local_addr()).await;
    let error = [("event", "sandbox.create"), ("outcome", "error")];
    assert_eq!(
        sample(&scrape, "sandbolt_lifecycle_sdk_events_total", &error),
        Some(1.0),
        "{scrape}"
    );
    let sum = "sandbolt_lifecycle_sdk_create_duration_seconds_sum";
    assert_eq!(sample(&scrape, sum, &[("outcome", "error")]), Some(2.5));
    ops.shutdown().await;
    lifecycle.shutdown().await.unwrap();
}
