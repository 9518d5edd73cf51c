//! `grpc.health.v1` on the controller's and the agent's gRPC ports, asked
//! the way a probe asks: no token. Every service each port serves answers
//! SERVING; a service the port does not serve is NOT_FOUND; and the open
//! health service is no way around the token for the services themselves.

use std::net::SocketAddr;
use std::time::Duration;

use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_e2e::bed::{start_agent, start_bed};
use sandbolt_proto::fastpath::v2::ListSandboxesRequest;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const TOKEN: &str = "health-agent-token";

async fn status(addr: SocketAddr, service: &str) -> Result<ServingStatus, Code> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut client = HealthClient::new(channel);
    client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|r| r.into_inner().status())
        .map_err(|s| s.code())
}

#[tokio::test(flavor = "multi_thread")]
async fn every_grpc_port_answers_health_checks_without_a_token() {
    let bed = start_bed().await;
    let data = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
    cfg.fastpath_token = Some("health-fastpath-token".into());
    let controller = Controller::start(cfg).await.expect("controller starts");
    let state = tempfile::tempdir().unwrap();
    let agent = start_agent(
        &bed,
        "agent-health",
        state.path(),
        controller.local_addr(),
        TOKEN,
        1,
        Duration::from_millis(200),
    )
    .await;

    for service in [
        "",
        "fastpath.v1.FastPathService",
        "fastpath.v2.FastPathService",
        "sandbolt.control.v1.SandboxService",
        "sandbolt.agent.v1.RegistryService",
    ] {
        assert_eq!(
            status(controller.local_addr(), service).await,
            Ok(ServingStatus::Serving),
            "controller {service:?}"
        );
    }
    for service in ["", "sandbolt.agent.v1.AgentService"] {
        assert_eq!(
            status(agent.grpc_addr(), service).await,
            Ok(ServingStatus::Serving),
            "agent {service:?}"
        );
    }
    assert_eq!(
        status(controller.local_addr(), "sandbolt.agent.v1.AgentService").await,
        Err(Code::NotFound),
        "the controller does not serve AgentService"
    );
    assert_eq!(
        status(agent.grpc_addr(), "fastpath.v2.FastPathService").await,
        Err(Code::NotFound),
        "the agent does not serve FastPath"
    );

    // Health is open; FastPath on the same port still wants its token.
    let mut fastpath =
        FastPathServiceClient::connect(format!("http://{}", controller.local_addr()))
            .await
            .unwrap();
    let refused = fastpath
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .expect_err("FastPath without a token");
    assert_eq!(refused.code(), Code::Unauthenticated);

    agent.shutdown().await;
    controller.shutdown().await;
}
