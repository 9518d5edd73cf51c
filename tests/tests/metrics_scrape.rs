//! Every component's /metrics after a create/exec/delete round (issue 20's
//! first Done-when): a controller, an agent, a janitor and a lifecycle API,
//! each its own process with `--metrics-listen`; the official Python SDK
//! creates a sandbox through the lifecycle, runs a command in it and kills
//! it; then each /metrics is fetched, checked to be OpenMetrics by its
//! content type, parsed by the official Prometheus client's OpenMetrics
//! parser, and what the round must have moved is asserted. Every metric the
//! chart's Grafana dashboard reads is among what the components serve.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::observed::{COMPONENTS, Scrape, Stack};

const EVENTS_WITHIN: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_create_exec_delete_round_shows_in_every_components_metrics() {
    let stack = Stack::start().await;
    let before = stack.scrape_all().await;
    let run = stack.sdk("round", None).await;
    assert!(run.stdout.contains("observability-round"), "{run:?}");
    stack.wait_no_containers().await;
    // The SDK posts its create event from a thread of its own; the janitor
    // scans every second.
    let scrapes = scrape_until(&stack, &before).await;

    assert_controller_moved(&scrapes["controller"]);
    assert_agent_moved(&scrapes["agent"]);
    assert_lifecycle_moved(&scrapes["lifecycle"]);
    assert!(
        scrapes["janitor"].sum("sandbolt_janitor_scans_total", &[])
            > before["janitor"].sum("sandbolt_janitor_scans_total", &[]),
        "{:?}",
        scrapes["janitor"].family("sandbolt_janitor_scans")
    );
    assert_dashboard_reads_only_served_metrics(&scrapes);
    stack.stop().await;
}

