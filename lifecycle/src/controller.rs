//! Controller backend: every route becomes one call of sandbolt's native
//! control API (`sandbolt.control.v1.SandboxService`) on the controller.
//!
//! The controller's record is the whole sandbox (spec, status, creation and
//! transition times, expiry), so this backend keeps nothing: no file, no
//! cache, no expiry sweep (the controller expires sandboxes). A restarted
//! lifecycle, or any number of replicas behind one address, give the same
//! answers because they all read the same record.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::egress::NetworkPolicy;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use crate::backend::{Backend, Route, paused_sandbox};
use crate::egress::{ENFORCEMENT_DNS_NFT, PolicyChange, PolicyStatus};
use crate::error::{ApiError, ApiResult, StartError};
use crate::model::{Allocation, SandboxRecord, State};
use crate::named_volumes::{
    AccessMode, SandboxVolume, Snapshot, Volume, VolumeCreate, VolumeFork, check_backend,
};
use crate::pools::{Pool, PoolCapacity, PoolCreate};
use crate::snapshots::{SandboxSnapshot, SnapshotFilter};
use crate::validate::{
    ConsistencyMode, CreatePlan, Extensions, FailurePolicy, Quantity, ResourceSet,
};
use crate::volumes::{PvcClaim, VolumeMount, VolumeSource, unsupported};

type Client =
    pb::sandbox_service_client::SandboxServiceClient<InterceptedService<Channel, BearerToken>>;

/// Controller backend settings.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// The controller's gRPC address, e.g. `http://127.0.0.1:9090`.
    pub controller: String,
    /// The namespace sandboxes are created and listed in.
    pub namespace: String,
    /// Bearer token the controller requires on its FastPath/native port
    /// (`sandbolt controller --fastpath-token`).
    pub token: Option<String>,
    /// CA (PEM) of a controller serving TLS (`sandbolt controller
    /// --tls-cert`); `controller` is then `https://`.
    pub ca: Option<std::path::PathBuf>,
}

impl ControllerConfig {
    pub fn new(controller: impl Into<String>) -> Self {
        Self {
            controller: controller.into(),
            namespace: "default".into(),
            token: None,
            ca: None,
        }
    }
}

/// Cheap to clone: the clients share one channel. The fsb gateway holds a
/// clone beside the API's.
#[derive(Clone)]
pub struct ControllerBackend {
    client: Client,
    /// `VolumeService` on the same channel and token.
    volumes: crate::controller_volumes::VolumeClient,
    /// `WarmPoolService` on the same channel and token.
    pools: crate::controller_pools::WarmPoolClient,
    /// `SnapshotService` on the same channel and token.
    snapshots: crate::controller_snapshots::SnapshotClient,
    /// `grpc.health.v1` on the same channel, for readiness (no token: the
    /// controller serves health to anyone, as to the kubelet).
    health: HealthClient<Channel>,
    namespace: String,
}

/// What the lifecycle asked the controller, where an answer's code means
/// something particular to the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Create,
    SetExpiry,
    /// The write of a changed egress policy (applied on the node before
    /// the controller answers).
    ChangePolicy,
    /// Every call on an existing sandbox (get, delete, update, pause,
    /// resume, resolve) and the list.
    OnSandbox,
}

/// Maps a controller status to the REST error: the one place where the
/// controller's answers are translated. The native API's codes mean one
/// thing each (control.proto), so the message is passed on as it is: for
/// INVALID_ARGUMENT it names the offending field.
fn map_status(call: Call, id: &str, s: tonic::Status) -> ApiError {
    use tonic::Code;
    let msg = s.message().to_string();
    match (call, s.code()) {
        // Nothing a create names can be "not found" but what it refers to
        // (a pool, an image): the request's to fix, not a missing sandbox.
        (Call::Create, Code::NotFound) => ApiError::invalid(msg),
        // The API layer read the record first and saw an expiry; the
        // controller disagreeing means it was made manual-cleanup in
        // between. Same answer as when the read sees it.
        (Call::SetExpiry, Code::FailedPrecondition) => ApiError::conflict(
            "SANDBOX_MANUAL_CLEANUP",
            format!("Sandbox {id} does not have automatic expiration enabled."),
        ),
        // The controller answered: it could not apply the policy on the
        // sandbox's node (agent unreachable); its message says why.
        (Call::ChangePolicy, Code::Unavailable) => {
            ApiError::unavailable(format!("egress policy of sandbox {id} not applied: {msg}"))
        }
        (_, code) => map_code(code, id, msg),
    }
}

/// `Retry-After` of a 429 (RESOURCE_EXHAUSTED).
pub(crate) const EXHAUSTED_RETRY_AFTER_SECS: u32 = 1;

/// The record a write is computed from: the same one (uid), unchanged
/// since (generation), or the controller refuses the write.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Precondition {
    uid: String,
    generation: i64,
}

/// How many times a policy change is computed and written before a
/// sandbox whose record keeps changing under it answers 409.
const POLICY_WRITE_ATTEMPTS: u32 = 4;

/// The policy a record holds.
fn stored_policy(s: &pb::Sandbox) -> ApiResult<NetworkPolicy> {
    let json = s
        .spec
        .as_ref()
        .map_or("", |spec| spec.network_policy_json.as_str());
    NetworkPolicy::parse(json).map_err(|e| {
        ApiError::internal(format!(
            "the controller holds an egress policy for sandbox {} that does not parse: {e}",
            s.name
        ))
    })
}

/// Read, compute, write guarded by the read's generation; a write that lost
/// to a concurrent writer (ABORTED) starts over from a fresh read, so no
/// PATCH or DELETE is computed on a stale policy and silently undoes another.
async fn change_with_retry<RF, WF>(
    id: &str,
    change: &PolicyChange,
    mut read: impl FnMut() -> RF,
    mut write: impl FnMut(Precondition, String) -> WF,
) -> ApiResult<pb::Sandbox>
where
    RF: Future<Output = Result<pb::Sandbox, tonic::Status>>,
    WF: Future<Output = Result<pb::Sandbox, tonic::Status>>,
{
    let mut attempt = 1;
    loop {
        let current = read()
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        let next = change.apply(&stored_policy(&current)?)?;
        let precondition = Precondition {
            uid: current.uid,
            generation: current.generation,
        };
        match write(precondition, next.to_json()).await {
            Ok(committed) => return Ok(committed),
            Err(s) if s.code() == tonic::Code::Aborted && attempt < POLICY_WRITE_ATTEMPTS => {
                tracing::debug!(sandbox_id = %id, attempt, error = %s.message(), "policy write lost to a concurrent change; reading again");
                attempt += 1;
            }
            Err(s) => return Err(map_status(Call::ChangePolicy, id, s)),
        }
    }
}

