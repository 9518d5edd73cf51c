//! The durable record of every sandbox, behind a `Store` trait.
//!
//! The trait is the seam between the controller and where records live:
//! [`embedded::RedbStore`] (one file, no server) now, Kubernetes custom
//! resources later. It is shaped after what both can do cheaply: get/create/
//! replace by key with optimistic concurrency (`revision` is opaque, like
//! Kubernetes' `resourceVersion`), an index by request id for idempotency, and
//! listing by namespace in name order for pagination.
//!
//! The trait is synchronous on purpose. Both backends answer reads from
//! memory (redb's page cache, the Kubernetes store's watch-fed cache), and
//! the controller reads inside placement and ownership paths that must not
//! yield. A write blocks its caller like the fsync it is: redb's commit, or
//! one API round trip that [`kube::KubeStore`] runs on its own I/O runtime.

pub mod embedded;
pub mod kube;
pub(crate) mod timed;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{AgentId, SandboxId, SandboxKey};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sandbox {0} not found")]
    NotFound(SandboxKey),
    /// The name (or the request id) is taken; carries the record holding it.
    #[error("sandbox {}/{} already exists", .0.namespace, .0.name)]
    AlreadyExists(Box<SandboxRecord>),
    /// Someone else wrote the record since it was read.
    #[error("sandbox {0} was modified concurrently")]
    Conflict(SandboxKey),
    #[error("store backend: {0}")]
    Backend(String),
    /// The backend refused the record as malformed (e.g. a name Kubernetes
    /// does not accept).
    #[error("invalid sandbox: {0}")]
    Invalid(String),
    #[error("store record is corrupt: {0}")]
    Corrupt(String),
    /// A warm pool of that name exists already.
    #[error("warm pool {0} already exists")]
    WarmPoolExists(String),
    /// No warm pool of that name.
    #[error("warm pool {0} not found")]
    WarmPoolNotFound(String),
    /// The warm pool was modified since it was read.
    #[error("warm pool {0} was modified concurrently")]
    WarmPoolConflict(String),
    /// A sandbox snapshot with that id exists already.
    #[error("snapshot {0} already exists")]
    SnapshotExists(String),
    /// No sandbox snapshot with that id.
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    /// The snapshot record was modified since it was read.
    #[error("snapshot {0} was modified concurrently")]
    SnapshotConflict(String),
    /// Injected by tests (a store that refuses writes), never by a backend.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Consistency {
    /// Agent creates first, record committed afterwards (with retries).
    Fast,
    /// Record committed before the agent creates anything.
    #[default]
    Strong,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum FailurePolicy {
    #[default]
    Manual,
    AutoRecreate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Phase {
    #[default]
    /// Record committed, container not confirmed yet (strong mode).
    Pending,
    Running,
    Paused,
    /// Its agent was lost; being recreated elsewhere (AUTO_RECREATE).
    Recovering,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub at_unix_nanos: i64,
    /// `info`, `warning`, `error`.
    pub level: String,
    /// `controller`, `agent`, `janitor`, `registry`.
    pub source: String,
    pub phase: String,
    pub message: String,
}

/// Resource limits and requests of one sandbox, as Kubernetes quantities
/// (canonical as the client sent them), after the pool's defaults. Empty or
/// 0 = unset (no cap).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Resources {
    pub cpu_limit: String,
    pub memory_limit: String,
    pub pids_limit: i64,
    pub cpu_request: String,
    pub memory_request: String,
    /// Bytes the writable layer may hold ("1Gi"); the agent measures it
    /// and stops the sandbox over it. Empty = none.
    pub ephemeral_storage_limit: String,
}

