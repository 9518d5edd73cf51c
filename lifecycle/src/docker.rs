//! Docker backend (bollard). For machines with a Docker engine and no
//! containerd of our own, and for sandbolt running inside a container with
//! only the Docker socket mounted (Station PRD): nothing here touches the
//! engine's filesystem. execd reaches the container through the archive API
//! before start, and the only host paths ever mounted are the user's own
//! validated volumes.
//!
//! State lives on the engine: labels (`opensandbox.io/*`, as the OpenSandbox
//! server writes them, so either server can manage the other's sandboxes)
//! carry id, expiry or manual-cleanup marker, and the create-time facts.
//! Labels cannot change after create, so metadata patches and renewed
//! expiries go to small JSON files in the data dir, which override labels.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use axum::http::StatusCode;
use bollard::Docker;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerSummary, HostConfig, Mount, MountType,
    PortBinding,
};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions, UploadToContainerOptions,
};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use sandbolt_proto::wire::{EXECD_PORT, EXECD_TOKEN_HEADER};
use serde::{Deserialize, Serialize};

use sandbolt_proto::egress::NetworkPolicy;

use crate::backend::{Backend, Route, paused_sandbox};
use crate::docker_network;
use crate::docker_snapshots::{LABEL_IMAGE, LABEL_RESTORED_FROM, Restore};
use crate::egress::{ENFORCEMENT_NONE, PolicyChange, PolicyStatus};
use crate::error::{ApiError, ApiResult, StartError};
use crate::model::{SandboxRecord, State};
use crate::snapshots::{SandboxSnapshot, SnapshotFilter};
use crate::validate::{CreatePlan, Extensions, FailurePolicy};
use crate::volumes::{VolumeMount, VolumeSource, unsupported};

/// Where execd lands inside every sandbox.
pub const EXECD_PATH: &str = "/opt/sandbolt/execd";

pub const LABEL_ID: &str = "opensandbox.io/id";
pub const LABEL_EXPIRES_AT: &str = "opensandbox.io/expires-at";
pub const LABEL_MANUAL_CLEANUP: &str = "opensandbox.io/manual-cleanup";
/// sandbolt's own facts. Under the reserved prefix on purpose: the
/// OpenSandbox server then treats them as system labels, not user metadata.
pub const LABEL_TOKEN: &str = "opensandbox.io/sandbolt-execd-token";
pub const LABEL_ENTRYPOINT: &str = "opensandbox.io/sandbolt-entrypoint";
pub const LABEL_CREATED_AT: &str = "opensandbox.io/sandbolt-created-at";

/// Label prefixes that are not user metadata (same rule as OpenSandbox).
const SYSTEM_LABEL_PREFIXES: &[&str] = &[
    "opensandbox.io/",
    "org.opencontainers.image.",
    "com.docker.",
    "desktop.docker.",
];

/// Docker backend settings.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// Docker engine socket (`unix://` prefix optional).
    pub socket: PathBuf,
    /// The static execd binary copied into every sandbox.
    pub execd_binary: PathBuf,
    /// Host address published ports bind to.
    pub publish_host_ip: String,
    /// Host name written into endpoint strings (what clients dial).
    pub endpoint_host: String,
    /// Process limit of a sandbox whose request names none (the agent's
    /// default on the containerd path, so both paths bound fork bombs alike).
    pub pids_limit: i64,
    /// Isolate sandboxes as the fast path does (own bridge network and
    /// nftables rules; needs root and `nft` in the engine's network
    /// namespace). Off: Docker's networking as is.
    pub isolation: bool,
    /// IPv4 subnet of the sandbox network when it is created (CIDR);
    /// `None` lets Docker pick.
    pub network_subnet: Option<String>,
    /// Resolvers the egress DNS proxy forwards allowed names to (with
    /// isolation on); empty: the host's, from `/etc/resolv.conf`.
    pub dns_upstreams: Vec<std::net::SocketAddr>,
}

impl DockerConfig {
    pub fn new(socket: impl Into<PathBuf>, execd_binary: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            execd_binary: execd_binary.into(),
            publish_host_ip: "127.0.0.1".into(),
            endpoint_host: "127.0.0.1".into(),
            pids_limit: 4096,
            isolation: true,
            network_subnet: None,
            dns_upstreams: Vec::new(),
        }
    }
}

#[derive(Clone)]
struct Reach {
    host_port: u16,
    token: Option<String>,
    /// Frozen by the engine: connections are accepted and never answered.
    paused: bool,
}

pub struct DockerBackend {
    pub(crate) docker: Docker,
    config: DockerConfig,
    /// execd packed as a tar once at start; uploaded into each sandbox.
    execd_tar: Bytes,
    pub(crate) data_dir: PathBuf,
    /// Derives each sandbox's execd token (none is stored; see
    /// [`crate::docker_token`]).
    token_key: crate::docker_token::TokenKey,
    /// Held from the host-binding check of a create until its container
    /// exists, so two creates never both pass the check against a world
    /// without the other (see [`crate::docker_volumes::check_bindings`]).
    binds_lock: tokio::sync::Mutex<()>,
    /// Endpoint facts cached from create so the SDK's endpoint lookups right
    /// after create need no engine round trip.
    reach: Mutex<HashMap<String, Reach>>,
    /// The isolated sandbox network, when isolation is on.
    network_mode: Option<String>,
    /// Egress policy enforcement (with isolation on).
    egress: Option<crate::docker_egress::DockerEgress>,
    /// Held by a snapshot delete, and by a restore from its check of the
    /// snapshot until its container exists, so a deletion never removes an
    /// image a container is being created from (see
    /// [`crate::docker_snapshots`]).
    pub(crate) snapshot_lock: tokio::sync::Mutex<()>,
}

