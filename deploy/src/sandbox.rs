//! `Sandbox` in `sandbox.fast.io/v1alpha2`, in the shape the OpenSandbox
//! server (1.1.1, `services/fast_sandbox/cr_reader.py` and `cr_mapping.py`)
//! reads:
//!
//! - `metadata.name` is the sandbox id; the server lists only names that
//!   start with [`NAME_PREFIX`].
//! - `spec.image`, `spec.command`, `spec.args`, `spec.poolRef` (read
//!   unconditionally: required here), `spec.expireTime` (RFC 3339; absent =
//!   never expires).
//! - `status.runtime.state` / `status.dataPlane.state`: the names of the
//!   FastPath v2 `RuntimeState` / `DataPlaneState` values in PascalCase (the
//!   server upper-cases them to find the enum value).
//! - `status.conditions[type=Ready]` with its own `observedGeneration`, and
//!   `status.observedGeneration`: the server calls a sandbox ready only when
//!   both are at least `metadata.generation` and both states are `Ready`.
//! - user metadata as labels prefixed [`METADATA_LABEL_PREFIX`].
//! - the egress policy as `spec.actionBindings[handler=egress].input` (the
//!   policy JSON, which the server reads back and replaces whole), and each
//!   binding's delivery in `status.actionBindings[].state`.
//! - the Ready condition's `reason` (the server's `status.reason`),
//!   `message` and `lastTransitionTime`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the Sandbox resource.
pub const GROUP: &str = "sandbox.fast.io";
/// API version of the Sandbox resource.
pub const VERSION: &str = "v1alpha2";
/// Prefix of every Sandbox name the OpenSandbox server lists.
pub const NAME_PREFIX: &str = "fsb-";
/// Prefix of the labels that carry user metadata.
pub const METADATA_LABEL_PREFIX: &str = "metadata.sandbox.fast.io/";
/// Finalizer the controller puts on every Sandbox: the object stays until
/// the controller has removed the container and everything it left behind.
pub const FINALIZER: &str = "sandbolt.io/sandbox-cleanup";
/// Type of the condition the OpenSandbox server reads.
pub const READY_CONDITION: &str = "Ready";
/// The one action handler sandbolt understands: its input is the
/// OpenSandbox `networkPolicy` JSON.
pub const EGRESS_HANDLER: &str = "egress";

/// What the user asked for.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "sandbox.fast.io",
    version = "v1alpha2",
    kind = "Sandbox",
    plural = "sandboxes",
    singular = "sandbox",
    namespaced,
    status = "SandboxStatus",
    derive = "PartialEq",
    category = "sandbolt",
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.image"}"#,
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".spec.poolRef"}"#,
    printcolumn = r#"{"name":"Runtime","type":"string","jsonPath":".status.runtime.state"}"#,
    printcolumn = r#"{"name":"DataPlane","type":"string","jsonPath":".status.dataPlane.state"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Node","type":"string","priority":1,"jsonPath":".status.nodeName"}"#,
    printcolumn = r#"{"name":"Expires","type":"date","jsonPath":".spec.expireTime"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSpec {
    /// Image reference as the user gave it.
    #[schemars(length(min = 1))]
    pub image: String,
    /// Entrypoint; empty means the image's own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Arguments to the entrypoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Name of the SandboxPool the sandbox runs in.
    #[schemars(length(min = 1))]
    pub pool_ref: String,
    /// When the sandbox expires; absent: it never does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expire_time: Option<Time>,
    /// Environment of the sandbox's entrypoint (sandbolt; the OpenSandbox
    /// server ignores it).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory of the entrypoint; absent: the image's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    /// Ports published through the agent's data-plane proxy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<u32>,
    /// What happens when the sandbox's agent is lost: `Manual` (default) or
    /// `AutoRecreate` (recreated elsewhere within `recoveryTimeoutSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_policy: Option<FailurePolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_timeout_seconds: Option<i32>,
    /// Changing it restarts the sandbox afresh (same id and token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_revision: Option<String>,
    /// Limits and requests, after the pool's defaults were applied (sandbolt;
    /// the OpenSandbox server ignores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<SandboxResources>,
    /// Host directories bound into the sandbox.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<SandboxVolume>,
    /// OCI runtime (`runc`, `crun`, `runsc`); absent: the pool's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Egress policy (OpenSandbox `networkPolicy`), as the controller
    /// normalized it; absent: all egress the node's isolation allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<SandboxNetworkPolicy>,
    /// FastPath action bindings; sandbolt understands the `egress` handler,
    /// whose `input` is the same policy as `networkPolicy` as JSON (the
    /// OpenSandbox server reads and replaces the policy here).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub action_bindings: Vec<ActionBinding>,
}