/// A refused create, in REST terms (see [`map_status`]).
pub(crate) fn map_create_status(id: &str, s: tonic::Status) -> ApiError {
    map_status(Call::Create, id, s)
}

pub(crate) fn map_code(code: tonic::Code, id: &str, msg: String) -> ApiError {
    use tonic::Code;
    match code {
        Code::NotFound => ApiError::not_found(id),
        Code::InvalidArgument | Code::OutOfRange => ApiError::invalid(msg),
        Code::AlreadyExists => ApiError::conflict("SANDBOX_ALREADY_EXISTS", msg),
        Code::Aborted => ApiError::conflict("SANDBOX_CONFLICT", msg),
        Code::FailedPrecondition => ApiError::conflict("SANDBOX_INVALID_STATE", msg),
        // The document promises Retry-After with the 429. No agent with
        // room, or a warm pool at its poolMax: either frees up as soon as
        // any sandbox goes, so the client may try again soon.
        Code::ResourceExhausted => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "CONTROLLER::RESOURCE_EXHAUSTED",
            msg,
        )
        .with_retry_after(EXHAUSTED_RETRY_AFTER_SECS),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
            ApiError::unavailable(format!("controller unavailable: {msg}"))
                .with_retry_after(crate::controller_volumes::RETRY_AFTER_SECS)
        }
        // The client did nothing wrong: this server is misconfigured. 502
        // says "the server behind me refused", and the message says which
        // knob to turn, instead of a bare 500.
        Code::Unauthenticated | Code::PermissionDenied => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "CONTROLLER::UNAUTHENTICATED",
            format!(
                "the controller refused the lifecycle's controller token (missing or wrong; \
                 set the lifecycle's --controller-token to the controller's token): {msg}"
            ),
        ),
        Code::Unimplemented => ApiError::not_implemented(&format!("This operation ({msg})")),
        _ => ApiError::internal(format!("controller error: {msg}")),
    }
}

/// The controller's phase in the REST vocabulary, with a machine-readable
/// reason where the state alone would hide what is going on.
fn state_of(phase: i32) -> (State, Option<&'static str>) {
    use pb::Phase as P;
    match P::try_from(phase).unwrap_or(P::Unspecified) {
        P::Pending => (State::Pending, None),
        P::Running => (State::Running, None),
        P::Paused => (State::Paused, None),
        // Being created again on another node: provisioning, as Pending says.
        P::Recovering => (State::Pending, Some("recovering")),
        P::Failed => (State::Failed, Some("runtime_error")),
        // The agent is silent: see `State::Unknown` for why no listed state.
        P::Unknown => (State::Unknown, Some("agent_unreachable")),
        // A controller that sets no phase tells us nothing either.
        P::Unspecified => (State::Unknown, None),
    }
}

fn from_millis(ms: i64) -> Option<DateTime<Utc>> {
    (ms > 0)
        .then(|| DateTime::from_timestamp_millis(ms))
        .flatten()
}

/// The native record as the REST API shows it.
pub fn to_record(s: &pb::Sandbox) -> SandboxRecord {
    let spec = s.spec.clone().unwrap_or_default();
    let status = s.status.clone().unwrap_or_default();
    let (state, reason) = state_of(status.phase);
    let mut entrypoint = spec.command;
    entrypoint.extend(spec.args);
    SandboxRecord {
        id: s.name.clone(),
        image: (!spec.image.is_empty()).then_some(spec.image),
        entrypoint,
        metadata: spec.metadata.into_iter().collect(),
        state,
        reason: reason.map(str::to_owned),
        message: (!status.message.is_empty()).then_some(status.message),
        // A record always has a creation time; epoch rather than "now" if a
        // controller ever leaves it out, so the answer does not change
        // from one read to the next.
        created_at: from_millis(status.created_at_unix_ms).unwrap_or_default(),
        expires_at: (spec.expires_at_unix_seconds > 0)
            .then(|| DateTime::from_timestamp(spec.expires_at_unix_seconds, 0))
            .flatten(),
        last_transition_at: from_millis(status.last_transition_unix_ms),
        allocation: (!spec.warm_pool.is_empty()).then_some(Allocation {
            pool: spec.warm_pool,
            claimed_warm: status.claimed_warm,
        }),
        snapshot_id: (!spec.snapshot_id.is_empty()).then_some(spec.snapshot_id),
    }
}

pub(crate) fn resource_list(set: &ResourceSet) -> pb::ResourceList {
    let text = |q: &Option<Quantity>| q.as_ref().map(|q| q.text.clone()).unwrap_or_default();
    pb::ResourceList {
        cpu: text(&set.cpu),
        memory: text(&set.memory),
        pids: set.pids.unwrap_or(0),
        ephemeral_storage: text(&set.ephemeral_storage),
    }
}

/// A `pvc` as the controller takes it: the named volume, created on the
/// sandbox's node when missing (if asked) with the one access mode, the
/// quota and the `local` backend the request names. Hints the controller
/// cannot honour are refused, naming the field, never dropped.
fn pvc_source(volume: &str, c: &PvcClaim) -> ApiResult<pb::PvcSource> {
    check_backend(
        &format!("volume '{volume}': pvc.storageClass"),
        c.storage_class.as_deref(),
    )?;
    let access_mode = match c.access_modes.as_slice() {
        [] => None,
        [mode] => Some(AccessMode::parse(
            &format!("volume '{volume}': pvc.accessModes[0]"),
            mode,
        )?),
        many => {
            return Err(ApiError::invalid_code(
                "VOLUME::INVALID_ACCESS_MODE",
                format!(
                    "volume '{volume}': pvc.accessModes lists {} modes; a named volume has exactly \
                     one (ReadWriteOnce, ReadOnlyMany or ReadWriteMany)",
                    many.len()
                ),
            ));
        }
    };
    Ok(pb::PvcSource {
        claim_name: c.claim_name.clone(),
        create_if_missing: c.create_if_missing,
        access_mode: crate::controller_volumes::to_pb_mode(access_mode),
        size: c.storage.clone().unwrap_or_default(),
        backend: c.storage_class.clone().unwrap_or_default(),
        delete_on_sandbox_delete: c.delete_on_sandbox_delete,
        created_by_sandbox: false,
    })
}

