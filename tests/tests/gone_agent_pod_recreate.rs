//! A gone agent on Kubernetes: the controller asks the API server (the
//! in-process double, through a real `kube::Client`) about a silent agent's
//! pod, and gives its sandboxes up only once that pod is gone and no other
//! agent pod of its pool is on its node. Real agents on the test bed, each
//! told its pod by the downward-API settings the chart gives it.
//!
//! Silent with its pod still there → nothing happens, past the timeout.
//! Pod deleted but a successor pod on the node → nothing happens.
//! API server failing → nothing happens.
//! Pod and successor gone → AUTO_RECREATE is recreated on the other agent
//! (and answers there), MANUAL is Failed, naming the pod. When the agent
//! comes back after all, the stale copy of the recreated sandbox goes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::registry::KubeAgentPresence;
use sandbolt_controller::store::{Phase, SandboxRecord};
use sandbolt_controller::{AgentId, Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_e2e::bed::stored_record as record;
use sandbolt_e2e::bed::{
    V2, agent_config, busybox_create_with_policy, containers, create_agent_pod, eventually,
    ping_execd, start_bed, wait_agents,
};
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::fastpath::v2;
use sandbolt_testbed::Testbed;
use serde_json::json;

const TOKEN: &str = "agent-gone-token";
const POD_NS: &str = "sandbolt";
const HB: Duration = Duration::from_millis(100);
const LOST: Duration = Duration::from_secs(1);
const GONE: Duration = Duration::from_secs(4);

/// A real agent in the pod `pod` (name, uid) on `node`, as the chart's
/// downward-API variables describe it.
async fn start_agent_in_pod(
    bed: &Testbed,
    id: &str,
    node: &str,
    pod: (&str, &str),
    state: &std::path::Path,
    ctl: &ControllerHandle,
) -> AgentHandle {
    let mut cfg = agent_config(bed, id, state, ctl.local_addr(), TOKEN);
    cfg.node_name = node.into();
    cfg.pod_name = Some(pod.0.into());
    cfg.pod_uid = Some(pod.1.into());
    cfg.pod_namespace = Some(POD_NS.into());
    cfg.heartbeat_interval = HB;
    cfg.max_sandboxes = 4;
    Agent::start(cfg).await.expect("agent starts")
}

fn req(name: &str, policy: v2::FailurePolicy) -> v2::CreateSandboxRequest {
    busybox_create_with_policy(name, policy, 60)
}

/// Asserts the records are as they were: same phase, sandbox id, agent.
fn unchanged(ctl: &ControllerHandle, before: &[SandboxRecord], when: &str) {
    for b in before {
        let r = record(ctl, &b.name);
        assert_eq!(
            (r.phase, &r.sandbox_id, &r.agent_id),
            (b.phase, &b.sandbox_id, &b.agent_id),
            "{when}: {} changed: {:?}",
            b.name,
            r.events
        );
    }
}

/// Waits until the API double has served `n` more requests of `verb` on
/// pods than `from` (the presence check has really asked).
async fn pod_requests(api: &ApiDouble, verb: &str, from: usize, n: usize) {
    eventually(&format!("{n} more pod {verb}s"), GONE * 3, || async {
        api.requests(verb, "pods") >= from + n
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_gone_agent_pod_lets_auto_recreate_and_manual_failure_happen() {
    let bed = start_bed().await;
    let api = ApiDouble::start().await;
    let pods: Api<Pod> = Api::namespaced(api.client(), POD_NS);
    let uid1 = create_agent_pod(&pods, "agent-1-pod", "node-1", "default").await;
    let uid2 = create_agent_pod(&pods, "agent-2-pod", "node-2", "default").await;

    let data = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
    cfg.default_consistency = Consistency::Strong;
    cfg.heartbeat_interval = HB;
    cfg.lost_agent_timeout = LOST;
    cfg.agent_gone_timeout = GONE;
    cfg.agent_presence = Some(Arc::new(KubeAgentPresence::new(api.client())));
    cfg.expiry_sweep_interval = Duration::from_millis(200);
    cfg.failpoint = None;
    let ctl = Controller::start(cfg).await.expect("controller starts");
    let mut c = V2::connect(format!("http://{}", ctl.local_addr()))
        .await
        .unwrap();

    let (state1, state2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent1 = start_agent_in_pod(
        &bed,
        "agent-1",
        "node-1",
        ("agent-1-pod", &uid1),
        state1.path(),
        &ctl,
    )
    .await;
    wait_agents(&c, 1).await;
    for (name, policy) in [
        ("auto", v2::FailurePolicy::AutoRecreate),
        ("manual", v2::FailurePolicy::Manual),
    ] {
        c.create_sandbox(req(name, policy))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    }
    let agent2 = start_agent_in_pod(
        &bed,
        "agent-2",
        "node-2",
        ("agent-2-pod", &uid2),
        state2.path(),
        &ctl,
    )
    .await;
    wait_agents(&c, 2).await;
    let before: Vec<SandboxRecord> = ["auto", "manual"].iter().map(|n| record(&ctl, n)).collect();
    assert!(before.iter().all(|r| r.agent_id == "agent-1"));
    let auto_sid = before[0].sandbox_id.clone();

    // 1. Silent, pod still there: past the gone timeout, the controller asks
    //    the API about the pod (more than once) and changes nothing.
    agent1.shutdown().await;
    let silent_since = Instant::now();
    eventually("agent-1 silent", Duration::from_secs(10), || async {
        ctl.core().agent_silent(&AgentId::from("agent-1"))
    })
    .await;
    let gets = api.requests("get", "pods");
    pod_requests(&api, "get", gets, 2).await;
    assert!(
        silent_since.elapsed() >= GONE,
        "asked only after the timeout"
    );
    unchanged(&ctl, &before, "pod still there");
    assert!(ctl.core().agent_silent(&AgentId::from("agent-1")));

    // 2. The pod is deleted, but a successor of the same pool is on the
    //    node (pulling its image, say): it will adopt the sandboxes.
    pods.delete("agent-1-pod", &DeleteParams::default())
        .await
        .expect("delete pod");
    create_agent_pod(&pods, "agent-1-pod-next", "node-1", "default").await;
    let lists = api.requests("list", "pods");
    pod_requests(&api, "list", lists, 2).await;
    unchanged(&ctl, &before, "successor on the node");

    // An agent pod of another pool on that node is no successor; an API
    // server that cannot answer proves nothing either (two checks fail).
    pods.delete("agent-1-pod-next", &DeleteParams::default())
        .await
        .expect("delete successor");
    create_agent_pod(&pods, "other-pool-pod", "node-1", "gpu").await;
    let gets = api.requests("get", "pods");
    api.fail_next("get", "pods", 500, 2);
    pod_requests(&api, "get", gets, 2).await;
    unchanged(&ctl, &before, "API server failing");

    // 3. The API answers again: agent-1 is gone. AUTO_RECREATE moves to
    //    agent-2, MANUAL fails.
    let recovery = Duration::from_secs(60);
    eventually("auto recreated on agent-2", recovery, || async {
        let r = record(&ctl, "auto");
        r.phase == Phase::Running && r.agent_id == "agent-2"
    })
    .await;
    let auto = record(&ctl, "auto");
    assert_ne!(auto.sandbox_id, auto_sid);
    assert!(
        auto.events
            .iter()
            .any(|e| e.message.contains("agent-1-pod no longer exists")),
        "{:?}",
        auto.events
    );
    let (ep, status) = ping_execd(&mut c, "auto").await;
    assert!(
        ep.starts_with(&agent2.proxy_addr().to_string()),
        "{ep} is agent-2's proxy"
    );
    assert_eq!(status, 200, "execd of the recreated sandbox answers");
    let manual = record(&ctl, "manual");
    assert_eq!(manual.phase, Phase::Failed);
    assert_eq!(manual.sandbox_id, before[1].sandbox_id, "MANUAL: not moved");
    assert!(
        manual.message.contains("agent-1 is gone") && manual.message.contains("agent-1-pod"),
        "{}",
        manual.message
    );

    // 4. agent-1 comes back after all (a node that was only cut off): the
    //    old copy of `auto` belongs to no record now and is removed.
    let uid1b = create_agent_pod(&pods, "agent-1-pod-2", "node-1", "default").await;
    let agent1 = start_agent_in_pod(
        &bed,
        "agent-1",
        "node-1",
        ("agent-1-pod-2", &uid1b),
        state1.path(),
        &ctl,
    )
    .await;
    eventually(
        "stale copy of auto removed",
        Duration::from_secs(30),
        || {
            let (bed, auto_sid) = (&bed, auto_sid.clone());
            async move { !containers(bed).await.contains(&auto_sid.to_string()) }
        },
    )
    .await;
    assert_eq!(record(&ctl, "auto").sandbox_id, auto.sandbox_id);
    assert_eq!(ping_execd(&mut c, "auto").await.1, 200);

    ctl.shutdown().await;
    agent1.shutdown().await;
    agent2.shutdown().await;
}

/// The presence source alone, against pods in each state that matters.
#[tokio::test]
async fn presence_follows_the_agent_pod_and_its_successors() {
    use kube::api::{Patch, PatchParams};
    use sandbolt_controller::registry::{AgentPresence, AgentWhereabouts, Presence};
    use sandbolt_proto::agent::v1::AgentPod;

    let api = ApiDouble::start().await;
    let pods: Api<Pod> = Api::namespaced(api.client(), POD_NS);
    let presence = KubeAgentPresence::new(api.client());
    let uid = create_agent_pod(&pods, "p", "node-1", "default").await;
    let who = |uid: &str| AgentWhereabouts {
        agent_id: "a".into(),
        node_name: "node-1".into(),
        pool: "default".into(),
        pod: Some(AgentPod {
            namespace: POD_NS.into(),
            name: "p".into(),
            uid: uid.into(),
        }),
    };
    let check = |w: AgentWhereabouts| {
        let presence = presence.clone();
        async move { presence.check(&w).await.expect("the API answers") }
    };

    assert_eq!(check(who(&uid)).await, Presence::Present);
    let unknown = AgentWhereabouts {
        pod: None,
        ..who(&uid)
    };
    assert_eq!(check(unknown).await, Presence::Unknown);

    // Stopped for good (evicted, say): gone, as no successor is there.
    pods.patch_status(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Failed"}})),
    )
    .await
    .unwrap();
    match check(who(&uid)).await {
        Presence::Gone(why) => assert!(why.contains("terminated"), "{why}"),
        other => panic!("{other:?}"),
    }

    // Re-created under the same name: that pod is a successor.
    pods.delete("p", &DeleteParams::default()).await.unwrap();
    create_agent_pod(&pods, "p", "node-1", "default").await;
    match check(who(&uid)).await {
        Presence::Replacing(why) => assert!(why.contains("was replaced"), "{why}"),
        other => panic!("{other:?}"),
    }

    // Pods of another pool, of another node, or stopped for good are none.
    pods.delete("p", &DeleteParams::default()).await.unwrap();
    create_agent_pod(&pods, "other-pool", "node-1", "gpu").await;
    create_agent_pod(&pods, "other-node", "node-2", "default").await;
    create_agent_pod(&pods, "stopped", "node-1", "default").await;
    pods.patch_status(
        "stopped",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    match check(who(&uid)).await {
        Presence::Gone(why) => assert!(why.contains("no longer exists"), "{why}"),
        other => panic!("{other:?}"),
    }

    // Cannot be asked: an error, never a verdict.
    api.fail_next("get", "pods", 500, 1);
    assert!(presence.check(&who(&uid)).await.is_err());
}
