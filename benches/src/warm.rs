//! Warm pools (issue 17): a create served by claiming a started, idle
//! sandbox against the same create done cold, in the same run.
//!
//! Its own fast-mode controller and agent hold a warm pool of busybox
//! ([`POOL`]); the cold counterparts go to the harness's fast-mode
//! controller, which has no warm pool (a warm pool of busybox on it would
//! turn its plain busybox creates, the sequential table's baselines, into
//! claims). Interleaved round by round:
//!
//! - FastPath v2 `CreateSandbox` (READY) with `pool_ref`, and cold;
//! - native `CreateSandbox` (`wait_ready`) with `spec.pool` = the warm pool,
//!   and cold;
//! - REST `POST /sandboxes` on a lifecycle (controller backend) until
//!   execd answers `/ping` through the endpoint the lifecycle resolves
//!   (stages: when the POST answered, and whether it answered Running),
//!   with `extensions.poolRef`, and cold;
//!
//! then the official Python SDK's `Sandbox.create` warm (poolRef) and cold,
//! interleaved with the SDK against a stub server that answers every call
//! at once (the SDK's own floor); then a burst of `burst` creates at once
//! with a buffer of `burst` warm sandboxes, and the same burst cold.
//!
//! Before each warm create the pool must report its whole buffer available
//! (waited for untimed): a claim is measured, not a race with the refill
//! (a claim while the agent is still starting a refill container measured
//! ~60 ms instead of ~15 ms here: runc on the same two cores).
//! Each warm create is checked to have been a claim (the native API's
//! `status.claimed_warm`); one that was not is recorded under the system's
//! name with [`NOT_CLAIMED`] appended, never mixed into the claims.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sandbolt_lifecycle::{BackendConfig, LifecycleHandle};
use sandbolt_proto::control::v1 as control;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::control::v1::warm_pool_service_client::WarmPoolServiceClient;
use sandbolt_proto::fastpath::v2;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_proto::wire::EXECD_PORT;
use sandbolt_testbed::BUSYBOX_REF;
use tonic::transport::Channel;

use crate::scenarios::Burst;
use crate::systems::{Bench, ExtraController};
use crate::{Sample, Skipped};

pub const POOL: &str = "bench-warm";
/// The sequential warm-vs-cold scenario.
pub const SCENARIO: &str = "warm vs cold";
pub const WARM_V2: &str = "sandbolt FastPath v2, warm claim";
pub const COLD_V2: &str = "sandbolt FastPath v2, cold";
pub const WARM_NATIVE: &str = "sandbolt native API, warm claim";
pub const COLD_NATIVE: &str = "sandbolt native API, cold";
pub const WARM_REST: &str = "sandbolt REST POST /sandboxes → execd, warm";
pub const COLD_REST: &str = "sandbolt REST POST /sandboxes → execd, cold";
/// The SDK systems of this scenario (scenario [`crate::sdk::SCENARIO_CREATE`]).
pub const SDK_WARM: &str = "sandbolt lifecycle, warm (poolRef)";
pub const SDK_COLD: &str = "sandbolt lifecycle, cold (warm scenario)";
pub const SDK_FLOOR: &str = "SDK floor (stub server, answers at once)";
pub const BURST_WARM: &str = "sandbolt FastPath v2, warm (buffer = burst)";
pub const BURST_COLD: &str = "sandbolt FastPath v2, cold (warm scenario)";
/// Appended to a warm system's name for creates that were not claims.
pub const NOT_CLAIMED: &str = " [not claimed]";
/// The sequential pairs, warm first.
pub const PAIRS: [(&str, &str); 3] = [
    (WARM_V2, COLD_V2),
    (WARM_NATIVE, COLD_NATIVE),
    (WARM_REST, COLD_REST),
];
/// Buffer of the sequential rounds: a few, so that one slow refill never
/// leaves the next round without a warm sandbox.
const SEQUENTIAL_BUFFER: i32 = 3;
const AVAILABLE_WITHIN: Duration = Duration::from_secs(60);

