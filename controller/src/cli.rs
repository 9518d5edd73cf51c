//! The controller's one entry point: its flags (each with a `SANDBOLT_…`
//! environment name) and [`run`]. `sandbolt controller` and the
//! `sandbolt-controller` binary (what tests start as a child to `kill -9`)
//! both parse [`ControllerArgs`] and call [`run`], so flags, environment
//! names and wiring are the same in both.
//!
//! Once serving (with `--store kubernetes`: once leading) it prints
//! `SANDBOLT_CONTROLLER_LISTENING <addr>` on stdout.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_telemetry::prometheus_client::registry::Registry;
use sandbolt_telemetry::{OpsServer, ops_router, serve_ops};

use crate::config::{ControllerConfig, FAILPOINT_ENV, FailpointSpec, TlsFiles};
use crate::ha::{ElectedExit, run_on_kubernetes};
use crate::leader::LeaseConfig;
use crate::registry::KubeAgentPresence;
use crate::store::Consistency;
use crate::{Controller, ControllerHandle};

/// What stdout says once the controller serves (the address follows).
pub const LISTENING_LINE: &str = "SANDBOLT_CONTROLLER_LISTENING";

/// Printed just before [`LISTENING_LINE`] when --open-fastpath-listen is set
/// (its address follows), so a caller that asked for port 0 learns the port
/// by the time it has read the listening line.
pub const OPEN_FASTPATH_LINE: &str = "SANDBOLT_CONTROLLER_OPEN_FASTPATH";

/// Printed once the ops endpoint (--metrics-listen) serves, before the
/// controller starts (a standby prints it too); its address follows.
pub const METRICS_LINE: &str = "SANDBOLT_CONTROLLER_METRICS";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreArg {
    /// One redb file under --data-dir; one replica only.
    Embedded,
    /// Sandbox custom resources and Leases through the Kubernetes API
    /// (in-cluster service account, or KUBECONFIG); replicas elect a leader
    /// through the Lease --lease-name, and only the leader serves.
    Kubernetes,
}

/// How the controller tells a silent agent from a gone one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AgentPresenceArg {
    /// `kubernetes` with --store kubernetes or inside a pod
    /// (KUBERNETES_SERVICE_HOST is set), `none` otherwise.
    Auto,
    /// Ask the Kubernetes API whether the agent's pod still exists.
    Kubernetes,
    /// Never: a silent agent's sandboxes wait for it however long it is away.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConsistencyArg {
    /// Container first, record after (lowest latency).
    Fast,
    /// Record first, container after.
    Strong,
}

impl From<ConsistencyArg> for Consistency {
    fn from(c: ConsistencyArg) -> Self {
        match c {
            ConsistencyArg::Fast => Consistency::Fast,
            ConsistencyArg::Strong => Consistency::Strong,
        }
    }
}

fn duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

