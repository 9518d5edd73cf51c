//! Per-agent credentials (issue 21): the shared agent token is only a
//! bootstrap secret that buys one agent id's credential (Enroll); a
//! heartbeat or reap report for an id needs that id's credential, enrolling
//! cannot take over a live id, and the controller calls each agent with the
//! agent's own credential, the only token an enrolled real agent accepts.

use crate::support;

use std::time::Duration;

use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_controller::{Controller, ControllerHandle};
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::auth::{CREDENTIAL_FILE, StoredCredential};
use sandbolt_test_support::eventually_async;
use sandbolt_testbed::{Testbed, execd_binary};
use support::standin::{AGENT_TOKEN, StandInAgent};
use support::{HB, sandbox_request, standin_config};
use tonic::transport::Channel;
use tonic::{Code, Request};

type Registry = RegistryServiceClient<Channel>;

async fn registry(h: &ControllerHandle) -> Registry {
    RegistryServiceClient::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap()
}

fn bearer<T>(body: T, token: &str) -> Request<T> {
    let mut req = Request::new(body);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

async fn enroll(r: &mut Registry, id: &str, token: &str) -> Result<String, tonic::Status> {
    let req = bearer(
        pb::EnrollRequest {
            agent_id: id.into(),
            node_name: format!("node-{id}"),
        },
        token,
    );
    Ok(r.enroll(req).await?.into_inner().credential)
}

/// A heartbeat for `id` claiming `api` as its AgentService endpoint.
async fn heartbeat(
    r: &mut Registry,
    id: &str,
    api: &str,
    token: &str,
) -> Result<(), tonic::Status> {
    let inv = pb::Inventory {
        agent_id: id.into(),
        node_name: format!("node-{id}"),
        pool: "default".into(),
        max_sandboxes: 4,
        api_endpoint: api.into(),
        proxy_endpoint: api.into(),
        ..Default::default()
    };
    let req = bearer(
        pb::HeartbeatRequest {
            inventory: Some(inv),
        },
        token,
    );
    r.heartbeat(req).await.map(drop)
}

fn api_of(h: &ControllerHandle, id: &str) -> String {
    h.core()
        .registry()
        .agent(&id.into())
        .map(|a| a.api_endpoint)
        .unwrap_or_default()
}

/// The Done-when of issue 21: agent B (or anyone holding the shared token,
/// which every agent held before) cannot heartbeat as agent A, so it can
/// neither redirect A's endpoints nor pose as A. Before per-agent
/// credentials the shared token alone was accepted for any id (the second
/// assertion failed there: the heartbeat went through and moved A).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_for_another_agents_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let mut r = registry(&h).await;

    let a = enroll(&mut r, "agent-a", AGENT_TOKEN).await.unwrap();
    let b = enroll(&mut r, "agent-b", AGENT_TOKEN).await.unwrap();
    assert_ne!(a, b, "each id has its own credential");
    assert_ne!(a, AGENT_TOKEN);
    heartbeat(&mut r, "agent-a", "10.0.0.1:7000", &a)
        .await
        .unwrap();
    heartbeat(&mut r, "agent-b", "10.0.0.2:7000", &b)
        .await
        .unwrap();

    // The shared (bootstrap) token alone speaks for nobody.
    let e = heartbeat(&mut r, "agent-a", "10.6.6.6:7000", AGENT_TOKEN)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("agent-a"), "{}", e.message());
    // Agent B's own credential does not speak for agent A.
    let e = heartbeat(&mut r, "agent-a", "10.6.6.6:7000", &b)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("agent-a"), "{}", e.message());
    // No token, or a made-up one.
    let e = r
        .heartbeat(pb::HeartbeatRequest {
            inventory: Some(pb::Inventory {
                agent_id: "agent-a".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = heartbeat(&mut r, "agent-a", "10.6.6.6:7000", "made-up")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    // A's endpoint is still the one A reported.
    assert_eq!(api_of(&h, "agent-a"), "10.0.0.1:7000");
    assert_eq!(api_of(&h, "agent-b"), "10.0.0.2:7000");

    // Reap reports speak for an agent too.
    let reap = |token: &str, agent: &str| {
        bearer(
            pb::ReportReapedRequest {
                node_name: "node-agent-a".into(),
                sandbox_id: "sb-1".into(),
                agent_id: agent.into(),
                reason: "terminal".into(),
            },
            token,
        )
    };
    for (token, why) in [
        (AGENT_TOKEN, "bootstrap"),
        (b.as_str(), "agent B's credential"),
    ] {
        let e = r.report_reaped(reap(token, "agent-a")).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{why}: {e:?}");
    }
    r.report_reaped(reap(&a, "agent-a")).await.unwrap();
    // The janitors' ownership query takes the bootstrap token.
    r.get_ownership(bearer(pb::GetOwnershipRequest::default(), AGENT_TOKEN))
        .await
        .unwrap();
    h.shutdown().await;
}

/// Enroll cannot take a live id over: with the bootstrap token it is
/// refused while the id heartbeats, allowed with the id's own credential,
/// and allowed again (same credential: nothing is stored per agent) once
/// the id is lost. Enroll did not exist before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrolling_cannot_take_over_a_live_agent() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let mut r = registry(&h).await;
    let a = enroll(&mut r, "agent-live", AGENT_TOKEN).await.unwrap();
    heartbeat(&mut r, "agent-live", "10.0.0.1:7000", &a)
        .await
        .unwrap();

    let e = enroll(&mut r, "agent-live", AGENT_TOKEN).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("agent-live"), "{}", e.message());
    assert_eq!(enroll(&mut r, "agent-live", &a).await.unwrap(), a);
    // Neither another token nor no id.
    let e = enroll(&mut r, "agent-x", "made-up").await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = enroll(&mut r, "", AGENT_TOKEN).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Silent past the lost timeout (600 ms): enrollable again.
    eventually_async("the silent agent is lost", Duration::from_secs(10), || {
        let live = h.core().registry().is_live(&"agent-live".into());
        async move { (!live).then_some(()) }
    })
    .await;
    assert_eq!(enroll(&mut r, "agent-live", AGENT_TOKEN).await.unwrap(), a);

    // A restarted controller on the same data dir mints the same
    // credentials (the identity key file is kept there, mode 0600).
    h.shutdown().await;
    let key = dir.path().join("identity.key");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let mut r = registry(&h).await;
    heartbeat(&mut r, "agent-live", "10.0.0.1:7000", &a)
        .await
        .unwrap();
    h.shutdown().await;
}

/// The controller calls a stand-in agent (which, like a real one, takes
/// only its own credential) with that agent's credential: the create goes
/// through. Before, the controller sent the shared token, which the
/// stand-in refuses now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_calls_each_agent_with_its_own_credential() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = StandInAgent::start("agent-one", "default", 2, &[], h.local_addr(), HB).await;
    let mut c = sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient::connect(
        format!("http://{}", h.local_addr()),
    )
    .await
    .unwrap();
    c.create_sandbox(sandbox_request("cred-sb", vec![]))
        .await
        .expect("the stand-in accepted the controller's call");
    assert_eq!(a.held(), 1);
    h.shutdown().await;
}

