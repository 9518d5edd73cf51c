//! The agent's `/metrics`, `/healthz` and `/readyz` (the ops router that
//! `--metrics-listen` serves) after a create / exec / delete round on a real
//! agent: every stage of a cold create is observed once, creates are counted
//! by outcome and source, RPCs by method and code, and the sandbox gauge
//! follows the table up and down. Scrapes are parsed as OpenMetrics.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use openmetrics_parser::OpenMetricsValue;
use openmetrics_parser::openmetrics::parse_openmetrics;
use prometheus_client::registry::Registry;
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_proto::agent::v1::{
    GetInventoryRequest, SandboxPhase, SandboxRef, WarmClass, WarmTarget,
};
use sandbolt_proto::wire::{EXECD_PORT, EXECD_TOKEN_HEADER, PROXY_TOKEN_HEADER};
use sandbolt_telemetry::OpsServer;
use tonic::Code;

const AGENT_SERVICE: &str = "sandbolt.agent.v1.AgentService";

/// One parsed scrape: each sample's value by family and labels.
struct Scrape {
    samples: HashMap<(String, Vec<(String, String)>), OpenMetricsValue>,
    text: String,
}

impl Scrape {
    async fn of(ops: &OpsServer) -> Scrape {
        let (status, text) = ops_get(ops, "metrics").await;
        assert_eq!(status, 200, "{text}");
        let exposition = parse_openmetrics(&text)
            .unwrap_or_else(|e| panic!("/metrics is not OpenMetrics ({e:?}):\n{text}"));
        let mut samples = HashMap::new();
        for (name, family) in exposition.families {
            for sample in family.iter_samples() {
                let mut labels: Vec<(String, String)> = sample
                    .get_labelset()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                labels.sort();
                samples.insert((name.clone(), labels), sample.value.clone());
            }
        }
        Scrape { samples, text }
    }

    /// The value of `family{labels}`: a counter's or gauge's value, a
    /// histogram's count. Absent series read 0.
    fn value(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        let mut key: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        key.sort();
        match self.samples.get(&(family.to_string(), key)) {
            None => 0.0,
            Some(OpenMetricsValue::Counter(c)) => c.value.as_f64(),
            Some(OpenMetricsValue::Gauge(g)) => g.as_f64(),
            Some(OpenMetricsValue::Histogram(h)) => h.count.unwrap_or(0) as f64,
            Some(other) => panic!("{family}{labels:?} is {other:?}:\n{}", self.text),
        }
    }

    fn stage_count(&self, stage: &str) -> f64 {
        self.value(
            "sandbolt_agent_create_stage_duration_seconds",
            &[("stage", stage)],
        )
    }

    fn creates(&self, outcome: &str, source: &str) -> f64 {
        self.value(
            "sandbolt_agent_creates",
            &[("outcome", outcome), ("source", source)],
        )
    }

    fn sandboxes(&self) -> f64 {
        self.value("sandbolt_agent_sandboxes", &[])
    }

    fn rpcs(&self, method: &str, code: &str) -> f64 {
        self.value(
            "sandbolt_grpc_server_requests",
            &[
                ("component", "agent"),
                ("service", AGENT_SERVICE),
                ("method", method),
                ("code", code),
            ],
        )
    }
}

/// GET `/<path>` of the ops router: (status, body).
async fn ops_get(ops: &OpsServer, path: &str) -> (u16, String) {
    let endpoint = format!("{}/{path}", ops.local_addr());
    sandbolt_test_support::http::get(&endpoint, "", &[]).await
}