#[derive(Debug, Clone, clap::Args)]
pub struct ControllerArgs {
    /// gRPC address for FastPath v1 + v2, the native API and the agents'
    /// RegistryService (port 0: any free port, printed once serving).
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    pub listen: SocketAddr,
    /// Directory of the embedded record store (controller.redb).
    #[arg(
        long,
        env = "SANDBOLT_DATA_DIR",
        default_value = "/var/lib/sandbolt/controller"
    )]
    pub data_dir: PathBuf,
    /// Bootstrap token: agents and janitors trade it for a per-agent
    /// credential (RegistryService.Enroll); heartbeats, reap reports and the
    /// controller's calls to agents use that credential.
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    pub agent_token: String,
    /// Key the per-agent credentials are minted with (at least 32 bytes;
    /// mount a Secret here so HA controllers share it). Default:
    /// `<data-dir>/identity.key`, created (0600) when absent.
    #[arg(long, env = "SANDBOLT_IDENTITY_KEY_FILE")]
    pub identity_key_file: Option<PathBuf>,
    /// Serve the main --listen port over TLS only, with this PEM certificate
    /// chain (and --tls-key); agents and janitors then connect to
    /// https://... with --controller-ca. Not with --fastpath-tls-cert.
    #[arg(
        long,
        env = "SANDBOLT_TLS_CERT",
        requires = "tls_key",
        conflicts_with = "fastpath_tls_cert"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The --tls-cert certificate's private key (PEM).
    #[arg(long, env = "SANDBOLT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// With --tls-cert: PEM CA certificate(s) for FastPath clients'
    /// certificates. A client presenting one signed by it needs no FastPath
    /// token; clients without one (agents, janitors, the lifecycle) still
    /// connect and use their tokens. Default: no client certificates.
    #[arg(long, env = "SANDBOLT_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Key sandboxes' access tokens are derived from and secret env values
    /// sealed with (at least 32 bytes; mount a Secret here so HA
    /// controllers share it). Default: `<data-dir>/token.key`, created
    /// (0600) when absent. Changing it changes every sandbox's token.
    #[arg(long, env = "SANDBOLT_TOKEN_KEY_FILE")]
    pub token_key_file: Option<PathBuf>,
    /// Require `authorization: Bearer <token>` on FastPath calls. Without it
    /// the FastPath port is open: bind it to a private address.
    #[arg(long, env = "SANDBOLT_FASTPATH_TOKEN", hide_env_values = true)]
    pub fastpath_token: Option<String>,
    /// Also serve FastPath v1 + v2 (only those, and health) on this second
    /// address, with no token and no TLS. For clients that can present no
    /// credentials, such as the OpenSandbox server, whose FastPath client
    /// opens a plaintext channel without a token. Anything that reaches
    /// this port can create and delete sandboxes, so only a network rule
    /// may protect it (the chart's NetworkPolicy admits only the server's
    /// pods); the main --listen port keeps --fastpath-token and is the one
    /// agents register on. Prefer --fastpath-tls-* for clients that can
    /// hold a certificate.
    #[arg(long, env = "SANDBOLT_OPEN_FASTPATH_LISTEN")]
    pub open_fastpath_listen: Option<SocketAddr>,
    /// Mutual TLS on the main --listen port (with --fastpath-tls-key and
    /// --fastpath-client-ca): the server's PEM certificate chain. A client
    /// presenting a certificate signed by the client CA needs no FastPath
    /// token; plaintext keeps working on the same port (agents, janitors,
    /// probes), with the token, or refused for FastPath when no
    /// --fastpath-token is set. Stronger than the open port (the client
    /// proves who it is, and the traffic is encrypted), but only for
    /// clients that can be given a certificate.
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_TLS_CERT",
        requires_all = ["fastpath_tls_key", "fastpath_client_ca"]
    )]
    pub fastpath_tls_cert: Option<PathBuf>,
    /// Mutual TLS: the PEM private key of --fastpath-tls-cert.
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_TLS_KEY",
        requires = "fastpath_tls_cert"
    )]
    pub fastpath_tls_key: Option<PathBuf>,
    /// Mutual TLS: PEM CA certificate(s) that client certificates must
    /// chain to (a client without one is refused at the handshake).
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_CLIENT_CA",
        requires = "fastpath_tls_cert"
    )]
    pub fastpath_client_ca: Option<PathBuf>,
    /// Consistency of creates that do not ask for one.
    #[arg(
        long,
        env = "SANDBOLT_CONSISTENCY",
        value_enum,
        default_value = "strong"
    )]
    pub consistency: ConsistencyArg,
    /// Where the records live.
    #[arg(long, env = "SANDBOLT_STORE", value_enum, default_value = "embedded")]
    pub store: StoreArg,
    /// Kubernetes store: namespace of the controller's Lease and of the agent
    /// records (the chart passes the pod's namespace).
    #[arg(
        long,
        env = "SANDBOLT_POD_NAMESPACE",
        required_if_eq("store", "kubernetes")
    )]
    pub namespace: Option<String>,
    /// Kubernetes store: this replica's identity in the Lease; must be unique
    /// per replica (the chart passes the pod name).
    #[arg(long, env = "SANDBOLT_POD_NAME", required_if_eq("store", "kubernetes"))]
    pub identity: Option<String>,
    /// Kubernetes store: name of the leader-election Lease.
    #[arg(
        long,
        env = "SANDBOLT_LEASE_NAME",
        default_value = "sandbolt-controller"
    )]
    pub lease_name: String,
    /// Kubernetes store: how long a leader's Lease is valid without renewal;
    /// a standby takes over at most this long after the leader died.
    #[arg(long, env = "SANDBOLT_LEASE_DURATION", default_value = "15s", value_parser = duration)]
    pub lease_duration: Duration,
    /// Kubernetes store: a leader that could not renew for this long stops
    /// serving (must be below --lease-duration).
    #[arg(long, env = "SANDBOLT_RENEW_DEADLINE", default_value = "10s", value_parser = duration)]
    pub renew_deadline: Duration,
    /// Kubernetes store: time between election rounds.
    #[arg(long, env = "SANDBOLT_LEASE_RETRY", default_value = "2s", value_parser = duration)]
    pub lease_retry: Duration,
    /// What agents are told to use between heartbeats.
    #[arg(long, env = "SANDBOLT_HEARTBEAT_INTERVAL", default_value = "2s", value_parser = duration)]
    pub heartbeat_interval: Duration,
    /// An agent silent this long is shown as unknown (its sandboxes' state)
    /// and gets no new sandboxes. Nothing is failed or reaped for silence.
    #[arg(long, env = "SANDBOLT_AGENT_LOST_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub agent_lost_timeout: Duration,
    /// A silent agent whose pod is gone (see --agent-presence) is given up
    /// after this much silence: its AUTO_RECREATE sandboxes are recreated
    /// elsewhere, its MANUAL ones marked failed. Leave room for a rollout or
    /// an image pull: a successor pod adopts the sandboxes.
    #[arg(long, env = "SANDBOLT_AGENT_GONE_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub agent_gone_timeout: Duration,
    /// How a silent agent is told from a gone one.
    #[arg(
        long,
        env = "SANDBOLT_AGENT_PRESENCE",
        value_enum,
        default_value = "auto"
    )]
    pub agent_presence: AgentPresenceArg,
    /// After a restart, writes wait this long at most for the agents known
    /// from the store to heartbeat.
    #[arg(long, env = "SANDBOLT_STARTUP_GRACE", default_value = "10s", value_parser = duration)]
    pub startup_grace: Duration,
    /// How often expired sandboxes are looked for.
    #[arg(long, env = "SANDBOLT_EXPIRY_SWEEP_INTERVAL", default_value = "1s", value_parser = duration)]
    pub expiry_sweep_interval: Duration,
    /// Kubernetes store: how long an expired sandbox's Sandbox resource is
    /// kept as a tombstone (its container is removed at expiry): the
    /// OpenSandbox server shows it as Terminated, as with fast-sandbox, and
    /// a create of the same name replaces it. It is deleted after this long.
    #[arg(long, env = "SANDBOLT_EXPIRED_SANDBOX_RETENTION", default_value = "1h", value_parser = duration)]
    pub expired_sandbox_retention: Duration,
    /// Serve /metrics (Prometheus, OpenMetrics text), /healthz and /readyz
    /// on this address, plain HTTP without credentials: nothing there is
    /// secret, and a network rule (the chart's NetworkPolicy) limits who
    /// reaches it. /readyz is 503 on a standby replica and until the store
    /// is open. Off by default.
    #[arg(long, env = "SANDBOLT_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Test hook: freeze at a named point (`strong-after-record[:name]`,
    /// `fast-after-create[:name]`) so a test can `kill -9` there.
    #[arg(long, env = FAILPOINT_ENV, hide = true)]
    pub failpoint: Option<FailpointSpec>,
    #[command(flatten)]
    pub listener: sandbolt_telemetry::listener::ListenerArgs,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}")]
    Config(String),
    #[error("{what}: {source}")]
    Kubernetes {
        what: &'static str,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("metrics endpoint on {listen}: {source}")]
    Metrics {
        listen: SocketAddr,
        source: sandbolt_telemetry::TelemetryError,
    },
    #[error("controller on {listen}: {source}")]
    Controller {
        listen: SocketAddr,
        source: crate::Error,
    },
    /// Exit non-zero: the pod restarts and comes back as a standby.
    #[error("lost the controller lease to another replica")]
    LostLeadership,
}

