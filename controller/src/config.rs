//! Controller configuration. The CLI (`sandbolt controller`, `sandbolt up`)
//! fills it; every field has a default that suits a single machine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::store::Consistency;

/// Default of [`ControllerConfig::agent_gone_timeout`]: long enough for a
/// node's agent pod to be replaced (image pull included) without its
/// sandboxes being given up.
pub const DEFAULT_AGENT_GONE_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// One gRPC port: fastpath.v2, fastpath.v1 and sandbolt's RegistryService.
    /// Port 0 picks a free one (see `ControllerHandle::local_addr`).
    pub listen: SocketAddr,
    /// Holds `controller.redb`.
    pub data_dir: PathBuf,
    /// Used when a request does not ask for a mode (v2 never does; v1's
    /// enum cannot say "unset" apart from FAST, see `fastpath::v1`).
    pub default_consistency: Consistency,
    /// The bootstrap secret: it authorizes `RegistryService.Enroll`, which
    /// hands an agent its own credential (see [`crate::identity`]); every
    /// other agent call needs that credential. Required.
    pub agent_token: String,
    /// When set, FastPath calls must carry `authorization: Bearer <token>`.
    /// `None` runs the port open (bind it to a private address): the
    /// OpenSandbox server's client uses an insecure channel with no token.
    pub fastpath_token: Option<String>,
    /// A second port serving only FastPath v1 + v2 (and health), with no
    /// token and no TLS, for a client that can present neither: the
    /// OpenSandbox server's FastPath client opens a plaintext channel and
    /// sends no credentials. Only the network protects it (the chart's
    /// NetworkPolicy admits only that server's pods). It serves neither the
    /// native API nor RegistryService, so the main port keeps its token.
    pub open_fastpath_listen: Option<SocketAddr>,
    /// Mutual TLS on the main port, beside plaintext (the first byte of a
    /// connection tells them apart, so agents, janitors and the kubelet's
    /// probes keep connecting in plaintext). A client certificate signed by
    /// `client_ca` authenticates FastPath and native API calls in place of
    /// the bearer token; RegistryService still needs the agent token.
    pub fastpath_tls: Option<TlsFiles>,
    /// Connection cap, first-bytes (header-read) timeout and HTTP/2
    /// keepalive of the gRPC listeners (see `sandbolt_telemetry::listener`).
    pub listener_limits: sandbolt_telemetry::ListenerLimits,
    /// What agents are told to use between heartbeats.
    pub heartbeat_interval: Duration,
    /// An agent silent this long is lost: it leaves placement and its
    /// sandboxes read as unknown (`Core::agent_silent`). Nothing else: their
    /// records keep their phase, and no container is failed or reaped.
    pub lost_agent_timeout: Duration,
    /// A silent agent is given up (AUTO_RECREATE recreates its sandboxes
    /// elsewhere, MANUAL ones are failed) only after this much silence, and
    /// only if `agent_presence` says its pod or node is gone. Keep it well
    /// above `lost_agent_timeout` and the agents' heartbeat RPC timeout
    /// (10 s): a rollout or a containerd restart must fit inside it.
    pub agent_gone_timeout: Duration,
    /// Says whether a silent agent is gone (Kubernetes: its pod or node).
    /// `None` (one machine): never — a silent agent's sandboxes wait for it.
    pub agent_presence: Option<std::sync::Arc<dyn crate::registry::AgentPresence>>,
    pub expiry_sweep_interval: Duration,
    /// Kubernetes store: how long an expired sandbox's resource stays as a
    /// tombstone (the OpenSandbox server shows it as Terminated).
    pub expired_sandbox_retention: Duration,
    /// Upper bound for one agent create (image + container + execd ready).
    pub create_deadline: Duration,
    /// Fast mode: attempts to commit the record after the container exists.
    pub record_commit_attempts: u32,
    /// AUTO_RECREATE sandboxes created with `recovery_timeout_seconds` = 0.
    pub default_recovery_timeout: Duration,
    /// After a restart, writes wait this long at most for the agents known
    /// from the store to heartbeat (their inventories complete the registry).
    pub startup_grace: Duration,
    /// Pools serve only their own namespace (fast-sandbox semantics) when
    /// true; by default a pool is global by name (see `Registry`).
    pub namespaced_pools: bool,
    /// Test hook: stop dead at a named point so a test can `kill -9` there.
    /// Set by the entry point (from `SANDBOLT_CONTROLLER_FAILPOINT`), never
    /// read from the environment here.
    pub failpoint: Option<FailpointSpec>,
    /// Where the controller's metrics go (one registration per process,
    /// see [`crate::register_metrics`]); `None`: into a registry nobody
    /// scrapes.
    pub metrics: Option<crate::metrics::ControllerMetrics>,
    /// The key sandbox access tokens are derived from and secret env
    /// values sealed with (see [`crate::secrets`]); `None`:
    /// `<data_dir>/token.key`, created when absent.
    pub token_key_file: Option<PathBuf>,
    /// The key agents' credentials are minted with (see
    /// [`crate::identity`]); `None`: `<data_dir>/identity.key`, created
    /// when absent. HA controllers must share it.
    pub identity_key_file: Option<PathBuf>,
    /// TLS only on the main port (plaintext refused): agents and janitors
    /// connect with `https://` and `--controller-ca`. Exclusive with
    /// `fastpath_tls` (which keeps plaintext beside mutual TLS); its
    /// `client_ca` gives FastPath clients the certificate login instead.
    pub tls: Option<ServerTlsFiles>,
}

