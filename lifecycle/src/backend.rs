//! The seam between the REST API and what runs sandboxes: the sandbolt
//! controller (its native control API) or a Docker engine.

use std::collections::BTreeMap;
use std::future::Future;

use chrono::{DateTime, Utc};

use sandbolt_proto::egress::NetworkPolicy;

use crate::egress::{PolicyChange, PolicyStatus};
use crate::error::{ApiError, ApiResult};
use crate::model::SandboxRecord;
use crate::named_volumes::{
    SandboxVolume, Snapshot, Volume, VolumeCreate, VolumeFork, unsupported_route,
};
use crate::pools::{Pool, PoolCapacity, PoolCreate, pools_unsupported};
use crate::snapshots::{SandboxSnapshot, SnapshotFilter};
use crate::validate::{CreatePlan, Extensions};
use crate::volumes::VolumeMount;

/// Where to reach one port of one sandbox: `authority` (`host:port`) plus a
/// path prefix, and the headers the hop needs (e.g. the execd access token).
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub authority: String,
    pub path_prefix: String,
    pub headers: BTreeMap<String, String>,
}

impl Route {
    /// The OpenSandbox endpoint string: `host:port[/path]`, no scheme.
    pub fn endpoint(&self) -> String {
        format!("{}{}", self.authority, self.path_prefix)
    }
}

/// How long [`Backend::readiness`] waits for the engine: a probe that hangs
/// is a failed probe (the kubelet's own timeout is short too).
pub const READINESS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// What [`Backend::proxy_route`] answers for a paused sandbox: a frozen
/// process accepts connections and never answers, so the proxy refuses
/// instead of letting the request hang.
pub fn paused_sandbox(code: &'static str, id: &str) -> ApiError {
    ApiError::conflict(
        code,
        format!("Sandbox {id} is paused; resume it before proxying to it."),
    )
}

/// The answer of a named-volume method on a runtime without named volumes.
fn no_volumes<B: Backend + ?Sized, T>(
    backend: &B,
    route: &str,
) -> std::future::Ready<ApiResult<T>> {
    std::future::ready(Err(unsupported_route(route, backend.runtime_name())))
}

/// The answer of a pool method on a runtime without warm pools.
fn no_pools<B: Backend + ?Sized, T>(backend: &B, route: &str) -> std::future::Ready<ApiResult<T>> {
    std::future::ready(Err(pools_unsupported(route, backend.runtime_name())))
}

