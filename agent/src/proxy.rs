//! The data-plane proxy: `http://<agent>:<proxy port>/<sandbox id>/<port>/<rest>`
//! reaches `http://127.0.0.1:<port>/<rest>` *inside* that sandbox.
//!
//! Sandboxes have their own network namespaces with only loopback, so there
//! is no address the agent could route to. Instead the upstream socket is
//! created inside the sandbox's namespace: a short-lived dedicated OS thread
//! enters the namespace with `setns(2)` on the sandbox's [`NetnsHandle`]
//! (an fd opened once when the task started, never a PID looked up at
//! dial time: see [`crate::netns`]), creates and connects the socket
//! there, and hands it back. A socket stays in the namespace it was
//! created in, so the async side can use it like any other. The thread then
//! exits, taking its changed namespace with it — a tokio worker (or a pooled
//! blocking thread) is never moved into a sandbox's namespace.
//!
//! A gVisor (runsc) sandbox is the exception: gVisor's netstack owns its
//! interfaces, so the namespace's kernel loopback is not the sandbox's and
//! nothing inside listens there. Its route dials the sandbox's own address
//! from the node instead ([`Upstream::Address`]; see [`crate::gvisor`]):
//! the node's nftables rules let the node open connections to its
//! sandboxes (only the answers come back in) while a sandbox still cannot
//! open one to the node. A server inside a runsc sandbox is reachable only
//! when it listens on the sandbox's address or `0.0.0.0` (execd does).
//!
//! Every request carries the sandbox's access token in
//! `X-Sandbolt-Access-Token`; the proxy compares its SHA-256 with the one the
//! agent stored, in constant time, and removes the header before forwarding
//! (the sandbox never sees the token through the proxy). Bodies stream in
//! both directions (SSE and chunked responses flow as they are produced), and
//! `Upgrade` requests (WebSocket) switch to a raw bidirectional copy after
//! the upstream's `101`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream as StdTcpStream};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use sandbolt_proto::auth::digest_matches;
use sandbolt_telemetry::listener::{CappedListener, Drain, ListenerLimits, Protocols};
use tokio::net::{TcpListener, TcpStream};

pub use crate::netns::NetnsHandle;

/// The header carrying the per-sandbox access token (header names are
/// case-insensitive; the wire constant is shared with the controller).
pub use sandbolt_proto::wire::PROXY_TOKEN_HEADER as TOKEN_HEADER;

/// How long a connect inside a sandbox may take. Loopback connects finish or
/// are refused at once; this only bounds a pathological namespace.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// How a connection to a port of a sandbox is opened.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// `127.0.0.1:<port>` inside this network namespace (held open since
    /// the sandbox's task started): runc and crun sandboxes.
    Namespace(Arc<NetnsHandle>),
    /// `<address>:<port>` from the node: gVisor sandboxes, whose netstack
    /// owns their veth and loopback.
    Address(Ipv4Addr),
}

impl Upstream {
    /// The `Host` header a server inside expects for `port`.
    pub fn host(&self, port: u16) -> String {
        match self {
            Upstream::Namespace(_) => format!("127.0.0.1:{port}"),
            Upstream::Address(ip) => format!("{ip}:{port}"),
        }
    }
}

/// Where a sandbox lives, as the proxy needs it.
#[derive(Debug, Clone)]
pub struct Route {
    /// How to reach it.
    pub upstream: Upstream,
    /// SHA-256 of the sandbox's access token.
    pub token_sha256: [u8; 32],
}

/// The agent's sandbox table, as seen by the proxy.
pub trait SandboxLookup: Send + Sync {
    fn lookup(&self, sandbox_id: &str) -> Option<Route>;
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("proxy listener failed: {0}")]
    Accept(#[source] io::Error),
}

type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// Serves the proxy on `listener` until `shutdown` completes, with the
/// default [`ListenerLimits`]; see [`serve_with_limits`].
pub async fn serve(
    listener: TcpListener,
    lookup: Arc<dyn SandboxLookup>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    serve_with_limits(listener, lookup, ListenerLimits::default(), shutdown).await
}