impl ControllerArgs {
    /// The library configuration these flags describe (no presence source:
    /// [`run`] adds it).
    pub fn config(&self) -> Result<ControllerConfig, RunError> {
        let mut c = ControllerConfig::new(self.listen, &self.data_dir, self.agent_token.clone());
        c.identity_key_file = self.identity_key_file.clone();
        c.tls = self
            .tls_cert
            .clone()
            .zip(self.tls_key.clone())
            .map(|(cert, key)| crate::config::ServerTlsFiles {
                cert,
                key,
                client_ca: self.tls_client_ca.clone(),
            });
        c.token_key_file = self.token_key_file.clone();
        c.fastpath_token = self.fastpath_token.clone().filter(|t| !t.is_empty());
        c.open_fastpath_listen = self.open_fastpath_listen;
        c.fastpath_tls = self.fastpath_tls();
        c.default_consistency = self.consistency.into();
        c.heartbeat_interval = self.heartbeat_interval;
        c.lost_agent_timeout = self.agent_lost_timeout;
        c.agent_gone_timeout = self.agent_gone_timeout;
        c.startup_grace = self.startup_grace;
        c.expiry_sweep_interval = self.expiry_sweep_interval;
        c.expired_sandbox_retention = self.expired_sandbox_retention;
        c.failpoint = self.failpoint.clone();
        c.listener_limits = self
            .listener
            .limits()
            .map_err(|e| RunError::Config(e.to_string()))?;
        check_timeouts(&c)?;
        Ok(c)
    }

