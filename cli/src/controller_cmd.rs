use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sandbolt_controller::ha::{ElectedExit, run_on_kubernetes};
use sandbolt_controller::leader::LeaseConfig;
use sandbolt_controller::{Consistency, Controller, ControllerConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum StoreArg {
    /// One redb file under --data-dir; one replica only.
    Embedded,
    /// Sandbox custom resources and Leases through the Kubernetes API
    /// (in-cluster service account, or KUBECONFIG); replicas elect a leader
    /// through the Lease --lease-name, and only the leader serves.
    Kubernetes,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ConsistencyArg {
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

#[derive(Debug, clap::Args)]
pub(crate) struct ControllerArgs {
    /// gRPC address for FastPath v1 + v2 and the agents' RegistryService.
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    listen: SocketAddr,
    /// Directory of the embedded record store (controller.redb).
    #[arg(
        long,
        env = "SANDBOLT_DATA_DIR",
        default_value = "/var/lib/sandbolt/controller"
    )]
    data_dir: PathBuf,
    /// Token agents and janitors present (and the controller presents to agents).
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    agent_token: String,
    /// Require `authorization: Bearer <token>` on FastPath calls. Without it
    /// the FastPath port is open: bind it to a private address.
    #[arg(long, env = "SANDBOLT_FASTPATH_TOKEN", hide_env_values = true)]
    fastpath_token: Option<String>,
    /// Consistency of creates that do not ask for one.
    #[arg(
        long,
        env = "SANDBOLT_CONSISTENCY",
        value_enum,
        default_value = "strong"
    )]
    consistency: ConsistencyArg,
    /// Where the records live.
    #[arg(long, env = "SANDBOLT_STORE", value_enum, default_value = "embedded")]
    store: StoreArg,
    /// Kubernetes store: namespace of the controller's Lease and of the agent
    /// records (the chart passes the pod's namespace).
    #[arg(
        long,
        env = "SANDBOLT_POD_NAMESPACE",
        required_if_eq("store", "kubernetes")
    )]
    namespace: Option<String>,
    /// Kubernetes store: this replica's identity in the Lease; must be unique
    /// per replica (the chart passes the pod name).
    #[arg(long, env = "SANDBOLT_POD_NAME", required_if_eq("store", "kubernetes"))]
    identity: Option<String>,
    /// Kubernetes store: name of the leader-election Lease.
    #[arg(
        long,
        env = "SANDBOLT_LEASE_NAME",
        default_value = "sandbolt-controller"
    )]
    lease_name: String,
    /// Kubernetes store: how long a leader's Lease is valid without renewal;
    /// a standby takes over at most this long after the leader died.
    #[arg(long, env = "SANDBOLT_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,
    /// Kubernetes store: a leader that could not renew for this long stops
    /// serving (must be below --lease-duration).
    #[arg(long, env = "SANDBOLT_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    renew_deadline: Duration,
    /// Kubernetes store: time between election rounds.
    #[arg(long, env = "SANDBOLT_LEASE_RETRY", default_value = "2s", value_parser = humantime::parse_duration)]
    lease_retry: Duration,
}

pub(crate) async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let mut config = ControllerConfig::new(args.listen, &args.data_dir, args.agent_token.clone());
    config.fastpath_token = args.fastpath_token.clone();
    config.default_consistency = args.consistency.into();
    if args.store == StoreArg::Kubernetes {
        return run_kubernetes(config, args).await;
    }
    let handle = Controller::start(config)
        .await
        .with_context(|| format!("starting the controller on {}", args.listen))?;
    tracing::info!(fastpath = %handle.local_addr(), data_dir = %args.data_dir.display(), "controller serving FastPath v1 + v2 and RegistryService");
    crate::shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}

async fn run_kubernetes(config: ControllerConfig, args: ControllerArgs) -> anyhow::Result<()> {
    // clap enforces both with --store kubernetes.
    let namespace = args.namespace.context("--namespace is required")?;
    let identity = args.identity.context("--identity is required")?;
    let kube_config = kube::Config::infer()
        .await
        .context("no Kubernetes API configuration (in-cluster service account or KUBECONFIG)")?;
    let lease = LeaseConfig::new(namespace, &args.lease_name, identity).with_timings(
        args.lease_duration,
        args.renew_deadline,
        args.lease_retry,
    );
    let listen = args.listen;
    let exit = run_on_kubernetes(
        config,
        kube_config,
        lease,
        |h| tracing::info!(fastpath = %h.local_addr(), "leader: serving FastPath v1 + v2 and RegistryService"),
        crate::shutdown_signal(),
    )
    .await
    .with_context(|| format!("controller on {listen}"))?;
    match exit {
        ElectedExit::Shutdown => Ok(()),
        // Exit non-zero: the pod restarts and comes back as a standby.
        ElectedExit::LostLeadership => {
            anyhow::bail!("lost the controller lease to another replica")
        }
    }
}
