//! Real components for the controller's tests: a private containerd (the
//! test bed) with busybox imported into `k8s.io`, real agents
//! (`sandbolt_agent::Agent`) bind-mounting the static execd, containers
//! counted through containerd itself, and a minimal HTTP/1.1 client for the
//! agents' data-plane proxy.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_proto::fastpath::v2;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// containerd namespace of the agents (and of the imported busybox).
pub const NS: &str = "k8s.io";

pub type V2 = v2::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A private containerd with busybox in [`NS`].
pub async fn start_bed() -> Testbed {
    init_tracing();
    tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed (private containerd) must start");
        bed.import_image(&busybox_image().expect("busybox image"), NS)
            .expect("import busybox");
        bed
    })
    .await
    .unwrap()
}

/// A real agent on `bed` that heartbeats to the controller at `controller`.
/// `token` is both its API token and the one it presents to the controller.
pub async fn start_agent(
    bed: &Testbed,
    id: &str,
    state: &Path,
    controller: SocketAddr,
    token: &str,
    capacity: u32,
    heartbeat: Duration,
) -> AgentHandle {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(id, bed.containerd_socket(), execd, state, token);
    cfg.controller_endpoint = Some(format!("http://{controller}"));
    cfg.controller_token = Some(token.into());
    cfg.heartbeat_interval = heartbeat;
    cfg.stop_grace_period = Duration::from_secs(1);
    cfg.max_sandboxes = capacity;
    Agent::start(cfg).await.expect("agent starts")
}

/// Container ids in [`NS`], as containerd lists them (`ctr containers ls -q`).
pub async fn containers(bed: &Testbed) -> Vec<String> {
    let mut cmd = bed.ctr(NS);
    cmd.args(["containers", "ls", "-q"]);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("run ctr containers ls");
    assert!(
        out.status.success(),
        "ctr containers ls: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    ids.sort();
    ids
}

/// Every task in [`NS`] as `ctr tasks ls` shows it: id → (pid, status).
pub async fn tasks(bed: &Testbed) -> BTreeMap<String, (u32, String)> {
    let mut cmd = bed.ctr(NS);
    cmd.args(["tasks", "ls"]);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("run ctr tasks ls");
    assert!(
        out.status.success(),
        "ctr tasks ls: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 3).then(|| {
                (
                    cols[0].to_string(),
                    (cols[1].parse().unwrap_or(0), cols[2].to_string()),
                )
            })
        })
        .collect()
}

/// Tasks containerd reports as RUNNING in [`NS`]: id → pid.
pub async fn running_tasks(bed: &Testbed) -> BTreeMap<String, u32> {
    tasks(bed)
        .await
        .into_iter()
        .filter(|(_, (_, status))| status == "RUNNING")
        .map(|(id, (pid, _))| (id, pid))
        .collect()
}

/// Waits until the controller's `default` pool counts `n` ready agents.
pub async fn wait_agents(c: &V2, n: i32) {
    let c = c.clone();
    eventually(
        &format!("{n} agent(s) ready"),
        Duration::from_secs(30),
        || {
            let mut c = c.clone();
            async move {
                c.get_pool(v2::GetPoolRequest::default())
                    .await
                    .is_ok_and(|p| p.into_inner().ready_fastlets == n)
            }
        },
    )
    .await;
}

/// Polls `f` every 50 ms until it holds; panics after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// GET through an agent's data-plane proxy; `endpoint` is `host:port/route`
/// as FastPath returns it (no scheme). Returns (status, body).
pub async fn http_get(endpoint: &str, path: &str, headers: &[(String, String)]) -> (u16, String) {
    let (host, prefix) = endpoint.split_once('/').expect("endpoint host/path");
    let mut s = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connect to agent proxy {host}: {e}"));
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

pub fn reference(name: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    })
}

/// ResolveEndpoint (execd's port) and `GET /ping` through the returned proxy
/// endpoint with the returned headers. Returns (proxy endpoint, status).
pub async fn ping_execd(c: &mut V2, name: &str) -> (String, u16) {
    let ep = c
        .resolve_endpoint(v2::ResolveEndpointRequest {
            sandbox: reference(name),
            target: Some(v2::EndpointTarget {
                target: Some(v2::endpoint_target::Target::Port(44772)),
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("resolve endpoint of {name}: {e:?}"))
        .into_inner();
    let headers: Vec<(String, String)> = ep.required_headers.into_iter().collect();
    let (status, _) = http_get(&ep.proxy_endpoint, "/ping", &headers).await;
    (ep.proxy_endpoint, status)
}

/// The sandbox id (= containerd container id) the controller's record of
/// `name` points at, from GetSandboxDiagnostics.
pub async fn sandbox_id(c: &mut V2, name: &str) -> String {
    c.get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
        sandbox_name: name.into(),
        namespace: "default".into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("diagnostics of {name}: {e:?}"))
    .into_inner()
    .runtime_instance_id
}

/// A free TCP port on 127.0.0.1 (bound, then released), so a controller
/// child can be restarted on the same address the agents heartbeat to.
pub fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}
