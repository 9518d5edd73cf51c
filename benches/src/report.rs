//! Markdown table, raw samples (CSV and JSON) and headline ratios.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::scenarios::RunOutput;
use crate::stats::{Summary, ms, paired_ratio, summarize};
use crate::systems::System;
use crate::{BenchError, Result};

/// (scenario, system) → summary of total latency, in first-seen order.
pub fn summaries(out: &RunOutput) -> Vec<(String, String, Summary)> {
    let mut order: Vec<(String, String)> = Vec::new();
    let mut groups: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    for s in &out.samples {
        let key = (s.scenario.clone(), s.system.clone());
        if !groups.contains_key(&key) {
            order.push(key.clone());
        }
        groups.entry(key).or_default().push(s.total_us);
    }
    order
        .into_iter()
        .filter_map(|k| {
            let sum = summarize(groups[&k].iter().copied())?;
            Some((k.0, k.1, sum))
        })
        .collect()
}

fn p50(out: &RunOutput, system: System) -> Option<u64> {
    summaries(out)
        .into_iter()
        .find(|(sc, sy, _)| sc == "sequential" && sy == system.name())
        .map(|(_, _, s)| s.p50_us)
}

/// Ratios of p50 create latency that answer the project's questions.
pub fn ratios(out: &RunOutput) -> Vec<(String, f64)> {
    let pairs = [
        (System::Agent, System::CtrRun),
        (System::Agent, System::ContainerdRaw),
        (System::AgentExecd, System::Docker),
        (System::FastPathFast, System::Docker),
        (System::FastPathFast, System::CtrRun),
        (System::FastPathStrong, System::FastPathFast),
        // Issue 13: what resource limits cost at create (goal ≤ 1.02×).
        (System::NativeFastLimits, System::NativeFast),
        (System::NativeFast, System::FastPathFast),
    ];
    let mut ratios: Vec<(String, f64)> = pairs
        .iter()
        .filter_map(|(a, b)| {
            let (x, y) = (p50(out, *a)?, p50(out, *b)?);
            Some((format!("{} ÷ {}", a.name(), b.name()), x as f64 / y as f64))
        })
        .collect();
    ratios.extend(crate::sdk::ratios(&out.samples));
    ratios.extend(crate::warm::ratios(&out.samples));
    ratios.extend(crate::snapshot::ratios(&out.samples));
    ratios.extend(crate::telemetry::ratios(&out.samples));
    ratios.extend(crate::runtimes::ratios(&out.samples));
    ratios
}

