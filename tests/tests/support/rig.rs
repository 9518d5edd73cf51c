//! The OpenSandbox server 1.1.1 on sandbolt, as an operator would run it
//! (issue 19): the server with `runtime.type = "kubernetes"` talks to an API
//! server (the double, over HTTP through a kubeconfig, with the CRDs of
//! `deploy/crds/` installed), to the controller's open FastPath listener
//! (`--open-fastpath-listen`: gRPC without credentials, since the server has
//! no option for any; the main port keeps its token) and hands out signed
//! routes to sandbolt's fsb gateway (`sandbolt lifecycle --gateway-listen`),
//! which reaches a real agent's sandboxes on the test bed's containerd.
//!
//! Every piece is a real process except the API server double and the agent
//! (in-process, so that a failing test's runtime shutdown stops it and
//! [`sandbolt_e2e::bed::with_network_state`] purges its networking).
//!
//! Included with `#[path = "support/rig.rs"] mod rig;`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::cli::OPEN_FASTPATH_LINE;
use sandbolt_e2e::bed::{agent_config, connect, free_port, test_network, wait_agents};
use sandbolt_e2e::controller_process::ControllerProcess;
use sandbolt_kube_double::ApiDouble;
use sandbolt_test_support::Proc;
use sandbolt_testbed::{Testbed, workspace_root};

/// The server's API key (its `[server] api_key`).
pub const API_KEY: &str = "sandbolt-rig-api-key-0123456789";
/// The namespace the server's fsb provider creates Sandboxes and
/// SandboxTemplates in (`[kubernetes] namespace`).
pub const NAMESPACE: &str = "opensandbox";
/// The agent's pool: the one the server names in every create
/// (`fastpath_resource_pool` of
/// `benches/python/opensandbox-server-kubernetes.toml`).
pub const POOL: &str = "default";
/// The pool's sandbox resources (`GetPool`'s `sandbox_cpu/memory`): the
/// server's image mode (a snapshot restore) accepts only request limits
/// equal to the pool's, and the SDK always sends limits, `cpu 1, memory
/// 2Gi` unless told otherwise. Not the template's (500m, 256Mi), so that a
/// template sandbox's limits show they came from the template.
pub const POOL_CPU: &str = "1";
pub const POOL_MEMORY: &str = "2Gi";
/// The controller's own namespace (its Lease).
const CONTROLLER_NAMESPACE: &str = "sandbolt-system";
const AGENT_TOKEN: &str = "rig-agent-token";
/// The controller's main port token (the gateway's lifecycle presents it).
const FASTPATH_TOKEN: &str = "rig-fastpath-token";
/// The route signing key shared by the server and the gateway, in the
/// server's format (`kid` + base64 of the key bytes).
pub const KEY_ID: &str = "k";
pub const KEY_B64: &str = "c2FuZGJvbHQtcmlnLWdhdGV3YXktc2VjcmV0LTAxMjM=";
/// How long a process may take to start serving.
const SERVING_WITHIN: Duration = Duration::from_secs(60);

/// Everything of the rig, started; dropping it kills the processes.
pub struct Rig {
    pub dir: tempfile::TempDir,
    pub api: ApiDouble,
    pub kubeconfig: PathBuf,
    pub controller: ControllerProcess,
    /// The controller's main port (agents, token-checked).
    pub controller_addr: SocketAddr,
    /// The open (tokenless) FastPath listener the server dials.
    pub fastpath_addr: SocketAddr,
    pub agent: Option<AgentHandle>,
    pub lifecycle: Proc,
    pub gateway_addr: SocketAddr,
    pub server: Proc,
    pub server_addr: SocketAddr,
}

