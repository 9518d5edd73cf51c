//! Server TLS on the controller's main port (`--tls-cert`/`--tls-key`) and
//! agents that reach it with `--controller-ca` (issue 21): a round trip over
//! TLS works, a client trusting another CA fails the handshake, plaintext to
//! the TLS port fails, and a real agent enrolls and heartbeats over TLS.
//! Before, the main port spoke plaintext to agents (the plaintext call below
//! succeeded and no agent could be given a CA).

use crate::support;

use std::path::Path;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_controller::config::ServerTlsFiles;
use sandbolt_controller::{Controller, ControllerHandle};
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_test_support::eventually_async;
use sandbolt_testbed::{Testbed, execd_binary};
use support::standin::AGENT_TOKEN;
use support::{HB, standin_config};
use tonic::Request;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

/// (CA PEM file, another CA's PEM file, the server's files) in `dir`.
fn pki(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, ServerTlsFiles) {
    let authority = ca("sandbolt test CA");
    let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    p.distinguished_name.push(DnType::CommonName, "controller");
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &authority).unwrap();
    let write = |name: &str, pem: &str| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    (
        write("ca.crt", &authority.pem()),
        write("other-ca.crt", &ca("someone else's CA").pem()),
        ServerTlsFiles {
            cert: write("tls.crt", &cert.pem()),
            key: write("tls.key", &key.serialize_pem()),
            client_ca: None,
        },
    )
}

async fn start(dir: &Path, tls: ServerTlsFiles) -> ControllerHandle {
    let mut cfg = standin_config(&dir.join("data"));
    cfg.tls = Some(tls);
    Controller::start(cfg).await.unwrap()
}

/// An Enroll over `channel`; the error as text (handshake errors surface
/// on the first call of a lazy channel).
async fn enroll(channel: Channel) -> Result<String, String> {
    let mut req = Request::new(pb::EnrollRequest {
        agent_id: "agent-tls".into(),
        node_name: "node-tls".into(),
    });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {AGENT_TOKEN}").parse().unwrap(),
    );
    RegistryServiceClient::new(channel)
        .enroll(req)
        .await
        .map(|r| r.into_inner().credential)
        .map_err(|s| format!("{s:?}"))
}

fn tls_channel(port: u16, ca: &Path) -> Channel {
    let t = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap()))
        .domain_name("localhost");
    Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(t)
        .unwrap()
        .connect_lazy()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_round_trips_and_refuses_the_wrong_ca_and_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, other, files) = pki(dir.path());
    let h = start(dir.path(), files).await;
    let port = h.local_addr().port();

    let credential = enroll(tls_channel(port, &ca)).await.expect("over TLS");
    assert_eq!(credential.len(), 64);
    let e = enroll(tls_channel(port, &other)).await.unwrap_err();
    assert!(
        e.contains("UnknownIssuer") || e.contains("certificate"),
        "a client trusting another CA must fail the handshake: {e}"
    );
    let plain = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_lazy();
    let e = enroll(plain).await.unwrap_err();
    assert!(!e.is_empty(), "plaintext to the TLS port must fail");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_agent_enrolls_and_heartbeats_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, _, files) = pki(dir.path());
    let h = start(dir.path(), files).await;
    let bed = tokio::task::spawn_blocking(|| Testbed::start().expect("test bed"))
        .await
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let config = |endpoint: String| {
        let execd = execd_binary().expect("static execd binary");
        let mut cfg = AgentConfig::new(
            "agent-tls",
            bed.containerd_socket(),
            execd,
            state.path(),
            AGENT_TOKEN,
        );
        cfg.node_name = "node-tls".into();
        cfg.controller_endpoint = Some(endpoint);
        cfg.controller_token = Some(AGENT_TOKEN.into());
        cfg.controller_ca = Some(ca.clone());
        cfg.heartbeat_interval = HB;
        cfg
    };
    // A CA with a plaintext endpoint is refused: the CA would go unused.
    let e = Agent::start(config(format!("http://{}", h.local_addr())))
        .await
        .err()
        .expect("an http:// endpoint with a CA is refused");
    assert!(e.to_string().contains("https://"), "{e}");

    let port = h.local_addr().port();
    let agent = Agent::start(config(format!("https://localhost:{port}")))
        .await
        .expect("agent starts");
    eventually_async(
        "the agent heartbeats over TLS",
        Duration::from_secs(20),
        || {
            let live = h.core().registry().is_live(&"agent-tls".into());
            async move { live.then_some(()) }
        },
    )
    .await;
    assert!(agent.credential().is_some());
    agent.shutdown().await;
    h.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
