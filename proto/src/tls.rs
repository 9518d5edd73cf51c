//! TLS between sandbolt's own processes: the controller's main port serves
//! TLS when given a certificate and key (`--tls-cert`, `--tls-key`), and
//! the processes that call it (agents, janitors) trust the CA given with
//! `--controller-ca`. PEM files, read once at start, so a bad file fails
//! the start rather than a later call.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

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