impl Resources {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A host directory bound into a sandbox (checked on the node by the agent
/// against its allowed roots: only the agent sees the node's filesystem).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostVolume {
    pub name: String,
    pub host_path: String,
    pub sub_path: String,
    pub mount_path: String,
    pub read_only: bool,
}

/// Kubernetes access mode of a named volume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AccessMode {
    /// Not given: a volume created for the sandbox is ReadWriteOnce.
    #[default]
    Unspecified,
    /// At most one read-write mount at a time.
    ReadWriteOnce,
    /// Read-only mounts only.
    ReadOnlyMany,
    /// Any number of read-write mounts.
    ReadWriteMany,
}

/// A named volume (`pvc` source) mounted into a sandbox. The volume lives
/// on one node's volume root and pins the sandbox to that node; the fields
/// after `read_only` describe the volume to create when none has the name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PvcVolume {
    /// The entry's name in the request (`volumes[].name`).
    pub name: String,
    /// The named volume.
    pub claim_name: String,
    pub sub_path: String,
    pub mount_path: String,
    pub read_only: bool,
    pub create_if_missing: bool,
    pub access_mode: AccessMode,
    /// Quota as the client wrote it ("1Gi"); empty = none.
    pub size: String,
    /// "local" or empty.
    pub backend: String,
    /// Remove the volume with the sandbox, if `created_by_sandbox`.
    pub delete_on_sandbox_delete: bool,
    /// This sandbox's create (or attach) made the volume: only then may
    /// `delete_on_sandbox_delete` remove it.
    pub created_by_sandbox: bool,
    /// Create the volume (when missing) as a fork of `<volume>@<snapshot>`
    /// instead of empty: set by a restore from a sandbox snapshot; empty
    /// otherwise.
    pub fork_from: String,
}

/// How many events a record keeps (oldest dropped first).
pub const MAX_EVENTS: usize = 64;

/// What the client asked for: the create request's spec, changed later only
/// by updates (metadata, expiry, failure policy). Limits and runtime are
/// stored after the pool's defaults were applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    pub pool: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    pub working_dir: String,
    pub exposed_ports: Vec<u32>,
    pub metadata: BTreeMap<String, String>,
    /// Unix seconds; 0 means the sandbox never expires (manual cleanup).
    pub expires_at: i64,
    pub failure_policy: FailurePolicy,
    pub recovery_timeout_seconds: i32,
    /// Limits and requests after the pool's defaults (records written
    /// before limits existed read back as unlimited).
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub volumes: Vec<HostVolume>,
    /// Named volumes (records from before named volumes have none).
    #[serde(default)]
    pub pvc_volumes: Vec<PvcVolume>,
    /// OCI runtime; empty = the agent's default (records from before).
    #[serde(default)]
    pub runtime: String,
    /// Egress policy, normalized (`sandbolt_proto::egress::NetworkPolicy::
    /// to_json`); empty = allow all egress the node's isolation allows
    /// (records from before networking read back so).
    #[serde(default)]
    pub network_policy_json: String,
    /// The warm pool the sandbox belongs to (see `crate::warm`); empty =
    /// none (records from before warm pools have none).
    #[serde(default)]
    pub warm_pool: String,
    /// The sandbox snapshot it was restored from (see `crate::snapshot`);
    /// empty = created from its image. While set, the snapshot is in use
    /// and is not removed.
    #[serde(default)]
    pub snapshot_id: String,
    /// Env values marked secret, sealed under the controller's key (see
    /// `crate::secrets`): name → sealed value. Never in `envs`, in a
    /// resource's spec or in an API answer; opened only for the agent's
    /// create call.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sealed_envs: BTreeMap<String, String>,
}

