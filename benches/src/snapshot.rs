//! Sandbox snapshots (issue 18): how long a capture takes and how long it
//! freezes the sandbox, for sandboxes with 1 MiB / 100 MiB / 1 GiB of
//! filesystem changes; and a create from a snapshot against a cold create
//! of the base image, interleaved in the same run (goal: ≤ 1.1×).
//!
//! Everything goes through the native API (`sandbolt.control.v1`) of a
//! fast-mode controller with an agent of its own (so the other scenarios'
//! controllers keep no snapshot and no source sandbox):
//!
//! - per size, one busybox source sandbox gets `size` MiB of random bytes
//!   written inside it (`dd` through execd, untimed); then `rounds` captures
//!   of it, each `CreateSnapshot` with `wait` timed from the client
//!   ([`CAPTURE`]; stages: the agent's own `took_us` and `paused_us`), the
//!   pause window the controller reports recorded on its own
//!   ([`PAUSE`]); every capture but the last is deleted after (untimed);
//! - then `rounds` rounds (after one warm-up) of a cold create of busybox
//!   and one create from each size's last snapshot, all `wait_ready` (the
//!   create answers once execd inside answers), in an order that rotates
//!   every round; each sandbox deleted after, untimed.

use std::time::{Duration, Instant};

use sandbolt_proto::control::v1 as control;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::control::v1::snapshot_service_client::SnapshotServiceClient;
use sandbolt_proto::wire::EXECD_PORT;
use tonic::transport::Channel;

use crate::systems::{Bench, ExtraController};
use crate::{Sample, Skipped};

/// Capture latency: `CreateSnapshot` with `wait`, client side.
pub const CAPTURE: &str = "snapshot capture (native, wait)";
/// The pause window of each capture, as the controller reports it.
pub const PAUSE: &str = "snapshot pause window (reported)";
/// Create from a snapshot vs cold create, interleaved.
pub const RESTORE: &str = "create from snapshot vs cold";
/// The cold baseline of [`RESTORE`].
pub const COLD: &str = "sandbolt native API, cold busybox";
/// Sandboxes and snapshots of the scenario live in this namespace.
const NAMESPACE: &str = "default";
const COMMAND_WITHIN: Duration = Duration::from_secs(600);

/// The system of [`CAPTURE`] and [`PAUSE`] for sandboxes with `mib` MiB of
/// changes.
pub fn capture_system(mib: u64) -> String {
    format!("{} of changes", size_name(mib))
}

/// The system of [`RESTORE`] creating from the snapshot of `mib` MiB.
pub fn restore_system(mib: u64) -> String {
    format!(
        "sandbolt native API, from snapshot ({} of changes)",
        size_name(mib)
    )
}

