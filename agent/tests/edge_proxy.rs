//! The data-plane proxy against real network namespaces.
//!
//! Each test creates a fresh network namespace (`unshare --net sleep`), brings
//! its loopback up, and runs upstream servers *inside* it: a separate
//! `busybox httpd` process (entered with `nsenter`), and in-process servers
//! whose listening sockets were created on a thread that entered the
//! namespace. The servers are unreachable from the host's namespace (checked),
//! so every successful response proves the proxy dialled inside.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use sandbolt_agent::proxy::{self, NetnsHandle, Route, SandboxLookup};
use sandbolt_test_support::{eventually_async, eventually_blocking, free_port};
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const TOKEN: &str = "s3cret-token-of-sb1";

/// A network namespace held open by a `sleep` process; killed on drop.
struct NetNs {
    holder: Child,
    children: Vec<Child>,
}

impl NetNs {
    fn new() -> NetNs {
        let holder = Command::new("unshare")
            .args(["--net", "sleep", "100000"])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn `unshare --net sleep` (needs root and util-linux)");
        let ns = NetNs {
            holder,
            children: Vec::new(),
        };
        // unshare(2) happens after fork: wait until the child's namespace
        // differs from ours before using it.
        let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
        eventually_blocking(
            "the `unshare --net` child in a new network namespace",
            Duration::from_secs(10),
            || {
                let theirs = std::fs::read_link(ns.ns_path()).ok()?;
                // unshare execs sleep after unsharing; wait for the exec so
                // the pid is the long-lived process.
                let exe = std::fs::read_link(format!("/proc/{}/exe", ns.pid())).ok()?;
                (theirs != ours && exe.ends_with("sleep")).then_some(())
            },
        );
        ns.nsenter(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    fn pid(&self) -> u32 {
        self.holder.id()
    }

    fn ns_path(&self) -> String {
        format!("/proc/{}/ns/net", self.pid())
    }

    fn nsenter(&self, args: &[&str]) {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.ns_path()))
            .args(args)
            .output()
            .expect("run nsenter");
        assert!(
            out.status.success(),
            "nsenter {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts `busybox httpd` inside the namespace on `port`, serving `dir`.
    fn busybox_httpd(&mut self, port: u16, dir: &Path) {
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.ns_path()))
            .args(["busybox", "httpd", "-f", "-p"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("-h")
            .arg(dir)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn busybox httpd in the namespace");
        self.children.push(child);
    }

    /// A listening socket created inside the namespace (port chosen by the kernel).
    fn listen(&self) -> tokio::net::TcpListener {
        let path = self.ns_path();
        let l = std::thread::spawn(move || {
            let ns = std::fs::File::open(path).unwrap();
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            std::net::TcpListener::bind("127.0.0.1:0").unwrap()
        })
        .join()
        .unwrap();
        l.set_nonblocking(true).unwrap();
        tokio::net::TcpListener::from_std(l).unwrap()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        for c in self
            .children
            .iter_mut()
            .chain(std::iter::once(&mut self.holder))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Table(HashMap<String, Route>);

impl SandboxLookup for Table {
    fn lookup(&self, sandbox_id: &str) -> Option<Route> {
        self.0.get(sandbox_id).cloned()
    }
}

/// A route into the namespace `pid` is in now.
fn route(pid: u32, token: &str) -> Route {
    Route {
        upstream: proxy::Upstream::Namespace(Arc::new(
            NetnsHandle::of_process(pid).expect("open the namespace"),
        )),
        token_sha256: Sha256::digest(token.as_bytes()).into(),
    }
}

/// The proxy on an ephemeral port; stopped (and its result checked) on `stop`.
struct Proxy {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), proxy::ProxyError>>,
}

impl Proxy {
    async fn start(routes: Vec<(&str, Route)>) -> Proxy {
        let table = Table(
            routes
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(proxy::serve(listener, Arc::new(table), async move {
            let _ = rx.await;
        }));
        Proxy {
            addr,
            stop: Some(tx),
            task,
        }
    }

    async fn stop(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        (&mut self.task)
            .await
            .unwrap()
            .expect("proxy::serve returns Ok after shutdown");
    }

    /// One request on a fresh connection; returns the streaming response.
    async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
    ) -> http::Response<Incoming> {
        let stream = TcpStream::connect(self.addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string());
        if let Some(t) = token {
            req = req.header(proxy::TOKEN_HEADER, t);
        }
        sender
            .send_request(req.body(Empty::<Bytes>::new()).unwrap())
            .await
            .unwrap()
    }

    async fn get(&self, path: &str, token: Option<&str>) -> (StatusCode, String) {
        let resp = self.send("GET", path, token).await;
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

/// Host-namespace connect to 127.0.0.1:port must be refused.
async fn assert_unreachable_from_host(port: u16) {
    let err = TcpStream::connect(("127.0.0.1", port)).await.expect_err(
        "the server inside the namespace must not be reachable from the host namespace",
    );
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
}

/// Waits until something listens on `port` inside the namespace.
async fn wait_listening(pid: u32, port: u16) {
    let what = format!("something listening on port {port} in the namespace of {pid}");
    let netns = Arc::new(NetnsHandle::of_process(pid).expect("open the namespace"));
    eventually_async(&what, Duration::from_secs(10), || {
        let netns = netns.clone();
        async move { proxy::dial_in_sandbox(&netns, port).await.ok().map(drop) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_proxy_http_auth_and_errors() {
    let mut ns = NetNs::new();
    let www = tempfile::tempdir().unwrap();
    std::fs::write(
        www.path().join("hello.txt"),
        "hello from inside the namespace\n",
    )
    .unwrap();
    let port = free_port();
    ns.busybox_httpd(port, www.path());
    wait_listening(ns.pid(), port).await;
    assert_unreachable_from_host(port).await;

    // A sandbox whose processes are gone: its route holds the namespace,
    // in which nothing listens any more.
    let gone = NetNs::new();
    let gone_route = route(gone.pid(), "t");
    drop(gone);

    let proxy = Proxy::start(vec![("sb1", route(ns.pid(), TOKEN)), ("gone", gone_route)]).await;

    // The right token reaches the server in the namespace; the query is kept.
    let (status, body) = proxy
        .get(&format!("/sb1/{port}/hello.txt?x=1&y=2"), Some(TOKEN))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, "hello from inside the namespace\n");

    // Missing and wrong tokens: 401 with a JSON error.
    for token in [
        None,
        Some("wrong"),
        Some(""),
        Some(&TOKEN[..TOKEN.len() - 1]),
    ] {
        let resp = proxy
            .send("GET", &format!("/sb1/{port}/hello.txt"), token)
            .await;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "token {token:?}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["code"], "UNAUTHORIZED", "{v}");
    }

    // Unknown sandbox: 404.
    let (status, body) = proxy
        .get(&format!("/nope/{port}/hello.txt"), Some(TOKEN))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(body.contains("SANDBOX_NOT_FOUND"), "{body}");

    // Nothing listening on that port inside the namespace: 502. The port is
    // the proxy's own, which *is* listening in the host namespace — so this
    // also proves the proxy does not dial in its own namespace.
    let (status, body) = proxy
        .get(&format!("/sb1/{}/", proxy.addr.port()), Some(TOKEN))
        .await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("nothing is listening"), "{body}");

    // The sandbox's processes are gone: 502, not a hang, a host dial, or
    // the namespace of whatever process has their pid now.
    let (status, body) = proxy.get(&format!("/gone/{port}/"), Some("t")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("nothing is listening"), "{body}");

    // Malformed routes: 400.
    for bad in ["/", "/sb1", "/sb1/notaport/x", "/sb1/0/x"] {
        let (status, _) = proxy.get(bad, Some(TOKEN)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    }

    proxy.stop().await;
}

/// In-process upstream inside the namespace: `/headers` echoes what it
/// received, `/sse` streams events paced by the test, `/upload` counts a
/// streamed request body.
async fn run_http_upstream(listener: tokio::net::TcpListener, pace: mpsc::Receiver<String>) {
    let pace = Arc::new(tokio::sync::Mutex::new(Some(pace)));
    loop {
        let (stream, _) = listener.accept().await.unwrap();
        let pace = pace.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let pace = pace.clone();
                async move {
                    let path = req.uri().path().to_string();
                    let resp: http::Response<
                        http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>,
                    > = match path.as_str() {
                        "/headers" => {
                            let mut lines: Vec<String> = req
                                .headers()
                                .iter()
                                .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap()))
                                .collect();
                            lines.push(format!("uri: {}", req.uri()));
                            http::Response::new(
                                http_body_util::Full::new(Bytes::from(lines.join("\n"))).boxed(),
                            )
                        }
                        "/sse" => {
                            let mut rx = pace.lock().await.take().expect("one /sse request");
                            let stream = async_stream(
                                move |tx: mpsc::Sender<
                                    Result<Frame<Bytes>, std::convert::Infallible>,
                                >| async move {
                                    while let Some(event) = rx.recv().await {
                                        if tx
                                            .send(Ok(Frame::data(Bytes::from(format!(
                                                "data: {event}\n\n"
                                            )))))
                                            .await
                                            .is_err()
                                        {
                                            break;
                                        }
                                    }
                                },
                            );
                            http::Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(BodyExt::boxed(StreamBody::new(stream)))
                                .unwrap()
                        }
                        "/upload" => {
                            let mut body = req.into_body();
                            let mut total = 0usize;
                            while let Some(frame) = body.frame().await {
                                if let Ok(d) = frame.unwrap().into_data() {
                                    total += d.len();
                                }
                            }
                            http::Response::new(
                                http_body_util::Full::new(Bytes::from(total.to_string())).boxed(),
                            )
                        }
                        _ => http::Response::builder()
                            .status(404)
                            .body(http_body_util::Full::new(Bytes::new()).boxed())
                            .unwrap(),
                    };
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// A body stream fed by a producer task.
fn async_stream<T, F, Fut>(producer: F) -> tokio_stream::wrappers::ReceiverStream<T>
where
    T: Send + 'static,
    F: FnOnce(mpsc::Sender<T>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(producer(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_proxy_headers_streaming_and_upload() {
    let ns = NetNs::new();
    let listener = ns.listen();
    let port = listener.local_addr().unwrap().port();
    let (pace_tx, pace_rx) = mpsc::channel::<String>(1);
    let upstream = tokio::spawn(run_http_upstream(listener, pace_rx));
    assert_unreachable_from_host(port).await;
    let proxy = Proxy::start(vec![("sb1", route(ns.pid(), TOKEN))]).await;

    // What the upstream sees: no token, path and query rewritten, forwarded headers.
    let (status, seen) = proxy
        .get(&format!("/sb1/{port}/headers?a=1&b=%20x"), Some(TOKEN))
        .await;
    assert_eq!(status, StatusCode::OK, "{seen}");
    assert!(
        !seen
            .to_ascii_lowercase()
            .contains("x-sandbolt-access-token"),
        "token leaked upstream:\n{seen}"
    );
    assert!(!seen.contains(TOKEN), "token leaked upstream:\n{seen}");
    assert!(seen.contains("uri: /headers?a=1&b=%20x"), "{seen}");
    assert!(seen.contains(&format!("host: 127.0.0.1:{port}")), "{seen}");
    assert!(
        seen.contains(&format!("x-forwarded-prefix: /sb1/{port}")),
        "{seen}"
    );
    assert!(seen.contains("x-forwarded-for: 127.0.0.1"), "{seen}");

    // SSE: each event arrives before the upstream is even told to produce
    // the next one, so nothing on the way buffers.
    let resp = proxy
        .send("GET", &format!("/sb1/{port}/sse"), Some(TOKEN))
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    for i in 0..5 {
        pace_tx.send(format!("event-{i}")).await.unwrap();
        let frame = body.frame().await.expect("stream still open").unwrap();
        assert_eq!(
            frame.into_data().unwrap(),
            Bytes::from(format!("data: event-{i}\n\n"))
        );
    }
    drop(pace_tx);
    assert!(
        body.frame().await.is_none(),
        "stream ends when the upstream ends it"
    );

    // A streamed (chunked) request body of 4 MiB reaches the upstream whole.
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let chunks = futures::stream::iter((0..64).map(|_| {
        Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(vec![7u8; 64 * 1024])))
    }));
    let req = Request::post(format!("/sb1/{port}/upload"))
        .header(proxy::TOKEN_HEADER, TOKEN)
        .body(StreamBody::new(chunks))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let n = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(n, Bytes::from((64 * 64 * 1024).to_string()));

    proxy.stop().await;
    upstream.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// tungstenite's handshake callback signature returns its large error type.
#[allow(clippy::result_large_err)]
async fn edge_proxy_websocket_echo() {
    let ns = NetNs::new();
    let listener = ns.listen();
    let port = listener.local_addr().unwrap().port();
    assert_unreachable_from_host(port).await;
    // A WebSocket echo server inside the namespace that also records whether
    // the access token reached it.
    let (seen_tx, seen_rx) = oneshot::channel::<bool>();
    let upstream = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut token_seen = None;
        let ws = tokio_tungstenite::accept_hdr_async(
            stream,
            |req: &tokio_tungstenite::tungstenite::handshake::server::Request, resp| {
                token_seen = Some(req.headers().contains_key(proxy::TOKEN_HEADER));
                Ok(resp)
            },
        )
        .await
        .unwrap();
        seen_tx.send(token_seen.unwrap()).unwrap();
        let (mut sink, mut stream) = ws.split();
        while let Some(Ok(msg)) = stream.next().await {
            if msg.is_close() {
                break;
            }
            if msg.is_text() || msg.is_binary() {
                sink.send(msg).await.unwrap();
            }
        }
    });
    let proxy = Proxy::start(vec![("sb1", route(ns.pid(), TOKEN))]).await;

    // Without the token the upgrade is refused.
    let mut req = format!("ws://{}/sb1/{port}/echo", proxy.addr)
        .into_client_request()
        .unwrap();
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let err = tokio_tungstenite::client_async(req.clone(), stream)
        .await
        .unwrap_err();
    match err {
        tokio_tungstenite::tungstenite::Error::Http(resp) => {
            assert_eq!(resp.status(), StatusCode::UNAUTHORIZED)
        }
        other => panic!("expected an HTTP 401, got {other}"),
    }

    req.headers_mut()
        .insert(proxy::TOKEN_HEADER, TOKEN.parse().unwrap());
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(req, stream).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert!(
        !seen_rx.await.unwrap(),
        "the access token must not reach the sandbox"
    );
    for i in 0..10 {
        ws.send(Message::text(format!("ping {i}"))).await.unwrap();
        assert_eq!(
            ws.next().await.unwrap().unwrap(),
            Message::text(format!("ping {i}"))
        );
    }
    let big = vec![0xa5u8; 1 << 20];
    ws.send(Message::binary(big.clone())).await.unwrap();
    assert_eq!(
        ws.next().await.unwrap().unwrap().into_data(),
        Bytes::from(big)
    );
    ws.close(None).await.unwrap();
    upstream.await.unwrap();
    proxy.stop().await;
}
