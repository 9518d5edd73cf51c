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

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common;

use common::{AgentFlags, JanitorFlags, NodeFlags, execd_via_proxy};
use sandbolt_janitor::{ControllerOwnership, KeepReason, OwnershipSource};
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_test_support::{Proc, eventually_async, free_port};
use sandbolt_testbed::Testbed;
use tonic::transport::Channel;

const NS: &str = "k8s.io";
const TOKEN: &str = "agent-outage-token";
const NODE: &str = "node-outage";
const AGENT: &str = "outage-agent";
/// The outage the issue names.
const OUTAGE: Duration = Duration::from_secs(60);
/// What the janitor logs before it removes a container.
const REAPING: &str = "reaping orphaned sandbox";

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
        common::ownership(&self.endpoint(), TOKEN)
    }

    async fn fastpath(&self) -> FastPathServiceClient<Channel> {
        common::fastpath(&self.endpoint()).await
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
        let proxy = format!("127.0.0.1:{}", free_port());
        AgentFlags {
            id: AGENT,
            on_node: NodeFlags::new(NODE, NS, self.endpoint(), TOKEN),
            proxy_listen: &proxy,
            state_dir: &self.dir.path().join("agent"),
            pool: None,
        }
        .apply(&mut cmd, &self.bed);
        let n = std::fs::read_dir(self.dir.path()).unwrap().count();
        self.agent = Some(Proc::spawn(
            "agent",
            &mut cmd,
            self.dir.path().join(format!("agent-{n}.log")),
        ));
    }

    async fn wait_agent_alive(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.agent_alive().await != Some(true) {
            self.agent.as_mut().unwrap().assert_running();
            self.controller.as_mut().unwrap().assert_running();
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

/// One request to sandbox `name`'s execd through the agent's proxy.
async fn execd(env: &Env, name: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    execd_via_proxy(&mut env.fastpath().await, name, method, path, body).await
}

/// Task status of every container in [`NS`]: id → (pid, status).
fn tasks(bed: &Testbed) -> std::collections::BTreeMap<String, (u32, String)> {
    bed.tasks(NS).expect("ctr tasks ls")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_60s_agent_outage_kills_no_sandbox_and_loses_no_file() {
    let bed = tokio::task::spawn_blocking(|| {
        Testbed::start_with_busybox(NS).expect("test bed (private containerd) with busybox")
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
    env.controller = Some(Proc::spawn(
        "controller",
        &mut cmd,
        env.dir.path().join("controller.log"),
    ));
    env.start_agent();
    env.wait_agent_alive().await;

    let mut cmd = sandbolt();
    JanitorFlags {
        on_node: NodeFlags::new(NODE, NS, env.endpoint(), TOKEN),
        agent_state_dir: &env.dir.path().join("agent"),
        state_dir: &env.dir.path().join("janitor"),
    }
    .apply(
        &mut cmd,
        &env.bed,
        &[
            "--interval",
            "2s",
            "--grace-period",
            "1s",
            "--agent-poll-interval",
            "500ms",
        ],
    );
    env.janitor = Some(Proc::spawn(
        "janitor",
        &mut cmd,
        env.dir.path().join("janitor.log"),
    ));

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
    eventually_async(
        "the controller to notice the outage",
        Duration::from_secs(20),
        || async { (env.agent_alive().await == Some(false)).then_some(()) },
    )
    .await;
    let scans_before = env
        .janitor
        .as_ref()
        .unwrap()
        .output()
        .matches("janitor scan")
        .count();
    while started.elapsed() < OUTAGE {
        env.controller.as_mut().unwrap().assert_running();
        env.janitor.as_mut().unwrap().assert_running();
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
        // Sampled for the whole outage: what is checked is that nothing
        // happens in 60 s, so there is no condition to wait for.
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
