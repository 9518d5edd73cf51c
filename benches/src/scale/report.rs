//! The scale run as a markdown table and JSON.

use std::fmt::Write as _;
use std::path::Path;

use super::load::StepResult;
use super::prom::{self, Buckets};
use super::{ScaleReport, StoreReport, Takeover};
use crate::{BenchError, Result};

/// The controller's histograms read around each step.
const GRPC: &str = "sandbolt_grpc_server_request_duration_seconds";
const STAGES: &str = "sandbolt_controller_create_stage_duration_seconds";

/// A p99 the client wants under for a rate to count as sustained.
pub const SUSTAINED_P99_MS: f64 = 50.0;

/// One step with what the controller's own histograms say about it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepReport {
    #[serde(flatten)]
    pub result: StepResult,
    /// Upper bound of the bucket holding the p99 of the controller's
    /// CreateSandbox server time (gRPC layer), ms.
    pub server_p99_ms: Option<f64>,
    /// Same for the `place` stage (allocation).
    pub place_p99_ms: Option<f64>,
    /// Same for one record write of a create.
    pub record_p99_ms: Option<f64>,
}

fn bound_ms(b: &Buckets) -> Option<f64> {
    b.quantile_bound(0.99).map(|s| s * 1000.0)
}

impl StepReport {
    /// `result` with the histograms' change between the scrapes `before`
    /// and `after`.
    pub fn new(result: StepResult, before: &str, after: &str) -> Self {
        let delta = |name: &str, want: &[(&str, &str)]| {
            prom::histogram(after, name, want).since(&prom::histogram(before, name, want))
        };
        StepReport {
            server_p99_ms: bound_ms(&delta(GRPC, &[("method", "CreateSandbox")])),
            place_p99_ms: bound_ms(&delta(STAGES, &[("stage", "place")])),
            record_p99_ms: bound_ms(&delta(STAGES, &[("stage", "record")])),
            result,
        }
    }

    pub fn line(&self) -> String {
        let r = &self.result;
        format!(
            "{:>13} c={:<4} ok {:>6} failed attempts {:>4} unanswered {} | {:>7.0}/s p50 {:>6.1} ms p99 {:>7.1} ms | server p99 ≤ {} place p99 ≤ {} record p99 ≤ {}",
            r.api.name(),
            r.concurrency,
            r.ok,
            r.failed_total(),
            r.unanswered,
            r.creates_per_s,
            r.p50_ms,
            r.p99_ms,
            opt_ms(self.server_p99_ms),
            opt_ms(self.place_p99_ms),
            opt_ms(self.record_p99_ms),
        )
    }
}

fn opt_ms(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_infinite() => "> max bucket".into(),
        Some(x) => format!("{x:.1} ms"),
        None => "–".into(),
    }
}

impl StoreReport {
    /// The fastest step whose client p99 stayed under 50 ms.
    pub fn sustained(&self) -> Option<&StepReport> {
        self.steps
            .iter()
            .filter(|s| s.result.p99_ms < SUSTAINED_P99_MS && s.result.ok > 0)
            .max_by(|a, b| a.result.creates_per_s.total_cmp(&b.result.creates_per_s))
    }

    /// Controller RSS growth per 10,000 records (first to last sample).
    pub fn rss_per_10k_mib(&self) -> Option<f64> {
        let (a, b) = (self.rss.first()?, self.rss.last()?);
        if b.records <= a.records {
            return None;
        }
        let grew = b.rss_bytes as f64 - a.rss_bytes as f64;
        Some(grew / (b.records - a.records) as f64 * 10_000.0 / (1 << 20) as f64)
    }
}

fn takeover(out: &mut String, what: &str, t: &Option<Takeover>) {
    match t {
        Some(t) => {
            let _ = writeln!(
                out,
                "- {what} at {} records: serving after {:.2} s, first create after {:.2} s; listed {} ({} answered creates missing)",
                t.records, t.serving_s, t.first_create_s, t.listed, t.missing
            );
        }
        None => {
            let _ = writeln!(out, "- {what}: not run");
        }
    }
}

