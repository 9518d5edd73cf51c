//! One scale run, store by store (see the module docs of [`super`]).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbolt_kube_double::ApiDouble;
use sandbolt_test_support::sim_agent::{ChurnSpec, Fleet, FleetConfig};

use super::controller::{ControllerChild, ControllerSetup};
use super::load::{self, Api};
use super::report::StepReport;
use super::{RssSample, ScaleOptions, ScaleReport, StoreKind, StoreReport, Takeover, prom};
use crate::{BenchError, Result};

const AGENT_TOKEN: &str = "scale-agent-token";
const LEASE_NAMESPACE: &str = "sandbolt-system";
/// Serving and takeover waits: generous, they bound only a broken run.
const SERVING_WITHIN: Duration = Duration::from_secs(300);

/// Runs every store of `opts` in turn; a store that fails is reported with
/// its error and the next one still runs.
pub async fn run(opts: &ScaleOptions, command: &str) -> Result<ScaleReport> {
    std::fs::create_dir_all(&opts.out_dir).map_err(|source| BenchError::Io {
        path: opts.out_dir.clone(),
        source,
    })?;
    let mut stores = Vec::new();
    for &store in &opts.stores {
        eprintln!(
            "scale: {} store, {} agents, {} sandboxes",
            store.name(),
            opts.agents,
            opts.sandboxes
        );
        stores.push(run_store(opts, store).await);
    }
    Ok(ScaleReport {
        command: command.to_string(),
        binary: opts.sandbolt_bin.display().to_string(),
        agents: opts.agents,
        sandboxes: opts.sandboxes,
        churn: opts.churn,
        stores,
    })
}

fn empty_report(opts: &ScaleOptions, store: StoreKind) -> StoreReport {
    StoreReport {
        store,
        agents: opts.agents,
        steps: Vec::new(),
        rss: Vec::new(),
        listed_after_load: 0,
        missing_after_load: 0,
        rebuild: None,
        failover: None,
        held: 0,
        fleet: Default::default(),
        error: None,
    }
}

/// What one store's run keeps while it goes.
struct StoreRun<'a> {
    opts: &'a ScaleOptions,
    setup: ControllerSetup,
    /// Kept alive for the Kubernetes store.
    _api: Option<ApiDouble>,
    /// Logs, keys, kubeconfig and (while it runs) the redb data.
    dir: std::path::PathBuf,
    report: StoreReport,
    /// Every name a create was answered OK for.
    created: HashSet<String>,
}

async fn run_store(opts: &ScaleOptions, store: StoreKind) -> StoreReport {
    let mut run = match StoreRun::new(opts, store).await {
        Ok(r) => r,
        Err(e) => {
            let mut r = empty_report(opts, store);
            r.error = Some(e.to_string());
            return r;
        }
    };
    if let Err(e) = run.drive().await {
        eprintln!("scale: {} store stopped: {e}", store.name());
        run.report.error = Some(e.to_string());
    }
    let _ = std::fs::remove_dir_all(run.dir.join("data"));
    run.report
}

impl<'a> StoreRun<'a> {
    async fn new(opts: &'a ScaleOptions, store: StoreKind) -> Result<StoreRun<'a>> {
        // Kept after the run (the controllers' logs); the store's data is
        // removed once the store is done.
        let dir = opts.out_dir.join(store.name());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|source| BenchError::Io {
            path: dir.clone(),
            source,
        })?;
        let listen = free_port()?;
        let mut env: Vec<(String, String)> = vec![
            (
                "SANDBOLT_DATA_DIR".into(),
                dir.join("data").display().to_string(),
            ),
            (
                "SANDBOLT_CONSISTENCY".into(),
                opts.default_consistency.clone(),
            ),
            (
                "SANDBOLT_HEARTBEAT_INTERVAL".into(),
                humantime::format_duration(opts.heartbeat).to_string(),
            ),
            (
                "SANDBOLT_AGENT_LOST_TIMEOUT".into(),
                humantime::format_duration(opts.lost_timeout).to_string(),
            ),
            (
                "SANDBOLT_STARTUP_GRACE".into(),
                humantime::format_duration(opts.startup_grace).to_string(),
            ),
        ];
        let api = match store {
            StoreKind::Embedded => {
                env.push(("SANDBOLT_STORE".into(), "embedded".into()));
                None
            }
            StoreKind::Kubernetes => {
                let api = ApiDouble::start().await;
                let kubeconfig = dir.join("kubeconfig");
                api.write_kubeconfig(&kubeconfig)
                    .map_err(|source| BenchError::Io {
                        path: kubeconfig.clone(),
                        source,
                    })?;
                let d = |d: Duration| humantime::format_duration(d).to_string();
                env.extend([
                    ("SANDBOLT_STORE".into(), "kubernetes".into()),
                    ("KUBECONFIG".into(), kubeconfig.display().to_string()),
                    ("SANDBOLT_POD_NAMESPACE".into(), LEASE_NAMESPACE.into()),
                    ("SANDBOLT_LEASE_DURATION".into(), d(opts.lease.duration)),
                    (
                        "SANDBOLT_RENEW_DEADLINE".into(),
                        d(opts.lease.renew_deadline),
                    ),
                    ("SANDBOLT_LEASE_RETRY".into(), d(opts.lease.retry)),
                ]);
                Some(api)
            }
        };
        let setup = ControllerSetup {
            binary: opts.sandbolt_bin.clone(),
            listen,
            dir: dir.clone(),
            agent_token: AGENT_TOKEN.into(),
            env,
        };
        setup.write_keys()?;
        Ok(StoreRun {
            opts,
            setup,
            _api: api,
            dir,
            report: empty_report(opts, store),
            created: HashSet::new(),
        })
    }