pub(crate) fn volume(v: &VolumeMount) -> ApiResult<pb::Volume> {
    let source = match &v.source {
        VolumeSource::Host { path } => pb::volume::Source::Host(pb::HostPathSource {
            path: path.to_string_lossy().into_owned(),
        }),
        VolumeSource::Pvc(claim) => pb::volume::Source::Pvc(pvc_source(&v.name, claim)?),
        other => return Err(unsupported(other.kind(), "controller")),
    };
    Ok(pb::Volume {
        name: v.name.clone(),
        source: Some(source),
        mount_path: v.mount_path.clone(),
        read_only: v.read_only,
        sub_path: v.sub_path.clone().unwrap_or_default(),
    })
}

/// The native create request for a validated plan.
pub fn create_request(plan: &CreatePlan, namespace: &str) -> ApiResult<pb::CreateSandboxRequest> {
    let resources = (!plan.limits.is_empty() || !plan.requests.is_empty()).then(|| pb::Resources {
        limits: Some(resource_list(&plan.limits)),
        requests: Some(resource_list(&plan.requests)),
    });
    let ext = &plan.extensions;
    let spec = pb::SandboxSpec {
        image: plan.image.clone(),
        // The REST entrypoint replaces the image's, arguments included.
        command: plan.entrypoint.clone(),
        args: Vec::new(),
        env: plan.env.clone().into_iter().collect(),
        working_dir: String::new(),
        resources,
        volumes: plan.volumes.iter().map(volume).collect::<ApiResult<_>>()?,
        runtime: String::new(),
        pool: ext.pool.clone().unwrap_or_default(),
        failure_policy: match ext.failure_policy {
            None => pb::FailurePolicy::Unspecified,
            Some(FailurePolicy::Manual) => pb::FailurePolicy::Manual,
            Some(FailurePolicy::AutoRecreate) => pb::FailurePolicy::AutoRecreate,
        } as i32,
        recovery_timeout_seconds: 0,
        expires_at_unix_seconds: plan.expires_at.map_or(0, ceil_to_second),
        metadata: plan.metadata.clone().into_iter().collect(),
        exposed_ports: Vec::new(),
        network_policy_json: plan.network_policy.to_json(),
        // The controller fills the image from the snapshot (`image` is empty).
        snapshot_id: plan.snapshot_id.clone().unwrap_or_default(),
        // `pool` may name a warm pool: the controller resolves it (and
        // fills the image from its template when the request has none).
        warm_pool: String::new(),
        secret_env_names: ext.secret_env.clone(),
    };
    Ok(pb::CreateSandboxRequest {
        // The id doubles as idempotency key: a retried create is the same one.
        request_id: plan.id.clone(),
        namespace: namespace.to_string(),
        name: plan.id.clone(),
        spec: Some(spec),
        consistency: match ext.consistency {
            None => pb::Consistency::Unspecified,
            Some(ConsistencyMode::Fast) => pb::Consistency::Fast,
            Some(ConsistencyMode::Strong) => pb::Consistency::Strong,
        } as i32,
        // 202 means Running with execd answering (contracts README).
        wait_ready: true,
    })
}

/// Splits `host:port/path` into authority and path prefix.
fn split_endpoint(ep: &str) -> (String, String) {
    let ep = ep
        .strip_prefix("http://")
        .or_else(|| ep.strip_prefix("https://"))
        .unwrap_or(ep);
    match ep.find('/') {
        Some(i) => (
            ep[..i].to_string(),
            ep[i..].trim_end_matches('/').to_string(),
        ),
        None => (ep.to_string(), String::new()),
    }
}

/// The controller's sandbox names (letters, digits, `-._`, alphanumeric
/// first, ≤ 253). Anything else cannot exist: 404 without a round trip.
pub(crate) fn check_id(id: &str) -> ApiResult<()> {
    let ok = !id.is_empty()
        && id.len() <= 253
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::not_found(id))
    }
}

/// The controller keeps expiry in whole seconds. Rounding up keeps a
/// timeout from ending early and a renew "in the future" (checked by the API
/// layer) in the future once truncated.
fn ceil_to_second(at: DateTime<Utc>) -> i64 {
    if at.timestamp_subsec_nanos() > 0 {
        at.timestamp() + 1
    } else {
        at.timestamp()
    }
}

impl ControllerBackend {
    /// Sets up the channel and checks, once, that the controller takes our
    /// token. The channel connects lazily: a controller that is not up yet
    /// (a rollout, `sandbolt up` ordering) is not a reason to refuse to start,
    /// a wrong token is.
    pub async fn connect(config: ControllerConfig) -> Result<Self, StartError> {
        let endpoint =
            sandbolt_proto::tls::controller_endpoint(&config.controller, config.ca.as_deref())
                .map_err(|e| StartError::Config(e.to_string()))?
                .connect_timeout(Duration::from_secs(5))
                .tcp_nodelay(true);
        let token = BearerToken::new(config.token.as_deref().unwrap_or_default())
            .map_err(|_| StartError::Config("controller token is not valid ASCII".into()))?;
        let channel = endpoint.connect_lazy();
        let backend = Self {
            client: pb::sandbox_service_client::SandboxServiceClient::with_interceptor(
                channel.clone(),
                token.clone(),
            ),
            volumes: pb::volume_service_client::VolumeServiceClient::with_interceptor(
                channel.clone(),
                token.clone(),
            ),
            pools: pb::warm_pool_service_client::WarmPoolServiceClient::with_interceptor(
                channel.clone(),
                token.clone(),
            ),
            snapshots: pb::snapshot_service_client::SnapshotServiceClient::with_interceptor(
                channel.clone(),
                token,
            ),
            health: HealthClient::new(channel),
            namespace: config.namespace,
        };
        match backend.client().list_pools(pb::ListPoolsRequest {}).await {
            Ok(_) => {}
            Err(s) if matches!(s.code(), tonic::Code::Unauthenticated) => {
                return Err(StartError::Backend(format!(
                    "controller {} refused the lifecycle's controller token (missing or wrong): {}",
                    config.controller,
                    s.message()
                )));
            }
            Err(s) => tracing::warn!(
                controller = %config.controller,
                code = ?s.code(),
                error = %s.message(),
                "controller not answering yet; requests will retry the connection"
            ),
        }
        Ok(backend)
    }

