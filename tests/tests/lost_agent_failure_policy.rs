//! Agent outages with real components: the controller, two real agents on
//! one test bed (private containerd, busybox, static execd as PID 1), and no
//! Kubernetes — so nothing can ever prove an agent gone.
//!
//! The agent holding three sandboxes is shut down (its heartbeats stop, its
//! proxy goes away; its containers run on, as after a crash of the agent
//! process alone) and stays away for many lost-agent timeouts: every record
//! keeps its phase and its sandbox id, whatever the failure policy. While it
//! is away two of the containers are removed behind its back (what a node
//! reboot or a wiped containerd does). When the agent is back, the sandbox it
//! reports is simply Running again and answers through its proxy; the two it
//! no longer has get their failure policies: the AUTO_RECREATE one is
//! recreated and answers, the MANUAL one is Failed and says why.
//! (A gone agent on Kubernetes: `gone_agent_pod_recreate.rs`.)

use std::time::Duration;

use sandbolt_controller::store::{Phase, SandboxRecord};
use sandbolt_controller::{AgentId, Consistency, Controller, ControllerConfig};
use sandbolt_e2e::bed::stored_record as record;
use sandbolt_e2e::bed::{
    NS, V2, busybox_create_with_policy, containers, eventually, ping_execd, sandbox_id,
    start_agent, start_bed, wait_agents,
};
use sandbolt_proto::fastpath::v2;

const TOKEN: &str = "lost-agent-token";
const HB: Duration = Duration::from_millis(100);
const LOST: Duration = Duration::from_secs(1);
const RECOVERY_TIMEOUT_SECONDS: i32 = 30;

fn req(name: &str, policy: v2::FailurePolicy) -> v2::CreateSandboxRequest {
    busybox_create_with_policy(name, policy, RECOVERY_TIMEOUT_SECONDS)
}

