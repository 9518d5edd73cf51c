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

/// The warm pool a warm sandbox serves (see the agent's `warm_pool`):
/// present only while the container is warm (started, unclaimed, no
/// record); a claim rewrites the labels without it. A restarted agent
/// removes every container carrying it, and the janitor keeps one only
/// while the agent instance that made it ([`AGENT_INSTANCE`]) heartbeats.
pub const WARM_POOL: &str = "io.sandbolt.warm-pool";
/// Instance id (one per agent process) of the agent that started a warm
/// sandbox; only on warm containers.
pub const AGENT_INSTANCE: &str = "io.sandbolt.agent-instance";

/// On a prepared writable snapshot (the agent's `prepared` module: a
/// `snapshots.Prepare` done ahead of cold creates): the id of the agent
/// that made it. Such a snapshot also carries [`AGENT_INSTANCE`]; while no
/// container references it, the janitor keeps it only while that agent
/// process heartbeats, and a restarted agent removes it itself.
pub const PREPARED: &str = "io.sandbolt.prepared";
/// Key prefix of prepared snapshots (`sandbolt-prepared-<uuid>`). A cold
/// create that takes one creates its container with it as `snapshot_key`:
/// the snapshot key is then not the sandbox id.
pub const PREPARED_KEY_PREFIX: &str = "sandbolt-prepared-";

/// Name prefix of committed sandbox snapshots
/// (`sandbolt-snapshot-<snapshot id>`, the agent's `snapshot` module): the
/// captured writable layer of a sandbox, parent of the writable layers of
/// the sandboxes restored from it. Such a snapshot also carries
/// [`SNAPSHOT`], [`AGENT_ID`], [`IMAGE`] and `containerd.io/gc.root`; the
/// janitor removes one whose id no controller record knows.
pub const SNAPSHOT_NAME_PREFIX: &str = "sandbolt-snapshot-";
/// Key prefix of the active snapshot a capture fills before committing it
/// (`sandbolt-snapshotting-<snapshot id>`). Never outlives its capture: a
/// restarted agent removes its own, the janitor one whose agent process
/// ([`AGENT_INSTANCE`]) is gone.
pub const SNAPSHOTTING_KEY_PREFIX: &str = "sandbolt-snapshotting-";
/// On a committed sandbox snapshot (and its in-progress key): the snapshot
/// id.
pub const SNAPSHOT: &str = "io.sandbolt.snapshot";
/// On a container whose processes a capture froze (the snapshot id): a
/// restarted agent thaws a container carrying it (the capture died with the
/// previous agent process) unless it is paused on purpose.
pub const FROZEN_FOR_SNAPSHOT: &str = "io.sandbolt.frozen-for-snapshot";
/// On a committed sandbox snapshot: the named volumes its sandbox mounted
/// and the volume snapshot taken of each (JSON list of `{volume, subPath,
/// mountPath, readOnly, volumeSnapshot}`; `volumeSnapshot` is absent for a
/// read-only mount). Deleting the snapshot deletes those volume snapshots.
pub const SNAPSHOT_VOLUMES: &str = "io.sandbolt.snapshot-volumes";
/// On a committed sandbox snapshot: how long the capture froze the
/// sandbox's processes, in microseconds (0: it was paused already).
pub const SNAPSHOT_PAUSED_US: &str = "io.sandbolt.snapshot-paused-us";
/// On a committed sandbox snapshot: how long the capture took up to its
/// commit, in microseconds.
pub const SNAPSHOT_TOOK_US: &str = "io.sandbolt.snapshot-took-us";
/// containerd's garbage collector keeps a snapshot carrying this label
/// (any value; sandbolt writes the time it was set, in Unix milliseconds).
pub const GC_ROOT: &str = "containerd.io/gc.root";