impl Rig {
    /// Starts the API double, the controller, an agent with networking on
    /// `bed` (its state in `state`), the gateway and the server; returns
    /// once each answers.
    pub async fn start(bed: &Testbed, state: &Path) -> Rig {
        let dir = tempfile::tempdir().expect("rig dir");
        let kubeconfig = dir.path().join("kubeconfig");
        let api = start_api_double(&kubeconfig).await;

        let controller_addr = free_port();
        let fastpath_addr = free_port();
        let mut controller = spawn_controller(controller_addr, fastpath_addr, &kubeconfig);
        assert_eq!(
            controller.wait_serving(SERVING_WITHIN),
            Some(controller_addr),
            "the controller serves on {controller_addr}:\n{}",
            controller.output()
        );
        assert!(
            controller
                .output()
                .contains(&format!("{OPEN_FASTPATH_LINE} {fastpath_addr}")),
            "the controller serves open FastPath on {fastpath_addr}:\n{}",
            controller.output()
        );

        let mut cfg = agent_config(bed, "agent-rig", state, controller_addr, AGENT_TOKEN);
        cfg.heartbeat_interval = Duration::from_millis(200);
        cfg.max_sandboxes = 8;
        cfg.pool = POOL.into();
        cfg.pool_default_limits = pool_limits();
        // Networking, so that network policies apply; its DNS proxy
        // forwards nowhere (the rig resolves no names).
        cfg.network = Some(test_network("127.0.0.1:9".parse().unwrap()));
        let agent = Agent::start(cfg).await.expect("agent starts");
        // Through the open listener: the main port wants its token.
        wait_agents(&connect(fastpath_addr).await, 1).await;

        let gateway_addr = free_port();
        let mut lifecycle = spawn_gateway(dir.path(), controller_addr, gateway_addr);
        wait_listening(&mut lifecycle, gateway_addr).await;

        let server_addr = free_port();
        let server = spawn_server(
            dir.path(),
            server_addr,
            &kubeconfig,
            fastpath_addr,
            gateway_addr,
        )
        .await;
        let mut rig = Rig {
            dir,
            api,
            kubeconfig,
            controller,
            controller_addr,
            fastpath_addr,
            agent: Some(agent),
            lifecycle,
            gateway_addr,
            server,
            server_addr,
        };
        rig.wait_server_healthy().await;
        rig
    }

    async fn wait_server_healthy(&mut self) {
        let url = format!("http://{}/health", self.server_addr);
        let http = reqwest::Client::new();
        for _ in 0..(SERVING_WITHIN.as_millis() / 200) {
            self.server.assert_running();
            let ok = http
                .get(&url)
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "the OpenSandbox server did not answer {url}:\n{}",
            self.server.output()
        );
    }

    /// The last `max` characters of each process's log, for a failure.
    pub fn logs(&self, max: usize) -> String {
        format!(
            "--- opensandbox-server ---\n{}\n--- controller ---\n{}\n--- lifecycle (gateway) ---\n{}",
            tail(&self.server.output(), max),
            tail(&self.controller.output(), max),
            tail(&self.lifecycle.output(), max),
        )
    }

    /// Stops the server, the gateway, the agent and the controller, in that
    /// order (graceful stops; the API double last).
    pub async fn stop(mut self) {
        self.server.kill9();
        let status = self.lifecycle.terminate(Duration::from_secs(30));
        eprintln!("the lifecycle (gateway) stopped: {status}");
        if let Some(agent) = self.agent.take() {
            agent.shutdown().await;
        }
        let status = self.controller.stop();
        eprintln!("the controller stopped: {status}");
        self.api.shutdown().await;
    }
}

fn pool_limits() -> sandbolt_agent::config::PoolLimits {
    sandbolt_agent::config::PoolLimits {
        cpu: POOL_CPU.into(),
        memory: POOL_MEMORY.into(),
        pids: 0,
    }
}

/// Until `proc` accepts connections on `addr`; panics with its output when
/// it exits first or does not within [`SERVING_WITHIN`].
async fn wait_listening(proc: &mut Proc, addr: SocketAddr) {
    for _ in 0..(SERVING_WITHIN.as_millis() / 100) {
        proc.assert_running();
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("nothing listens on {addr}:\n{}", proc.output());
}

/// The API server double with sandbolt's CRDs (`deploy/crds/`) installed,
/// nothing else (the kinds the server also lists, `batchsandboxes` and
/// fast-sandbox's `sandboxsnapshots`, answer 404 as on a cluster with only
/// sandbolt; the server reads that as empty), and its kubeconfig at `kubeconfig`, read by kube-rs (`KUBECONFIG`, the
/// controller) and the Python client's `load_kube_config` (the server).
async fn start_api_double(kubeconfig: &Path) -> ApiDouble {
    let api = ApiDouble::start().await;
    let crds = workspace_root().join("deploy/crds");
    let kinds = api
        .register_crds(&crds)
        .unwrap_or_else(|e| panic!("registering {}: {e}", crds.display()));
    assert!(
        kinds.iter().any(|k| k.plural == "sandboxtemplates"),
        "deploy/crds has the SandboxTemplate CRD: {kinds:?}"
    );
    api.write_kubeconfig(kubeconfig)
        .expect("writing the kubeconfig");
    api
}

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_e2e-sandbolt"))
}

