//! The scenarios of one run: sequential creates, bursts, churn, SDK creates.

use std::time::Instant;

use crate::machine::{self, Machine};
use crate::progress::Progress;
use crate::systems::{Bench, System};
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
    pub seconds: f64,
}

const BURST_SYSTEMS: [System; 3] = [
    System::AgentExecd,
    System::FastPathFast,
    System::FastPathStrong,
];

pub async fn run(opts: &Options) -> Result<RunOutput> {
    let started = Instant::now();
    let machine = machine::describe();
    let mut bench = Bench::start(&opts.runtime).await?;
    let mut enabled: Vec<System> = System::ALL.to_vec();
    let mut skipped = Vec::new();
    let mut retried = Vec::new();
    let mut samples = Vec::new();
    let mut bursts = Vec::new();
    let total = (opts.iterations as u64 + 1) * enabled.len() as u64
        + BURST_SYSTEMS.len() as u64
        + opts.churn as u64
        + u64::from(opts.sdk_rounds > 0);
    let mut progress = Progress::new(total, opts.progress);

    // Iteration 0 is a warm-up and is not recorded: the first create of
    // each system pays one-time costs (page cache, first shim binary load).
    for i in 0..=opts.iterations {
        // Interleaved: every system once per iteration, so that a slow
        // moment of the machine hits all of them alike.
        let mut order = enabled.clone();
        // The limits pair is compared sample by sample; in a fixed order the
        // second would always follow the first's teardown on the same agent,
        // which measured 0.5–2 % slower. Alternating who goes first spreads
        // that over both. Even iterations swap, so the first recorded one
        // (1) keeps the table's order.
        if i % 2 == 0 {
            swap(&mut order, System::NativeFast, System::NativeFastLimits);
        }
        for system in order {
            progress.step(&format!("sequential {i}: {}", system.name()));
            // One retry under a fresh id: a transient failure of one create
            // must not drop a baseline from the whole run. Every failure is
            // reported (`retried`), and a second one in a row drops the system.
            let mut outcome = None;
            for attempt in 0..2 {
                let id = match attempt {
                    0 => format!("seq{i}-{}", short(system)),
                    _ => format!("seq{i}-{}-retry", short(system)),
                };
                let result = bench.create(system, &id).await;
                if let Err(e) = bench.remove(system, &id).await {
                    tracing::debug!(system = system.name(), %id, error = %e, "cleanup failed");
                }
                match result {
                    Ok(m) => {
                        outcome = Some(Ok(m));
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(system = system.name(), attempt, error = %e, "create failed");
                        retried.push(Skipped {
                            system: format!("{} (iteration {i})", system.name()),
                            reason: e.to_string(),
                        });
                        outcome = Some(Err(e));
                    }
                }
            }
            match outcome.expect("at least one attempt") {
                Ok(m) => {
                    if i > 0 {
                        samples.push(Sample {
                            scenario: "sequential".into(),
                            system: system.name().into(),
                            iteration: i,
                            total_us: m.total_us,
                            stages: m.stages,
                        });
                    }
                }
                Err(e) => {
                    tracing::warn!(system = system.name(), error = %e, "system cannot run; continuing without it");
                    skipped.push(Skipped {
                        system: system.name().into(),
                        reason: e.to_string(),
                    });
                    enabled.retain(|s| *s != system);
                }
            }
        }
    }

    for system in BURST_SYSTEMS {
        progress.step(&format!("burst x{}: {}", opts.burst, system.name()));
        if !enabled.contains(&system) {
            continue;
        }
        match bench.burst(system, opts.burst, short(system)).await {
            Ok((measured, wall_us)) => {
                for (k, m) in measured.into_iter().enumerate() {
                    samples.push(Sample {
                        scenario: format!("burst x{}", opts.burst),
                        system: system.name().into(),
                        iteration: k as u32,
                        total_us: m.total_us,
                        stages: m.stages,
                    });
                }
                bursts.push(Burst {
                    system: system.name().into(),
                    concurrency: opts.burst,
                    wall_us,
                });
            }
            Err(e) => skipped.push(Skipped {
                system: format!("{} (burst)", system.name()),
                reason: e.to_string(),
            }),
        }
    }

    // Churn: the whole life of a sandbox as an agent framework uses it.
    let churn_system = System::FastPathFast;
    for i in 0..opts.churn {
        progress.step(&format!("churn {i}"));
        if !enabled.contains(&churn_system) {
            continue;
        }
        let id = format!("churn{i}");
        let t = Instant::now();
        let round = async {
            bench.create(churn_system, &id).await?;
            let created = t.elapsed().as_micros() as u64;
            bench.run_command(churn_system, &id).await?;
            let commanded = t.elapsed().as_micros() as u64;
            bench.remove(churn_system, &id).await?;
            Ok::<_, crate::BenchError>(vec![
                ("created".to_string(), created),
                ("first_command_done".to_string(), commanded),
            ])
        };
        match round.await {
            Ok(stages) => samples.push(Sample {
                scenario: "churn".into(),
                system: churn_system.name().into(),
                iteration: i,
                total_us: t.elapsed().as_micros() as u64,
                stages,
            }),
            Err(e) => {
                skipped.push(Skipped {
                    system: format!("{} (churn)", churn_system.name()),
                    reason: e.to_string(),
                });
                let _ = bench.remove(churn_system, &id).await;
                break;
            }
        }
    }
    // SDK end-to-end: the official OpenSandbox SDK against sandbolt's
    // lifecycle adapter (both backends) and the OpenSandbox server.
    if opts.sdk_rounds > 0 {
        progress.step(&format!("sdk create x{}", opts.sdk_rounds));
        let sdk = crate::sdk::run(&bench, opts.sdk_rounds).await;
        samples.extend(sdk.samples);
        skipped.extend(sdk.skipped);
    }
    progress.finish();
    bench.shutdown().await;
    Ok(RunOutput {
        machine,
        options: format!(
            "iterations={} burst={} churn={} sdk_rounds={} runtime={}",
            opts.iterations, opts.burst, opts.churn, opts.sdk_rounds, opts.runtime
        ),
        samples,
        bursts,
        skipped,
        retried,
        seconds: started.elapsed().as_secs_f64(),
    })
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
