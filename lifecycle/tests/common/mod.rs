//! Shared set-up of the lifecycle integration tests: a private dockerd (or
//! containerd, with a real controller and agent) from the test bed, the
//! local busybox image, the static execd, and lifecycle servers on either
//! backend. Anything missing fails the test loudly.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_agent::volume_store::{BackendChoice, VolumeStoreConfig};
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::{Controller, ControllerHandle};
use sandbolt_lifecycle::{
    BackendConfig, ControllerConfig, DockerConfig, Lifecycle, LifecycleConfig, LifecycleHandle,
};
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as control;
use sandbolt_test_support::eventually_async;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use serde_json::Value;
use tonic::service::interceptor::InterceptedService;

pub const API_KEY: &str = "sandbolt-test-key-0123456789";
pub const AGENT_TOKEN: &str = "agent-token-for-tests";
/// The token of the controller's port (FastPath and the native API).
pub const CONTROLLER_TOKEN: &str = "controller-token-for-tests";
/// The namespace the test agent's pool serves (`default`, as in `sandbolt
/// up`), distinct from its containerd namespace (`k8s.io`).
pub const POOL_NAMESPACE: &str = "default";
/// containerd namespace of the agent and of the imported busybox.
pub const CONTAINERD_NS: &str = "k8s.io";

pub fn init_tracing() {
    sandbolt_test_support::init_tracing("warn,sandbolt_lifecycle=info");
}

/// A real controller (embedded store) and a real agent on the test bed's
/// private containerd, for lifecycles on the controller backend.
pub struct ControllerEnv {
    pub bed: Testbed,
    pub controller: Option<ControllerHandle>,
    pub agent: Option<AgentHandle>,
    pub image: String,
    pub dirs: tempfile::TempDir,
    /// The agent's only allowed host-path root.
    pub host_root: tempfile::TempDir,
    /// The DNS upstream of a networked agent: a local server answering
    /// [`DNS_ZONE`] only, so nothing a test does resolves through the
    /// outside world.
    pub dns: Option<sandbolt_test_support::dns::StaticDns>,
    /// The agent's volume root (a loop-backed btrfs image the agent mounts
    /// at start), when it has one; unmounted by [`ControllerEnv::stop`] (a
    /// bed dropped after a panic unmounts it too).
    pub volume_root: Option<PathBuf>,
}

/// Size of the agent's loop-backed btrfs volume pool in these tests
/// (sparse: only what is written takes space).
pub const VOLUME_POOL_BYTES: u64 = 1 << 30;

/// What a networked agent's DNS upstream knows: names and their one
/// address (documentation range; nothing ever connects to them).
pub const DNS_ZONE: &[(&str, [u8; 4])] = &[
    ("pkgs.test", [203, 0, 113, 11]),
    ("www.docs.test", [203, 0, 113, 12]),
    ("blocked.docs.test", [203, 0, 113, 13]),
    ("other.test", [203, 0, 113, 14]),
];

/// [`DNS_ZONE`] as `name=address,...` for the python suites.
pub fn dns_zone_env() -> String {
    DNS_ZONE
        .iter()
        .map(|(name, a)| format!("{name}={}", std::net::Ipv4Addr::from(*a)))
        .collect::<Vec<_>>()
        .join(",")
}

/// Starts the controller and one agent holding at most `capacity`
/// sandboxes, and waits until the agent is a ready member of the pool.
pub async fn controller_env(capacity: u32) -> ControllerEnv {
    controller_env_with(capacity, false).await
}

/// [`controller_env`] with sandbox networking on the agent (egress,
/// isolation, policy enforcement) when `networking` is set.
pub async fn controller_env_with(capacity: u32, networking: bool) -> ControllerEnv {
    controller_env_opts(capacity, networking, false).await
}

/// [`controller_env`] whose agent has a volume root for named volumes: a
/// loop-backed btrfs image in the bed's directory.
pub async fn controller_env_with_volumes(capacity: u32) -> ControllerEnv {
    controller_env_opts(capacity, false, true).await
}

