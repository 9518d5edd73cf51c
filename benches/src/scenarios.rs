//! The scenarios of one run: sequential creates, bursts, churn, SDK creates.

use std::time::Instant;

use crate::machine::{self, Machine};
use crate::progress::Progress;
use crate::systems::{Bench, Measured, System};
use crate::{Options, Result, Sample, Skipped};

/// Burst results: how many at once, how long the whole burst took.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Burst {
    pub system: String,
    pub concurrency: u32,
    pub wall_us: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct RunOutput {
    pub machine: Machine,
    pub options: String,
    pub samples: Vec<Sample>,
    pub bursts: Vec<Burst>,
    pub skipped: Vec<Skipped>,
    /// Creates that failed once and were retried (reported, not hidden).
    pub retried: Vec<Skipped>,
    /// Facts of the run the tables do not show (e.g. how many warm creates
    /// were claims).
    pub notes: Vec<String>,
    pub seconds: f64,
}

const BURST_SYSTEMS: [System; 3] = [
    System::AgentExecd,
    System::FastPathFast,
    System::FastPathStrong,
];

/// Runs every scenario of `opts` on one freshly started [`Bench`].
pub async fn run(opts: &Options) -> Result<RunOutput> {
    let started = Instant::now();
    let machine = machine::describe();
    let bench = Bench::start(&opts.runtime).await?;
    let enabled: Vec<System> = System::ALL.to_vec();
    let steps = |scenario: &str, n: u64| if opts.runs(scenario) { n } else { 0 };
    let total = steps(
        "sequential",
        (opts.iterations as u64 + 1) * enabled.len() as u64,
    ) + steps("burst", BURST_SYSTEMS.len() as u64)
        + steps("churn", opts.churn as u64)
        + steps("sdk", u64::from(opts.sdk_rounds > 0))
        + steps("warm", u64::from(opts.warm_rounds > 0))
        + steps("snapshots", u64::from(opts.snapshot_rounds > 0))
        + steps("telemetry", u64::from(opts.telemetry_rounds > 0))
        + steps("runtimes", u64::from(opts.runtime_rounds > 0));
    let mut run = Run {
        bench,
        enabled,
        progress: Progress::new(total, opts.progress),
        samples: Vec::new(),
        bursts: Vec::new(),
        skipped: Vec::new(),
        retried: Vec::new(),
        notes: Vec::new(),
    };
    if opts.runs("sequential") {
        run.sequential(opts.iterations).await;
    }
    if opts.runs("burst") {
        run.bursts(opts.burst).await;
    }
    if opts.runs("churn") {
        run.churn(opts.churn).await;
    }
    if opts.runs("sdk") {
        run.sdk(opts.sdk_rounds).await;
    }
    if opts.runs("warm") {
        run.warm(opts).await;
    }
    if opts.runs("snapshots") {
        run.snapshots(opts).await;
    }
    if opts.runs("telemetry") {
        run.telemetry(opts.telemetry_rounds).await;
    }
    if opts.runs("runtimes") {
        run.runtimes(opts.runtime_rounds).await;
    }
    run.progress.finish();
    run.bench.shutdown().await;
    Ok(RunOutput {
        machine,
        options: format!(
            "iterations={} burst={} churn={} sdk_rounds={} warm_rounds={} warm_burst={} snapshot_rounds={} snapshot_sizes_mib={:?} telemetry_rounds={} runtime_rounds={} scenarios={} runtime={}",
            opts.iterations,
            opts.burst,
            opts.churn,
            opts.sdk_rounds,
            opts.warm_rounds,
            opts.warm_burst,
            opts.snapshot_rounds,
            opts.snapshot_sizes_mib,
            opts.telemetry_rounds,
            opts.runtime_rounds,
            if opts.scenarios.is_empty() {
                "all".to_string()
            } else {
                opts.scenarios.join(",")
            },
            opts.runtime
        ),
        samples: run.samples,
        bursts: run.bursts,
        skipped: run.skipped,
        retried: run.retried,
        notes: run.notes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// One run in progress: the systems still in it and what it measured.
struct Run {
    bench: Bench,
    /// Systems not dropped after failing twice in a row.
    enabled: Vec<System>,
    progress: Progress,
    samples: Vec<Sample>,
    bursts: Vec<Burst>,
    skipped: Vec<Skipped>,
    retried: Vec<Skipped>,
    notes: Vec<String>,
}

impl Run {
    /// `iterations` rounds of one create per system, after a warm-up round.
    async fn sequential(&mut self, iterations: u32) {
        // Iteration 0 is a warm-up and is not recorded: the first create of
        // each system pays one-time costs (page cache, first shim binary load).
        for i in 0..=iterations {
            // Interleaved: every system once per iteration, so that a slow
            // moment of the machine hits all of them alike.
            let mut order = self.enabled.clone();
            // The limits pair is compared sample by sample; in a fixed order the
            // second would always follow the first's teardown on the same agent,
            // which measured 0.5–2 % slower. Alternating who goes first spreads
            // that over both. Even iterations swap, so the first recorded one
            // (1) keeps the table's order.
            if i % 2 == 0 {
                swap(&mut order, System::NativeFast, System::NativeFastLimits);
            }
            for system in order {
                self.progress
                    .step(&format!("sequential {i}: {}", system.name()));
                match self.create_with_one_retry(system, i).await {
                    Ok(m) if i > 0 => self.samples.push(Sample {
                        scenario: "sequential".into(),
                        system: system.name().into(),
                        iteration: i,
                        total_us: m.total_us,
                        stages: m.stages,
                    }),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(system = system.name(), error = %e, "system cannot run; continuing without it");
                        self.skipped.push(Skipped {
                            system: system.name().into(),
                            reason: e.to_string(),
                        });
                        self.enabled.retain(|s| *s != system);
                    }
                }
            }
        }
    }

    /// One timed create (and untimed removal) on `system`, retried once
    /// under a fresh id: a transient failure of one create must not drop a
    /// baseline from the whole run. Every failure is reported (`retried`);
    /// the second one in a row is returned. Not `backon`: each attempt has
    /// its own id and its own report, and there is no delay to back off.
    async fn create_with_one_retry(&mut self, system: System, i: u32) -> Result<Measured> {
        let mut last = None;
        for id in [
            format!("seq{i}-{}", short(system)),
            format!("seq{i}-{}-retry", short(system)),
        ] {
            let result = self.bench.create(system, &id).await;
            if let Err(e) = self.bench.remove(system, &id).await {
                tracing::debug!(system = system.name(), %id, error = %e, "cleanup failed");
            }
            match result {
                Ok(m) => return Ok(m),
                Err(e) => {
                    tracing::warn!(system = system.name(), %id, error = %e, "create failed");
                    self.retried.push(Skipped {
                        system: format!("{} (iteration {i})", system.name()),
                        reason: e.to_string(),
                    });
                    last = Some(e);
                }
            }
        }
        Err(last.expect("two attempts"))
    }

    /// `size` creates at once on each burst system.
    async fn bursts(&mut self, size: u32) {
        for system in BURST_SYSTEMS {
            self.progress
                .step(&format!("burst x{size}: {}", system.name()));
            if !self.enabled.contains(&system) {
                continue;
            }
            match self.bench.burst(system, size, short(system)).await {
                Ok((measured, wall_us)) => {
                    for (k, m) in measured.into_iter().enumerate() {
                        self.samples.push(Sample {
                            scenario: format!("burst x{size}"),
                            system: system.name().into(),
                            iteration: k as u32,
                            total_us: m.total_us,
                            stages: m.stages,
                        });
                    }
                    self.bursts.push(Burst {
                        system: system.name().into(),
                        concurrency: size,
                        wall_us,
                    });
                }
                Err(e) => self.skipped.push(Skipped {
                    system: format!("{} (burst)", system.name()),
                    reason: e.to_string(),
                }),
            }
        }
    }

    /// Churn: the whole life of a sandbox as an agent framework uses it
    /// (create, first command, delete), `rounds` times.
    async fn churn(&mut self, rounds: u32) {
        let system = System::FastPathFast;
        for i in 0..rounds {
            self.progress.step(&format!("churn {i}"));
            if !self.enabled.contains(&system) {
                continue;
            }
            let id = format!("churn{i}");
            let t = Instant::now();
            match self.churn_round(system, &id, t).await {
                Ok(stages) => self.samples.push(Sample {
                    scenario: "churn".into(),
                    system: system.name().into(),
                    iteration: i,
                    total_us: t.elapsed().as_micros() as u64,
                    stages,
                }),
                Err(e) => {
                    self.skipped.push(Skipped {
                        system: format!("{} (churn)", system.name()),
                        reason: e.to_string(),
                    });
                    let _ = self.bench.remove(system, &id).await;
                    break;
                }
            }
        }
    }

    async fn churn_round(
        &mut self,
        system: System,
        id: &str,
        t: Instant,
    ) -> Result<Vec<(String, u64)>> {
        self.bench.create(system, id).await?;
        let created = t.elapsed().as_micros() as u64;
        self.bench.run_command(system, id).await?;
        let commanded = t.elapsed().as_micros() as u64;
        self.bench.remove(system, id).await?;
        Ok(vec![
            ("created".to_string(), created),
            ("first_command_done".to_string(), commanded),
        ])
    }

    /// SDK end-to-end: the official OpenSandbox SDK against sandbolt's
    /// lifecycle adapter (both backends) and the OpenSandbox server.
    async fn sdk(&mut self, rounds: u32) {
        if rounds == 0 {
            return;
        }
        self.progress.step(&format!("sdk create x{rounds}"));
        let sdk = crate::sdk::run(&self.bench, rounds).await;
        self.samples.extend(sdk.samples);
        self.skipped.extend(sdk.skipped);
    }

    /// Warm pools (issue 17): claims against cold creates per API, the SDK
    /// warm vs cold vs its floor, and a burst with a buffer as large.
    async fn warm(&mut self, opts: &Options) {
        if opts.warm_rounds == 0 {
            return;
        }
        self.progress.step(&format!(
            "warm pools x{} (burst {})",
            opts.warm_rounds, opts.warm_burst
        ));
        let warm = crate::warm::run(
            &self.bench,
            opts.warm_rounds,
            opts.sdk_rounds,
            opts.warm_burst,
        )
        .await;
        self.samples.extend(warm.samples);
        self.bursts.extend(warm.bursts);
        self.skipped.extend(warm.skipped);
        self.notes.extend(warm.notes);
    }

    /// Sandbox snapshots (issue 18): capture latency and pause window per
    /// size of changes, and create-from-snapshot vs cold create.
    async fn snapshots(&mut self, opts: &Options) {
        if opts.snapshot_rounds == 0 {
            return;
        }
        self.progress.step(&format!(
            "snapshots x{} (sizes {:?} MiB)",
            opts.snapshot_rounds, opts.snapshot_sizes_mib
        ));
        let snapshots =
            crate::snapshot::run(&self.bench, opts.snapshot_rounds, &opts.snapshot_sizes_mib).await;
        self.samples.extend(snapshots.samples);
        self.skipped.extend(snapshots.skipped);
        self.notes.extend(snapshots.notes);
    }

    /// Telemetry (issue 20): cold creates and deletes with OTLP span export
    /// and scraping on vs off, interleaved round by round.
    async fn telemetry(&mut self, rounds: u32) {
        if rounds == 0 {
            return;
        }
        self.progress.step(&format!("telemetry on/off x{rounds}"));
        let telemetry = crate::telemetry::run(&self.bench, rounds).await;
        self.samples.extend(telemetry.samples);
        self.skipped.extend(telemetry.skipped);
        self.notes.extend(telemetry.notes);
    }
}

impl Run {
    /// OCI runtimes (issue 24): runc vs runsc on pools of their own,
    /// interleaved round by round.
    async fn runtimes(&mut self, rounds: u32) {
        if rounds == 0 {
            return;
        }
        self.progress
            .step(&format!("runtimes runc vs runsc x{rounds}"));
        let out = crate::runtimes::run(&self.bench, rounds).await;
        self.samples.extend(out.samples);
        self.skipped.extend(out.skipped);
        self.notes.extend(out.notes);
    }
}

/// Exchanges the places of `a` and `b` in `order` (when both are there).
fn swap(order: &mut [System], a: System, b: System) {
    let find = |s| order.iter().position(|x| *x == s);
    if let (Some(x), Some(y)) = (find(a), find(b)) {
        order.swap(x, y);
    }
}

fn short(system: System) -> &'static str {
    match system {
        System::ContainerdRaw => "raw",
        System::CtrRun => "ctr",
        System::Docker => "docker",
        System::Agent => "agent",
        System::AgentExecd => "agentx",
        System::FastPathFast => "fast",
        System::FastPathStrong => "strong",
        System::NativeFast => "native",
        System::NativeFastLimits => "nativelim",
    }
}
