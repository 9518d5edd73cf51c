//! `sandbolt janitor`: the node janitor (a DaemonSet in a cluster; inside
//! `sandbolt up` on one machine).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sandbolt_janitor::agent_pods::DEFAULT_SELECTOR;
use sandbolt_janitor::{AgentPods, Janitor, JanitorConfig, ScanReport};
use sandbolt_telemetry::prometheus_client::registry::Registry;

#[derive(Debug, clap::Args)]
pub(crate) struct JanitorArgs {
    /// This node's name, as its agent reports it (default: host name).
    #[arg(long, env = "SANDBOLT_NODE_NAME")]
    node_name: Option<String>,
    #[command(flatten)]
    containerd: crate::containerd::ContainerdArgs,
    /// The agent's snapshotter.
    #[arg(long, env = "SANDBOLT_SNAPSHOTTER", default_value = "overlayfs")]
    snapshotter: String,
    /// Controller endpoint, e.g. http://10.0.0.1:9090.
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: String,
    /// CA certificate (PEM) of a controller serving TLS (--tls-cert);
    /// --controller is then https://...
    #[arg(long, env = "SANDBOLT_CONTROLLER_CA")]
    controller_ca: Option<PathBuf>,
    /// The agent token (janitors authenticate to the controller with it).
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    token: String,
    /// Time between periodic scans.
    #[arg(long, env = "SANDBOLT_JANITOR_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Nothing younger than this is touched; keep it above the controller's
    /// fast-mode commit deadline (create deadline + commit retries).
    #[arg(long, env = "SANDBOLT_JANITOR_GRACE", default_value = "90s", value_parser = humantime::parse_duration)]
    grace_period: Duration,
    /// How often to check for lost or restarted agents between scans.
    #[arg(long, env = "SANDBOLT_JANITOR_AGENT_POLL", default_value = "2s", value_parser = humantime::parse_duration)]
    agent_poll_interval: Duration,
    /// The agent's state dir (its per-sandbox logs are in `<dir>/logs`).
    #[arg(long, env = "SANDBOLT_STATE_DIR", default_value = crate::agent_cmd::AGENT_STATE_DIR)]
    agent_state_dir: PathBuf,
    /// The agent keeps logs of deleted sandboxes: do not remove log files.
    #[arg(long, env = "SANDBOLT_KEEP_LOGS")]
    keep_logs: bool,
    /// The janitor's own journal of cleanups in progress.
    #[arg(
        long,
        env = "SANDBOLT_JANITOR_STATE_DIR",
        default_value = "/var/lib/sandbolt/janitor"
    )]
    state_dir: PathBuf,
    /// Read this node's agent pods from the Kubernetes API (in-cluster
    /// configuration): once the controller is recreating a sandbox
    /// elsewhere, its old container is reaped when its agent pod left the
    /// node and a Ready agent pod that did not adopt it is there. A merely
    /// silent agent's containers are never reaped.
    #[arg(long, env = "SANDBOLT_KUBE")]
    kube: bool,
    /// Namespace of the agent pods (with --kube).
    #[arg(long, env = "SANDBOLT_POD_NAMESPACE")]
    agent_pod_namespace: Option<String>,
    /// Label selector of the agent pods (with --kube). Every agent pod that
    /// may run on this node must match: a sandbox whose agent pod does not is
    /// taken for abandoned.
    #[arg(long, env = "SANDBOLT_AGENT_POD_SELECTOR", default_value = DEFAULT_SELECTOR)]
    agent_pod_selector: String,
    /// Run one scan, print what it did, and exit.
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    metrics: crate::agent_cmd::MetricsListenArgs,
}

pub(crate) fn config(args: &JanitorArgs) -> JanitorConfig {
    let mut cfg = JanitorConfig::new(
        args.node_name
            .clone()
            .unwrap_or_else(crate::secrets::hostname),
        &args.containerd.socket,
        &args.controller,
        &args.token,
        &args.state_dir,
    );
    cfg.containerd_namespace = args.containerd.namespace.clone();
    cfg.snapshotter = args.snapshotter.clone();
    cfg.interval = args.interval;
    cfg.grace_period = args.grace_period;
    cfg.agent_poll_interval = args.agent_poll_interval;
    cfg.agent_state_dir = Some(args.agent_state_dir.clone());
    cfg.controller_ca = args.controller_ca.clone();
    cfg.keep_logs = args.keep_logs;
    cfg
}