async fn controller_env_opts(capacity: u32, networking: bool, volumes: bool) -> ControllerEnv {
    init_tracing();
    let (bed, image) = tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed (private containerd) must start");
        let image = busybox_image().expect("busybox image builds");
        bed.import_image(&image, CONTAINERD_NS)
            .expect("busybox imports");
        (bed, image.reference().to_string())
    })
    .await
    .unwrap();
    let dirs = tempfile::tempdir().unwrap();
    let host_root = tempfile::tempdir().unwrap();

    let mut ccfg = sandbolt_controller::ControllerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        dirs.path().join("controller"),
        AGENT_TOKEN,
    );
    ccfg.fastpath_token = Some(CONTROLLER_TOKEN.into());
    ccfg.heartbeat_interval = Duration::from_millis(200);
    ccfg.expiry_sweep_interval = Duration::from_millis(200);
    let controller = Controller::start(ccfg).await.expect("controller starts");
    let caddr = controller.local_addr();

    let mut acfg = AgentConfig::new(
        "agent-1",
        bed.containerd_socket(),
        execd_binary().expect("static execd"),
        dirs.path().join("agent"),
        AGENT_TOKEN,
    );
    acfg.controller_endpoint = Some(format!("http://{caddr}"));
    acfg.controller_token = Some(AGENT_TOKEN.into());
    acfg.heartbeat_interval = Duration::from_millis(200);
    acfg.stop_grace_period = Duration::from_secs(2);
    acfg.max_sandboxes = capacity;
    acfg.allowed_host_paths = vec![host_root.path().to_path_buf()];
    let dns = networking.then(|| {
        DNS_ZONE
            .iter()
            .fold(
                sandbolt_test_support::dns::StaticDns::builder(),
                |b, (name, a)| b.a(name, [std::net::Ipv4Addr::from(*a)]),
            )
            .start()
    });
    if let Some(dns) = &dns {
        let mut net = sandbolt_agent::config::NetworkConfig::new(vec![dns.addr()]);
        net.pool_size = 2;
        acfg.network = Some(net);
    }
    let volume_root = volumes.then(|| bed.root().join("volume-root"));
    acfg.volumes = volume_root.as_ref().map(|root| VolumeStoreConfig {
        root: root.clone(),
        backend: BackendChoice::Btrfs,
        loop_image: bed.root().join("volumes.btrfs.img"),
        loop_size_bytes: VOLUME_POOL_BYTES,
    });
    let agent = Agent::start(acfg).await.expect("agent starts");
    assert!(
        controller.wait_ready(Duration::from_secs(30)).await,
        "controller never became ready"
    );
    let env = ControllerEnv {
        bed,
        controller: Some(controller),
        agent: Some(agent),
        image,
        dirs,
        host_root,
        dns,
        volume_root,
    };
    env.wait_for_agent().await;
    env
}

impl ControllerEnv {
    pub fn controller_addr(&self) -> SocketAddr {
        self.controller.as_ref().unwrap().local_addr()
    }

    /// The native API client, as any sandbolt client reaches it.
    pub async fn native(&self) -> NativeClient {
        NativeClient::connect(self.controller_addr(), CONTROLLER_TOKEN).await
    }

    /// Waits until the agent's heartbeat has made it a ready member of the
    /// default pool (asked over the native API, as a client would).
    async fn wait_for_agent(&self) {
        let client = self.native().await;
        eventually_async(
            "the agent to join the default pool",
            Duration::from_secs(15),
            || {
                let mut client = client.clone();
                async move {
                    let pool = client.get_pool("default").await.ok()?;
                    (pool.ready_agents > 0).then_some(())
                }
            },
        )
        .await;
    }

    /// A lifecycle configuration on the controller backend, keeping
    /// whatever it would keep in `data_dir` (nothing, is the point).
    pub fn lifecycle_config(&self, data_dir: &Path) -> LifecycleConfig {
        let mut backend = ControllerConfig::new(format!("http://{}", self.controller_addr()));
        backend.token = Some(CONTROLLER_TOKEN.into());
        backend.namespace = POOL_NAMESPACE.into();
        let mut c = LifecycleConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::Controller(backend),
            data_dir,
        );
        c.api_key = Some(API_KEY.into());
        c
    }

    pub async fn lifecycle(&self, data_dir: &Path) -> LifecycleHandle {
        Lifecycle::start(self.lifecycle_config(data_dir))
            .await
            .expect("lifecycle starts on the controller backend")
    }

    /// Runs the pytest file `file` of lifecycle/tests/python against a new
    /// lifecycle on this controller, then stops the lifecycle and this
    /// environment, and only then fails with the suite's panic (if any).
    pub async fn run_sdk_suite(self, file: &'static str) {
        let data = tempfile::tempdir().unwrap();
        let lifecycle = self.lifecycle(data.path()).await;
        let suite = lifecycle_pytest(file, lifecycle.addr(), &self.image, "controller").await;
        lifecycle.shutdown().await.unwrap();
        self.stop().await;
        rethrow(suite);
    }

    pub async fn stop(mut self) {
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
        if let Some(c) = self.controller.take() {
            c.shutdown().await;
        }
        if let Some(root) = self.volume_root.take()
            && let Err(e) = sandbolt_agent::volume_store::unmount_root(&root)
        {
            eprintln!("unmounting the volume root {}: {e}", root.display());
        }
    }
}

