//! Controller → agent TLS, pinned (issue 21): a real agent with `api_tls`
//! makes its self-signed certificate at the first start, advertises its
//! SHA-256 in the API endpoint of its heartbeats, and serves the
//! AgentService over TLS only. The controller reaches it (a sandbox is
//! created through it), a client pinning another fingerprint is refused
//! during the handshake, plaintext to the agent's port fails, and a
//! restarted agent keeps its certificate (the stored pin stays valid).
//! Before, the AgentService spoke plaintext only: `api_tls` did not exist,
//! the controller dialed every agent over `http://`, and the plaintext call
//! below reached the handler.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::agent_client::{AgentClients, StatusRpc};
use sandbolt_controller::identity::AgentIdentity;
use sandbolt_controller::{Controller, ControllerHandle};
use sandbolt_proto::agent::v1 as apb;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::tls::{AGENT_CERT_FILE, fingerprint, pinned_endpoint};
use sandbolt_test_support::eventually_async;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use support::standin::AGENT_TOKEN;
use support::{HB, sandbox_request, sref, standin_config, with_spec};
use tonic::transport::Channel;

const AGENT: &str = "agent-api-tls";
const WAIT: Duration = Duration::from_secs(60);

fn agent_config(bed: &Testbed, state: &Path, ctl: &ControllerHandle) -> AgentConfig {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(AGENT, bed.containerd_socket(), execd, state, AGENT_TOKEN);
    cfg.node_name = "node-api-tls".into();
    cfg.controller_endpoint = Some(format!("http://{}", ctl.local_addr()));
    cfg.controller_token = Some(AGENT_TOKEN.into());
    cfg.heartbeat_interval = HB;
    cfg.stop_grace_period = Duration::from_secs(1);
    cfg.api_tls = true;
    cfg
}

/// The endpoint the registry holds for the agent, once it heartbeated one
/// for `grpc_addr`.
async fn registered_endpoint(ctl: &ControllerHandle, port: u16) -> String {
    eventually_async("the agent heartbeats its endpoint", WAIT, || {
        let ep = ctl
            .core()
            .registry()
            .agents()
            .into_iter()
            .find(|a| a.agent_id.as_str() == AGENT && !a.lost)
            .map(|a| a.api_endpoint)
            .filter(|e| e.contains(&format!(":{port}")));
        async move { ep }
    })
    .await
}

/// The SHA-256 of the certificate the agent keeps in its state dir.
fn stored_fingerprint(state: &Path) -> [u8; 32] {
    let pem = std::fs::read(state.join("identity").join(AGENT_CERT_FILE)).unwrap();
    fingerprint(&CertificateDer::from_pem_slice(&pem).unwrap())
}

async fn start_agent(bed: &Testbed, state: &Path, ctl: &ControllerHandle) -> AgentHandle {
    Agent::start(agent_config(bed, state, ctl))
        .await
        .expect("agent starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_reaches_a_tls_agent_by_its_pinned_certificate_only() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ctl = Controller::start(standin_config(&data)).await.unwrap();
    let bed = tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed");
        bed.import_image(&busybox_image().expect("busybox image"), "k8s.io")
            .expect("import busybox");
        bed
    })
    .await
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let agent = start_agent(&bed, state.path(), &ctl).await;
    let addr = agent.grpc_addr();

    // The endpoint carries the fingerprint of the certificate made at the
    // first start.
    let endpoint = registered_endpoint(&ctl, addr.port()).await;
    let pin = stored_fingerprint(state.path());
    assert_eq!(
        endpoint,
        pinned_endpoint(&format!("127.0.0.1:{}", addr.port()), &pin)
    );

    // The controller reaches it: a create goes through the agent.
    let mut sandboxes = native::sandbox_service_client::SandboxServiceClient::connect(format!(
        "http://{}",
        ctl.local_addr()
    ))
    .await
    .unwrap();
    let req = with_spec(sandbox_request("tls-box", vec![]), |s| {
        s.command = vec!["sleep".into(), "600".into()];
    });
    let created = sandboxes
        .create_sandbox(req)
        .await
        .expect("the controller creates through the TLS agent")
        .into_inner();
    let id = created.status.as_ref().unwrap().container_id.clone();

    // A client pinning another certificate is refused in the handshake; the
    // right pin reaches the sandbox.
    let identity = AgentIdentity::load(None, &data, AGENT_TOKEN).unwrap();
    let clients = AgentClients::new(Arc::new(identity));
    let wrong = pinned_endpoint(&format!("127.0.0.1:{}", addr.port()), &[7u8; 32]);
    let e = clients
        .status_rpc(
            &AGENT.into(),
            &wrong,
            &id.as_str().into(),
            StatusRpc::Get,
            WAIT,
        )
        .await
        .expect_err("a wrong fingerprint is refused");
    let text = format!("{e:?}");
    assert!(
        text.contains("not the pinned") || text.contains("certificate"),
        "the refusal names the certificate: {text}"
    );
    let got = clients
        .status_rpc(
            &AGENT.into(),
            &endpoint,
            &id.as_str().into(),
            StatusRpc::Get,
            WAIT,
        )
        .await
        .expect("the pinned certificate is accepted");
    assert_eq!(got.sandbox_id, id);

    // Plaintext to the TLS port fails, even with the right credential.
    let credential = agent.credential().expect("enrolled");
    let plain = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let mut c = AgentServiceClient::with_interceptor(plain, BearerToken::new(&credential).unwrap());
    let e = c
        .get_sandbox(apb::SandboxRef {
            sandbox_id: id.clone(),
        })
        .await
        .expect_err("plaintext to a TLS agent fails");
    assert_ne!(e.code(), tonic::Code::Ok);

    // A restarted agent keeps its certificate: the stored pin still holds.
    agent.shutdown().await;
    let agent = start_agent(&bed, state.path(), &ctl).await;
    assert_eq!(stored_fingerprint(state.path()), pin);
    let again = registered_endpoint(&ctl, agent.grpc_addr().port()).await;
    assert!(
        again.ends_with(&endpoint[endpoint.find('#').unwrap()..]),
        "{again}"
    );
    sandboxes
        .delete_sandbox(native::DeleteSandboxRequest {
            sandbox: sref("tls-box"),
        })
        .await
        .expect("delete through the TLS agent");

    agent.shutdown().await;
    ctl.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