/// PEM files of the main port's server TLS ([`ControllerConfig::tls`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA certificate(s) a client certificate must chain to. A client may
    /// present one (it then stands in for the FastPath token) or none
    /// (agents, janitors, the lifecycle: tokens). `None`: no client
    /// certificates asked for.
    pub client_ca: Option<PathBuf>,
}

impl ControllerConfig {
    pub fn new(
        listen: SocketAddr,
        data_dir: impl Into<PathBuf>,
        agent_token: impl Into<String>,
    ) -> Self {
        Self {
            listen,
            data_dir: data_dir.into(),
            default_consistency: Consistency::Strong,
            agent_token: agent_token.into(),
            fastpath_token: None,
            open_fastpath_listen: None,
            fastpath_tls: None,
            listener_limits: sandbolt_telemetry::ListenerLimits::default(),
            heartbeat_interval: Duration::from_secs(2),
            lost_agent_timeout: Duration::from_secs(10),
            agent_gone_timeout: DEFAULT_AGENT_GONE_TIMEOUT,
            agent_presence: None,
            expiry_sweep_interval: Duration::from_secs(1),
            expired_sandbox_retention: crate::store::kube::DEFAULT_EXPIRED_SANDBOX_RETENTION,
            create_deadline: Duration::from_secs(60),
            record_commit_attempts: 5,
            default_recovery_timeout: Duration::from_secs(60),
            startup_grace: Duration::from_secs(10),
            namespaced_pools: false,
            failpoint: None,
            metrics: None,
            token_key_file: None,
            identity_key_file: None,
            tls: None,
        }
    }
}

/// PEM files of the main port's mutual TLS (see
/// [`ControllerConfig::fastpath_tls`]). Read once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain, leaf first.
    pub cert: PathBuf,
    /// The server certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificate(s) client certificates must chain to.
    pub client_ca: PathBuf,
}

/// Points where a test can freeze the controller (it then sits there until
/// killed). Chosen with `SANDBOLT_CONTROLLER_FAILPOINT` (see [`crate::cli`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// Strong mode: the record is committed, the agent not yet called.
    StrongAfterRecord,
    /// Fast mode: the container exists, the record is not written yet.
    FastAfterCreate,
}

pub const FAILPOINT_ENV: &str = "SANDBOLT_CONTROLLER_FAILPOINT";

/// A failpoint, optionally only for one sandbox name:
/// `strong-after-record` or `strong-after-record:victim`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailpointSpec {
    pub point: Failpoint,
    pub only_for: Option<String>,
}

impl std::str::FromStr for FailpointSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).ok_or_else(|| {
            format!("unknown failpoint {s:?} (strong-after-record or fast-after-create, optionally :<sandbox name>)")
        })
    }
}

impl FailpointSpec {
    pub fn parse(s: &str) -> Option<Self> {
        let (p, name) = match s.split_once(':') {
            Some((p, n)) => (p, Some(n.to_string())),
            None => (s, None),
        };
        let point = match p {
            "strong-after-record" => Failpoint::StrongAfterRecord,
            "fast-after-create" => Failpoint::FastAfterCreate,
            _ => return None,
        };
        Some(Self {
            point,
            only_for: name,
        })
    }
}

impl Failpoint {
    pub fn name(self) -> &'static str {
        match self {
            Self::StrongAfterRecord => "strong-after-record",
            Self::FastAfterCreate => "fast-after-create",
        }
    }
}

/// Stops this task forever if `point` is the configured failpoint, after
/// saying so on stderr (the test waits for that line, then sends SIGKILL).
pub(crate) async fn failpoint(config: &ControllerConfig, point: Failpoint, sandbox: &str) {
    let Some(spec) = &config.failpoint else {
        return;
    };
    if spec.point == point && spec.only_for.as_deref().is_none_or(|n| n == sandbox) {
        eprintln!("SANDBOLT_FAILPOINT_REACHED {} {sandbox}", point.name());
        std::future::pending::<()>().await;
    }
}
