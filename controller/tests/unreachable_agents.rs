//! An agent that heartbeats but refuses connections on its API (an agent
//! restarting, a sim agent stopped by the scale harness' churn): a fast
//! create placed on it goes to another agent, and the creates after it do
//! not pick it again until it heartbeats. Before, every create placed there
//! failed UNAVAILABLE ("connection refused") until the agent was lost, and
//! the agent looked least loaded (its failed creates freed their slots), so
//! placement kept choosing it (issue 25, found by the scale harness).

use crate::support;

use std::time::Duration;

use sandbolt_controller::{Consistency, Controller};
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::control::v1 as native;
use support::standin::{AGENT_TOKEN, StandInAgent};
use support::{HB, sandbox_request, standin_config};
use tonic::Request;

type Native = native::sandbox_service_client::SandboxServiceClient<tonic::transport::Channel>;

fn bearer<T>(body: T, token: &str) -> Request<T> {
    let mut req = Request::new(body);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

/// Heartbeats as `id` every `HB`, claiming `api` (where nothing listens)
/// and the image every create asks for, so placement prefers it.
async fn refusing_agent(controller: std::net::SocketAddr, id: &str, api: String) {
    let mut r = RegistryServiceClient::connect(format!("http://{controller}"))
        .await
        .unwrap();
    let credential = r
        .enroll(bearer(
            pb::EnrollRequest {
                agent_id: id.into(),
                node_name: format!("node-{id}"),
            },
            AGENT_TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .credential;
    let inv = pb::Inventory {
        agent_id: id.into(),
        node_name: format!("node-{id}"),
        pool: "default".into(),
        max_sandboxes: 100,
        api_endpoint: api.clone(),
        proxy_endpoint: api,
        images: vec![pb::ImageInfo {
            references: vec!["busybox".into()],
            ..Default::default()
        }],
        ..Default::default()
    };
    let beat = move || {
        bearer(
            pb::HeartbeatRequest {
                inventory: Some(inv.clone()),
            },
            &credential,
        )
    };
    r.heartbeat(beat()).await.unwrap();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(HB).await;
            let _ = r.heartbeat(beat()).await;
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_creates_go_around_an_agent_that_refuses_connections() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = standin_config(dir.path());
    config.default_consistency = Consistency::Fast;
    let h = Controller::start(config).await.unwrap();
    // The healthy agent has no image cached: the refusing one, which has,
    // wins placement whenever it is in it.
    let good = StandInAgent::start("good", "default", 50, &[], h.local_addr(), HB).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    refusing_agent(h.local_addr(), "refusing", closed).await;
    let mut c = Native::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap();
    // Both agents are in placement.
    support::eventually("both agents ready", async || {
        h.core().registry().is_live(&"good".into())
            && h.core().registry().is_live(&"refusing".into())
    })
    .await;
    for i in 0..6 {
        let name = format!("around-{i}");
        let created = c
            .create_sandbox(sandbox_request(&name, vec![]))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:?}"))
            .into_inner();
        let status = created.status.unwrap();
        assert_eq!(status.agent_id, "good", "{name}");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(good.held(), 6);
    // The first create was placed on the refusing agent and went around
    // it (the path the old code lacked: it answered UNAVAILABLE there).
    let first = h
        .core()
        .store()
        .get(&sandbolt_controller::SandboxKey::new("default", "around-0"))
        .unwrap()
        .unwrap();
    assert!(
        first
            .events
            .iter()
            .any(|e| e.message.contains("agent refusing refused the connection")),
        "{:?}",
        first.events
    );
    h.shutdown().await;
}
