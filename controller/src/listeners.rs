//! The controller's gRPC ports and who may call what on them.
//!
//! - The main port serves everything (FastPath v1 + v2, the native API,
//!   RegistryService, health). FastPath and native calls need the FastPath
//!   bearer token, or, with [`ControllerConfig::fastpath_tls`], a client
//!   certificate instead: the port then speaks TLS and plaintext side by
//!   side (a TLS connection starts with a handshake record, a plaintext
//!   HTTP/2 one with its preface), so agents, janitors, the bundled
//!   lifecycle and the kubelet's gRPC probes, which have no certificates,
//!   keep working unchanged.
//! - The open port ([`ControllerConfig::open_fastpath_listen`]) serves only
//!   FastPath v1 + v2 and health, with no credentials at all: it exists for
//!   the OpenSandbox server, whose FastPath client opens a plaintext channel
//!   and cannot send a token. Only the network may reach it (the chart's
//!   NetworkPolicy), and nothing on it can register an agent.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sandbolt_proto::auth::RequireBearer;
use sandbolt_telemetry::CappedListener;
use sandbolt_telemetry::listener::CappedStream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tonic::{Request, Status};

use crate::config::{ControllerConfig, TlsFiles};
use crate::{Error, Result};

/// First byte of a TLS record carrying a handshake message (a ClientHello
/// opens every TLS connection); an HTTP/2 preface starts with `P`.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// A client that connected but neither finished a TLS handshake nor sent a
/// first byte within this long is dropped, so idle sockets cannot pile up.
const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted connections waiting for the gRPC server to take them.
const ACCEPT_BACKLOG: usize = 64;

/// The FastPath token check of the main port, which a verified client
/// certificate satisfies as well (see [`ControllerConfig::fastpath_tls`]).
#[derive(Clone)]
pub(crate) struct FastPathAuth {
    bearer: RequireBearer,
    /// TLS is on and no token is configured: plaintext FastPath calls are
    /// refused instead of running open (a certificate is the only way in).
    certificate_only: bool,
}

impl FastPathAuth {
    pub(crate) fn new(config: &ControllerConfig) -> Self {
        let token = config.fastpath_token.as_deref().filter(|t| !t.is_empty());
        let client_ca = config.fastpath_tls.is_some()
            || config.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        Self {
            bearer: RequireBearer::new(token, "fastpath"),
            certificate_only: client_ca && token.is_none(),
        }
    }
}

impl tonic::service::Interceptor for FastPathAuth {
    fn call(&mut self, req: Request<()>) -> std::result::Result<Request<()>, Status> {
        let has_certificate = req
            .extensions()
            .get::<MainPortPeer>()
            .is_some_and(|p| p.client_certificate);
        if has_certificate {
            return Ok(req);
        }
        if self.certificate_only {
            return Err(Status::unauthenticated(
                "fastpath: this port needs a TLS client certificate signed by the configured client CA",
            ));
        }
        self.bearer.check(req)
    }
}

/// What the main port knows about a connection's peer; FastPath handlers
/// find it in the request extensions.
#[derive(Debug, Clone)]
pub(crate) struct MainPortPeer {
    /// The peer completed mutual TLS with a certificate the client CA signed.
    pub(crate) client_certificate: bool,
}

/// One accepted connection of the main port with TLS on.
pub(crate) enum MainPortConn {
    Plain(CappedStream),
    Tls(Box<TlsStream<CappedStream>>),
}

impl Connected for MainPortConn {
    type ConnectInfo = MainPortPeer;

    fn connect_info(&self) -> MainPortPeer {
        match self {
            Self::Plain(_) => MainPortPeer {
                client_certificate: false,
            },
            Self::Tls(s) => {
                let (_, session) = s.get_ref();
                MainPortPeer {
                    // The verifier refuses a handshake without one; checked
                    // again so a config change cannot silently open the port.
                    client_certificate: session.peer_certificates().is_some_and(|c| !c.is_empty()),
                }
            }
        }
    }
}

impl AsyncRead for MainPortConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MainPortConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The main port with TLS on, as [`main_port_tls`] decided it.
pub(crate) struct MainPortTls {
    config: Arc<rustls::ServerConfig>,
    /// `--fastpath-tls-*`: plaintext beside mutual TLS. Otherwise
    /// (`--tls-cert`) TLS only.
    plaintext_too: bool,
}

