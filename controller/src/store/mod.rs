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

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sandbox {0}/{1} not found")]
    NotFound(String, String),
    /// The name (or the request id) is taken; carries the record holding it.
    #[error("sandbox {}/{} already exists", .0.namespace, .0.name)]
    AlreadyExists(Box<SandboxRecord>),
    /// Someone else wrote the record since it was read.
    #[error("sandbox {0}/{1} was modified concurrently")]
    Conflict(String, String),
    #[error("store backend: {0}")]
    Backend(String),
    /// The backend refused the record as malformed (e.g. a name Kubernetes
    /// does not accept).
    #[error("invalid sandbox: {0}")]
    Invalid(String),
    #[error("store record is corrupt: {0}")]
    Corrupt(String),
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

/// How many events a record keeps (oldest dropped first).
pub const MAX_EVENTS: usize = 64;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    /// Container id on the agent; changes when the sandbox is recreated.
    pub sandbox_id: String,
    pub agent_id: String,
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
    pub reset_revision: String,
    /// Bumped by every change of the desired state (spec, metadata, expiry).
    pub generation: i64,
    pub phase: Phase,
    pub message: String,
    /// Idempotency key of the create; empty when the client sent none.
    pub request_id: String,
    /// Per-sandbox secret for execd and the agent's proxy.
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
    /// Limits and requests after the pool's defaults (records written
    /// before limits existed read back as unlimited).
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub volumes: Vec<HostVolume>,
    /// OCI runtime; empty = the agent's default (records from before).
    #[serde(default)]
    pub runtime: String,
    /// When `phase` last changed (unix ms).
    #[serde(default)]
    pub last_transition_unix_ms: i64,
}

impl SandboxRecord {
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

    /// Whether the record holds a slot on its agent.
    pub fn holds_slot(&self) -> bool {
        !self.agent_id.is_empty()
            && matches!(self.phase, Phase::Pending | Phase::Running | Phase::Paused)
    }
}

/// An agent the controller has seen, so a restarted controller knows whom to
/// wait for and where to reach them before they heartbeat again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub agent_id: String,
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

pub trait Store: Send + Sync + 'static {
    /// Inserts a new record. Fails with `AlreadyExists` (carrying the holder)
    /// when the name or the non-empty request id is taken.
    fn create(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord>;
    fn get(&self, namespace: &str, name: &str) -> StoreResult<Option<SandboxRecord>>;
    fn get_by_request_id(&self, request_id: &str) -> StoreResult<Option<SandboxRecord>>;
    /// Replaces a record if its stored revision still equals `record.revision`
    /// (else `Conflict`); returns it with the new revision.
    fn replace(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord>;
    /// Deletes a record (and its request id); `None` if it did not exist.
    fn delete(&self, namespace: &str, name: &str) -> StoreResult<Option<SandboxRecord>>;
    /// Records of one namespace (all when `None`), in name order, starting
    /// after `after`, at most `limit` (0 = all).
    fn list(
        &self,
        namespace: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> StoreResult<Vec<SandboxRecord>>;

    fn put_agent(&self, agent: &AgentRecord) -> StoreResult<()>;
    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>>;

    /// Records someone outside the controller asked to delete (a Kubernetes
    /// `kubectl delete` leaves the object terminating behind its finalizer
    /// until the controller removed the container and calls `delete`).
    fn deletions_requested(&self) -> Vec<(String, String)> {
        Vec::new()
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
            sandbox_id: format!("sb-{name}"),
            agent_id: "agent-1".into(),
            pool: "default".into(),
            image: "busybox".into(),
            command: vec!["sleep".into()],
            args: vec!["1000".into()],
            envs: [("A".to_string(), "1".to_string())].into(),
            working_dir: "/".into(),
            exposed_ports: vec![],
            metadata: [("team".to_string(), "x".to_string())].into(),
            expires_at: 0,
            failure_policy: FailurePolicy::Manual,
            recovery_timeout_seconds: 0,
            reset_revision: String::new(),
            generation: 1,
            phase: Phase::Pending,
            message: String::new(),
            request_id: rid.into(),
            access_token: "tok".into(),
            consistency: Consistency::Strong,
            created_at_unix_ms: 1,
            assignment_attempt: 1,
            recovery_deadline_unix_ms: 0,
            events: vec![],
            revision: String::new(),
            ..Default::default()
        }
    }
}
