//! Reverse proxy `/sandboxes/{id}/proxy/{port}/...` to a sandbox port, for
//! plain HTTP and for upgraded connections (WebSocket). One upstream
//! connection per request: the proxy is for clients that cannot reach the
//! sandbox directly, not the fast path. [`forward_to`] also serves the fsb
//! gateway (`crate::gateway`), which finds its route from a signed scope.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::api::{API_KEY_HEADER, App, parse_port};
use crate::backend::{Backend, Route};
use crate::error::{ApiError, ApiResult};
use crate::gateway_scope::INGRESS_HEADER;

/// Hop-by-hop headers (RFC 9110 §7.6.1) are not forwarded; `Connection` and
/// `Upgrade` are re-added for upgrades.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
];

#[tracing::instrument(skip_all, fields(sandbox_id = %id, port = %port))]
pub async fn proxy_root<B: Backend>(
    State(app): State<Arc<App<B>>>,
    Path((id, port)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward(app, id, port, String::new(), req).await
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id, port = %port))]
pub async fn proxy_path<B: Backend>(
    State(app): State<Arc<App<B>>>,
    Path((id, port, path)): Path<(String, String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward(app, id, port, path, req).await
}

fn bad_gateway(msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "PROXY_UPSTREAM_ERROR", msg)
}

/// `/sandboxes/{id}/proxy/{port}/{path}`: the route the backend answers
/// for the sandbox of the API's namespace.
async fn forward<B: Backend>(
    app: Arc<App<B>>,
    id: String,
    port: String,
    path: String,
    req: Request,
) -> ApiResult<Response> {
    let port = parse_port(&port)?;
    check_path(&path)?;
    let route = app.backend.proxy_route(&id, port).await?;
    forward_to(&route, &Upstream { id: &id, port }, &path, req).await
}

/// Refuses a path that would climb out of the route's path prefix.
pub(crate) fn check_path(path: &str) -> ApiResult<()> {
    if path.split('/').any(|seg| seg == "..") {
        return Err(ApiError::invalid("proxy path must not contain '..'"));
    }
    Ok(())
}

/// Which sandbox port a forwarded request is for (error messages).
pub(crate) struct Upstream<'a> {
    pub id: &'a str,
    pub port: u16,
}

/// Forwards `req` to `route` + `path` (relative, no leading `/`; the
/// query is the request's) over a fresh HTTP/1.1 connection, streaming both
/// bodies (SSE included) and splicing the two connections together after a
/// `101 Switching Protocols` (WebSocket or any other upgrade). The caller
/// has checked that the client may reach this sandbox port and `path` with
/// [`check_path`].
pub(crate) async fn forward_to(
    route: &Route,
    upstream: &Upstream<'_>,
    path: &str,
    mut req: Request,
) -> ApiResult<Response> {
    let Upstream { id, port } = *upstream;
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let upstream_path = format!("{}/{}{}", route.path_prefix, path, query);
    let uri: Uri = upstream_path
        .parse()
        .map_err(|e| ApiError::invalid(format!("bad proxy path: {e}")))?;

    let client_upgrade = take_client_upgrade(&mut req);
    let out = upstream_request(route, uri, req, client_upgrade.is_some())?;

    let stream = TcpStream::connect(&route.authority)
        .await
        .map_err(|e| bad_gateway(format!("cannot reach sandbox {id} port {port}: {e}")))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| bad_gateway(format!("handshake with sandbox {id} failed: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "proxy upstream connection ended");
        }
    });
    let mut resp = sender
        .send_request(out)
        .await
        .map_err(|e| bad_gateway(format!("sandbox {id} port {port}: {e}")))?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        splice_upgraded(hyper::upgrade::on(&mut resp), client_upgrade);
        let (parts, _) = resp.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }

    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(*h);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// The client side of an upgrade, when the request asks for one.
fn take_client_upgrade(req: &mut Request) -> Option<hyper::upgrade::OnUpgrade> {
    let is_upgrade = req
        .headers()
        .get(header::CONNECTION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        });
    if is_upgrade {
        req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>()
    } else {
        None
    }
}

/// The request as the sandbox gets it: hop-by-hop headers (and those
/// `Connection` names) and every
/// credential meant for sandbolt dropped, the route's own headers (execd's
/// token) set, `Host` the upstream's, `Connection`/`Upgrade` re-added for an
/// upgrade.
fn upstream_request(
    route: &Route,
    uri: Uri,
    req: Request,
    upgrade: bool,
) -> ApiResult<http::Request<Body>> {
    let upgrade_proto = req.headers().get(header::UPGRADE).cloned();
    let (parts, body) = req.into_parts();
    // Headers the client's Connection names belong to this hop too.
    let named: Vec<String> = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .collect();
    let mut out = http::Request::builder().method(parts.method).uri(uri);
    let headers = out.headers_mut().expect("fresh builder");
    for (k, v) in &parts.headers {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name)
            || named.iter().any(|n| n == name)
            || name == "host"
            || is_credential(k)
        {
            continue;
        }
        headers.append(k, v.clone());
    }
    for (k, v) in &route.headers {
        let (Ok(k), Ok(v)) = (
            HeaderName::try_from(k.as_str()),
            HeaderValue::try_from(v.as_str()),
        ) else {
            continue;
        };
        headers.insert(k, v);
    }
    headers.insert(
        header::HOST,
        HeaderValue::try_from(route.authority.as_str()).map_err(|e| bad_gateway(e.to_string()))?,
    );
    if let (true, Some(proto)) = (upgrade, upgrade_proto) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto);
    }
    out.body(body).map_err(|e| bad_gateway(e.to_string()))
}

/// The API key authenticates to the lifecycle and a route scope to the
/// gateway; neither may reach the (untrusted) sandbox, which could replay it.
fn is_credential(name: &HeaderName) -> bool {
    name == API_KEY_HEADER || name == INGRESS_HEADER
}

/// Copies bytes both ways between the two upgraded connections until either
/// side closes.
fn splice_upgraded(upstream: hyper::upgrade::OnUpgrade, client: hyper::upgrade::OnUpgrade) {
    tokio::spawn(async move {
        let (up, down) = match tokio::try_join!(upstream, client) {
            Ok(pair) => pair,
            Err(e) => {
                tracing::debug!(error = %e, "proxy upgrade failed");
                return;
            }
        };
        let (mut up, mut down) = (TokioIo::new(up), TokioIo::new(down));
        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
    });
}
