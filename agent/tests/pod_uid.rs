//! Agent identity in a cluster: every container carries the agent pod's UID,
//! and an agent started in a new pod (a DaemonSet update) moves the
//! containers it adopts to its own UID before it serves — the sandboxes keep
//! running throughout. Real containerd (the test bed).

use crate::common;

use common::*;
use sandbolt_agent::Agent;
use sandbolt_agent::labels;
use sandbolt_proto::agent::v1::SandboxPhase;

fn label(env: &Env, id: &str, key: &str) -> Option<String> {
    let info = env.ctr(&["containers", "info", id]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    info["Labels"][key].as_str().map(str::to_string)
}

fn task_running(env: &Env, id: &str) -> bool {
    env.ctr(&["tasks", "list"])
        .lines()
        .any(|l| l.starts_with(id) && l.contains("RUNNING"))
}

async fn phase(client: &mut Client, id: &str) -> SandboxPhase {
    get(client, id).await.expect("get sandbox").phase()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_agent_pod_relabels_and_keeps_the_sandboxes_of_the_old_one() {
    let mut env = Env::start_with(|c| c.pod_uid = Some("pod-uid-a".into())).await;
    let ids = ["sb-pod-1", "sb-pod-2"];
    for id in ids {
        env.client
            .create_sandbox(create_req(spec(id, &["sleep", "1000"])))
            .await
            .expect("create");
        assert_eq!(
            label(&env, id, labels::AGENT_POD_UID).as_deref(),
            Some("pod-uid-a")
        );
    }
    // A sandbox of another agent on the same containerd: not adopted, so
    // not re-labelled either.
    let mut other_cfg = config(&env.bed, env.state.path(), "other-agent");
    other_cfg.pod_uid = Some("pod-uid-other".into());
    let other = Agent::start(other_cfg).await.expect("other agent starts");
    let mut other_client = client(other.grpc_addr(), TOKEN).await;
    other_client
        .create_sandbox(create_req(spec("sb-other", &["sleep", "1000"])))
        .await
        .expect("create on the other agent");
    other.shutdown().await;

    // The pod is replaced: the old agent stops, sandboxes keep running.
    env.agent.take().unwrap().shutdown().await;
    let mut cfg = config(&env.bed, env.state.path(), "agent-test");
    cfg.pod_uid = Some("pod-uid-b".into());
    let agent = Agent::start(cfg)
        .await
        .expect("agent starts in the new pod");
    // Agent::start returns only after recovery: the labels are already moved
    // when the agent can first be reached.
    for id in ids {
        assert_eq!(
            label(&env, id, labels::AGENT_POD_UID).as_deref(),
            Some("pod-uid-b"),
            "{id} was adopted by the new pod"
        );
        assert!(task_running(&env, id), "{id} still runs");
        // Everything else the labels say is untouched.
        assert_eq!(
            label(&env, id, labels::AGENT_ID).as_deref(),
            Some("agent-test")
        );
        assert_eq!(
            label(&env, id, labels::NAME).as_deref(),
            Some(format!("name-{id}").as_str())
        );
        assert!(label(&env, id, labels::TOKEN_SHA256).is_some());
    }
    assert_eq!(
        label(&env, "sb-other", labels::AGENT_POD_UID).as_deref(),
        Some("pod-uid-other"),
        "another agent's sandbox is not adopted"
    );
    env.client = client(agent.grpc_addr(), TOKEN).await;
    env.agent = Some(agent);
    for id in ids {
        assert_eq!(phase(&mut env.client, id).await, SandboxPhase::Running);
    }
    // New sandboxes carry the new pod's UID.
    env.client
        .create_sandbox(create_req(spec("sb-pod-3", &["sleep", "1000"])))
        .await
        .expect("create");
    assert_eq!(
        label(&env, "sb-pod-3", labels::AGENT_POD_UID).as_deref(),
        Some("pod-uid-b")
    );

    // Restarted in the same pod: nothing to move. Started outside
    // Kubernetes (no pod UID): the labels are left as they are.
    env.agent.take().unwrap().shutdown().await;
    let agent = Agent::start(config(&env.bed, env.state.path(), "agent-test"))
        .await
        .expect("agent starts without a pod");
    for id in ["sb-pod-1", "sb-pod-2", "sb-pod-3"] {
        assert_eq!(
            label(&env, id, labels::AGENT_POD_UID).as_deref(),
            Some("pod-uid-b")
        );
    }
    env.client = client(agent.grpc_addr(), TOKEN).await;
    env.agent = Some(agent);
    for id in ["sb-pod-1", "sb-pod-2", "sb-pod-3"] {
        assert_eq!(phase(&mut env.client, id).await, SandboxPhase::Running);
    }
    // The test bed removes every task when it goes.
    env.shutdown().await;
}