    /// All three files or none (clap's `requires` sees to it).
    fn fastpath_tls(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: self.fastpath_tls_cert.clone()?,
            key: self.fastpath_tls_key.clone()?,
            client_ca: self.fastpath_client_ca.clone()?,
        })
    }

    fn wants_kube_presence(&self, in_cluster: bool) -> bool {
        match self.agent_presence {
            AgentPresenceArg::Kubernetes => true,
            AgentPresenceArg::None => false,
            AgentPresenceArg::Auto => self.store == StoreArg::Kubernetes || in_cluster,
        }
    }
}

/// Where the timeouts contradict each other or the heartbeat.
fn check_timeouts(config: &ControllerConfig) -> Result<(), RunError> {
    if config.lost_agent_timeout <= config.heartbeat_interval {
        return Err(RunError::Config(format!(
            "--agent-lost-timeout ({:?}) must be longer than the heartbeat interval ({:?})",
            config.lost_agent_timeout, config.heartbeat_interval
        )));
    }
    if config.agent_gone_timeout <= config.lost_agent_timeout {
        return Err(RunError::Config(format!(
            "--agent-gone-timeout ({:?}) must be longer than --agent-lost-timeout ({:?})",
            config.agent_gone_timeout, config.lost_agent_timeout
        )));
    }
    Ok(())
}

async fn kube_config(what: &'static str) -> Result<kube::Config, RunError> {
    kube::Config::infer()
        .await
        .map_err(|e| RunError::Kubernetes {
            what,
            source: Box::new(e),
        })
}

/// Adds the Kubernetes presence source when `--agent-presence` asks for it.
async fn add_presence(
    config: &mut ControllerConfig,
    args: &ControllerArgs,
) -> Result<(), RunError> {
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    if !args.wants_kube_presence(in_cluster) {
        tracing::info!(
            "no agent presence source: a silent agent's sandboxes wait for it, never recreated"
        );
        return Ok(());
    }
    const WHAT: &str = "--agent-presence kubernetes needs a Kubernetes API (in-cluster service account or KUBECONFIG)";
    let client =
        kube::Client::try_from(kube_config(WHAT).await?).map_err(|e| RunError::Kubernetes {
            what: WHAT,
            source: Box::new(e),
        })?;
    config.agent_presence = Some(Arc::new(KubeAgentPresence::new(client)));
    tracing::info!(gone_after = ?config.agent_gone_timeout, "silent agents are given up only when their pod is gone (Kubernetes API)");
    Ok(())
}

fn announce(h: &ControllerHandle) {
    tracing::info!(fastpath = %h.local_addr(), "serving FastPath v1 + v2, the native API and RegistryService");
    if let Some(open) = h.open_fastpath_addr() {
        println!("{OPEN_FASTPATH_LINE} {open}");
    }
    println!("{LISTENING_LINE} {}", h.local_addr());
    let _ = std::io::stdout().flush();
}