#[derive(Serialize, Deserialize)]
struct ExpiryFile {
    expires_at: String,
}

/// Containers on the engine's network get no egress filtering from
/// sandbolt: a policy that restricts anything would be accepted and ignored.
fn refuse_restricting_policy(policy: &NetworkPolicy) -> ApiResult<()> {
    if crate::egress::normalized(policy.clone()).is_allow_all() {
        return Ok(());
    }
    Err(ApiError::invalid_code(
        "UNSUPPORTED_FIELD",
        "networkPolicy: the docker runtime does not enforce egress policy for this sandbox \
         (only allow-all): isolation is off (--docker-isolation off), or the sandbox predates \
         enforcement; omit networkPolicy, turn isolation on, or use the controller backend",
    ))
}

pub(crate) fn container_name(id: &str) -> String {
    format!("sandbox-{id}")
}

/// Ids reach Docker as container names; refuse anything else early so a
/// path segment can never address an unrelated container.
fn check_id(id: &str) -> ApiResult<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_');
    if ok {
        Ok(())
    } else {
        Err(ApiError::not_found(id))
    }
}

/// What the backend asked the engine, where a failure means something
/// particular to the call.
#[derive(Debug, Clone, Copy)]
enum DockerCall<'a> {
    /// Creating the container of a sandbox from `image`.
    Create {
        image: &'a str,
    },
    /// Copying execd into the created container.
    CopyExecd,
    Start,
    /// Every call on an existing sandbox, and the list.
    OnSandbox,
}

/// Maps an engine error to the REST error: the one place where bollard's
/// errors are translated.
fn map_docker_err(call: DockerCall<'_>, id: &str, e: bollard::errors::Error) -> ApiError {
    use bollard::errors::Error as E;
    match (call, e) {
        (
            DockerCall::Create { image },
            E::DockerResponseServerError {
                status_code: 404,
                message,
            },
        ) => ApiError::invalid_code(
            "DOCKER::SANDBOX_IMAGE_NOT_FOUND",
            format!("image {image} is not available: {message}"),
        ),
        (
            DockerCall::Create { .. },
            E::DockerResponseServerError {
                status_code: 400,
                message,
            },
        ) => ApiError::invalid(format!("docker rejected the sandbox: {message}")),
        (DockerCall::CopyExecd, e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "DOCKER::SANDBOX_EXECD_DISTRIBUTION_FAILED",
            format!("copying execd into the sandbox failed: {e}"),
        ),
        (DockerCall::Start, e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "DOCKER::SANDBOX_START_FAILED",
            format!("starting the sandbox failed: {e}"),
        ),
        (_, e) => map_engine_answer(id, e),
    }
}

pub(crate) fn map_engine_answer(id: &str, e: bollard::errors::Error) -> ApiError {
    use bollard::errors::Error as E;
    match e {
        E::DockerResponseServerError {
            status_code: 404, ..
        } => ApiError::not_found(id),
        E::DockerResponseServerError {
            status_code: 409,
            message,
        } => ApiError::conflict("DOCKER::CONFLICT", message),
        E::DockerResponseServerError {
            status_code,
            message,
        } => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "DOCKER::ENGINE_ERROR",
            format!("docker engine answered {status_code}: {message}"),
        ),
        other => ApiError::unavailable(format!("docker engine unreachable: {other}")),
    }
}

fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

fn state_of(status: &str, exit_code: Option<i64>) -> (State, Option<String>, Option<String>) {
    match status {
        "running" => (State::Running, None, None),
        "paused" => (State::Paused, None, None),
        "created" | "restarting" => (State::Pending, None, None),
        "removing" | "stopping" => (State::Stopping, None, None),
        "exited" | "dead" => match exit_code {
            Some(0) | None => (
                State::Terminated,
                Some("ContainerExited".into()),
                Some("the sandbox's entry process exited".into()),
            ),
            Some(code) => (
                State::Failed,
                Some("ContainerExited".into()),
                Some(format!(
                    "the sandbox's entry process exited with code {code}"
                )),
            ),
        },
        _ => (State::Pending, None, None),
    }
}

/// Millicores → Docker's `NanoCpus`.
const NANO_PER_MILLI: i64 = 1_000_000;
/// cgroup v1 `cpu.shares` of one CPU (what Kubernetes gives a 1-CPU request).
const SHARES_PER_CPU: i64 = 1024;
/// The kernel's minimum `cpu.shares`.
const MIN_SHARES: i64 = 2;

/// The resource fields of the container's `HostConfig`: the same limits the
/// containerd path applies (agent/src/hardening.rs). Memory holds swap to the
/// same value (`MemorySwap` = `Memory`), or a sandbox at its limit would
/// page out instead of being OOM-killed; CPU is a CFS quota (`NanoCpus`);
/// pids always has a bound; requests become `cpu.shares` and a memory soft
/// limit.
fn limits(plan: &CreatePlan, default_pids: i64) -> ApiResult<HostConfig> {
    // Quantities parse up to u64 millicores; Docker takes i64 nanos.
    let scaled = |field: &str, millis: u64, per: i64| {
        i64::try_from(millis)
            .ok()
            .and_then(|m| m.checked_mul(per))
            .ok_or_else(|| ApiError::invalid(format!("{field} is too large")))
    };
    // Docker bounds a container's writable layer only on some storage
    // drivers (overlay2 needs xfs with pquota); refused, never dropped.
    if plan.limits.ephemeral_storage.is_some() {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            "resourceLimits.ephemeral-storage is not enforced on the Docker backend; leave it unset or use the containerd fast path (sandbolt controller mode)",
        ));
    }
    let memory = plan.limits.memory.as_ref().map(|q| q.value as i64);
    Ok(HostConfig {
        memory,
        memory_swap: memory,
        nano_cpus: plan
            .limits
            .cpu
            .as_ref()
            .map(|q| scaled("resourceLimits.cpu", q.value, NANO_PER_MILLI))
            .transpose()?,
        pids_limit: Some(plan.limits.pids.unwrap_or(default_pids)),
        cpu_shares: plan
            .requests
            .cpu
            .as_ref()
            .map(|q| scaled("resourceRequests.cpu", q.value, SHARES_PER_CPU))
            .transpose()?
            .map(|s| (s / 1000).max(MIN_SHARES)),
        memory_reservation: plan.requests.memory.as_ref().map(|q| q.value as i64),
        ..Default::default()
    })
}