/// The burst scenario's name for `n` creates at once.
pub fn burst_scenario(n: u32) -> String {
    format!("burst x{n} (warm pools)")
}

/// What the scenario measured, and what it could not.
#[derive(Debug, Default)]
pub struct WarmOutcome {
    pub samples: Vec<Sample>,
    pub bursts: Vec<Burst>,
    pub skipped: Vec<Skipped>,
    /// Facts of the run the tables do not show (claims counted, REST
    /// answers' states).
    pub notes: Vec<String>,
}

impl WarmOutcome {
    fn skip(&mut self, system: &str, reason: impl std::fmt::Display) {
        tracing::warn!(system, %reason, "warm pools: cannot measure; continuing without it");
        self.skipped.push(Skipped {
            system: system.to_string(),
            reason: reason.to_string(),
        });
    }
}

/// One controller's clients.
#[derive(Clone)]
struct Clients {
    v2: FastPathServiceClient<Channel>,
    native: SandboxServiceClient<Channel>,
    /// Its lifecycle's base URL (`http://addr`).
    rest: String,
}

struct Setup {
    warm: Clients,
    cold: Clients,
    pools: WarmPoolServiceClient<Channel>,
    http: reqwest::Client,
    extra: ExtraController,
    lifecycles: Vec<LifecycleHandle>,
    floor: FloorServer,
    _dir: tempfile::TempDir,
}

/// Runs the scenario: `rounds` sequential rounds (after one warm-up),
/// `sdk_rounds` SDK rounds (0 leaves them out), one burst of `burst`.
pub async fn run(bench: &Bench, rounds: u32, sdk_rounds: u32, burst: u32) -> WarmOutcome {
    let mut out = WarmOutcome::default();
    let mut setup = match Setup::start(bench).await {
        Ok(s) => s,
        Err(e) => {
            out.skip("warm pools", e);
            return out;
        }
    };
    if let Err(e) = setup.sequential(rounds, &mut out).await {
        out.skip(&format!("{SCENARIO} (sequential)"), e);
    }
    if sdk_rounds > 0 {
        setup.sdk(sdk_rounds, &mut out).await;
    }
    if burst > 0
        && let Err(e) = setup.bursts(burst, &mut out).await
    {
        out.skip(&burst_scenario(burst), e);
    }
    setup.shutdown().await;
    out
}