/// With `--metrics-listen`: registers the controller's metrics, hands them
/// to `config` and serves the ops router (metrics, health, readiness).
async fn serve_metrics(
    config: &mut ControllerConfig,
    listen: Option<SocketAddr>,
) -> Result<Option<OpsServer>, RunError> {
    let Some(listen) = listen else {
        return Ok(None);
    };
    let mut registry = Registry::default();
    let metrics = crate::register_metrics(&mut registry);
    let router = ops_router(Arc::new(registry), metrics.readiness());
    config.metrics = Some(metrics);
    let server = serve_ops(listen, router)
        .await
        .map_err(|source| RunError::Metrics { listen, source })?;
    tracing::info!(addr = %server.local_addr(), "serving /metrics, /healthz and /readyz");
    println!("{METRICS_LINE} {}", server.local_addr());
    let _ = std::io::stdout().flush();
    Ok(Some(server))
}

/// Runs the controller these flags describe until `shutdown` resolves (or,
/// with the Kubernetes store, until this replica loses the lease).
pub async fn run(args: ControllerArgs, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let mut config = args.config()?;
    add_presence(&mut config, &args).await?;
    let ops = serve_metrics(&mut config, args.metrics_listen).await?;
    let ran = if args.store == StoreArg::Kubernetes {
        if config.token_key_file.is_none() {
            // Replicas (and a restarted pod) each with their own key derive
            // tokens the running sandboxes do not hold.
            tracing::warn!(
                "no --token-key-file with the kubernetes store: sandbox tokens are derived from \
                 a key in this pod's data dir; give every replica one Secret"
            );
        }
        run_kubernetes(config, args, shutdown).await
    } else {
        run_embedded(config, args.listen, shutdown).await
    };
    // Closed before returning, so that a caller that starts again finds
    // the port free; a scraper holding a connection open cannot keep it.
    if let Some(ops) = ops
        && tokio::time::timeout(OPS_SHUTDOWN_GRACE, ops.shutdown())
            .await
            .is_err()
    {
        tracing::warn!(grace = ?OPS_SHUTDOWN_GRACE, "ops endpoint did not stop in time; aborted");
    }
    ran
}

/// How long the ops endpoint's requests in flight may take at shutdown.
const OPS_SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

async fn run_embedded(
    config: ControllerConfig,
    listen: SocketAddr,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    let handle = Controller::start(config)
        .await
        .map_err(|source| RunError::Controller { listen, source })?;
    announce(&handle);
    shutdown.await;
    handle.shutdown().await;
    Ok(())
}

