//! Reverse proxy `/sandboxes/{id}/proxy/{port}/...` to a sandbox port, for
//! plain HTTP and for upgraded connections (WebSocket). One upstream
//! connection per request: the proxy is for clients that cannot reach the
//! sandbox directly, not the fast path.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::api::{API_KEY_HEADER, App, parse_port};
use crate::backend::Backend;
use crate::error::{ApiError, ApiResult};

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

async fn forward<B: Backend>(
    app: Arc<App<B>>,
    id: String,
    port: String,
    path: String,
    mut req: Request,
) -> ApiResult<Response> {
    let port = parse_port(&port)?;
    if path.split('/').any(|seg| seg == "..") {
        return Err(ApiError::invalid("proxy path must not contain '..'"));
    }
    let route = app.backend.proxy_route(&id, port).await?;
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let upstream_path = format!("{}/{}{}", route.path_prefix, path, query);
    let uri: Uri = upstream_path
        .parse()
        .map_err(|e| ApiError::invalid(format!("bad proxy path: {e}")))?;

    let is_upgrade = req
        .headers()
        .get(header::CONNECTION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        });
    let upgrade_proto = req.headers().get(header::UPGRADE).cloned();
    let client_upgrade = if is_upgrade {
        req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>()
    } else {
        None
    };

    let (parts, body) = req.into_parts();
    let mut out = http::Request::builder().method(parts.method).uri(uri);
    let headers = out.headers_mut().expect("fresh builder");
    for (k, v) in &parts.headers {
        let name = k.as_str();
        // The API key authenticates to *us*; it must never reach the
        // (untrusted) sandbox.
        if HOP_BY_HOP.contains(&name) || name == "host" || k == API_KEY_HEADER {
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
    if let (true, Some(proto)) = (client_upgrade.is_some(), upgrade_proto) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto);
    }
    let out = out.body(body).map_err(|e| bad_gateway(e.to_string()))?;

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
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (up, down) = match tokio::try_join!(upstream_upgrade, client_upgrade) {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::debug!(error = %e, "proxy upgrade failed");
                    return;
                }
            };
            let (mut up, mut down) = (TokioIo::new(up), TokioIo::new(down));
            let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
        });
        let (parts, _) = resp.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }

    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(*h);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}