/// The main port's one TLS configuration, read now so a bad file fails the
/// start:
/// - `--tls-cert/--tls-key` ([`ControllerConfig::tls`]): TLS only, the
///   server certificate always; with `--tls-client-ca` a client may present
///   a certificate (verified against it), which then stands in for the
///   FastPath token; clients without one (agents, janitors, the lifecycle)
///   still connect and use their tokens.
/// - `--fastpath-tls-*` ([`ControllerConfig::fastpath_tls`]): plaintext and
///   mutual TLS side by side, a certificate required on TLS connections.
///
/// Both at once would be two TLS setups on one port: refused.
pub(crate) fn main_port_tls(config: &ControllerConfig) -> Result<Option<MainPortTls>> {
    match (&config.tls, &config.fastpath_tls) {
        (Some(_), Some(_)) => Err(Error::InvalidArgument(
            "--tls-cert and --fastpath-tls-cert exclude each other: with --tls-cert the main \
             port is TLS only; give the FastPath client CA as --tls-client-ca instead of \
             --fastpath-tls-*"
                .into(),
        )),
        (Some(files), None) => Ok(Some(MainPortTls {
            config: build_server_config(
                &files.cert,
                &files.key,
                files.client_ca.as_deref().map(|ca| (ca, false)),
                "--tls-cert",
            )?,
            plaintext_too: false,
        })),
        (None, Some(files)) => Ok(Some(MainPortTls {
            config: server_tls_config(files)?,
            plaintext_too: true,
        })),
        (None, None) => Ok(None),
    }
}

/// The main port's connections with TLS on: each accepted socket gets
/// TCP_NODELAY, then is handed over after a completed TLS handshake, or as
/// plaintext where [`MainPortTls`] allows it (refused otherwise). Ends when
/// the gRPC server drops the stream.
pub(crate) fn plaintext_or_tls(
    listener: CappedListener,
    tls: MainPortTls,
) -> ReceiverStream<io::Result<MainPortConn>> {
    let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
    tokio::spawn(accept_loop(
        listener,
        TlsAcceptor::from(tls.config),
        tls.plaintext_too,
        tx,
    ));
    ReceiverStream::new(rx)
}

async fn accept_loop(
    listener: CappedListener,
    acceptor: TlsAcceptor,
    plaintext_too: bool,
    tx: mpsc::Sender<io::Result<MainPortConn>>,
) {
    loop {
        // Under the connection cap, with TCP_NODELAY (see `capped` in
        // lib.rs); accept errors are retried by the listener.
        let conn = tokio::select! {
            c = listener.accept() => c,
            () = tx.closed() => return,
        };
        let peer = conn.peer;
        let stream = conn.into_stream();
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        // Per connection, so a slow handshake never holds up the others.
        tokio::spawn(async move {
            match tokio::time::timeout(
                FIRST_BYTES_TIMEOUT,
                plaintext_or_handshake(stream, &acceptor, plaintext_too),
            )
            .await
            {
                Ok(Ok(conn)) => {
                    let _ = tx.send(Ok(conn)).await;
                }
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "controller port: TLS connection refused")
                }
                Err(_) => {
                    tracing::debug!(%peer, "controller port: no first bytes in time; dropped")
                }
            }
        });
    }
}

async fn plaintext_or_handshake(
    stream: CappedStream,
    acceptor: &TlsAcceptor,
    plaintext_too: bool,
) -> io::Result<MainPortConn> {
    let mut first = [0u8; 1];
    let n = stream.get_ref().peek(&mut first).await?;
    if n == 1 && first[0] == TLS_HANDSHAKE_RECORD {
        Ok(MainPortConn::Tls(Box::new(acceptor.accept(stream).await?)))
    } else if plaintext_too {
        Ok(MainPortConn::Plain(stream))
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "plaintext on a TLS-only port (--tls-cert): connect with https:// and --controller-ca",
        ))
    }
}

/// The main port's TLS settings: the server certificate, a client
/// certificate required and verified against `client_ca`, HTTP/2 by ALPN
/// (gRPC clients, grpcio among them, insist on it).
pub(crate) fn server_tls_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>> {
    build_server_config(
        &files.cert,
        &files.key,
        Some((&files.client_ca, true)),
        "FastPath TLS",
    )
}

/// A server presenting `cert`/`key`; with `client_ca` = (CA file,
/// required), client certificates are verified against that CA, and
/// required or only accepted when presented.
fn build_server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<(&Path, bool)>,
    flag: &str,
) -> Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let bad = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
        Error::InvalidArgument(format!("{flag} {what} {}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| bad("certificate", cert, &e))?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("key", key, &e))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Internal(format!("TLS protocol versions: {e}")))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some((ca_file, required)) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in
                CertificateDer::pem_file_iter(ca_file).map_err(|e| bad("client CA", ca_file, &e))?
            {
                let ca = ca.map_err(|e| bad("client CA", ca_file, &e))?;
                roots.add(ca).map_err(|e| bad("client CA", ca_file, &e))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            );
            // Optional: agents, janitors and the lifecycle hold no client
            // certificate and authenticate with their tokens instead.
            let verifier = if required {
                verifier.build()
            } else {
                verifier.allow_unauthenticated().build()
            }
            .map_err(|e| bad("client CA", ca_file, &e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key_der)
        .map_err(|e| bad("certificate/key pair", cert, &e))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