async fn run_kubernetes(
    config: ControllerConfig,
    args: ControllerArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    // clap requires both with --store kubernetes; a caller building the
    // args by hand gets the same message.
    let required = |v: Option<String>, flag: &str| {
        v.filter(|s| !s.is_empty())
            .ok_or_else(|| RunError::Config(format!("--store kubernetes needs {flag}")))
    };
    let namespace = required(args.namespace, "--namespace")?;
    let identity = required(args.identity, "--identity")?;
    let kube =
        kube_config("no Kubernetes API configuration (in-cluster service account or KUBECONFIG)")
            .await?;
    let lease = LeaseConfig::new(namespace, &args.lease_name, identity).with_timings(
        args.lease_duration,
        args.renew_deadline,
        args.lease_retry,
    );
    let listen = args.listen;
    let exit = run_on_kubernetes(config, kube, lease, announce, shutdown)
        .await
        .map_err(|source| RunError::Controller { listen, source })?;
    match exit {
        ElectedExit::Shutdown => Ok(()),
        ElectedExit::LostLeadership => Err(RunError::LostLeadership),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::DEFAULT_AGENT_GONE_TIMEOUT;

    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        args: ControllerArgs,
    }

    fn parse(extra: &[&str]) -> ControllerArgs {
        let mut argv = vec!["controller", "--agent-token", "t"];
        argv.extend_from_slice(extra);
        Cmd::try_parse_from(argv).expect("parses").args
    }

    #[test]
    fn silence_and_gone_timeouts_have_flags_and_sane_defaults() {
        let d = parse(&[]);
        assert_eq!(d.agent_lost_timeout, Duration::from_secs(10));
        assert_eq!(d.agent_gone_timeout, Duration::from_secs(300));
        assert_eq!(d.agent_gone_timeout, DEFAULT_AGENT_GONE_TIMEOUT);
        d.config().expect("defaults are consistent");
        let set = parse(&["--agent-lost-timeout", "3s", "--agent-gone-timeout", "2m"]);
        assert_eq!(set.agent_lost_timeout, Duration::from_secs(3));
        assert_eq!(set.agent_gone_timeout, Duration::from_secs(120));
        set.config().unwrap();
        let inverted = parse(&["--agent-lost-timeout", "30s", "--agent-gone-timeout", "20s"]);
        let e = inverted.config().unwrap_err().to_string();
        assert!(e.contains("--agent-gone-timeout"), "{e}");
        let too_short = parse(&["--agent-lost-timeout", "1s"]);
        assert!(too_short.config().is_err());
    }

    #[test]
    fn presence_is_kubernetes_where_the_controller_runs_on_kubernetes() {
        let auto = parse(&[]);
        assert!(!auto.wants_kube_presence(false), "one machine: never");
        assert!(auto.wants_kube_presence(true), "inside a pod");
        let kube_store = parse(&[
            "--store",
            "kubernetes",
            "--namespace",
            "n",
            "--identity",
            "i",
        ]);
        assert!(kube_store.wants_kube_presence(false));
        let off = parse(&["--agent-presence", "none"]);
        assert!(!off.wants_kube_presence(true));
        let on = parse(&["--agent-presence", "kubernetes"]);
        assert!(on.wants_kube_presence(false));
    }

    #[test]
    fn every_setting_reaches_the_config() {
        let a = parse(&[
            "--heartbeat-interval",
            "100ms",
            "--agent-lost-timeout",
            "3s",
            "--startup-grace",
            "3s",
            "--expiry-sweep-interval",
            "100ms",
            "--expired-sandbox-retention",
            "2m",
            "--consistency",
            "fast",
            "--failpoint",
            "strong-after-record:victim",
        ]);
        let c = a.config().unwrap();
        assert_eq!(c.heartbeat_interval, Duration::from_millis(100));
        assert_eq!(c.startup_grace, Duration::from_secs(3));
        assert_eq!(c.expiry_sweep_interval, Duration::from_millis(100));
        assert_eq!(c.expired_sandbox_retention, Duration::from_secs(120));
        assert_eq!(
            parse(&[]).config().unwrap().expired_sandbox_retention,
            Duration::from_secs(3600)
        );
        assert_eq!(c.default_consistency, Consistency::Fast);
        let fp = c.failpoint.expect("failpoint");
        assert_eq!(fp.only_for.as_deref(), Some("victim"));
        let bad = Cmd::try_parse_from(["controller", "--agent-token", "t", "--failpoint", "nope"]);
        assert!(bad.is_err(), "an unknown failpoint is refused, not ignored");
    }

    #[test]
    fn open_port_and_mutual_tls_reach_the_config() {
        let none = parse(&[]).config().unwrap();
        assert_eq!(none.open_fastpath_listen, None);
        assert_eq!(none.fastpath_tls, None);
        let c = parse(&[
            "--open-fastpath-listen",
            "0.0.0.0:9093",
            "--fastpath-tls-cert",
            "/tls/tls.crt",
            "--fastpath-tls-key",
            "/tls/tls.key",
            "--fastpath-client-ca",
            "/tls/ca.crt",
        ])
        .config()
        .unwrap();
        assert_eq!(
            c.open_fastpath_listen,
            Some("0.0.0.0:9093".parse().unwrap())
        );
        let tls = c.fastpath_tls.expect("tls");
        assert_eq!(tls.cert, PathBuf::from("/tls/tls.crt"));
        assert_eq!(tls.key, PathBuf::from("/tls/tls.key"));
        assert_eq!(tls.client_ca, PathBuf::from("/tls/ca.crt"));
        for partial in [
            &["--fastpath-tls-cert", "/c"][..],
            &["--fastpath-tls-cert", "/c", "--fastpath-tls-key", "/k"],
            &["--fastpath-client-ca", "/ca"],
        ] {
            let mut argv = vec!["controller", "--agent-token", "t"];
            argv.extend_from_slice(partial);
            assert!(
                Cmd::try_parse_from(argv).is_err(),
                "half a TLS setup is refused: {partial:?}"
            );
        }
    }
}
