//! Container labels: the agent's only durable state. A restarted agent (and
//! the janitor) rebuild everything they need from these.

pub const MANAGED: &str = "io.sandbolt.managed";
pub const SANDBOX_ID: &str = "io.sandbolt.sandbox-id";
pub const NAME: &str = "io.sandbolt.name";
pub const NAMESPACE: &str = "io.sandbolt.namespace";
pub const AGENT_ID: &str = "io.sandbolt.agent-id";
pub const RECORD_UID: &str = "io.sandbolt.record-uid";
/// Unix milliseconds.
pub const CREATED_AT: &str = "io.sandbolt.created-at";
pub const POOL: &str = "io.sandbolt.pool";
/// Hex sha256 of the per-sandbox access token (the plaintext is only in the
/// sandbox's env, for execd).
pub const TOKEN_SHA256: &str = "io.sandbolt.access-token-sha256";
/// The image as requested, normalized.
pub const IMAGE: &str = "io.sandbolt.image";
pub const RUNTIME: &str = "io.sandbolt.runtime";
/// Comma-separated ports.
pub const EXPOSED_PORTS: &str = "io.sandbolt.exposed-ports";
/// UID of the Kubernetes pod of the agent that owns the container now (set
/// at create, rewritten by a new agent pod's recovery). The janitor reaps
/// containers whose agent pod is gone from the node by it. Absent outside
/// Kubernetes.
pub const AGENT_POD_UID: &str = "io.sandbolt.agent-pod-uid";

/// Prefix reserved for the agent's own labels; user labels may not use it.
pub const RESERVED_PREFIX: &str = "io.sandbolt.";

/// The named volumes the sandbox mounts now (JSON list of
/// `{volume, subPath, mountPath, readOnly}`): those of its create, then
/// attached ones. Rewritten on attach and detach; a restarted agent rebuilds
/// its volume mount table (and so the access-mode rules) from it.
pub const VOLUME_MOUNTS: &str = "io.sandbolt.volume-mounts";
