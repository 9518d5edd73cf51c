//! Slow clients against every HTTP listener a stranger can reach before any
//! credential is checked: the lifecycle REST API, the agent's data-plane
//! proxy and execd (issue 21, "timeouts and caps").
//!
//! A real controller and a real agent (on the test bed's containerd), a
//! lifecycle on the controller backend and an execd server, each with short
//! limits. 1,000 connections that send half a request line and then nothing
//! must not stop the server from answering a normal request, and the server
//! must close them after its header-read timeout. A listener at its
//! connection cap must close a new connection at once, and serve again once
//! connections are gone.
//!
//! Before these limits, none of the three closed a silent connection (execd
//! after 30 s, longer than these tests wait) and none had a cap.

use std::net::SocketAddr;
use std::time::Duration;

use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_e2e::bed::{agent_config, eventually, start_bed};
use sandbolt_lifecycle::{BackendConfig, ControllerConfig as LifecycleBackend, Lifecycle};
use sandbolt_lifecycle::{LifecycleConfig, LifecycleHandle, ListenerLimits};
use sandbolt_testbed::Testbed;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

const AGENT_TOKEN: &str = "slowloris-agent-token";
const FASTPATH_TOKEN: &str = "slowloris-fastpath-token";
const API_KEY: &str = "slowloris-api-key";
const EXECD_TOKEN: &str = "slowloris-execd-token";
/// Idle connections held against each listener.
const SLOW_CLIENTS: usize = 1_000;
/// How long a closed connection may take to be noticed as closed: far more
/// than the header-read timeout under test, far less than execd's old 30 s.
const CLOSE_DEADLINE: Duration = Duration::from_secs(20);

/// One listener under test: where it is and the request that must keep
/// answering (a request line, headers, blank line).
struct Target {
    name: &'static str,
    addr: SocketAddr,
    request: String,
}

/// Controller + agent on the bed, a lifecycle before the controller, an
/// execd server: every one with `limits`.
struct Stack {
    _bed: Testbed,
    _dirs: Vec<tempfile::TempDir>,
    controller: ControllerHandle,
    agent: sandbolt_agent::AgentHandle,
    lifecycle: LifecycleHandle,
    execd: SocketAddr,
    stop_execd: Option<oneshot::Sender<()>>,
}

impl Stack {
    async fn start(limits: ListenerLimits) -> Self {
        raise_fd_limit();
        let bed = start_bed().await;
        let (data, state, lifecycle_dir) = (tempdir(), tempdir(), tempdir());
        let mut cfg =
            ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), AGENT_TOKEN);
        cfg.fastpath_token = Some(FASTPATH_TOKEN.into());
        cfg.listener_limits = limits;
        let controller = Controller::start(cfg).await.expect("controller starts");
        let mut cfg = agent_config(
            &bed,
            "agent-slowloris",
            state.path(),
            controller.local_addr(),
            AGENT_TOKEN,
        );
        cfg.listener_limits = limits;
        let agent = sandbolt_agent::Agent::start(cfg)
            .await
            .expect("agent starts");
        let mut backend = LifecycleBackend::new(format!("http://{}", controller.local_addr()));
        backend.token = Some(FASTPATH_TOKEN.into());
        let mut cfg = LifecycleConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::Controller(backend),
            lifecycle_dir.path(),
        );
        cfg.api_key = Some(API_KEY.into());
        cfg.listener = limits;
        let lifecycle = Lifecycle::start(cfg).await.expect("lifecycle starts");
        let (execd, stop_execd) = start_execd(&limits).await;
        Self {
            _bed: bed,
            _dirs: vec![data, state, lifecycle_dir],
            controller,
            agent,
            lifecycle,
            execd,
            stop_execd: Some(stop_execd),
        }
    }

    fn targets(&self) -> Vec<Target> {
        let get = |path: &str, header: &str| {
            format!("GET {path} HTTP/1.1\r\nHost: test\r\n{header}Connection: close\r\n\r\n")
        };
        vec![
            Target {
                name: "lifecycle",
                addr: self.lifecycle.addr(),
                request: get("/health", ""),
            },
            Target {
                // No token: the proxy's own refusal (401), which is all a
                // stranger gets from it.
                name: "agent proxy",
                addr: self.agent.proxy_addr(),
                request: get("/no-such-sandbox/44772/ping", ""),
            },
            Target {
                name: "execd",
                addr: self.execd,
                request: get("/ping", &format!("X-EXECD-ACCESS-TOKEN: {EXECD_TOKEN}\r\n")),
            },
        ]
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop_execd.take() {
            let _ = stop.send(());
        }
        let _ = self.lifecycle.shutdown().await;
        self.agent.shutdown().await;
        self.controller.shutdown().await;
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// 1,000 client sockets plus the servers' 1,000 in one process: more than
/// the common default soft limit of 1,024 descriptors.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let want = hard.min(16_384);
    if soft < want {
        setrlimit(Resource::RLIMIT_NOFILE, want, hard).expect("setrlimit");
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    assert!(
        soft >= 4 * SLOW_CLIENTS as u64,
        "RLIMIT_NOFILE {soft} is too low for {SLOW_CLIENTS} slow clients"
    );
}

async fn start_execd(limits: &ListenerLimits) -> (SocketAddr, oneshot::Sender<()>) {
    let config = sandbolt_execd::Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        access_token: Some(EXECD_TOKEN.into()),
        limits: sandbolt_execd::ConnLimits {
            max_connections: limits.max_connections,
            header_read_timeout: limits.header_read_timeout,
        },
        ..sandbolt_execd::Config::default()
    };
    let server = sandbolt_execd::Server::bind(&config)
        .await
        .expect("execd binds");
    let addr = server.local_addr().expect("execd address");
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    (addr, stop)
}