    pub(crate) fn reference(&self, id: &str) -> pb::SandboxRef {
        reference_in(&self.namespace, id)
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    pub(crate) fn volume_client(&self) -> crate::controller_volumes::VolumeClient {
        self.volumes.clone()
    }

    pub(crate) fn pool_client(&self) -> crate::controller_pools::WarmPoolClient {
        self.pools.clone()
    }

    pub(crate) fn snapshot_client(&self) -> crate::controller_snapshots::SnapshotClient {
        self.snapshots.clone()
    }

    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    pub(crate) async fn read(&self, id: &str) -> Result<pb::Sandbox, tonic::Status> {
        self.read_in(&self.namespace, id).await
    }

    async fn read_in(&self, namespace: &str, id: &str) -> Result<pb::Sandbox, tonic::Status> {
        let req = pb::GetSandboxRequest {
            sandbox: Some(reference_in(namespace, id)),
        };
        Ok(self.client().get_sandbox(req).await?.into_inner())
    }

    /// Replaces the egress policy of sandbox `id` if its record still is
    /// the one the change was computed from (else ABORTED or NOT_FOUND).
    async fn write_policy(
        &self,
        id: &str,
        precondition: Precondition,
        policy_json: String,
    ) -> Result<pb::Sandbox, tonic::Status> {
        let mut sandbox = self.reference(id);
        sandbox.expected_uid = precondition.uid;
        let req = pb::UpdateSandboxRequest {
            sandbox: Some(sandbox),
            expected_generation: precondition.generation,
            expires_at_unix_seconds: None,
            metadata_upsert: Default::default(),
            metadata_delete_keys: Vec::new(),
            network_policy_json: Some(policy_json),
        };
        Ok(self.client().update_sandbox(req).await?.into_inner())
    }
}

impl Backend for ControllerBackend {
    fn runtime_name(&self) -> &'static str {
        "controller"
    }

    fn check_volume(&self, v: &VolumeMount) -> ApiResult<()> {
        match &v.source {
            // The node's agent enforces its allowlist; whether a pvc can be
            // served is the controller's to say (it answers 400 naming it).
            VolumeSource::Host { .. } | VolumeSource::Pvc { .. } => Ok(()),
            other => Err(unsupported(other.kind(), self.runtime_name())),
        }
    }

    fn check_extensions(&self, _: &Extensions) -> ApiResult<()> {
        // Every extension sandbolt parses is a field of the native spec.
        Ok(())
    }

    fn check_network_policy(&self, _: &NetworkPolicy) -> ApiResult<()> {
        // Every node enforces policy; the controller checks it again.
        Ok(())
    }

    fn host_paths_checked_on_node(&self) -> bool {
        true
    }

    fn expires_sandboxes_itself(&self) -> bool {
        true
    }

