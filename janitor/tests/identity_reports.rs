//! A janitor's reap report speaks for the agent whose container went
//! (issue 21): it carries that agent's credential, read from the node
//! agent's state dir, and the bootstrap token alone cannot report for a live
//! agent. Before per-agent credentials any holder of the shared token could
//! report any agent's sandbox reaped (the refusal below did not happen).

use std::time::Duration;

use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_janitor::{ControllerOwnership, OwnershipSource, ReapNotice, ReapReason};
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::auth::StoredCredential;
use tonic::Request;

const TOKEN: &str = "janitor-identity-token";

fn bearer<T>(body: T, token: &str) -> Request<T> {
    let mut req = Request::new(body);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

fn notice(agent_id: &str) -> ReapNotice<'_> {
    ReapNotice {
        node_name: "node-j",
        sandbox_id: "sb-reaped",
        agent_id,
        reason: ReapReason::Terminal,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_reports_carry_the_reaped_agents_credential() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().join("ctl"),
        TOKEN,
    );
    cfg.lost_agent_timeout = Duration::from_secs(60);
    cfg.failpoint = None;
    let ctl = Controller::start(cfg).await.unwrap();
    let endpoint = format!("http://{}", ctl.local_addr());

    // A live agent: enrolled, heartbeating, its credential in its state dir.
    let mut r = RegistryServiceClient::connect(endpoint.clone())
        .await
        .unwrap();
    let enroll = pb::EnrollRequest {
        agent_id: "agent-live".into(),
        node_name: "node-j".into(),
    };
    let credential = r
        .enroll(bearer(enroll, TOKEN))
        .await
        .unwrap()
        .into_inner()
        .credential;
    let inv = pb::Inventory {
        agent_id: "agent-live".into(),
        node_name: "node-j".into(),
        api_endpoint: "127.0.0.1:1".into(),
        ..Default::default()
    };
    r.heartbeat(bearer(
        pb::HeartbeatRequest {
            inventory: Some(inv),
        },
        &credential,
    ))
    .await
    .unwrap();
    let agent_state = dir.path().join("agent");
    StoredCredential {
        agent_id: "agent-live".into(),
        credential,
    }
    .write(&agent_state)
    .unwrap();

    let owner = |state: Option<std::path::PathBuf>| {
        ControllerOwnership::new(&endpoint, TOKEN, Duration::from_secs(5))
            .unwrap()
            .with_agent_state_dir(state)
    };
    // With the node agent's state dir: the report goes through.
    owner(Some(agent_state))
        .report_reaped(&notice("agent-live"))
        .await
        .expect("reported with the agent's credential");
    // Without it, the bootstrap token cannot speak for the live agent
    // (enrolling for it is refused while it heartbeats).
    let e = owner(None)
        .report_reaped(&notice("agent-live"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("agent-live"), "{e}");
    // An agent the controller does not know live (a dead one, the usual
    // reap): the janitor enrolls for it with the bootstrap token.
    owner(None)
        .report_reaped(&notice("agent-gone"))
        .await
        .expect("reported for an agent that is not live");
    ctl.shutdown().await;
}
