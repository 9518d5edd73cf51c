//! Sandbox snapshots: records, captures on the agents, deletion once unused.
//!
//! A snapshot record is put PENDING before its source's agent is asked to
//! capture, so a capture never exists without a record (the janitor removes
//! what a record does not own). Files, read top-down:
//! - `model.rs`: request checks, the wire form, list filter and pages;
//! - `capture.rs`: create (idempotent by request id), the capture task
//!   (PENDING → READY or FAILED), re-driving PENDING records at start;
//! - `delete.rs`: delete, [`Core::snapshot_released`] and the sweep of
//!   snapshots whose deletion waits for their restored sandboxes;
//! - `service.rs`: `sandbolt.control.v1.SnapshotService`.

mod capture;
mod delete;
pub mod model;
pub mod service;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

pub use model::SnapshotFilter;

use crate::clock;
use crate::error::{Error, Result};
use crate::ids::{AgentId, SandboxKey};
use crate::placement::or_default;
use crate::registry::AgentInfo;
use crate::sandbox::Core;
use crate::store::{SnapshotRecord, StoreError};

/// How often snapshots whose deletion waits (DELETING) are looked at again.
pub const SNAPSHOT_SWEEP_PERIOD: Duration = Duration::from_secs(10);

/// A snapshot record and the names of the sandboxes restored from it.
pub type SnapshotInUse = (SnapshotRecord, Vec<String>);

/// A snapshot create, from any API.
#[derive(Debug, Clone)]
pub struct SnapshotCreate {
    /// Idempotency key (empty: none).
    pub request_id: String,
    /// The source sandbox; its namespace is the snapshot's.
    pub source: SandboxKey,
    /// When set, the source must be this record (else NOT_FOUND).
    pub expected_uid: String,
    pub display_name: String,
    pub metadata: BTreeMap<String, String>,
    /// Answer once READY or FAILED instead of at once (PENDING).
    pub wait: bool,
}

/// The agent a snapshot lives on (records keep it as a plain string).
fn agent_of(r: &SnapshotRecord) -> AgentId {
    AgentId::from(r.agent_id.as_str())
}

impl Core {
    /// The snapshot's agent if it is registered and not lost.
    fn live_snapshot_agent(&self, r: &SnapshotRecord) -> Option<(AgentId, AgentInfo)> {
        let id = agent_of(r);
        let a = self.registry.agent(&id).filter(|a| !a.lost)?;
        Some((id, a))
    }

    /// The snapshot `id` of `namespace`; NOT_FOUND when it does not exist
    /// there or (with `expected_uid`) is another record.
    pub fn get_snapshot(
        &self,
        namespace: &str,
        id: &str,
        expected_uid: &str,
    ) -> Result<SnapshotRecord> {
        self.store
            .get_snapshot(id)?
            .filter(|r| r.namespace == or_default(namespace))
            .filter(|r| expected_uid.is_empty() || r.uid == expected_uid)
            .ok_or_else(|| StoreError::SnapshotNotFound(id.to_string()).into())
    }

    /// The snapshot of `namespace` that FastPath v2 calls `name`: the one
    /// whose id it is, else the one created with it as request id. A v2
    /// client names its snapshots by the request id it chose (fast-sandbox
    /// names the resource after it; the OpenSandbox server reads, deletes
    /// and restores its snapshots by that name), while sandbolt's ids are
    /// its own. A request id names one snapshot per namespace (creates are
    /// idempotent by it).
    pub fn snapshot_named(&self, namespace: &str, name: &str) -> Result<Option<SnapshotRecord>> {
        let namespace = or_default(namespace);
        if name.is_empty() {
            return Ok(None);
        }
        if let Some(r) = self
            .store
            .get_snapshot(name)?
            .filter(|r| r.namespace == namespace)
        {
            return Ok(Some(r));
        }
        self.snapshot_of_request_id(namespace, name)
    }