    /// The controller's health answer for the service the lifecycle calls:
    /// a standby replica, or one whose store is not open, is not serving.
    async fn readiness(&self) -> Result<(), String> {
        let service = pb::sandbox_service_server::SERVICE_NAME;
        let mut health = self.health.clone();
        let check = health.check(HealthCheckRequest {
            service: service.to_string(),
        });
        match tokio::time::timeout(crate::backend::READINESS_TIMEOUT, check).await {
            Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32 => Ok(()),
            Ok(Ok(r)) => Err(format!(
                "controller reports {service} as {:?}",
                r.get_ref().status()
            )),
            Ok(Err(s)) => Err(format!(
                "controller health check failed: {:?} {}",
                s.code(),
                s.message()
            )),
            Err(_) => Err(format!(
                "controller did not answer its health check within {:?}",
                crate::backend::READINESS_TIMEOUT
            )),
        }
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "create", sandbox_id = %plan.id, namespace = %self.namespace))]
    async fn create(&self, plan: CreatePlan) -> ApiResult<SandboxRecord> {
        let req = create_request(&plan, &self.namespace)?;
        let sandbox = match self.client().create_sandbox(req).await {
            Ok(s) => s.into_inner(),
            Err(s) => return Err(self.create_refused(&plan, s).await),
        };
        let mut rec = to_record(&sandbox);
        // wait_ready: the controller answered once execd inside answered.
        // With fast consistency the record may still say Pending while the
        // sandbox already serves; Running is the fact.
        if rec.state == State::Pending && rec.reason.is_none() {
            rec.state = State::Running;
        }
        tracing::info!(id = %rec.id, image = %plan.image, "sandbox created");
        Ok(rec)
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "get", sandbox_id = %id, namespace = %self.namespace))]
    async fn get(&self, id: &str) -> ApiResult<SandboxRecord> {
        check_id(id)?;
        let sandbox = self
            .read(id)
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        Ok(to_record(&sandbox))
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "list", namespace = %self.namespace))]
    async fn list(&self) -> ApiResult<Vec<SandboxRecord>> {
        // page_size 0: every sandbox in one answer. The token loop is only
        // for a controller that pages anyway.
        let mut out = Vec::new();
        let mut page_token = String::new();
        loop {
            let resp = self
                .client()
                .list_sandboxes(pb::ListSandboxesRequest {
                    namespace: self.namespace.clone(),
                    metadata: Default::default(),
                    phases: Vec::new(),
                    page_size: 0,
                    page_token,
                })
                .await
                .map_err(|s| map_status(Call::OnSandbox, "*", s))?
                .into_inner();
            out.extend(resp.items.iter().map(to_record));
            if resp.next_page_token.is_empty() {
                return Ok(out);
            }
            page_token = resp.next_page_token;
        }
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "delete", sandbox_id = %id, namespace = %self.namespace))]
    async fn delete(&self, id: &str) -> ApiResult<()> {
        check_id(id)?;
        self.client()
            .delete_sandbox(pb::DeleteSandboxRequest {
                sandbox: Some(self.reference(id)),
            })
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        tracing::info!(%id, "sandbox deleted");
        Ok(())
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "patch_metadata", sandbox_id = %id, namespace = %self.namespace))]
    async fn patch_metadata(
        &self,
        id: &str,
        patch: BTreeMap<String, Option<String>>,
    ) -> ApiResult<SandboxRecord> {
        check_id(id)?;
        let upsert = patch
            .iter()
            .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
            .collect();
        let delete = patch
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        let sandbox = self
            .client()
            .update_sandbox(pb::UpdateSandboxRequest {
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
                expires_at_unix_seconds: None,
                metadata_upsert: upsert,
                metadata_delete_keys: delete,
                network_policy_json: None,
            })
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?
            .into_inner();
        Ok(to_record(&sandbox))
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "pause", sandbox_id = %id, namespace = %self.namespace))]
    async fn pause(&self, id: &str) -> ApiResult<()> {
        check_id(id)?;
        self.client()
            .pause_sandbox(self.reference(id))
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        Ok(())
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "resume", sandbox_id = %id, namespace = %self.namespace))]
    async fn resume(&self, id: &str) -> ApiResult<()> {
        check_id(id)?;
        self.client()
            .resume_sandbox(self.reference(id))
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        Ok(())
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "set_expiry", sandbox_id = %id, namespace = %self.namespace))]
    async fn set_expiry(&self, id: &str, at: DateTime<Utc>) -> ApiResult<DateTime<Utc>> {
        check_id(id)?;
        let sandbox = self
            .client()
            .update_sandbox(pb::UpdateSandboxRequest {
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
                expires_at_unix_seconds: Some(ceil_to_second(at)),
                metadata_upsert: Default::default(),
                metadata_delete_keys: Vec::new(),
                network_policy_json: None,
            })
            .await
            .map_err(|s| map_status(Call::SetExpiry, id, s))?
            .into_inner();
        to_record(&sandbox)
            .expires_at
            .ok_or_else(|| ApiError::internal("the controller committed no expiry"))
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "network_policy", sandbox_id = %id, namespace = %self.namespace))]
    async fn network_policy(&self, id: &str) -> ApiResult<PolicyStatus> {
        check_id(id)?;
        let sandbox = self
            .read(id)
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        Ok(PolicyStatus {
            policy: stored_policy(&sandbox)?,
            enforcement_mode: ENFORCEMENT_DNS_NFT,
        })
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "change_network_policy", sandbox_id = %id, namespace = %self.namespace))]
    async fn change_network_policy(
        &self,
        id: &str,
        change: PolicyChange,
    ) -> ApiResult<PolicyStatus> {
        check_id(id)?;
        let committed = change_with_retry(
            id,
            &change,
            || self.read(id),
            |precondition, policy_json| self.write_policy(id, precondition, policy_json),
        )
        .await?;
        Ok(PolicyStatus {
            policy: stored_policy(&committed)?,
            enforcement_mode: ENFORCEMENT_DNS_NFT,
        })
    }

    async fn create_pool(&self, req: PoolCreate) -> ApiResult<Pool> {
        self.pool_create(req).await
    }

    async fn get_pool(&self, name: &str) -> ApiResult<Pool> {
        self.pool_get(name).await
    }

    async fn list_pools(&self) -> ApiResult<Vec<Pool>> {
        self.pool_list().await
    }

    async fn update_pool(&self, name: &str, capacity: PoolCapacity) -> ApiResult<Pool> {
        self.pool_update(name, capacity).await
    }

    async fn delete_pool(&self, name: &str) -> ApiResult<()> {
        self.pool_delete(name).await
    }

    async fn create_volume(&self, req: VolumeCreate) -> ApiResult<Volume> {
        self.vol_create(req).await
    }

    async fn get_volume(&self, name: &str) -> ApiResult<Volume> {
        self.vol_get(name).await
    }

    async fn list_volumes(&self) -> ApiResult<Vec<Volume>> {
        self.vol_list().await
    }

    async fn delete_volume(&self, name: &str) -> ApiResult<()> {
        self.vol_delete(name).await
    }

    async fn create_volume_snapshot(&self, volume: &str, snapshot: &str) -> ApiResult<Snapshot> {
        self.vol_snapshot(volume, snapshot).await
    }

    async fn list_volume_snapshots(&self, volume: &str) -> ApiResult<Vec<Snapshot>> {
        self.vol_snapshots(volume).await
    }

    async fn delete_volume_snapshot(&self, volume: &str, snapshot: &str) -> ApiResult<()> {
        self.vol_delete_snapshot(volume, snapshot).await
    }

    async fn restore_volume(&self, volume: &str, snapshot: &str) -> ApiResult<Volume> {
        self.vol_restore(volume, snapshot).await
    }

    async fn fork_volume(&self, fork: VolumeFork) -> ApiResult<Volume> {
        self.vol_fork(fork).await
    }

    async fn attach_volume(&self, id: &str, volume: VolumeMount) -> ApiResult<Vec<SandboxVolume>> {
        self.vol_attach(id, volume).await
    }

    async fn detach_volume(&self, id: &str, volume: &str) -> ApiResult<()> {
        self.vol_detach(id, volume).await
    }

    async fn create_snapshot(&self, id: &str, name: Option<String>) -> ApiResult<SandboxSnapshot> {
        self.snap_create(id, name).await
    }

    async fn get_snapshot(&self, id: &str) -> ApiResult<SandboxSnapshot> {
        self.snap_get(id).await
    }

    async fn list_snapshots(&self, filter: &SnapshotFilter) -> ApiResult<Vec<SandboxSnapshot>> {
        self.snap_list(filter).await
    }

    async fn delete_snapshot(&self, id: &str) -> ApiResult<()> {
        self.snap_delete(id).await
    }

    async fn proxy_route(&self, id: &str, port: u16) -> ApiResult<Route> {
        self.proxy_route_in(&self.namespace, id, port).await
    }

    async fn route(&self, id: &str, port: u16) -> ApiResult<Route> {
        self.resolve_in(&self.namespace, id, port).await
    }

    async fn diagnostics(
        &self,
        id: &str,
        query: crate::diagnostics::DiagnosticsQuery,
    ) -> ApiResult<crate::diagnostics::Diagnostics> {
        crate::diagnostics::of_controller(self, id, query).await
    }
}

/// A reference to sandbox `id` of `namespace`, with no precondition.
fn reference_in(namespace: &str, id: &str) -> pb::SandboxRef {
    pb::SandboxRef {
        namespace: namespace.to_string(),
        name: id.to_string(),
        expected_uid: String::new(),
    }
}