/// Scrapes until the lifecycle counted the SDK's event and the janitor
/// scanned again.
async fn scrape_until(
    stack: &Stack,
    before: &BTreeMap<&'static str, Scrape>,
) -> BTreeMap<&'static str, Scrape> {
    let scans_before = before["janitor"].sum("sandbolt_janitor_scans_total", &[]);
    let started = std::time::Instant::now();
    loop {
        let scrapes = stack.scrape_all().await;
        let events = scrapes["lifecycle"].sum("sandbolt_lifecycle_sdk_events_total", &[]);
        let scans = scrapes["janitor"].sum("sandbolt_janitor_scans_total", &[]);
        if events >= 1.0 && scans > scans_before {
            return scrapes;
        }
        assert!(
            started.elapsed() < EVENTS_WITHIN,
            "no SDK event ({events}) or no new janitor scan ({scans} <= {scans_before}) within {EVENTS_WITHIN:?}\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Calls to `service/method` with status `code` the component counted.
fn calls(s: &Scrape, component: &str, service: &str, method: &str, code: &str) -> f64 {
    s.sum(
        "sandbolt_grpc_server_requests_total",
        &[
            ("component", component),
            ("service", service),
            ("method", method),
            ("code", code),
        ],
    )
}

/// Observations of the histogram `name` with `labels`.
fn observed(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    s.sum(&format!("{name}_count"), labels)
}

fn assert_controller_moved(s: &Scrape) {
    const SVC: &str = "sandbolt.control.v1.SandboxService";
    for method in ["CreateSandbox", "DeleteSandbox"] {
        assert!(
            calls(s, "controller", SVC, method, "OK") >= 1.0,
            "{method}: {:?}",
            s.family("sandbolt_grpc_server_requests")
        );
    }
    assert!(
        observed(
            s,
            "sandbolt_grpc_server_request_duration_seconds",
            &[("component", "controller"), ("method", "CreateSandbox")]
        ) >= 1.0
    );
    const STAGES: &str = "sandbolt_controller_create_stage_duration_seconds";
    for stage in ["place", "agent_create"] {
        assert!(
            observed(s, STAGES, &[("stage", stage)]) >= 1.0,
            "{stage}: {:?}",
            s.family(STAGES)
        );
    }
    assert!(
        observed(s, "sandbolt_controller_store_write_duration_seconds", &[]) >= 1.0,
        "{:?}",
        s.family("sandbolt_controller_store_write_duration_seconds")
    );
    assert_eq!(s.sum("sandbolt_controller_leader", &[]), 1.0);
    assert!(
        s.sum("sandbolt_controller_agents", &[]) >= 1.0,
        "{:?}",
        s.family("sandbolt_controller_agents")
    );
    assert!(
        s.sum("sandbolt_controller_capacity", &[("resource", "sandboxes")]) >= 1.0,
        "{:?}",
        s.family("sandbolt_controller_capacity")
    );
    // Read live at scrape time: the deleted sandbox is counted nowhere.
    assert_eq!(
        s.sum("sandbolt_controller_sandboxes", &[]),
        0.0,
        "{:?}",
        s.family("sandbolt_controller_sandboxes")
    );
}

fn assert_agent_moved(s: &Scrape) {
    const SVC: &str = "sandbolt.agent.v1.AgentService";
    for method in ["CreateSandbox", "DeleteSandbox"] {
        assert!(
            calls(s, "agent", SVC, method, "OK") >= 1.0,
            "{method}: {:?}",
            s.family("sandbolt_grpc_server_requests")
        );
    }
    // One cold create: each of its stages timed once.
    const STAGES: &str = "sandbolt_agent_create_stage_duration_seconds";
    for stage in ["image", "container", "task", "execd_ready"] {
        assert_eq!(
            observed(s, STAGES, &[("stage", stage)]),
            1.0,
            "{stage}: {:?}",
            s.family(STAGES)
        );
    }
    assert_eq!(
        s.sum(
            "sandbolt_agent_creates_total",
            &[("outcome", "ok"), ("source", "cold")]
        ),
        1.0,
        "{:?}",
        s.family("sandbolt_agent_creates")
    );
    assert_eq!(s.sum("sandbolt_agent_sandboxes", &[]), 0.0);
}

fn assert_lifecycle_moved(s: &Scrape) {
    let requests = |method: &str, status: &str| {
        s.samples("sandbolt_http_requests_total")
            .filter(|x| {
                x.labels["component"] == "lifecycle"
                    && x.labels["method"] == method
                    && x.labels["route"].contains("/sandboxes")
                    && x.labels["status"].starts_with(status)
            })
            .map(|x| x.value)
            .sum::<f64>()
    };
    let family = || s.family("sandbolt_http_requests");
    assert!(requests("POST", "2") >= 1.0, "create: {:?}", family());
    assert!(
        requests("GET", "2") >= 1.0,
        "status and endpoint: {:?}",
        family()
    );
    assert!(requests("DELETE", "2") >= 1.0, "kill: {:?}", family());
    assert!(
        s.samples("sandbolt_http_requests_total")
            .all(|x| x.labels["route"] != "unmatched" || x.labels["status"] == "404"),
        "{:?}",
        family()
    );
    assert!(
        observed(
            s,
            "sandbolt_http_request_duration_seconds",
            &[("method", "POST")]
        ) >= 1.0
    );
    assert!(s.sum("sandbolt_lifecycle_sdk_events_total", &[]) >= 1.0);
}

/// Every metric name a dashboard query reads is served by some component.
fn assert_dashboard_reads_only_served_metrics(scrapes: &BTreeMap<&'static str, Scrape>) {
    let served: std::collections::BTreeSet<String> = COMPONENTS
        .iter()
        .flat_map(|c| scrapes[c].queryable_names())
        .collect();
    let dashboard = sandbolt_deploy::dashboard::load().unwrap();
    let read = sandbolt_deploy::dashboard::metric_names(&dashboard);
    assert!(!read.is_empty());
    let missing: Vec<&String> = read.iter().filter(|n| !served.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard reads metrics no component serves: {missing:?}\nserved: {served:?}"
    );
}