/// Serde enum → its wire string (bollard's state enums).
fn enum_str<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The labels that make a container a sandbox: the user's metadata, then
/// id, expiry (or manual cleanup) and the create-time facts. No token: it
/// is derived from the id (see [`crate::docker_token`]).
fn container_labels(plan: &CreatePlan) -> HashMap<String, String> {
    let mut labels: HashMap<String, String> = plan
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.insert(LABEL_ID.into(), plan.id.clone());
    match plan.expires_at {
        Some(t) => labels.insert(LABEL_EXPIRES_AT.into(), t.to_rfc3339()),
        None => labels.insert(LABEL_MANUAL_CLEANUP.into(), "true".into()),
    };
    labels.insert(
        LABEL_ENTRYPOINT.into(),
        serde_json::to_string(&plan.entrypoint).expect("strings serialize"),
    );
    labels.insert(
        LABEL_CREATED_AT.into(),
        crate::model::rfc3339(plan.created_at),
    );
    labels
}

fn container_env(plan: &CreatePlan, token: &str) -> Vec<String> {
    let mut env: Vec<String> = plan.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.push(format!("OPENSANDBOX_ID={}", plan.id));
    env.push(format!("EXECD_ACCESS_TOKEN={token}"));
    env
}

/// execd is PID 1: it reaps, forwards signals and runs the user's
/// entrypoint as its child; no shell needed in the image.
fn execd_entrypoint(plan: &CreatePlan) -> Vec<String> {
    let mut entrypoint = vec![
        EXECD_PATH.to_string(),
        "--init".into(),
        "--listen".into(),
        format!("0.0.0.0:{EXECD_PORT}"),
        "--".into(),
    ];
    entrypoint.extend(plan.entrypoint.iter().cloned());
    entrypoint
}

/// Packs execd as `opt/sandbolt/execd` (0755, root) for the archive API.
fn pack_execd(binary: &Path) -> Result<Bytes, StartError> {
    let data = std::fs::read(binary)
        .map_err(|e| StartError::Config(format!("execd binary {}: {e}", binary.display())))?;
    let mut b = tar::Builder::new(Vec::new());
    for dir in ["opt/", "opt/sandbolt/"] {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        h.set_cksum();
        b.append_data(&mut h, dir, std::io::empty())
            .map_err(|e| StartError::Config(e.to_string()))?;
    }
    let mut h = tar::Header::new_gnu();
    h.set_mode(0o755);
    h.set_size(data.len() as u64);
    h.set_cksum();
    b.append_data(&mut h, "opt/sandbolt/execd", data.as_slice())
        .map_err(|e| StartError::Config(e.to_string()))?;
    let out = b
        .into_inner()
        .map_err(|e| StartError::Config(e.to_string()))?;
    Ok(Bytes::from(out))
}

/// Reads a JSON file, treating absence as `None`.
pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    let bytes = std::fs::read(path).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable state file");
            None
        }
    }
}

/// Writes via tmp + rename so a crash never leaves a truncated file.
pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> ApiResult<()> {
    let dir = path.parent().expect("state files live in a directory");
    std::fs::create_dir_all(dir)
        .map_err(|e| ApiError::internal(format!("create {}: {e}", dir.display())))?;
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec(value).expect("state serializes");
    std::fs::write(&tmp, bytes)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| ApiError::internal(format!("write {}: {e}", path.display())))
}

impl DockerBackend {
    /// Connects to the engine (negotiating the API version, since the
    /// engine may be older than bollard's default) and packs execd.
    pub async fn connect(config: DockerConfig, data_dir: &Path) -> Result<Self, StartError> {
        let socket = config.socket.to_string_lossy().into_owned();
        let docker = Docker::connect_with_unix(&socket, 120, bollard::API_DEFAULT_VERSION)
            .map_err(|e| StartError::Backend(format!("docker socket {socket}: {e}")))?
            .negotiate_version()
            .await
            .map_err(|e| StartError::Backend(format!("docker engine at {socket}: {e}")))?;
        let execd_tar = pack_execd(&config.execd_binary)?;
        std::fs::create_dir_all(data_dir.join("metadata"))
            .and_then(|_| std::fs::create_dir_all(data_dir.join("expiry")))
            .map_err(|e| StartError::Config(format!("data dir {}: {e}", data_dir.display())))?;
        let token_key = crate::docker_token::TokenKey::load_or_create(data_dir)?;
        // Before any sandbox can start, so there is never a window.
        let (network_mode, egress) = if config.isolation {
            let network =
                docker_network::ensure_isolated(&docker, config.network_subnet.as_deref()).await?;
            let egress = crate::docker_egress::DockerEgress::start(
                &docker,
                &network,
                data_dir,
                &config.dns_upstreams,
            )
            .await?;
            (Some(docker_network::NETWORK_NAME.to_string()), Some(egress))
        } else {
            // Said once, loudly: the fast path isolates sandboxes.
            tracing::warn!(
                socket = %socket,
                "docker runtime with isolation off: sandboxes use Docker's networking \
                 (they can reach each other, this host and link-local/cloud-metadata addresses); \
                 turn isolation on (--docker-isolation on) or use the containerd runtime"
            );
            (None, None)
        };
        let backend = Self {
            docker,
            config,
            execd_tar,
            data_dir: data_dir.to_path_buf(),
            token_key,
            binds_lock: tokio::sync::Mutex::new(()),
            reach: Mutex::new(HashMap::new()),
            network_mode,
            egress,
            snapshot_lock: tokio::sync::Mutex::new(()),
        };
        // Containers removed while we were down may have been the last
        // users of snapshots whose deletion was pending.
        backend.settle_snapshot_deletes().await;
        Ok(backend)
    }