/// One sandbox as stored. The spec is flattened, so the stored JSON keeps
/// the field names records had when the spec's fields sat here directly.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    /// Container id on the agent; changes when the sandbox is recreated.
    pub sandbox_id: SandboxId,
    pub agent_id: AgentId,
    #[serde(flatten)]
    pub spec: SandboxSpec,
    pub reset_revision: String,
    /// Bumped by every change of the desired state (spec, metadata, expiry).
    pub generation: i64,
    pub phase: Phase,
    pub message: String,
    /// Idempotency key of the create; empty when the client sent none.
    pub request_id: String,
    /// Per-sandbox secret for execd and the agent's proxy, as records
    /// written before tokens were derived hold it; empty (and not written)
    /// since: `Core::access_token` derives it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub access_token: String,
    pub consistency: Consistency,
    pub created_at_unix_ms: i64,
    /// How many times a container was assigned for this record.
    pub assignment_attempt: i64,
    /// Recovering: give up (Failed) after this instant.
    pub recovery_deadline_unix_ms: i64,
    pub events: Vec<Event>,
    /// Store-managed optimistic-concurrency token, opaque to the controller
    /// (empty until the record is stored).
    pub revision: String,
    /// When `phase` last changed (unix ms).
    #[serde(default)]
    pub last_transition_unix_ms: i64,
    /// The agent has not confirmed `spec.network_policy_json` yet: an
    /// update was recorded but the agent was unreachable or did not answer.
    /// The controller re-sends it when the agent reports the sandbox again;
    /// a recreated container gets it with its create.
    #[serde(default)]
    pub network_policy_pending: bool,
    /// When the policy last changed or was confirmed by the agent (unix ms).
    #[serde(default)]
    pub network_policy_transition_unix_ms: i64,
    /// The sandbox's address on its node's sandbox network, as the agent
    /// answered its create (empty without networking).
    #[serde(default)]
    pub ip_address: String,
    /// The create was served by claiming a warm sandbox (false for cold
    /// creates and for records from before warm pools).
    #[serde(default)]
    pub claimed_warm: bool,
    /// The uid the API server gave the object holding the record (the
    /// Kubernetes store's `metadata.uid`); empty in stores without one.
    /// Read from the object, never written: `uid` stays the identity agents
    /// and the janitor know the sandbox by.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api_uid: String,
    /// The object's `metadata.generation` (moves with spec changes only, as
    /// Kubernetes counts them); 0 in stores without one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub api_generation: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl SandboxRecord {
    pub fn key(&self) -> SandboxKey {
        SandboxKey {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    /// Sets the phase, stamping the transition time when it changes.
    pub fn set_phase(&mut self, phase: Phase) {
        if self.phase != phase {
            self.phase = phase;
            self.last_transition_unix_ms = crate::clock::now_unix_ms();
        }
    }

    pub fn push_event(&mut self, level: &str, source: &str, message: impl Into<String>) {
        let message = message.into();
        tracing::debug!(sandbox = %self.name, namespace = %self.namespace, %level, %source, %message, "event");
        self.events.push(Event {
            at_unix_nanos: crate::clock::now_unix_nanos(),
            level: level.into(),
            source: source.into(),
            phase: format!("{:?}", self.phase),
            message,
        });
        if self.events.len() > MAX_EVENTS {
            let drop = self.events.len() - MAX_EVENTS;
            self.events.drain(..drop);
        }
    }

    /// The uid clients outside the controller know the sandbox by: the API
    /// object's when the store has one (the OpenSandbox server reads it
    /// from the Sandbox resource), else the record's.
    pub fn object_uid(&self) -> &str {
        if self.api_uid.is_empty() {
            &self.uid
        } else {
            &self.api_uid
        }
    }

    /// The generation that goes with [`Self::object_uid`]: the API object's
    /// when the store has one, else the record's.
    pub fn object_generation(&self) -> i64 {
        if self.api_generation == 0 {
            self.generation
        } else {
            self.api_generation
        }
    }

    /// How far the egress policy got to the agent; `None` without one
    /// (allow-all). Every API reports it as the egress action binding.
    pub fn policy_delivery(&self) -> Option<PolicyDelivery> {
        if self.spec.network_policy_json.is_empty() {
            return None;
        }
        let message = if self.network_policy_pending {
            format!(
                "recorded; agent {} has not confirmed it yet (re-sent when it reports the sandbox)",
                self.agent_id
            )
        } else {
            String::new()
        };
        Some(PolicyDelivery {
            pending: self.network_policy_pending,
            message,
            since_unix_ms: match self.network_policy_transition_unix_ms {
                0 => self.created_at_unix_ms,
                t => t,
            },
        })
    }

    /// Whether the record holds a slot on its agent.
    pub fn holds_slot(&self) -> bool {
        !self.agent_id.is_empty()
            && matches!(self.phase, Phase::Pending | Phase::Running | Phase::Paused)
    }
}

/// See [`SandboxRecord::policy_delivery`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyDelivery {
    /// Recorded, not confirmed by the agent yet.
    pub pending: bool,
    /// Why it is pending; empty once confirmed.
    pub message: String,
    /// When the policy last changed or was confirmed (unix ms).
    pub since_unix_ms: i64,
}

