//! sandbolt execd: the daemon inside every sandbox, speaking the OpenSandbox execd API
//! (`shared/contracts/opensandbox/execd-api.yaml`).
//!
//! * [`run`] is the whole daemon (what the `execd` binary calls): it serves the API and,
//!   with [`Config::init`], acts as PID 1 — starts the user's entrypoint, forwards
//!   signals to it, reaps every zombie, and optionally exits with the entrypoint.
//! * [`Server`] binds and serves the API on an existing Tokio runtime (tests, embedding).
//! * [`router`] is the bare axum router over an [`AppState`], for in-process tests.
//!
//! # Warm mode (`--warm`)
//!
//! A warm sandbox is started before anyone asked for it: execd runs without an
//! entrypoint, serving the API with an agent-only token, until the agent hands the sandbox
//! to a request with `POST /sandbolt/claim` (a sandbolt route, deliberately outside `/v1`
//! and the OpenSandbox paths). It requires the current token and takes
//!
//! ```json
//! {"accessToken": "<new>", "env": ["K=V", ...], "command": ["prog", "arg", ...], "workingDir": "/abs"}
//! ```
//!
//! `env` is the whole environment (what a cold start would have given execd itself,
//! `EXECD_ACCESS_TOKEN` included and, as there, kept from user processes); `workingDir`
//! is optional. At once the old token stops working, `env` becomes the base environment
//! of the entrypoint and of every later command and session, `workingDir` becomes
//! execd's (so every later command's default) working directory, and `command` is
//! started exactly as a cold `-- ENTRYPOINT` is (signals forwarded,
//! `--exit-with-entrypoint` honoured). Answers: 200 `{"pid": N}`; 409 `NOT_WARM` /
//! `ALREADY_CLAIMED` (exactly one claim ever succeeds); 400 `INVALID_REQUEST_BODY` naming
//! the field; 401 without the current token; 500 `SPAWN_FAILED` when the entrypoint
//! cannot be started, after which execd exits as a cold start would (127 for a missing
//! program, 126 otherwise, with `--exit-with-entrypoint`).

mod claim;
mod commands;
mod drain;
mod error;
mod extract;
mod files;
mod init;
mod metrics;
mod process;
#[cfg(test)]
mod prop_tests;
mod proxy;
mod server;
mod session;
mod sse;
mod state;
mod util;

use std::ffi::OsString;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

pub use error::{ApiError, ExecdError};
pub use init::run;
pub use server::{ACCESS_TOKEN_HEADER, router};
pub use state::{AppState, StateConfig};

/// The OpenSandbox execd port. execd links no sandbolt crate (it is a small static
/// binary), so this is its own copy of `sandbolt_proto::wire::EXECD_PORT`;
/// `tests/tests/wire_constants.rs` holds the two equal.
pub const PORT: u16 = 44772;
/// Default API address (all interfaces, [`PORT`]).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:44772";
/// Where `--init` points `EXECD_ENVS` when the environment does not set it.
pub const DEFAULT_ENV_FILE: &str = "/opt/sandbolt/.env";

/// Daemon configuration (see the `execd` binary's `--help`).
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    /// Required `X-EXECD-ACCESS-TOKEN`; `None` leaves the API open.
    pub access_token: Option<String>,
    /// Act as PID 1: reap every child, forward signals to the entrypoint.
    pub init: bool,
    /// Exit with the entrypoint's status when it exits.
    pub exit_with_entrypoint: bool,
    /// The user's entrypoint (program and arguments); empty for none.
    pub entrypoint: Vec<OsString>,
    /// Warm mode: no entrypoint yet; `POST /sandbolt/claim` brings it (with a new token,
    /// environment and working directory). Excludes `entrypoint`.
    pub warm: bool,
    /// Environment for user processes; `None` takes execd's own (minus its secrets).
    pub env: Option<Vec<(OsString, OsString)>>,
    /// `EXECD_ENVS` file; `None` takes the `EXECD_ENVS` variable.
    pub env_file: Option<PathBuf>,
    /// Connection cap and header-read timeout of the API's listener.
    pub limits: ConnLimits,
}

/// What one client may hold of execd's listener. execd is reachable by
/// everything inside its sandbox and, through the agent's proxy, from
/// outside; without a cap and a head timeout, clients that open
/// connections and never finish a request would pile up until execd runs
/// out of descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once; more are accepted and closed at once.
    pub max_connections: usize,
    /// A request head (the first, and each next one on a kept-alive
    /// connection) must be complete within this; it is also how long an idle
    /// kept-alive connection stays open.
    pub header_read_timeout: std::time::Duration,
}

impl ConnLimits {
    /// Default cap on open connections.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
    /// Default header-read (and keep-alive idle) timeout.
    pub const DEFAULT_HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: Self::DEFAULT_HEADER_READ_TIMEOUT,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN.parse().expect("valid default address"),
            access_token: None,
            init: false,
            exit_with_entrypoint: false,
            entrypoint: Vec::new(),
            warm: false,
            env: None,
            env_file: None,
            limits: ConnLimits::default(),
        }
    }
}

impl Config {
    /// The state configuration this daemon configuration implies.
    pub fn state_config(&self) -> StateConfig {
        let mut sc = StateConfig::from_env(self.access_token.clone());
        if let Some(env) = &self.env {
            sc.base_env = env
                .iter()
                .filter(|(k, _)| !state::PRIVATE_ENV.iter().any(|p| k == p))
                .cloned()
                .collect();
        }
        if let Some(f) = &self.env_file {
            sc.env_file = Some(f.clone());
        }
        if self.init && sc.env_file.is_none() {
            sc.env_file = Some(PathBuf::from(DEFAULT_ENV_FILE));
        }
        sc.export_env_file();
        sc
    }
}

/// A bound API server on the current Tokio runtime.
pub struct Server {
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: ConnLimits,
}

impl Server {
    /// Binds `config.listen` with a fresh [`AppState`].
    pub async fn bind(config: &Config) -> Result<Server, ExecdError> {
        let state = AppState::new(config.state_config());
        Ok(Self::bind_with_state(config.listen, state)
            .await?
            .with_limits(config.limits))
    }

    pub async fn bind_with_state(addr: SocketAddr, state: AppState) -> Result<Server, ExecdError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ExecdError::Bind {
                addr: addr.to_string(),
                source,
            })?;
        Ok(Server {
            listener,
            state,
            limits: ConnLimits::default(),
        })
    }

    /// Serves under `limits` instead of the defaults.
    pub fn with_limits(mut self, limits: ConnLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` resolves, then until every open connection has finished
    /// its current answer (bound the wait if connections may stay busy).
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let router = router(self.state.clone());
        server::serve(self.listener, router, self.limits, shutdown).await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn default_listen_is_on_the_execd_port() {
        let addr: std::net::SocketAddr = super::DEFAULT_LISTEN.parse().unwrap();
        assert_eq!(addr.port(), super::PORT);
    }
}