    /// The snapshot of `namespace` created with `request_id` (a request id
    /// names one snapshot per namespace: creates are idempotent by it).
    pub(crate) fn snapshot_of_request_id(
        &self,
        namespace: &str,
        request_id: &str,
    ) -> Result<Option<SnapshotRecord>> {
        Ok(self
            .store
            .list_snapshots()?
            .into_iter()
            .find(|r| r.namespace == namespace && r.request_id == request_id))
    }

    /// [`Core::snapshot_named`], NOT_FOUND when there is none or (with
    /// `expected_uid`) it is another record.
    pub fn get_snapshot_named(
        &self,
        namespace: &str,
        name: &str,
        expected_uid: &str,
    ) -> Result<SnapshotRecord> {
        self.snapshot_named(namespace, name)?
            .filter(|r| expected_uid.is_empty() || r.uid == expected_uid)
            .ok_or_else(|| StoreError::SnapshotNotFound(name.to_string()).into())
    }

    /// Names of the sandbox records restored from snapshot `id`: while any
    /// exists the snapshot stays.
    pub fn snapshot_users(&self, id: &str) -> Result<Vec<String>> {
        let sandboxes = self.store.list(&crate::store::ListRange::all())?;
        Ok(model::users_by_snapshot(&sandboxes)
            .remove(id)
            .unwrap_or_default())
    }

    /// One page of the snapshots `filter` matches, each with its users,
    /// and the next page's token (empty on the last page).
    pub fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
        page_size: usize,
        page_token: &str,
    ) -> Result<(Vec<SnapshotInUse>, String)> {
        let filter = SnapshotFilter {
            namespace: or_default(&filter.namespace).to_string(),
            ..filter.clone()
        };
        let (page, next) =
            model::page(self.store.list_snapshots()?, &filter, page_size, page_token)?;
        let sandboxes = self.store.list(&crate::store::ListRange::all())?;
        let mut users = model::users_by_snapshot(&sandboxes);
        let items = page
            .into_iter()
            .map(|r| {
                let u = users.remove(&r.id).unwrap_or_default();
                (r, u)
            })
            .collect();
        Ok((items, next))
    }

    /// Read-modify-write of a snapshot record; `f` may refuse. A conflict
    /// means a newer record to apply `f` to, at once.
    pub(crate) fn modify_snapshot(
        &self,
        id: &str,
        mut f: impl FnMut(&mut SnapshotRecord) -> Result<()>,
    ) -> Result<SnapshotRecord> {
        for _ in 0..16 {
            let mut r = self
                .store
                .get_snapshot(id)?
                .ok_or_else(|| StoreError::SnapshotNotFound(id.to_string()))?;
            let before = r.phase;
            f(&mut r)?;
            if r.phase != before {
                r.last_transition_unix_ms = clock::now_unix_ms();
            }
            match self.store.put_snapshot(&r) {
                Err(StoreError::SnapshotConflict(_)) => continue,
                done => return Ok(done?),
            }
        }
        Err(Error::Aborted(format!(
            "snapshot {id} keeps changing; retry"
        )))
    }

    /// The leader's snapshot upkeep until `stop`: re-drives the captures
    /// `pending` names (PENDING records found at start) once their agents
    /// are back, and every [`SNAPSHOT_SWEEP_PERIOD`] removes DELETING
    /// snapshots nothing uses any more.
    pub async fn snapshot_upkeep(
        self: Arc<Self>,
        mut pending: Vec<SnapshotRecord>,
        tick: Duration,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut last_sweep = tokio::time::Instant::now();
        loop {
            tokio::select! {
                r = stop.wait_for(|s| *s) => { drop(r); return; }
                _ = tokio::time::sleep(tick) => {}
            }
            if !pending.is_empty() && self.is_ready() {
                pending = self.redrive_captures(pending);
            }
            if last_sweep.elapsed() >= SNAPSHOT_SWEEP_PERIOD {
                last_sweep = tokio::time::Instant::now();
                self.sweep_snapshots().await;
            }
        }
    }
}
