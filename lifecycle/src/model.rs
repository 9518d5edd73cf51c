//! Wire types of the OpenSandbox Lifecycle API (1.1.1 shape). Responses omit
//! absent fields instead of sending `null` (contracts README), so every
//! optional field skips serialization when `None`.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};

/// `CreateSandboxRequest`. Unknown fields are ignored (clients of newer
/// server versions send more); fields sandbolt cannot honour are rejected in
/// `validate`, not silently dropped.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateSandboxRequest {
    pub image: Option<ImageSpec>,
    /// Kept as a raw JSON value so that `0`, negatives, floats and strings
    /// get a precise error message instead of a generic parse failure.
    pub timeout: Option<serde_json::Value>,
    pub resource_limits: Option<BTreeMap<String, String>>,
    pub resource_requests: Option<BTreeMap<String, String>>,
    pub env: Option<BTreeMap<String, Option<String>>>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub entrypoint: Option<Vec<String>>,
    pub extensions: Option<BTreeMap<String, String>>,
    pub volumes: Option<Vec<serde_json::Value>>,
    pub volume_bindings: Option<Vec<serde_json::Value>>,
    pub snapshot_id: Option<String>,
    pub template_id: Option<String>,
    pub network_policy: Option<serde_json::Value>,
    pub platform: Option<PlatformSpec>,
    pub lifecycle: Option<serde_json::Value>,
    pub credential_proxy: Option<serde_json::Value>,
    #[serde(default)]
    pub secure_access: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageSpec {
    pub uri: String,
    #[serde(skip_serializing)]
    pub auth: Option<ImageAuth>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ImageAuth {
    pub username: String,
    pub password: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PlatformSpec {
    pub os: String,
    pub arch: String,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_transition_at: Option<String>,
}

/// `Sandbox` (get, list, metadata patch).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    pub status: SandboxStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    pub created_at: String,
    /// Omitted unless the sandbox belongs to a warm pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocation: Option<AllocationSummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extensions: Option<BTreeMap<String, String>>,
    /// The snapshot the sandbox was restored from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
}

/// `CreateSandboxResponse`: the sandbox without image.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateSandboxResponse {
    pub id: String,
    pub status: SandboxStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    pub created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extensions: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PaginationInfo {
    pub page: u32,
    pub page_size: u32,
    pub total_items: u64,
    pub total_pages: u64,
    pub has_next_page: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListSandboxesResponse {
    pub items: Vec<Sandbox>,
    pub pagination: PaginationInfo,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewSandboxExpirationRequest {
    pub expires_at: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewSandboxExpirationResponse {
    pub expires_at: String,
}

/// `Endpoint`: `endpoint` is `host:port[/path]` with no scheme.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Endpoint {
    pub endpoint: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// Lifecycle states as the API spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Pending,
    Running,
    Pausing,
    Paused,
    Resuming,
    Stopping,
    Terminated,
    Failed,
    /// Nothing is known right now: the node that runs the sandbox is not
    /// reporting (the controller's `PHASE_UNKNOWN`). Not in the spec's list
    /// of common states, which says new values may be added and clients must
    /// handle unknown ones (the SDK keeps `state` a plain string). Every
    /// listed state would be a claim we cannot back: `Running` promises an
    /// answer, `Failed` invites the client to throw away a sandbox that is
    /// most likely still alive, `Pending` says it is being provisioned.
    Unknown,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "Pending",
            State::Running => "Running",
            State::Pausing => "Pausing",
            State::Paused => "Paused",
            State::Resuming => "Resuming",
            State::Stopping => "Stopping",
            State::Terminated => "Terminated",
            State::Failed => "Failed",
            State::Unknown => "Unknown",
        }
    }
}

/// What a backend knows about one sandbox; the API layer renders it.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: String,
    pub image: Option<String>,
    pub entrypoint: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    pub state: State,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub created_at: DateTime<Utc>,
    /// `None` = manual cleanup (OpenSandbox #442).
    pub expires_at: Option<DateTime<Utc>>,
    /// When `state` last changed, where the backend knows it.
    pub last_transition_at: Option<DateTime<Utc>>,
    /// The warm pool the sandbox belongs to, where the engine has them.
    pub allocation: Option<Allocation>,
    /// The snapshot the sandbox was restored from (`snapshotId`).
    pub snapshot_id: Option<String>,
}

/// A sandbox's membership of a warm pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The warm pool's name.
    pub pool: String,
    /// The create was served by claiming one of the pool's warm sandboxes
    /// (false: created cold, within the pool's poolMax).
    pub claimed_warm: bool,
}

/// The `extensions` key of a sandbox answer that says whether a warm
/// sandbox was claimed for it (`"true"`) or it was created cold
/// (`"false"`); present only for sandboxes of a warm pool. Namespaced, as
/// the SDK asks of extension keys; sandbolt-specific, so a client that
/// never heard of it loses nothing.
pub const EXT_CLAIMED_WARM: &str = "sandbolt.claimedWarm";

/// `AllocationSummary`: the pool a sandbox is allocated from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocationSummary {
    pub mode: &'static str,
    pub pool_ref: String,
    pub state: &'static str,
}

pub fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

impl SandboxRecord {
    fn status(&self) -> SandboxStatus {
        SandboxStatus {
            state: self.state.as_str().to_string(),
            reason: self.reason.clone(),
            message: self.message.clone(),
            last_transition_at: self.last_transition_at.map(rfc3339),
        }
    }
    fn metadata_out(&self) -> Option<BTreeMap<String, String>> {
        (!self.metadata.is_empty()).then(|| self.metadata.clone())
    }

    fn allocation_out(&self) -> Option<AllocationSummary> {
        self.allocation.as_ref().map(|a| AllocationSummary {
            mode: "pool",
            pool_ref: a.pool.clone(),
            state: "allocated",
        })
    }

    fn extensions_out(&self) -> Option<BTreeMap<String, String>> {
        self.allocation
            .as_ref()
            .map(|a| BTreeMap::from([(EXT_CLAIMED_WARM.to_string(), a.claimed_warm.to_string())]))
    }

    pub fn to_sandbox(&self) -> Sandbox {
        Sandbox {
            id: self.id.clone(),
            image: self.image.as_ref().map(|uri| ImageSpec {
                uri: uri.clone(),
                auth: None,
            }),
            status: self.status(),
            metadata: self.metadata_out(),
            // The SDK's SandboxInfo requires `entrypoint`: always send it.
            entrypoint: Some(self.entrypoint.clone()),
            expires_at: self.expires_at.map(rfc3339),
            created_at: rfc3339(self.created_at),
            allocation: self.allocation_out(),
            extensions: self.extensions_out(),
            snapshot_id: self.snapshot_id.clone(),
        }
    }

    pub fn to_create_response(&self) -> CreateSandboxResponse {
        CreateSandboxResponse {
            id: self.id.clone(),
            status: self.status(),
            metadata: self.metadata_out(),
            expires_at: self.expires_at.map(rfc3339),
            created_at: rfc3339(self.created_at),
            entrypoint: Some(self.entrypoint.clone()),
            extensions: self.extensions_out(),
        }
    }
}
