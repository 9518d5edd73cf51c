//! `sandbolt-bench`: runs the latency harness and writes its results.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use sandbolt_benches::{Options, report, scenarios};

/// sandbolt's latency harness: sandbolt and its baselines (containerd API,
/// `ctr run -d`, Docker) on a private test bed, interleaved in one run.
/// Writes results.md, samples.csv, samples.json and latency.png.
#[derive(Debug, Parser)]
#[command(
    name = "sandbolt-bench",
    version,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Small run (about a minute) that proves the harness works; it says
    /// nothing about speed.
    #[arg(long)]
    quick: bool,
    /// Sequential creates per system (overrides the mode's default).
    #[arg(long)]
    iterations: Option<u32>,
    /// Concurrency of the burst scenario.
    #[arg(long)]
    burst: Option<u32>,
    /// Create → command → delete rounds.
    #[arg(long)]
    churn: Option<u32>,
    /// Rounds of the official SDK's `Sandbox.create` on each lifecycle and
    /// on the OpenSandbox server (0 leaves the scenario out).
    #[arg(long)]
    sdk_rounds: Option<u32>,
    /// Sequential rounds of the warm pools scenario (0 leaves it out).
    #[arg(long)]
    warm_rounds: Option<u32>,
    /// Creates at once in the warm pools burst, with a buffer of as many.
    #[arg(long)]
    warm_burst: Option<u32>,
    /// Captures per size in the snapshots scenario, and its rounds of
    /// create-from-snapshot vs cold create (0 leaves it out).
    #[arg(long)]
    snapshot_rounds: Option<u32>,
    /// MiB of changes in the snapshotted sandboxes, comma-separated
    /// (default: 1 with --quick, else 1,100,1024).
    #[arg(long, value_delimiter = ',')]
    snapshot_sizes_mib: Option<Vec<u64>>,
    /// Rounds of the telemetry scenario: creates with OTLP span export and
    /// scraping on vs off, interleaved (0 leaves it out).
    #[arg(long)]
    telemetry_rounds: Option<u32>,
    /// Rounds of the runtimes scenario: runc vs runsc (gVisor), each on a
    /// pool of its own with sandbox networking — create → READY, exec and
    /// 1 MiB file round trips, idle memory per sandbox (default: 0 with
    /// --quick, else 20; 0 leaves it out).
    #[arg(long)]
    runtime_rounds: Option<u32>,
    /// Run only these scenarios (sequential, burst, churn, sdk, warm,
    /// snapshots, telemetry, runtimes; repeatable or comma-separated);
    /// default all.
    #[arg(long = "scenario", value_delimiter = ',')]
    scenarios: Vec<String>,
    /// OCI runtime of sandbolt's agents: runc, crun or runsc (one that
    /// cannot run on this machine is reported as such).
    #[arg(long, default_value = "runc")]
    runtime: String,
    /// Where to write the results.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

/// Harnesses other than the latency one.
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// The controller at scale against simulated agents (issue 25); see
    /// `sandbolt-bench scale --help`.
    Scale(sandbolt_benches::scale::cli::ScaleArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The telemetry scenario switches OTLP span export on and off in this
    // process's subscriber, so the harness installs it.
    sandbolt_benches::telemetry::init_tracing();
    let args = Args::parse();
    if let Some(Command::Scale(scale)) = args.command {
        return sandbolt_benches::scale::cli::main(scale).await;
    }
    let mut opts = if args.quick {
        Options::quick(args.out.clone())
    } else {
        Options::full(args.out.clone())
    };
    opts.iterations = args.iterations.unwrap_or(opts.iterations);
    opts.burst = args.burst.unwrap_or(opts.burst);
    opts.churn = args.churn.unwrap_or(opts.churn);
    opts.sdk_rounds = args.sdk_rounds.unwrap_or(opts.sdk_rounds);
    opts.warm_rounds = args.warm_rounds.unwrap_or(opts.warm_rounds);
    opts.warm_burst = args.warm_burst.unwrap_or(opts.warm_burst);
    opts.snapshot_rounds = args.snapshot_rounds.unwrap_or(opts.snapshot_rounds);
    if let Some(sizes) = args.snapshot_sizes_mib {
        opts.snapshot_sizes_mib = sizes;
    }
    opts.telemetry_rounds = args.telemetry_rounds.unwrap_or(opts.telemetry_rounds);
    opts.runtime_rounds = args.runtime_rounds.unwrap_or(opts.runtime_rounds);
    if let Some(unknown) = args
        .scenarios
        .iter()
        .find(|s| !sandbolt_benches::SCENARIOS.contains(&s.as_str()))
    {
        anyhow::bail!(
            "unknown scenario {unknown:?}; known: {}",
            sandbolt_benches::SCENARIOS.join(", ")
        );
    }
    opts.scenarios = args.scenarios;
    opts.runtime = args.runtime;
    opts.progress = std::io::IsTerminal::is_terminal(&std::io::stderr()) || !args.quick;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let out = scenarios::run(&opts).await.context("benchmark run")?;
    report::write_all(&out, &opts.out_dir, &command).context("writing results")?;
    print!("{}", report::markdown(&out, &command));
    eprintln!("results in {}", opts.out_dir.display());
    Ok(())
}
