//! The controller's [`Store`], each write timed into
//! `sandbolt_controller_store_write_duration_seconds` (see
//! `crate::metrics`), whichever backend is behind it. Reads are not timed:
//! both backends answer them from memory.
//!
//! Every method of the trait is forwarded, the defaulted ones too: a
//! default left in place here would hide the backend's own version (the
//! Kubernetes store's tombstones and template catalog). A method added to
//! the trait must be added here.

use std::sync::Arc;
use std::time::Instant;

use super::{
    AgentRecord, ExitObserver, ListRange, SandboxRecord, SnapshotRecord, Store, StoreResult,
    WarmPoolRecord,
};
use crate::ids::SandboxKey;
use crate::metrics::{ControllerMetrics, StoreWrite};

pub(crate) struct TimedStore {
    inner: Arc<dyn Store>,
    metrics: ControllerMetrics,
}

impl TimedStore {
    pub(crate) fn new(inner: Arc<dyn Store>, metrics: ControllerMetrics) -> Self {
        Self { inner, metrics }
    }

    /// Runs the write `op` of the inner store, timing it (failed writes
    /// too: a conflict costs the round trip all the same).
    fn timed<T>(&self, op: &'static str, write: impl FnOnce(&dyn Store) -> T) -> T {
        let started = Instant::now();
        let out = blocking(|| write(self.inner.as_ref()));
        let store = self.inner.backend();
        self.metrics
            .observe_store_write(StoreWrite { store, op }, started.elapsed());
        out
    }
}

/// Runs `f`, which blocks (a write's fsync or API round trip, a read of
/// every record), off the async runtime's worker when called on one: the
/// store is synchronous and the controller calls it from async handlers;
/// on a multi-threaded runtime the worker's other tasks (heartbeats,
/// reads, other creates) move to another thread meanwhile instead of
/// waiting behind it. Elsewhere (no runtime, a current-thread runtime as in
/// unit tests, a blocking thread) `f` simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Store for TimedStore {
    fn create(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        self.timed("create", |s| s.create(record))
    }
    fn get(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        self.inner.get(key)
    }
    fn get_by_request_id(&self, request_id: &str) -> StoreResult<Option<SandboxRecord>> {
        self.inner.get_by_request_id(request_id)
    }
    fn replace(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        self.timed("replace", |s| s.replace(record))
    }
    fn delete(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        self.timed("delete", |s| s.delete(key))
    }
    fn delete_expired(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        self.timed("delete_expired", |s| s.delete_expired(key))
    }
    fn delete_tombstone(&self, key: &SandboxKey) -> StoreResult<bool> {
        self.timed("delete_tombstone", |s| s.delete_tombstone(key))
    }
    fn list(&self, range: &ListRange<'_>) -> StoreResult<Vec<SandboxRecord>> {
        if range.limit == 0 {
            return blocking(|| self.inner.list(range));
        }
        self.inner.list(range)
    }
    fn get_by_sandbox_id(&self, sandbox_id: &str) -> StoreResult<Option<SandboxRecord>> {
        self.inner.get_by_sandbox_id(sandbox_id)
    }
    fn sandbox_owner(&self, sandbox_id: &str) -> StoreResult<Option<SandboxKey>> {
        self.inner.sandbox_owner(sandbox_id)
    }
    fn list_filtered(
        &self,
        range: &ListRange<'_>,
        filter: &std::collections::BTreeMap<String, String>,
    ) -> StoreResult<Vec<SandboxRecord>> {
        if range.limit == 0 {
            return blocking(|| self.inner.list_filtered(range, filter));
        }
        self.inner.list_filtered(range, filter)
    }
    fn put_agent(&self, agent: &AgentRecord) -> StoreResult<()> {
        self.timed("put_agent", |s| s.put_agent(agent))
    }
    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>> {
        self.inner.list_agents()
    }
    fn put_warm_pool(&self, pool: &WarmPoolRecord) -> StoreResult<WarmPoolRecord> {
        self.timed("put_warm_pool", |s| s.put_warm_pool(pool))
    }
    fn list_warm_pools(&self) -> StoreResult<Vec<WarmPoolRecord>> {
        self.inner.list_warm_pools()
    }
    fn delete_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        self.timed("delete_warm_pool", |s| s.delete_warm_pool(name))
    }
    fn get_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        self.inner.get_warm_pool(name)
    }
    fn put_snapshot(&self, snapshot: &SnapshotRecord) -> StoreResult<SnapshotRecord> {
        self.timed("put_snapshot", |s| s.put_snapshot(snapshot))
    }
    fn get_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        self.inner.get_snapshot(id)
    }
    fn list_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        self.inner.list_snapshots()
    }
    fn delete_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        self.timed("delete_snapshot", |s| s.delete_snapshot(id))
    }
    fn publish_observed_exits(&self, observer: ExitObserver) {
        self.inner.publish_observed_exits(observer);
    }
    fn template_catalog(&self) -> Option<&crate::template::TemplateCatalog> {
        self.inner.template_catalog()
    }
    fn deletions_requested(&self) -> Vec<SandboxKey> {
        self.inner.deletions_requested()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}
