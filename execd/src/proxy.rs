//! `/proxy/{port}/...`: HTTP and WebSocket (any HTTP/1.1 upgrade) passthrough to
//! `127.0.0.1:{port}` inside the sandbox. Always loopback: no DNS, no other hosts.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use crate::error::{ApiError, code};
use crate::server::{ACCESS_TOKEN_HEADER, mark_proxied};

/// Headers that belong to one hop and are not forwarded.
const HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Splits `/proxy/{port}/rest` into the port and the upstream path (always starting
/// with `/`).
pub fn split_target(path: &str) -> Result<(u16, String), ApiError> {
    let rest = path
        .strip_prefix("/proxy/")
        .ok_or_else(|| ApiError::bad_request("not a proxy path"))?;
    let (port, tail) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::bad_request(format!("invalid proxy port {port:?}")))?;
    Ok((port, tail.to_string()))
}

fn bad_gateway(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, code::BAD_GATEWAY, message)
}

/// `/proxy/{port}/...`: the request relayed to `127.0.0.1:{port}`.
#[tracing::instrument(skip_all, fields(path = %req.uri().path()))]
pub async fn handle(mut req: Request) -> Result<Response, ApiError> {
    let (port, path) = split_target(req.uri().path())?;
    let path_q = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let uri = path_q
        .parse::<Uri>()
        .map_err(|_| ApiError::bad_request("invalid proxy path"))?;
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));

    let mut sender = connect_upstream(port).await?;
    let out = upstream_request(req, uri, port, upgrade.as_deref());
    let mut resp = sender
        .send_request(out)
        .await
        .map_err(|e| bad_gateway(format!("upstream 127.0.0.1:{port}: {e}")))?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let client_upgrade =
            client_upgrade.ok_or_else(|| bad_gateway("upstream switched protocols unasked"))?;
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (Ok(c), Ok(u)) = (client_upgrade.await, upstream_upgrade.await) else {
                return;
            };
            let mut c = TokioIo::new(c);
            let mut u = TokioIo::new(u);
            let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
        });
        let (parts, _) = resp.into_parts();
        return Ok(mark_proxied(Response::from_parts(parts, Body::empty())));
    }

    let (mut parts, body) = resp.into_parts();
    for h in HOP {
        parts.headers.remove(*h);
    }
    Ok(mark_proxied(Response::from_parts(parts, Body::new(body))))
}

/// One HTTP/1.1 connection to `127.0.0.1:{port}`, driven in the background.
async fn connect_upstream(
    port: u16,
) -> Result<hyper::client::conn::http1::SendRequest<Body>, ApiError> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| bad_gateway(format!("cannot reach 127.0.0.1:{port}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| bad_gateway(format!("upstream 127.0.0.1:{port}: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    Ok(sender)
}

/// The request as the application sees it: end-to-end headers only (never the
/// access token), the upgrade asked for, and a Host.
fn upstream_request(req: Request, uri: Uri, port: u16, upgrade: Option<&str>) -> Request {
    let (parts, body) = req.into_parts();
    let mut out = http::Request::new(body);
    *out.method_mut() = parts.method.clone();
    *out.uri_mut() = uri;
    *out.version_mut() = http::Version::HTTP_11;
    let headers = out.headers_mut();
    // Headers named by Connection are hop-by-hop too.
    let named: Vec<String> = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for (k, v) in parts.headers.iter() {
        let name = k.as_str();
        if HOP.contains(&name) || named.iter().any(|n| n == name) || name == ACCESS_TOKEN_HEADER {
            continue;
        }
        headers.append(k.clone(), v.clone());
    }
    if let Some(up) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Ok(v) = HeaderValue::from_str(up) {
            headers.insert(header::UPGRADE, v);
        }
    }
    if !headers.contains_key(header::HOST)
        && let Ok(v) = HeaderValue::from_str(&format!("127.0.0.1:{port}"))
    {
        headers.insert(header::HOST, v);
    }
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(
            split_target("/proxy/8080/a/b").unwrap(),
            (8080, "/a/b".into())
        );
        assert_eq!(split_target("/proxy/8080").unwrap(), (8080, "/".into()));
        assert_eq!(split_target("/proxy/8080/").unwrap(), (8080, "/".into()));
        assert!(split_target("/proxy/0/x").is_err());
        assert!(split_target("/proxy/99999/x").is_err());
        assert!(split_target("/proxy/abc").is_err());
        assert!(split_target("/proxy/").is_err());
    }
}