/// `sandbolt controller --store kubernetes` on `listen` (token-checked) and
/// `open` (FastPath only, no token), over the double.
fn spawn_controller(listen: SocketAddr, open: SocketAddr, kubeconfig: &Path) -> ControllerProcess {
    // The token key a cluster keeps in a Secret (the data dir is not used).
    let token_key = kubeconfig.with_file_name("token.key");
    std::fs::write(&token_key, "0123456789abcdef0123456789abcdef").unwrap();
    // Likewise the key agents' credentials are minted with.
    let identity_key = kubeconfig.with_file_name("identity.key");
    std::fs::write(&identity_key, "fedcba9876543210fedcba9876543210").unwrap();
    let env = [
        ("SANDBOLT_TOKEN_KEY_FILE", token_key.display().to_string()),
        (
            "SANDBOLT_IDENTITY_KEY_FILE",
            identity_key.display().to_string(),
        ),
        ("SANDBOLT_STORE", "kubernetes".to_string()),
        ("SANDBOLT_POD_NAMESPACE", CONTROLLER_NAMESPACE.to_string()),
        ("SANDBOLT_POD_NAME", "controller-rig".to_string()),
        ("KUBECONFIG", kubeconfig.display().to_string()),
        (
            "SANDBOLT_DATA_DIR",
            "/nonexistent-kube-store-needs-none".to_string(),
        ),
        ("SANDBOLT_FASTPATH_LISTEN", listen.to_string()),
        ("SANDBOLT_FASTPATH_TOKEN", FASTPATH_TOKEN.to_string()),
        ("SANDBOLT_OPEN_FASTPATH_LISTEN", open.to_string()),
        ("SANDBOLT_AGENT_TOKEN", AGENT_TOKEN.to_string()),
        ("SANDBOLT_HEARTBEAT_INTERVAL", "200ms".to_string()),
        ("SANDBOLT_STARTUP_GRACE", "1s".to_string()),
        ("SANDBOLT_AGENT_PRESENCE", "none".to_string()),
        ("SANDBOLT_LOG", "sandbolt_controller=info".to_string()),
    ];
    let mut cmd = ControllerProcess::command(binary(), &env);
    ControllerProcess::spawn(
        "controller",
        &mut cmd,
        kubeconfig.with_file_name("controller.log"),
    )
}

/// `sandbolt lifecycle` on the controller with the fsb gateway on
/// `gateway`, the server's signing key from the environment.
fn spawn_gateway(dir: &Path, controller: SocketAddr, gateway: SocketAddr) -> Proc {
    let mut cmd = Command::new(binary());
    cmd.arg("lifecycle")
        .arg("--listen")
        .arg(free_port().to_string())
        .args(["--api-key", API_KEY])
        .arg("--controller")
        .arg(format!("http://{controller}"))
        .args(["--controller-token", FASTPATH_TOKEN])
        .args(["--controller-namespace", NAMESPACE])
        .arg("--data-dir")
        .arg(dir.join("lifecycle"))
        .arg("--gateway-listen")
        .arg(gateway.to_string())
        .env(
            "OPENSANDBOX_SECURE_ACCESS_KEYS",
            format!("{KEY_ID}={KEY_B64}"),
        )
        .env("SANDBOLT_LOG", "sandbolt_lifecycle=debug");
    Proc::spawn("lifecycle (gateway)", &mut cmd, dir.join("lifecycle.log"))
}

/// The OpenSandbox server's configuration for the rig: the harness's
/// `benches/python/opensandbox-server-kubernetes.toml` (Kubernetes runtime
/// through `kubeconfig`, FastPath at `fastpath`, gateway ingress at
/// `gateway` with header routes signed by [`KEY_ID`]) filled in.
pub fn server_config(
    port: u16,
    db: &Path,
    kubeconfig: &Path,
    fastpath: SocketAddr,
    gateway: SocketAddr,
) -> String {
    let path = workspace_root().join("benches/python/opensandbox-server-kubernetes.toml");
    let mut text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let values = [
        ("port", port.to_string()),
        ("api_key", API_KEY.into()),
        ("log_level", "INFO".into()),
        ("db", db.display().to_string()),
        ("kubeconfig", kubeconfig.display().to_string()),
        ("namespace", NAMESPACE.into()),
        ("fastpath", fastpath.to_string()),
        ("gateway", gateway.to_string()),
        ("key_id", KEY_ID.into()),
        ("key", KEY_B64.into()),
    ];
    for (name, value) in values {
        text = text.replace(&format!("{{{name}}}"), &value);
    }
    assert!(
        !text.contains('{'),
        "{}: unfilled placeholders:\n{text}",
        path.display()
    );
    text
}