fn micros(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

impl Setup {
    async fn start(bench: &Bench) -> Result<Setup, String> {
        let extra = bench
            .start_extra_controller("warm")
            .await
            .map_err(|e| e.to_string())?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let warm_addr = extra.controller.local_addr();
        let cold_addr = bench.fast_controller_addr();
        let mut lifecycles = Vec::new();
        let mut clients = Vec::new();
        for (name, addr) in [("warm", warm_addr), ("cold", cold_addr)] {
            let mut fp = sandbolt_lifecycle::ControllerConfig::new(format!("http://{addr}"));
            fp.namespace = "default".into();
            let lc = crate::sdk::start_lifecycle(
                BackendConfig::Controller(fp),
                &dir.path().join(format!("lc-{name}")),
            )
            .await?;
            clients.push(Clients {
                v2: FastPathServiceClient::connect(format!("http://{addr}"))
                    .await
                    .map_err(|e| e.to_string())?,
                native: SandboxServiceClient::connect(format!("http://{addr}"))
                    .await
                    .map_err(|e| e.to_string())?,
                rest: format!("http://{}", lc.addr()),
            });
            lifecycles.push(lc);
        }
        let cold = clients.pop().expect("two");
        let warm = clients.pop().expect("two");
        let mut pools = WarmPoolServiceClient::connect(format!("http://{warm_addr}"))
            .await
            .map_err(|e| e.to_string())?;
        pools
            .create_warm_pool(control::CreateWarmPoolRequest {
                pool: Some(control::WarmPool {
                    name: POOL.into(),
                    template: Some(control::WarmTemplate {
                        image: BUSYBOX_REF.into(),
                        ..Default::default()
                    }),
                    capacity: Some(capacity(SEQUENTIAL_BUFFER)),
                    ..Default::default()
                }),
            })
            .await
            .map_err(|e| format!("CreateWarmPool: {e}"))?;
        let floor = FloorServer::start().await?;
        Ok(Setup {
            warm,
            cold,
            pools,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .map_err(|e| e.to_string())?,
            extra,
            lifecycles,
            floor,
            _dir: dir,
        })
    }

    async fn shutdown(self) {
        let mut pools = self.pools;
        let _ = pools
            .delete_warm_pool(control::WarmPoolRef { name: POOL.into() })
            .await;
        for lc in self.lifecycles {
            let _ = lc.shutdown().await;
        }
        self.floor.stop();
        self.extra.shutdown().await;
    }

    async fn available(&mut self) -> Result<i32, String> {
        Ok(self
            .pools
            .get_warm_pool(control::WarmPoolRef { name: POOL.into() })
            .await
            .map_err(|e| format!("GetWarmPool: {e}"))?
            .into_inner()
            .status
            .map(|s| s.available)
            .unwrap_or(0))
    }

    /// Untimed: until the pool reports `n` available.
    async fn wait_available(&mut self, n: i32, within: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            let now = self.available().await?;
            if now >= n {
                return Ok(());
            }
            if started.elapsed() > within {
                return Err(format!(
                    "warm pool {POOL}: {now} available, not {n}, after {within:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn set_buffer(&mut self, n: i32) -> Result<(), String> {
        self.pools
            .update_warm_pool(control::UpdateWarmPoolRequest {
                name: POOL.into(),
                capacity: Some(capacity(n)),
            })
            .await
            .map(|_| ())
            .map_err(|e| format!("UpdateWarmPool: {e}"))
    }

    fn clients(&self, warm: bool) -> Clients {
        if warm {
            self.warm.clone()
        } else {
            self.cold.clone()
        }
    }

    async fn sequential(&mut self, rounds: u32, out: &mut WarmOutcome) -> Result<(), String> {
        self.wait_available(SEQUENTIAL_BUFFER, AVAILABLE_WITHIN)
            .await?;
        let systems = [
            WARM_V2,
            COLD_V2,
            WARM_NATIVE,
            COLD_NATIVE,
            WARM_REST,
            COLD_REST,
        ];
        let mut claims = std::collections::BTreeMap::<&str, (u32, u32)>::new();
        let mut rest_running = std::collections::BTreeMap::<&str, (u32, u32)>::new();
        for i in 0..=rounds {
            // Alternate which of a pair goes first: a create pays for the
            // teardown just before it on a shared containerd.
            let mut order = systems.to_vec();
            if i % 2 == 0 {
                for k in (0..order.len()).step_by(2) {
                    order.swap(k, k + 1);
                }
            }
            for system in order {
                let warm = PAIRS.iter().any(|(w, _)| *w == system);
                if warm {
                    // The whole buffer, not just one: a refill still
                    // starting a container (runc, on the same cores) slows
                    // a claim beside it several-fold; this measures the
                    // claim itself (the burst measures claims under load).
                    self.wait_available(SEQUENTIAL_BUFFER, AVAILABLE_WITHIN)
                        .await?;
                }
                let id = format!("w{i}-{}", short(system));
                let m = self.create(system, warm, &id).await;
                let claimed = match &m {
                    Ok((name, _, _)) if warm => self.claimed(name).await,
                    _ => false,
                };
                if let Ok((name, _, _)) = &m {
                    self.remove(system, warm, name).await;
                }
                let (total_us, stages, running) = m.map(|(_, m, r)| (m.0, m.1, r))?;
                if i == 0 {
                    continue;
                }
                if warm {
                    let c = claims.entry(system).or_default();
                    c.0 += u32::from(claimed);
                    c.1 += 1;
                }
                if let Some(r) = running {
                    let c = rest_running.entry(system).or_default();
                    c.0 += u32::from(r);
                    c.1 += 1;
                }
                let name = if warm && !claimed {
                    format!("{system}{NOT_CLAIMED}")
                } else {
                    system.to_string()
                };
                out.samples.push(Sample {
                    scenario: SCENARIO.into(),
                    system: name,
                    iteration: i,
                    total_us,
                    stages,
                });
            }
        }
        for (system, (n, of)) in claims {
            out.notes
                .push(format!("{system}: {n} of {of} creates were claims"));
        }
        for (system, (n, of)) in rest_running {
            out.notes.push(format!(
                "{system}: POST /sandboxes answered Running {n} of {of} times"
            ));
        }
        Ok(())
    }

    /// One timed create; (name to remove it by, (total, stages), whether a
    /// REST answer said Running).
    async fn create(
        &mut self,
        system: &str,
        warm: bool,
        id: &str,
    ) -> Result<(String, (u64, Vec<(String, u64)>), Option<bool>), String> {
        let mut c = self.clients(warm);
        let t = Instant::now();
        match system {
            WARM_V2 | COLD_V2 => {
                let resp =
                    c.v2.create_sandbox(v2_create(id, warm))
                        .await
                        .map_err(|e| format!("{system}: {e}"))?
                        .into_inner();
                let total = micros(t);
                let name = resp
                    .sandbox
                    .and_then(|s| s.identity)
                    .map(|i| i.name)
                    .ok_or_else(|| format!("{system}: answered without an identity"))?;
                Ok((name, (total, Vec::new()), None))
            }
            WARM_NATIVE | COLD_NATIVE => {
                let s = c
                    .native
                    .create_sandbox(native_create(id, warm))
                    .await
                    .map_err(|e| format!("{system}: {e}"))?
                    .into_inner();
                let total = micros(t);
                let phase = s.status.as_ref().map(|s| s.phase());
                if phase != Some(control::Phase::Running) {
                    return Err(format!("{system}: answered in phase {phase:?}"));
                }
                Ok((s.name, (total, Vec::new()), None))
            }
            _ => {
                let (name, stages, running) = self
                    .rest_create(&c.rest, warm, t)
                    .await
                    .map_err(|e| format!("{system}: {e}"))?;
                Ok((name, (micros(t), stages), Some(running)))
            }
        }
    }

    /// REST `POST /sandboxes`, then (when the answer was not Running) GET
    /// until Running, then the execd endpoint and `/ping` until it answers
    /// 200 — what a client does before its first command.
    async fn rest_create(
        &self,
        base: &str,
        warm: bool,
        t: Instant,
    ) -> Result<(String, Vec<(String, u64)>, bool), String> {
        let mut body = serde_json::json!({
            "image": { "uri": BUSYBOX_REF },
            "entrypoint": ["sleep", "3600"],
            "timeout": 3600,
            "resourceLimits": {},
        });
        if warm {
            body["extensions"] = serde_json::json!({ "poolRef": POOL });
        }
        let key = ("OPEN-SANDBOX-API-KEY", crate::sdk::API_KEY);
        let r = self
            .http
            .post(format!("{base}/v1/sandboxes"))
            .header(key.0, key.1)
            .json(&body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status();
        let v: serde_json::Value = r.json().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("POST /sandboxes: {status} {v}"));
        }
        let mut stages = vec![("post_answered".to_string(), micros(t))];
        let id = v["id"].as_str().ok_or("no id")?.to_string();
        let answered_running = v["status"]["state"] == "Running";
        if !answered_running {
            loop {
                let v: serde_json::Value = self
                    .http
                    .get(format!("{base}/v1/sandboxes/{id}"))
                    .header(key.0, key.1)
                    .send()
                    .await
                    .map_err(|e| e.to_string())?
                    .json()
                    .await
                    .map_err(|e| e.to_string())?;
                match v["status"]["state"].as_str() {
                    Some("Running") => break,
                    Some("Failed") => return Err(format!("{id} failed: {v}")),
                    _ if t.elapsed() > AVAILABLE_WITHIN => {
                        return Err(format!("{id} not Running: {v}"));
                    }
                    _ => tokio::time::sleep(Duration::from_millis(2)).await,
                }
            }
            stages.push(("running".into(), micros(t)));
        }
        let ep: serde_json::Value = self
            .http
            .get(format!("{base}/v1/sandboxes/{id}/endpoints/{EXECD_PORT}"))
            .header(key.0, key.1)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        stages.push(("endpoint_resolved".into(), micros(t)));
        let endpoint = ep["endpoint"]
            .as_str()
            .ok_or_else(|| format!("no endpoint: {ep}"))?;
        loop {
            let mut rb = self.http.get(format!("http://{endpoint}/ping"));
            if let Some(h) = ep["headers"].as_object() {
                for (k, v) in h {
                    rb = rb.header(k, v.as_str().unwrap_or_default());
                }
            }
            if rb.send().await.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            if t.elapsed() > AVAILABLE_WITHIN {
                return Err(format!("execd of {id} never answered /ping"));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        stages.push(("execd_ready".into(), micros(t)));
        Ok((id, stages, answered_running))
    }

    /// Whether the native API says `default/<name>` (of the warm controller)
    /// was served by a claim.
    async fn claimed(&mut self, name: &str) -> bool {
        self.warm
            .native
            .get_sandbox(control::GetSandboxRequest {
                sandbox: Some(sandbox_ref(name)),
            })
            .await
            .ok()
            .and_then(|s| s.into_inner().status)
            .is_some_and(|s| s.claimed_warm)
    }

    /// Untimed removal; a failure is logged (the next create's name is new).
    async fn remove(&mut self, system: &str, warm: bool, name: &str) {
        let mut c = self.clients(warm);
        let r = if system == WARM_REST || system == COLD_REST {
            self.http
                .delete(format!("{}/v1/sandboxes/{name}", c.rest))
                .header("OPEN-SANDBOX-API-KEY", crate::sdk::API_KEY)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        } else {
            c.native
                .delete_sandbox(control::DeleteSandboxRequest {
                    sandbox: Some(sandbox_ref(name)),
                })
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        if let Err(e) = r {
            tracing::debug!(system, name, error = %e, "warm scenario cleanup");
        }
    }

    /// The SDK warm (poolRef) and cold on lifecycles of the two controllers,
    /// and against the floor stub, interleaved by `sdk_create.py`.
    async fn sdk(&mut self, rounds: u32, out: &mut WarmOutcome) {
        use crate::sdk::Target;
        let targets = [
            Target {
                name: SDK_COLD,
                url: self.cold.rest.clone(),
                resource: None,
                extensions: None,
                wait_pool: None,
                template: false,
            },
            Target {
                name: SDK_WARM,
                url: self.warm.rest.clone(),
                resource: None,
                extensions: Some(serde_json::json!({ "poolRef": POOL })),
                wait_pool: Some((POOL.into(), SEQUENTIAL_BUFFER)),
                template: false,
            },
            Target {
                name: SDK_FLOOR,
                url: format!("http://{}", self.floor.addr),
                resource: None,
                extensions: None,
                wait_pool: None,
                template: false,
            },
        ];
        match crate::sdk::run_python(&targets, rounds).await {
            Ok(report) => {
                let mut sdk = crate::sdk::SdkOutcome::default();
                crate::sdk::record(report, None, &mut sdk);
                out.samples.extend(sdk.samples);
                out.skipped.extend(sdk.skipped);
            }
            Err(e) => {
                for t in &targets {
                    out.skip(t.name, &e);
                }
            }
        }
    }

    /// `n` READY creates at once through FastPath v2 with a buffer of `n`,
    /// then the same `n` cold; each create's latency and the wall time.
    async fn bursts(&mut self, n: u32, out: &mut WarmOutcome) -> Result<(), String> {
        let n_i32 = i32::try_from(n).map_err(|e| e.to_string())?;
        self.set_buffer(n_i32.max(SEQUENTIAL_BUFFER)).await?;
        // Filling: one start at a time, paced; minutes for hundreds.
        self.wait_available(n_i32, Duration::from_secs(60 + 3 * u64::from(n)))
            .await?;
        let scenario = burst_scenario(n);
        for (system, warm) in [(BURST_WARM, true), (BURST_COLD, false)] {
            let c = self.clients(warm);
            let started = Instant::now();
            let results = futures::future::join_all((0..n).map(|k| {
                let mut v2c = c.v2.clone();
                let id = format!("wburst-{}-{k}", if warm { "w" } else { "c" });
                async move {
                    let t = Instant::now();
                    let r = v2c.create_sandbox(v2_create(&id, warm)).await;
                    let us = micros(t);
                    r.map(|resp| {
                        let name = resp
                            .into_inner()
                            .sandbox
                            .and_then(|s| s.identity)
                            .map(|i| i.name)
                            .unwrap_or_default();
                        (name, us)
                    })
                    .map_err(|e| e.to_string())
                }
            }))
            .await;
            let wall_us = micros(started);
            let mut failures = Vec::new();
            let mut names = Vec::new();
            let mut claims = 0;
            for (k, r) in results.into_iter().enumerate() {
                match r {
                    Ok((name, us)) => {
                        if warm && self.claimed(&name).await {
                            claims += 1;
                        }
                        out.samples.push(Sample {
                            scenario: scenario.clone(),
                            system: system.into(),
                            iteration: k as u32,
                            total_us: us,
                            stages: Vec::new(),
                        });
                        names.push(name);
                    }
                    Err(e) => failures.push(e),
                }
            }
            for name in &names {
                self.remove(system, warm, name).await;
            }
            if warm {
                out.notes.push(format!(
                    "{scenario}, {system}: {claims} of {n} creates were claims"
                ));
                // Drain the big buffer before the cold burst: its refill
                // would compete with the cold creates for the CPU.
                self.set_buffer(0).await?;
            }
            if let Some(e) = failures.first() {
                return Err(format!(
                    "{system}: {} of {n} creates failed, first: {e}",
                    failures.len()
                ));
            }
            out.bursts.push(Burst {
                system: system.into(),
                concurrency: n,
                wall_us,
            });
        }
        Ok(())
    }
}

fn capacity(buffer: i32) -> control::WarmCapacity {
    control::WarmCapacity {
        buffer_min: buffer,
        buffer_max: buffer,
        pool_min: 0,
        // Room for a burst's claims and the refill behind them.
        pool_max: 2 * buffer + 16,
    }
}

fn sandbox_ref(name: &str) -> control::SandboxRef {
    control::SandboxRef {
        namespace: "default".into(),
        name: name.into(),
        expected_uid: String::new(),
    }
}

fn short(system: &str) -> &'static str {
    match system {
        WARM_V2 => "wv2",
        COLD_V2 => "cv2",
        WARM_NATIVE => "wnat",
        COLD_NATIVE => "cnat",
        WARM_REST => "wrest",
        _ => "crest",
    }
}

/// A READY v2 create of busybox; with `warm`, `pool_ref` names [`POOL`].
fn v2_create(id: &str, warm: bool) -> v2::CreateSandboxRequest {
    let mut r = crate::systems::v2_create(id);
    if warm {
        r.pool_ref = POOL.into();
    }
    r
}

/// A native create (fast, `wait_ready`) of busybox; with `warm`,
/// `spec.pool` names [`POOL`].
fn native_create(id: &str, warm: bool) -> control::CreateSandboxRequest {
    let mut r = crate::systems::native_create(id, false);
    if warm && let Some(spec) = r.spec.as_mut() {
        spec.pool = POOL.into();
    }
    r
}

/// Ratios of p50 (warm ÷ cold per API, SDK warm ÷ cold and ÷ floor) and
/// p99 ÷ p50 of each burst, for the report's ratio list.
pub fn ratios(samples: &[Sample]) -> Vec<(String, f64)> {
    let summary = |scenario: &str, system: &str| {
        crate::stats::summarize(
            samples
                .iter()
                .filter(|s| s.scenario == scenario && s.system == system)
                .map(|s| s.total_us),
        )
    };
    let mut out = Vec::new();
    let sdk = crate::sdk::SCENARIO_CREATE;
    for (scenario, warm, cold) in PAIRS
        .iter()
        .map(|(w, c)| (SCENARIO, *w, *c))
        .chain([(sdk, SDK_WARM, SDK_COLD), (sdk, SDK_WARM, SDK_FLOOR)])
    {
        if let (Some(w), Some(c)) = (summary(scenario, warm), summary(scenario, cold)) {
            out.push((
                format!("{scenario}: {warm} ÷ {cold}"),
                w.p50_us as f64 / c.p50_us as f64,
            ));
        }
    }
    let bursts: std::collections::BTreeSet<&str> = samples
        .iter()
        .filter(|s| s.scenario.ends_with("(warm pools)"))
        .map(|s| s.scenario.as_str())
        .collect();
    for scenario in bursts {
        for system in [BURST_WARM, BURST_COLD] {
            if let Some(s) = summary(scenario, system) {
                out.push((
                    format!("{scenario}: {system} p99 ÷ p50"),
                    s.p99_us as f64 / s.p50_us as f64,
                ));
            }
        }
        if let (Some(w), Some(c)) = (summary(scenario, BURST_WARM), summary(scenario, BURST_COLD)) {
            out.push((
                format!("{scenario}: {BURST_WARM} ÷ {BURST_COLD} (p99)"),
                w.p99_us as f64 / c.p99_us as f64,
            ));
        }
    }
    out
}

/// A server that answers every call the SDK's `Sandbox.create` and
/// `kill` make, at once and without doing anything: the time the SDK takes
/// against it is the SDK's own (HTTP client, models, its readiness loop).
/// `POST /sandboxes` answers Running, the endpoints point back at this
/// server, `/ping` answers 200.
struct FloorServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl FloorServer {
    async fn start() -> Result<FloorServer, String> {
        use axum::Router;
        use axum::extract::{Path, State};
        use axum::http::StatusCode;
        use axum::routing::{get, post};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};

        #[derive(Clone)]
        struct S {
            addr: SocketAddr,
            next: Arc<AtomicU64>,
        }
        fn sandbox(id: &str) -> serde_json::Value {
            serde_json::json!({
                "id": id,
                "status": { "state": "Running" },
                "image": { "uri": BUSYBOX_REF },
                "entrypoint": ["sleep", "infinity"],
                "metadata": {},
                "createdAt": "2026-01-01T00:00:00Z",
                "expiresAt": "2026-01-01T01:00:00Z",
            })
        }
        async fn create(State(s): State<S>) -> (StatusCode, axum::Json<serde_json::Value>) {
            let id = format!("floor-{}", s.next.fetch_add(1, Ordering::Relaxed));
            (StatusCode::ACCEPTED, axum::Json(sandbox(&id)))
        }
        async fn one(Path(id): Path<String>) -> axum::Json<serde_json::Value> {
            axum::Json(sandbox(&id))
        }
        async fn endpoint(
            State(s): State<S>,
            Path((id, port)): Path<(String, u16)>,
        ) -> axum::Json<serde_json::Value> {
            axum::Json(serde_json::json!({
                "endpoint": format!("{}/floor/{id}/{port}", s.addr),
                "headers": {},
            }))
        }
        async fn delete() -> StatusCode {
            StatusCode::NO_CONTENT
        }
        async fn ping() -> StatusCode {
            StatusCode::OK
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("floor server: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let state = S {
            addr,
            next: Arc::new(AtomicU64::new(0)),
        };
        let api = Router::new()
            .route("/sandboxes", post(create))
            .route("/sandboxes/{id}", get(one).delete(delete))
            .route("/sandboxes/{id}/endpoints/{port}", get(endpoint));
        let app = Router::new()
            .nest("/v1", api.clone())
            .merge(api)
            .route("/floor/{id}/{port}/ping", get(ping))
            .with_state(state);
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "floor server stopped");
            }
        });
        Ok(FloorServer { addr, task })
    }

    fn stop(self) {
        self.task.abort();
    }
}