/// Serves the proxy on `listener` until `shutdown` completes. Then it stops
/// accepting, asks open HTTP connections to finish their current request
/// and close, and returns without waiting for them (upgraded WebSocket
/// streams may live arbitrarily long; they end with their peers or the
/// runtime).
///
/// The port is reachable cluster-wide before any token is checked, so
/// `limits` apply before anything else (see `sandbolt_telemetry::listener`):
/// at most `max_connections` open, a new connection's request head within
/// `header_read_timeout`, a connection with no request in progress closed
/// after `idle_timeout`. Accept errors (out of descriptors and the like)
/// are retried after a pause; the proxy keeps serving.
pub async fn serve_with_limits(
    listener: TcpListener,
    lookup: Arc<dyn SandboxLookup>,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "data-plane proxy listening");
    }
    let listener = CappedListener::new(listener, "agent-proxy", &limits);
    let make_service = move |peer: SocketAddr| {
        let lookup = lookup.clone();
        service_fn(move |req| handle(req, lookup.clone(), peer))
    };
    sandbolt_telemetry::listener::serve_http(
        listener,
        make_service,
        limits,
        Protocols::Http1,
        Drain::NoWait,
        shutdown,
    )
    .await;
    tracing::info!("data-plane proxy stopped");
    Ok(())
}

/// Opens a TCP connection to `port` of a sandbox, the way its upstream says.
pub async fn dial(upstream: &Upstream, port: u16) -> io::Result<TcpStream> {
    match upstream {
        Upstream::Namespace(netns) => dial_in_sandbox(netns, port).await,
        Upstream::Address(ip) => {
            let addr = SocketAddr::from((*ip, port));
            let stream = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr))
                .await
                .map_err(|_| {
                    io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {addr}"))
                })??;
            let _ = stream.set_nodelay(true);
            notice_a_dead_sandbox(&stream);
            Ok(stream)
        }
    }
}

/// A gVisor sandbox that dies takes its network stack with it: nothing
/// answers for its address any more, not even with a reset, so a
/// connection to it would wait for ever. Keepalive probes (and a bound on
/// unacknowledged data) end such a connection within about half a minute.
fn notice_a_dead_sandbox(stream: &TcpStream) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    let sock = socket2::SockRef::from(stream);
    if let Err(e) = sock
        .set_tcp_keepalive(&keepalive)
        .and_then(|()| sock.set_tcp_user_timeout(Some(Duration::from_secs(30))))
    {
        tracing::debug!(error = %e, "cannot set keepalive on a sandbox connection");
    }
}

/// Opens a TCP connection to `127.0.0.1:<port>` inside the network namespace
/// `netns`. Refuses the caller's own namespace: that would turn the proxy
/// into a way to reach the agent's own loopback services.
pub async fn dial_in_sandbox(netns: &Arc<NetnsHandle>, port: u16) -> io::Result<TcpStream> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let netns = netns.clone();
    std::thread::Builder::new()
        .name(format!("netns-dial-{}", netns.inode()))
        .spawn(move || {
            let _ = tx.send(dial_blocking(&netns, port));
        })?;
    let stream = rx
        .await
        .map_err(|_| io::Error::other("netns dial thread exited without an answer"))??;
    stream.set_nonblocking(true)?;
    let _ = stream.set_nodelay(true);
    TcpStream::from_std(stream)
}

/// Runs on a dedicated thread that exits right after: its network namespace
/// is changed for good.
fn dial_blocking(netns: &NetnsHandle, port: u16) -> io::Result<StdTcpStream> {
    netns.enter()?;
    StdTcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), DIAL_TIMEOUT)
}

/// `/<sandbox id>/<port>[/<rest>]` → (id, port, `/<rest>`).
fn parse_route(path: &str) -> Option<(&str, u16, &str)> {
    let path = path.strip_prefix('/')?;
    let (id, after) = path.split_once('/')?;
    let (port, rest) = match after.find('/') {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, "/"),
    };
    if id.is_empty() || port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    Some((id, port, rest))
}

/// Why the proxy answers a request itself instead of forwarding it; sent
/// as `{"code": …, "message": …}` with the status.
#[derive(Debug)]
struct Rejection {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl Rejection {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    fn into_response(self) -> Response<ProxyBody> {
        let body = serde_json::json!({"code": self.code, "message": self.message}).to_string();
        let mut resp = Response::new(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        );
        *resp.status_mut() = self.status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus
/// any header the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        if keep_upgrade && name == header::UPGRADE {
            continue;
        }
        headers.remove(name);
    }
    for name in [
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
    headers.remove(header::CONNECTION);
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(header::UPGRADE);
    }
}

fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

async fn handle(
    req: Request<Incoming>,
    lookup: Arc<dyn SandboxLookup>,
    peer: SocketAddr,
) -> Result<Response<ProxyBody>, Infallible> {
    Ok(forward(req, lookup, peer)
        .await
        .unwrap_or_else(Rejection::into_response))
}

/// One proxied request: route and authenticate it, rewrite it for the
/// upstream, dial inside the sandbox, send it, and relay the answer (and a
/// protocol upgrade, when the upstream accepts one).
#[tracing::instrument(skip_all, fields(sandbox_id, port))]
async fn forward(
    mut req: Request<Incoming>,
    lookup: Arc<dyn SandboxLookup>,
    peer: SocketAddr,
) -> Result<Response<ProxyBody>, Rejection> {
    let path = req.uri().path().to_owned();
    let Some((sandbox_id, port, rest)) = parse_route(&path) else {
        return Err(Rejection::new(
            StatusCode::BAD_REQUEST,
            "INVALID_ROUTE",
            "path must be /<sandbox id>/<port>/<path inside the sandbox>",
        ));
    };
    let span = tracing::Span::current();
    span.record("sandbox_id", sandbox_id);
    span.record("port", port);
    let route = authorize(&req, lookup.as_ref(), sandbox_id, peer)?;
    let upgrade = wants_upgrade(req.headers());
    let host = route.upstream.host(port);
    rewrite_for_upstream(&mut req, sandbox_id, (port, &host), rest, peer, upgrade)?;
    // Take the client side of a possible upgrade before the request moves on.
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let mut resp = send_upstream(req, &route.upstream, sandbox_id, port).await?;
    let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if switched {
        let Some(client_upgrade) = client_upgrade else {
            return Err(Rejection::new(
                StatusCode::BAD_GATEWAY,
                "UPSTREAM_FAILED",
                "upstream switched protocols without being asked",
            ));
        };
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(relay_upgraded(
            client_upgrade,
            upstream_upgrade,
            sandbox_id.to_string(),
        ));
    }
    strip_hop_by_hop(resp.headers_mut(), switched);
    Ok(resp.map(|b| b.boxed()))
}

/// The sandbox's route, if the request carries exactly one token header
/// and it is the sandbox's token. A missing token is refused before the
/// sandbox table is consulted.
fn authorize(
    req: &Request<Incoming>,
    lookup: &dyn SandboxLookup,
    sandbox_id: &str,
    peer: SocketAddr,
) -> Result<Route, Rejection> {
    let unauthorized = |msg: &str| Rejection::new(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", msg);
    let tokens: Vec<&HeaderValue> = req.headers().get_all(TOKEN_HEADER).iter().collect();
    let presented = match tokens.as_slice() {
        [one] => one.as_bytes(),
        [] => return Err(unauthorized("missing X-Sandbolt-Access-Token header")),
        _ => return Err(unauthorized("more than one X-Sandbolt-Access-Token header")),
    };
    let Some(route) = lookup.lookup(sandbox_id) else {
        return Err(Rejection::new(
            StatusCode::NOT_FOUND,
            "SANDBOX_NOT_FOUND",
            format!("sandbox {sandbox_id:?} is not on this node"),
        ));
    };
    if !digest_matches(presented, &route.token_sha256) {
        tracing::info!(sandbox_id, %peer, "proxy request with a wrong access token");
        return Err(unauthorized("invalid access token"));
    }
    Ok(route)
}

/// Points the request at `rest` inside the sandbox: drops the token and the
/// hop-by-hop headers, sets `Host` to the upstream and adds the
/// `X-Forwarded-*` headers.
fn rewrite_for_upstream(
    req: &mut Request<Incoming>,
    sandbox_id: &str,
    (port, host): (u16, &str),
    rest: &str,
    peer: SocketAddr,
    upgrade: bool,
) -> Result<(), Rejection> {
    let invalid = |msg: &str| Rejection::new(StatusCode::BAD_REQUEST, "INVALID_ROUTE", msg);
    let upstream_uri: Uri = match req.uri().query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_string(),
    }
    .parse()
    .map_err(|_| invalid("path is not a valid request target"))?;
    let prefix = HeaderValue::from_str(&format!("/{sandbox_id}/{port}"))
        .map_err(|_| invalid("sandbox id is not a valid header value"))?;
    let original_host = req.headers().get(header::HOST).cloned();

    let headers = req.headers_mut();
    headers.remove(TOKEN_HEADER);
    strip_hop_by_hop(headers, upgrade);
    headers.insert(header::HOST, HeaderValue::from_str(host).expect("ascii"));
    if let Some(h) = original_host {
        headers.insert("x-forwarded-host", h);
    }
    headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    headers.insert("x-forwarded-prefix", prefix);
    let xff = match headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {}", peer.ip()),
        None => peer.ip().to_string(),
    };
    headers.insert(
        "x-forwarded-for",
        HeaderValue::from_str(&xff).expect("ip addresses are ascii"),
    );
    *req.uri_mut() = upstream_uri;
    Ok(())
}

