//! A local OCI registry: the read side of the OCI distribution spec over
//! plain HTTP on 127.0.0.1, serving images the test bed builds.
//!
//! No registry is reachable from the machines sandbolt is tested on, yet the
//! agent's pull path (`ctr images pull`) must be exercised for real. This
//! serves exactly what a pull reads: `GET /v2/`, `HEAD`/`GET` of manifests
//! by tag or digest (a tag names the image's OCI index, as for multi-arch
//! images on Docker Hub) and `HEAD`/`GET` of blobs by digest. It counts and
//! logs every request, so a test can tell whether a pull happened, and it
//! can hold requests ([`LocalRegistry::hold`]) so a test can observe what
//! happens while a pull is under way.
//!
//! The server runs on its own thread with its own tokio runtime (usable from
//! plain and async tests alike) and stops when the value is dropped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::{oneshot, watch};

use crate::TestbedError;
use crate::image::{MT_OCI_INDEX, MT_OCI_MANIFEST, OciDocuments, OciImage, sha256_digest};

const DIGEST_HEADER: &str = "Docker-Content-Digest";
const MT_OCTET: &str = "application/octet-stream";

/// A running local registry; see the module documentation.
pub struct LocalRegistry {
    addr: SocketAddr,
    state: Arc<RegistryState>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

struct Blob {
    media_type: &'static str,
    data: Bytes,
}

#[derive(Default)]
struct Repository {
    /// Tag → digest of the index it names.
    tags: HashMap<String, String>,
    /// Everything of the repository by digest: index, manifest, config, layer.
    blobs: HashMap<String, Blob>,
}

struct RegistryState {
    repositories: HashMap<String, Repository>,
    requests: AtomicUsize,
    log: Mutex<Vec<String>>,
    /// `true` while requests are answered; `false` holds them (after they
    /// are counted) until [`LocalRegistry::release`].
    open: watch::Sender<bool>,
}

impl LocalRegistry {
    /// Serves each `(name:tag, image)` on a fresh port of 127.0.0.1, e.g.
    /// `("warm/busybox:1", &busybox)` is pulled as
    /// `127.0.0.1:<port>/warm/busybox:1` (see [`LocalRegistry::reference`]).
    /// A name without a tag gets `latest`.
    pub fn serve(images: &[(&str, &OciImage)]) -> Result<LocalRegistry, TestbedError> {
        let mut repositories: HashMap<String, Repository> = HashMap::new();
        for (name_tag, image) in images {
            let (name, tag) = split_name_tag(name_tag)?;
            let OciDocuments {
                config,
                manifest,
                index,
            } = image.documents();
            let repo = repositories.entry(name).or_default();
            let index_digest = sha256_digest(&index);
            let mut add = |media_type: &'static str, data: Vec<u8>| {
                repo.blobs.insert(
                    sha256_digest(&data),
                    Blob {
                        media_type,
                        data: Bytes::from(data),
                    },
                );
            };
            add(MT_OCI_INDEX, index);
            add(MT_OCI_MANIFEST, manifest);
            add("application/vnd.oci.image.config.v1+json", config);
            add(
                "application/vnd.oci.image.layer.v1.tar",
                image.rootfs_tar().to_vec(),
            );
            repo.tags.insert(tag, index_digest);
        }

        // Bound here, synchronously, so a failure is the caller's error and
        // the address is known before the first request can be made.
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| TestbedError::Setup(format!("local registry: binding a port: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| TestbedError::Setup(format!("local registry: local address: {e}")))?;
        let state = Arc::new(RegistryState {
            repositories,
            requests: AtomicUsize::new(0),
            log: Default::default(),
            open: watch::Sender::new(true),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TestbedError::Setup(format!("local registry: tokio runtime: {e}")))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let app = Router::new().fallback(handle).with_state(state.clone());
        let thread = std::thread::Builder::new()
            .name(format!("local-registry-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "local registry: adopting the listener");
                            return;
                        }
                    };
                    // Not a graceful shutdown: held requests would never
                    // finish. Dropping the runtime ends every connection.
                    tokio::select! {
                        res = axum::serve(listener, app) => {
                            if let Err(e) = res {
                                tracing::error!(error = %e, "local registry stopped");
                            }
                        }
                        _ = stopped => {}
                    }
                });
            })
            .map_err(|e| TestbedError::Spawn {
                what: "local registry thread".into(),
                source: e,
            })?;
        Ok(LocalRegistry {
            addr,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `127.0.0.1:<port>`: the registry host part of a reference, and what
    /// a client must be told to reach over plain HTTP.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The full reference of a served `name:tag`.
    pub fn reference(&self, name_tag: &str) -> String {
        format!("{}/{name_tag}", self.host())
    }

    /// Requests received so far (any path, any method, held ones included).
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Every request so far as `METHOD /path`, in arrival order.
    pub fn request_log(&self) -> Vec<String> {
        self.state
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Holds every request from now on (it is counted and logged, then
    /// waits) until [`LocalRegistry::release`].
    pub fn hold(&self) {
        self.state.open.send_replace(false);
    }

    /// Answers held requests and every later one.
    pub fn release(&self) {
        self.state.open.send_replace(true);
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `warm/busybox:1` → (`warm/busybox`, `1`); a colon followed by a slash
/// belongs to a host:port, not a tag.
fn split_name_tag(name_tag: &str) -> Result<(String, String), TestbedError> {
    let (name, tag) = match name_tag.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, tag),
        _ => (name_tag, "latest"),
    };
    let valid_name = !name.is_empty()
        && name.split('/').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        });
    if !valid_name || tag.is_empty() {
        return Err(TestbedError::Setup(format!(
            "local registry: {name_tag:?} is not a repository name with an optional tag"
        )));
    }
    Ok((name.to_string(), tag.to_string()))
}

enum Route<'a> {
    Base,
    Manifest { name: &'a str, reference: &'a str },
    Blob { name: &'a str, digest: &'a str },
}

fn route(path: &str) -> Option<Route<'_>> {
    if path == "/v2/" || path == "/v2" {
        return Some(Route::Base);
    }
    let rest = path.strip_prefix("/v2/")?;
    if let Some((name, reference)) = rest.rsplit_once("/manifests/") {
        return Some(Route::Manifest { name, reference });
    }
    if let Some((name, digest)) = rest.rsplit_once("/blobs/") {
        return Some(Route::Blob { name, digest });
    }
    None
}