/// `sandbolt.control.v1.SandboxService` with the controller's token.
#[derive(Clone)]
pub struct NativeClient {
    client: control::sandbox_service_client::SandboxServiceClient<
        InterceptedService<tonic::transport::Channel, BearerToken>,
    >,
}

impl NativeClient {
    pub async fn connect(addr: SocketAddr, token: &str) -> NativeClient {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("controller answers gRPC");
        NativeClient {
            client: control::sandbox_service_client::SandboxServiceClient::with_interceptor(
                channel,
                BearerToken::new(token).unwrap(),
            ),
        }
    }

    pub async fn get_pool(&mut self, name: &str) -> Result<control::Pool, tonic::Status> {
        let r = control::GetPoolRequest { name: name.into() };
        self.client.get_pool(r).await.map(|r| r.into_inner())
    }

    pub async fn get(&mut self, name: &str) -> Result<control::Sandbox, tonic::Status> {
        let r = control::GetSandboxRequest {
            sandbox: Some(control::SandboxRef {
                namespace: POOL_NAMESPACE.into(),
                name: name.into(),
                expected_uid: String::new(),
            }),
        };
        self.client.get_sandbox(r).await.map(|r| r.into_inner())
    }
}

/// One REST call with the API key: status and JSON body (`Null` if empty).
pub async fn call(
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
) -> (reqwest::StatusCode, Value) {
    let (status, _, v) = call_as(method, url, Some(API_KEY), body).await;
    (status, v)
}

/// One refused REST call: method, path under the lifecycle's base, body,
/// and the status and error `code` it must answer.
pub type Refusal = (
    reqwest::Method,
    String,
    Option<Value>,
    reqwest::StatusCode,
    &'static str,
);

/// Panics unless every call of `refusals` to the lifecycle at `base`
/// answers its status and error code.
pub async fn assert_refusals(base: &str, refusals: Vec<Refusal>) {
    for (method, path, body, status, code) in refusals {
        let (s, v) = call(method.clone(), format!("{base}{path}"), body).await;
        assert_eq!(
            (s, v["code"].as_str()),
            (status, Some(code)),
            "{method} {path}: {v}"
        );
    }
}

/// One REST call sending `key` (none when `None`): status, headers and JSON body
/// (`Null` if empty, a string if not JSON).
pub async fn call_as(
    method: reqwest::Method,
    url: String,
    key: Option<&str>,
    body: Option<Value>,
) -> (reqwest::StatusCode, reqwest::header::HeaderMap, Value) {
    let mut rb = reqwest::Client::new().request(method, url);
    if let Some(k) = key {
        rb = rb.header("OPEN-SANDBOX-API-KEY", k);
    }
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let r = rb.send().await.expect("request reaches the server");
    let status = r.status();
    let headers = r.headers().clone();
    let text = r.text().await.unwrap();
    let v = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    (status, headers, v)
}

/// What one command run through execd answered: stdout, stderr, and the
/// error frame's message when it did not exit 0.
#[derive(Debug, Default)]
pub struct CommandOutput {
    pub stdout: String,
    pub stderr: String,
    pub error: Option<String>,
}