/// A container its agent reports as exited, which the record (still
/// Running or Paused) does not say: the failure policies act on lost
/// containers, not on entrypoints that ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerExit {
    /// Exited with an error (else: it stopped cleanly).
    pub failed: bool,
    pub message: String,
}

/// What the controller observes of a record's container beyond the record:
/// `None` while the record's phase tells the whole story.
pub type ExitObserver =
    std::sync::Arc<dyn Fn(&SandboxRecord) -> Option<ContainerExit> + Send + Sync>;

/// An agent the controller has seen, so a restarted controller knows whom to
/// wait for and where to reach them before they heartbeat again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub agent_id: AgentId,
    pub namespace: String,
    pub pool: String,
    pub api_endpoint: String,
    pub proxy_endpoint: String,
    pub capacity: u32,
    pub node_name: String,
    /// The agent's pod (Kubernetes), so that a controller restarted while
    /// the agent is silent can still tell a gone pod from a slow one.
    #[serde(default)]
    pub pod: Option<AgentPod>,
}

/// Identity of the pod an agent runs in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A warm pool as stored (control.proto `WarmPool`, without its status,
/// which the controller computes from the agents' reports).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WarmPoolRecord {
    pub name: String,
    /// The agent pool whose agents keep the buffer ("default" when unset).
    pub agent_pool: String,
    /// Normalized image reference.
    pub image: String,
    /// OCI runtime; empty = the agent pool's.
    pub runtime: String,
    /// Limits of the idle warm sandboxes and the defaults of a claim
    /// (only the `*_limit` fields are used).
    pub limits: Resources,
    /// Environment every claim starts with (the request's wins).
    pub env: BTreeMap<String, String>,
    pub buffer_min: i32,
    pub buffer_max: i32,
    pub pool_min: i32,
    pub pool_max: i32,
    pub created_at_unix_ms: i64,
    /// Bumped by every change of the spec (capacity).
    pub generation: i64,
    /// Opaque, set by the store; empty in a pool that is to be created.
    #[serde(skip)]
    pub revision: String,
}

/// Phase of a sandbox snapshot (control.proto `SnapshotPhase`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotPhase {
    /// Recorded; the capture runs on the source's node.
    #[default]
    Pending,
    Ready,
    /// The capture failed; nothing of it is left on the node (or the
    /// janitor removes what is).
    Failed,
    /// Deletion asked while sandboxes restored from it live.
    Deleting,
}

/// A named volume of a snapshot's source (control.proto `SnapshotVolume`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnapshotVolumeRecord {
    pub volume: String,
    pub mount_path: String,
    pub sub_path: String,
    pub read_only: bool,
    /// Empty for a read-only mount.
    pub volume_snapshot: String,
}