/// A real agent enrolls, keeps its credential in its state dir (0600),
/// accepts only it on the AgentService (not the shared token any more), and
/// a restart re-uses the stored credential instead of enrolling (which the
/// controller would refuse: the id is still live).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_agent_enrolls_keeps_its_credential_and_accepts_only_it() {
    let bed = tokio::task::spawn_blocking(|| Testbed::start().expect("test bed"))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = standin_config(dir.path());
    cfg.lost_agent_timeout = Duration::from_secs(30);
    let h = Controller::start(cfg).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    let agent_config = || {
        let execd = execd_binary().expect("static execd binary");
        let mut cfg = AgentConfig::new(
            "agent-real",
            bed.containerd_socket(),
            execd,
            state.path(),
            AGENT_TOKEN,
        );
        cfg.node_name = "node-real".into();
        cfg.controller_endpoint = Some(format!("http://{}", h.local_addr()));
        cfg.controller_token = Some(AGENT_TOKEN.into());
        cfg.heartbeat_interval = HB;
        cfg
    };
    let agent = Agent::start(agent_config()).await.expect("agent starts");
    let credential = agent
        .credential_within(Duration::from_secs(20))
        .await
        .expect("the agent enrolled");
    let stored = StoredCredential::read(state.path()).expect("credential stored");
    assert_eq!(stored.agent_id, "agent-real");
    assert_eq!(stored.credential, credential);
    let file = state.path().join(CREDENTIAL_FILE);
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );
    wait_registered(&h, "agent-real").await;

    let ch = Channel::from_shared(format!("http://{}", agent.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut direct = AgentServiceClient::new(ch);
    let inv = || pb::GetInventoryRequest::default();
    let e = direct
        .get_inventory(bearer(inv(), AGENT_TOKEN))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::Unauthenticated,
        "the shared token opens no agent"
    );
    direct
        .get_inventory(bearer(inv(), &credential))
        .await
        .expect("its own credential");

    // Restart: the stored credential is used (the id is live, so a fresh
    // enrollment with the shared token would be refused).
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    agent.shutdown().await;
    let agent = Agent::start(agent_config()).await.expect("agent restarts");
    assert_eq!(agent.credential().as_deref(), Some(credential.as_str()));
    wait_answered(&agent).await;
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&meta),
        inode,
        "not re-enrolled"
    );
    agent.shutdown().await;
    h.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

async fn wait_registered(h: &ControllerHandle, id: &str) {
    eventually_async("the agent heartbeats", Duration::from_secs(20), || {
        let live = h.core().registry().is_live(&id.into()) && !api_of(h, id).is_empty();
        async move { live.then_some(()) }
    })
    .await;
}

async fn wait_answered(agent: &sandbolt_agent::AgentHandle) {
    eventually_async(
        "the controller answers a heartbeat",
        Duration::from_secs(20),
        || {
            let ready = agent.readiness();
            async move { ready.check().await.ok() }
        },
    )
    .await;
}
