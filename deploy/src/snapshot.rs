//! `SandboxSnapshot` in `sandbolt.io/v1alpha1`: a sandbox's filesystem
//! (its writable layer and the snapshots of its read-write named volumes)
//! committed on the sandbox's node, from which new sandboxes are restored.
//!
//! The controller stores its snapshot records as these objects in its own
//! namespace: one object per snapshot, named after its id (a UUID, so
//! unique in the cluster), the whole record in `spec`. There is no status
//! subresource: the controller writes the record (phase included) in one
//! request, so a phase change is atomic with the fields it sets. Only the
//! controller creates them (a capture runs on an agent); `kubectl get sbsnap`
//! shows them, and `kubectl delete` of one forgets the record (the janitor
//! then removes what the node still holds).

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One snapshot record (control.proto `Snapshot` without `in_use_by`,
/// which follows from the sandboxes restored from it).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "sandbolt.io",
    version = "v1alpha1",
    kind = "SandboxSnapshot",
    plural = "sandboxsnapshots",
    singular = "sandboxsnapshot",
    shortname = "sbsnap",
    namespaced,
    derive = "PartialEq",
    category = "sandbolt",
    printcolumn = r#"{"name":"SandboxNamespace","type":"string","jsonPath":".spec.sandboxNamespace","priority":1}"#,
    printcolumn = r#"{"name":"Source","type":"string","jsonPath":".spec.sourceSandbox"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".spec.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.nodeName"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".spec.sizeBytes"}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.image","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSnapshotSpec {
    /// Namespace of the source sandbox; restores are made in it (the
    /// object itself lives in the controller's namespace).
    #[schemars(length(min = 1))]
    pub sandbox_namespace: String,
    /// The record's uid (a UUID the controller made): tells this snapshot
    /// from an earlier one of the same id.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 253))]
    pub display_name: String,
    /// Idempotency key of the create; unset when the client sent none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
    /// The source sandbox: its name (in `sandboxNamespace`), record uid
    /// and container id.
    #[schemars(length(min = 1))]
    pub source_sandbox: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_uid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_sandbox_id: String,
    #[serde(default)]
    pub phase: SnapshotPhase,
    /// Why it failed, or what it waits for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The agent (and its node) holding the snapshot: restores run there.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node_name: String,
    /// The source's image (normalized): a restore runs the same one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub image: String,
    /// The source's OCI runtime.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub runtime: String,
    /// Bytes of the committed writable layer.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(min = 0))]
    pub size_bytes: i64,
    /// How long the source was frozen for the capture (0: it was paused
    /// already), and how long the whole capture took, in microseconds.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(min = 0))]
    pub paused_us: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(min = 0))]
    pub took_us: i64,
    /// The source's named volumes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<SnapshotVolume>,
    /// User metadata of the snapshot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Milliseconds since the Unix epoch (`metadata.creationTimestamp` has
    /// whole seconds; lists are ordered by these).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub created_at_unix_ms: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub completed_at_unix_ms: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub last_transition_unix_ms: i64,
}

/// Where a snapshot is in its life (control.proto `SnapshotPhase`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SnapshotPhase {
    /// The capture runs on the source's node.
    #[default]
    Pending,
    Ready,
    Failed,
    /// Deletion was asked while sandboxes restored from it live.
    Deleting,
}

/// A named volume the source mounted.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotVolume {
    #[schemars(length(min = 1))]
    pub volume: String,
    pub mount_path: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sub_path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// The volume snapshot taken with it; unset for a read-only mount.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub volume_snapshot: String,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}