/// A sandbox snapshot as stored (control.proto `Snapshot` without
/// `in_use_by`, which is computed from the sandbox records).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnapshotRecord {
    /// Cluster-unique; DNS-1123 label.
    pub id: String,
    pub namespace: String,
    pub uid: String,
    pub display_name: String,
    /// Idempotency key of the create; empty when the client sent none.
    pub request_id: String,
    /// The source sandbox: name (in `namespace`), record uid, container id.
    pub source_sandbox: String,
    pub source_uid: String,
    pub source_sandbox_id: String,
    pub phase: SnapshotPhase,
    pub message: String,
    pub agent_id: String,
    pub node_name: String,
    pub image: String,
    pub runtime: String,
    pub size_bytes: i64,
    pub paused_us: i64,
    pub took_us: i64,
    pub volumes: Vec<SnapshotVolumeRecord>,
    pub metadata: BTreeMap<String, String>,
    pub created_at_unix_ms: i64,
    pub completed_at_unix_ms: i64,
    pub last_transition_unix_ms: i64,
    /// Opaque, set by the store; empty in a snapshot that is to be created.
    #[serde(skip)]
    pub revision: String,
}

/// Which records [`Store::list`] returns: those of one namespace (all when
/// `namespace` is `None`), in name order, after the name `after` (within a
/// namespace only), at most `limit` (0 = all).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListRange<'a> {
    pub namespace: Option<&'a str>,
    pub after: Option<&'a str>,
    pub limit: usize,
}

impl<'a> ListRange<'a> {
    /// Every record of every namespace.
    pub fn all() -> Self {
        Self::default()
    }

    /// Every record of `namespace`.
    pub fn namespace(namespace: &'a str) -> Self {
        Self {
            namespace: Some(namespace),
            ..Self::default()
        }
    }

    /// Starting after the name `name` (the last one of the previous page).
    pub fn after(self, name: Option<&'a str>) -> Self {
        Self {
            after: name,
            ..self
        }
    }

    /// At most `limit` records (0 = all).
    pub fn limit(self, limit: usize) -> Self {
        Self { limit, ..self }
    }

    /// Whether the record at `key` lies in the range (ignoring `limit`).
    pub fn contains(&self, key: &SandboxKey) -> bool {
        match self.namespace {
            None => true,
            Some(ns) => ns == key.namespace && self.after.is_none_or(|a| key.name.as_str() > a),
        }
    }

    /// The first `limit` records of `records` (already in order and in the
    /// range); the first error ends the list.
    pub fn take(
        &self,
        records: impl IntoIterator<Item = StoreResult<SandboxRecord>>,
    ) -> StoreResult<Vec<SandboxRecord>> {
        let limit = if self.limit == 0 {
            usize::MAX
        } else {
            self.limit
        };
        records.into_iter().take(limit).collect()
    }
}

/// Whether `r`'s metadata hold every pair of `filter`.
pub fn metadata_matches(r: &SandboxRecord, filter: &BTreeMap<String, String>) -> bool {
    filter
        .iter()
        .all(|(k, v)| r.spec.metadata.get(k) == Some(v))
}

