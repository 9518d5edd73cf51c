//! TLS between sandbolt's own processes: the controller's main port serves
//! TLS when given a certificate and key (`--tls-cert`, `--tls-key`), and
//! the processes that call it (agents, janitors) trust the CA given with
//! `--controller-ca`. PEM files, read once at start, so a bad file fails
//! the start rather than a later call.
//!
//! The controller calls agents over TLS pinned to each agent's own
//! self-signed certificate ([`SelfSignedIdentity`], [`AgentEndpoint`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use sha2::Digest;
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig, Uri,
};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TLS file {path} holds no PEM block (-----BEGIN ...)")]
    NotPem { path: PathBuf },
    #[error("controller endpoint {endpoint:?}: {message}")]
    Endpoint { endpoint: String, message: String },
    #[error("agent endpoint {endpoint:?}: {message}")]
    AgentEndpoint { endpoint: String, message: String },
    #[error("making the agent's self-signed TLS certificate: {0}")]
    Generate(String),
    #[error(
        "{dir}: holds only one of tls.crt and tls.key; remove the other to have a new pair made (the controller learns the new fingerprint from the next heartbeat)"
    )]
    Pair { dir: PathBuf },
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if !pem.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(TlsError::NotPem {
            path: path.to_path_buf(),
        });
    }
    Ok(pem)
}

/// A server presenting the certificate chain in `cert` (leaf first) with
/// the private key in `key`.
pub fn server_config(cert: &Path, key: &Path) -> Result<ServerTlsConfig, TlsError> {
    let identity = Identity::from_pem(read_pem(cert)?, read_pem(key)?);
    Ok(ServerTlsConfig::new().identity(identity))
}

/// A client that trusts only the CA certificate(s) in `ca`.
pub fn client_config(ca: &Path) -> Result<ClientTlsConfig, TlsError> {
    Ok(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_pem(ca)?)))
}

/// The endpoint of a controller: with a CA, over TLS trusting only it (an
/// `http://` endpoint is then refused: the CA would be silently unused).
pub fn controller_endpoint(endpoint: &str, ca: Option<&Path>) -> Result<Endpoint, TlsError> {
    let bad = |message: String| TlsError::Endpoint {
        endpoint: endpoint.to_string(),
        message,
    };
    let ep = Endpoint::from_shared(endpoint.to_string()).map_err(|e| bad(e.to_string()))?;
    let Some(ca) = ca else {
        return Ok(ep);
    };
    if !endpoint.starts_with("https://") {
        return Err(bad(
            "--controller-ca is given: the endpoint must be https://".into(),
        ));
    }
    ep.tls_config(client_config(ca)?)
        .map_err(|e| bad(e.to_string()))
}

// ---------------------------------------------------------------------------
// Controller → agent: the agent's self-signed certificate, pinned.
//
// An agent serving its API over TLS makes a key and a self-signed
// certificate at its first start (kept in its state dir) and advertises
// `https://host:port#sha256=<hex of the certificate's SHA-256>` as its API
// endpoint in every heartbeat, a channel its per-agent credential already
// authenticates. The controller dials that endpoint trusting exactly that
// certificate. The fingerprint travels inside the endpoint string on
// purpose: everywhere the endpoint is kept (the store, a replica taking
// over, a restarted controller) the pin is kept with it, so there is no
// second field to fall out of step, and no CA to run for agents.
// ---------------------------------------------------------------------------

/// What separates an agent's address from its certificate's fingerprint in
/// its advertised endpoint.
pub const PIN_MARK: &str = "#sha256=";

/// The certificate and key files in the directory given to
/// [`SelfSignedIdentity::load_or_create`].
pub const AGENT_CERT_FILE: &str = "tls.crt";
pub const AGENT_KEY_FILE: &str = "tls.key";

/// The name the controller asks for (SNI). The certificate is checked by
/// its fingerprint, not its names, so any fixed name serves.
const AGENT_SERVER_NAME: &str = "sandbolt-agent";

/// An agent's TLS identity: its certificate, key and the certificate's
/// SHA-256.
#[derive(Clone)]
pub struct SelfSignedIdentity {
    pub cert_pem: String,
    pub key_pem: String,
    pub sha256: [u8; 32],
}

impl std::fmt::Debug for SelfSignedIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelfSignedIdentity")
            .field("sha256", &hex(&self.sha256))
            .finish_non_exhaustive()
    }
}

