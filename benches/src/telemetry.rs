//! Telemetry on vs off (issue 20): what an operator's switches cost a cold
//! create and its delete.
//!
//! The counting layers (`grpc_layer`, `http_layer`) are always on in the
//! servers, so they are in both conditions. What an operator switches on is
//! span export (`--otlp-endpoint`) and a scraper of `/metrics`, so:
//!
//! - **off**: the harness's own subscriber only (log lines at `warn`, or
//!   `RUST_LOG`), no span recorded for export, nobody scraping;
//! - **on**: every `info` span of the process (the `sandbolt` binary's
//!   default `--log` level) goes to `sandbolt_telemetry::otlp::layer`, which
//!   exports over OTLP/gRPC to an in-process collector, and a task GETs the
//!   controller's and the agent's `/metrics` every 100 ms.
//!
//! A fast-mode controller with one agent of its own, both with their
//! metrics registered and served by `serve_ops`, takes native creates
//! (`wait_ready`, busybox) then deletes; each round (after one warm-up)
//! does one create + delete off and one on, the order alternating, both
//! timed. Export is switched per round by a flag the export layer's filter
//! reads (a `reload` layer would hide the OpenTelemetry layer from
//! `tracing_opentelemetry`'s context look-ups, which carry `traceparent`
//! across the controller → agent hop). After each on round the exporter is
//! flushed, timed apart ([`FLUSH`]), so that no batch of it is exported
//! during an off round.

use std::any::TypeId;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::control::v1 as control;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_telemetry::otlp::{OtlpGuard, OtlpLayer};
use sandbolt_telemetry::prometheus_client::registry::Registry as MetricsRegistry;
use sandbolt_telemetry::{OpsServer, ops_router, serve_ops};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tracing::level_filters::LevelFilter;
use tracing::span;
use tracing::subscriber::Interest;
use tracing_subscriber::filter::DynFilterFn;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::Registry;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::systems::{Bench, TOKEN, native_create, wait_for_ready_agent};
use crate::{Sample, Skipped};

/// Create → Running with execd answering (native API, `wait_ready`).
pub const CREATE: &str = "telemetry: create";
/// The delete of that sandbox, right after.
pub const DELETE: &str = "telemetry: delete";
/// The exporter's flush after each on round (outside the timed create and
/// delete): the spans of one round sent to the collector.
pub const FLUSH: &str = "telemetry: OTLP flush after an on round";
pub const OFF: &str = "sandbolt native API (fast), telemetry off";
pub const ON: &str = "sandbolt native API (fast), OTLP export + /metrics every 100 ms";
const SCRAPE_EVERY: Duration = Duration::from_millis(100);
/// The level of the spans exported: the `sandbolt` binary's default `--log`.
const EXPORTED: tracing::Level = tracing::Level::INFO;

/// Whether spans are recorded for export now (read by the export layer's
/// filter on every span and event at [`EXPORTED`] or above).
static EXPORT_ON: AtomicBool = AtomicBool::new(false);
/// The OpenTelemetry layer, once the scenario has a collector to send to.
static OTLP: OnceLock<OtlpLayer<Registry>> = OnceLock::new();

/// Installs the harness's subscriber: log lines on stderr (`RUST_LOG`,
/// default `warn`) and the export layer, which records nothing until the
/// telemetry scenario switches it on. Where the process already has a
/// subscriber this one is not installed, and the telemetry scenario
/// reports that its on rounds exported nothing.
pub fn init_tracing() {
    let log = EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let export =
        DynFilterFn::new(|meta, _| *meta.level() <= EXPORTED && EXPORT_ON.load(Ordering::Relaxed))
            .with_max_level_hint(LevelFilter::from_level(EXPORTED))
            // Asked per span: the answer changes between rounds.
            .with_callsite_filter(|meta| {
                if *meta.level() <= EXPORTED {
                    Interest::sometimes()
                } else {
                    Interest::never()
                }
            });
    let installed = tracing_subscriber::registry()
        .with(ExportSwitch.with_filter(export))
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(log),
        )
        .try_init();
    if let Err(e) = installed {
        tracing::warn!(error = %e, "the harness's subscriber is not installed: no span export");
    }
}

/// Forwards to the OpenTelemetry layer in [`OTLP`] once it is there.
/// Unlike `tracing_subscriber::reload`, it also answers `downcast_raw`, by
/// which `tracing_opentelemetry` finds a span's OpenTelemetry context (the
/// layer lives in a static, so the pointer it hands out stays valid).
struct ExportSwitch;

