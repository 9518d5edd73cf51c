//! The embedded store: one redb file, the default for `sandbolt up`.
//!
//! Records are JSON (readable with any redb tool while debugging; the record
//! is small and the write cost is the fsync, not the encoding). Every write
//! is one transaction with `Durability::Immediate`, so a record the
//! controller acknowledged survives `kill -9`.
//!
//! Two index tables are written in the same transaction as the record, so
//! they can never disagree with it: container id → record
//! ([`Store::get_by_sandbox_id`]) and metadata pair → record
//! ([`Store::list_filtered`]). A file written before they existed gets them
//! built once when it is opened ([`INDEX_VERSION`]).

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{
    AgentRecord, ListRange, SandboxRecord, SnapshotRecord, Store, StoreError, StoreResult,
    WarmPoolRecord, metadata_matches,
};
use crate::ids::SandboxKey;

/// `namespace \0 name` → record JSON.
const SANDBOXES: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("sandboxes");
/// request id → `namespace \0 name`.
const REQUEST_IDS: TableDefinition<'_, &str, &str> = TableDefinition::new("request_ids");
/// agent id → agent JSON.
const AGENTS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("agents");
/// warm pool name → (revision, warm pool JSON).
const WARM_POOLS: TableDefinition<'_, &str, (u64, &[u8])> = TableDefinition::new("warm_pools");
/// snapshot id → (revision, snapshot JSON).
const SNAPSHOTS: TableDefinition<'_, &str, (u64, &[u8])> = TableDefinition::new("snapshots");
/// container (sandbox) id → `namespace \0 name`.
const SANDBOX_IDS: TableDefinition<'_, &str, &str> = TableDefinition::new("sandbox_ids");
/// `namespace \0 key \0 value \0 name` of every metadata pair → nothing:
/// the names of one namespace holding one pair are one key range, in name
/// order.
const METADATA: TableDefinition<'_, &str, ()> = TableDefinition::new("metadata_index");
/// `"indexes"` → the [`INDEX_VERSION`] the index tables were built for.
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");
/// Bumped when the index tables change shape: a file with another version
/// gets them rebuilt at open.
const INDEX_VERSION: u64 = 1;

pub struct RedbStore {
    db: Database,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// The table key of a record: sorts by namespace, then name.
fn table_key(namespace: &str, name: &str) -> String {
    format!("{namespace}\0{name}")
}

fn key(k: &SandboxKey) -> String {
    table_key(&k.namespace, &k.name)
}

fn decode(bytes: &[u8]) -> StoreResult<SandboxRecord> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// [`Store::list_filtered`] by scanning `range` (no namespace, or no
/// filter to drive an index with).
fn scan_filtered(
    store: &RedbStore,
    range: &ListRange<'_>,
    filter: &BTreeMap<String, String>,
) -> StoreResult<Vec<SandboxRecord>> {
    let all = store.list(&range.limit(0))?;
    range.take(
        all.into_iter()
            .filter(|r| metadata_matches(r, filter))
            .map(Ok),
    )
}

fn parse_revision(r: &str) -> StoreResult<u64> {
    r.parse()
        .map_err(|_| StoreError::Corrupt(format!("revision {r:?} is not a number")))
}

fn encode<T: serde::Serialize>(v: &T) -> StoreResult<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| StoreError::Corrupt(e.to_string()))
}

impl RedbStore {
    /// Opens (or creates) `dir/controller.redb`.
    pub fn open(dir: &Path) -> StoreResult<Self> {
        std::fs::create_dir_all(dir).map_err(backend)?;
        let db = Database::create(dir.join("controller.redb")).map_err(backend)?;
        // Create the tables up front so readers never see "table missing".
        let tx = db.begin_write().map_err(backend)?;
        tx.open_table(SANDBOXES).map_err(backend)?;
        tx.open_table(REQUEST_IDS).map_err(backend)?;
        tx.open_table(AGENTS).map_err(backend)?;
        tx.open_table(WARM_POOLS).map_err(backend)?;
        tx.open_table(SNAPSHOTS).map_err(backend)?;
        let built = tx
            .open_table(META)
            .map_err(backend)?
            .get("indexes")
            .map_err(backend)?
            .map(|v| v.value());
        if built != Some(INDEX_VERSION) {
            build_indexes(&tx)?;
        }
        tx.commit().map_err(backend)?;
        Ok(Self { db })
    }
}