impl SelfSignedIdentity {
    /// Reads `dir/tls.crt` and `dir/tls.key`, or makes them (key 0600) if
    /// neither exists, so the fingerprint stays the same across restarts
    /// and the controller's stored pin stays valid. One file without the
    /// other is refused: remove both to make a new pair.
    pub fn load_or_create(dir: &Path) -> Result<Self, TlsError> {
        let cert_path = dir.join(AGENT_CERT_FILE);
        let key_path = dir.join(AGENT_KEY_FILE);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TlsError::Read { path, source }
        };
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => {}
            (false, false) => {
                std::fs::create_dir_all(dir).map_err(io(dir))?;
                let made = rcgen::generate_simple_self_signed(vec![AGENT_SERVER_NAME.to_string()])
                    .map_err(|e| TlsError::Generate(e.to_string()))?;
                // The key first: a crash in between leaves a key without a
                // certificate, refused below rather than silently replaced.
                write_private(&key_path, made.signing_key.serialize_pem().as_bytes())
                    .map_err(io(&key_path))?;
                write_private(&cert_path, made.cert.pem().as_bytes()).map_err(io(&cert_path))?;
            }
            _ => {
                return Err(TlsError::Pair {
                    dir: dir.to_path_buf(),
                });
            }
        }
        let cert_pem = String::from_utf8_lossy(&read_pem(&cert_path)?).into_owned();
        let key_pem = String::from_utf8_lossy(&read_pem(&key_path)?).into_owned();
        let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| TlsError::Generate(format!("{}: {e}", cert_path.display())))?;
        Ok(Self {
            sha256: fingerprint(&der),
            cert_pem,
            key_pem,
        })
    }

    /// The server side of it, for tonic.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
    }

    /// The endpoint to advertise for `host_port`: pinned to this certificate.
    pub fn advertise(&self, host_port: &str) -> String {
        pinned_endpoint(host_port, &self.sha256)
    }
}

/// Writes `path` atomically with mode 0600.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// SHA-256 of a certificate's DER bytes.
pub fn fingerprint(cert_der: &[u8]) -> [u8; 32] {
    sha2::Sha256::digest(cert_der).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `https://host_port#sha256=<hex>`.
pub fn pinned_endpoint(host_port: &str, sha256: &[u8; 32]) -> String {
    format!("https://{host_port}{PIN_MARK}{}", hex(sha256))
}

/// An agent's advertised API endpoint, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEndpoint {
    /// `host:port`.
    pub address: String,
    /// The certificate's SHA-256 when the agent serves TLS; None for a
    /// plaintext agent.
    pub pin: Option<[u8; 32]>,
}

impl AgentEndpoint {
    /// Parses `host:port`, `http://host:port` (plaintext) or
    /// `https://host:port#sha256=<64 hex>` (TLS, pinned). An `https://`
    /// endpoint without a pin is refused: nothing could verify the agent.
    pub fn parse(endpoint: &str) -> Result<Self, TlsError> {
        let bad = |message: &str| TlsError::AgentEndpoint {
            endpoint: endpoint.to_string(),
            message: message.to_string(),
        };
        if let Some(rest) = endpoint.strip_prefix("https://") {
            let (address, pin) = rest.split_once(PIN_MARK).ok_or_else(|| {
                bad("an https:// agent endpoint must carry #sha256=<certificate fingerprint>")
            })?;
            let pin = parse_hex32(pin)
                .ok_or_else(|| bad("the #sha256= fingerprint must be 64 hex digits"))?;
            return Ok(Self {
                address: address.to_string(),
                pin: Some(pin),
            });
        }
        let address = endpoint.strip_prefix("http://").unwrap_or(endpoint);
        if address.contains("://") || address.contains('#') {
            return Err(bad(
                "expected host:port, http://host:port or https://host:port#sha256=<hex>",
            ));
        }
        Ok(Self {
            address: address.to_string(),
            pin: None,
        })
    }

    /// A lazily connected channel to the agent: plaintext, or TLS accepting
    /// only the pinned certificate (any other is refused, and logged).
    pub fn channel(&self, connect_timeout: Duration) -> Result<Channel, TlsError> {
        // tonic's own connector refuses https:// without its TLS config;
        // the TLS here is done by the connector below, so tonic sees http.
        let uri = format!("http://{}", self.address);
        let ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| TlsError::AgentEndpoint {
                endpoint: uri,
                message: e.to_string(),
            })?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true);
        let Some(pin) = self.pin else {
            return Ok(ep.connect_lazy());
        };
        let connector = PinnedConnector {
            tls: tokio_rustls::TlsConnector::from(pinned_client_config(pin)),
        };
        Ok(ep.connect_with_connector_lazy(connector))
    }
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A rustls client that accepts exactly the certificate whose SHA-256 is
/// `pin` (the handshake's signature is still checked against it, so only
/// the holder of its key passes), speaking HTTP/2.
pub fn pinned_client_config(pin: [u8; 32]) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(PinnedVerifier {
        pin,
        provider: provider.clone(),
    });
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