    fn listen(&self) -> SocketAddr {
        self.setup.listen
    }

    /// Start, ramp, check, restart, fail over.
    async fn drive(&mut self) -> Result<()> {
        let mut ctl = self.setup.spawn("controller-0")?;
        ctl.wait_serving(SERVING_WITHIN).await?;
        let metrics = ctl.wait_metrics(Duration::from_secs(10)).await?;
        let fleet = self.start_fleet().await?;
        wait_agents(metrics, self.opts.agents).await?;
        self.sample_rss(&ctl, 0);
        let churn = (self.opts.churn > 0.0).then(|| {
            fleet.spawn_churn(ChurnSpec {
                fraction: self.opts.churn,
                every: self.opts.churn_every,
                down_for: self.opts.churn_down,
            })
        });
        let ramped = self.ramp(&ctl, metrics).await;
        if let Some(c) = churn {
            c.abort();
        }
        fleet
            .restart_all()
            .await
            .map_err(|e| BenchError::system("sim-agents", e))?;
        let finished = match ramped {
            Ok(()) => self.after_load(ctl, &fleet).await,
            Err(e) => Err(e),
        };
        self.report.held = fleet.held();
        self.report.fleet = fleet.counters();
        fleet.shutdown().await;
        finished
    }

    async fn after_load(&mut self, ctl: ControllerChild, fleet: &Arc<Fleet>) -> Result<()> {
        let listed = load::list_all(self.listen()).await?;
        self.report.listed_after_load = listed.len();
        self.report.missing_after_load = self.missing(&listed);
        eprintln!(
            "scale: {} records listed, {} answered creates missing, fleet holds {}",
            listed.len(),
            self.report.missing_after_load,
            fleet.held()
        );
        let ctl = self.rebuild(ctl, listed.len()).await?;
        if self.report.store == StoreKind::Kubernetes && self.opts.failover {
            self.failover(ctl).await?;
        }
        Ok(())
    }

    fn missing(&self, listed: &[(String, i32)]) -> usize {
        let names: HashSet<&str> = listed.iter().map(|(n, _)| n.as_str()).collect();
        self.created
            .iter()
            .filter(|n| !names.contains(n.as_str()))
            .count()
    }

    async fn start_fleet(&self) -> Result<Arc<Fleet>> {
        let mut cfg = FleetConfig::new(format!("http://{}", self.listen()), AGENT_TOKEN);
        cfg.agents = self.opts.agents;
        cfg.id_prefix = format!("sim-{}", self.report.store.name());
        cfg.capacity = self.opts.capacity();
        cfg.latency = self.opts.latency;
        cfg.failure_rate = self.opts.failure_rate;
        cfg.initial_heartbeat = self.opts.heartbeat;
        let started = Instant::now();
        let fleet = Fleet::start(cfg)
            .await
            .map_err(|e| BenchError::system("sim-agents", e))?;
        eprintln!(
            "scale: {} agents registered in {:.1}s",
            fleet.len(),
            started.elapsed().as_secs_f64()
        );
        Ok(fleet)
    }

    fn sample_rss(&mut self, ctl: &ControllerChild, records: usize) {
        if let Some(rss_bytes) = ctl.rss_bytes() {
            self.report.rss.push(RssSample { records, rss_bytes });
        }
    }