/// Fills the index tables from every record (a file from before they
/// existed, or of another index version), inside the opening transaction.
fn build_indexes(tx: &redb::WriteTransaction) -> StoreResult<()> {
    let started = std::time::Instant::now();
    let sandboxes = tx.open_table(SANDBOXES).map_err(backend)?;
    let mut sids = tx.open_table(SANDBOX_IDS).map_err(backend)?;
    let mut meta = tx.open_table(METADATA).map_err(backend)?;
    sids.retain(|_, _| false).map_err(backend)?;
    meta.retain(|_, _| false).map_err(backend)?;
    let mut n = 0;
    for row in sandboxes.iter().map_err(backend)? {
        let (k, v) = row.map_err(backend)?;
        index(&mut sids, &mut meta, k.value(), &decode(v.value())?)?;
        n += 1;
    }
    tx.open_table(META)
        .map_err(backend)?
        .insert("indexes", INDEX_VERSION)
        .map_err(backend)?;
    tracing::info!(records = n, took = ?started.elapsed(), "store indexes built");
    Ok(())
}

/// The metadata index key of one pair of the record at `namespace`/`name`.
fn metadata_key(namespace: &str, key: &str, value: &str, name: &str) -> String {
    format!("{namespace}\0{key}\0{value}\0{name}")
}

type SidTable<'t> = redb::Table<'t, &'static str, &'static str>;
type MetaTable<'t> = redb::Table<'t, &'static str, ()>;

/// Adds `r` (stored at table key `k`) to the index tables.
fn index(
    sids: &mut SidTable<'_>,
    meta: &mut MetaTable<'_>,
    k: &str,
    r: &SandboxRecord,
) -> StoreResult<()> {
    if !r.sandbox_id.is_empty() {
        sids.insert(r.sandbox_id.as_str(), k).map_err(backend)?;
    }
    for (mk, mv) in &r.spec.metadata {
        meta.insert(metadata_key(&r.namespace, mk, mv, &r.name).as_str(), ())
            .map_err(backend)?;
    }
    Ok(())
}

/// Removes `r` (stored at table key `k`) from the index tables; a
/// container id another record holds now stays its.
fn unindex(
    sids: &mut SidTable<'_>,
    meta: &mut MetaTable<'_>,
    k: &str,
    r: &SandboxRecord,
) -> StoreResult<()> {
    if !r.sandbox_id.is_empty() {
        let holder = sids
            .get(r.sandbox_id.as_str())
            .map_err(backend)?
            .map(|g| g.value() == k);
        if holder == Some(true) {
            sids.remove(r.sandbox_id.as_str()).map_err(backend)?;
        }
    }
    for (mk, mv) in &r.spec.metadata {
        meta.remove(metadata_key(&r.namespace, mk, mv, &r.name).as_str())
            .map_err(backend)?;
    }
    Ok(())
}