/// Runs `command` (through `sh -c`) in a sandbox: resolves execd's endpoint
/// through the lifecycle at `base` (as the SDK does) and calls `/command`.
pub async fn sh(base: &str, id: &str, command: &str) -> CommandOutput {
    let (s, ep) = call(
        reqwest::Method::GET,
        format!("{base}/v1/sandboxes/{id}/endpoints/44772"),
        None,
    )
    .await;
    assert_eq!(s, reqwest::StatusCode::OK, "{ep}");
    let endpoint = ep["endpoint"].as_str().expect("endpoint");
    let with_headers = |mut rb: reqwest::RequestBuilder| {
        if let Some(h) = ep["headers"].as_object() {
            for (k, v) in h {
                rb = rb.header(k, v.as_str().unwrap());
            }
        }
        rb
    };
    // A sandbox just created may not serve yet (the Docker backend answers
    // once the container runs; its port proxy accepts and drops until
    // execd listens): wait for /ping first, as the SDK does.
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let ping = with_headers(client.get(format!("http://{endpoint}/ping")))
            .send()
            .await;
        match ping {
            Ok(r) if r.status().is_success() => break,
            other if std::time::Instant::now() > deadline => {
                panic!("execd of {id} does not answer /ping: {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let r = with_headers(client.post(format!("http://{endpoint}/command")))
        .json(&serde_json::json!({ "command": command }))
        .send()
        .await
        .expect("execd answers");
    assert!(
        r.status().is_success(),
        "execd refused {command:?}: {}",
        r.status()
    );
    let body = r.text().await.unwrap();
    let mut out = CommandOutput::default();
    // execd streams bare JSON frames separated by blank lines.
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        let v: Value = serde_json::from_str(frame)
            .unwrap_or_else(|e| panic!("bad execd frame {frame:?}: {e}"));
        match v["type"].as_str() {
            Some("stdout") => out.stdout.push_str(v["text"].as_str().unwrap_or("")),
            Some("stderr") => out.stderr.push_str(v["text"].as_str().unwrap_or("")),
            Some("error") => out.error = Some(v.to_string()),
            _ => {}
        }
    }
    out
}

pub struct DockerEnv {
    pub bed: Testbed,
    pub image: String,
    pub execd: PathBuf,
    pub data: tempfile::TempDir,
    /// The only prefix host volumes may use.
    pub host_root: tempfile::TempDir,
}

pub fn docker_env() -> DockerEnv {
    let bed = Testbed::start_with_docker().expect("test bed with dockerd must start");
    let image = busybox_image().expect("busybox image builds");
    bed.docker_load(&image).expect("busybox loads into dockerd");
    let execd = execd_binary().expect("static execd builds");
    DockerEnv {
        image: image.reference().to_string(),
        bed,
        execd,
        data: tempfile::tempdir().unwrap(),
        host_root: tempfile::tempdir().unwrap(),
    }
}

impl DockerEnv {
    pub fn socket(&self) -> &Path {
        self.bed.docker_socket().expect("bed started with docker")
    }

    /// The sandbox network's subnet, unique per bed (so parallel test
    /// processes never collide): the bed's bridge 10.213.X.0/24 becomes
    /// 10.214.X.0/24.
    pub fn sandbox_subnet(&self) -> String {
        let bridge = self.bed.docker_bridge().expect("bed started with docker");
        let out = Command::new("ip")
            .args(["-4", "-o", "addr", "show", "dev", bridge])
            .output()
            .expect("ip runs");
        let text = String::from_utf8_lossy(&out.stdout);
        let third = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("10.213."))
            .and_then(|rest| rest.split('.').next())
            .unwrap_or_else(|| panic!("bed bridge {bridge} has no 10.213.X address: {text}"));
        format!("10.214.{third}.0/24")
    }

    /// The sandbox network's bridge on this bed's engine.
    pub fn sandbox_bridge(&self) -> String {
        self.engine_bridge()
            .expect("docker info gives the engine ID")
    }

    fn engine_bridge(&self) -> Option<String> {
        let out = Command::new("docker")
            .args([
                "-H",
                &format!("unix://{}", self.socket().display()),
                "info",
                "--format",
                "{{.ID}}\n{{.DockerRootDir}}",
            ])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (id, root) = text.trim().split_once('\n')?;
        (!id.is_empty()).then(|| sandbolt_lifecycle::docker_network::bridge_name(id, root))
    }

    pub fn config(&self) -> LifecycleConfig {
        let mut docker = DockerConfig::new(self.socket(), &self.execd);
        docker.network_subnet = Some(self.sandbox_subnet());
        let mut c = LifecycleConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::Docker(docker),
            self.data.path(),
        );
        c.api_key = Some(API_KEY.into());
        c.allow_host_paths = vec![self.host_root.path().to_path_buf()];
        c.sweep_interval = Duration::from_millis(500);
        c
    }

    pub async fn start(&self) -> LifecycleHandle {
        Lifecycle::start(self.config())
            .await
            .expect("lifecycle starts on the docker backend")
    }

    /// `docker inspect` of the container of sandbox `id`, as the engine
    /// reports it.
    pub fn inspect(&self, id: &str) -> Value {
        let out = Command::new("docker")
            .args([
                "-H",
                &format!("unix://{}", self.socket().display()),
                "inspect",
                &format!("sandbox-{id}"),
            ])
            .output()
            .expect("docker CLI runs");
        let v: Value = serde_json::from_slice(&out.stdout).expect("docker inspect answers JSON");
        v[0].clone()
    }
}

