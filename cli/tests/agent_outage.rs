//! Agent outages kill nothing, with real daemons: `sandbolt controller`,
//! `sandbolt agent` and `sandbolt janitor` processes on the test bed's
//! private containerd. Two sandboxes (MANUAL and AUTO_RECREATE) get a file
//! written through execd; the agent is SIGKILLed and stays away for 60 s
//! while the controller and a scanning janitor run on; then it is started
//! again. Every sandbox is the same sandbox as before (same container, same
//! process, same record) and its file is still there.
//!
//! Only timeouts that are flags are shortened: the controller's lost-agent
//! timeout (5 s, far below the outage) and the janitor's scan interval and
//! grace period (so that it scans the silent agent's sandboxes many times,
//! each one old enough to be reaped if a rule allowed it).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sandbolt_janitor::{ControllerOwnership, KeepReason, OwnershipSource};
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_testbed::Testbed;

const NS: &str = "k8s.io";
const TOKEN: &str = "agent-outage-token";
const NODE: &str = "node-outage";
const AGENT: &str = "outage-agent";
/// The outage the issue names.
const OUTAGE: Duration = Duration::from_secs(60);
/// What the janitor logs before it removes a container.
const REAPING: &str = "reaping orphaned sandbox";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process, SIGKILLed when dropped; its output goes to a file.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(cmd: &mut Command, log: PathBuf) -> Proc {
        let f = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .expect("spawn sandbolt");
        Proc { child, log }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self, what: &str) {
        if let Ok(Some(st)) = self.child.try_wait() {
            panic!("{what} exited ({st}):\n{}", self.output());
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn sandbolt() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    c.env(
        "SANDBOLT_LOG",
        "info,sandbolt_controller=debug,sandbolt_janitor=debug",
    )
    .env_remove("SANDBOLT_CONTROLLER_FAILPOINT")
    .env_remove(sandbolt_janitor::FAILPOINT_ENV)
    .env_remove("KUBERNETES_SERVICE_HOST");
    c
}

struct Env {
    // Field order: processes die before the bed goes.
    agent: Option<Proc>,
    janitor: Option<Proc>,
    controller: Option<Proc>,
    controller_port: u16,
    dir: tempfile::TempDir,
    bed: Testbed,
}

impl Env {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.controller_port)
    }

    fn owner(&self) -> ControllerOwnership {
        ControllerOwnership::new(&self.endpoint(), TOKEN, Duration::from_secs(5)).unwrap()
    }

    async fn fastpath(&self) -> FastPathServiceClient<tonic::transport::Channel> {
        FastPathServiceClient::connect(self.endpoint())
            .await
            .expect("fastpath connects")
    }

    /// Whether the controller counts the agent as heartbeating (`None`:
    /// it does not know the agent).
    async fn agent_alive(&self) -> Option<bool> {
        let r = self.owner().ownership(NODE, &[]).await.ok()?;
        r.agents
            .iter()
            .find(|a| a.agent_id == AGENT)
            .map(|a| a.alive())
    }

    fn start_agent(&mut self) {
        let mut cmd = sandbolt();
        cmd.args([
            "agent",
            "--agent-id",
            AGENT,
            "--node-name",
            NODE,
            "--containerd-namespace",
            NS,
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--proxy-listen",
            &format!("127.0.0.1:{}", free_port()),
            "--token",
            TOKEN,
            "--controller",
            &self.endpoint(),
            "--containerd-socket",
        ])
        .arg(self.bed.containerd_socket())
        .arg("--execd-bin")
        .arg(sandbolt_testbed::execd_binary().expect("static execd"))
        .arg("--state-dir")
        .arg(self.dir.path().join("agent"));
        let n = std::fs::read_dir(self.dir.path()).unwrap().count();
        self.agent = Some(Proc::spawn(
            &mut cmd,
            self.dir.path().join(format!("agent-{n}.log")),
        ));
    }

    async fn wait_agent_alive(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.agent_alive().await != Some(true) {
            self.agent.as_mut().unwrap().assert_running("agent");
            self.controller
                .as_mut()
                .unwrap()
                .assert_running("controller");
            assert!(
                Instant::now() < deadline,
                "the agent never heartbeated:\n{}\ncontroller:\n{}",
                self.agent.as_ref().unwrap().output(),
                self.controller.as_ref().unwrap().output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn reference(name: &str) -> Option<fp::SandboxReference> {
    Some(fp::SandboxReference {
        namespaced_name: Some(fp::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    })
}

/// The record as the controller answers it: (assignment state, sandbox id,
/// assignment attempt).
async fn record(env: &Env, name: &str) -> (String, String, i64) {
    let d = env
        .fastpath()
        .await
        .get_sandbox_diagnostics(fp::SandboxDiagnosticsRequest {
            sandbox_name: name.into(),
            namespace: "default".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("diagnostics of {name}: {e:?}"))
        .into_inner();
    (
        d.assignment_state,
        d.runtime_instance_id,
        d.assignment_attempt,
    )
}

/// One HTTP/1.1 request through the agent's data-plane proxy to the
/// sandbox's execd (ResolveEndpoint gives the route and the headers).
/// Returns (status, body).
async fn execd(env: &Env, name: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ep = env
        .fastpath()
        .await
        .resolve_endpoint(fp::ResolveEndpointRequest {
            sandbox: reference(name),
            target: Some(fp::EndpointTarget {
                target: Some(fp::endpoint_target::Target::ComponentName("execd".into())),
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("resolve endpoint of {name}: {e:?}"))
        .into_inner();
    let (host, prefix) = ep.proxy_endpoint.split_once('/').expect("host/route");
    let mut s = tokio::net::TcpStream::connect(host)
        .await
        .expect("proxy connects");
    let mut req = format!(
        "{method} /{prefix}{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in &ep.required_headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf))
        .await
        .expect("execd answers within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad HTTP answer {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Task status of every container in [`NS`]: id → (pid, status).
fn tasks(bed: &Testbed) -> std::collections::BTreeMap<String, (u32, String)> {
    let out = bed
        .ctr(NS)
        .args(["tasks", "ls"])
        .output()
        .expect("ctr runs");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c.len() >= 3).then(|| (c[0].to_string(), (c[1].parse().unwrap_or(0), c[2].into())))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_60s_agent_outage_kills_no_sandbox_and_loses_no_file() {
    let bed = tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed (private containerd) must start");
        bed.import_image(
            &sandbolt_testbed::busybox_image().expect("busybox image"),
            NS,
        )
        .expect("import busybox");
        bed
    })
    .await
    .unwrap();
    let mut env = Env {
        agent: None,
        janitor: None,
        controller: None,
        controller_port: free_port(),
        dir: tempfile::tempdir().unwrap(),
        bed,
    };

    let mut cmd = sandbolt();
    cmd.args([
        "controller",
        "--listen",
        &format!("127.0.0.1:{}", env.controller_port),
        "--agent-token",
        TOKEN,
        "--agent-lost-timeout",
        "5s",
        "--data-dir",
    ])
    .arg(env.dir.path().join("controller"));
    env.controller = Some(Proc::spawn(&mut cmd, env.dir.path().join("controller.log")));
    env.start_agent();
    env.wait_agent_alive().await;

    let mut cmd = sandbolt();
    cmd.args([
        "janitor",
        "--node-name",
        NODE,
        "--containerd-namespace",
        NS,
        "--controller",
        &env.endpoint(),
        "--token",
        TOKEN,
        "--interval",
        "2s",
        "--grace-period",
        "1s",
        "--agent-poll-interval",
        "500ms",
        "--containerd-socket",
    ])
    .arg(env.bed.containerd_socket())
    .arg("--agent-state-dir")
    .arg(env.dir.path().join("agent"))
    .arg("--state-dir")
    .arg(env.dir.path().join("janitor"));
    env.janitor = Some(Proc::spawn(&mut cmd, env.dir.path().join("janitor.log")));

    // Two sandboxes, one per failure policy, each with a file written
    // through execd.
    let sandboxes = [
        ("manual", fp::FailurePolicy::Manual),
        ("auto", fp::FailurePolicy::AutoRecreate),
    ];
    let mut fastpath = env.fastpath().await;
    for (name, policy) in sandboxes {
        fastpath
            .create_sandbox(fp::CreateSandboxRequest {
                request_id: name.into(),
                image: "busybox".into(),
                command: vec!["sleep".into(), "100000".into()],
                completion: fp::CreateCompletion::Ready as i32,
                failure_policy: policy as i32,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
        let cmd = format!(
            r#"{{"argv": ["sh", "-c", "echo written-before-the-outage-{name} > /outage-marker"]}}"#
        );
        let (status, body) = execd(&env, name, "POST", "/command", &cmd).await;
        assert_eq!(status, 200, "write the file: {body}");
    }
    let marker = |name: &str| format!("written-before-the-outage-{name}\n");
    let mut before = Vec::new();
    for (name, _) in sandboxes {
        let (status, body) =
            execd(&env, name, "GET", "/files/download?path=/outage-marker", "").await;
        assert_eq!(
            (status, body),
            (200, marker(name)),
            "{name}: the file is there"
        );
        let r = record(&env, name).await;
        assert_eq!(r.0, "Assigned", "{name}");
        let pid = tasks(&env.bed)
            .get(&r.1)
            .map(|t| t.0)
            .unwrap_or_else(|| panic!("{name}: no task"));
        before.push((name, r, pid));
    }

    // The outage: the agent is SIGKILLed and stays away for 60 s. All the
    // while the controller must keep the records as they are, the janitor
    // must keep scanning and never reap, and the sandboxes must run on.
    env.agent.as_mut().unwrap().kill9();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(20);
    while env.agent_alive().await != Some(false) {
        assert!(
            Instant::now() < deadline,
            "the controller never noticed the outage"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let scans_before = env
        .janitor
        .as_ref()
        .unwrap()
        .output()
        .matches("janitor scan")
        .count();
    while started.elapsed() < OUTAGE {
        env.controller
            .as_mut()
            .unwrap()
            .assert_running("controller");
        env.janitor.as_mut().unwrap().assert_running("janitor");
        let t = tasks(&env.bed);
        for (name, (_, sid, attempt), pid) in &before {
            assert_eq!(
                t.get(sid),
                Some(&(*pid, "RUNNING".to_string())),
                "{name} after {:?} of outage: {t:?}",
                started.elapsed()
            );
            let now = record(&env, name).await;
            assert_eq!(
                (now.0.as_str(), &now.1, now.2),
                ("Assigned", sid, *attempt),
                "{name} after {:?} of outage",
                started.elapsed()
            );
        }
        assert_eq!(env.agent_alive().await, Some(false), "still away");
        let jlog = env.janitor.as_ref().unwrap().output();
        assert!(!jlog.contains(REAPING), "the janitor reaped:\n{jlog}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let jlog = env.janitor.as_ref().unwrap().output();
    let scans = jlog.matches("janitor scan").count() - scans_before;
    assert!(
        scans >= 10,
        "the janitor must have scanned the silent agent's sandboxes: {scans} scans\n{jlog}"
    );
    // What it thinks of them, asked the same way.
    let facts: Vec<sandbolt_janitor::rules::ContainerFacts> = before
        .iter()
        .map(
            |(name, (_, sid, _), _)| sandbolt_janitor::rules::ContainerFacts {
                sandbox_id: sid.clone(),
                name: name.to_string(),
                namespace: "default".into(),
                agent_id: AGENT.into(),
                created_at_ms: Some(0),
                ..Default::default()
            },
        )
        .collect();
    let report = env
        .owner()
        .ownership(NODE, &facts)
        .await
        .expect("ownership");
    for (f, o) in facts.iter().zip(&report.answers) {
        assert_eq!(
            sandbolt_janitor::rules::evaluate(f, o, report.ready, i64::MAX, Duration::ZERO, None),
            sandbolt_janitor::Verdict::Keep(KeepReason::AgentSilent),
            "{}",
            f.name
        );
    }

    // The agent is back: every sandbox is the one it was, with its file.
    env.start_agent();
    env.wait_agent_alive().await;
    for (name, (state, sid, attempt), pid) in &before {
        let (status, body) =
            execd(&env, name, "GET", "/files/download?path=/outage-marker", "").await;
        assert_eq!(
            (status, body),
            (200, marker(name)),
            "{name}: the file survived"
        );
        assert_eq!(
            &record(&env, name).await,
            &(state.clone(), sid.clone(), *attempt),
            "{name}: nothing to repair"
        );
        assert_eq!(
            tasks(&env.bed).get(sid).map(|t| t.0),
            Some(*pid),
            "{name}: same process"
        );
    }
    let jlog = env.janitor.as_ref().unwrap().output();
    assert!(!jlog.contains(REAPING), "the janitor reaped:\n{jlog}");
}