impl Store for RedbStore {
    fn backend(&self) -> &'static str {
        "embedded"
    }

    fn create(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        let tx = self.db.begin_write().map_err(backend)?;
        let mut out = record.clone();
        {
            let mut sandboxes = tx.open_table(SANDBOXES).map_err(backend)?;
            let mut rids = tx.open_table(REQUEST_IDS).map_err(backend)?;
            if !record.request_id.is_empty() {
                let holder = rids
                    .get(record.request_id.as_str())
                    .map_err(backend)?
                    .map(|g| g.value().to_string());
                if let Some(k) = holder
                    && let Some(existing) = sandboxes.get(k.as_str()).map_err(backend)?
                {
                    return Err(StoreError::AlreadyExists(Box::new(decode(
                        existing.value(),
                    )?)));
                }
            }
            let k = key(&record.key());
            if let Some(existing) = sandboxes.get(k.as_str()).map_err(backend)? {
                return Err(StoreError::AlreadyExists(Box::new(decode(
                    existing.value(),
                )?)));
            }
            out.revision = "1".into();
            sandboxes
                .insert(k.as_str(), encode(&out)?.as_slice())
                .map_err(backend)?;
            let mut sids = tx.open_table(SANDBOX_IDS).map_err(backend)?;
            let mut meta = tx.open_table(METADATA).map_err(backend)?;
            index(&mut sids, &mut meta, &k, &out)?;
            if !record.request_id.is_empty() {
                rids.insert(record.request_id.as_str(), k.as_str())
                    .map_err(backend)?;
            }
        }
        tx.commit().map_err(backend)?;
        Ok(out)
    }

    fn get(&self, k: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        let tx = self.db.begin_read().map_err(backend)?;
        let t = tx.open_table(SANDBOXES).map_err(backend)?;
        t.get(key(k).as_str())
            .map_err(backend)?
            .map(|g| decode(g.value()))
            .transpose()
    }

    fn get_by_request_id(&self, request_id: &str) -> StoreResult<Option<SandboxRecord>> {
        let tx = self.db.begin_read().map_err(backend)?;
        let rids = tx.open_table(REQUEST_IDS).map_err(backend)?;
        let Some(k) = rids
            .get(request_id)
            .map_err(backend)?
            .map(|g| g.value().to_string())
        else {
            return Ok(None);
        };
        let t = tx.open_table(SANDBOXES).map_err(backend)?;
        t.get(k.as_str())
            .map_err(backend)?
            .map(|g| decode(g.value()))
            .transpose()
    }

    fn replace(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        let tx = self.db.begin_write().map_err(backend)?;
        let mut out = record.clone();
        {
            let mut t = tx.open_table(SANDBOXES).map_err(backend)?;
            let k = key(&record.key());
            let current = match t.get(k.as_str()).map_err(backend)? {
                Some(g) => decode(g.value())?,
                None => return Err(StoreError::NotFound(record.key())),
            };
            if current.revision != record.revision || current.uid != record.uid {
                return Err(StoreError::Conflict(record.key()));
            }
            out.revision = (parse_revision(&current.revision)? + 1).to_string();
            t.insert(k.as_str(), encode(&out)?.as_slice())
                .map_err(backend)?;
            if current.sandbox_id != out.sandbox_id || current.spec.metadata != out.spec.metadata {
                let mut sids = tx.open_table(SANDBOX_IDS).map_err(backend)?;
                let mut meta = tx.open_table(METADATA).map_err(backend)?;
                unindex(&mut sids, &mut meta, &k, &current)?;
                index(&mut sids, &mut meta, &k, &out)?;
            }
        }
        tx.commit().map_err(backend)?;
        Ok(out)
    }

    fn delete(&self, k: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        let tx = self.db.begin_write().map_err(backend)?;
        let removed = {
            let mut t = tx.open_table(SANDBOXES).map_err(backend)?;
            let removed = t
                .remove(key(k).as_str())
                .map_err(backend)?
                .map(|g| decode(g.value()));
            let removed = removed.transpose()?;
            if let Some(r) = &removed
                && !r.request_id.is_empty()
            {
                let mut rids = tx.open_table(REQUEST_IDS).map_err(backend)?;
                rids.remove(r.request_id.as_str()).map_err(backend)?;
            }
            if let Some(r) = &removed {
                let mut sids = tx.open_table(SANDBOX_IDS).map_err(backend)?;
                let mut meta = tx.open_table(METADATA).map_err(backend)?;
                unindex(&mut sids, &mut meta, &key(k), r)?;
            }
            removed
        };
        tx.commit().map_err(backend)?;
        Ok(removed)
    }

    fn list(&self, range: &ListRange<'_>) -> StoreResult<Vec<SandboxRecord>> {
        let tx = self.db.begin_read().map_err(backend)?;
        let t = tx.open_table(SANDBOXES).map_err(backend)?;
        // Keys sort by namespace, then name: a namespace is one key range.
        let (lo, hi): (Bound<String>, Bound<String>) = match range.namespace {
            Some(ns) => (
                match range.after {
                    Some(a) => Bound::Excluded(table_key(ns, a)),
                    None => Bound::Included(format!("{ns}\0")),
                },
                Bound::Excluded(format!("{ns}\u{1}")),
            ),
            None => (Bound::Unbounded, Bound::Unbounded),
        };
        let rows = t
            .range::<&str>((
                lo.as_ref().map(|s| s.as_str()),
                hi.as_ref().map(|s| s.as_str()),
            ))
            .map_err(backend)?;
        range.take(rows.map(|row| decode(row.map_err(backend)?.1.value())))
    }

    fn get_by_sandbox_id(&self, sandbox_id: &str) -> StoreResult<Option<SandboxRecord>> {
        if sandbox_id.is_empty() {
            return Ok(None);
        }
        let tx = self.db.begin_read().map_err(backend)?;
        let sids = tx.open_table(SANDBOX_IDS).map_err(backend)?;
        let Some(k) = sids
            .get(sandbox_id)
            .map_err(backend)?
            .map(|g| g.value().to_string())
        else {
            return Ok(None);
        };
        let t = tx.open_table(SANDBOXES).map_err(backend)?;
        let found = t.get(k.as_str()).map_err(backend)?;
        let record = found.map(|g| decode(g.value())).transpose()?;
        Ok(record.filter(|r| r.sandbox_id == sandbox_id))
    }

    fn sandbox_owner(&self, sandbox_id: &str) -> StoreResult<Option<SandboxKey>> {
        if sandbox_id.is_empty() {
            return Ok(None);
        }
        let tx = self.db.begin_read().map_err(backend)?;
        let sids = tx.open_table(SANDBOX_IDS).map_err(backend)?;
        let found = sids.get(sandbox_id).map_err(backend)?;
        Ok(found.and_then(|g| {
            g.value()
                .split_once('\0')
                .map(|(ns, name)| SandboxKey::new(ns, name))
        }))
    }

    fn list_filtered(
        &self,
        range: &ListRange<'_>,
        filter: &BTreeMap<String, String>,
    ) -> StoreResult<Vec<SandboxRecord>> {
        // The index drives by its first pair; the others are checked on the
        // records it yields (they are few: those holding the first pair).
        let (Some(ns), Some((fk, fv))) = (range.namespace, filter.iter().next()) else {
            return scan_filtered(self, range, filter);
        };
        let tx = self.db.begin_read().map_err(backend)?;
        let meta = tx.open_table(METADATA).map_err(backend)?;
        let t = tx.open_table(SANDBOXES).map_err(backend)?;
        let prefix = metadata_key(ns, fk, fv, "");
        let lo = match range.after {
            Some(a) => Bound::Excluded(metadata_key(ns, fk, fv, a)),
            None => Bound::Included(prefix.clone()),
        };
        // Every key of the prefix (which ends in \0) sorts below the prefix
        // with its last byte raised to \u{1}.
        let hi = Bound::Excluded(format!("{}\u{1}", &prefix[..prefix.len() - 1]));
        let rows = meta
            .range::<&str>((
                lo.as_ref().map(|s| s.as_str()),
                hi.as_ref().map(|s| s.as_str()),
            ))
            .map_err(backend)?;
        let records = rows.filter_map(|row| {
            let row = match row {
                Ok(row) => row,
                Err(e) => return Some(Err(backend(e))),
            };
            let name = &row.0.value()[prefix.len()..];
            match t.get(table_key(ns, name).as_str()) {
                Ok(Some(g)) => match decode(g.value()) {
                    Ok(r) if metadata_matches(&r, filter) => Some(Ok(r)),
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                },
                Ok(None) => None,
                Err(e) => Some(Err(backend(e))),
            }
        });
        range.take(records)
    }

    fn put_agent(&self, agent: &AgentRecord) -> StoreResult<()> {
        let tx = self.db.begin_write().map_err(backend)?;
        {
            let mut t = tx.open_table(AGENTS).map_err(backend)?;
            t.insert(agent.agent_id.as_str(), encode(agent)?.as_slice())
                .map_err(backend)?;
        }
        tx.commit().map_err(backend)
    }

    fn put_warm_pool(&self, pool: &WarmPoolRecord) -> StoreResult<WarmPoolRecord> {
        self.put_revisioned(WARM_POOLS, pool)
    }

    fn list_warm_pools(&self) -> StoreResult<Vec<WarmPoolRecord>> {
        self.list_revisioned(WARM_POOLS)
    }

    fn delete_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        self.delete_revisioned(WARM_POOLS, name)
    }

    fn put_snapshot(&self, snapshot: &SnapshotRecord) -> StoreResult<SnapshotRecord> {
        self.put_revisioned(SNAPSHOTS, snapshot)
    }

    fn get_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        let tx = self.db.begin_read().map_err(backend)?;
        let t = tx.open_table(SNAPSHOTS).map_err(backend)?;
        let got = t.get(id).map_err(backend)?;
        got.map(|v| {
            let (revision, bytes) = v.value();
            decode_revisioned(revision, bytes)
        })
        .transpose()
    }

    fn list_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        self.list_revisioned(SNAPSHOTS)
    }

    fn delete_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        self.delete_revisioned(SNAPSHOTS, id)
    }

    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>> {
        let tx = self.db.begin_read().map_err(backend)?;
        let t = tx.open_table(AGENTS).map_err(backend)?;
        let mut out = Vec::new();
        for item in t.iter().map_err(backend)? {
            let (_, v) = item.map_err(backend)?;
            out.push(
                serde_json::from_slice(v.value())
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            );
        }
        Ok(out)
    }
}