    pub(crate) fn metadata_path(&self, id: &str) -> PathBuf {
        self.data_dir.join("metadata").join(format!("{id}.json"))
    }
    fn expiry_path(&self, id: &str) -> PathBuf {
        self.data_dir.join("expiry").join(format!("{id}.json"))
    }

    fn effective_metadata(
        &self,
        id: &str,
        labels: &HashMap<String, String>,
    ) -> BTreeMap<String, String> {
        if let Some(m) = read_json::<BTreeMap<String, String>>(&self.metadata_path(id)) {
            return m;
        }
        labels
            .iter()
            .filter(|(k, _)| !SYSTEM_LABEL_PREFIXES.iter().any(|p| k.starts_with(p)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn effective_expiry(
        &self,
        id: &str,
        labels: &HashMap<String, String>,
    ) -> Option<DateTime<Utc>> {
        if labels
            .get(LABEL_MANUAL_CLEANUP)
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            return None;
        }
        if let Some(f) = read_json::<ExpiryFile>(&self.expiry_path(id))
            && let Some(t) = parse_time(&f.expires_at)
        {
            return Some(t);
        }
        labels.get(LABEL_EXPIRES_AT).and_then(|s| parse_time(s))
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        id: &str,
        labels: &HashMap<String, String>,
        image: Option<String>,
        status: &str,
        exit_code: Option<i64>,
        docker_created: Option<DateTime<Utc>>,
        fallback_entrypoint: Vec<String>,
    ) -> SandboxRecord {
        let (state, reason, message) = state_of(status, exit_code);
        let entrypoint = labels
            .get(LABEL_ENTRYPOINT)
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(fallback_entrypoint);
        let created_at = labels
            .get(LABEL_CREATED_AT)
            .and_then(|s| parse_time(s))
            .or(docker_created)
            .unwrap_or_else(Utc::now);
        SandboxRecord {
            id: id.to_string(),
            image: labels.get(LABEL_IMAGE).cloned().or(image),
            entrypoint,
            metadata: self.effective_metadata(id, labels),
            state,
            reason,
            message,
            created_at,
            expires_at: self.effective_expiry(id, labels),
            last_transition_at: None,
            allocation: None,
            snapshot_id: labels.get(LABEL_RESTORED_FROM).cloned(),
        }
    }

    pub(crate) async fn inspect(&self, id: &str) -> ApiResult<ContainerInspectResponse> {
        check_id(id)?;
        let c = self
            .docker
            .inspect_container(&container_name(id), None)
            .await
            .map_err(|e| map_docker_err(DockerCall::OnSandbox, id, e))?;
        // A container merely named like ours is not ours.
        let ours = c
            .config
            .as_ref()
            .and_then(|cfg| cfg.labels.as_ref())
            .and_then(|l| l.get(LABEL_ID))
            .is_some_and(|v| v == id);
        if !ours {
            return Err(ApiError::not_found(id));
        }
        Ok(c)
    }

    pub(crate) fn record_from_inspect(
        &self,
        id: &str,
        c: &ContainerInspectResponse,
    ) -> SandboxRecord {
        let cfg = c.config.clone().unwrap_or_default();
        let labels = cfg.labels.clone().unwrap_or_default();
        let st = c.state.clone().unwrap_or_default();
        let status = st.status.as_ref().map(enum_str).unwrap_or_default();
        // Sandboxes created by the OpenSandbox server have no entrypoint label.
        let fallback = cfg.cmd.clone().unwrap_or_default();
        self.record(
            id,
            &labels,
            cfg.image.clone(),
            &status,
            st.exit_code,
            c.created.as_deref().and_then(parse_time),
            fallback,
        )
    }

    fn record_from_summary(&self, s: &ContainerSummary) -> Option<SandboxRecord> {
        let labels = s.labels.clone().unwrap_or_default();
        let id = labels.get(LABEL_ID)?.clone();
        let status = s.state.as_ref().map(enum_str).unwrap_or_default();
        // The summary has no exit code; "Exited (N) ..." carries it.
        let exit_code = s.status.as_deref().and_then(|st| {
            let rest = st.strip_prefix("Exited (")?;
            rest.split(')').next()?.parse().ok()
        });
        let created = s
            .created
            .and_then(|secs| DateTime::<Utc>::from_timestamp(secs, 0));
        Some(self.record(
            &id,
            &labels,
            s.image.clone(),
            &status,
            exit_code,
            created,
            Vec::new(),
        ))
    }

    fn reach_from_inspect(&self, c: &ContainerInspectResponse) -> Option<Reach> {
        let key = format!("{EXECD_PORT}/tcp");
        let host_port = c
            .network_settings
            .as_ref()?
            .ports
            .as_ref()?
            .get(&key)?
            .as_ref()?
            .iter()
            .find_map(|b| b.host_port.as_deref()?.parse().ok())?;
        // Derived from the sandbox id; a container of an older sandbolt
        // carries its random token in a label instead.
        let labels = c.config.as_ref().and_then(|cfg| cfg.labels.as_ref());
        let token = labels.and_then(|l| {
            l.get(LABEL_TOKEN)
                .cloned()
                .or_else(|| l.get(LABEL_ID).map(|id| self.token_key.token(id)))
        });
        let paused = c.state.as_ref().and_then(|s| s.paused).unwrap_or(false);
        Some(Reach {
            host_port,
            token,
            paused,
        })
    }

    /// The sandbox's `HostConfig`: execd's port published on a port the
    /// engine picks, hardening, the user's volumes and the resource limits.
    fn host_config(&self, plan: &CreatePlan) -> ApiResult<HostConfig> {
        Ok(HostConfig {
            port_bindings: Some(HashMap::from([(
                format!("{EXECD_PORT}/tcp"),
                Some(vec![PortBinding {
                    host_ip: Some(self.config.publish_host_ip.clone()),
                    // Empty = the engine picks a free port (no races with us).
                    host_port: Some(String::new()),
                }]),
            )])),
            security_opt: Some(vec!["no-new-privileges:true".into()]),
            // Docker's default capability set minus the ones a sandbox has no
            // business with (raw sockets, device nodes, audit).
            cap_drop: Some(vec!["NET_RAW".into(), "MKNOD".into(), "AUDIT_WRITE".into()]),
            privileged: Some(false),
            mounts: Some({
                let mut mounts = self.mounts(&plan.volumes)?;
                mounts.extend(
                    self.egress
                        .as_ref()
                        .map(crate::docker_egress::DockerEgress::resolv_conf_mount),
                );
                mounts
            }),
            init: Some(false),
            network_mode: self.network_mode.clone(),
            ..limits(plan, self.config.pids_limit)?
        })
    }

    fn mounts(&self, volumes: &[VolumeMount]) -> ApiResult<Vec<Mount>> {
        volumes
            .iter()
            .map(|v| {
                self.check_volume(v)?;
                let (typ, source) = match &v.source {
                    VolumeSource::Host { path } => {
                        (MountType::BIND, path.to_string_lossy().into_owned())
                    }
                    VolumeSource::Pvc(claim) => (MountType::VOLUME, claim.claim_name.clone()),
                    other => return Err(unsupported(other.kind(), self.runtime_name())),
                };
                Ok(Mount {
                    target: Some(v.mount_path.clone()),
                    source: Some(source),
                    typ: Some(typ),
                    read_only: Some(v.read_only),
                    ..Default::default()
                })
            })
            .collect()
    }

    /// The container of a sandbox, created (not started). `delete_volumes`
    /// are the Docker volumes to remove at its delete.
    async fn create_stopped(
        &self,
        plan: &CreatePlan,
        token: &str,
        delete_volumes: &[String],
        restore: Option<&Restore>,
    ) -> ApiResult<()> {
        let name = container_name(&plan.id);
        let mut labels = container_labels(plan);
        if !delete_volumes.is_empty() {
            labels.insert(
                crate::docker_volumes::LABEL_DELETE_VOLUMES.into(),
                serde_json::to_string(delete_volumes).expect("strings serialize"),
            );
        }
        if let Some(r) = restore {
            r.container_labels(&mut labels);
        }
        // The address and its egress chain exist before the container does.
        let networking_config = match &self.egress {
            Some(e) => {
                let policy = crate::egress::normalized(plan.network_policy.clone());
                let ip = e.reserve(&self.docker, &plan.id, &policy).await?;
                Some(crate::docker_egress::DockerEgress::networking_config(ip))
            }
            None => None,
        };
        let body = ContainerCreateBody {
            image: Some(plan.image.clone()),
            entrypoint: Some(execd_entrypoint(plan)),
            cmd: Some(Vec::new()),
            env: Some(container_env(plan, token)),
            labels: Some(labels),
            exposed_ports: Some(vec![format!("{EXECD_PORT}/tcp")]),
            host_config: Some(self.host_config(plan)?),
            networking_config,
            ..Default::default()
        };
        let opts = CreateContainerOptions {
            name: Some(name.clone()),
            ..Default::default()
        };
        let create = DockerCall::Create { image: &plan.image };
        self.docker
            .create_container(Some(opts), body)
            .await
            .map_err(|e| map_docker_err(create, &plan.id, e))?;
        Ok(())
    }

    /// The container of a sandbox, created, given execd and started; how to
    /// reach its execd. Host bindings are checked against every other
    /// sandbox's under a lock held until the container (and so its
    /// bindings) exists.
    async fn create_container(
        &self,
        plan: &CreatePlan,
        token: &str,
        pvcs: &crate::docker_volumes::PreparedPvcs,
        restore: Option<&Restore>,
    ) -> ApiResult<Reach> {
        let binds = crate::docker_volumes::host_bindings(plan);
        {
            let _held = if binds.is_empty() {
                None
            } else {
                let held = self.binds_lock.lock().await;
                let existing = self.existing_bindings().await?;
                crate::docker_volumes::check_bindings(&binds, &existing)?;
                Some(held)
            };
            self.create_stopped(plan, token, &pvcs.delete_on_delete, restore)
                .await?;
        }
        self.start_created(plan).await
    }

    /// The created container of a sandbox, given execd and started; how to
    /// reach its execd.
    async fn start_created(&self, plan: &CreatePlan) -> ApiResult<Reach> {
        let name = container_name(&plan.id);
        // Copy execd in before start: no bind mount, so this works even when
        // the engine cannot see our filesystem.
        let upload = UploadToContainerOptions {
            path: "/".into(),
            ..Default::default()
        };
        self.docker
            .upload_to_container(
                &name,
                Some(upload),
                bollard::body_full(self.execd_tar.clone()),
            )
            .await
            .map_err(|e| map_docker_err(DockerCall::CopyExecd, &plan.id, e))?;
        self.docker
            .start_container(&name, None)
            .await
            .map_err(|e| map_docker_err(DockerCall::Start, &plan.id, e))?;
        let c = self.inspect(&plan.id).await?;
        self.reach_from_inspect(&c)
            .ok_or_else(|| ApiError::internal("the engine published no host port for execd"))
    }

    async fn reach(&self, id: &str) -> ApiResult<Reach> {
        if let Some(r) = self.reach.lock().expect("reach lock").get(id).cloned() {
            return Ok(r);
        }
        let c = self.inspect(id).await?;
        let r = self.reach_from_inspect(&c).ok_or_else(|| {
            ApiError::conflict(
                "DOCKER::SANDBOX_NOT_RUNNING",
                format!("Sandbox {id} has no published execd port (is it running?)"),
            )
        })?;
        self.reach
            .lock()
            .expect("reach lock")
            .insert(id.to_string(), r.clone());
        Ok(r)
    }

    /// Records a pause or resume done through this server in the cache.
    fn set_paused(&self, id: &str, paused: bool) {
        if let Some(r) = self.reach.lock().expect("reach lock").get_mut(id) {
            r.paused = paused;
        }
    }

    /// Pause and resume check the state first: the engine would answer a
    /// repeated one with a bare 500.
    async fn require_state(
        &self,
        id: &str,
        want: State,
        code: &'static str,
        verb: &str,
    ) -> ApiResult<()> {
        let rec = self.get(id).await?;
        if rec.state != want {
            return Err(ApiError::conflict(
                code,
                format!(
                    "Sandbox {id} is {} and cannot be {verb}.",
                    rec.state.as_str()
                ),
            ));
        }
        Ok(())
    }

    fn forget(&self, id: &str) {
        self.reach.lock().expect("reach lock").remove(id);
        if let Some(e) = &self.egress {
            e.release(id);
        }
        for p in [self.metadata_path(id), self.expiry_path(id)] {
            if let Err(e) = std::fs::remove_file(&p)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove state file");
            }
        }
    }
}

impl Backend for DockerBackend {
    fn runtime_name(&self) -> &'static str {
        "docker"
    }