#[derive(Debug)]
struct PinnedVerifier {
    pin: [u8; 32],
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let got = fingerprint(end_entity);
        if got == self.pin {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        }
        tracing::warn!(
            pinned = %hex(&self.pin),
            presented = %hex(&got),
            "agent TLS: the certificate presented is not the one the agent reported in its heartbeat; connection refused"
        );
        Err(rustls::Error::General(format!(
            "agent certificate sha256 {} is not the pinned {} (the agent reported another certificate in its heartbeat)",
            hex(&got),
            hex(&self.pin)
        )))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// TCP to the URI's host and port, then the pinned TLS handshake.
#[derive(Clone)]
struct PinnedConnector {
    tls: tokio_rustls::TlsConnector,
}

type PinnedIo = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

impl tower::Service<Uri> for PinnedConnector {
    type Response = PinnedIo;
    type Error = std::io::Error;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<PinnedIo, std::io::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
            let port = uri.port_u16().unwrap_or(443);
            let tcp = tokio::net::TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(AGENT_SERVER_NAME)
                .expect("a valid DNS name")
                .to_owned();
            let stream = tls.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_endpoints_parse_with_and_without_a_pin() {
        let plain = AgentEndpoint::parse("10.0.0.1:7000").unwrap();
        assert_eq!(plain.address, "10.0.0.1:7000");
        assert_eq!(plain.pin, None);
        assert_eq!(AgentEndpoint::parse("http://10.0.0.1:7000").unwrap(), plain);
        let pinned = pinned_endpoint("10.0.0.1:7000", &[0xab; 32]);
        let p = AgentEndpoint::parse(&pinned).unwrap();
        assert_eq!(p.address, "10.0.0.1:7000");
        assert_eq!(p.pin, Some([0xab; 32]));
        for bad in [
            "https://10.0.0.1:7000",
            "https://10.0.0.1:7000#sha256=abc",
            "ftp://x:1",
            "10.0.0.1:7000#sha256=00",
        ] {
            assert!(AgentEndpoint::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn a_self_signed_identity_is_made_once_and_kept() {
        let dir = std::env::temp_dir().join(format!("sandbolt-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = SelfSignedIdentity::load_or_create(&dir).unwrap();
        let b = SelfSignedIdentity::load_or_create(&dir).unwrap();
        assert_eq!(a.sha256, b.sha256);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(AGENT_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_file(dir.join(AGENT_CERT_FILE)).unwrap();
        assert!(matches!(
            SelfSignedIdentity::load_or_create(&dir),
            Err(TlsError::Pair { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A CA and a server certificate it signed, kept in one directory (`ca.crt`,
/// `ca.key`, `tls.crt`, `tls.key`, keys 0600): what a single-node install
/// (`sandbolt up`) serves its controller port with. Clients trust `ca`.
#[derive(Debug, Clone)]
pub struct LocalPki {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl LocalPki {
    /// Reads the CA in `dir` (made at the first call) and (re)issues the
    /// server certificate when `names` (DNS names or IP addresses) differ
    /// from the ones it was issued for, so clients keep trusting the same CA
    /// when the listen address changes.
    pub fn load_or_create(dir: &Path, names: &[String]) -> Result<Self, TlsError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TlsError::Read { path, source }
        };
        let generate = |e: rcgen::Error| TlsError::Generate(e.to_string());
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let (ca_cert, ca_key) = (dir.join("ca.crt"), dir.join("ca.key"));
        if !ca_key.exists() || !ca_cert.exists() {
            let key = rcgen::KeyPair::generate().map_err(generate)?;
            let cert = local_ca_params()
                .map_err(generate)?
                .self_signed(&key)
                .map_err(generate)?;
            write_private(&ca_key, key.serialize_pem().as_bytes()).map_err(io(&ca_key))?;
            write_private(&ca_cert, cert.pem().as_bytes()).map_err(io(&ca_cert))?;
            // A new CA: any certificate left from an old one is void.
            let _ = std::fs::remove_file(dir.join("names"));
        }
        let pki = Self {
            ca: ca_cert,
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        let wanted = names.join("\n");
        let issued = std::fs::read_to_string(dir.join("names")).unwrap_or_default();
        if issued == wanted && pki.cert.exists() && pki.key.exists() {
            return Ok(pki);
        }
        let ca_key_pem = std::fs::read_to_string(&ca_key).map_err(io(&ca_key))?;
        let issuer_key = rcgen::KeyPair::from_pem(&ca_key_pem).map_err(generate)?;
        // The CA's own parameters and key: its name and key identifier
        // (derived from the key) are what the chain links by.
        let issuer = rcgen::Issuer::new(local_ca_params().map_err(generate)?, issuer_key);
        let mut p = rcgen::CertificateParams::new(names.to_vec()).map_err(generate)?;
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "sandbolt controller");
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate().map_err(generate)?;
        let cert = p.signed_by(&key, &issuer).map_err(generate)?;
        write_private(&pki.key, key.serialize_pem().as_bytes()).map_err(io(&pki.key))?;
        write_private(&pki.cert, cert.pem().as_bytes()).map_err(io(&pki.cert))?;
        write_private(&dir.join("names"), wanted.as_bytes()).map_err(io(dir))?;
        Ok(pki)
    }
}

/// The local CA's certificate parameters (the same at creation and at each
/// issuance).
fn local_ca_params() -> Result<rcgen::CertificateParams, rcgen::Error> {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "sandbolt local CA");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}
