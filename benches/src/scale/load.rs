//! Creates at a fixed concurrency through one API, each timed by the
//! client: closed-loop workers; a failed attempt is retried (same request
//! id) as a client would, so the time of a create includes its retries and
//! a create that never succeeds within the deadline is unanswered.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use tonic::transport::{Channel, Endpoint};

use crate::{BenchError, Result};

/// How a create reaches the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Api {
    /// FastPath v2 `CreateSandbox` (READY completion); its consistency is
    /// the controller's default (v2 cannot ask for one).
    FastPathV2,
    /// `sandbolt.control.v1` CreateSandbox asking for FAST.
    NativeFast,
    /// `sandbolt.control.v1` CreateSandbox asking for STRONG.
    NativeStrong,
}

impl Api {
    pub const ALL: [Api; 3] = [Api::FastPathV2, Api::NativeFast, Api::NativeStrong];

    pub fn name(self) -> &'static str {
        match self {
            Api::FastPathV2 => "fastpath-v2",
            Api::NativeFast => "native-fast",
            Api::NativeStrong => "native-strong",
        }
    }
}

/// Metadata every harness create carries (what a metadata filter finds).
pub const METADATA: (&str, &str) = ("bench", "scale");

/// What one step of creates did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepResult {
    pub api: Api,
    pub concurrency: usize,
    pub issued: usize,
    pub ok: usize,
    /// Attempts answered with an error (then retried), by gRPC code.
    pub failed: BTreeMap<String, usize>,
    /// The first message of each code in `failed`.
    pub failure_samples: BTreeMap<String, String>,
    /// Creates that did not succeed within the create deadline, retries
    /// included.
    pub unanswered: usize,
    pub elapsed_s: f64,
    pub creates_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Names of the sandboxes created (not serialized: the report counts).
    #[serde(skip)]
    pub names: Vec<String>,
}

impl StepResult {
    pub fn failed_total(&self) -> usize {
        self.failed.values().sum()
    }
}

/// Channels to the controller: one per 32 workers, so that HTTP/2 stream
/// limits of one connection do not become the thing measured.
pub fn channels(addr: SocketAddr, concurrency: usize) -> Result<Vec<Channel>> {
    let n = concurrency.div_ceil(32).max(1);
    (0..n)
        .map(|_| {
            Ok(Endpoint::from_shared(format!("http://{addr}"))
                .map_err(|e| BenchError::system("controller", e))?
                .tcp_nodelay(true)
                .connect_lazy())
        })
        .collect()
}

struct Tally {
    hist: Histogram<u64>,
    failed: BTreeMap<String, usize>,
    samples: BTreeMap<String, String>,
    unanswered: usize,
    names: Vec<String>,
}

/// `count` creates through `api`, `concurrency` at a time, names
/// `<prefix>-<n>`; each bounded by `deadline`.
pub async fn run_step(
    addr: SocketAddr,
    api: Api,
    concurrency: usize,
    count: usize,
    prefix: &str,
    deadline: Duration,
) -> Result<StepResult> {
    let chans = channels(addr, concurrency)?;
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally {
        hist: Histogram::new_with_bounds(1, 600_000_000, 3)
            .map_err(|e| BenchError::system("harness", e))?,
        failed: BTreeMap::new(),
        samples: BTreeMap::new(),
        unanswered: 0,
        names: Vec::with_capacity(count),
    }));
    let started = Instant::now();
    let workers = (0..concurrency.max(1)).map(|w| {
        let (ch, next, tally) = (chans[w % chans.len()].clone(), next.clone(), tally.clone());
        let prefix = prefix.to_string();
        tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let name = format!("{prefix}-{i}");
                let t = Instant::now();
                let r =
                    tokio::time::timeout(deadline, until_created(&ch, api, &name, &tally)).await;
                let us = t.elapsed().as_micros() as u64;
                let mut g = tally.lock();
                match r {
                    Ok(created) => {
                        let _ = g.hist.record(us.max(1));
                        g.names.push(created);
                    }
                    Err(_) => g.unanswered += 1,
                }
            }
        })
    });
    for w in futures::future::join_all(workers).await {
        w.map_err(|e| BenchError::system("harness", e))?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut g = tally.lock();
    let ms = |v: u64| v as f64 / 1000.0;
    Ok(StepResult {
        api,
        concurrency,
        issued: count,
        ok: g.names.len(),
        failed: std::mem::take(&mut g.failed),
        failure_samples: std::mem::take(&mut g.samples),
        unanswered: g.unanswered,
        elapsed_s: elapsed,
        creates_per_s: g.names.len() as f64 / elapsed.max(1e-9),
        p50_ms: ms(g.hist.value_at_quantile(0.5)),
        p99_ms: ms(g.hist.value_at_quantile(0.99)),
        max_ms: ms(g.hist.max()),
        names: std::mem::take(&mut g.names),
    })
}

