//! `SandboxWarmPool` in `sandbolt.io/v1alpha1`: a buffer of started, idle
//! sandboxes of one image, kept on the agents of an agent pool
//! ([`crate::SandboxPool`]), so that a create is a claim of a running
//! sandbox rather than a container start.
//!
//! The controller stores its warm pools as these objects in its own
//! namespace (one object per pool; the name is the pool's, a DNS-1123 label
//! unique in the cluster), so `kubectl apply` of one is the same as a
//! `WarmPoolService.CreateWarmPool`. The leader writes `status`.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::pool::{LimitValues, OciRuntime};

/// What the agents keep warm, and how many.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "sandbolt.io",
    version = "v1alpha1",
    kind = "SandboxWarmPool",
    plural = "sandboxwarmpools",
    singular = "sandboxwarmpool",
    shortname = "sbwarm",
    namespaced,
    status = "SandboxWarmPoolStatus",
    derive = "PartialEq",
    category = "sandbolt",
    printcolumn = r#"{"name":"AgentPool","type":"string","jsonPath":".spec.agentPool"}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.template.image"}"#,
    printcolumn = r#"{"name":"Available","type":"integer","jsonPath":".status.available"}"#,
    printcolumn = r#"{"name":"Allocated","type":"integer","jsonPath":".status.allocated"}"#,
    printcolumn = r#"{"name":"Total","type":"integer","jsonPath":".status.total"}"#,
    printcolumn = r#"{"name":"PoolMax","type":"integer","jsonPath":".spec.capacity.poolMax","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxWarmPoolSpec {
    /// The agent pool (a SandboxPool's name, the agents' `--pool`) whose
    /// agents keep the buffer; unset: "default".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_pool: Option<String>,
    /// What every warm sandbox is before it is claimed. Fixed once created
    /// (the controller's API refuses changes; delete and recreate instead).
    pub template: WarmPoolTemplate,
    /// Buffer and pool size bounds (OpenSandbox's capacitySpec).
    pub capacity: WarmPoolCapacity,
}

/// A warm sandbox's image, runtime, limits and base environment.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmPoolTemplate {
    /// Image reference (normalized by the controller).
    #[schemars(length(min = 1))]
    pub image: String,
    /// OCI runtime; unset: the agent pool's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<OciRuntime>,
    /// Limits of the idle warm sandboxes and the defaults of a claim whose
    /// request sets none (within the agent pool's maxima).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitValues>,
    /// Environment every claim starts with; the request's variables win.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// The pool's available (warm) sandboxes are kept within
/// `bufferMin..=bufferMax`, its total (available + allocated) within
/// `poolMin..=poolMax`; creates beyond `poolMax` are refused.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.bufferMin <= self.bufferMax", "message": "bufferMin must not exceed bufferMax", "fieldPath": ".bufferMin"},
    {"rule": "self.poolMin <= self.poolMax", "message": "poolMin must not exceed poolMax", "fieldPath": ".poolMin"},
    {"rule": "self.bufferMax <= self.poolMax", "message": "bufferMax must not exceed poolMax", "fieldPath": ".bufferMax"},
]))]
pub struct WarmPoolCapacity {
    #[schemars(range(min = 0))]
    pub buffer_min: i32,
    #[schemars(range(min = 0))]
    pub buffer_max: i32,
    #[schemars(range(min = 0))]
    pub pool_min: i32,
    #[schemars(range(min = 0))]
    pub pool_max: i32,
}

/// Counts the leader observed (control.proto `WarmPoolStatus`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxWarmPoolStatus {
    /// available + allocated.
    #[serde(default)]
    pub total: i32,
    /// Live sandboxes of the pool (claimed, or created cold within it).
    #[serde(default)]
    pub allocated: i32,
    /// Warm sandboxes ready to claim.
    #[serde(default)]
    pub available: i32,
    /// Warm sandboxes being started.
    #[serde(default)]
    pub starting: i32,
    /// Live agents of the agent pool that hold (or should hold) the buffer.
    #[serde(default)]
    pub agents: i32,
    /// The `metadata.generation` this status describes; unset while the
    /// controller does not know the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl SandboxWarmPoolSpec {
    /// The agent pool, "default" when unset or empty.
    pub fn agent_pool(&self) -> &str {
        match self.agent_pool.as_deref() {
            None | Some("") => "default",
            Some(p) => p,
        }
    }
}
