//! Who may call what on the controller's two FastPath doors: the open port
//! (`open_fastpath_listen`: FastPath v1 + v2 without credentials, for the
//! OpenSandbox server, and nothing else) and mutual TLS on the main port
//! (`fastpath_tls`: a client certificate instead of the token, plaintext
//! still served beside it for agents and probes). Certificates are made
//! here with rcgen; no agents are needed (ListPools and ListSandboxes answer
//! from the registry and the store).

use std::net::SocketAddr;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use sandbolt_controller::config::TlsFiles;
use sandbolt_controller::{Controller, ControllerConfig, Error};
use sandbolt_proto::agent::v1 as agent;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::{v1, v2};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const AGENT_TOKEN: &str = "agent-secret";
const FASTPATH_TOKEN: &str = "fp-secret";

fn config(dir: &Path) -> ControllerConfig {
    let mut c = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, AGENT_TOKEN);
    c.fastpath_token = Some(FASTPATH_TOKEN.into());
    c
}

async fn plaintext(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    req
}

async fn v2_list_pools(ch: Channel, token: Option<&str>) -> Result<(), tonic::Status> {
    v2::fast_path_service_client::FastPathServiceClient::new(ch)
        .list_pools(with_token(v2::ListPoolsRequest::default(), token))
        .await
        .map(drop)
}

async fn v1_list_sandboxes(ch: Channel, token: Option<&str>) -> Result<(), tonic::Status> {
    v1::fast_path_service_client::FastPathServiceClient::new(ch)
        .list_sandboxes(with_token(v1::ListRequest::default(), token))
        .await
        .map(drop)
}

async fn native_list(ch: Channel, token: Option<&str>) -> Result<(), tonic::Status> {
    native::sandbox_service_client::SandboxServiceClient::new(ch)
        .list_sandboxes(with_token(native::ListSandboxesRequest::default(), token))
        .await
        .map(drop)
}

/// A heartbeat carrying the agent token: what an agent sends.
async fn agent_heartbeat(ch: Channel, token: Option<&str>) -> Result<(), tonic::Status> {
    let beat = agent::HeartbeatRequest {
        inventory: Some(agent::Inventory {
            agent_id: "listener-test-agent".into(),
            ..Default::default()
        }),
    };
    agent::registry_service_client::RegistryServiceClient::new(ch)
        .heartbeat(with_token(beat, token))
        .await
        .map(drop)
}

async fn health(ch: Channel, service: &str) -> Result<ServingStatus, tonic::Status> {
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await?;
    Ok(r.into_inner().status())
}

fn code(r: Result<(), tonic::Status>) -> Code {
    r.err().map_or(Code::Ok, |s| s.code())
}