/// A sandbox runtime. Implementations map each lifecycle operation to their
/// engine and report errors as [`crate::error::ApiError`] with the right
/// status (404 unknown id, 409 wrong state, 503 engine unreachable).
pub trait Backend: Send + Sync + 'static {
    /// The runtime's name in error messages ("docker", "controller").
    fn runtime_name(&self) -> &'static str;

    /// Rejects a volume this runtime cannot mount (400 naming backend and runtime).
    fn check_volume(&self, volume: &VolumeMount) -> ApiResult<()>;

    /// Rejects `extensions` this runtime cannot honour (400 naming the key).
    fn check_extensions(&self, extensions: &Extensions) -> ApiResult<()>;

    /// Rejects a create-time `networkPolicy` this runtime cannot enforce
    /// (400 naming the field and the runtime).
    fn check_network_policy(&self, policy: &NetworkPolicy) -> ApiResult<()>;

    /// True when host paths are checked by the node that mounts them, not
    /// on this machine (see [`crate::volumes::HostPathCheck`]).
    fn host_paths_checked_on_node(&self) -> bool {
        false
    }

    /// True when the engine deletes expired sandboxes itself, so the
    /// lifecycle runs no sweep of its own (one sweeper per sandbox, however
    /// many lifecycle replicas run).
    fn expires_sandboxes_itself(&self) -> bool {
        false
    }

    /// Whether the engine answers now (the lifecycle's `/readyz`); `Err`
    /// says what does not. The default suits an engine inside this process,
    /// which cannot be out of reach; remote engines ping theirs.
    fn readiness(&self) -> impl Future<Output = Result<(), String>> + Send {
        std::future::ready(Ok(()))
    }

    /// Creates and starts a sandbox; it is `Running` when this returns.
    fn create(&self, plan: CreatePlan) -> impl Future<Output = ApiResult<SandboxRecord>> + Send;

    fn get(&self, id: &str) -> impl Future<Output = ApiResult<SandboxRecord>> + Send;

    /// Every sandbox this backend manages (the API layer filters and pages).
    fn list(&self) -> impl Future<Output = ApiResult<Vec<SandboxRecord>>> + Send;

    fn delete(&self, id: &str) -> impl Future<Output = ApiResult<()>> + Send;

    /// JSON merge patch of user metadata: `Some` upserts, `None` deletes.
    fn patch_metadata(
        &self,
        id: &str,
        patch: BTreeMap<String, Option<String>>,
    ) -> impl Future<Output = ApiResult<SandboxRecord>> + Send;

    fn pause(&self, id: &str) -> impl Future<Output = ApiResult<()>> + Send;

    fn resume(&self, id: &str) -> impl Future<Output = ApiResult<()>> + Send;

    /// Persists a new expiry and answers the expiry as committed (an engine
    /// may keep less precision than `at`). The API layer has already checked
    /// that the sandbox has TTL semantics and that `at` is in the future.
    fn set_expiry(
        &self,
        id: &str,
        at: DateTime<Utc>,
    ) -> impl Future<Output = ApiResult<DateTime<Utc>>> + Send;

    /// The egress policy sandbox `id` runs under, and how it is enforced.
    fn network_policy(&self, id: &str) -> impl Future<Output = ApiResult<PolicyStatus>> + Send;

    /// Applies `change` to the policy of sandbox `id` (read, compute, write
    /// guarded against concurrent writers) and answers the policy as
    /// committed; a runtime that cannot enforce the result answers 400.
    fn change_network_policy(
        &self,
        id: &str,
        change: PolicyChange,
    ) -> impl Future<Output = ApiResult<PolicyStatus>> + Send;

    /// How to reach `port` of sandbox `id`.
    fn route(&self, id: &str, port: u16) -> impl Future<Output = ApiResult<Route>> + Send;

    /// True when this runtime has no named volumes. The API layer then
    /// answers every named-volume route (`/volumes...`,
    /// `/sandboxes/{id}/volumes...`) with a 501 naming the route before it
    /// reads the request. The volume methods below default to that same
    /// 501, for runtimes without named volumes.
    fn named_volumes_unsupported(&self) -> bool {
        false
    }

    fn create_volume(&self, _: VolumeCreate) -> impl Future<Output = ApiResult<Volume>> + Send {
        no_volumes(self, "POST /volumes")
    }

    fn get_volume(&self, _: &str) -> impl Future<Output = ApiResult<Volume>> + Send {
        no_volumes(self, "GET /volumes/{name}")
    }

    fn list_volumes(&self) -> impl Future<Output = ApiResult<Vec<Volume>>> + Send {
        no_volumes(self, "GET /volumes")
    }

    /// Removes the volume and its snapshots (its forks stay); 409 while
    /// any sandbox mounts it.
    fn delete_volume(&self, _: &str) -> impl Future<Output = ApiResult<()>> + Send {
        no_volumes(self, "DELETE /volumes/{name}")
    }

    fn create_volume_snapshot(
        &self,
        _volume: &str,
        _snapshot: &str,
    ) -> impl Future<Output = ApiResult<Snapshot>> + Send {
        no_volumes(self, "POST /volumes/{name}/snapshots")
    }

    fn list_volume_snapshots(
        &self,
        _volume: &str,
    ) -> impl Future<Output = ApiResult<Vec<Snapshot>>> + Send {
        no_volumes(self, "GET /volumes/{name}/snapshots")
    }

    fn delete_volume_snapshot(
        &self,
        _volume: &str,
        _snapshot: &str,
    ) -> impl Future<Output = ApiResult<()>> + Send {
        no_volumes(self, "DELETE /volumes/{name}/snapshots/{snapshot}")
    }

    /// Replaces the volume's data with the snapshot's; 409 while mounted.
    fn restore_volume(
        &self,
        _volume: &str,
        _snapshot: &str,
    ) -> impl Future<Output = ApiResult<Volume>> + Send {
        no_volumes(self, "POST /volumes/{name}/restore")
    }

    fn fork_volume(&self, _: VolumeFork) -> impl Future<Output = ApiResult<Volume>> + Send {
        no_volumes(self, "POST /volumes/{name}/fork")
    }

    /// Mounts a `pvc` volume into running sandbox `id`; answers every
    /// volume the sandbox mounts afterwards.
    fn attach_volume(
        &self,
        _id: &str,
        _volume: VolumeMount,
    ) -> impl Future<Output = ApiResult<Vec<SandboxVolume>>> + Send {
        no_volumes(self, "POST /sandboxes/{id}/volumes")
    }

    /// Unmounts named volume `volume` (its claim name, or the name of the
    /// sandbox's volume entry) from running sandbox `id`.
    fn detach_volume(
        &self,
        _id: &str,
        _volume: &str,
    ) -> impl Future<Output = ApiResult<()>> + Send {
        no_volumes(self, "DELETE /sandboxes/{id}/volumes/{volumeName}")
    }

    /// True when this runtime has no warm pools: every `/pools` route then
    /// answers 501 before it reads the request (the pool methods below
    /// default to that same 501).
    fn pools_unsupported(&self) -> bool {
        false
    }

    /// Creates a warm pool; 409 when the name is taken.
    fn create_pool(&self, _: PoolCreate) -> impl Future<Output = ApiResult<Pool>> + Send {
        no_pools(self, "POST /pools")
    }

    fn get_pool(&self, _: &str) -> impl Future<Output = ApiResult<Pool>> + Send {
        no_pools(self, "GET /pools/{pool_name}")
    }

    fn list_pools(&self) -> impl Future<Output = ApiResult<Vec<Pool>>> + Send {
        no_pools(self, "GET /pools")
    }

    /// Replaces the pool's capacity (its template is fixed).
    fn update_pool(
        &self,
        _name: &str,
        _capacity: PoolCapacity,
    ) -> impl Future<Output = ApiResult<Pool>> + Send {
        no_pools(self, "PUT /pools/{pool_name}")
    }

    /// Drains the pool's buffers; sandboxes claimed from it live on.
    fn delete_pool(&self, _: &str) -> impl Future<Output = ApiResult<()>> + Send {
        no_pools(self, "DELETE /pools/{pool_name}")
    }

    /// Captures sandbox `id`'s filesystem as a new snapshot named `name`;
    /// answers it `Creating` (the capture goes on) or already `Ready`. 404
    /// unknown sandbox, 409 not running or paused.
    fn create_snapshot(
        &self,
        _id: &str,
        _name: Option<String>,
    ) -> impl Future<Output = ApiResult<SandboxSnapshot>> + Send {
        std::future::ready(Err(ApiError::not_implemented("Snapshots")))
    }

    fn get_snapshot(&self, _: &str) -> impl Future<Output = ApiResult<SandboxSnapshot>> + Send {
        std::future::ready(Err(ApiError::not_implemented("Snapshots")))
    }

    /// The snapshots `filter` selects (a backend may answer more: the API
    /// layer filters again, then orders and pages).
    fn list_snapshots(
        &self,
        _: &SnapshotFilter,
    ) -> impl Future<Output = ApiResult<Vec<SandboxSnapshot>>> + Send {
        std::future::ready(Err(ApiError::not_implemented("Snapshots")))
    }

    /// Removes the snapshot, or marks it `Deleting` while sandboxes created
    /// from it live (it goes with the last of them); 409 while it is being
    /// captured.
    fn delete_snapshot(&self, _: &str) -> impl Future<Output = ApiResult<()>> + Send {
        std::future::ready(Err(ApiError::not_implemented("Snapshots")))
    }

    /// The route the reverse proxy forwards to. Unlike [`Backend::route`]
    /// (endpoints are facts, valid while paused too), this refuses a sandbox
    /// that cannot answer, so the proxy never waits on a frozen process.
    fn proxy_route(&self, id: &str, port: u16) -> impl Future<Output = ApiResult<Route>> + Send {
        self.route(id, port)
    }

    /// What the diagnostics routes show of sandbox `id`: facts about its
    /// container, its newest events and the end of its log, within
    /// `query`'s bounds (see [`crate::diagnostics`]). 404 unknown id.
    fn diagnostics(
        &self,
        _id: &str,
        _query: crate::diagnostics::DiagnosticsQuery,
    ) -> impl Future<Output = ApiResult<crate::diagnostics::Diagnostics>> + Send {
        std::future::ready(Err(ApiError::not_implemented("Diagnostics")))
    }
}