/// `sh -c 'echo ran'` through the data-plane proxy into execd.
async fn exec_echo(env: &Env, id: &str) -> String {
    let endpoint = format!("{}/{id}/{EXECD_PORT}", env.agent().proxy_addr());
    let token = format!("token-{id}");
    let headers = [
        (PROXY_TOKEN_HEADER.to_string(), token.clone()),
        (EXECD_TOKEN_HEADER.to_string(), token),
    ];
    let (status, body) = sandbolt_test_support::http::request(
        &endpoint,
        "POST",
        "/command",
        &headers,
        r#"{"argv":["sh","-c","echo ran"]}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

/// A started agent whose metrics are registered into the registry that
/// its ops router serves.
async fn start(tweak: impl FnOnce(&mut AgentConfig)) -> (Env, OpsServer) {
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(&bed, state.path(), "agent-metrics");
    tweak(&mut cfg);
    let mut registry = Registry::default();
    let agent = Agent::start_with_metrics(cfg, &mut registry)
        .await
        .expect("agent starts");
    let router = sandbolt_telemetry::ops_router(Arc::new(registry), agent.readiness());
    let ops = sandbolt_telemetry::serve_ops("127.0.0.1:0".parse().unwrap(), router)
        .await
        .expect("ops router serves");
    let client = client(agent.grpc_addr(), TOKEN).await;
    let env = Env {
        agent: Some(agent),
        client,
        state,
        volume_root: None,
        bed,
    };
    (env, ops)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_create_exec_delete_round_shows_in_the_agents_metrics() {
    let (mut env, ops) = start(|_| {}).await;
    let (status, body) = ops_get(&ops, "readyz").await;
    assert_eq!(
        status, 200,
        "containerd answers, no controller to register with: {body}"
    );
    let (status, _) = ops_get(&ops, "healthz").await;
    assert_eq!(status, 200);
    // A call before the first scrape: openmetrics-parser 0.5 (unlike
    // Prometheus) refuses the gRPC families while they have no sample.
    env.client
        .get_inventory(GetInventoryRequest {})
        .await
        .expect("inventory");
    let before = Scrape::of(&ops).await;
    assert_eq!(before.sandboxes(), 0.0, "{}", before.text);
    assert_eq!(before.rpcs("GetInventory", "OK"), 1.0, "{}", before.text);
    assert_eq!(before.creates("ok", "cold"), 0.0, "{}", before.text);

    let mut spec = sh_spec("sb-metrics", "exec sleep 1000");
    spec.wait_for_execd = true;
    env.create(spec).await.expect("cold create");
    let created = Scrape::of(&ops).await;
    for stage in ["image", "container", "task", "execd_ready"] {
        assert_eq!(
            created.stage_count(stage),
            1.0,
            "{stage}:\n{}",
            created.text
        );
    }
    assert_eq!(created.stage_count("warm_claim"), 0.0, "{}", created.text);
    assert_eq!(created.creates("ok", "cold"), 1.0, "{}", created.text);
    assert_eq!(created.sandboxes(), 1.0, "{}", created.text);
    assert_eq!(created.rpcs("CreateSandbox", "OK"), 1.0, "{}", created.text);

    assert!(exec_echo(&env, "sb-metrics").await.contains("ran"));
    // A create the agent refuses, and a lookup of an unknown sandbox.
    let mut refused = sh_spec("sb-metrics-bad", "true");
    refused.runtime = "no-such-runtime".into();
    let err = env.create(refused).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let not_found = env
        .client
        .get_sandbox(SandboxRef {
            sandbox_id: "sb-never-created".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(not_found.code(), Code::NotFound);
    wait_for_phase(&env.client, "sb-metrics", SandboxPhase::Running).await;
    assert!(env.delete_leaving_nothing("sb-metrics", 2000).await);

    let after = Scrape::of(&ops).await;
    assert_eq!(after.sandboxes(), 0.0, "deleted:\n{}", after.text);
    assert_eq!(after.creates("error", "cold"), 1.0, "{}", after.text);
    assert_eq!(after.creates("ok", "cold"), 1.0, "{}", after.text);
    for stage in ["image", "container", "task", "execd_ready"] {
        assert_eq!(
            after.stage_count(stage),
            1.0,
            "the refused create started no stage ({stage}):\n{}",
            after.text
        );
    }
    assert_eq!(
        after.rpcs("CreateSandbox", "FAILED_PRECONDITION"),
        1.0,
        "{}",
        after.text
    );
    assert_eq!(after.rpcs("GetSandbox", "NOT_FOUND"), 1.0, "{}", after.text);
    assert_eq!(after.rpcs("DeleteSandbox", "OK"), 1.0, "{}", after.text);
    assert!(after.rpcs("GetSandbox", "OK") >= 1.0, "{}", after.text);

    drop(ops);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_the_controller_has_not_answered_is_not_ready() {
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(&bed, state.path(), "agent-unregistered");
    // Nothing listens there: no heartbeat is ever answered.
    cfg.controller_endpoint = Some(format!(
        "http://127.0.0.1:{}",
        sandbolt_test_support::free_port()
    ));
    let agent = Agent::start_with_metrics(cfg, &mut Registry::default())
        .await
        .expect("agent starts");
    let reason = eventually_async("a failed heartbeat", WAIT, || {
        let ready = agent.readiness();
        async move {
            ready
                .check()
                .await
                .err()
                .filter(|r| r.contains("heartbeat failed"))
        }
    })
    .await;
    assert!(reason.contains("Unavailable"), "{reason}");
    agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

fn warm_targets(count: i32) -> Vec<WarmTarget> {
    let class = WarmClass {
        warm_pool: "wp".into(),
        image: "busybox".into(),
        ..Default::default()
    };
    vec![WarmTarget {
        class: Some(class),
        count,
    }]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_warm_claim_is_timed_and_counted_and_warm_sandboxes_are_gauged_by_pool() {
    let (mut env, ops) = start(|cfg| {
        cfg.warm_pool_interval = std::time::Duration::from_millis(200);
        cfg.warm_refill_pause = std::time::Duration::from_millis(10);
    })
    .await;
    env.client
        .get_inventory(GetInventoryRequest {})
        .await
        .expect("inventory");
    env.agent().set_warm_targets(warm_targets(1));
    let warm_id = eventually("a claimable warm sandbox", WAIT, || {
        let warm = env.agent().sandboxes().warm_sandboxes();
        warm.iter().find(|w| w.ready).map(|w| w.id.clone())
    })
    .await;
    let filled = Scrape::of(&ops).await;
    let warm_in_pool = |s: &Scrape| s.value("sandbolt_agent_warm_sandboxes", &[("pool", "wp")]);
    assert_eq!(warm_in_pool(&filled), 1.0, "{}", filled.text);
    assert_eq!(
        filled.sandboxes(),
        0.0,
        "warm ones are not sandboxes:\n{}",
        filled.text
    );

    let mut spec = sh_spec(&warm_id, "exec sleep 1000");
    spec.wait_for_execd = true;
    let resp = env.create(spec).await.expect("claim");
    assert!(resp.claimed_warm, "{resp:?}");
    env.agent().set_warm_targets(vec![]);
    let claimed = eventually_async("the refill trimmed away", WAIT, || async {
        let s = Scrape::of(&ops).await;
        (warm_in_pool(&s) == 0.0).then_some(s)
    })
    .await;
    assert_eq!(claimed.sandboxes(), 1.0, "{}", claimed.text);
    assert_eq!(claimed.stage_count("warm_claim"), 1.0, "{}", claimed.text);
    assert_eq!(claimed.creates("ok", "warm"), 1.0, "{}", claimed.text);
    assert_eq!(claimed.creates("ok", "cold"), 0.0, "{}", claimed.text);
    for stage in ["image", "container", "task", "execd_ready"] {
        assert_eq!(
            claimed.stage_count(stage),
            0.0,
            "warm starts are no user's wait ({stage}):\n{}",
            claimed.text
        );
    }
    assert!(env.delete_leaving_nothing(&warm_id, 2000).await);
    let deleted = Scrape::of(&ops).await;
    assert_eq!(deleted.sandboxes(), 0.0, "{}", deleted.text);

    drop(ops);
    env.shutdown().await;
}
