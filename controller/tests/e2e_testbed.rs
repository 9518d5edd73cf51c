//! End to end on the test bed: the real controller, the real agent, a
//! private containerd, busybox with execd as PID 1. No stand-ins.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::fastpath::{v1, v2};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

const TOKEN: &str = "e2e-agent-token";
const NS: &str = "k8s.io";

type V2 = v2::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;
type V1 = v1::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;

struct Env {
    agent: Option<AgentHandle>,
    controller: Option<ControllerHandle>,
    _state: tempfile::TempDir,
    _data: tempfile::TempDir,
    _bed: Testbed,
}

impl Env {
    async fn start(mode: Consistency) -> Env {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_test_writer()
            .try_init();
        let bed = tokio::task::spawn_blocking(|| {
            let bed = Testbed::start().expect("test bed (private containerd) must start");
            bed.import_image(&busybox_image().expect("busybox image"), NS)
                .expect("import busybox");
            bed
        })
        .await
        .unwrap();
        let data = tempfile::tempdir().unwrap();
        let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
        cfg.default_consistency = mode;
        cfg.heartbeat_interval = Duration::from_millis(200);
        cfg.expiry_sweep_interval = Duration::from_millis(200);
        cfg.failpoint = None;
        let controller = Controller::start(cfg).await.expect("controller starts");
        let state = tempfile::tempdir().unwrap();
        let agent = start_agent(&bed, state.path(), controller.local_addr()).await;
        let core = controller.core().clone();
        wait("agent registered", || {
            core.registry()
                .agent("agent-e2e")
                .is_some_and(|a| a.heartbeated)
        })
        .await;
        Env {
            agent: Some(agent),
            controller: Some(controller),
            _state: state,
            _data: data,
            _bed: bed,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.controller.as_ref().unwrap().local_addr()
    }

    async fn stop(mut self) {
        if let Some(c) = self.controller.take() {
            c.shutdown().await;
        }
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
    }
}

async fn start_agent(bed: &Testbed, state: &Path, controller: SocketAddr) -> AgentHandle {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new("agent-e2e", bed.containerd_socket(), execd, state, TOKEN);
    cfg.controller_endpoint = Some(format!("http://{controller}"));
    cfg.controller_token = Some(TOKEN.into());
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.stop_grace_period = Duration::from_secs(1);
    cfg.max_sandboxes = 8;
    Agent::start(cfg).await.expect("agent starts")
}

async fn wait<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn reference(name: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    })
}

/// GET through the agent's data-plane proxy; returns (status, body).
async fn http_get(endpoint: &str, path: &str, headers: &[(String, String)]) -> (u16, String) {
    let (host, prefix) = endpoint.split_once('/').expect("endpoint host/path");
    let mut s = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to agent proxy");
    let mut req = format!("GET /{prefix}{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

async fn v2_flow(addr: SocketAddr, name: &str) {
    let mut c = V2::connect(format!("http://{addr}")).await.unwrap();
    let created = c
        .create_sandbox(v2::CreateSandboxRequest {
            request_id: name.into(),
            image: "busybox".into(),
            command: vec!["sleep".into(), "3600".into()],
            expires_at_unix_seconds: now() + 600,
            completion: v2::CreateCompletion::Ready as i32,
            ..Default::default()
        })
        .await
        .expect("v2 create")
        .into_inner();
    let info = created.sandbox.unwrap();
    assert!(info.ready, "{info:?}");
    let got = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference(name),
            expected_generation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        got.sandbox.unwrap().runtime.unwrap().state,
        v2::RuntimeState::Ready as i32
    );
    let ep = c
        .resolve_endpoint(v2::ResolveEndpointRequest {
            sandbox: reference(name),
            target: Some(v2::EndpointTarget {
                target: Some(v2::endpoint_target::Target::Port(44772)),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let headers: Vec<(String, String)> = ep.required_headers.clone().into_iter().collect();
    let (status, _) = http_get(&ep.proxy_endpoint, "/ping", &headers).await;
    assert_eq!(
        status, 200,
        "execd /ping through the agent proxy with the required headers"
    );
    let (status, _) = http_get(&ep.proxy_endpoint, "/ping", &[]).await;
    assert!(
        status == 401 || status == 403,
        "no token must be refused, got {status}"
    );
    let upd = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference(name),
            expected_generation: got.generation,
            update: Some(v2::update_sandbox_request::Update::ExpiresAtUnixSeconds(
                now() + 1200,
            )),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(upd.committed_generation, got.generation + 1);
    c.delete_sandbox(v2::DeleteRequest {
        sandbox: reference(name),
    })
    .await
    .unwrap();
    let e = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference(name),
            expected_generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let (status, _) = http_get(&ep.proxy_endpoint, "/ping", &headers).await;
    assert_ne!(status, 200, "the sandbox is gone");
}

async fn v1_flow(env: &Env, name: &str, mode: v1::ConsistencyMode) {
    let mut c = V1::connect(format!("http://{}", env.addr())).await.unwrap();
    let r = c
        .create_sandbox(v1::CreateRequest {
            image: "docker.io/library/busybox:latest".into(),
            command: vec!["sleep".into(), "3600".into()],
            exposed_ports: vec![44772],
            name: name.into(),
            consistency_mode: mode as i32,
            ..Default::default()
        })
        .await
        .expect("v1 create")
        .into_inner();
    assert_eq!(r.agent_pod, "agent-e2e");
    let info = c
        .get_sandbox(v1::GetRequest {
            sandbox_name: name.into(),
            namespace: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.phase, "Running");
    // v1 carries no token on the wire; the route is the same as v2's.
    let token = env
        .controller
        .as_ref()
        .unwrap()
        .core()
        .store()
        .get("default", name)
        .unwrap()
        .unwrap()
        .access_token;
    let headers = vec![
        ("X-Sandbolt-Access-Token".to_string(), token.clone()),
        ("X-EXECD-ACCESS-TOKEN".to_string(), token),
    ];
    let (status, _) = http_get(&r.endpoints[0], "/ping", &headers).await;
    assert_eq!(status, 200, "v1 endpoint reaches execd");
    // v1: created without expiry (manual); a renew is refused, labels work.
    let e = c
        .update_sandbox(v1::UpdateRequest {
            sandbox_name: name.into(),
            update: Some(v1::update_request::Update::ExpireTimeSeconds(now() + 600)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        c.update_sandbox(v1::UpdateRequest {
            sandbox_name: name.into(),
            labels: [("k".into(), "v".into())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .success
    );
    assert!(
        c.list_sandboxes(v1::ListRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items
            .iter()
            .any(|i| i.sandbox_name == name)
    );
    assert!(
        c.delete_sandbox(v1::DeleteRequest {
            sandbox_name: name.into(),
            namespace: String::new()
        })
        .await
        .unwrap()
        .into_inner()
        .success
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_strong_mode_v2_and_v1() {
    let env = Env::start(Consistency::Strong).await;
    v2_flow(env.addr(), "e2e-strong-v2").await;
    v1_flow(&env, "e2e-strong-v1", v1::ConsistencyMode::Strong).await;
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_fast_mode_v2_and_v1() {
    let env = Env::start(Consistency::Fast).await;
    v2_flow(env.addr(), "e2e-fast-v2").await;
    // FAST (= unset) takes the server default: fast here.
    v1_flow(&env, "e2e-fast-v1", v1::ConsistencyMode::Fast).await;
    env.stop().await;
}