impl Layer<Registry> for ExportSwitch {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_new_span(attrs, id, ctx);
        }
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_record(id, values, ctx);
        }
    }

    fn on_follows_from(&self, id: &span::Id, follows: &span::Id, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_follows_from(id, follows, ctx);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_event(event, ctx);
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_enter(id, ctx);
        }
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_exit(id, ctx);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, Registry>) {
        if let Some(otlp) = OTLP.get() {
            otlp.on_close(id, ctx);
        }
    }

    unsafe fn downcast_raw(&self, id: TypeId) -> Option<*const ()> {
        if id == TypeId::of::<Self>() {
            return Some(self as *const Self as *const ());
        }
        // SAFETY: forwarded to a layer in a static, never moved or dropped.
        OTLP.get().and_then(|otlp| unsafe { otlp.downcast_raw(id) })
    }
}

/// What the scenario measured, and what it could not.
#[derive(Debug, Default)]
pub struct TelemetryOutcome {
    pub samples: Vec<Sample>,
    pub skipped: Vec<Skipped>,
    pub notes: Vec<String>,
}

/// Runs `rounds` on/off rounds (after one warm-up) on a controller and
/// agent of the scenario's own.
pub async fn run(bench: &Bench, rounds: u32) -> TelemetryOutcome {
    let mut out = TelemetryOutcome::default();
    let mut setup = match Setup::start(bench).await {
        Ok(s) => s,
        Err(e) => {
            out.skipped.push(skipped(e));
            return out;
        }
    };
    if let Err(e) = setup.rounds(rounds, &mut out).await {
        out.skipped.push(skipped(e));
    }
    out.notes.extend(setup.notes());
    setup.shutdown().await;
    out
}

fn skipped(reason: String) -> Skipped {
    tracing::warn!(%reason, "telemetry: cannot measure; continuing without it");
    Skipped {
        system: "telemetry on/off".into(),
        reason,
    }
}

/// On ÷ off for the create and the delete: p50, p90 and the median of the
/// per-round ratios.
pub fn ratios(samples: &[Sample]) -> Vec<(String, f64)> {
    [CREATE, DELETE]
        .into_iter()
        .flat_map(|scenario| {
            crate::stats::ratio_rows(samples, scenario, ON, OFF, &format!("{scenario}: on ÷ off"))
        })
        .collect()
}

/// An OTLP/gRPC trace collector that counts what it receives.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.spans.fetch_add(spans as u64, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    /// Serves on a loopback port; its `http://` endpoint.
    async fn start(&self) -> Result<(String, JoinHandle<()>), String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("collector: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let service = TraceServiceServer::new(self.clone());
        let task = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
            {
                tracing::warn!(error = %e, "telemetry: the OTLP collector stopped");
            }
        });
        Ok((format!("http://{addr}"), task))
    }

    fn spans(&self) -> u64 {
        self.spans.load(Ordering::Relaxed)
    }
}

/// What the scraper did during the on rounds.
#[derive(Default)]
struct ScrapeCounts {
    ok: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
}