#[tracing::instrument(skip_all, fields(%method, path = uri.path()))]
async fn handle(State(state): State<Arc<RegistryState>>, method: Method, uri: Uri) -> Response {
    state.requests.fetch_add(1, Ordering::SeqCst);
    state
        .log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(format!("{method} {}", uri.path()));
    let mut open = state.open.subscribe();
    // Err only when the sender is gone, i.e. the registry is shutting down.
    let _ = open.wait_for(|open| *open).await;

    if method != Method::GET && method != Method::HEAD {
        // The read side only: no pushes, no deletes.
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "UNSUPPORTED",
            "this registry is read-only",
        );
    }
    let head = method == Method::HEAD;
    match route(uri.path()) {
        Some(Route::Base) => {
            let mut resp = (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                "{}",
            )
                .into_response();
            resp.headers_mut().insert(
                "Docker-Distribution-API-Version",
                HeaderValue::from_static("registry/2.0"),
            );
            resp
        }
        Some(Route::Manifest { name, reference }) => {
            let Some(repo) = state.repositories.get(name) else {
                return error(StatusCode::NOT_FOUND, "NAME_UNKNOWN", name);
            };
            let digest = if reference.starts_with("sha256:") {
                reference
            } else {
                match repo.tags.get(reference) {
                    Some(d) => d.as_str(),
                    None => return error(StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN", reference),
                }
            };
            match repo.blobs.get(digest) {
                Some(blob)
                    if blob.media_type == MT_OCI_INDEX || blob.media_type == MT_OCI_MANIFEST =>
                {
                    content(digest, blob.media_type, &blob.data, head)
                }
                _ => error(StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN", reference),
            }
        }
        Some(Route::Blob { name, digest }) => {
            let Some(repo) = state.repositories.get(name) else {
                return error(StatusCode::NOT_FOUND, "NAME_UNKNOWN", name);
            };
            match repo.blobs.get(digest) {
                Some(blob) => content(digest, MT_OCTET, &blob.data, head),
                None => error(StatusCode::NOT_FOUND, "BLOB_UNKNOWN", digest),
            }
        }
        None => error(StatusCode::NOT_FOUND, "NOT_FOUND", uri.path()),
    }
}

/// A document or blob: its media type, digest and length, and (for GET) the
/// bytes. A HEAD answer carries the same Content-Length as the GET would,
/// which is what a client resolving a tag reads the size from.
fn content(digest: &str, media_type: &'static str, data: &Bytes, head: bool) -> Response {
    let body = if head {
        Body::empty()
    } else {
        Body::from(data.clone())
    };
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(data.len()));
    if let Ok(d) = HeaderValue::from_str(digest) {
        headers.insert(DIGEST_HEADER, d);
    }
    resp
}

/// An error in the distribution spec's JSON shape.
fn error(status: StatusCode, code: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "errors": [{"code": code, "message": code.to_lowercase().replace('_', " "), "detail": detail}]
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags_split_like_references() {
        assert_eq!(
            split_name_tag("warm/busybox:1").unwrap(),
            ("warm/busybox".into(), "1".into())
        );
        assert_eq!(
            split_name_tag("busybox").unwrap(),
            ("busybox".into(), "latest".into())
        );
        assert!(split_name_tag("Upper/case:1").is_err());
        assert!(split_name_tag("a//b:1").is_err());
    }

    #[test]
    fn routes_names_with_slashes() {
        assert!(matches!(route("/v2/"), Some(Route::Base)));
        match route("/v2/a/b/manifests/1") {
            Some(Route::Manifest { name, reference }) => {
                assert_eq!((name, reference), ("a/b", "1"))
            }
            _ => panic!("manifest route"),
        }
        match route("/v2/a/blobs/sha256:00") {
            Some(Route::Blob { name, digest }) => assert_eq!((name, digest), ("a", "sha256:00")),
            _ => panic!("blob route"),
        }
        assert!(route("/v3/").is_none());
    }
}