/// A FastPath action binding: a handler and its input.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActionBinding {
    #[schemars(length(min = 1))]
    pub handler: String,
    /// The handler's input (`egress`: the networkPolicy JSON).
    #[serde(default)]
    pub input: String,
}

/// OpenSandbox `networkPolicy`: rules evaluated in order, the first whose
/// target matches wins, else `defaultAction`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxNetworkPolicy {
    /// What applies when no rule matches; absent: `deny` when there are
    /// rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_action: Option<NetworkAction>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EgressRule>,
}

/// One egress rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct EgressRule {
    pub action: NetworkAction,
    /// An FQDN, `*.suffix`, or an IPv4 address or CIDR.
    #[schemars(length(min = 1))]
    pub target: String,
}

/// Allow or deny.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkAction {
    Allow,
    Deny,
}

/// Kubernetes-style resource quantities.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxResources {
    /// `cpu`, `memory` (quantities) and `pids` (a count).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
    /// `cpu`, `memory`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, String>,
}

/// A host directory bound into a sandbox.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxVolume {
    pub name: String,
    /// Absolute host path (checked by the agent against its allowed roots).
    pub host_path: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sub_path: String,
    pub mount_path: String,
    #[serde(default)]
    pub read_only: bool,
}

/// What the controller does when a sandbox's agent is lost.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum FailurePolicy {
    Manual,
    AutoRecreate,
}

/// What the controller observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_plane: Option<DataPlaneStatus>,
    /// Standard conditions; the OpenSandbox server reads `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Agent that holds the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Node the sandbox runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Delivery of each of `spec.actionBindings`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub action_bindings: Vec<ActionBindingStatus>,
}

/// How far one action binding got.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActionBindingStatus {
    pub handler: String,
    pub state: ActionState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// FastPath v2 `ActionState` (without UNSPECIFIED), as the server spells it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ActionState {
    Pending,
    Applying,
    Ready,
    Failed,
}

/// The container's state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStatus {
    pub state: RuntimeState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// The endpoint's state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataPlaneStatus {
    pub state: DataPlaneState,
    /// `host:port/<route>` clients reach the sandbox at (no scheme).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// FastPath v2 `RuntimeState` (without UNSPECIFIED), as the server spells it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RuntimeState {
    Unknown,
    Pending,
    Creating,
    Ready,
    Stopping,
    Stopped,
    Failed,
    Unavailable,
    Pausing,
    Paused,
    Resuming,
}

/// FastPath v2 `DataPlaneState` (without UNSPECIFIED), as the server spells it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum DataPlaneState {
    Unknown,
    Pending,
    Publishing,
    Ready,
    Draining,
    Failed,
    Unavailable,
}

/// User metadata as Sandbox labels (`key` -> `metadata.sandbox.fast.io/key`).
pub fn metadata_to_labels(metadata: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    metadata
        .iter()
        .map(|(k, v)| (format!("{METADATA_LABEL_PREFIX}{k}"), v.clone()))
        .collect()
}

/// User metadata back from labels; labels without the prefix are not metadata.
pub fn labels_to_metadata(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix(METADATA_LABEL_PREFIX)
                .map(|k| (k.to_string(), v.clone()))
        })
        .collect()
}

impl Sandbox {
    /// The `Ready` condition, if the controller has set one.
    pub fn ready_condition(&self) -> Option<&Condition> {
        self.status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == READY_CONDITION)
    }

    /// Ready exactly as the OpenSandbox server decides it: the Ready condition
    /// is True and both it and the status observed the current generation,
    /// and runtime and data plane are both Ready.
    pub fn is_ready(&self) -> bool {
        let generation = self.metadata.generation.unwrap_or(1);
        let Some(status) = self.status.as_ref() else {
            return false;
        };
        let Some(cond) = self.ready_condition() else {
            return false;
        };
        cond.status == "True"
            && cond.observed_generation.unwrap_or(0) >= generation
            && status.observed_generation.unwrap_or(0) >= generation
            && status.runtime.as_ref().map(|r| r.state) == Some(RuntimeState::Ready)
            && status.data_plane.as_ref().map(|d| d.state) == Some(DataPlaneState::Ready)
    }
}