#[tokio::test]
async fn open_port_serves_fastpath_without_a_token_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.open_fastpath_listen = Some("127.0.0.1:0".parse().unwrap());
    let h = Controller::start(cfg).await.unwrap();
    let open = h.open_fastpath_addr().expect("open port bound");
    assert_ne!(open, h.local_addr());
    let ch = plaintext(open).await;

    assert_eq!(code(v2_list_pools(ch.clone(), None).await), Code::Ok);
    assert_eq!(code(v1_list_sandboxes(ch.clone(), None).await), Code::Ok);
    let get = v2::fast_path_service_client::FastPathServiceClient::new(ch.clone())
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: Some(v2::SandboxReference {
                namespaced_name: Some(v2::NamespacedName {
                    namespace: "opensandbox".into(),
                    name: "fsb-missing".into(),
                }),
                expected_uid: String::new(),
            }),
            expected_generation: 0,
        })
        .await;
    assert_eq!(
        code(get.map(drop)),
        Code::NotFound,
        "a real answer, not a refusal"
    );
    assert_eq!(
        health(ch.clone(), "fastpath.v2.FastPathService")
            .await
            .unwrap(),
        ServingStatus::Serving
    );

    // Nothing else lives there: not RegistryService (even with the agent
    // token nothing may register through the open port), not the native API.
    assert_eq!(
        code(agent_heartbeat(ch.clone(), Some(AGENT_TOKEN)).await),
        Code::Unimplemented
    );
    assert_eq!(
        code(native_list(ch.clone(), Some(FASTPATH_TOKEN)).await),
        Code::Unimplemented
    );
    assert_eq!(
        health(ch, "sandbolt.agent.v1.RegistryService")
            .await
            .unwrap_err()
            .code(),
        Code::NotFound,
        "health does not claim services the port lacks"
    );

    // The main port still wants the token.
    let main = plaintext(h.local_addr()).await;
    assert_eq!(
        code(v2_list_pools(main.clone(), None).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code(v1_list_sandboxes(main.clone(), None).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code(native_list(main.clone(), None).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code(v2_list_pools(main.clone(), Some(FASTPATH_TOKEN)).await),
        Code::Ok
    );
    assert_eq!(
        code(agent_heartbeat(main, None).await),
        Code::Unauthenticated
    );
    h.shutdown().await;
}

#[tokio::test]
async fn without_the_open_port_configured_there_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(config(dir.path())).await.unwrap();
    assert_eq!(h.open_fastpath_addr(), None);
    h.shutdown().await;
}

/// A CA, a server certificate for `localhost` and a client certificate it
/// signed, and a client certificate from another CA, as PEM files in `dir`.
struct Pki {
    files: TlsFiles,
    ca_pem: String,
    client: Identity,
    stranger: Identity,
}

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

/// (certificate PEM, key PEM) for `names`, signed by `issuer`.
fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut p = CertificateParams::new(names).unwrap();
    p.distinguished_name
        .push(DnType::CommonName, "sandbolt test");
    p.extended_key_usages = vec![usage];
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn pki(dir: &Path) -> Pki {
    let authority = ca("sandbolt test CA");
    let (server_cert, server_key) = leaf(
        &authority,
        &["localhost"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        &authority,
        &["opensandbox-server"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let (stranger_cert, stranger_key) = leaf(
        &ca("someone else's CA"),
        &["opensandbox-server"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let write = |name: &str, pem: &str| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    Pki {
        files: TlsFiles {
            cert: write("tls.crt", &server_cert),
            key: write("tls.key", &server_key),
            client_ca: write("ca.crt", &authority.pem()),
        },
        ca_pem: authority.pem(),
        client: Identity::from_pem(client_cert, client_key),
        stranger: Identity::from_pem(stranger_cert, stranger_key),
    }
}

/// A TLS channel trusting the test CA, presenting `identity` if any. A
/// refused handshake surfaces either here or on the first call.
async fn tls(addr: SocketAddr, pki: &Pki, identity: Option<&Identity>) -> Result<Channel, String> {
    let mut t = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    if let Some(id) = identity {
        t = t.identity(id.clone());
    }
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(t)
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

/// Whether a ListPools over TLS with `identity` and no token succeeds.
async fn tls_list_pools(
    addr: SocketAddr,
    pki: &Pki,
    identity: Option<&Identity>,
) -> Result<(), String> {
    let ch = tls(addr, pki, identity).await?;
    v2_list_pools(ch, None).await.map_err(|s| format!("{s:?}"))
}

#[tokio::test]
async fn a_client_certificate_stands_in_for_the_token_on_the_main_port() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let mut cfg = config(dir.path());
    cfg.fastpath_tls = Some(pki.files.clone());
    let h = Controller::start(cfg).await.unwrap();
    let addr = h.local_addr();

    // With a certificate from the client CA: FastPath and the native API
    // answer without a token.
    tls_list_pools(addr, &pki, Some(&pki.client)).await.unwrap();
    let ch = tls(addr, &pki, Some(&pki.client)).await.unwrap();
    assert_eq!(code(v1_list_sandboxes(ch.clone(), None).await), Code::Ok);
    assert_eq!(code(native_list(ch.clone(), None).await), Code::Ok);
    // A certificate is not an agent's credential.
    assert_eq!(code(agent_heartbeat(ch, None).await), Code::Unauthenticated);

    // Without a certificate, or with one from another CA: refused (at the
    // handshake; the same server and CA just worked with the right one).
    let e = tls_list_pools(addr, &pki, None).await.unwrap_err();
    assert!(e.contains("CertificateRequired"), "{e}");
    let e = tls_list_pools(addr, &pki, Some(&pki.stranger))
        .await
        .unwrap_err();
    assert!(e.contains("UnknownCA"), "{e}");

    // Plaintext on the same port is unchanged: the token for FastPath, the
    // agent token for the registry, health open (the kubelet's probe).
    let plain = plaintext(addr).await;
    assert_eq!(
        code(v2_list_pools(plain.clone(), None).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code(v2_list_pools(plain.clone(), Some(FASTPATH_TOKEN)).await),
        Code::Ok
    );
    assert_eq!(
        code(agent_heartbeat(plain.clone(), None).await),
        Code::Unauthenticated
    );
    assert_ne!(
        code(agent_heartbeat(plain.clone(), Some(AGENT_TOKEN)).await),
        Code::Unauthenticated
    );
    assert_eq!(health(plain, "").await.unwrap(), ServingStatus::Serving);
    h.shutdown().await;
}

#[tokio::test]
async fn with_tls_and_no_token_plaintext_fastpath_is_refused_not_open() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let mut cfg = config(dir.path());
    cfg.fastpath_token = None;
    cfg.fastpath_tls = Some(pki.files.clone());
    let h = Controller::start(cfg).await.unwrap();
    let plain = plaintext(h.local_addr()).await;
    assert_eq!(
        code(v2_list_pools(plain.clone(), None).await),
        Code::Unauthenticated
    );
    assert_eq!(code(native_list(plain, None).await), Code::Unauthenticated);
    tls_list_pools(h.local_addr(), &pki, Some(&pki.client))
        .await
        .unwrap();
    h.shutdown().await;
}

#[tokio::test]
async fn unreadable_tls_files_fail_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let mut cfg = config(dir.path());
    cfg.fastpath_tls = Some(TlsFiles {
        client_ca: dir.path().join("missing-ca.crt"),
        ..pki.files.clone()
    });
    match Controller::start(cfg).await {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("missing-ca.crt"), "{m}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(h) => {
            h.shutdown().await;
            panic!("started with a missing client CA");
        }
    }
}

/// One TLS setup on the main port (issue 21): `--tls-cert` with
/// `--tls-client-ca`. The port is TLS only; a FastPath client presenting a
/// certificate from the client CA needs no token, a client without one
/// (an agent, a janitor, the lifecycle) still connects and uses its token,
/// and plaintext is refused. Before, `tls` took no client CA (so the chart's
/// FastPath mutual TLS could not be kept once TLS was on: the two were
/// refused together), and a certificate alone got UNAUTHENTICATED there.
#[tokio::test]
async fn server_tls_with_a_client_ca_takes_certificates_and_tokens_but_no_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let mut cfg = config(dir.path());
    cfg.tls = Some(sandbolt_controller::config::ServerTlsFiles {
        cert: pki.files.cert.clone(),
        key: pki.files.key.clone(),
        client_ca: Some(pki.files.client_ca.clone()),
    });
    let h = Controller::start(cfg).await.unwrap();
    let addr = h.local_addr();

    // A certificate from the client CA: FastPath and native without a token.
    tls_list_pools(addr, &pki, Some(&pki.client)).await.unwrap();
    let ch = tls(addr, &pki, Some(&pki.client)).await.unwrap();
    assert_eq!(code(native_list(ch.clone(), None).await), Code::Ok);
    assert_eq!(code(agent_heartbeat(ch, None).await), Code::Unauthenticated);

    // No certificate: the handshake passes, the tokens decide.
    let ch = tls(addr, &pki, None).await.unwrap();
    assert_eq!(
        code(v2_list_pools(ch.clone(), None).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code(v2_list_pools(ch.clone(), Some(FASTPATH_TOKEN)).await),
        Code::Ok
    );
    assert_ne!(
        code(agent_heartbeat(ch.clone(), Some(AGENT_TOKEN)).await),
        Code::Unauthenticated
    );
    assert_eq!(health(ch, "").await.unwrap(), ServingStatus::Serving);
    // A certificate from another CA is refused at the handshake.
    let e = tls_list_pools(addr, &pki, Some(&pki.stranger))
        .await
        .unwrap_err();
    assert!(e.contains("UnknownCA"), "{e}");
    // Plaintext is refused.
    let plain = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    assert_ne!(
        code(v2_list_pools(plain, Some(FASTPATH_TOKEN)).await),
        Code::Ok
    );
    h.shutdown().await;

    // Both TLS setups at once are refused, naming the way out.
    let mut cfg = config(dir.path());
    cfg.tls = Some(sandbolt_controller::config::ServerTlsFiles {
        cert: pki.files.cert.clone(),
        key: pki.files.key.clone(),
        client_ca: None,
    });
    cfg.fastpath_tls = Some(pki.files.clone());
    match Controller::start(cfg).await {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("--tls-client-ca"), "{m}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(h) => {
            h.shutdown().await;
            panic!("started with two TLS setups on one port");
        }
    }
}