fn size_name(mib: u64) -> String {
    if mib >= 1024 && mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

/// What the scenario measured, and what it could not.
#[derive(Debug, Default)]
pub struct SnapshotOutcome {
    pub samples: Vec<Sample>,
    pub skipped: Vec<Skipped>,
    pub notes: Vec<String>,
}

impl SnapshotOutcome {
    fn skip(&mut self, system: &str, reason: impl std::fmt::Display) {
        tracing::warn!(system, %reason, "snapshots: cannot measure; continuing without it");
        self.skipped.push(Skipped {
            system: system.to_string(),
            reason: reason.to_string(),
        });
    }
}

/// Runs the scenario: for each of `sizes_mib`, `rounds` captures; then
/// `rounds` restore-vs-cold rounds (after one warm-up).
pub async fn run(bench: &Bench, rounds: u32, sizes_mib: &[u64]) -> SnapshotOutcome {
    let mut out = SnapshotOutcome::default();
    let mut setup = match Setup::start(bench).await {
        Ok(s) => s,
        Err(e) => {
            out.skip("snapshots", e);
            return out;
        }
    };
    // Per size: the snapshot kept for the restore rounds.
    let mut kept = Vec::new();
    for &mib in sizes_mib {
        match setup.captures(mib, rounds, &mut out).await {
            Ok(id) => kept.push((mib, id)),
            Err(e) => out.skip(&format!("{CAPTURE}: {}", capture_system(mib)), e),
        }
    }
    if !kept.is_empty()
        && let Err(e) = setup.restores(&kept, rounds, &mut out).await
    {
        out.skip(RESTORE, e);
    }
    setup.shutdown(&kept).await;
    out
}

fn micros(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

fn sandbox_ref(name: &str) -> Option<control::SandboxRef> {
    Some(control::SandboxRef {
        namespace: NAMESPACE.into(),
        name: name.into(),
        expected_uid: String::new(),
    })
}

fn snapshot_ref(id: &str) -> control::SnapshotRef {
    control::SnapshotRef {
        namespace: NAMESPACE.into(),
        id: id.into(),
        expected_uid: String::new(),
    }
}

/// A native create of busybox named `name` that answers once execd
/// answers; from `snapshot_id` when not empty (the image is then the
/// snapshot's). Everything else is the same for both, so their ratio is
/// what creating from a snapshot costs.
fn create_request(name: &str, snapshot_id: &str) -> control::CreateSandboxRequest {
    let mut r = crate::systems::native_create(name, false);
    if let Some(spec) = r.spec.as_mut()
        && !snapshot_id.is_empty()
    {
        spec.image.clear();
        spec.snapshot_id = snapshot_id.into();
    }
    r
}

struct Setup {
    extra: ExtraController,
    sandboxes: SandboxServiceClient<Channel>,
    snapshots: SnapshotServiceClient<Channel>,
    http: reqwest::Client,
    /// Source sandboxes made so far (removed at the end).
    sources: Vec<String>,
}

impl Setup {
    async fn start(bench: &Bench) -> Result<Setup, String> {
        let extra = bench
            .start_extra_controller("snapshot")
            .await
            .map_err(|e| e.to_string())?;
        let endpoint = format!("http://{}", extra.controller.local_addr());
        Ok(Setup {
            sandboxes: SandboxServiceClient::connect(endpoint.clone())
                .await
                .map_err(|e| e.to_string())?,
            snapshots: SnapshotServiceClient::connect(endpoint)
                .await
                .map_err(|e| e.to_string())?,
            http: reqwest::Client::builder()
                .timeout(COMMAND_WITHIN)
                .build()
                .map_err(|e| e.to_string())?,
            extra,
            sources: Vec::new(),
        })
    }

    /// Untimed: every kept snapshot, every source, then the controller.
    async fn shutdown(mut self, kept: &[(u64, String)]) {
        for (_, id) in kept {
            self.delete_snapshot(id).await;
        }
        for name in std::mem::take(&mut self.sources) {
            self.remove(&name).await;
        }
        self.extra.shutdown().await;
    }

    /// One create (`wait_ready`), checked to be Running; its latency.
    async fn create(&mut self, name: &str, snapshot_id: &str) -> Result<u64, String> {
        let t = Instant::now();
        let s = self
            .sandboxes
            .create_sandbox(create_request(name, snapshot_id))
            .await
            .map_err(|e| format!("create {name}: {e}"))?
            .into_inner();
        let us = micros(t);
        let phase = s.status.as_ref().map(|s| s.phase());
        if phase != Some(control::Phase::Running) {
            return Err(format!("create {name}: answered in phase {phase:?}"));
        }
        Ok(us)
    }

    /// Untimed removal; a failure is logged (names are never reused).
    async fn remove(&mut self, name: &str) {
        if let Err(e) = self
            .sandboxes
            .delete_sandbox(control::DeleteSandboxRequest {
                sandbox: sandbox_ref(name),
            })
            .await
        {
            tracing::debug!(name, error = %e, "snapshot scenario cleanup");
        }
    }

    async fn delete_snapshot(&mut self, id: &str) {
        if let Err(e) = self.snapshots.delete_snapshot(snapshot_ref(id)).await {
            tracing::debug!(id, error = %e, "snapshot scenario cleanup");
        }
    }

    /// Runs `command` with `sh -c` through execd of `name`, reached at the
    /// endpoint the controller resolves; fails unless it completes.
    async fn sh(&mut self, name: &str, command: &str) -> Result<(), String> {
        let ep = self
            .sandboxes
            .resolve_endpoint(control::ResolveEndpointRequest {
                sandbox: sandbox_ref(name),
                port: u32::from(EXECD_PORT),
            })
            .await
            .map_err(|e| format!("resolve execd of {name}: {e}"))?
            .into_inner();
        let mut req = self
            .http
            .post(format!("http://{}/command", ep.endpoint))
            .json(&serde_json::json!({ "command": command }));
        for (k, v) in &ep.headers {
            req = req.header(k, v);
        }
        let body = req
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| format!("execd of {name}: {e}"))?
            .text()
            .await
            .map_err(|e| format!("execd of {name}: {e}"))?;
        // execd streams JSON frames; an `error` frame is a non-zero exit.
        if !body.contains("execution_complete") || body.contains("\"type\":\"error\"") {
            return Err(format!("{command:?} in {name}: {body}"));
        }
        Ok(())
    }

    /// A source with `mib` MiB of changes and `rounds` timed captures of
    /// it; the id of the last one (kept for the restores).
    async fn captures(
        &mut self,
        mib: u64,
        rounds: u32,
        out: &mut SnapshotOutcome,
    ) -> Result<String, String> {
        let source = format!("snap-src-{mib}m");
        self.create(&source, "").await?;
        self.sources.push(source.clone());
        self.sh(
            &source,
            &format!("dd if=/dev/urandom of=/root/changes bs=1M count={mib} 2>/dev/null && sync"),
        )
        .await?;
        let system = capture_system(mib);
        let mut kept: Option<String> = None;
        let mut sizes = Vec::new();
        for i in 0..rounds.max(1) {
            if let Some(id) = kept.take() {
                self.delete_snapshot(&id).await;
            }
            let t = Instant::now();
            let snap = self
                .snapshots
                .create_snapshot(control::CreateSnapshotRequest {
                    request_id: format!("bench-snap-{mib}m-{i}"),
                    sandbox: sandbox_ref(&source),
                    display_name: format!("bench {system} #{i}"),
                    wait: true,
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("CreateSnapshot of {source}: {e}"))?
                .into_inner();
            let total_us = micros(t);
            if snap.phase() != control::SnapshotPhase::Ready {
                return Err(format!(
                    "capture of {source} ended {:?}: {}",
                    snap.phase(),
                    snap.message
                ));
            }
            let paused_us = u64::try_from(snap.paused_us).unwrap_or(0);
            let took_us = u64::try_from(snap.took_us).unwrap_or(0);
            out.samples.push(Sample {
                scenario: CAPTURE.into(),
                system: system.clone(),
                iteration: i,
                total_us,
                stages: vec![("agent_took".into(), took_us), ("paused".into(), paused_us)],
            });
            out.samples.push(Sample {
                scenario: PAUSE.into(),
                system: system.clone(),
                iteration: i,
                total_us: paused_us,
                stages: Vec::new(),
            });
            sizes.push(snap.size_bytes);
            kept = Some(snap.id);
        }
        out.notes.push(format!(
            "{CAPTURE}, {system}: reported sizes {} bytes",
            sizes
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
        kept.ok_or_else(|| "no capture".to_string())
    }

    /// `rounds` rounds (after a warm-up) of a cold create and a create from
    /// each of `kept`, in a rotating order.
    async fn restores(
        &mut self,
        kept: &[(u64, String)],
        rounds: u32,
        out: &mut SnapshotOutcome,
    ) -> Result<(), String> {
        let mut systems: Vec<(String, String)> = vec![(COLD.to_string(), String::new())];
        systems.extend(
            kept.iter()
                .map(|(mib, id)| (restore_system(*mib), id.clone())),
        );
        for i in 0..=rounds {
            // Rotated: each goes first as often as the others, so none
            // always pays for the teardown just before it.
            let mut order = systems.clone();
            let n = order.len();
            order.rotate_left(i as usize % n);
            for (k, (system, snapshot_id)) in order.into_iter().enumerate() {
                let name = format!("snap-r{i}-{k}");
                let created = self.create(&name, &snapshot_id).await;
                self.remove(&name).await;
                let total_us = created.map_err(|e| format!("{system}: {e}"))?;
                if i == 0 {
                    continue;
                }
                out.samples.push(Sample {
                    scenario: RESTORE.into(),
                    system,
                    iteration: i,
                    total_us,
                    stages: Vec::new(),
                });
            }
        }
        Ok(())
    }
}

/// Create from snapshot ÷ cold create (p50, p90, and the median of the
/// per-round ratios) for each snapshot size measured.
pub fn ratios(samples: &[Sample]) -> Vec<(String, f64)> {
    let restore_systems: std::collections::BTreeSet<&str> = samples
        .iter()
        .filter(|s| s.scenario == RESTORE && s.system != COLD)
        .map(|s| s.system.as_str())
        .collect();
    restore_systems
        .into_iter()
        .flat_map(|system| {
            crate::stats::ratio_rows(
                samples,
                RESTORE,
                system,
                COLD,
                &format!("{RESTORE}: {system} ÷ {COLD}"),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(system: &str, iteration: u32, total_us: u64) -> Sample {
        Sample {
            scenario: RESTORE.into(),
            system: system.into(),
            iteration,
            total_us,
            stages: Vec::new(),
        }
    }

    #[test]
    fn sizes_are_named_in_the_unit_they_were_asked_in() {
        assert_eq!(capture_system(1), "1 MiB of changes");
        assert_eq!(capture_system(100), "100 MiB of changes");
        assert_eq!(capture_system(1024), "1 GiB of changes");
        assert_eq!(capture_system(1536), "1536 MiB of changes");
    }

    #[test]
    fn restore_ratios_compare_each_size_with_the_cold_creates_of_the_run() {
        let one = restore_system(1);
        let samples = [
            sample(COLD, 1, 100),
            sample(&one, 1, 110),
            sample(COLD, 2, 200),
            sample(&one, 2, 200),
        ];
        let r = ratios(&samples);
        assert_eq!(r.len(), 3, "{r:?}");
        assert!(r.iter().all(|(name, _)| name.contains(&one)), "{r:?}");
        // Per-round ratios 1.1 and 1.0: median 1.05.
        assert!((r[2].1 - 1.05).abs() < 1e-9, "{r:?}");
        assert!(ratios(&samples[1..2]).is_empty());
    }
}