pub trait Store: Send + Sync + 'static {
    /// Inserts a new record. Fails with `AlreadyExists` (carrying the holder)
    /// when the name or the non-empty request id is taken.
    fn create(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord>;
    fn get(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>>;
    fn get_by_request_id(&self, request_id: &str) -> StoreResult<Option<SandboxRecord>>;
    /// Replaces a record if its stored revision still equals `record.revision`
    /// (else `Conflict`); returns it with the new revision.
    fn replace(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord>;
    /// Deletes a record (and its request id); `None` if it did not exist.
    fn delete(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>>;
    /// Deletes the record of a sandbox whose expiry passed (its container
    /// is gone). A store read outside the controller may leave a tombstone
    /// there for those readers (the Kubernetes store: the OpenSandbox
    /// server shows an expired sandbox as Terminated); a tombstone is no
    /// record: no read of this trait returns it. By default a delete.
    fn delete_expired(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        self.delete(key)
    }
    /// Removes the tombstone an expiry left at `key`, if that is all there
    /// is; true when one was removed (stores without tombstones: never).
    fn delete_tombstone(&self, _key: &SandboxKey) -> StoreResult<bool> {
        Ok(false)
    }
    /// The records `range` selects, in namespace and name order.
    fn list(&self, range: &ListRange<'_>) -> StoreResult<Vec<SandboxRecord>>;
    /// The record whose container is `sandbox_id` (`ReportReaped`, the
    /// janitor's nameless ownership queries, vanished containers). By
    /// default a scan; both backends answer from an index.
    fn get_by_sandbox_id(&self, sandbox_id: &str) -> StoreResult<Option<SandboxRecord>> {
        Ok(self
            .list(&ListRange::all())?
            .into_iter()
            .find(|r| r.sandbox_id == sandbox_id))
    }
    /// The key of the record whose container is `sandbox_id` as the index
    /// says, without reading the record: the heartbeat's orphan check asks
    /// it for every reported sandbox. It may lag where the index does (the
    /// Kubernetes store): "no owner" is for the caller to confirm.
    fn sandbox_owner(&self, sandbox_id: &str) -> StoreResult<Option<SandboxKey>> {
        Ok(self.get_by_sandbox_id(sandbox_id)?.map(|r| r.key()))
    }
    /// The records `range` selects whose metadata hold every pair of
    /// `filter` (all of them when it is empty), in name order, at most
    /// `range.limit`. By default a scan; both backends answer from an
    /// index of metadata pairs.
    fn list_filtered(
        &self,
        range: &ListRange<'_>,
        filter: &BTreeMap<String, String>,
    ) -> StoreResult<Vec<SandboxRecord>> {
        let all = self.list(&range.limit(0))?;
        range.take(
            all.into_iter()
                .filter(|r| metadata_matches(r, filter))
                .map(Ok),
        )
    }

    fn put_agent(&self, agent: &AgentRecord) -> StoreResult<()>;
    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>>;

    /// Creates a warm pool (`pool.revision` empty; `WarmPoolExists` when the
    /// name is taken) or replaces one (`pool.revision` = the stored one,
    /// else `WarmPoolConflict`; `WarmPoolNotFound` when gone). Returns it
    /// with its new revision.
    fn put_warm_pool(&self, pool: &WarmPoolRecord) -> StoreResult<WarmPoolRecord>;
    /// Every warm pool, in name order.
    fn list_warm_pools(&self) -> StoreResult<Vec<WarmPoolRecord>>;
    /// Removes a warm pool; `None` if it did not exist.
    fn delete_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>>;
    fn get_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        Ok(self.list_warm_pools()?.into_iter().find(|p| p.name == name))
    }

    /// Creates a snapshot record (`snapshot.revision` empty;
    /// `SnapshotExists` when the id is taken) or replaces one
    /// (`snapshot.revision` = the stored one, else `SnapshotConflict`;
    /// `SnapshotNotFound` when gone). Returns it with its new revision.
    fn put_snapshot(&self, snapshot: &SnapshotRecord) -> StoreResult<SnapshotRecord>;
    fn get_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>>;
    /// Every snapshot record, in id order.
    fn list_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>>;
    /// Removes a snapshot record; `None` if it did not exist.
    fn delete_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>>;

    /// Lets a store whose records are read outside the controller (the
    /// Kubernetes store's `status`) show exits the record does not hold:
    /// `observer` answers for a record. Stores without such readers ignore
    /// it.
    fn publish_observed_exits(&self, _observer: ExitObserver) {}

    /// The SandboxTemplates creates may name (`crate::template`); `None`:
    /// this store has none, an image is always an image.
    fn template_catalog(&self) -> Option<&crate::template::TemplateCatalog> {
        None
    }

    /// Records someone outside the controller asked to delete (a Kubernetes
    /// `kubectl delete` leaves the object terminating behind its finalizer
    /// until the controller removed the container and calls `delete`).
    fn deletions_requested(&self) -> Vec<SandboxKey> {
        Vec::new()
    }

    /// The `store` label of the controller's store write metrics.
    fn backend(&self) -> &'static str {
        "other"
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    pub(crate) fn record(ns: &str, name: &str, rid: &str) -> SandboxRecord {
        SandboxRecord {
            uid: format!("uid-{name}"),
            name: name.into(),
            namespace: ns.into(),
            sandbox_id: format!("sb-{name}").into(),
            agent_id: "agent-1".into(),
            spec: SandboxSpec {
                pool: "default".into(),
                image: "busybox".into(),
                command: vec!["sleep".into()],
                args: vec!["1000".into()],
                envs: [("A".to_string(), "1".to_string())].into(),
                working_dir: "/".into(),
                metadata: [("team".to_string(), "x".to_string())].into(),
                ..Default::default()
            },
            generation: 1,
            phase: Phase::Pending,
            request_id: rid.into(),
            access_token: "tok".into(),
            consistency: Consistency::Strong,
            created_at_unix_ms: 1,
            assignment_attempt: 1,
            ..Default::default()
        }
    }

    /// A record as the version before typed specs wrote it (flat fields,
    /// before limits, volumes and runtimes existed).
    pub(crate) const OLD_FORMAT_RECORD: &str = r#"{"uid":"u1","name":"old","namespace":"default","sandbox_id":"sb-old","agent_id":"agent-1","pool":"default","image":"busybox","command":["sleep"],"args":["1000"],"envs":{"A":"1"},"working_dir":"/","exposed_ports":[8080],"metadata":{"team":"x"},"expires_at":0,"failure_policy":"AutoRecreate","recovery_timeout_seconds":5,"reset_revision":"","generation":2,"phase":"Running","message":"","request_id":"r1","access_token":"tok","consistency":"Fast","created_at_unix_ms":1,"assignment_attempt":1,"recovery_deadline_unix_ms":0,"events":[],"revision":""}"#;

    #[test]
    fn records_written_by_the_previous_version_still_load() {
        let r: SandboxRecord = serde_json::from_str(OLD_FORMAT_RECORD).expect("old record loads");
        assert_eq!(r.sandbox_id, "sb-old");
        assert_eq!(r.agent_id, "agent-1");
        assert_eq!(r.spec.image, "busybox");
        assert_eq!(r.spec.exposed_ports, vec![8080]);
        assert_eq!(r.spec.failure_policy, FailurePolicy::AutoRecreate);
        assert!(r.spec.resources.is_empty() && r.spec.runtime.is_empty());
        assert!(
            r.spec.network_policy_json.is_empty(),
            "old records allow all"
        );
        assert!(!r.network_policy_pending && r.ip_address.is_empty());
        assert!(
            r.spec.pvc_volumes.is_empty(),
            "old records mount no named volume"
        );
        assert!(
            r.spec.warm_pool.is_empty() && !r.claimed_warm,
            "old records belong to no warm pool"
        );
        // And the same flat names are written back.
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["image"], "busybox");
        assert_eq!(v["sandbox_id"], "sb-old");
        assert!(v.get("spec").is_none());
    }

    #[test]
    fn named_volumes_round_trip_with_every_field() {
        let mut r = record("default", "v", "");
        r.spec.pvc_volumes = vec![PvcVolume {
            name: "data".into(),
            claim_name: "work".into(),
            sub_path: "a/b".into(),
            mount_path: "/data".into(),
            read_only: true,
            create_if_missing: true,
            access_mode: AccessMode::ReadWriteMany,
            size: "1Gi".into(),
            backend: "local".into(),
            delete_on_sandbox_delete: true,
            created_by_sandbox: true,
            fork_from: "src@s1".into(),
        }];
        let json = serde_json::to_string(&r).unwrap();
        let back: SandboxRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        // A volume entry missing fields (a newer writer's subset) loads.
        let v: PvcVolume = serde_json::from_str(r#"{"claim_name":"w"}"#).unwrap();
        assert_eq!(v.access_mode, AccessMode::Unspecified);
    }
}