/// A record kept in a `name → (revision, JSON)` table with optimistic
/// concurrency: warm pools and snapshots.
trait Revisioned: serde::Serialize + serde::de::DeserializeOwned + Clone {
    fn table_key(&self) -> &str;
    fn revision(&self) -> &str;
    fn set_revision(&mut self, revision: String);
    fn exists(key: &str) -> StoreError;
    fn not_found(key: &str) -> StoreError;
    fn conflict(key: &str) -> StoreError;
}

impl Revisioned for WarmPoolRecord {
    fn table_key(&self) -> &str {
        &self.name
    }
    fn revision(&self) -> &str {
        &self.revision
    }
    fn set_revision(&mut self, revision: String) {
        self.revision = revision;
    }
    fn exists(key: &str) -> StoreError {
        StoreError::WarmPoolExists(key.into())
    }
    fn not_found(key: &str) -> StoreError {
        StoreError::WarmPoolNotFound(key.into())
    }
    fn conflict(key: &str) -> StoreError {
        StoreError::WarmPoolConflict(key.into())
    }
}

impl Revisioned for SnapshotRecord {
    fn table_key(&self) -> &str {
        &self.id
    }
    fn revision(&self) -> &str {
        &self.revision
    }
    fn set_revision(&mut self, revision: String) {
        self.revision = revision;
    }
    fn exists(key: &str) -> StoreError {
        StoreError::SnapshotExists(key.into())
    }
    fn not_found(key: &str) -> StoreError {
        StoreError::SnapshotNotFound(key.into())
    }
    fn conflict(key: &str) -> StoreError {
        StoreError::SnapshotConflict(key.into())
    }
}