/// Issue 13's comparisons, each in the same run: (scenario, system with
/// limits, the same system without).
pub fn limit_pairs() -> [(&'static str, &'static str, &'static str); 2] {
    [
        (
            "sequential",
            System::NativeFastLimits.name(),
            System::NativeFast.name(),
        ),
        (
            crate::sdk::SCENARIO_CREATE,
            crate::sdk::LIFECYCLE_FASTPATH_LIMITS,
            crate::sdk::LIFECYCLE_FASTPATH_NO_LIMITS,
        ),
    ]
}

/// One row per limits pair measured: p50/p90 of both, their ratios, and
/// the median of the per-iteration ratios (the least noisy of the three).
fn limits_table(out: &RunOutput) -> String {
    let all = summaries(out);
    let find = |scenario: &str, system: &str| {
        all.iter()
            .find(|(sc, sy, _)| sc == scenario && sy == system)
            .map(|(_, _, s)| *s)
    };
    let mut md = String::new();
    for (scenario, with, without) in limit_pairs() {
        let (Some(w), Some(wo)) = (find(scenario, with), find(scenario, without)) else {
            continue;
        };
        let paired = paired_ratio(&out.samples, scenario, with, without)
            .map(|(r, n)| format!("{r:.3}× (n={n})"))
            .unwrap_or_else(|| "–".into());
        let _ = writeln!(
            md,
            "| {scenario} | {without} | {:.1} / {:.1} | {:.1} / {:.1} | {:.3}× | {:.3}× | {paired} |",
            ms(wo.p50_us),
            ms(wo.p90_us),
            ms(w.p50_us),
            ms(w.p90_us),
            w.p50_us as f64 / wo.p50_us as f64,
            w.p90_us as f64 / wo.p90_us as f64,
        );
    }
    md
}

pub fn markdown(out: &RunOutput, command: &str) -> String {
    let m = &out.machine;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Command: `{command}` ({}; {:.0} s)\n",
        out.options, out.seconds
    );
    let _ = writeln!(
        md,
        "Machine: {} · {} cores · {:.1} GiB · Linux {} · {} · {} · {}\n",
        m.cpu,
        m.cores,
        m.memory_gib,
        m.kernel,
        m.containerd,
        m.runc.replace('\n', " "),
        m.docker
    );
    let _ = writeln!(
        md,
        "| scenario | system | n | p50 ms | p90 ms | p95 ms | p99 ms | max ms |"
    );
    let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|");
    for (scenario, system, s) in summaries(out) {
        let _ = writeln!(
            md,
            "| {scenario} | {system} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            s.count,
            ms(s.p50_us),
            ms(s.p90_us),
            ms(s.p95_us),
            ms(s.p99_us),
            ms(s.max_us)
        );
    }
    let stages = stage_table(out);
    if !stages.is_empty() {
        let _ = writeln!(
            md,
            "\nStage timings (p50, ms from the start of the create):\n"
        );
        let _ = writeln!(md, "| scenario | system | stage | p50 ms | p99 ms |");
        let _ = writeln!(md, "|---|---|---|---:|---:|");
        md.push_str(&stages);
    }
    if !out.bursts.is_empty() {
        let _ = writeln!(md, "\nBursts (all creates at once):\n");
        let _ = writeln!(md, "| system | concurrency | wall ms | sandboxes/s |");
        let _ = writeln!(md, "|---|---:|---:|---:|");
        for b in &out.bursts {
            let _ = writeln!(
                md,
                "| {} | {} | {:.1} | {:.1} |",
                b.system,
                b.concurrency,
                ms(b.wall_us),
                b.concurrency as f64 / (b.wall_us as f64 / 1e6)
            );
        }
    }
    let ratios = ratios(out);
    if !ratios.is_empty() {
        let _ = writeln!(md, "\nRatios of p50 (same run):\n");
        for (name, r) in ratios {
            let _ = writeln!(md, "- {name}: **{r:.2}×**");
        }
    }
    let limits = limits_table(out);
    if !limits.is_empty() {
        let _ = writeln!(
            md,
            "\nLimits vs no limits (issue 13; with limits ÷ without, same run, interleaved):\n"
        );
        let _ = writeln!(
            md,
            "| scenario | system (without limits) | without p50 / p90 ms | with p50 / p90 ms | p50 ratio | p90 ratio | median of per-iteration ratios |"
        );
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|");
        md.push_str(&limits);
    }
    if !out.notes.is_empty() {
        let _ = writeln!(md, "\nNotes:\n");
        for n in &out.notes {
            let _ = writeln!(md, "- {n}");
        }
    }
    if !out.retried.is_empty() {
        let _ = writeln!(md, "\nFailed creates, each retried once under a new id:\n");
        for s in &out.retried {
            let _ = writeln!(md, "- {}: {}", s.system, s.reason);
        }
    }
    if !out.skipped.is_empty() {
        let _ = writeln!(md, "\nNot measured:\n");
        for s in &out.skipped {
            let _ = writeln!(md, "- {}: {}", s.system, s.reason);
        }
    }
    md
}

fn stage_table(out: &RunOutput) -> String {
    let mut groups: BTreeMap<(String, String, String), Vec<u64>> = BTreeMap::new();
    for s in &out.samples {
        for (stage, us) in &s.stages {
            groups
                .entry((s.scenario.clone(), s.system.clone(), stage.clone()))
                .or_default()
                .push(*us);
        }
    }
    let mut md = String::new();
    for ((scenario, system, stage), v) in groups {
        if let Some(s) = summarize(v) {
            let _ = writeln!(
                md,
                "| {scenario} | {system} | {stage} | {:.1} | {:.1} |",
                ms(s.p50_us),
                ms(s.p99_us)
            );
        }
    }
    md
}

pub fn csv(out: &RunOutput) -> String {
    let mut csv = String::from("scenario,system,iteration,total_us,stages\n");
    for s in &out.samples {
        let stages: Vec<String> = s.stages.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            csv,
            "{},{},{},{},{}",
            s.scenario,
            s.system.replace(',', ";"),
            s.iteration,
            s.total_us,
            stages.join(";")
        );
    }
    csv
}

pub fn write_all(out: &RunOutput, dir: &Path, command: &str) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::Io {
        path: dir.into(),
        source: e,
    })?;
    let write = |name: &str, data: String| {
        let path = dir.join(name);
        std::fs::write(&path, data).map_err(|e| BenchError::Io { path, source: e })
    };
    write("results.md", markdown(out, command))?;
    write("samples.csv", csv(out))?;
    write(
        "samples.json",
        serde_json::to_string_pretty(out).expect("serializable"),
    )?;
    crate::chart::draw(out, &dir.join("latency.png"))
}