async fn spawn_server(
    dir: &Path,
    addr: SocketAddr,
    kubeconfig: &Path,
    fastpath: SocketAddr,
    gateway: SocketAddr,
) -> Proc {
    let exe = tokio::task::spawn_blocking(sandbolt_testbed::opensandbox_server)
        .await
        .expect("server-env.sh does not panic")
        .expect("the OpenSandbox server's venv (benches/python/server-env.sh)");
    let home = dir.join("opensandbox-home");
    std::fs::create_dir_all(&home).unwrap();
    let config = dir.join("opensandbox-server.toml");
    let text = server_config(
        addr.port(),
        &home.join("opensandbox.db"),
        kubeconfig,
        fastpath,
        gateway,
    );
    std::fs::write(&config, text).unwrap();
    let mut cmd = Command::new(exe);
    cmd.arg("--config")
        .arg(&config)
        .current_dir(&home)
        .env("HOME", &home)
        .env_remove("KUBECONFIG")
        .env_remove("SANDBOX_CONFIG_PATH")
        .env_remove("OPENSANDBOX_SECURE_ACCESS_KEYS");
    Proc::spawn(
        "opensandbox-server",
        &mut cmd,
        dir.join("opensandbox-server.log"),
    )
}

/// One step of the SDK run, as `tests/python/opensandbox_server_rig.py`
/// recorded it.
#[derive(Debug, Clone)]
pub struct Step {
    pub step: String,
    /// works | differs | missing
    pub status: String,
    pub detail: String,
}

/// Runs the SDK script against the rig; its steps, in order.
pub async fn run_sdk(rig: &Rig) -> Vec<Step> {
    let python = tokio::task::spawn_blocking(sandbolt_testbed::python)
        .await
        .unwrap()
        .expect("the SDK's venv (scripts/python-env.sh)");
    let script = workspace_root().join("tests/python/opensandbox_server_rig.py");
    let results = rig.dir.path().join("sdk-result.json");
    let log = rig.dir.path().join("sdk.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = tokio::process::Command::new(python)
        .arg(&script)
        .env("RIG_SERVER", rig.server_addr.to_string())
        .env("RIG_API_KEY", API_KEY)
        .env("RIG_IMAGE", sandbolt_testbed::BUSYBOX_REF)
        .env("RIG_POOL_CPU", POOL_CPU)
        .env("RIG_POOL_MEMORY", POOL_MEMORY)
        .env("RIG_GATEWAY", rig.gateway_addr.to_string())
        .env("RIG_KUBE_URL", rig.api.url())
        .env("RIG_KUBE_TOKEN", rig.api.token())
        .env("RIG_RESULTS", &results)
        .stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .kill_on_drop(true)
        .spawn()
        .expect("running the SDK script");
    let status = tokio::time::timeout(Duration::from_secs(900), child.wait())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the SDK script ran over 15 minutes:\n{}",
                tail(&read(&log), 6000)
            )
        })
        .unwrap();
    let sdk_log = read(&log);
    eprintln!("--- SDK script ---\n{}", tail(&sdk_log, 12000));
    assert!(status.success(), "the SDK script failed ({status})");
    let doc: serde_json::Value = serde_json::from_str(&read(&results))
        .unwrap_or_else(|e| panic!("{}: {e}", results.display()));
    doc["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| Step {
            step: s["step"].as_str().unwrap_or_default().to_string(),
            status: s["status"].as_str().unwrap_or_default().to_string(),
            detail: s["detail"].as_str().unwrap_or_default().to_string(),
        })
        .collect()
}

/// The steps as a Markdown table (what the README's table is made from).
pub fn table(steps: &[Step]) -> String {
    let mut out = String::from("| step | result | detail |\n|---|---|---|\n");
    for s in steps {
        let detail = s.detail.replace('|', "\\|").replace('\n', " ");
        out.push_str(&format!("| {} | {} | {} |\n", s.step, s.status, detail));
    }
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub fn tail(text: &str, max: usize) -> String {
    let text = text.trim();
    match text.char_indices().rev().nth(max) {
        Some((i, _)) => format!("…{}", &text[i..]),
        None => text.to_string(),
    }
}
