//! `kill -9` of the agent process, then a new agent process on the same
//! containerd manages the old sandboxes (status from labels + tasks, exits
//! that happened while no agent ran, delete).
//!
//! A custom harness: this binary is both the test and, when
//! `SANDBOLT_AGENT_CHILD` is set, the agent process the test kills.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::*;
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_proto::agent::v1::{SandboxPhase, SandboxRef};

const CHILD_ENV: &str = "SANDBOLT_AGENT_CHILD";

fn main() {
    if let Ok(args) = std::env::var(CHILD_ENV) {
        run_child(&args);
        return;
    }
    // `cargo test -- --list` and filters: this file holds exactly one test.
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        // nextest also lists `--ignored` tests: this one is not ignored.
        if !args.iter().any(|a| a == "--ignored") {
            println!("agent_kill_9_recovery: test");
        }
        return;
    }
    if let Some(filter) = args.iter().skip(1).find(|a| !a.starts_with('-'))
        && !"agent_kill_9_recovery".contains(filter.as_str())
    {
        return;
    }
    println!("running agent_kill_9_recovery");
    scenario();
    println!("test agent_kill_9_recovery ... ok");
}

/// Child mode: start an agent and serve until killed.
fn run_child(args: &str) {
    let v: serde_json::Value = serde_json::from_str(args).expect("child args");
    let s = |k: &str| v[k].as_str().unwrap().to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        init_tracing();
        let mut cfg = AgentConfig::new(s("agent_id"), s("socket"), s("execd"), s("state"), TOKEN);
        cfg.stop_grace_period = Duration::from_secs(1);
        let agent = Agent::start(cfg).await.expect("child agent starts");
        let addr_file = PathBuf::from(s("addr_file"));
        std::fs::write(
            addr_file.with_extension("tmp"),
            agent.grpc_addr().to_string(),
        )
        .unwrap();
        std::fs::rename(addr_file.with_extension("tmp"), &addr_file).unwrap();
        std::future::pending::<()>().await;
    });
}

/// Kills the child on drop, so a failing assertion leaves no agent behind.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_agent(socket: &Path, state: &Path, addr_file: &Path) -> ChildGuard {
    let _ = std::fs::remove_file(addr_file);
    let args = serde_json::json!({
        "agent_id": "agent-recover",
        "socket": socket,
        "execd": sandbolt_testbed::execd_binary().expect("execd"),
        "state": state,
        "addr_file": addr_file,
    });
    let child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, args.to_string())
        .spawn()
        .expect("spawn agent child");
    ChildGuard(child)
}

fn wait_addr(addr_file: &Path, child: &mut ChildGuard) -> std::net::SocketAddr {
    eventually_blocking("the agent child to come up", WAIT, || {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("agent child exited early: {status}");
        }
        std::fs::read_to_string(addr_file).ok()
    })
    .parse()
    .unwrap()
}

fn scenario() {
    let bed = bed();
    let state = tempfile::tempdir().unwrap();
    let addr_file = state.path().join("agent.addr");
    let rt = tokio::runtime::Runtime::new().unwrap();

    let mut first = spawn_agent(bed.containerd_socket(), state.path(), &addr_file);
    let addr = wait_addr(&addr_file, &mut first);
    let (pid, created_at, exits_pid) = rt.block_on(async {
        let mut c = client(addr, TOKEN).await;
        let mut s = spec("sb-survivor", &["sh", "-c", "echo up; exec sleep 1000"]);
        s.record_uid = "uid-survivor".into();
        s.exposed_ports = vec![8080];
        let st = c
            .create_sandbox(create_req(s))
            .await
            .expect("create survivor")
            .into_inner()
            .status
            .unwrap();
        // Exits while no agent is running (the agent is killed first).
        let exits = c
            .create_sandbox(create_req(spec(
                "sb-exits",
                &["sh", "-c", "sleep 3; exit 5"],
            )))
            .await
            .expect("create exits")
            .into_inner()
            .status
            .unwrap();
        (st.pid, st.created_at_unix_ms, exits.pid)
    });

    // kill -9 (SIGKILL): no cleanup code of the agent runs.
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    drop(first);
    let tasks =
        String::from_utf8(bed.ctr(NS).args(["tasks", "list"]).output().unwrap().stdout).unwrap();
    assert!(
        tasks
            .lines()
            .any(|l| l.starts_with("sb-survivor") && l.contains("RUNNING")),
        "the sandbox outlives its agent: {tasks}"
    );
    // sb-exits exits while no agent listens to events.
    eventually_blocking("sb-exits to exit", WAIT, || {
        process_gone(exits_pid).then_some(())
    });

    let mut second = spawn_agent(bed.containerd_socket(), state.path(), &addr_file);
    let addr = wait_addr(&addr_file, &mut second);
    rt.block_on(async {
        let mut c = client(addr, TOKEN).await;
        let st = c
            .get_sandbox(SandboxRef {
                sandbox_id: "sb-survivor".into(),
            })
            .await
            .expect("recovered sandbox is known")
            .into_inner();
        assert_eq!(st.phase(), SandboxPhase::Running, "{st:?}");
        assert_eq!(st.pid, pid);
        assert_eq!(st.created_at_unix_ms, created_at);
        assert_eq!(st.record_uid, "uid-survivor");
        assert_eq!(st.name, "name-sb-survivor");
        assert_eq!(st.image, "docker.io/library/busybox:latest");
        assert_eq!(st.exposed_ports, vec![8080]);
        let exited = c
            .get_sandbox(SandboxRef {
                sandbox_id: "sb-exits".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(exited.phase(), SandboxPhase::Failed, "{exited:?}");
        assert_eq!(exited.exit_code, 5);

        for id in ["sb-survivor", "sb-exits"] {
            let existed = delete(&mut c, id, 500).await;
            assert!(existed, "{id}");
            assert_eq!(leftovers_in(&bed, state.path(), id), Vec::<String>::new());
        }
    });
    drop(second);
}
