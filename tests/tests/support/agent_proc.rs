//! A real `sandbolt agent` process on a test bed's containerd, for the
//! `kill -9` tests: started, SIGKILLed and started again on the same state
//! directory. Each test adds the flags that make its agent what it needs
//! (controller, network mode, volume backend, capacity).
//!
//! Included with `#[path = "support/agent_proc.rs"] mod agent_proc;`.

#![allow(dead_code)]

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_test_support::{Proc, free_port};
use sandbolt_testbed::Testbed;

/// The `sandbolt agent` process, restartable on the same state. Dropping
/// it SIGKILLs the process (see [`Proc`]).
pub struct AgentProc {
    proc: Option<Proc>,
    agent_id: String,
    node_name: String,
    token: String,
    pub listen: SocketAddr,
    /// Its execd proxy in the current start (a new port each start).
    pub proxy: SocketAddr,
    pub state: PathBuf,
    /// Flags after the common ones (controller, network, volumes...).
    extra_args: Vec<OsString>,
    starts: u32,
}

impl AgentProc {
    /// Not started yet: `agent_id` on node `node_name`, a free port to
    /// listen on, its state under `state`.
    pub fn new(agent_id: &str, node_name: &str, token: &str, state: PathBuf) -> AgentProc {
        AgentProc {
            proc: None,
            agent_id: agent_id.into(),
            node_name: node_name.into(),
            token: token.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], free_port())),
            proxy: SocketAddr::from(([127, 0, 0, 1], 0)),
            state,
            extra_args: Vec::new(),
            starts: 0,
        }
    }

    /// Adds flags to every start's command line.
    pub fn args<I, S>(mut self, args: I) -> AgentProc
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Adds `--controller http://<controller>`: it heartbeats there.
    pub fn controller(self, controller: SocketAddr) -> AgentProc {
        self.args(["--controller".to_string(), format!("http://{controller}")])
    }

    fn command(&self, bed: &Testbed) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_e2e-sandbolt"));
        cmd.arg("agent")
            .args(["--agent-id", &self.agent_id])
            .args(["--node-name", &self.node_name])
            .args(["--token", &self.token])
            .arg("--listen")
            .arg(self.listen.to_string())
            .arg("--proxy-listen")
            .arg(self.proxy.to_string())
            .arg("--containerd-socket")
            .arg(bed.containerd_socket())
            .arg("--execd-bin")
            .arg(sandbolt_testbed::execd_binary().expect("static execd"))
            .arg("--state-dir")
            .arg(&self.state)
            .args(&self.extra_args)
            .env("SANDBOLT_LOG", "sandbolt_agent=debug")
            .env_remove("SANDBOLT_CONTROLLER");
        cmd
    }

    /// Starts it (again), its output in `<agent_id>-<n>.log` next to its
    /// state directory.
    pub fn start(&mut self, bed: &Testbed) {
        self.starts += 1;
        self.proxy = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let log = self
            .state
            .with_file_name(format!("{}-{}.log", self.agent_id, self.starts));
        self.proc = Some(Proc::spawn("agent", &mut self.command(bed), log));
    }

    /// The running process; panics when it is not started.
    pub fn proc_mut(&mut self) -> &mut Proc {
        self.proc.as_mut().expect("the agent is started")
    }

    /// What the current start printed so far.
    pub fn output(&self) -> String {
        self.proc.as_ref().map(Proc::output).unwrap_or_default()
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }

    /// SIGTERM, and waits up to 30 s for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            let status = p.terminate(Duration::from_secs(30));
            eprintln!("the agent stopped: {status}");
        }
    }
}

/// A real controller for such an agent, its store in `dir`, asking for
/// heartbeats every 200 ms so that a restarted agent is seen quickly.
pub async fn start_controller(dir: &Path, token: &str) -> ControllerHandle {
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, token);
    cfg.heartbeat_interval = Duration::from_millis(200);
    Controller::start(cfg).await.expect("controller starts")
}