    fn check_volume(&self, v: &VolumeMount) -> ApiResult<()> {
        match &v.source {
            VolumeSource::Host { .. } => Ok(()),
            // Docker 20.10 (API 1.41) has no volume subpath option.
            VolumeSource::Pvc { .. } if v.sub_path.is_some() => {
                Err(unsupported("pvc with subPath", self.runtime_name()))
            }
            VolumeSource::Pvc { .. } => Ok(()),
            other => Err(unsupported(other.kind(), self.runtime_name())),
        }
    }

    fn check_extensions(&self, ext: &Extensions) -> ApiResult<()> {
        // One engine, no pools and nowhere to recreate a sandbox: saying yes
        // would be accepting and ignoring. Either consistency holds trivially
        // (the container and its labels are the record, created at once).
        if let Some(pool) = &ext.pool {
            return Err(ApiError::invalid_code(
                "UNSUPPORTED_FIELD",
                format!(
                    "extensions.poolRef '{pool}' is not supported by the docker runtime (it has no pools)"
                ),
            ));
        }
        if ext.failure_policy == Some(FailurePolicy::AutoRecreate) {
            return Err(ApiError::invalid_code(
                "UNSUPPORTED_FIELD",
                "extensions.failurePolicy auto_recreate is not supported by the docker runtime (one engine: nowhere to recreate)",
            ));
        }
        // The engine keeps a container's env in its configuration, in the
        // clear for anyone who can inspect it: nothing to seal it in.
        if !ext.secret_env.is_empty() {
            return Err(ApiError::invalid_code(
                "UNSUPPORTED_FIELD",
                "extensions.secretEnv is not supported by the docker runtime (the engine keeps env in the container's configuration)",
            ));
        }
        Ok(())
    }

