//! `/metrics` and `/metrics/watch`: CPU and memory of the sandbox.
//!
//! Inside a container the cgroup is what counts: memory limit and usage and CPU time
//! come from cgroup v2 (`/sys/fs/cgroup/{memory.max,memory.current,cpu.stat,cpu.max}`)
//! or v1 (`memory/…`, `cpuacct/…`), falling back to `/proc/meminfo` and `/proc/stat`
//! for the whole machine.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::state::AppState;
use crate::util::now_millis;

#[derive(Serialize, Debug, Clone, Copy)]
pub struct Metrics {
    pub cpu_count: f64,
    pub cpu_used_pct: f64,
    pub mem_total_mib: f64,
    pub mem_used_mib: f64,
    pub timestamp: i64,
}

/// Remembers the last CPU reading so a request can report usage since then.
#[derive(Default)]
pub struct CpuSampler {
    last: Option<(Instant, CpuReading)>,
}

#[derive(Clone, Copy, Debug)]
enum CpuReading {
    /// Cgroup CPU time used, in microseconds.
    Cgroup(u64),
    /// /proc/stat: (busy, total) jiffies.
    Host(u64, u64),
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn read_u64(path: &str) -> Option<u64> {
    read(path)?.trim().parse().ok()
}

fn cpu_reading() -> Option<CpuReading> {
    if let Some(stat) = read("/sys/fs/cgroup/cpu.stat") {
        for line in stat.lines() {
            if let Some(v) = line.strip_prefix("usage_usec ") {
                return v.trim().parse().ok().map(CpuReading::Cgroup);
            }
        }
    }
    for p in [
        "/sys/fs/cgroup/cpuacct/cpuacct.usage",
        "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage",
    ] {
        if let Some(ns) = read_u64(p) {
            return Some(CpuReading::Cgroup(ns / 1000));
        }
    }
    let stat = read("/proc/stat")?;
    let line = stat.lines().next()?;
    let vals: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    if vals.len() < 4 {
        return None;
    }
    let idle = vals[3] + vals.get(4).copied().unwrap_or(0);
    let total: u64 = vals.iter().take(8).sum();
    Some(CpuReading::Host(total - idle, total))
}

/// CPUs available to the sandbox: the cgroup quota if any, else the affinity mask.
pub fn cpu_count() -> f64 {
    let quota = read("/sys/fs/cgroup/cpu.max")
        .and_then(|s| {
            let mut it = s.split_whitespace();
            let q = it.next()?.parse::<f64>().ok()?;
            let p = it.next()?.parse::<f64>().ok()?;
            (p > 0.0).then_some(q / p)
        })
        .or_else(|| {
            let q = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")?
                .trim()
                .parse::<f64>()
                .ok()?;
            let p = read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")?
                .trim()
                .parse::<f64>()
                .ok()?;
            (q > 0.0 && p > 0.0).then_some(q / p)
        });
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as f64)
        .unwrap_or(1.0);
    match quota {
        Some(q) if q > 0.0 && q < cpus => q,
        _ => cpus,
    }
}

/// (total, used) memory in bytes.
pub fn memory() -> (u64, u64) {
    let mut host_total = 0;
    let mut host_avail = 0;
    if let Some(mi) = read("/proc/meminfo") {
        for line in mi.lines() {
            let val = || {
                line.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
                    * 1024
            };
            if line.starts_with("MemTotal:") {
                host_total = val();
            } else if line.starts_with("MemAvailable:") {
                host_avail = val();
            }
        }
    }
    // cgroup v2
    let limit = read("/sys/fs/cgroup/memory.max").and_then(|s| s.trim().parse::<u64>().ok());
    let usage = read_u64("/sys/fs/cgroup/memory.current");
    let inactive = |stat: Option<String>, key: &str| -> u64 {
        stat.and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(key)
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
        })
        .unwrap_or(0)
    };
    if let Some(u) = usage {
        let used = u.saturating_sub(inactive(
            read("/sys/fs/cgroup/memory.stat"),
            "inactive_file ",
        ));
        let total = limit
            .filter(|l| *l > 0 && (host_total == 0 || *l < host_total))
            .unwrap_or(host_total);
        return (total, if total > 0 { used.min(total) } else { used });
    }
    // cgroup v1
    if let Some(u) = read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes") {
        let l = read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes");
        let used = u.saturating_sub(inactive(
            read("/sys/fs/cgroup/memory/memory.stat"),
            "total_inactive_file ",
        ));
        let total = l
            .filter(|l| host_total == 0 || *l < host_total)
            .unwrap_or(host_total);
        if total < host_total || host_total == 0 {
            return (total, used);
        }
    }
    (host_total, host_total.saturating_sub(host_avail))
}

impl CpuSampler {
    /// CPU use in percent of the available CPUs since the previous sample (taking a
    /// short second sample when there is no recent one).
    fn percent_since(&mut self, now: Instant, reading: CpuReading, cpus: f64) -> Option<f64> {
        let prev = self.last.replace((now, reading));
        let (t0, r0) = prev?;
        let wall = now.duration_since(t0).as_secs_f64();
        match (r0, reading) {
            (CpuReading::Cgroup(a), CpuReading::Cgroup(b)) if wall > 0.0 => Some(
                ((b.saturating_sub(a)) as f64 / 1e6 / wall / cpus.max(0.01) * 100.0)
                    .clamp(0.0, 100.0),
            ),
            (CpuReading::Host(b0, t0), CpuReading::Host(b1, t1)) if t1 > t0 => {
                Some((b1.saturating_sub(b0) as f64 / (t1 - t0) as f64 * 100.0).clamp(0.0, 100.0))
            }
            _ => None,
        }
    }
}

/// Reads the metrics now.
pub async fn collect(state: &AppState) -> Metrics {
    let cpus = cpu_count();
    let stale = {
        let s = state.cpu();
        s.last
            .is_none_or(|(t, _)| t.elapsed() > Duration::from_secs(30))
    };
    if stale {
        if let Some(r) = cpu_reading() {
            state.cpu().last = Some((Instant::now(), r));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    } else if state
        .cpu()
        .last
        .is_some_and(|(t, _)| t.elapsed() < Duration::from_millis(50))
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pct = match cpu_reading() {
        Some(r) => state
            .cpu()
            .percent_since(Instant::now(), r, cpus)
            .unwrap_or(0.0),
        None => 0.0,
    };
    let (total, used) = memory();
    Metrics {
        cpu_count: cpus,
        cpu_used_pct: (pct * 100.0).round() / 100.0,
        mem_total_mib: (total as f64 / 1048576.0 * 100.0).round() / 100.0,
        mem_used_mib: (used as f64 / 1048576.0 * 100.0).round() / 100.0,
        timestamp: now_millis(),
    }
}

/// `GET /metrics`
#[tracing::instrument(skip_all)]
pub async fn get(State(state): State<AppState>) -> Response {
    axum::Json(collect(&state).await).into_response()
}

/// `GET /metrics/watch`: one JSON object per second, each followed by a blank line.
#[tracing::instrument(skip_all)]
pub async fn watch(State(state): State<AppState>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(2);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = tx.closed() => return,
            }
            let m = collect(&state).await;
            let mut v = serde_json::to_vec(&m).unwrap_or_default();
            v.extend_from_slice(b"\n\n");
            if tx.send(Ok(Bytes::from(v))).await.is_err() {
                return;
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    ));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