/// Pause between a failed attempt and its retry.
const RETRY_AFTER: Duration = Duration::from_millis(50);

/// Creates `name`, retrying a failed attempt (same request id: the create
/// is idempotent) as a client would; failed attempts are tallied by code.
async fn until_created(ch: &Channel, api: Api, name: &str, tally: &Mutex<Tally>) -> String {
    loop {
        match create(ch.clone(), api, name).await {
            Ok(created) => return created,
            Err(status) => {
                {
                    let mut g = tally.lock();
                    let code = format!("{:?}", status.code());
                    *g.failed.entry(code.clone()).or_default() += 1;
                    g.samples
                        .entry(code)
                        .or_insert_with(|| status.message().to_string());
                }
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
}

/// One create; the name the controller committed.
pub async fn create(
    ch: Channel,
    api: Api,
    name: &str,
) -> std::result::Result<String, tonic::Status> {
    let metadata: std::collections::HashMap<String, String> =
        [(METADATA.0.to_string(), METADATA.1.to_string())].into();
    match api {
        Api::FastPathV2 => {
            let r = FastPathServiceClient::new(ch)
                .create_sandbox(v2::CreateSandboxRequest {
                    request_id: name.into(),
                    image: "busybox".into(),
                    metadata,
                    completion: v2::CreateCompletion::Ready as i32,
                    ..Default::default()
                })
                .await?
                .into_inner();
            Ok(r.sandbox
                .and_then(|s| s.identity)
                .map(|i| i.name)
                .unwrap_or_else(|| name.to_string()))
        }
        Api::NativeFast | Api::NativeStrong => {
            let consistency = if api == Api::NativeFast {
                native::Consistency::Fast
            } else {
                native::Consistency::Strong
            };
            let r = SandboxServiceClient::new(ch)
                .create_sandbox(native::CreateSandboxRequest {
                    request_id: name.into(),
                    name: name.into(),
                    spec: Some(native::SandboxSpec {
                        image: "busybox".into(),
                        metadata,
                        ..Default::default()
                    }),
                    consistency: consistency as i32,
                    wait_ready: true,
                    ..Default::default()
                })
                .await?
                .into_inner();
            Ok(r.name)
        }
    }
}

/// Every record's name and phase through the native API, a page at a time.
pub async fn list_all(addr: SocketAddr) -> Result<Vec<(String, i32)>> {
    let ch = channels(addr, 1)?.remove(0);
    let mut c = SandboxServiceClient::new(ch).max_decoding_message_size(64 << 20);
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .list_sandboxes(native::ListSandboxesRequest {
                page_size: 2000,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| BenchError::system("controller", format!("ListSandboxes: {e}")))?
            .into_inner();
        out.extend(
            page.items
                .into_iter()
                .map(|s| (s.name, s.status.map_or(0, |st| st.phase))),
        );
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        token = page.next_page_token;
    }
}