/// GETs every url in `urls` every [`SCRAPE_EVERY`] until aborted.
fn start_scraper(
    http: reqwest::Client,
    urls: Arc<Vec<String>>,
    counts: Arc<ScrapeCounts>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SCRAPE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for url in urls.iter() {
                let body = match http.get(url).send().await {
                    Ok(r) if r.status().is_success() => r.bytes().await.ok(),
                    _ => None,
                };
                match body {
                    Some(b) => {
                        counts.ok.fetch_add(1, Ordering::Relaxed);
                        counts.bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
                    }
                    None => {
                        counts.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    On,
}

impl Mode {
    fn system(self) -> &'static str {
        match self {
            Mode::Off => OFF,
            Mode::On => ON,
        }
    }

    fn short(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::On => "on",
        }
    }
}

/// One create + delete, timed.
struct Measured {
    create_us: u64,
    delete_us: u64,
    /// On rounds: the flush after it.
    flush_us: Option<u64>,
}

/// The scenario's controller, agent, their ops endpoints, the collector
/// and the exporter.
struct Setup {
    controller: ControllerHandle,
    agent: AgentHandle,
    ops: Vec<OpsServer>,
    native: SandboxServiceClient<Channel>,
    collector: Collector,
    collector_task: JoinHandle<()>,
    exporter: Arc<OtlpGuard>,
    http: reqwest::Client,
    scrape_urls: Arc<Vec<String>>,
    scrapes: Arc<ScrapeCounts>,
    /// Spans the collector received while export was off (should be 0).
    spans_while_off: u64,
    /// Spans per on round, as received.
    spans_per_on_round: Vec<u64>,
    _dir: tempfile::TempDir,
}

impl Setup {
    async fn start(bench: &Bench) -> Result<Setup, String> {
        let collector = Collector::default();
        let (endpoint, collector_task) = collector.start().await?;
        let (layer, exporter) = sandbolt_telemetry::otlp::layer(&endpoint, "sandbolt-bench")
            .map_err(|e| format!("OTLP exporter: {e}"))?;
        OTLP.set(layer)
            .map_err(|_| "the OTLP layer was already installed in this process".to_string())?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let (controller, controller_ops) = start_controller(dir.path()).await?;
        let (agent, agent_ops) = start_agent(bench, &controller).await?;
        let endpoint = format!("http://{}", controller.local_addr());
        let mut fastpath = FastPathServiceClient::connect(endpoint.clone())
            .await
            .map_err(|e| format!("controller: {e}"))?;
        wait_for_ready_agent(&mut fastpath)
            .await
            .map_err(|e| e.to_string())?;
        let native = SandboxServiceClient::connect(endpoint)
            .await
            .map_err(|e| format!("controller: {e}"))?;
        let scrape_urls = [&controller_ops, &agent_ops]
            .iter()
            .map(|ops| format!("http://{}/metrics", ops.local_addr()))
            .collect();
        Ok(Setup {
            controller,
            agent,
            ops: vec![controller_ops, agent_ops],
            native,
            collector,
            collector_task,
            exporter: Arc::new(exporter),
            http: reqwest::Client::new(),
            scrape_urls: Arc::new(scrape_urls),
            scrapes: Arc::default(),
            spans_while_off: 0,
            spans_per_on_round: Vec::new(),
            _dir: dir,
        })
    }

    /// Round 0 is a warm-up (not recorded); then `rounds` rounds of one
    /// off and one on, the order alternating (a create pays for whatever
    /// ran just before it on the agent).
    async fn rounds(&mut self, rounds: u32, out: &mut TelemetryOutcome) -> Result<(), String> {
        for i in 0..=rounds {
            let order = if i % 2 == 0 {
                [Mode::Off, Mode::On]
            } else {
                [Mode::On, Mode::Off]
            };
            for mode in order {
                let m = self
                    .measure(mode, &format!("tel{i}-{}", mode.short()))
                    .await?;
                if i == 0 {
                    continue;
                }
                out.samples.push(sample(CREATE, mode, i, m.create_us));
                out.samples.push(sample(DELETE, mode, i, m.delete_us));
                if let Some(flush_us) = m.flush_us {
                    out.samples.push(Sample {
                        scenario: FLUSH.into(),
                        system: ON.into(),
                        iteration: i,
                        total_us: flush_us,
                        stages: Vec::new(),
                    });
                }
            }
        }
        if self.spans_per_on_round.iter().all(|n| *n == 0) {
            return Err("the on rounds exported no span: nothing was measured".into());
        }
        Ok(())
    }

    /// One create and delete of `name` in `mode`.
    async fn measure(&mut self, mode: Mode, name: &str) -> Result<Measured, String> {
        let spans_before = self.collector.spans();
        let scraper = (mode == Mode::On).then(|| {
            EXPORT_ON.store(true, Ordering::Relaxed);
            start_scraper(
                self.http.clone(),
                self.scrape_urls.clone(),
                self.scrapes.clone(),
            )
        });
        let timed = self.create_and_delete(name).await;
        if let Some(scraper) = scraper {
            scraper.abort();
        }
        EXPORT_ON.store(false, Ordering::Relaxed);
        let (create_us, delete_us) = timed?;
        let flush_us = match mode {
            Mode::On => Some(self.flush().await?),
            Mode::Off => None,
        };
        let spans = self.collector.spans() - spans_before;
        match mode {
            Mode::On => self.spans_per_on_round.push(spans),
            Mode::Off => self.spans_while_off += spans,
        }
        Ok(Measured {
            create_us,
            delete_us,
            flush_us,
        })
    }

    async fn create_and_delete(&mut self, name: &str) -> Result<(u64, u64), String> {
        let t = Instant::now();
        self.native
            .create_sandbox(native_create(name, false))
            .await
            .map_err(|e| format!("create {name}: {e}"))?;
        let create_us = micros(t);
        let t = Instant::now();
        self.native
            .delete_sandbox(control::DeleteSandboxRequest {
                sandbox: Some(control::SandboxRef {
                    namespace: "default".into(),
                    name: name.into(),
                    expected_uid: String::new(),
                }),
            })
            .await
            .map_err(|e| format!("delete {name}: {e}"))?;
        Ok((create_us, micros(t)))
    }

    /// Exports every span ended so far; how long that took. On a blocking
    /// thread: the exporter blocks until the collector answered.
    async fn flush(&self) -> Result<u64, String> {
        let exporter = self.exporter.clone();
        let t = Instant::now();
        tokio::task::spawn_blocking(move || exporter.force_flush())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("OTLP flush: {e}"))?;
        Ok(micros(t))
    }

    fn notes(&self) -> Vec<String> {
        let mut per_round = self.spans_per_on_round.clone();
        per_round.sort_unstable();
        let median = per_round.get(per_round.len() / 2).copied().unwrap_or(0);
        let ok = self.scrapes.ok.load(Ordering::Relaxed);
        vec![format!(
            "telemetry: the collector received {} spans in {} export requests, median {median} per on round (create + delete), {} while export was off; {ok} scrapes of /metrics (controller and agent) answered, {} failed, {} bytes each on average",
            self.collector.spans(),
            self.collector.requests.load(Ordering::Relaxed),
            self.spans_while_off,
            self.scrapes.failed.load(Ordering::Relaxed),
            self.scrapes.bytes.load(Ordering::Relaxed) / ok.max(1),
        )]
    }

    async fn shutdown(self) {
        EXPORT_ON.store(false, Ordering::Relaxed);
        self.agent.shutdown().await;
        self.controller.shutdown().await;
        for ops in self.ops {
            ops.shutdown().await;
        }
        if let Ok(exporter) = Arc::try_unwrap(self.exporter) {
            let _ = tokio::task::spawn_blocking(move || exporter.shutdown()).await;
        }
        self.collector_task.abort();
    }
}