type RevisionedTable = TableDefinition<'static, &'static str, (u64, &'static [u8])>;

fn decode_revisioned<T: Revisioned>(revision: u64, bytes: &[u8]) -> StoreResult<T> {
    let mut v: T = serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    v.set_revision(revision.to_string());
    Ok(v)
}

impl RedbStore {
    /// Creates (`value`'s revision empty) or replaces (revision = the
    /// stored one) one entry of a revisioned table.
    fn put_revisioned<T: Revisioned>(&self, table: RevisionedTable, value: &T) -> StoreResult<T> {
        let key = value.table_key();
        let tx = self.db.begin_write().map_err(backend)?;
        let revision = {
            let mut t = tx.open_table(table).map_err(backend)?;
            let stored = t.get(key).map_err(backend)?.map(|v| v.value().0);
            let revision = match (stored, value.revision()) {
                (None, "") => 1,
                (Some(_), "") => return Err(T::exists(key)),
                (None, _) => return Err(T::not_found(key)),
                (Some(old), want) if old == parse_revision(want)? => old + 1,
                (Some(_), _) => return Err(T::conflict(key)),
            };
            t.insert(key, (revision, encode(value)?.as_slice()))
                .map_err(backend)?;
            revision
        };
        tx.commit().map_err(backend)?;
        let mut out = value.clone();
        out.set_revision(revision.to_string());
        Ok(out)
    }

    fn list_revisioned<T: Revisioned>(&self, table: RevisionedTable) -> StoreResult<Vec<T>> {
        let tx = self.db.begin_read().map_err(backend)?;
        let t = tx.open_table(table).map_err(backend)?;
        let mut out = Vec::new();
        for item in t.iter().map_err(backend)? {
            let (_, v) = item.map_err(backend)?;
            let (revision, bytes) = v.value();
            out.push(decode_revisioned(revision, bytes)?);
        }
        Ok(out)
    }

    fn delete_revisioned<T: Revisioned>(
        &self,
        table: RevisionedTable,
        key: &str,
    ) -> StoreResult<Option<T>> {
        let tx = self.db.begin_write().map_err(backend)?;
        let removed = {
            let mut t = tx.open_table(table).map_err(backend)?;
            let removed = t.remove(key).map_err(backend)?;
            match removed {
                Some(v) => {
                    let (revision, bytes) = v.value();
                    Some(decode_revisioned(revision, bytes)?)
                }
                None => None,
            }
        };
        tx.commit().map_err(backend)?;
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Phase;
    use crate::store::tests_support::record;

    #[test]
    fn crud_idempotency_and_restart() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RedbStore::open(dir.path()).unwrap();
            let r = s.create(&record("default", "a", "req-a")).unwrap();
            assert_eq!(r.revision, "1");
            // Same request id under another name: the holder comes back.
            match s.create(&record("default", "other", "req-a")) {
                Err(StoreError::AlreadyExists(h)) => assert_eq!(h.name, "a"),
                other => panic!("{other:?}"),
            }
            // Same name, other request id: conflict on the name.
            match s.create(&record("default", "a", "req-b")) {
                Err(StoreError::AlreadyExists(h)) => assert_eq!(h.request_id, "req-a"),
                other => panic!("{other:?}"),
            }
            assert_eq!(s.get_by_request_id("req-a").unwrap().unwrap().name, "a");
            let mut upd = r.clone();
            upd.phase = Phase::Running;
            let upd = s.replace(&upd).unwrap();
            assert_eq!(upd.revision, "2");
            // A stale writer loses.
            assert!(matches!(s.replace(&r), Err(StoreError::Conflict(..))));
            s.create(&record("default", "b", "")).unwrap();
            s.create(&record("team", "c", "req-c")).unwrap();
            s.put_agent(&AgentRecord {
                agent_id: "agent-1".into(),
                namespace: "default".into(),
                pool: "default".into(),
                api_endpoint: "127.0.0.1:1".into(),
                proxy_endpoint: "127.0.0.1:2".into(),
                capacity: 4,
                node_name: "n".into(),
                pod: None,
            })
            .unwrap();
        }
        // Reopen: everything is still there.
        let s = RedbStore::open(dir.path()).unwrap();
        let at = |ns: &str, name: &str| SandboxKey::new(ns, name);
        let a = s.get(&at("default", "a")).unwrap().unwrap();
        assert_eq!((a.phase, a.revision.as_str()), (Phase::Running, "2"));
        let names = |v: Vec<SandboxRecord>| v.into_iter().map(|r| r.name).collect::<Vec<_>>();
        let default = ListRange::namespace("default");
        assert_eq!(names(s.list(&default).unwrap()), ["a", "b"]);
        assert_eq!(names(s.list(&default.after(Some("a"))).unwrap()), ["b"]);
        assert_eq!(names(s.list(&default.limit(1)).unwrap()), ["a"]);
        assert_eq!(names(s.list(&ListRange::namespace("team")).unwrap()), ["c"]);
        assert_eq!(s.list(&ListRange::all()).unwrap().len(), 3);
        assert_eq!(s.list_agents().unwrap().len(), 1);
        // Delete frees the name and the request id.
        assert_eq!(s.delete(&at("default", "a")).unwrap().unwrap().name, "a");
        assert!(s.delete(&at("default", "a")).unwrap().is_none());
        assert!(s.get_by_request_id("req-a").unwrap().is_none());
        s.create(&record("default", "a", "req-a")).unwrap();
    }
}