/// Removes a container and its task the way a reboot or a wiped containerd
/// loses them: behind the agent's back.
fn remove_behind_the_agents_back(bed: &sandbolt_testbed::Testbed, id: &str) {
    for args in [
        vec!["tasks", "delete", "--force", id],
        vec!["containers", "delete", id],
    ] {
        let out = bed.ctr(NS).args(&args).output().expect("ctr runs");
        assert!(
            out.status.success(),
            "ctr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_fails_nothing_and_vanished_containers_get_their_failure_policy() {
    let bed = start_bed().await;
    let data = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
    cfg.default_consistency = Consistency::Strong;
    cfg.heartbeat_interval = HB;
    cfg.lost_agent_timeout = LOST;
    // Would be long passed: without a presence source it must not matter.
    cfg.agent_gone_timeout = Duration::from_secs(2);
    cfg.expiry_sweep_interval = Duration::from_millis(200);
    cfg.failpoint = None;
    assert!(
        cfg.agent_presence.is_none(),
        "one machine: no presence source"
    );
    let ctl = Controller::start(cfg).await.expect("controller starts");
    let addr = ctl.local_addr();
    let mut c = V2::connect(format!("http://{addr}")).await.unwrap();

    let (state1, state2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent1 = start_agent(&bed, "agent-1", state1.path(), addr, TOKEN, 4, HB).await;
    wait_agents(&c, 1).await;
    // All three land on agent-1: it is the only agent yet.
    for (name, policy) in [
        ("keep", v2::FailurePolicy::Manual),
        ("auto", v2::FailurePolicy::AutoRecreate),
        ("manual", v2::FailurePolicy::Manual),
    ] {
        c.create_sandbox(req(name, policy))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    }
    let before: Vec<SandboxRecord> = ["keep", "auto", "manual"]
        .iter()
        .map(|n| record(&ctl, n))
        .collect();
    for r in &before {
        assert_eq!(r.agent_id, "agent-1");
        assert_eq!(r.phase, Phase::Running);
    }
    let agent2 = start_agent(&bed, "agent-2", state2.path(), addr, TOKEN, 4, HB).await;
    wait_agents(&c, 2).await;

    // agent-1 goes silent.
    agent1.shutdown().await;
    eventually("agent-1 silent", Duration::from_secs(10), || async {
        ctl.core().agent_silent(&AgentId::from("agent-1"))
    })
    .await;
    assert!(!ctl.core().agent_silent(&AgentId::from("agent-2")));
    assert!(!ctl.core().agent_silent(&AgentId::from("no-such-agent")));
    // Many lost-agent timeouts (and past the gone timeout) of silence:
    // nothing may change, so there is nothing to poll for — only to wait.
    tokio::time::sleep(LOST * 5).await;
    assert!(ctl.core().agent_silent(&AgentId::from("agent-1")));
    for b in &before {
        let r = record(&ctl, &b.name);
        assert_eq!(
            (r.phase, &r.sandbox_id, &r.agent_id, r.assignment_attempt),
            (b.phase, &b.sandbox_id, &b.agent_id, b.assignment_attempt),
            "{}: silence changed the record: {:?}",
            b.name,
            r.events
        );
        assert_eq!(r.events.len(), b.events.len(), "{:?}", r.events);
    }
    let all = containers(&bed).await;
    for b in &before {
        assert!(
            all.contains(&b.sandbox_id.to_string()),
            "{} still exists",
            b.name
        );
    }

    // While it is away, two containers vanish.
    let (keep_sid, auto_sid, manual_sid) = (
        before[0].sandbox_id.clone(),
        before[1].sandbox_id.clone(),
        before[2].sandbox_id.clone(),
    );
    remove_behind_the_agents_back(&bed, &auto_sid);
    remove_behind_the_agents_back(&bed, &manual_sid);

    // agent-1 comes back (same id: it finds its remaining container by label).
    let agent1 = start_agent(&bed, "agent-1", state1.path(), addr, TOKEN, 4, HB).await;
    eventually("agent-1 heard again", Duration::from_secs(10), || async {
        !ctl.core().agent_silent(&AgentId::from("agent-1"))
    })
    .await;
    // The sandbox it reports needed no repair: same record, and it answers.
    let keep = record(&ctl, "keep");
    assert_eq!(
        (keep.phase, keep.sandbox_id.as_str()),
        (Phase::Running, keep_sid.as_str())
    );
    let (ep, status) = ping_execd(&mut c, "keep").await;
    assert_eq!(status, 200, "execd of the kept sandbox answers");
    assert!(
        ep.starts_with(&agent1.proxy_addr().to_string()),
        "{ep} is agent-1's proxy"
    );

    // The two it no longer has: MANUAL failed, AUTO_RECREATE recreated.
    let recovery = Duration::from_secs(RECOVERY_TIMEOUT_SECONDS as u64);
    eventually("manual marked failed", recovery, || async {
        record(&ctl, "manual").phase == Phase::Failed
    })
    .await;
    let manual = record(&ctl, "manual");
    assert_eq!(manual.sandbox_id, manual_sid, "MANUAL: not moved");
    assert!(manual.message.contains("vanished"), "{}", manual.message);
    assert!(
        manual
            .events
            .iter()
            .any(|e| e.message.contains("MANUAL policy")),
        "{:?}",
        manual.events
    );
    eventually("auto recreated", recovery, || async {
        let r = record(&ctl, "auto");
        r.phase == Phase::Running && r.sandbox_id != auto_sid
    })
    .await;
    let auto = record(&ctl, "auto");
    assert_eq!(auto.assignment_attempt, before[1].assignment_attempt + 1);
    assert!(
        auto.events.iter().any(|e| e.message.contains("vanished")),
        "{:?}",
        auto.events
    );
    assert!(
        containers(&bed)
            .await
            .contains(&auto.sandbox_id.to_string())
    );
    assert_eq!(
        ping_execd(&mut c, "auto").await.1,
        200,
        "execd of the recreated sandbox answers"
    );
    assert_eq!(sandbox_id(&mut c, "keep").await, keep_sid);
    assert_eq!(record(&ctl, "keep").phase, Phase::Running);

    ctl.shutdown().await;
    agent1.shutdown().await;
    agent2.shutdown().await;
}
