//! What `sandbolt janitor` (and `sandbolt up`) pass in.

use std::path::PathBuf;
use std::time::Duration;

/// Points where a test can freeze the janitor in the middle of a cleanup so
/// that it can be `kill -9`ed there (`SANDBOLT_JANITOR_FAILPOINT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// The task and the container are gone; snapshot, log file and the
    /// report to the controller are not done yet.
    AfterContainerDelete,
}

pub const FAILPOINT_ENV: &str = "SANDBOLT_JANITOR_FAILPOINT";

impl Failpoint {
    pub fn from_env() -> Option<Self> {
        match std::env::var(FAILPOINT_ENV).ok()?.as_str() {
            "after-container-delete" => Some(Self::AfterContainerDelete),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::AfterContainerDelete => "after-container-delete",
        }
    }
}

#[derive(Debug, Clone)]
pub struct JanitorConfig {
    /// This node's name (sent to the controller with every report).
    pub node_name: String,
    pub containerd_socket: PathBuf,
    /// The agent's containerd namespace.
    pub containerd_namespace: String,
    /// The agent's snapshotter.
    pub snapshotter: String,
    /// Controller RegistryService endpoint, e.g. `http://127.0.0.1:9090`.
    pub controller_endpoint: String,
    /// CA (PEM) of a controller serving TLS; the endpoint is then https://.
    pub controller_ca: Option<PathBuf>,
    /// The agent (bootstrap) token: ownership queries carry it; reap
    /// reports carry the reaped agent's credential, read from
    /// `agent_state_dir` or enrolled for with this token.
    pub token: String,
    /// Time between periodic scans.
    pub interval: Duration,
    /// How often the janitor asks the controller about agents between scans
    /// (a lost agent or a restarted one triggers a scan at once).
    pub agent_poll_interval: Duration,
    /// Nothing younger than this (by the container's created-at label, or
    /// containerd's creation time, whichever is later) is ever touched. It
    /// backs up the in-flight fence (see `rules`); keep it above the
    /// controller's fast-mode commit deadline.
    pub grace_period: Duration,
    /// The agent's state dir: its per-sandbox logs live in `<dir>/logs/`.
    /// `None`: log files are not cleaned up.
    pub agent_state_dir: Option<PathBuf>,
    /// The agent keeps log files of deleted sandboxes: then so does the janitor.
    pub keep_logs: bool,
    /// Where the janitor keeps its journal of cleanups in progress.
    pub state_dir: PathBuf,
    /// Deadline of one controller call.
    pub rpc_timeout: Duration,
    /// Test hook, see [`Failpoint`].
    pub failpoint: Option<Failpoint>,
}

impl JanitorConfig {
    pub fn new(
        node_name: impl Into<String>,
        containerd_socket: impl Into<PathBuf>,
        controller_endpoint: impl Into<String>,
        token: impl Into<String>,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            node_name: node_name.into(),
            containerd_socket: containerd_socket.into(),
            containerd_namespace: "k8s.io".into(),
            snapshotter: "overlayfs".into(),
            controller_endpoint: controller_endpoint.into(),
            controller_ca: None,
            token: token.into(),
            interval: Duration::from_secs(30),
            agent_poll_interval: Duration::from_secs(2),
            grace_period: Duration::from_secs(90),
            agent_state_dir: None,
            keep_logs: false,
            state_dir: state_dir.into(),
            rpc_timeout: Duration::from_secs(5),
            failpoint: Failpoint::from_env(),
        }
    }

    pub fn logs_dir(&self) -> Option<PathBuf> {
        self.agent_state_dir.as_ref().map(|d| d.join("logs"))
    }
}