impl Drop for DockerEnv {
    /// The sandbox network's bridge outlives dockerd and the isolation
    /// tables outlive the lifecycle: both go here, before the bed stops.
    fn drop(&mut self) {
        let Some(bridge) = self.engine_bridge() else {
            eprintln!("dockerd gave no engine ID: sandbox network left to the bed");
            return;
        };
        let host = format!("unix://{}", self.socket().display());
        let ids = Command::new("docker")
            .args(["-H", &host, "ps", "-aq"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for id in ids.split_whitespace() {
            let _ = Command::new("docker")
                .args(["-H", &host, "rm", "-f", "-v", id])
                .output();
        }
        let _ = Command::new("docker")
            .args(["-H", &host, "network", "rm", "sandbolt"])
            .output();
        if Path::new("/sys/class/net").join(&bridge).exists() {
            let _ = Command::new("ip").args(["link", "del", &bridge]).output();
        }
        if let Err(e) = sandbolt_lifecycle::docker_network::remove_isolation(&bridge) {
            eprintln!("removing the isolation tables of {bridge}: {e}");
        }
    }
}

/// Runs one pytest file of tests/python against a lifecycle server and
/// panics with pytest's output unless every test passed.
pub fn run_pytest(
    file: &str,
    addr: SocketAddr,
    image: &str,
    backend: &str,
    host_root: Option<&Path>,
) {
    run_pytest_env(file, addr, image, backend, host_root, &[]);
}

/// [`run_pytest`] off the async workers (pytest blocks for minutes).
pub async fn pytest(
    file: &'static str,
    addr: SocketAddr,
    image: &str,
    backend: &'static str,
    host_root: Option<PathBuf>,
) {
    let image = image.to_string();
    tokio::task::spawn_blocking(move || {
        run_pytest(file, addr, &image, backend, host_root.as_deref())
    })
    .await
    .unwrap();
}

/// [`run_pytest`] with extra environment variables for the test file.
pub fn run_pytest_env(
    file: &str,
    addr: SocketAddr,
    image: &str,
    backend: &str,
    host_root: Option<&Path>,
    extra_env: &[(&str, &str)],
) {
    let python =
        sandbolt_testbed::python().expect("the repo's venv python (scripts/python-env.sh)");
    let path = sandbolt_testbed::workspace_root()
        .join("tests/python")
        .join(file);
    assert!(path.is_file(), "missing {}", path.display());
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-x"])
        .arg(&path)
        .env("LIFECYCLE_DOMAIN", addr.to_string())
        .env("LIFECYCLE_API_KEY", API_KEY)
        .env("SANDBOLT_IMAGE", image)
        .env("SANDBOLT_BACKEND", backend);
    if let Some(h) = host_root {
        cmd.env("SANDBOLT_HOST_ROOT", h);
    }
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("pytest runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "pytest {file} failed:\n{text}");
}

/// [`run_lifecycle_pytest`] off the async workers; the suite's panic is
/// handed back (see [`rethrow`]) so the caller can stop its servers first.
pub async fn lifecycle_pytest(
    file: &'static str,
    addr: SocketAddr,
    image: &str,
    backend: &'static str,
) -> Result<(), tokio::task::JoinError> {
    let image = image.to_string();
    tokio::task::spawn_blocking(move || run_lifecycle_pytest(file, addr, &image, backend)).await
}

/// Fails the test with the panic of a suite run by [`lifecycle_pytest`].
pub fn rethrow(suite: Result<(), tokio::task::JoinError>) {
    if let Err(panic) = suite {
        std::panic::resume_unwind(panic.into_panic());
    }
}

/// Runs one pytest file of lifecycle/tests/python (with tests/python on
/// the import path, for `lifecycle_env`) against a lifecycle server and
/// panics with pytest's output unless every test passed. Blocking.
pub fn run_lifecycle_pytest(file: &str, addr: SocketAddr, image: &str, backend: &str) {
    let python =
        sandbolt_testbed::python().expect("the repo's venv python (scripts/python-env.sh)");
    let root = sandbolt_testbed::workspace_root();
    let path = root.join("lifecycle/tests/python").join(file);
    assert!(path.is_file(), "missing {}", path.display());
    let out = Command::new(python)
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-x"])
        .arg(&path)
        .env("PYTHONPATH", root.join("tests/python"))
        .env("LIFECYCLE_DOMAIN", addr.to_string())
        .env("LIFECYCLE_API_KEY", API_KEY)
        .env("SANDBOLT_IMAGE", image)
        .env("SANDBOLT_BACKEND", backend)
        .output()
        .expect("pytest runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "pytest {file} failed:\n{text}");
}
