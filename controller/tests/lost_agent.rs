//! Failure policies with real components: the controller, two real agents on
//! one test bed (private containerd, busybox, static execd as PID 1). The
//! agent holding two sandboxes is shut down (its heartbeats stop, its proxy
//! goes away); the AUTO_RECREATE sandbox comes back on the other agent and
//! answers execd `/ping` through that agent's proxy, the MANUAL one is
//! marked failed. When the lost agent comes back, the stale copy of the
//! recreated sandbox (no record owns it any more) is removed.

mod support;

use std::time::Duration;

use sandbolt_controller::{Consistency, Controller, ControllerConfig};
use sandbolt_proto::fastpath::v2;
use support::bed::{
    V2, containers, eventually, ping_execd, running_tasks, sandbox_id, start_agent, start_bed,
    wait_agents,
};

const TOKEN: &str = "lost-agent-token";
const HB: Duration = Duration::from_millis(100);
const RECOVERY_TIMEOUT_SECONDS: i32 = 30;

fn req(name: &str, policy: v2::FailurePolicy) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: name.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "3600".into()],
        completion: v2::CreateCompletion::Ready as i32,
        failure_policy: policy as i32,
        recovery_timeout_seconds: RECOVERY_TIMEOUT_SECONDS,
        ..Default::default()
    }
}

async fn diag(c: &V2, name: &str) -> v2::SandboxDiagnosticsResponse {
    c.clone()
        .get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
            sandbox_name: name.into(),
            namespace: "default".into(),
            limit: 100,
        })
        .await
        .unwrap_or_else(|e| panic!("diagnostics of {name}: {e:?}"))
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_agent_auto_recreates_on_the_other_agent_and_manual_is_marked_failed() {
    let bed = start_bed().await;
    let data = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
    cfg.default_consistency = Consistency::Strong;
    cfg.heartbeat_interval = HB;
    cfg.lost_agent_timeout = Duration::from_secs(1);
    cfg.expiry_sweep_interval = Duration::from_millis(200);
    cfg.failpoint = None;
    let ctl = Controller::start(cfg).await.expect("controller starts");
    let addr = ctl.local_addr();
    let mut c = V2::connect(format!("http://{addr}")).await.unwrap();

    let (state1, state2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent1 = start_agent(&bed, "agent-1", state1.path(), addr, TOKEN, 4, HB).await;
    wait_agents(&c, 1).await;
    // Both sandboxes land on agent-1: it is the only agent yet.
    c.create_sandbox(req("auto", v2::FailurePolicy::AutoRecreate))
        .await
        .expect("create auto");
    c.create_sandbox(req("manual", v2::FailurePolicy::Manual))
        .await
        .expect("create manual");
    let before = diag(&c, "auto").await;
    let (auto_sid, manual_sid) = (
        before.runtime_instance_id.clone(),
        sandbox_id(&mut c, "manual").await,
    );
    let (ep, status) = ping_execd(&mut c, "auto").await;
    assert_eq!(status, 200);
    assert!(
        ep.starts_with(&agent1.proxy_addr().to_string()),
        "{ep} is agent-1's proxy"
    );

    let agent2 = start_agent(&bed, "agent-2", state2.path(), addr, TOKEN, 4, HB).await;
    wait_agents(&c, 2).await;
    let agent2_proxy = agent2.proxy_addr().to_string();

    // agent-1 goes away: no heartbeats, no proxy, no API (its containers
    // keep running, as after a crash of the agent process alone).
    agent1.shutdown().await;
    // "Within recovery_timeout_seconds": the wait gives up at that bound.
    let recovery = Duration::from_secs(RECOVERY_TIMEOUT_SECONDS as u64);
    eventually("auto recreated on agent-2", recovery, || {
        let c = c.clone();
        let auto_sid = auto_sid.clone();
        async move {
            let d = diag(&c, "auto").await;
            d.assignment_state == "Assigned" && d.runtime_instance_id != auto_sid
        }
    })
    .await;
    let after = diag(&c, "auto").await;
    assert_eq!(after.assignment_attempt, before.assignment_attempt + 1);
    assert!(
        after
            .events
            .iter()
            .any(|e| e.message.contains("recreated on agent agent-2")),
        "{:?}",
        after.events
    );
    assert!(after.sandbox.unwrap().ready);
    let new_sid = after.runtime_instance_id;
    assert!(
        running_tasks(&bed).await.contains_key(&new_sid),
        "the recreated sandbox runs in containerd"
    );
    let (ep, status) = ping_execd(&mut c, "auto").await;
    assert!(ep.starts_with(&agent2_proxy), "{ep} is agent-2's proxy");
    assert_eq!(status, 200, "execd of the recreated sandbox answers");

    let manual = diag(&c, "manual").await;
    assert_eq!(manual.assignment_state, "Failed");
    assert_eq!(
        manual.runtime_instance_id, manual_sid,
        "MANUAL: left where it was"
    );
    assert_eq!(
        manual.sandbox.unwrap().runtime.unwrap().state,
        v2::RuntimeState::Failed as i32
    );
    assert!(
        manual
            .events
            .iter()
            .any(|e| e.message.contains("MANUAL policy")),
        "{:?}",
        manual.events
    );
    let all = containers(&bed).await;
    assert!(
        all.contains(&manual_sid),
        "MANUAL: its container is left alone: {all:?}"
    );

    // agent-1 comes back (same id: it finds its containers by label). The
    // old copy of `auto` belongs to no record now and is removed; the
    // recreated one stays.
    let agent1 = start_agent(&bed, "agent-1", state1.path(), addr, TOKEN, 4, HB).await;
    eventually(
        "stale copy of auto removed",
        Duration::from_secs(30),
        || {
            let bed = &bed;
            let auto_sid = auto_sid.clone();
            async move { !containers(bed).await.contains(&auto_sid) }
        },
    )
    .await;
    assert!(containers(&bed).await.contains(&new_sid));
    let (_, status) = ping_execd(&mut c, "auto").await;
    assert_eq!(status, 200);

    ctl.shutdown().await;
    agent1.shutdown().await;
    agent2.shutdown().await;
}