fn store_markdown(out: &mut String, s: &StoreReport) {
    let _ = writeln!(out, "\n### {} store, {} agents\n", s.store.name(), s.agents);
    let _ = writeln!(
        out,
        "| API | concurrency | created | failed attempts (retried) | unanswered | creates/s | p50 ms | p99 ms | server p99 ≤ ms | place p99 ≤ ms | record p99 ≤ ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for st in &s.steps {
        let r = &st.result;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.0} | {:.1} | {:.1} | {} | {} | {} |",
            r.api.name(),
            r.concurrency,
            r.ok,
            r.failed_total(),
            r.unanswered,
            r.creates_per_s,
            r.p50_ms,
            r.p99_ms,
            opt_ms(st.server_p99_ms).trim_end_matches(" ms"),
            opt_ms(st.place_p99_ms).trim_end_matches(" ms"),
            opt_ms(st.record_p99_ms).trim_end_matches(" ms"),
        );
    }
    let _ = writeln!(out);
    match s.sustained() {
        Some(st) => {
            let _ = writeln!(
                out,
                "- sustained at client p99 < {SUSTAINED_P99_MS} ms: {:.0} creates/s ({} at concurrency {})",
                st.result.creates_per_s,
                st.result.api.name(),
                st.result.concurrency
            );
        }
        None => {
            let _ = writeln!(
                out,
                "- no step kept its client p99 under {SUSTAINED_P99_MS} ms"
            );
        }
    }
    if let (Some(per), Some(last)) = (s.rss_per_10k_mib(), s.rss.last()) {
        let _ = writeln!(
            out,
            "- controller RSS: {:.1} MiB at {} records, {per:.1} MiB per 10,000 records",
            last.rss_bytes as f64 / (1 << 20) as f64,
            last.records
        );
    }
    let _ = writeln!(
        out,
        "- after the ramp: {} records listed, {} answered creates missing; agents hold {}",
        s.listed_after_load, s.missing_after_load, s.held
    );
    for st in s.steps.iter().filter(|st| st.result.failed_total() > 0) {
        for (code, msg) in &st.result.failure_samples {
            let msg: String = msg.chars().take(160).collect();
            let _ = writeln!(
                out,
                "- {} at concurrency {}: {} failed attempts × {code} (retried), e.g. \"{msg}\"",
                st.result.api.name(),
                st.result.concurrency,
                st.result.failed.get(code).copied().unwrap_or_default(),
            );
        }
    }
    takeover(out, "rebuild (restart)", &s.rebuild);
    takeover(out, "leader failover (SIGKILL)", &s.failover);
    let f = &s.fleet;
    let _ = writeln!(
        out,
        "- sim agents: {} creates, {} heartbeats ({} failed), {} stops / {} restarts, {} over capacity",
        f.creates, f.heartbeats, f.heartbeat_failures, f.stops, f.restarts, f.overcommits
    );
    if let Some(e) = &s.error {
        let _ = writeln!(out, "- **stopped early**: {e}");
    }
}

pub fn markdown(r: &ScaleReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Scale run: {} agents, {} sandboxes per store, churn {:.0} %\n\n`{}`\n\ncontroller binary: `{}`",
        r.agents,
        r.sandboxes,
        r.churn * 100.0,
        r.command,
        r.binary
    );
    for s in &r.stores {
        store_markdown(&mut out, s);
    }
    out
}

/// `scale.md` and `scale.json` in `dir`.
pub fn write_all(r: &ScaleReport, dir: &Path) -> Result<()> {
    let io = |path: std::path::PathBuf| move |source| BenchError::Io { path, source };
    let md = dir.join("scale.md");
    std::fs::write(&md, markdown(r)).map_err(io(md.clone()))?;
    let json = dir.join("scale.json");
    let text = serde_json::to_string_pretty(r)
        .map_err(|e| BenchError::system("harness", format!("scale.json: {e}")))?;
    std::fs::write(&json, text).map_err(io(json.clone()))?;
    Ok(())
}