fn sample(scenario: &str, mode: Mode, iteration: u32, total_us: u64) -> Sample {
    Sample {
        scenario: scenario.into(),
        system: mode.system().into(),
        iteration,
        total_us,
        stages: Vec::new(),
    }
}

/// A fast-mode controller with its metrics registered and served.
async fn start_controller(dir: &std::path::Path) -> Result<(ControllerHandle, OpsServer), String> {
    let mut config = ControllerConfig::new("127.0.0.1:0".parse().expect("addr"), dir, TOKEN);
    config.default_consistency = Consistency::Fast;
    config.heartbeat_interval = Duration::from_millis(500);
    let mut registry = MetricsRegistry::default();
    let metrics = sandbolt_controller::register_metrics(&mut registry);
    let router = ops_router(Arc::new(registry), metrics.readiness());
    config.metrics = Some(metrics);
    let ops = serve_ops("127.0.0.1:0".parse().expect("addr"), router)
        .await
        .map_err(|e| format!("controller ops: {e}"))?;
    let controller = Controller::start(config)
        .await
        .map_err(|e| format!("controller: {e}"))?;
    Ok((controller, ops))
}

/// An agent of the bench's bed heartbeating to `controller`, its metrics
/// registered and served, once the controller has it.
async fn start_agent(
    bench: &Bench,
    controller: &ControllerHandle,
) -> Result<(AgentHandle, OpsServer), String> {
    let config = bench.agent_config("bench-agent-telemetry", controller.local_addr());
    let mut registry = MetricsRegistry::default();
    let agent = Agent::start_with_metrics(config, &mut registry)
        .await
        .map_err(|e| format!("agent: {e}"))?;
    let router = ops_router(Arc::new(registry), agent.readiness());
    let ops = serve_ops("127.0.0.1:0".parse().expect("addr"), router)
        .await
        .map_err(|e| format!("agent ops: {e}"))?;
    if !controller.wait_ready(Duration::from_secs(30)).await {
        return Err("no agent registered within 30 s".into());
    }
    Ok((agent, ops))
}

fn micros(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_compare_on_with_off_per_scenario() {
        let samples = [
            sample(CREATE, Mode::Off, 1, 100),
            sample(CREATE, Mode::On, 1, 110),
            sample(CREATE, Mode::Off, 2, 200),
            sample(CREATE, Mode::On, 2, 200),
            sample(DELETE, Mode::Off, 1, 50),
            sample(DELETE, Mode::On, 1, 50),
        ];
        let r = ratios(&samples);
        assert_eq!(r.len(), 6, "{r:?}");
        assert!(r[..3].iter().all(|(n, _)| n.starts_with(CREATE)), "{r:?}");
        // Per-round ratios 1.1 and 1.0: median 1.05.
        assert!((r[2].1 - 1.05).abs() < 1e-9, "{r:?}");
        assert!((r[3].1 - 1.0).abs() < 1e-9, "{r:?}");
        assert!(ratios(&samples[..1]).is_empty());
    }
}