    fn check_network_policy(&self, policy: &NetworkPolicy) -> ApiResult<()> {
        if self.egress.is_some() {
            return Ok(());
        }
        refuse_restricting_policy(policy)
    }

    async fn readiness(&self) -> Result<(), String> {
        let ping = tokio::time::timeout(crate::backend::READINESS_TIMEOUT, self.docker.ping());
        match ping.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("docker engine does not answer /_ping: {e}")),
            Err(_) => Err(format!(
                "docker engine did not answer /_ping within {:?}",
                crate::backend::READINESS_TIMEOUT
            )),
        }
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "network_policy", sandbox_id = %id))]
    async fn network_policy(&self, id: &str) -> ApiResult<PolicyStatus> {
        self.inspect(id).await?;
        if let Some(policy) = self.egress.as_ref().and_then(|e| e.policy(id)) {
            return Ok(PolicyStatus {
                policy,
                enforcement_mode: crate::egress::ENFORCEMENT_DNS_NFT,
            });
        }
        Ok(PolicyStatus {
            policy: NetworkPolicy::default(),
            enforcement_mode: ENFORCEMENT_NONE,
        })
    }

    /// Only a change that leaves the sandbox allowing everything holds: it
    /// is the truth on this runtime.
    #[tracing::instrument(name = "docker", skip_all, fields(call = "change_network_policy", sandbox_id = %id))]
    async fn change_network_policy(
        &self,
        id: &str,
        change: PolicyChange,
    ) -> ApiResult<PolicyStatus> {
        self.inspect(id).await?;
        if let Some(egress) = &self.egress
            && let Some(current) = egress.policy(id)
        {
            let policy = change.apply(&current)?;
            if egress.replace(id, policy.clone()).await?.is_some() {
                return Ok(PolicyStatus {
                    policy,
                    enforcement_mode: crate::egress::ENFORCEMENT_DNS_NFT,
                });
            }
        }
        let policy = change.apply(&NetworkPolicy::default())?;
        refuse_restricting_policy(&policy)?;
        Ok(PolicyStatus {
            policy,
            enforcement_mode: ENFORCEMENT_NONE,
        })
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "create", sandbox_id = %plan.id, snapshot_id = plan.snapshot_id.as_deref()))]
    async fn create(&self, mut plan: CreatePlan) -> ApiResult<SandboxRecord> {
        let token = self.token_key.token(&plan.id);
        let _restoring = match plan.snapshot_id {
            Some(_) => Some(self.snapshot_lock.lock().await),
            None => None,
        };
        let restore = self.prepare_restore(&mut plan).await?;
        let pvcs = match self.prepare_pvcs(&plan).await {
            Ok(p) => p,
            Err(e) => {
                self.forget(&plan.id);
                return Err(e);
            }
        };
        match self
            .create_container(&plan, &token, &pvcs, restore.as_ref())
            .await
        {
            Ok(reach) => {
                self.reach
                    .lock()
                    .expect("reach lock")
                    .insert(plan.id.clone(), reach);
                tracing::info!(id = %plan.id, image = %plan.image, "sandbox created");
                Ok(SandboxRecord {
                    id: plan.id,
                    image: Some(match &restore {
                        Some(r) => r.source_image.clone(),
                        None => plan.image,
                    }),
                    snapshot_id: restore.map(|r| r.snapshot_id),
                    entrypoint: plan.entrypoint,
                    metadata: plan.metadata,
                    state: State::Running,
                    reason: None,
                    message: None,
                    created_at: plan.created_at,
                    expires_at: plan.expires_at,
                    last_transition_at: None,
                    allocation: None,
                })
            }
            Err(e) => {
                // Leave nothing half-made behind.
                let _ = self
                    .docker
                    .remove_container(
                        &container_name(&plan.id),
                        Some(RemoveContainerOptions {
                            force: true,
                            v: true,
                            ..Default::default()
                        }),
                    )
                    .await;
                self.remove_volumes(&pvcs.created).await;
                self.forget(&plan.id);
                Err(e)
            }
        }
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "get", sandbox_id = %id))]
    async fn get(&self, id: &str) -> ApiResult<SandboxRecord> {
        let c = self.inspect(id).await?;
        Ok(self.record_from_inspect(id, &c))
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "list"))]
    async fn list(&self) -> ApiResult<Vec<SandboxRecord>> {
        let opts = ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([(
                "label".to_string(),
                vec![LABEL_ID.to_string()],
            )])),
            ..Default::default()
        };
        let all = self
            .docker
            .list_containers(Some(opts))
            .await
            .map_err(|e| map_docker_err(DockerCall::OnSandbox, "*", e))?;
        Ok(all
            .iter()
            .filter_map(|s| self.record_from_summary(s))
            .collect())
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "delete", sandbox_id = %id))]
    async fn delete(&self, id: &str) -> ApiResult<()> {
        let c = self.inspect(id).await?;
        let labels = c.config.and_then(|cfg| cfg.labels).unwrap_or_default();
        self.owe_volume_deletes(id, &labels);
        self.docker
            .remove_container(
                &container_name(id),
                Some(RemoveContainerOptions {
                    force: true,
                    // Anonymous volumes only; named (pvc) volumes are the user's.
                    v: true,
                    ..Default::default()
                }),
            )
            .await
            .map_err(|e| map_docker_err(DockerCall::OnSandbox, id, e))?;
        self.forget(id);
        tracing::info!(%id, "sandbox deleted");
        self.settle_volume_deletes().await;
        self.settle_snapshot_deletes().await;
        Ok(())
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "patch_metadata", sandbox_id = %id))]
    async fn patch_metadata(
        &self,
        id: &str,
        patch: BTreeMap<String, Option<String>>,
    ) -> ApiResult<SandboxRecord> {
        let c = self.inspect(id).await?;
        let mut rec = self.record_from_inspect(id, &c);
        for (k, v) in patch {
            match v {
                Some(v) => rec.metadata.insert(k, v),
                None => rec.metadata.remove(&k),
            };
        }
        write_json(&self.metadata_path(id), &rec.metadata)?;
        Ok(rec)
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "pause", sandbox_id = %id))]
    async fn pause(&self, id: &str) -> ApiResult<()> {
        self.require_state(id, State::Running, "DOCKER::SANDBOX_NOT_RUNNING", "paused")
            .await?;
        self.docker
            .pause_container(&container_name(id))
            .await
            .map_err(|e| map_docker_err(DockerCall::OnSandbox, id, e))?;
        self.set_paused(id, true);
        Ok(())
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "resume", sandbox_id = %id))]
    async fn resume(&self, id: &str) -> ApiResult<()> {
        self.require_state(id, State::Paused, "DOCKER::SANDBOX_NOT_PAUSED", "resumed")
            .await?;
        self.docker
            .unpause_container(&container_name(id))
            .await
            .map_err(|e| map_docker_err(DockerCall::OnSandbox, id, e))?;
        self.set_paused(id, false);
        Ok(())
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "set_expiry", sandbox_id = %id))]
    async fn set_expiry(&self, id: &str, at: DateTime<Utc>) -> ApiResult<DateTime<Utc>> {
        write_json(
            &self.expiry_path(id),
            &ExpiryFile {
                expires_at: at.to_rfc3339(),
            },
        )?;
        Ok(at)
    }

    /// Docker named volumes have no snapshots or forks, and the engine
    /// cannot add a mount to a running container: every named-volume route
    /// answers 501 (the trait's default methods). A sandbox's `pvc` is a
    /// Docker named volume all the same (see [`crate::docker_volumes`]).
    fn named_volumes_unsupported(&self) -> bool {
        true
    }

    /// One engine, nothing to keep a buffer of started sandboxes on
    /// between creates: the pool routes answer 501.
    fn pools_unsupported(&self) -> bool {
        true
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
        let result = self.snap_delete(id).await;
        // Snapshots pending deletion whose last container was removed
        // behind this server's back (`docker rm`) go here too.
        self.settle_snapshot_deletes().await;
        result
    }

    async fn diagnostics(
        &self,
        id: &str,
        query: crate::diagnostics::DiagnosticsQuery,
    ) -> ApiResult<crate::diagnostics::Diagnostics> {
        crate::diagnostics::of_docker(self, id, query).await
    }

    async fn proxy_route(&self, id: &str, port: u16) -> ApiResult<Route> {
        check_id(id)?;
        if self.reach(id).await?.paused {
            return Err(paused_sandbox("DOCKER::SANDBOX_PAUSED", id));
        }
        self.route(id, port).await
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "route", sandbox_id = %id, port = port))]
    async fn route(&self, id: &str, port: u16) -> ApiResult<Route> {
        check_id(id)?;
        let reach = self.reach(id).await?;
        let headers = reach
            .token
            .iter()
            .map(|t| (EXECD_TOKEN_HEADER.to_string(), t.clone()))
            .collect();
        // execd is published directly; every other port goes through
        // execd's `/proxy/{port}` so only one host port per sandbox is used.
        let path_prefix = if port == EXECD_PORT {
            String::new()
        } else {
            format!("/proxy/{port}")
        };
        Ok(Route {
            authority: format!("{}:{}", self.config.endpoint_host, reach.host_port),
            path_prefix,
            headers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execd_tar_layout() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("execd");
        std::fs::write(&bin, b"\x7fELF-not-really").unwrap();
        let tar = pack_execd(&bin).unwrap();
        let mut a = tar::Archive::new(tar.as_ref());
        let entries: Vec<(String, u32)> = a
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    e.header().mode().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            entries,
            vec![
                ("opt/".to_string(), 0o755),
                ("opt/sandbolt/".to_string(), 0o755),
                ("opt/sandbolt/execd".to_string(), 0o755)
            ]
        );
    }

    #[test]
    fn only_allow_all_policies_pass_on_docker() {
        for allow_all in [
            "{}",
            r#"{"defaultAction":"allow"}"#,
            r#"{"defaultAction":"allow","egress":[]}"#,
        ] {
            refuse_restricting_policy(&NetworkPolicy::parse(allow_all).unwrap()).unwrap();
        }
        for restricting in [
            r#"{"defaultAction":"deny"}"#,
            r#"{"defaultAction":"allow","egress":[{"action":"deny","target":"a.test"}]}"#,
            r#"{"egress":[{"action":"allow","target":"a.test"}]}"#,
        ] {
            let e =
                refuse_restricting_policy(&NetworkPolicy::parse(restricting).unwrap()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{restricting}");
            assert!(
                e.message.contains("networkPolicy")
                    && e.message.contains("docker runtime does not enforce"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn ids_are_checked_before_reaching_docker() {
        assert!(check_id("4f1c2d9e-aaaa-bbbb-cccc-0123456789ab").is_ok());
        for bad in ["", "../x", "a/b", "x y", &"a".repeat(65)] {
            assert_eq!(check_id(bad).unwrap_err().status, 404, "{bad:?}");
        }
    }

    #[test]
    fn exit_codes_map_to_states() {
        assert_eq!(state_of("running", None).0, State::Running);
        assert_eq!(state_of("paused", None).0, State::Paused);
        assert_eq!(state_of("exited", Some(0)).0, State::Terminated);
        assert_eq!(state_of("exited", Some(3)).0, State::Failed);
    }

    fn plan(limits: serde_json::Value, requests: serde_json::Value) -> CreatePlan {
        let policy = crate::validate::Policy {
            max_timeout_secs: 86_400,
            host_paths: crate::volumes::HostPathCheck::Local(vec![]),
        };
        let body = serde_json::json!({
            "image": {"uri": "busybox"},
            "entrypoint": ["sh"],
            "resourceLimits": limits,
            "resourceRequests": requests,
        });
        crate::validate::plan_create(serde_json::from_value(body).unwrap(), &policy, Utc::now())
            .unwrap()
    }

    #[test]
    fn limits_match_the_containerd_path() {
        let h = limits(
            &plan(
                serde_json::json!({"cpu":"500m","memory":"64Mi","pids":"100"}),
                serde_json::json!({"cpu":"250m","memory":"32Mi"}),
            ),
            4096,
        )
        .unwrap();
        assert_eq!(h.memory, Some(64 << 20));
        // No swap beyond the limit.
        assert_eq!(h.memory_swap, h.memory);
        assert_eq!(h.nano_cpus, Some(500_000_000));
        assert_eq!(h.pids_limit, Some(100));
        assert_eq!(h.cpu_shares, Some(256));
        assert_eq!(h.memory_reservation, Some(32 << 20));
        // Nothing asked: no CPU or memory cap, but always a pids bound.
        let h = limits(&plan(serde_json::json!({}), serde_json::json!({})), 4096).unwrap();
        assert_eq!((h.memory, h.memory_swap, h.nano_cpus), (None, None, None));
        assert_eq!(h.pids_limit, Some(4096));
        assert_eq!((h.cpu_shares, h.memory_reservation), (None, None));
        // A tiny request still gets the kernel's minimum weight.
        let h = limits(
            &plan(serde_json::json!({}), serde_json::json!({"cpu":"1m"})),
            4096,
        )
        .unwrap();
        assert_eq!(h.cpu_shares, Some(MIN_SHARES));
        // Absurd but parseable: a 400, not an overflow.
        let e = limits(
            &plan(serde_json::json!({"cpu":"1e15"}), serde_json::json!({})),
            4096,
        )
        .unwrap_err();
        assert_eq!(e.status, 400, "{e}");
    }
}