/// Dials `port` inside the sandbox and sends the request over a fresh
/// HTTP/1 connection (kept alive for an upgrade).
async fn send_upstream(
    req: Request<Incoming>,
    upstream: &Upstream,
    sandbox_id: &str,
    port: u16,
) -> Result<Response<Incoming>, Rejection> {
    let unavailable =
        |msg: String| Rejection::new(StatusCode::BAD_GATEWAY, "UPSTREAM_UNAVAILABLE", msg);
    let stream = dial(upstream, port).await.map_err(|e| {
        tracing::debug!(error = %e, "dial inside sandbox failed");
        unavailable(if e.kind() == io::ErrorKind::ConnectionRefused {
            format!("nothing is listening on port {port} in sandbox {sandbox_id:?}")
        } else {
            format!("cannot connect to port {port} in sandbox {sandbox_id:?}: {e}")
        })
    })?;
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unavailable(format!("upstream handshake failed: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    sender.send_request(req).await.map_err(|e| {
        Rejection::new(
            StatusCode::BAD_GATEWAY,
            "UPSTREAM_FAILED",
            format!("upstream request failed: {e}"),
        )
    })
}

/// Copies bytes both ways between the two upgraded connections until either
/// side closes.
async fn relay_upgraded(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    sandbox: String,
) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(pair) => pair,
        Err(e) => {
            tracing::debug!(sandbox, error = %e, "upgrade did not complete");
            return;
        }
    };
    let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((up, down)) => tracing::debug!(sandbox, up, down, "upgraded stream closed"),
        Err(e) => tracing::debug!(sandbox, error = %e, "upgraded stream ended with an error"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            parse_route("/sb-1/8080/api/x"),
            Some(("sb-1", 8080, "/api/x"))
        );
        assert_eq!(parse_route("/sb-1/8080/"), Some(("sb-1", 8080, "/")));
        assert_eq!(parse_route("/sb-1/8080"), Some(("sb-1", 8080, "/")));
        assert_eq!(
            parse_route("/sb-1/44772/a//b/"),
            Some(("sb-1", 44772, "/a//b/"))
        );
        for bad in [
            "/",
            "",
            "/sb-1",
            "/sb-1/",
            "//8080/x",
            "/sb-1/0/x",
            "/sb-1/65536/x",
            "/sb-1/-1/x",
            "/sb-1/+80/x",
            "/sb-1/80a/x",
            "/sb-1//x",
        ] {
            assert_eq!(parse_route(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tokens() {
        let expected = sandbolt_proto::auth::token_digest(b"secret");
        assert!(digest_matches(b"secret", &expected));
        assert!(!digest_matches(b"secreT", &expected));
        assert!(!digest_matches(b"", &expected));
    }

    #[test]
    fn hop_by_hop() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        let mut plain = h.clone();
        strip_hop_by_hop(&mut plain, false);
        assert_eq!(plain.len(), 1);
        assert!(plain.contains_key("x-kept"));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h.get(header::UPGRADE).unwrap(), "websocket");
        assert_eq!(h.get(header::CONNECTION).unwrap(), "upgrade");
        assert!(!h.contains_key("x-private"));
    }

    #[tokio::test]
    async fn dials_inside_the_handles_namespace() {
        let ns = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            std::fs::File::open("/proc/thread-self/ns/net").unwrap()
        })
        .join()
        .unwrap();
        let ns = NetnsHandle::from_file(ns).unwrap();
        // A port that listens in the agent's namespace is not reached:
        // loopback is down in the fresh namespace.
        let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = host.local_addr().unwrap().port();
        let err = dial_in_sandbox(&Arc::new(ns), port).await.unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    }
}
