//! The janitor's `/metrics` and `/readyz` (the ops router that
//! `sandbolt janitor --metrics-listen` serves), on the test bed's
//! containerd with a real agent and a real controller (in process): a
//! sandbox the agent made and captured, which no record owns, is reaped
//! with its snapshot, and the scrape counts both reaps by rule; once
//! containerd is gone, a scan turns the janitor unready with the reason.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use openmetrics_parser::OpenMetricsValue;
use openmetrics_parser::openmetrics::parse_openmetrics;
use prometheus_client::registry::Registry;
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_janitor::{
    ControllerOwnership, Janitor, JanitorConfig, OwnershipSource, ReapReason, SnapshotReapReason,
};
use sandbolt_node::labels::SNAPSHOT_NAME_PREFIX;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::agent::v1::{CreateSandboxRequest, CreateSnapshotRequest, SandboxSpec};
use sandbolt_proto::auth::BearerToken;
use sandbolt_telemetry::OpsServer;
use sandbolt_test_support::{eventually_async, init_tracing};
use sandbolt_testbed::{Testbed, execd_binary};

const NS: &str = "k8s.io";
const TOKEN: &str = "janitor-metrics-token";
const NODE: &str = "node-m";
const WAIT: Duration = Duration::from_secs(30);

/// GET `/<path>` of the ops router: (status, body).
async fn ops_get(ops: &OpsServer, path: &str) -> (u16, String) {
    let endpoint = format!("{}/{path}", ops.local_addr());
    sandbolt_test_support::http::get(&endpoint, "", &[]).await
}

/// Counter values of the scrape by (family, label values), parsed as
/// OpenMetrics.
async fn scrape(ops: &OpsServer) -> (HashMap<(String, Vec<String>), f64>, String) {
    let (status, text) = ops_get(ops, "metrics").await;
    assert_eq!(status, 200, "{text}");
    let exposition = parse_openmetrics(&text)
        .unwrap_or_else(|e| panic!("/metrics is not OpenMetrics ({e:?}):\n{text}"));
    let mut counters = HashMap::new();
    for (name, family) in exposition.families {
        for sample in family.iter_samples() {
            if let OpenMetricsValue::Counter(c) = &sample.value {
                let labels = sample.get_labelset().unwrap();
                let values = labels.iter_values().cloned().collect();
                counters.insert((name.clone(), values), c.value.as_f64());
            }
        }
    }
    (counters, text)
}

/// An agent (no controller: nothing records its sandboxes) with sandbox
/// `id` running and captured as snapshot `snapshot`.
async fn orphan_with_snapshot(
    bed: &Testbed,
    state: &std::path::Path,
    id: &str,
    snapshot: &str,
) -> sandbolt_agent::AgentHandle {
    let mut cfg = AgentConfig::new(
        "agent-m",
        bed.containerd_socket(),
        execd_binary().expect("static execd"),
        state,
        TOKEN,
    );
    cfg.node_name = NODE.into();
    // No prepared snapshots: they would be reaped too (their agent process
    // is unknown to the controller), blurring the counts.
    cfg.prepared_snapshots = 0;
    let agent = Agent::start(cfg).await.expect("agent starts");
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", agent.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client =
        AgentServiceClient::with_interceptor(channel, BearerToken::new(TOKEN).unwrap());
    let spec = SandboxSpec {
        sandbox_id: id.into(),
        name: "orphan".into(),
        namespace: "tests".into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "1000".into()],
        access_token: "token".into(),
        ..Default::default()
    };
    client
        .create_sandbox(CreateSandboxRequest { spec: Some(spec) })
        .await
        .expect("create");
    client
        .create_snapshot(CreateSnapshotRequest {
            snapshot_id: snapshot.into(),
            sandbox_id: id.into(),
        })
        .await
        .expect("capture");
    agent
}

#[tokio::test(flavor = "multi_thread")]
async fn reaps_are_scraped_by_rule_and_a_lost_containerd_makes_the_janitor_unready() {
    init_tracing("info");
    let bed = tokio::task::spawn_blocking(|| Testbed::start_with_busybox(NS))
        .await
        .unwrap()
        .expect("test bed with busybox");
    let dir = tempfile::tempdir().unwrap();
    let mut ctl_cfg = ControllerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().join("ctl"),
        TOKEN,
    );
    ctl_cfg.failpoint = None;
    let ctl = Controller::start(ctl_cfg).await.expect("controller starts");
    let endpoint = format!("http://{}", ctl.local_addr());
    let agent_state = dir.path().join("agent");
    let agent = orphan_with_snapshot(&bed, &agent_state, "sb-orphan", "snap-orphan").await;
    agent.shutdown().await;

    let owner = ControllerOwnership::new(&endpoint, TOKEN, Duration::from_secs(5)).unwrap();
    eventually_async("the controller ready", WAIT, || async {
        owner.ownership(NODE, &[]).await.ok().filter(|r| r.ready)
    })
    .await;
    let mut cfg = JanitorConfig::new(
        NODE,
        bed.containerd_socket(),
        &endpoint,
        TOKEN,
        dir.path().join("janitor"),
    );
    cfg.containerd_namespace = NS.into();
    cfg.grace_period = Duration::ZERO;
    cfg.interval = Duration::from_secs(3600);
    cfg.agent_state_dir = Some(agent_state);
    let janitor = Janitor::new(cfg).await.expect("janitor");
    let mut registry = Registry::default();
    janitor.metrics().register(&mut registry);
    let router = sandbolt_telemetry::ops_router(Arc::new(registry), janitor.readiness());
    let ops = sandbolt_telemetry::serve_ops("127.0.0.1:0".parse().unwrap(), router)
        .await
        .expect("ops router serves");

    let report = janitor.scan_once().await.expect("scan");
    assert_eq!(
        report
            .reaped
            .iter()
            .map(|r| (r.sandbox_id.as_str(), r.reason))
            .collect::<Vec<_>>(),
        [("sb-orphan", ReapReason::NoRecord)],
        "{report:?}"
    );
    assert_eq!(
        report.snapshot_reap_reason(&format!("{SNAPSHOT_NAME_PREFIX}snap-orphan")),
        Some(SnapshotReapReason::NoRecord),
        "{report:?}"
    );
    let (counters, text) = scrape(&ops).await;
    let counter = |family: &str, labels: &[&str]| {
        let key = (
            family.to_string(),
            labels.iter().map(|l| l.to_string()).collect(),
        );
        counters
            .get(&key)
            .copied()
            .unwrap_or_else(|| panic!("{family}{labels:?}:\n{text}"))
    };
    assert_eq!(counter("sandbolt_janitor_reaped", &["no-record"]), 1.0);
    assert_eq!(
        counter("sandbolt_janitor_snapshots_reaped", &["no-record"]),
        1.0
    );
    assert_eq!(counter("sandbolt_janitor_scans", &[]), 1.0);
    assert_eq!(counter("sandbolt_janitor_fail_safe_scans", &[]), 0.0);
    assert_eq!(ops_get(&ops, "readyz").await.0, 200);

    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
    janitor.scan_once().await.expect_err("containerd is gone");
    let (status, body) = ops_get(&ops, "readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("could not reach containerd"), "{body}");
    let (counters, text) = scrape(&ops).await;
    assert_eq!(
        counters.get(&("sandbolt_janitor_scans".to_string(), vec![])),
        Some(&2.0),
        "{text}"
    );
    ops.shutdown().await;
    ctl.shutdown().await;
}