/// One line per decision, for people and for tests.
pub(crate) fn print_report(r: &ScanReport) {
    for x in &r.reaped {
        println!(
            "reaped {} reason={} agent={} leftover={}",
            x.sandbox_id, x.reason, x.agent_id, x.leftover
        );
    }
    for k in &r.kept {
        println!("kept {} reason={:?}", k.sandbox_id, k.reason);
    }
    for e in &r.errors {
        println!("error {e}");
    }
    if let Some(e) = &r.agent_pods_error {
        println!("agent-pods-unavailable {e}");
    }
    println!(
        "scan containers={} reaped={} kept={} errors={} controller_ready={}",
        r.containers,
        r.reaped.len(),
        r.kept.len(),
        r.errors.len(),
        r.controller_ready
    );
}

/// The agent pods' namespace when `--kube` is on; an error when it is on
/// without one (checked before anything connects).
fn agent_pod_namespace(args: &JanitorArgs) -> anyhow::Result<Option<String>> {
    if !args.kube {
        return Ok(None);
    }
    let namespace = args
        .agent_pod_namespace
        .clone()
        .filter(|n| !n.is_empty())
        .context("--kube needs --agent-pod-namespace (SANDBOLT_POD_NAMESPACE)")?;
    Ok(Some(namespace))
}

/// The janitor, with the agent-pod rule when `--kube` says so.
async fn janitor(args: &JanitorArgs, cfg: JanitorConfig) -> anyhow::Result<Janitor> {
    let namespace = agent_pod_namespace(args)?;
    let timeout = cfg.rpc_timeout;
    let janitor = Janitor::new(cfg).await.context("starting the janitor")?;
    let Some(namespace) = namespace else {
        return Ok(janitor);
    };
    let pods = AgentPods::from_environment(&namespace, &args.agent_pod_selector, timeout)
        .await
        .context("connecting to the Kubernetes API")?;
    tracing::info!(%namespace, selector = %args.agent_pod_selector, "reading this node's agent pods");
    Ok(janitor.with_agent_pods(pods))
}

pub(crate) async fn run(args: JanitorArgs) -> anyhow::Result<()> {
    let cfg = config(&args);
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
    let janitor = janitor(&args, cfg).await?;
    if args.once {
        let report = janitor
            .scan_once()
            .await
            .context("scan (nothing was reaped)")?;
        print_report(&report);
        anyhow::ensure!(
            report.errors.is_empty(),
            "{} cleanup(s) incomplete; the next scan finishes them",
            report.errors.len()
        );
        return Ok(());
    }
    let mut registry = Registry::default();
    janitor.metrics().register(&mut registry);
    let ops = args.metrics.serve(registry, janitor.readiness()).await?;
    let handle = Janitor::spawn(std::sync::Arc::new(janitor));
    crate::shutdown_signal().await;
    handle.shutdown().await;
    drop(ops);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> JanitorArgs {
        let argv = ["janitor", "--controller", "http://c:9090", "--token", "t"];
        crate::parse_flags(&[&argv[..], extra].concat())
    }

    #[test]
    fn the_agent_pod_rule_is_off_unless_asked_and_needs_a_namespace() {
        let off = parse(&[]);
        assert!(!off.kube);
        assert_eq!(agent_pod_namespace(&off).unwrap(), None);
        let on = parse(&["--kube", "--agent-pod-namespace", "sandbolt"]);
        assert_eq!(on.agent_pod_selector, DEFAULT_SELECTOR);
        assert_eq!(
            agent_pod_namespace(&on).unwrap().as_deref(),
            Some("sandbolt")
        );
        let no_ns = parse(&["--kube"]);
        assert!(agent_pod_namespace(&no_ns).is_err());
    }

    #[test]
    fn the_metrics_listener_is_off_unless_an_address_is_given() {
        assert_eq!(parse(&[]).metrics.metrics_listen, None);
        let on = parse(&["--metrics-listen", "127.0.0.1:9464"]);
        assert_eq!(
            on.metrics.metrics_listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        let err = crate::try_parse_flags::<JanitorArgs>(&[
            "janitor",
            "--controller",
            "http://c:9090",
            "--token",
            "t",
            "--metrics-listen",
            "nowhere",
        ]);
        assert!(err.is_err(), "an address is required");
    }
}
