//! `SandboxPool` in `sandbolt.io/v1alpha1`: the project's own pool resource.
//! A pool is a set of agents (selected by node labels) that share an OCI
//! runtime, a per-agent sandbox limit and a list of images kept warm on
//! every agent; `spec.poolRef` of a Sandbox names one.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the SandboxPool resource.
pub const GROUP: &str = "sandbolt.io";
/// API version of the SandboxPool resource.
pub const VERSION: &str = "v1alpha1";

/// Which agents form the pool and how they run sandboxes.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "sandbolt.io",
    version = "v1alpha1",
    kind = "SandboxPool",
    plural = "sandboxpools",
    singular = "sandboxpool",
    shortname = "sbpool",
    namespaced,
    status = "SandboxPoolStatus",
    derive = "PartialEq",
    category = "sandbolt",
    printcolumn = r#"{"name":"Runtime","type":"string","jsonPath":".spec.runtime"}"#,
    printcolumn = r#"{"name":"Agents","type":"integer","jsonPath":".status.readyAgents"}"#,
    printcolumn = r#"{"name":"Sandboxes","type":"integer","jsonPath":".status.sandboxes"}"#,
    printcolumn = r#"{"name":"Capacity","type":"integer","jsonPath":".status.capacity"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxPoolSpec {
    /// Node labels an agent's node must carry to serve this pool (empty:
    /// every node running an agent of this pool).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Most sandboxes one agent of the pool holds at once.
    #[schemars(range(min = 1))]
    pub max_sandboxes_per_agent: u32,
    /// OCI runtime the pool's sandboxes run under.
    #[serde(default)]
    pub runtime: OciRuntime,
    /// Images every agent of the pool keeps pulled (normalized references
    /// or digests are both fine).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub warm_images: Vec<String>,
    /// Bounds on the pool's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityBounds>,
    /// Per-sandbox resource policy: defaults for what a request leaves
    /// unset, maxima above which a request is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<PoolLimits>,
}

/// A pool's per-sandbox resource policy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defaults: Option<LimitValues>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<LimitValues>,
}

/// CPU and memory as Kubernetes quantities (`2`, `"500m"`, `"1Gi"`: int or
/// string, as in a pod's resources), pids as a count.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LimitValues {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<IntOrString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<IntOrString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub pids: Option<i64>,
}

/// OCI runtime of a pool.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OciRuntime {
    #[default]
    Runc,
    Crun,
    Runsc,
}

impl OciRuntime {
    /// The runtime's binary name, as given to containerd.
    pub fn as_str(self) -> &'static str {
        match self {
            OciRuntime::Runc => "runc",
            OciRuntime::Crun => "crun",
            OciRuntime::Runsc => "runsc",
        }
    }
}

/// Bounds on a pool's size.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapacityBounds {
    /// The pool is not Ready with fewer ready agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_agents: Option<u32>,
    /// Creates beyond this many live sandboxes in the pool are refused
    /// (ResourceExhausted), whatever the agents could hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u32>,
}

/// Counts the controller observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxPoolStatus {
    /// Agents registered for the pool.
    #[serde(default)]
    pub agents: u32,
    /// Agents whose heartbeats are current.
    #[serde(default)]
    pub ready_agents: u32,
    /// Live sandboxes in the pool.
    #[serde(default)]
    pub sandboxes: u32,
    /// Sandboxes the ready agents can hold in all (bounded by
    /// `capacity.maxSandboxes`).
    #[serde(default)]
    pub capacity: u32,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl SandboxPoolSpec {
    /// Sandboxes `ready_agents` agents can hold, within the pool's bound.
    pub fn capacity_for(&self, ready_agents: u32) -> u32 {
        let raw = ready_agents.saturating_mul(self.max_sandboxes_per_agent);
        match self.capacity.as_ref().and_then(|c| c.max_sandboxes) {
            Some(max) => raw.min(max),
            None => raw,
        }
    }
}
