//! `sandbolt-bench scale`: its flags and its entry point.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use sandbolt_test_support::sim_agent::Latency;
use sandbolt_test_support::sim_agent::faults::parse_fraction;

use super::{Api, ScaleOptions, StoreKind, report};

/// The controller at scale: the real controller binary and store against
/// simulated agents (real protocol, no containers). Without --quick: 1,000
/// agents, 100,000 live sandboxes per store, 10 % agent churn every 30 s.
/// Writes scale.md and scale.json to --out.
#[derive(Debug, clap::Args)]
pub struct ScaleArgs {
    /// Small run (20 agents, 2,000 sandboxes per store, short timers) that
    /// proves the harness works; it says nothing about speed.
    #[arg(long)]
    quick: bool,
    /// The `sandbolt` binary whose `controller` is measured (default:
    /// $SANDBOLT_STATIC_BIN).
    #[arg(long, env = "SANDBOLT_STATIC_BIN")]
    sandbolt_bin: PathBuf,
    /// Simulated agents (default 1000; 20 with --quick).
    #[arg(long)]
    agents: Option<usize>,
    /// Live sandboxes at the end of each store's ramp (default 100000;
    /// 2000 with --quick).
    #[arg(long)]
    sandboxes: Option<usize>,
    /// Concurrency of the ramp's steps, comma-separated (default 8,32,128;
    /// 4,16 with --quick); every API runs at each.
    #[arg(long, value_delimiter = ',')]
    concurrency: Option<Vec<usize>>,
    /// APIs to create through: fastpath-v2, native-fast, native-strong
    /// (comma-separated; default all three).
    #[arg(long = "api", value_delimiter = ',')]
    apis: Vec<String>,
    /// Stores to run: redb, kube (comma-separated; default both).
    #[arg(long = "store", value_delimiter = ',')]
    stores: Vec<String>,
    /// Fraction of agents stopped and restarted per churn round, 10% or
    /// 0.1; 0 = no churn (default 10%).
    #[arg(long)]
    churn: Option<String>,
    /// Time between churn rounds (default 30s; 2s with --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    churn_every: Option<Duration>,
    /// How long churned agents stay down (default 15s; 1.5s with --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    churn_down: Option<Duration>,
    /// The controller's --heartbeat-interval (default 2s; 200ms with
    /// --quick).
    #[arg(long, value_parser = humantime::parse_duration)]
    heartbeat: Option<Duration>,
    /// The controller's default --consistency, which FastPath v2 creates
    /// get: fast or strong (default strong).
    #[arg(long, default_value = "strong")]
    default_consistency: String,
    /// Simulated agents' delay before each answer: 0, <duration>,
    /// uniform:<min>-<max> or exp:<mean> (default 0: the controller's own
    /// time is what is measured).
    #[arg(long, default_value = "0")]
    latency: String,
    /// Fraction of the agents' mutating calls failed on purpose (default 0).
    #[arg(long, default_value = "0")]
    failure_rate: String,
    /// Skip the Kubernetes store's leader failover.
    #[arg(long)]
    no_failover: bool,
    /// Where scale.md, scale.json and the controllers' logs go.
    #[arg(long, default_value = "bench-out/scale")]
    out: PathBuf,
}

impl ScaleArgs {
    pub fn options(&self) -> anyhow::Result<ScaleOptions> {
        if !self.sandbolt_bin.is_file() {
            bail!(
                "--sandbolt-bin {}: no such file (build it with scripts/build-static.sh, or \
                 point --sandbolt-bin / SANDBOLT_STATIC_BIN at a sandbolt binary)",
                self.sandbolt_bin.display()
            );
        }
        let (bin, out) = (self.sandbolt_bin.clone(), self.out.clone());
        let mut o = if self.quick {
            ScaleOptions::quick(bin, out)
        } else {
            ScaleOptions::full(bin, out)
        };
        o.agents = self.agents.unwrap_or(o.agents);
        o.sandboxes = self.sandboxes.unwrap_or(o.sandboxes);
        if let Some(c) = &self.concurrency {
            if c.is_empty() || c.contains(&0) {
                bail!("--concurrency: give positive numbers, e.g. 8,32,128");
            }
            o.concurrency = c.clone();
        }
        if !self.apis.is_empty() {
            o.apis = self
                .apis
                .iter()
                .map(|a| api(a))
                .collect::<anyhow::Result<_>>()?;
        }
        if !self.stores.is_empty() {
            o.stores = self
                .stores
                .iter()
                .map(|s| store(s))
                .collect::<anyhow::Result<_>>()?;
        }
        if let Some(c) = &self.churn {
            o.churn = parse_fraction("--churn", c)?;
        }
        o.churn_every = self.churn_every.unwrap_or(o.churn_every);
        o.churn_down = self.churn_down.unwrap_or(o.churn_down);
        if let Some(h) = self.heartbeat {
            o.heartbeat = h;
            o.lost_timeout = o.lost_timeout.max(h * 5);
        }
        if !matches!(self.default_consistency.as_str(), "fast" | "strong") {
            bail!(
                "--default-consistency {:?}: fast or strong",
                self.default_consistency
            );
        }
        o.default_consistency = self.default_consistency.clone();
        o.latency = self.latency.parse::<Latency>()?;
        o.failure_rate = parse_fraction("--failure-rate", &self.failure_rate)?;
        o.failover = !self.no_failover;
        if o.agents == 0 || o.sandboxes == 0 {
            bail!("--agents and --sandboxes must be at least 1");
        }
        Ok(o)
    }
}

fn api(s: &str) -> anyhow::Result<Api> {
    Api::ALL
        .into_iter()
        .find(|a| a.name() == s)
        .with_context(|| format!("--api {s:?}: fastpath-v2, native-fast or native-strong"))
}

fn store(s: &str) -> anyhow::Result<StoreKind> {
    match s {
        "redb" => Ok(StoreKind::Embedded),
        "kube" => Ok(StoreKind::Kubernetes),
        _ => bail!("--store {s:?}: redb or kube"),
    }
}

/// Runs the scale harness as `args` say; prints the markdown report.
pub async fn main(args: ScaleArgs) -> anyhow::Result<()> {
    let opts = args.options()?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let r = super::run(&opts, &command).await.context("scale run")?;
    report::write_all(&r, &opts.out_dir).context("writing scale results")?;
    print!("{}", report::markdown(&r));
    eprintln!("results in {}", opts.out_dir.display());
    if let Some(s) = r.stores.iter().find(|s| s.error.is_some()) {
        bail!(
            "{} store stopped early: {}",
            s.store.name(),
            s.error.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}