    /// Every (concurrency, API) step in turn, `sandboxes / steps` creates
    /// each, the APIs interleaved so each sees the store at a similar size.
    async fn ramp(&mut self, ctl: &ControllerChild, metrics: SocketAddr) -> Result<()> {
        let plan: Vec<(usize, Api)> = self
            .opts
            .concurrency
            .iter()
            .flat_map(|&c| self.opts.apis.iter().map(move |&a| (c, a)))
            .collect();
        let per = self.opts.sandboxes / plan.len().max(1);
        for (i, &(concurrency, api)) in plan.iter().enumerate() {
            let count = if i + 1 == plan.len() {
                self.opts.sandboxes - per * (plan.len() - 1)
            } else {
                per
            };
            let before = scrape(metrics).await?;
            let prefix = format!("{}-s{i}-{}", self.report.store.name(), api.name());
            let step = load::run_step(
                self.listen(),
                api,
                concurrency,
                count,
                &prefix,
                self.opts.create_deadline,
            )
            .await?;
            let after = scrape(metrics).await?;
            let step = StepReport::new(step, &before, &after);
            eprintln!("scale: {}", step.line());
            self.created.extend(step.result.names.iter().cloned());
            self.report.steps.push(step);
            self.sample_rss(ctl, self.created.len());
        }
        Ok(())
    }

    /// A create after a restart or failover, retried until writes open;
    /// the time from `since` until it succeeded.
    async fn probe(&mut self, name: &str, since: Instant) -> Result<f64> {
        let ch = load::channels(self.listen(), 1)?.remove(0);
        let deadline = Instant::now() + SERVING_WITHIN;
        loop {
            match load::create(ch.clone(), Api::NativeStrong, name).await {
                Ok(n) => {
                    self.created.insert(n);
                    return Ok(since.elapsed().as_secs_f64());
                }
                Err(e) if Instant::now() >= deadline => {
                    return Err(BenchError::system(
                        "controller",
                        format!("probe {name}: {e}"),
                    ));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// SIGTERM, start a new process on the same store, time it.
    async fn rebuild(
        &mut self,
        mut old: ControllerChild,
        records: usize,
    ) -> Result<ControllerChild> {
        old.terminate(Duration::from_secs(60)).await;
        drop(old);
        let mut ctl = self.setup.spawn("controller-1")?;
        let started = ctl.started;
        let serving = ctl.wait_serving(SERVING_WITHIN).await?;
        let first = self.probe("probe-rebuild", started).await?;
        let listed = load::list_all(self.listen()).await?;
        let t = Takeover {
            records,
            serving_s: serving.as_secs_f64(),
            first_create_s: first,
            listed: listed.len(),
            missing: self.missing(&listed),
        };
        eprintln!("scale: rebuild {t:?}");
        self.report.rebuild = Some(t);
        Ok(ctl)
    }

    /// A standby beside the leader `leader`; SIGKILL the leader, time the
    /// standby's takeover.
    async fn failover(&mut self, mut leader: ControllerChild) -> Result<()> {
        let records = load::list_all(self.listen()).await?.len();
        let mut standby = self.setup.spawn("controller-2")?;
        standby.wait_metrics(Duration::from_secs(30)).await?;
        // Campaigning: it has read the Lease and found it held.
        tokio::time::sleep(self.opts.lease.retry * 2).await;
        leader.kill9();
        let killed = Instant::now();
        standby.wait_serving(SERVING_WITHIN).await?;
        let serving = killed.elapsed();
        let first = self.probe("probe-failover", killed).await?;
        let listed = load::list_all(self.listen()).await?;
        let t = Takeover {
            records,
            serving_s: serving.as_secs_f64(),
            first_create_s: first,
            listed: listed.len(),
            missing: self.missing(&listed),
        };
        eprintln!("scale: failover {t:?}");
        self.report.failover = Some(t);
        Ok(())
    }
}

fn free_port() -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| BenchError::system("harness", format!("free port: {e}")))?;
    l.local_addr()
        .map_err(|e| BenchError::system("harness", format!("free port: {e}")))
}

/// The controller's `/metrics` text.
pub async fn scrape(metrics: SocketAddr) -> Result<String> {
    let r = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .map_err(|e| BenchError::system("controller", format!("/metrics: {e}")))?;
    r.text()
        .await
        .map_err(|e| BenchError::system("controller", format!("/metrics: {e}")))
}

/// Until the controller counts `n` agents ready.
async fn wait_agents(metrics: SocketAddr, n: usize) -> Result<()> {
    let deadline = Instant::now() + SERVING_WITHIN;
    loop {
        let text = scrape(metrics).await?;
        let ready = prom::value(&text, "sandbolt_controller_agents", &[("state", "ready")]);
        if ready.unwrap_or(0.0) as usize >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(BenchError::system(
                "controller",
                format!("{ready:?} of {n} agents ready"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
