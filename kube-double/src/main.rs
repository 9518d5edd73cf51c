//! `kube-double`: the Kubernetes API double as a process, for clients that
//! cannot share the test's address space (the OpenSandbox server, a
//! controller started as a binary) and read a kubeconfig instead.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use sandbolt_kube_double::{ApiDouble, StartOptions};
use tokio::signal::unix::{SignalKind, signal};

/// An in-memory Kubernetes API server double (plain HTTP, bearer token).
///
/// Serves pods, leases and sandbolt's kinds built in, plus the kinds of
/// the CustomResourceDefinitions in `--crds`. Prints its URL on stdout once
/// it accepts connections (after the kubeconfig is written) and serves
/// until SIGTERM or SIGINT. State lives in memory only.
#[derive(Debug, Parser)]
#[command(name = "kube-double", version)]
struct Args {
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// A directory of CRD files (`.yaml`/`.yml`, e.g. deploy/crds) whose
    /// kinds to serve. Namespaced CRDs with one served version only.
    #[arg(long, value_name = "DIR")]
    crds: Vec<PathBuf>,
    /// Extra custom kinds to serve, as GROUP/VERSION/KIND/PLURAL with an
    /// optional `+status` suffix for the status subresource, e.g.
    /// sandbox.opensandbox.io/v1alpha1/BatchSandbox/batchsandboxes.
    #[arg(long = "kind", value_name = "G/V/KIND/PLURAL[+status]")]
    kinds: Vec<String>,
    /// Write a kubeconfig for the double here (mode 0600): for `KUBECONFIG`
    /// or the Python client's `load_kube_config`.
    #[arg(long, value_name = "PATH")]
    kubeconfig_out: Option<PathBuf>,
    /// The bearer token clients must send; a random one when unset (read
    /// it from the kubeconfig).
    #[arg(long, env = "KUBE_DOUBLE_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

/// `GROUP/VERSION/KIND/PLURAL[+status]`.
fn parse_kind(spec: &str) -> anyhow::Result<sandbolt_kube_double::CustomKind> {
    let (path, status) = match spec.strip_suffix("+status") {
        Some(path) => (path, true),
        None => (spec, false),
    };
    let [group, version, kind, plural] = path.split('/').collect::<Vec<_>>()[..] else {
        anyhow::bail!("--kind {spec:?}: expected GROUP/VERSION/KIND/PLURAL[+status]");
    };
    let custom = sandbolt_kube_double::CustomKind::new(group, version, kind, plural);
    Ok(if status { custom.with_status() } else { custom })
}

/// Starts the double and registers every kind asked for.
async fn start(args: &Args) -> anyhow::Result<ApiDouble> {
    let options = StartOptions {
        listen: args.listen,
        token: args.token.clone(),
    };
    let double = ApiDouble::start_with(options)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    for dir in &args.crds {
        let kinds = double.register_crds(dir)?;
        for kind in kinds {
            tracing::info!(
                group = kind.group,
                version = kind.version,
                plural = kind.plural,
                "serving CRD kind"
            );
        }
    }
    for spec in &args.kinds {
        double.register_kind(&parse_kind(spec)?)?;
    }
    if let Some(path) = &args.kubeconfig_out {
        double
            .write_kubeconfig(path)
            .with_context(|| format!("writing the kubeconfig {}", path.display()))?;
    }
    Ok(double)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let mut terminate = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let double = start(&args).await?;
    // The one line on stdout: a parent reads it to know the double is up.
    println!("{}", double.url());
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    double.shutdown().await;
    Ok(())
}