/// A client that sends half a request line and then nothing.
async fn slow_client(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"GET /hea")
        .await
        .expect("half a request line");
    stream
}

/// Sends `request` on a new connection and returns the status code.
async fn status_of(target: &Target) -> Result<u16, String> {
    let mut stream = TcpStream::connect(target.addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .write_all(target.request.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut head = Vec::new();
    let read = tokio::time::timeout(CLOSE_DEADLINE, stream.read_to_end(&mut head)).await;
    match read {
        Err(_) => return Err("no answer".into()),
        Ok(Err(e)) => return Err(format!("read: {e}")),
        Ok(Ok(_)) => {}
    }
    let head = String::from_utf8_lossy(&head);
    head.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {head:?}"))
}

/// `Ok(bytes it answered first)` if the server closed `stream` (EOF or
/// reset) within `deadline`, `Err(())` if it is still open.
async fn closed_by_server(stream: &mut TcpStream, deadline: Duration) -> Result<usize, ()> {
    let mut buf = Vec::new();
    match tokio::time::timeout(deadline, stream.read_to_end(&mut buf)).await {
        Ok(_) => Ok(buf.len()),
        Err(_) => Err(()),
    }
}

fn expected_status(target: &Target) -> u16 {
    if target.name == "agent proxy" {
        401
    } else {
        200
    }
}

/// 1,000 half-sent requests against `which`: a normal request still
/// answers, and the server closes all 1,000 after its header-read timeout.
async fn slow_clients_are_closed_and_the_server_answers(which: &str) {
    // Long enough that all 1,000 are open while the normal request runs.
    let limits = ListenerLimits {
        header_read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        ..ListenerLimits::default()
    };
    let stack = Stack::start(limits).await;
    assert!(
        stack.targets().iter().any(|t| t.name == which),
        "no target {which}"
    );
    for target in stack.targets().into_iter().filter(|t| t.name == which) {
        let mut slow = Vec::with_capacity(SLOW_CLIENTS);
        for _ in 0..SLOW_CLIENTS {
            slow.push(slow_client(target.addr).await);
        }
        assert_eq!(
            status_of(&target).await,
            Ok(expected_status(&target)),
            "{}: a normal request answers beside {SLOW_CLIENTS} slow clients",
            target.name
        );
        // One deadline for all: a server that never closes fails the test
        // once, not once per connection.
        let deadline = tokio::time::Instant::now() + limits.header_read_timeout + CLOSE_DEADLINE;
        let mut open = 0;
        for s in &mut slow {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if closed_by_server(s, left).await.is_err() {
                open += 1;
            }
        }
        assert_eq!(
            open, 0,
            "{}: {open} of {SLOW_CLIENTS} slow clients still open {CLOSE_DEADLINE:?} after the header-read timeout",
            target.name
        );
        assert_eq!(
            status_of(&target).await,
            Ok(expected_status(&target)),
            "{}: still answers after closing them",
            target.name
        );
    }
    stack.stop().await;
}

/// `which` at its connection cap closes a new connection at once, keeps the
/// ones it holds, and serves again once they are gone.
async fn at_the_cap_new_connections_are_closed_and_the_server_recovers(which: &str) {
    const CAP: usize = 20;
    // The held connections must outlive the checks: a long head timeout.
    let limits = ListenerLimits {
        max_connections: CAP,
        header_read_timeout: Duration::from_secs(600),
        idle_timeout: Duration::from_secs(600),
        ..ListenerLimits::default()
    };
    let stack = Stack::start(limits).await;
    assert!(
        stack.targets().iter().any(|t| t.name == which),
        "no target {which}"
    );
    for target in stack.targets().into_iter().filter(|t| t.name == which) {
        let mut held = Vec::with_capacity(CAP);
        for _ in 0..CAP {
            held.push(slow_client(target.addr).await);
        }
        // The kernel completes the handshake; the server accepts and closes.
        // Sends nothing: a server that drops unread bytes would reset the
        // connection instead of closing it, and either is a close here.
        let mut over = TcpStream::connect(target.addr).await.expect("connect");
        assert_eq!(
            closed_by_server(&mut over, CLOSE_DEADLINE).await,
            Ok(0),
            "{}: a connection over the cap of {CAP} is closed at once, unanswered",
            target.name
        );
        for (i, s) in held.iter_mut().enumerate().take(3) {
            assert!(
                closed_by_server(s, Duration::from_millis(200))
                    .await
                    .is_err(),
                "{}: held connection {i} stays open (the cap closes only new ones)",
                target.name
            );
        }
        drop(held);
        // The server frees a place when it sees a client's close.
        let what = format!(
            "{} answers again once the held connections are gone",
            target.name
        );
        let want = expected_status(&target);
        eventually(&what, CLOSE_DEADLINE, || async {
            status_of(&target).await == Ok(want)
        })
        .await;
    }
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lifecycle_closes_a_thousand_slow_clients_and_answers() {
    slow_clients_are_closed_and_the_server_answers("lifecycle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_proxy_closes_a_thousand_slow_clients_and_answers() {
    slow_clients_are_closed_and_the_server_answers("agent proxy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn execd_closes_a_thousand_slow_clients_and_answers() {
    slow_clients_are_closed_and_the_server_answers("execd").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lifecycle_at_its_connection_cap_closes_new_ones_and_recovers() {
    at_the_cap_new_connections_are_closed_and_the_server_recovers("lifecycle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_proxy_at_its_connection_cap_closes_new_ones_and_recovers() {
    at_the_cap_new_connections_are_closed_and_the_server_recovers("agent proxy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn execd_at_its_connection_cap_closes_new_ones_and_recovers() {
    at_the_cap_new_connections_are_closed_and_the_server_recovers("execd").await;
}

/// A gRPC client's health check on `addr` (what a probe asks).
async fn grpc_health(addr: SocketAddr) -> Result<i32, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let request = tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    };
    client
        .check(request)
        .await
        .map(|r| r.into_inner().status)
        .map_err(|s| s.to_string())
}

/// 1,000 clients sending half an HTTP/2 preface to the gRPC port `which`
/// (`controller` or `agent`): a health check still answers, and the port
/// closes all 1,000 after the header-read (first-bytes) timeout.
async fn grpc_port_closes_half_prefaces(which: &str) {
    let limits = ListenerLimits {
        header_read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        ..ListenerLimits::default()
    };
    let stack = Stack::start(limits).await;
    let addr = match which {
        "controller" => stack.controller.local_addr(),
        "agent" => stack.agent.grpc_addr(),
        other => panic!("no gRPC port {other}"),
    };
    let mut slow = Vec::with_capacity(SLOW_CLIENTS);
    for _ in 0..SLOW_CLIENTS {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"PRI * HTTP/2.0\r\n")
            .await
            .expect("half a preface");
        slow.push(stream);
    }
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(
        grpc_health(addr).await,
        Ok(serving),
        "{which}: a health check answers beside {SLOW_CLIENTS} slow clients"
    );
    let deadline = tokio::time::Instant::now() + limits.header_read_timeout + CLOSE_DEADLINE;
    let mut open = 0;
    for s in &mut slow {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if closed_by_server(s, left).await.is_err() {
            open += 1;
        }
    }
    assert_eq!(
        open, 0,
        "{which}: {open} of {SLOW_CLIENTS} half prefaces still open {CLOSE_DEADLINE:?} after the timeout"
    );
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_grpc_closes_a_thousand_half_prefaces_and_answers() {
    grpc_port_closes_half_prefaces("controller").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_grpc_closes_a_thousand_half_prefaces_and_answers() {
    grpc_port_closes_half_prefaces("agent").await;
}