/// Routes to sandboxes of any namespace: the fsb gateway's scopes name the
/// namespace the OpenSandbox server created the sandbox in, which need not
/// be the one this lifecycle serves.
impl ControllerBackend {
    /// [`Backend::proxy_route`] for sandbox `id` of `namespace`: refuses a
    /// paused sandbox (409) rather than forwarding to a frozen process.
    #[tracing::instrument(name = "controller", skip_all, fields(call = "proxy_route", sandbox_id = %id, namespace = %namespace, port = port))]
    pub(crate) async fn proxy_route_in(
        &self,
        namespace: &str,
        id: &str,
        port: u16,
    ) -> ApiResult<Route> {
        check_id(id)?;
        // Read from the controller every time; a cached answer would
        // differ between replicas.
        let sandbox = self
            .read_in(namespace, id)
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?;
        if to_record(&sandbox).state == State::Paused {
            return Err(paused_sandbox("SANDBOX_PAUSED", id));
        }
        self.resolve_in(namespace, id, port).await
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "route", sandbox_id = %id, namespace = %namespace, port = port))]
    async fn resolve_in(&self, namespace: &str, id: &str, port: u16) -> ApiResult<Route> {
        check_id(id)?;
        let ep = self
            .client()
            .resolve_endpoint(pb::ResolveEndpointRequest {
                sandbox: Some(reference_in(namespace, id)),
                port: u32::from(port),
            })
            .await
            .map_err(|s| map_status(Call::OnSandbox, id, s))?
            .into_inner();
        if ep.endpoint.is_empty() {
            return Err(ApiError::internal("controller resolved no endpoint"));
        }
        let (authority, path_prefix) = split_endpoint(&ep.endpoint);
        Ok(Route {
            authority,
            path_prefix,
            headers: ep.headers.into_iter().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::{Policy, plan_create};
    use crate::volumes::HostPathCheck;
    use serde_json::json;

    fn sandbox(phase: pb::Phase) -> pb::Sandbox {
        pb::Sandbox {
            namespace: "default".into(),
            name: "sbx-1".into(),
            uid: "u-1".into(),
            generation: 3,
            request_id: "sbx-1".into(),
            spec: Some(pb::SandboxSpec {
                image: "busybox".into(),
                command: vec!["sh".into(), "-c".into()],
                args: vec!["sleep 1000".into()],
                metadata: [("team".to_string(), "a".to_string())].into(),
                expires_at_unix_seconds: 1_900_000_000,
                ..Default::default()
            }),
            status: Some(pb::SandboxStatus {
                phase: phase as i32,
                message: "agent agent-1 silent for 12s".into(),
                created_at_unix_ms: 1_800_000_000_123,
                last_transition_unix_ms: 1_800_000_100_456,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn record_carries_the_whole_sandbox() {
        let r = to_record(&sandbox(pb::Phase::Running));
        assert_eq!(r.id, "sbx-1");
        assert_eq!(r.image.as_deref(), Some("busybox"));
        // command + args = the REST entrypoint.
        assert_eq!(r.entrypoint, ["sh", "-c", "sleep 1000"]);
        assert_eq!(r.metadata, BTreeMap::from([("team".into(), "a".into())]));
        assert_eq!(r.state, State::Running);
        assert_eq!(
            r.created_at,
            DateTime::from_timestamp_millis(1_800_000_000_123).unwrap()
        );
        assert_eq!(
            r.expires_at,
            Some(DateTime::from_timestamp(1_900_000_000, 0).unwrap())
        );
        let s = r.to_sandbox();
        assert_eq!(
            s.status.last_transition_at.as_deref(),
            Some("2027-01-15T08:01:40.456000Z")
        );
        assert_eq!(s.created_at, "2027-01-15T08:00:00.123000Z");
        // Manual cleanup: no expiry at all.
        let mut m = sandbox(pb::Phase::Running);
        m.spec.as_mut().unwrap().expires_at_unix_seconds = 0;
        assert_eq!(to_record(&m).expires_at, None);
        assert!(to_record(&m).to_sandbox().expires_at.is_none());
    }

    #[test]
    fn phases_map_to_states_that_do_not_lie() {
        for (phase, state, reason) in [
            (pb::Phase::Pending, "Pending", None),
            (pb::Phase::Running, "Running", None),
            (pb::Phase::Paused, "Paused", None),
            (pb::Phase::Recovering, "Pending", Some("recovering")),
            (pb::Phase::Failed, "Failed", Some("runtime_error")),
            (pb::Phase::Unknown, "Unknown", Some("agent_unreachable")),
            (pb::Phase::Unspecified, "Unknown", None),
        ] {
            let r = to_record(&sandbox(phase));
            assert_eq!(r.state.as_str(), state, "{phase:?}");
            assert_eq!(r.reason.as_deref(), reason, "{phase:?}");
            assert_eq!(
                r.message.as_deref(),
                Some("agent agent-1 silent for 12s"),
                "{phase:?}"
            );
        }
    }

    fn plan(body: serde_json::Value) -> CreatePlan {
        let policy = Policy {
            max_timeout_secs: 86_400,
            host_paths: HostPathCheck::OnNode,
        };
        plan_create(serde_json::from_value(body).unwrap(), &policy, Utc::now()).unwrap()
    }

    #[test]
    fn create_passes_everything() {
        let p = plan(json!({
            "image": {"uri": "busybox"},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 600,
            "env": {"A": "1", "GONE": null},
            "metadata": {"team": "a"},
            "resourceLimits": {"cpu": "500m", "memory": "64Mi", "pids": "256"},
            "resourceRequests": {"cpu": "250m"},
            "volumes": [
                {"name": "w", "host": {"path": "/srv/data"}, "subPath": "t1", "mountPath": "/mnt/w", "readOnly": true},
                {"name": "p", "pvc": {"claimName": "claim-a"}, "mountPath": "/data"}
            ],
            "extensions": {"poolRef": "gpu", "consistency_mode": "strong", "failurePolicy": "auto_recreate"}
        }));
        let q = create_request(&p, "team-ns").unwrap();
        assert_eq!(q.request_id, p.id);
        assert_eq!(q.name, p.id);
        assert_eq!(q.namespace, "team-ns");
        assert!(q.wait_ready);
        assert_eq!(q.consistency, pb::Consistency::Strong as i32);
        let spec = q.spec.unwrap();
        assert_eq!(spec.image, "busybox");
        assert_eq!(spec.command, ["sleep", "infinity"]);
        assert!(spec.args.is_empty());
        assert_eq!(spec.env, [("A".to_string(), "1".to_string())].into());
        assert_eq!(
            spec.metadata,
            [("team".to_string(), "a".to_string())].into()
        );
        // Never earlier than asked: whole seconds, rounded up.
        assert_eq!(
            spec.expires_at_unix_seconds,
            ceil_to_second(p.expires_at.unwrap())
        );
        assert_eq!(spec.pool, "gpu");
        assert_eq!(spec.failure_policy, pb::FailurePolicy::AutoRecreate as i32);
        let res = spec.resources.unwrap();
        assert_eq!(
            res.limits.unwrap(),
            pb::ResourceList {
                cpu: "500m".into(),
                memory: "64Mi".into(),
                pids: 256,
                ephemeral_storage: String::new(),
            }
        );
        assert_eq!(res.requests.unwrap().cpu, "250m");
        assert_eq!(
            spec.volumes,
            vec![
                pb::Volume {
                    name: "w".into(),
                    source: Some(pb::volume::Source::Host(pb::HostPathSource {
                        path: "/srv/data".into()
                    })),
                    mount_path: "/mnt/w".into(),
                    read_only: true,
                    sub_path: "t1".into(),
                },
                pb::Volume {
                    name: "p".into(),
                    source: Some(pb::volume::Source::Pvc(pb::PvcSource {
                        claim_name: "claim-a".into(),
                        // OpenSandbox's default.
                        create_if_missing: true,
                        ..Default::default()
                    })),
                    mount_path: "/data".into(),
                    read_only: false,
                    sub_path: String::new(),
                },
            ]
        );
    }

    #[test]
    fn pvc_hints_reach_the_controller_or_are_refused_by_name() {
        let pvc = |extra: serde_json::Value| {
            let mut p = json!({"claimName": "vol-a"});
            p.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            plan(json!({
                "image": {"uri": "busybox"}, "entrypoint": ["sh"],
                "volumes": [{"name": "data", "pvc": p, "mountPath": "/data"}]
            }))
        };
        let p = pvc(json!({
            "createIfNotExists": false, "deleteOnSandboxTermination": true,
            "storage": "1Gi", "storageClass": "local", "accessModes": ["RWX"]
        }));
        let spec = create_request(&p, "default").unwrap().spec.unwrap();
        assert_eq!(
            spec.volumes[0].source,
            Some(pb::volume::Source::Pvc(pb::PvcSource {
                claim_name: "vol-a".into(),
                create_if_missing: false,
                access_mode: pb::AccessMode::ReadWriteMany as i32,
                size: "1Gi".into(),
                backend: "local".into(),
                delete_on_sandbox_delete: true,
                created_by_sandbox: false,
            }))
        );
        for (extra, words) in [
            (
                json!({"storageClass": "gp3"}),
                vec!["volume 'data': pvc.storageClass 'gp3'", "local"],
            ),
            (
                json!({"accessModes": ["ReadWriteOnce", "ReadOnlyMany"]}),
                vec!["volume 'data': pvc.accessModes lists 2 modes"],
            ),
            (
                json!({"accessModes": ["ReadWriteOncePod"]}),
                vec!["volume 'data': pvc.accessModes[0] 'ReadWriteOncePod'"],
            ),
        ] {
            let e = create_request(&pvc(extra.clone()), "default").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
            for w in words {
                assert!(e.message.contains(w), "{extra}: {}", e.message);
            }
        }
    }

    #[test]
    fn create_leaves_unset_what_the_request_left_unset() {
        let p =
            plan(json!({"image": {"uri": "busybox"}, "entrypoint": ["sh"], "resourceLimits": {}}));
        let q = create_request(&p, "default").unwrap();
        let spec = q.spec.unwrap();
        // Unset: the pool's defaults apply on the controller.
        assert_eq!(spec.resources, None);
        assert_eq!(spec.expires_at_unix_seconds, 0);
        assert_eq!(spec.pool, "");
        assert_eq!(spec.failure_policy, pb::FailurePolicy::Unspecified as i32);
        assert_eq!(q.consistency, pb::Consistency::Unspecified as i32);
    }

    #[test]
    fn statuses_map_to_http() {
        let e = map_status(
            Call::OnSandbox,
            "x",
            tonic::Status::unauthenticated("bad bearer token"),
        );
        assert_eq!(e.status, StatusCode::BAD_GATEWAY);
        assert!(e.message.contains("controller token"), "{}", e.message);
        let e = map_status(
            Call::OnSandbox,
            "x",
            tonic::Status::invalid_argument(
                "spec.resources.limits.memory: 64Ti is above the pool maximum 8Gi",
            ),
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("spec.resources.limits.memory"),
            "{}",
            e.message
        );
        for (status, want) in [
            (tonic::Status::not_found("x"), StatusCode::NOT_FOUND),
            (
                tonic::Status::resource_exhausted("full"),
                StatusCode::TOO_MANY_REQUESTS,
            ),
            (
                tonic::Status::failed_precondition("paused"),
                StatusCode::CONFLICT,
            ),
            (tonic::Status::aborted("generation"), StatusCode::CONFLICT),
            (tonic::Status::already_exists("taken"), StatusCode::CONFLICT),
            (
                tonic::Status::unavailable("down"),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (
                tonic::Status::permission_denied("no"),
                StatusCode::BAD_GATEWAY,
            ),
            (
                tonic::Status::internal("boom"),
                StatusCode::INTERNAL_SERVER_ERROR,
            ),
        ] {
            assert_eq!(
                map_status(Call::OnSandbox, "x", status.clone()).status,
                want,
                "{status:?}"
            );
        }
    }

    #[test]
    fn exhausted_is_429_with_a_short_retry_after() {
        // No agent with room, or a warm pool at its poolMax: both free up as
        // soon as any sandbox goes.
        for call in [Call::Create, Call::OnSandbox] {
            let e = map_status(
                call,
                "x",
                tonic::Status::resource_exhausted("warm pool py is full: 4 of poolMax 4"),
            );
            assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(e.retry_after_secs, Some(1));
            assert!(e.message.contains("warm pool py is full"), "{}", e.message);
        }
    }

    #[test]
    fn create_sends_the_policy_normalized() {
        let p = plan(json!({
            "image": {"uri": "busybox"}, "entrypoint": ["sh"],
            "networkPolicy": {"defaultAction": "DENY", "egress": [{"action": "Allow", "target": "PyPI.org."}]}
        }));
        let spec = create_request(&p, "default").unwrap().spec.unwrap();
        assert_eq!(
            spec.network_policy_json,
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"pypi.org"}]}"#
        );
        let p = plan(json!({"image": {"uri": "busybox"}, "entrypoint": ["sh"]}));
        let spec = create_request(&p, "default").unwrap().spec.unwrap();
        assert_eq!(spec.network_policy_json, "");
    }

    fn record(generation: i64, policy_json: &str) -> pb::Sandbox {
        let mut s = sandbox(pb::Phase::Running);
        s.generation = generation;
        s.spec.as_mut().unwrap().network_policy_json = policy_json.into();
        s
    }

    /// A controller stand-in: every read answers the next generation with
    /// a policy another writer changed; writes answer from `outcomes`.
    async fn run_change(
        change: PolicyChange,
        outcomes: Vec<Result<(), tonic::Status>>,
    ) -> (ApiResult<pb::Sandbox>, Vec<(Precondition, String)>) {
        let reads = std::sync::atomic::AtomicI64::new(0);
        let writes = std::sync::Mutex::new(Vec::new());
        let outcomes = std::sync::Mutex::new(outcomes.into_iter());
        let result = change_with_retry(
            "sbx-1",
            &change,
            || {
                let n = reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                let target = format!("r{n}.test");
                async move {
                    Ok(record(
                        n,
                        &format!(r#"{{"defaultAction":"deny","egress":[{{"action":"allow","target":"{target}"}}]}}"#),
                    ))
                }
            },
            |pre, json| {
                writes.lock().unwrap().push((pre, json.clone()));
                let outcome = outcomes.lock().unwrap().next().expect("a planned outcome");
                async move { outcome.map(|()| record(99, &json)) }
            },
        )
        .await;
        (result, writes.into_inner().unwrap())
    }

    #[tokio::test]
    async fn a_policy_change_lost_to_a_concurrent_writer_is_computed_again() {
        let patch = PolicyChange::Patch(vec![sandbolt_proto::egress::NetworkRule {
            action: sandbolt_proto::egress::Action::Allow,
            target: "new.test".into(),
        }]);
        let (result, writes) = run_change(
            patch.clone(),
            vec![
                Err(tonic::Status::aborted(
                    "sandbox default/sbx-1 is at generation 2, not 1",
                )),
                Ok(()),
            ],
        )
        .await;
        let committed = result.unwrap();
        assert_eq!(writes.len(), 2);
        // Each write names the record it was computed from ...
        assert_eq!(
            writes[0].0,
            Precondition {
                uid: "u-1".into(),
                generation: 1
            }
        );
        assert_eq!(
            writes[1].0,
            Precondition {
                uid: "u-1".into(),
                generation: 2
            }
        );
        // ... and the retry merged into the fresh read, not the stale one.
        assert!(
            writes[1].1.contains("r2.test") && !writes[1].1.contains("r1.test"),
            "{}",
            writes[1].1
        );
        assert!(writes[1].1.contains("new.test"), "{}", writes[1].1);
        assert_eq!(stored_policy(&committed).unwrap().egress.len(), 2);

        // A record that never stops changing: 409, after a bounded number of tries.
        let aborted = || Err(tonic::Status::aborted("generation"));
        let (result, writes) = run_change(
            patch.clone(),
            (0..POLICY_WRITE_ATTEMPTS).map(|_| aborted()).collect(),
        )
        .await;
        assert_eq!(result.unwrap_err().status, StatusCode::CONFLICT);
        assert_eq!(writes.len(), POLICY_WRITE_ATTEMPTS as usize);

        // Other answers are not retried, and keep the controller's words.
        for (status, want) in [
            (
                tonic::Status::unavailable("agent agent-1 unreachable"),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (
                tonic::Status::failed_precondition("sandbox is paused"),
                StatusCode::CONFLICT,
            ),
            (tonic::Status::not_found("gone"), StatusCode::NOT_FOUND),
            (
                tonic::Status::invalid_argument("network_policy_json.egress[0]"),
                StatusCode::BAD_REQUEST,
            ),
        ] {
            let (result, writes) = run_change(patch.clone(), vec![Err(status.clone())]).await;
            let e = result.unwrap_err();
            assert_eq!((e.status, writes.len()), (want, 1), "{status:?}");
            if want == StatusCode::SERVICE_UNAVAILABLE {
                assert!(
                    e.message.contains("agent agent-1 unreachable"),
                    "{}",
                    e.message
                );
                assert!(
                    !e.message.contains("controller unavailable"),
                    "{}",
                    e.message
                );
            }
        }
        // A bad change never reaches the controller.
        let bad = PolicyChange::Patch(vec![sandbolt_proto::egress::NetworkRule {
            action: sandbolt_proto::egress::Action::Allow,
            target: "bad name".into(),
        }]);
        let (result, writes) = run_change(bad, vec![]).await;
        assert_eq!(result.unwrap_err().status, StatusCode::BAD_REQUEST);
        assert!(writes.is_empty());
    }

    #[test]
    fn expiry_rounds_up_to_whole_seconds() {
        let t = DateTime::from_timestamp(100, 0).unwrap();
        assert_eq!(ceil_to_second(t), 100);
        assert_eq!(ceil_to_second(t + chrono::Duration::milliseconds(1)), 101);
    }

    #[test]
    fn ids_the_controller_cannot_hold_are_404() {
        assert!(check_id("4f1c2d9e-aaaa-bbbb-cccc-0123456789ab").is_ok());
        for bad in ["", ".x", "-x", "a/b", "x y", &"a".repeat(254)] {
            assert_eq!(check_id(bad).unwrap_err().status, 404, "{bad:?}");
        }
    }

    #[test]
    fn endpoint_split() {
        assert_eq!(
            split_endpoint("127.0.0.1:8081/sandboxes/x/44772"),
            ("127.0.0.1:8081".into(), "/sandboxes/x/44772".into())
        );
        assert_eq!(split_endpoint("http://h:1"), ("h:1".into(), String::new()));
    }
}
