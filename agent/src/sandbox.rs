//! The sandbox table and its operations on containerd: create, delete,
//! pause/resume, status, recovery from labels, and task-exit tracking.
//! Warm sandboxes (started, unclaimed) live in the same table, invisible to
//! the sandbox API: `warm_start` starts them, `claim` turns one into the
//! sandbox of a create.

mod claim;
mod warm_start;

pub use warm_start::{Occupancy, WarmView};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use backon::Retryable;
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, GetContainerRequest, GetRequest,
    ListContainersRequest, PauseTaskRequest, ResumeTaskRequest, StartRequest,
    UpdateContainerRequest,
};
use containerd_client::types::Mount;
use containerd_client::types::v1::Status as TaskStatus;
use parking_lot::RwLock;
use sandbolt_node::NodeError;
use sandbolt_node::retry;
use sandbolt_proto::agent::v1::{
    CreateTimings, NamedVolumeMount, Resources, SandboxPhase, SandboxSpec, SandboxStatus,
    SnapshotInfo, WarmClass,
};
use sandbolt_proto::egress::NetworkPolicy;
use sandbolt_proto::quantity::QuantityError;
use sandbolt_proto::wire::EXECD_TOKEN_HEADER;

use tonic::Code;

use crate::config::AgentConfig;
use crate::containerd::Containerd;
use crate::error::{AgentError, Result};
use crate::images::{self, Images, ResolvedImage};
use crate::labels;
use crate::metrics::{AgentMetrics, CreateSource, CreateStage};
use crate::network::{Attachment, Network};
use crate::prepared::Prepared;
use crate::runtime::RuntimeInfo;
use crate::snapshot::{self, Snapshots};
use crate::teardown::{SnapshotRef, Stop, Teardown};
use crate::volume_mounts::{self, VolumeMounts};
use crate::{hardening, proxy, spec, volumes};
use sandbolt_image_ref::normalize;

/// OCI spec type URL containerd expects on `Container.spec`.
const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";
/// Env var that hands execd its access token.
pub const EXECD_TOKEN_ENV: &str = "EXECD_ACCESS_TOKEN";

/// One sandbox as the agent knows it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub record_uid: String,
    pub image: String,
    pub runtime: String,
    pub pool: String,
    pub created_at_ms: i64,
    pub phase: SandboxPhase,
    pub exit_code: i32,
    pub pid: u32,
    pub message: String,
    pub exposed_ports: Vec<u32>,
    pub token_sha256: [u8; 32],
    /// The sandbox's network namespace, held open from task creation (or
    /// recovery) until it exits: the proxy and the execd probes dial
    /// through it, never through `pid` (see [`crate::netns`]).
    pub netns: Option<Arc<crate::netns::NetnsHandle>>,
    /// Named volumes mounted now (the create's, then attached ones); kept
    /// in the container's [`labels::VOLUME_MOUNTS`] label.
    pub volume_mounts: Vec<NamedVolumeMount>,
    /// `resources.ephemeral_storage` in bytes, 0 for none; enforced by
    /// [`crate::storage_limit`], kept in its label.
    pub ephemeral_storage_limit: u64,
    /// Set while the sandbox is warm (no record, no user code yet); a claim
    /// clears it first of all, so nothing else can claim or trim it.
    pub warm: Option<WarmState>,
}

/// What only a warm sandbox has.
#[derive(Clone)]
pub struct WarmState {
    pub class: WarmClass,
    /// The warm token in plain text: the claim authenticates to execd with
    /// it. Only in memory (a restarted agent removes its warm sandboxes).
    token: String,
    /// execd answered: claimable. Until then the sandbox is starting.
    pub ready: bool,
}

impl std::fmt::Debug for WarmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WarmState")
            .field("class", &self.class)
            .field("ready", &self.ready)
            .finish_non_exhaustive()
    }
}

/// What a create answered.
#[derive(Debug, Clone)]
pub struct Created {
    pub status: SandboxStatus,
    pub timings: CreateTimings,
    /// Served by claiming a warm sandbox.
    pub claimed_warm: bool,
}

/// Counts a user create (or claim) for as long as it runs: warm refills
/// wait while one is in flight.
struct UserCreate<'a>(&'a AtomicUsize);

impl<'a> UserCreate<'a> {
    fn enter(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Self(n)
    }
}

impl Drop for UserCreate<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Entry {
    fn status(&self, agent_id: &str) -> SandboxStatus {
        SandboxStatus {
            sandbox_id: self.id.clone(),
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            record_uid: self.record_uid.clone(),
            phase: self.phase as i32,
            exit_code: self.exit_code,
            pid: self.pid,
            created_at_unix_ms: self.created_at_ms,
            image: self.image.clone(),
            runtime: self.runtime.clone(),
            agent_id: agent_id.to_string(),
            pool: self.pool.clone(),
            proxy_path: format!("/{}", self.id),
            message: self.message.clone(),
            exposed_ports: self.exposed_ports.clone(),
            ip_address: String::new(),
            volume_mounts: self.volume_mounts.clone(),
        }
    }

    fn exited(&mut self, exit_status: u32) {
        // Its pid may name another process from now on; the namespace goes.
        self.netns = None;
        self.exit_code = exit_status as i32;
        self.phase = if exit_status == 0 {
            SandboxPhase::Stopped
        } else {
            SandboxPhase::Failed
        };
    }
}

pub struct Sandboxes {
    cfg: Arc<AgentConfig>,
    ctrd: Containerd,
    pub images: Images,
    runtimes: Vec<RuntimeInfo>,
    table: RwLock<HashMap<String, Entry>>,
    /// Per-sandbox operation locks: a create and a delete of one id never
    /// interleave; different sandboxes never wait on each other.
    locks: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Task, container, snapshot and log removal (shared with the janitor).
    teardown: Teardown,
    /// Whether memory limits can hold swap too (checked once at start).
    swap_accounting: bool,
    /// Sandbox networking, once started (after recovery: it needs to know
    /// which sandboxes are alive); never set with `--network none`.
    network: std::sync::OnceLock<Network>,
    /// The node's named volumes and who mounts them.
    volumes: Arc<VolumeMounts>,
    /// This agent process (labels its warm sandboxes, see
    /// [`labels::AGENT_INSTANCE`]).
    instance_id: String,
    /// User creates and claims running now.
    user_creates: AtomicUsize,
    /// Wakes the warm pool's reconcile loop: a claim, a warm sandbox's
    /// exit, a create that may have filled the agent.
    warm_wake: Arc<tokio::sync::Notify>,
    /// Writable snapshots prepared ahead of cold creates.
    prepared: Arc<Prepared>,
    /// Committed sandbox snapshots (captures, deletes, restores' parents).
    snapshots: Arc<Snapshots>,
    /// Shifted image snapshots, with user namespaces on (`crate::userns`).
    userns: Option<Arc<crate::userns::Shifter>>,
    /// Create stage timings and outcomes (see [`AgentMetrics::register`]).
    metrics: AgentMetrics,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// RLIMIT_NOFILE for sandboxes: the hardening default, capped at the
/// agent's own hard limit. runc cannot raise a hard limit above what the
/// runtime inherited on hosts that forbid it (seen here: 20000), and the
/// create would fail with "error setting rlimits".
fn nofile_limit() -> u64 {
    let wanted = hardening::Options::default().nofile;
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((_, hard)) if hard != nix::sys::resource::RLIM_INFINITY => wanted.min(hard),
        _ => wanted,
    }
}

fn validate_id(id: &str) -> Result<()> {
    // containerd's identifier rules, and safe as a file and cgroup name.
    let ok = !id.is_empty()
        && id.len() <= 76
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(AgentError::InvalidArgument(format!(
            "sandbox id {id:?} must be 1-76 characters of [A-Za-z0-9_.-], starting alphanumeric"
        )))
    }
}

/// The request checks that need neither the table nor containerd.
fn validate_request(spec: &SandboxSpec) -> Result<()> {
    validate_id(&spec.sandbox_id)?;
    if spec.image.trim().is_empty() {
        return Err(AgentError::InvalidArgument("image is required".into()));
    }
    if spec.access_token.is_empty() {
        return Err(AgentError::InvalidArgument(
            "access_token is required (it authenticates execd and the proxy route)".into(),
        ));
    }
    if let Some(k) = spec
        .labels
        .keys()
        .find(|k| k.starts_with(labels::RESERVED_PREFIX))
    {
        return Err(AgentError::InvalidArgument(format!(
            "label {k:?} uses the reserved prefix {}",
            labels::RESERVED_PREFIX
        )));
    }
    if !spec.snapshot_id.is_empty() {
        snapshot::validate_id(&spec.snapshot_id)?;
    }
    crate::storage_limit::limit_of(spec)?;
    volume_mounts::validate(&spec.volume_mounts, "volume_mounts")
}

/// The key of snapshot `id`'s operation lock in the per-id lock map ('/'
/// is never in a sandbox id): a delete of the snapshot waits for a capture
/// of it and for a restore's writable layer to exist.
fn snapshot_lock_key(id: &str) -> String {
    format!("snapshot/{id}")
}

/// `value`, or `default` when `value` is empty (proto3 strings have no
/// "unset").
fn or_default<'a>(value: &'a str, default: &'a str) -> &'a str {
    if value.is_empty() { default } else { value }
}

/// Microseconds since the create began, for [`CreateTimings`].
struct CreateClock(Instant);

impl CreateClock {
    fn start() -> Self {
        Self(Instant::now())
    }

    fn elapsed_us(&self) -> i64 {
        self.0.elapsed().as_micros() as i64
    }
}

/// What a cold create (or a warm start) did so far.
#[derive(Default)]
struct CreateProgress {
    /// Microseconds since the create began, for the response.
    timings: CreateTimings,
    /// Each stage's own duration, once it succeeded (user creates report
    /// them to [`AgentMetrics`]).
    stages: Vec<(CreateStage, Duration)>,
    /// Whether this create made the container: only then is cleaning up
    /// after a failure ours to do (an id clash must not remove someone
    /// else's container).
    created: bool,
}

/// Runs `step` and says how long it took.
async fn timed<T>(step: impl Future<Output = T>) -> (T, Duration) {
    let started = Instant::now();
    let out = step.await;
    (out, started.elapsed())
}

/// What execd runs as the sandbox's entrypoint, and how.
struct Entrypoint {
    command: Vec<String>,
    /// `KEY=value`, the access token included.
    env: Vec<String>,
    cwd: String,
}

/// Why one `/ping` of execd did not succeed.
#[derive(Debug)]
enum ExecdProbe {
    /// The sandbox exited (with this status): waiting longer cannot help.
    Exited(i32),
    /// No answer, or not 200 (what happened, for the final error).
    NoAnswer(String),
}

impl Sandboxes {
    /// How this agent pulls a missing image (creates and warm images alike).
    pub fn pull_options(&self) -> images::PullOptions<'_> {
        images::PullOptions {
            timeout: self.cfg.pull_timeout,
            plain_http_registries: &self.cfg.plain_http_registries,
        }
    }

    pub fn new(
        cfg: Arc<AgentConfig>,
        ctrd: Containerd,
        runtimes: Vec<RuntimeInfo>,
        volumes: Arc<VolumeMounts>,
        instance_id: &str,
    ) -> Self {
        Self {
            images: Images::new(ctrd.clone(), cfg.snapshotter.clone()),
            teardown: Teardown::new(ctrd.clone(), (!cfg.keep_logs).then(|| cfg.logs_dir())),
            prepared: Arc::new(Prepared::new(
                ctrd.clone(),
                &cfg.snapshotter,
                &cfg.agent_id,
                instance_id,
                cfg.prepared_snapshots,
            )),
            snapshots: Arc::new(Snapshots::new(
                ctrd.clone(),
                &cfg.snapshotter,
                &cfg.agent_id,
                &cfg.node_name,
                instance_id,
                volumes.clone(),
            )),
            userns: cfg.user_namespace.enabled().then(|| {
                Arc::new(crate::userns::Shifter::new(
                    ctrd.clone(),
                    &cfg.snapshotter,
                    cfg.userns_base,
                    &cfg.state_dir,
                ))
            }),
            cfg,
            ctrd,
            runtimes,
            table: RwLock::new(HashMap::new()),
            locks: parking_lot::Mutex::new(HashMap::new()),
            swap_accounting: hardening::swap_accounting(),
            network: std::sync::OnceLock::new(),
            volumes,
            instance_id: instance_id.to_string(),
            user_creates: AtomicUsize::new(0),
            warm_wake: Arc::new(tokio::sync::Notify::new()),
            metrics: AgentMetrics::default(),
        }
    }

    /// This agent's create metrics.
    pub fn metrics(&self) -> &AgentMetrics {
        &self.metrics
    }

    /// The node's named volumes.
    pub fn volumes(&self) -> &Arc<VolumeMounts> {
        &self.volumes
    }

    /// The writable snapshots prepared ahead of cold creates.
    pub fn prepared(&self) -> &Arc<Prepared> {
        &self.prepared
    }

    /// The shifted image snapshots (None with user namespaces off).
    pub fn userns(&self) -> Option<&Arc<crate::userns::Shifter>> {
        self.userns.as_ref()
    }

    /// The parent of a writable snapshot on image `chain_id`: the chain id
    /// itself, or with user namespaces on its shifted snapshot (made on
    /// the image's first use, see [`crate::userns`]).
    pub async fn rootfs_parent(&self, chain_id: &str) -> Result<String> {
        match &self.userns {
            Some(shifter) => shifter.parent_for(chain_id).await,
            None => Ok(chain_id.to_string()),
        }
    }

    /// This agent's committed sandbox snapshots.
    pub fn snapshots(&self) -> &Arc<Snapshots> {
        &self.snapshots
    }

    /// Hands the started network to the table (once, at agent start).
    pub fn set_network(&self, network: Network) {
        if self.network.set(network).is_err() {
            tracing::warn!("sandbox networking was already set; the second one is ignored");
        }
    }

    pub fn network(&self) -> Option<&Network> {
        self.network.get()
    }

    /// Every sandbox id the table holds (recovery of the network keeps
    /// their namespaces).
    pub fn ids(&self) -> std::collections::HashSet<String> {
        self.table.read().keys().cloned().collect()
    }

    /// `status` with the sandbox's address, when it has one.
    fn with_ip(&self, mut status: SandboxStatus) -> SandboxStatus {
        if let Some(ip) = self.network().and_then(|n| n.ip_of(&status.sandbox_id)) {
            status.ip_address = ip.to_string();
        }
        status
    }

    pub fn runtimes(&self) -> &[RuntimeInfo] {
        &self.runtimes
    }

    /// What this agent's pool promises its sandboxes (see `PoolPolicy`).
    pub fn pool_policy(&self) -> sandbolt_proto::agent::v1::PoolPolicy {
        sandbolt_proto::agent::v1::PoolPolicy {
            runtime: self.cfg.default_runtime.clone(),
            default_limits: Some(self.cfg.pool_default_limits.to_wire()),
            max_limits: Some(self.cfg.pool_max_limits.to_wire()),
            warm_images: self.cfg.warm_images.clone(),
        }
    }

    pub fn containerd(&self) -> &Containerd {
        &self.ctrd
    }

    /// The file the task of sandbox `id` writes its stdout and stderr to.
    pub fn log_path(&self, id: &str) -> std::path::PathBuf {
        self.cfg.log_path(id)
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.lock().entry(id.to_string()).or_default().clone()
    }

    /// Forgets the lock of a sandbox that is gone, unless another operation
    /// holds or awaits it (it would otherwise race a fresh lock's holder).
    fn release_lock(&self, id: &str, lock: &Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self.locks.lock();
        // One reference in the map, one in the caller.
        if Arc::strong_count(lock) <= 2 {
            locks.remove(id);
        }
    }

    /// The status of a sandbox (warm ones are not sandboxes of the API).
    fn status_of(&self, id: &str) -> Option<SandboxStatus> {
        let status = self
            .table
            .read()
            .get(id)
            .filter(|e| e.warm.is_none())
            .map(|e| e.status(&self.cfg.agent_id))?;
        Some(self.with_ip(status))
    }

    pub fn get(&self, id: &str) -> Result<SandboxStatus> {
        self.status_of(id)
            .ok_or_else(|| AgentError::SandboxNotFound(id.to_string()))
    }

    pub fn list(&self) -> Vec<SandboxStatus> {
        let v: Vec<_> = self
            .table
            .read()
            .values()
            .filter(|e| e.warm.is_none())
            .map(|e| e.status(&self.cfg.agent_id))
            .collect();
        let mut v: Vec<_> = v.into_iter().map(|s| self.with_ip(s)).collect();
        v.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        v
    }

    /// Creates and starts a sandbox. Idempotent by id (for the same
    /// identity; another's is ALREADY_EXISTS). An id naming a warm sandbox
    /// of this agent claims it (see the `claim` module); one that cannot be claimed
    /// any more is replaced by a cold create under the same id.
    #[tracing::instrument(skip_all)]
    pub async fn create(&self, spec: SandboxSpec) -> Result<Created> {
        let mut source = Some(CreateSource::Cold);
        let created = self.create_or_claim(spec, &mut source).await;
        if let Some(source) = source {
            self.metrics.count_create(source, created.is_ok());
        }
        created
    }

    /// [`Self::create`] proper. Leaves `source` at what served the request:
    /// a claim (also when it refused the request), a cold create, or None
    /// for the idempotent answer about a sandbox that exists (no create).
    async fn create_or_claim(
        &self,
        spec: SandboxSpec,
        source: &mut Option<CreateSource>,
    ) -> Result<Created> {
        let clock = CreateClock::start();
        validate_request(&spec)?;
        let _in_flight = UserCreate::enter(&self.user_creates);
        let id = spec.sandbox_id.clone();
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        if let Some(status) = self.existing(&spec)? {
            *source = None;
            return Ok(Created {
                status,
                timings: CreateTimings::default(),
                claimed_warm: false,
            });
        }
        if !spec.snapshot_id.is_empty() && self.is_warm(&id) {
            return Err(AgentError::AlreadyExists {
                id,
                owner: "a warm sandbox of this agent".into(),
                requested: format!(
                    "a restore of snapshot {} (restores never claim warm sandboxes)",
                    spec.snapshot_id
                ),
            });
        }
        if self.is_warm(&id) {
            *source = Some(CreateSource::Warm);
            let claimed = self.claim(&spec, &clock).await;
            self.warm_wake.notify_one();
            match claimed {
                Ok(Some(created)) => return Ok(created),
                // W is gone: a cold create under its id.
                Ok(None) => *source = Some(CreateSource::Cold),
                // A refused request leaves W warm.
                Err(e) => return Err(e),
            }
        }
        let created = self.create_cold(&spec, &clock, &lock).await;
        // The agent may be full now: the warm pool makes room.
        self.warm_wake.notify_one();
        created
    }

    /// The idempotent answer for a sandbox that exists (not warm) under the
    /// request's id: only for the same namespace and name (and record uid,
    /// when both have one), else ALREADY_EXISTS.
    fn existing(&self, spec: &SandboxSpec) -> Result<Option<SandboxStatus>> {
        let Some(status) = self.status_of(&spec.sandbox_id) else {
            return Ok(None);
        };
        let uid_matches = status.record_uid.is_empty()
            || spec.record_uid.is_empty()
            || status.record_uid == spec.record_uid;
        if status.name == spec.name && status.namespace == spec.namespace && uid_matches {
            return Ok(Some(status));
        }
        let who = |ns: &str, name: &str, uid: &str| {
            if uid.is_empty() {
                format!("{ns}/{name}")
            } else {
                format!("{ns}/{name} (record uid {uid})")
            }
        };
        Err(AgentError::AlreadyExists {
            id: spec.sandbox_id.clone(),
            owner: who(&status.namespace, &status.name, &status.record_uid),
            requested: who(&spec.namespace, &spec.name, &spec.record_uid),
        })
    }

    /// Whether `id` is a warm sandbox (claimable or starting).
    fn is_warm(&self, id: &str) -> bool {
        self.table.read().get(id).is_some_and(|e| e.warm.is_some())
    }

    /// The create proper, under the id's lock: reserve a table entry,
    /// create and start the task ([`Self::create_and_start`]), mark it
    /// running and (when asked) wait for execd; a failure undoes what this
    /// create made.
    async fn create_cold(
        &self,
        spec: &SandboxSpec,
        clock: &CreateClock,
        lock: &Arc<tokio::sync::Mutex<()>>,
    ) -> Result<Created> {
        let id = spec.sandbox_id.clone();
        // What the runtime refuses (e.g. volumes under runsc) is said
        // before volumes are looked up.
        if let Err(e) = self.runtime_for(spec) {
            self.release_lock(&id, lock);
            return Err(e);
        }
        self.reserve_entry(spec)?;
        if let Err(e) = self
            .reserve_volumes(&id, &spec.volume_mounts, "volume_mounts")
            .await
        {
            self.table.write().remove(&id);
            self.release_lock(&id, lock);
            return Err(e);
        }
        let mut progress = CreateProgress::default();
        let outcome = match self.create_and_start(spec, clock, &mut progress).await {
            Ok(pid) => {
                progress.timings.task_started_us = clock.elapsed_us();
                self.mark_running(&id, pid);
                self.wait_until_ready(spec, clock, &mut progress)
                    .await
                    .map(|()| pid)
            }
            Err(e) => Err(e),
        };
        // The stages that got done count, whether or not the create did.
        for &(stage, took) in &progress.stages {
            self.metrics.observe_stage(stage, took);
        }
        match outcome {
            Ok(pid) => {
                tracing::info!(sandbox = %id, pid, total_us = clock.elapsed_us(), "sandbox running");
                Ok(Created {
                    status: self.get(&id)?,
                    timings: progress.timings,
                    claimed_warm: false,
                })
            }
            Err(e) => {
                let created = progress.created;
                tracing::warn!(sandbox = %id, error = %e, created, "create failed");
                self.undo_create(&id, created).await;
                self.release_lock(&id, lock);
                Err(e)
            }
        }
    }

    /// Removes what a failed create (or a warm sandbox that is given up)
    /// made: container and task when `created`, network, volume holds,
    /// table entry. The caller holds the id's lock.
    async fn undo_create(&self, id: &str, created: bool) {
        if created {
            self.cleanup(id).await;
        } else {
            // A prepared snapshot taken for a container never made.
            self.prepared.discard_taken(id).await;
        }
        self.release_network(id).await;
        self.volumes.release(id, None);
        self.table.write().remove(id);
    }

    /// Puts the sandbox in the table as Creating, unless the agent is full
    /// (warm sandboxes do not count: the warm pool trims them when creates
    /// need the room).
    fn reserve_entry(&self, spec: &SandboxSpec) -> Result<()> {
        let mut table = self.table.write();
        let users = table.values().filter(|e| e.warm.is_none()).count();
        if users >= self.cfg.max_sandboxes as usize {
            return Err(AgentError::Capacity {
                max: self.cfg.max_sandboxes,
            });
        }
        let entry = self.new_entry(spec);
        table.insert(entry.id.clone(), entry);
        Ok(())
    }

    /// A Creating table entry for `spec` (not warm).
    fn new_entry(&self, spec: &SandboxSpec) -> Entry {
        Entry {
            id: spec.sandbox_id.clone(),
            name: spec.name.clone(),
            namespace: spec.namespace.clone(),
            record_uid: spec.record_uid.clone(),
            image: normalize(&spec.image),
            runtime: self.runtime_name(spec).to_string(),
            pool: or_default(&spec.pool, &self.cfg.pool).to_string(),
            created_at_ms: now_ms(),
            phase: SandboxPhase::Creating,
            exit_code: 0,
            pid: 0,
            netns: None,
            message: String::new(),
            exposed_ports: spec.exposed_ports.clone(),
            token_sha256: sandbolt_proto::auth::token_digest(spec.access_token.as_bytes()),
            volume_mounts: spec.volume_mounts.clone(),
            // Checked by `validate_request` before any entry exists.
            ephemeral_storage_limit: crate::storage_limit::limit_of(spec).unwrap_or(0),
            warm: None,
        }
    }

    /// Everything that makes the sandbox exist, top-down: checks that need
    /// no I/O first, then the image, the runtime spec, the container and its
    /// snapshot, and the task. Returns the task's pid.
    async fn create_and_start(
        &self,
        spec: &SandboxSpec,
        clock: &CreateClock,
        progress: &mut CreateProgress,
    ) -> Result<u32> {
        let runtime = self.runtime_for(spec)?;
        let mut limits = self.limits_for(spec.resources.clone().unwrap_or_default())?;
        if runtime.name == crate::gvisor::RUNSC {
            limits.pids_limit = crate::gvisor::host_pids_limit(limits.pids_limit);
            self.check_runsc_id(&spec.sandbox_id)?;
        }
        // Held open until the task exists, then mounted into it (see
        // `crate::live_mount`): what was checked is what gets mounted.
        let held = self.bind_mounts(spec)?;
        let held = self.with_named_volumes(spec, held).await?;
        let policy = self.network_policy(spec)?;
        // Held until the writable layer sits on the snapshot.
        let restore = self.restore_parent(spec).await?;

        // A prepared namespace is taken while the image resolves.
        let ((image, image_took), attachment) = tokio::join!(
            timed(self.image_for(spec)),
            self.reserve_network(spec, policy)
        );
        let attachment = attachment?;
        let image = image?;
        progress.timings.image_resolved_us = clock.elapsed_us();
        progress.stages.push((CreateStage::Image, image_took));

        // The sandbox's rules go in while the container and its task are
        // made (runc creates the task's processes but runs nothing of the
        // sandbox's until tasks.Start); both are done before the task starts.
        // Until then the namespace's traffic is dropped.
        let container = async {
            let started = Instant::now();
            let oci = self.runtime_spec(spec, &image, &limits, attachment.as_ref())?;
            let labels = self.container_labels(spec, runtime)?;
            // The image's shifted snapshot with user namespaces on.
            let image_parent = self.rootfs_parent(&image.chain_id).await?;
            let (key, prepared) = self.snapshot_key_for(spec, &image_parent);
            // The container first: it references the snapshot key, which keeps
            // containerd's GC off the snapshot from the moment it exists.
            self.create_container(spec, runtime, &image, &oci, labels, &key)
                .await?;
            progress.created = true;
            let parent = restore
                .as_ref()
                .map_or(image_parent.as_str(), |(p, _)| p.as_str());
            let rootfs = self.rootfs(&key, prepared, parent).await?;
            // Container and rootfs ready (with a prepared snapshot: no
            // snapshots.Prepare on this path).
            progress.timings.container_created_us = clock.elapsed_us();
            progress
                .stages
                .push((CreateStage::Container, started.elapsed()));
            tracing::debug!(sandbox = %spec.sandbox_id, snapshot = %key, prepared, "container created");
            let (pid, took) = timed(self.create_task(&spec.sandbox_id, rootfs, runtime)).await;
            pid.map(|pid| (pid, took))
        };
        let (task, rules) = tokio::join!(container, self.apply_network(spec, &attachment));
        rules?;
        let (pid, task_create_took) = task?;
        // Before tasks.Start: nothing of the sandbox's has run, so `pid` is
        // still its init process.
        self.hold_netns(&spec.sandbox_id, pid, attachment.as_ref())?;
        let (started, task_start_took) = timed(async {
            // Before tasks.Start: none of the sandbox's code has run yet.
            crate::live_mount::attach_held(pid, &spec.sandbox_id, held).await?;
            self.start_task(&spec.sandbox_id).await
        })
        .await;
        started?;
        progress
            .stages
            .push((CreateStage::Task, task_create_took + task_start_took));
        Ok(pid)
    }

    /// The request's network policy, checked: refused when this agent
    /// cannot enforce it. None when the agent runs without networking.
    fn network_policy(&self, spec: &SandboxSpec) -> Result<Option<NetworkPolicy>> {
        let policy = NetworkPolicy::parse(&spec.network_policy_json)
            .map_err(|e| AgentError::InvalidArgument(format!("network_policy_json: {e}")))?;
        if self.network().is_some() {
            return Ok(Some(policy));
        }
        if !policy.is_allow_all() {
            return Err(no_network_for_policy());
        }
        Ok(None)
    }

    /// A prepared namespace for the sandbox (None without networking).
    async fn reserve_network(
        &self,
        spec: &SandboxSpec,
        policy: Option<NetworkPolicy>,
    ) -> Result<Option<Attachment>> {
        let (Some(network), Some(policy)) = (self.network(), policy) else {
            return Ok(None);
        };
        Ok(Some(network.reserve(&spec.sandbox_id, policy).await?))
    }

    async fn apply_network(
        &self,
        spec: &SandboxSpec,
        attachment: &Option<Attachment>,
    ) -> Result<()> {
        if let (Some(network), Some(_)) = (self.network(), attachment) {
            network.apply(&spec.sandbox_id).await?;
        }
        Ok(())
    }

    /// Removes the sandbox's network, if it has one.
    async fn release_network(&self, id: &str) {
        if let Some(network) = self.network() {
            network.release(id).await;
        }
    }

    /// Replaces the network policy of a sandbox (`policy_json` as the
    /// agent API carries it); returns its status once the rules are in
    /// place.
    pub async fn update_network_policy(
        &self,
        id: &str,
        policy_json: &str,
    ) -> Result<SandboxStatus> {
        let policy = NetworkPolicy::parse(policy_json)
            .map_err(|e| AgentError::InvalidArgument(format!("network_policy_json: {e}")))?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        self.get(id)?;
        match self.network() {
            Some(network) if network.ip_of(id).is_some() => {
                network.update_policy(id, policy).await?;
            }
            Some(_) if !policy.is_allow_all() => {
                return Err(AgentError::NetworkUnavailable(format!(
                    "network_policy_json: sandbox {id} was created without a network (before networking was enabled on this agent), so no policy can be enforced for it"
                )));
            }
            None if !policy.is_allow_all() => return Err(no_network_for_policy()),
            _ => {}
        }
        self.get(id)
    }

    /// The request's runtime, or the pool's default.
    fn runtime_name<'a>(&'a self, spec: &'a SandboxSpec) -> &'a str {
        or_default(&spec.runtime, &self.cfg.default_runtime)
    }

    /// The OCI runtime the sandbox runs under; it must be available here.
    fn runtime_for(&self, spec: &SandboxSpec) -> Result<&RuntimeInfo> {
        let name = self.runtime_name(spec);
        let runtime = self
            .runtimes
            .iter()
            .find(|r| r.name == name)
            .ok_or_else(|| AgentError::RuntimeUnavailable {
                runtime: name.to_string(),
                reason: "unknown runtime (known: runc, crun, runsc)".into(),
            })?;
        if !runtime.available {
            return Err(AgentError::RuntimeUnavailable {
                runtime: runtime.name.clone(),
                reason: runtime.reason.clone(),
            });
        }
        if runtime.name == crate::gvisor::RUNSC {
            crate::gvisor::check_spec(spec, &self.cfg.runsc)?;
        }
        Ok(runtime)
    }

    /// runsc finds containers by id prefix and refuses an id that is a
    /// prefix of another's as ambiguous (after the container exists), so
    /// such an id is refused up front. The controller's ids have one fixed
    /// length and never clash.
    fn check_runsc_id(&self, id: &str) -> Result<()> {
        let table = self.table.read();
        let clash = table.values().find(|e| {
            e.id != id
                && e.runtime == crate::gvisor::RUNSC
                && (e.id.starts_with(id) || id.starts_with(&e.id))
        });
        match clash {
            Some(e) => Err(AgentError::InvalidArgument(format!(
                "sandbox_id {id:?}: runsc cannot run it beside runsc sandbox {:?} on this node (runsc finds containers by id prefix); use ids of one length",
                e.id
            ))),
            None => Ok(()),
        }
    }

    /// The hardening options: the request's limits parsed, the agent's
    /// defaults where it sets none.
    fn limits_for(&self, resources: Resources) -> Result<hardening::Options> {
        let invalid = |what: &str| {
            let what = what.to_string();
            move |e: QuantityError| AgentError::InvalidArgument(format!("{what}{e}"))
        };
        let given = |q: &str| !q.trim().is_empty();
        let mut limits = hardening::Options {
            pids_limit: if resources.pids_limit > 0 {
                resources.pids_limit
            } else {
                self.cfg.default_pids_limit
            },
            nofile: nofile_limit(),
            ..Default::default()
        };
        if given(&resources.cpu) {
            limits.cpu = Some(hardening::parse_cpu(&resources.cpu).map_err(invalid(""))?);
        }
        if given(&resources.memory) {
            limits.memory_bytes =
                Some(hardening::parse_memory(&resources.memory).map_err(invalid(""))?);
            limits.limit_swap = self.swap_accounting;
        }
        if given(&resources.cpu_request) {
            let m = sandbolt_proto::quantity::millicores(&resources.cpu_request)
                .map_err(invalid("cpu request: "))?;
            limits.cpu_shares = Some(hardening::cpu_shares(m));
        }
        if given(&resources.memory_request) {
            limits.memory_reservation = Some(
                hardening::parse_memory(&resources.memory_request)
                    .map_err(invalid("memory request: "))?,
            );
        }
        Ok(limits)
    }

    /// The host-path bindings, resolved against the allowlist and held
    /// open (see [`volumes::HeldMount`]).
    fn bind_mounts(&self, spec: &SandboxSpec) -> Result<Vec<volumes::HeldMount>> {
        volumes::resolve(&spec.host_mounts, &self.cfg.allowed_host_paths)
            .map_err(|e| AgentError::Volume(e.to_string()))
    }

    /// The image, pulled when missing, unpacked for the snapshotter.
    #[tracing::instrument(skip_all, fields(image = %spec.image))]
    async fn image_for(&self, spec: &SandboxSpec) -> Result<Arc<ResolvedImage>> {
        // The common case (the image is here) takes no pull lock.
        let image = match self.images.resolve(&spec.image).await {
            Ok(i) => i,
            Err(NodeError::ImageNotFound { .. }) => {
                self.images
                    .resolve_or_pull(&spec.image, self.pull_options())
                    .await?
            }
            Err(e) => return Err(e.into()),
        };
        self.images.ensure_unpacked(&image).await?;
        Ok(image)
    }

    /// What execd starts as the sandbox's entrypoint: the user's command
    /// (the request's, else the image's), the merged environment (image,
    /// request, the access token) and the working directory. The same for
    /// a cold create (in the runtime spec) and a claim (sent to execd).
    fn entrypoint(&self, spec: &SandboxSpec, image: &ResolvedImage) -> Result<Entrypoint> {
        let command = spec::user_command(
            image.config.entrypoint.as_deref(),
            image.config.cmd.as_deref(),
            &spec.command,
            &spec.args,
        );
        if command.is_empty() {
            return Err(AgentError::InvalidArgument(format!(
                "no command: the request has none and image {} sets neither Entrypoint nor Cmd",
                image.name
            )));
        }
        let (env, cwd) = self.environment(spec, image)?;
        Ok(Entrypoint { command, env, cwd })
    }

    /// The merged environment and the working directory of `spec`.
    fn environment(
        &self,
        spec: &SandboxSpec,
        image: &ResolvedImage,
    ) -> Result<(Vec<String>, String)> {
        let env = spec::merge_env(
            image.config.env.as_deref().unwrap_or_default(),
            &spec.envs,
            &[(EXECD_TOKEN_ENV.to_string(), spec.access_token.clone())],
        );
        let image_cwd = image.config.working_dir.as_deref().unwrap_or_default();
        let cwd = or_default(&spec.working_dir, or_default(image_cwd, "/"));
        if !cwd.starts_with('/') {
            return Err(AgentError::InvalidArgument(format!(
                "working_dir {cwd:?} must be absolute"
            )));
        }
        Ok((env, cwd.to_string()))
    }

    /// The hardened OCI runtime spec: execd as PID 1 running the user's
    /// command with merged env and cwd; for a warm sandbox, execd alone
    /// (`--warm`), its env holding the warm token.
    fn runtime_spec(
        &self,
        spec: &SandboxSpec,
        image: &ResolvedImage,
        limits: &hardening::Options,
        network: Option<&Attachment>,
    ) -> Result<oci_spec::runtime::Spec> {
        let warm = self.is_warm(&spec.sandbox_id);
        let entrypoint = if warm {
            let (env, cwd) = self.environment(spec, image)?;
            Entrypoint {
                command: Vec::new(),
                env,
                cwd,
            }
        } else {
            self.entrypoint(spec, image)?
        };
        let id = &spec.sandbox_id;
        let hostname: String = id.chars().take(63).collect();
        let mut oci = spec::build(&spec::SpecInput {
            hostname: &hostname,
            user_command: &entrypoint.command,
            warm,
            env: &entrypoint.env,
            cwd: &entrypoint.cwd,
            execd_host_path: &self.cfg.execd_binary,
            cgroups_path: &crate::config::cgroup_path(&self.cfg.cgroup_parent, id),
            network: network.map(|a| spec::NetworkInput {
                netns_path: &a.netns_path,
                resolv_conf: &a.resolv_conf,
            }),
        });
        hardening::apply(&mut oci, limits);
        if self.cfg.user_namespace.enabled() {
            crate::userns::apply(&mut oci, self.cfg.userns_base, network.is_some());
        }
        Ok(oci)
    }

    /// The container's labels: the request's, then the agent's own (which
    /// are its durable state, see [`entry_from_labels`]).
    fn container_labels(
        &self,
        spec: &SandboxSpec,
        runtime: &RuntimeInfo,
    ) -> Result<HashMap<String, String>> {
        let id = &spec.sandbox_id;
        let entry = self
            .table
            .read()
            .get(id)
            .cloned()
            .ok_or_else(|| AgentError::SandboxNotFound(id.clone()))?;
        let mut container_labels = spec.labels.clone();
        container_labels.extend([
            (labels::MANAGED.into(), "true".into()),
            (labels::SANDBOX_ID.into(), id.clone()),
            (labels::NAME.into(), spec.name.clone()),
            (labels::NAMESPACE.into(), spec.namespace.clone()),
            (labels::AGENT_ID.into(), self.cfg.agent_id.clone()),
            (labels::CREATED_AT.into(), entry.created_at_ms.to_string()),
            (labels::POOL.into(), entry.pool),
            (labels::TOKEN_SHA256.into(), hex::encode(entry.token_sha256)),
            (labels::IMAGE.into(), entry.image),
            (labels::RUNTIME.into(), runtime.name.clone()),
        ]);
        if !spec.record_uid.is_empty() {
            container_labels.insert(labels::RECORD_UID.into(), spec.record_uid.clone());
        }
        if let Some(w) = &entry.warm {
            container_labels.insert(labels::WARM_POOL.into(), w.class.warm_pool.clone());
            container_labels.insert(labels::AGENT_INSTANCE.into(), self.instance_id.clone());
        }
        if let Some(uid) = self.cfg.pod_uid() {
            container_labels.insert(labels::AGENT_POD_UID.into(), uid.to_string());
        }
        if !spec.exposed_ports.is_empty() {
            let ports: Vec<String> = spec.exposed_ports.iter().map(u32::to_string).collect();
            container_labels.insert(labels::EXPOSED_PORTS.into(), ports.join(","));
        }
        if !spec.volume_mounts.is_empty() {
            container_labels.insert(
                labels::VOLUME_MOUNTS.into(),
                volume_mounts::to_label(&spec.volume_mounts)?,
            );
        }
        if entry.ephemeral_storage_limit > 0 {
            container_labels.insert(
                crate::storage_limit::LIMIT_LABEL.into(),
                entry.ephemeral_storage_limit.to_string(),
            );
        }
        Ok(container_labels)
    }

    #[tracing::instrument(skip_all)]
    async fn create_container(
        &self,
        spec: &SandboxSpec,
        runtime: &RuntimeInfo,
        image: &ResolvedImage,
        oci: &oci_spec::runtime::Spec,
        labels: HashMap<String, String>,
        snapshot_key: &str,
    ) -> Result<()> {
        let container = Container {
            id: spec.sandbox_id.clone(),
            labels,
            image: image.name.clone(),
            runtime: Some(runtime.container_runtime()),
            spec: Some(prost_types::Any {
                type_url: SPEC_TYPE_URL.into(),
                value: serde_json::to_vec(oci).expect("an OCI spec serializes to JSON"),
            }),
            snapshotter: self.cfg.snapshotter.clone(),
            snapshot_key: snapshot_key.to_string(),
            ..Default::default()
        };
        self.ctrd
            .containers()
            .create(self.ctrd.req(CreateContainerRequest {
                container: Some(container),
            }))
            .await
            .map_err(AgentError::containerd("containers.Create"))?;
        Ok(())
    }

    /// The writable snapshot key of a create: a prepared snapshot of the
    /// image when one is ready (user creates only: warm starts refill on
    /// their own schedule), else the sandbox id. True when prepared.
    fn snapshot_key_for(&self, spec: &SandboxSpec, image_parent: &str) -> (String, bool) {
        // A restore's layer sits on its snapshot, never on the image.
        if spec.snapshot_id.is_empty()
            && !self.is_warm(&spec.sandbox_id)
            && let Some(key) = self.prepared.take(&spec.sandbox_id, image_parent)
        {
            return (key, true);
        }
        (spec.sandbox_id.clone(), false)
    }

    /// The task's rootfs mounts: a prepared snapshot's from
    /// `snapshots.Mounts`; else (or when the prepared one vanished) a
    /// snapshot prepared now under `key`.
    async fn rootfs(&self, key: &str, prepared: bool, parent: &str) -> Result<Vec<Mount>> {
        if prepared {
            match self.prepared.mounts(key).await {
                Ok(m) => return Ok(m),
                Err(e) if e.is_not_found() => {
                    tracing::warn!(snapshot = %key, "prepared snapshot vanished; preparing it now");
                }
                Err(e) => return Err(e),
            }
        }
        self.prepare_snapshot(key, parent).await
    }

    /// The sandbox's writable snapshot on top of the image (or of a sandbox
    /// snapshot); returns its mounts (the task's rootfs).
    ///
    /// A GC root, as prepared snapshots are: the teardown removes it
    /// explicitly, the janitor a leftover (the sandbox-id label proves it
    /// sandbolt's). Left to containerd's GC once the container is gone, it
    /// is deleted without unlinking it from its parent (containerd 1.6), and
    /// a sandbox snapshot it sat on could never be removed ("cannot remove
    /// snapshot with child", with no child).
    async fn prepare_snapshot(&self, id: &str, parent: &str) -> Result<Vec<Mount>> {
        let labels = HashMap::from([
            (labels::GC_ROOT.to_string(), now_ms().to_string()),
            (labels::SANDBOX_ID.to_string(), id.to_string()),
        ]);
        self.ctrd
            .prepare_snapshot(&self.cfg.snapshotter, id, parent, labels)
            .await
            .map_err(AgentError::containerd("snapshots.Prepare"))
    }

    /// Creates and starts the task; returns its pid.
    #[tracing::instrument(skip_all)]
    /// tasks.Create: the shim and runc's init process, waiting to run the
    /// sandbox's entrypoint (see [`Self::start_task`]). Returns its pid.
    async fn create_task(
        &self,
        id: &str,
        rootfs: Vec<Mount>,
        runtime: &RuntimeInfo,
    ) -> Result<u32> {
        // stdout and stderr append to one host file (the shim opens file://
        // URIs itself: no FIFOs to leak).
        let log = format!("file://{}", self.cfg.log_path(id).display());
        let task = self
            .ctrd
            .tasks()
            .create(self.ctrd.req(CreateTaskRequest {
                container_id: id.to_string(),
                rootfs,
                stdout: log.clone(),
                stderr: log,
                ..Default::default()
            }))
            .await
            .map_err(|status| {
                // A runtime that refuses to run here is reported as such.
                if runtime.name != "runc" && status.message().contains(&runtime.name) {
                    AgentError::RuntimeUnavailable {
                        runtime: runtime.name.clone(),
                        reason: status.message().to_string(),
                    }
                } else {
                    AgentError::containerd("tasks.Create")(status)
                }
            })?
            .into_inner();
        Ok(task.pid)
    }

    /// tasks.Start: the sandbox's own code begins to run.
    async fn start_task(&self, id: &str) -> Result<()> {
        self.ctrd
            .tasks()
            .start(self.ctrd.req(StartRequest {
                container_id: id.to_string(),
                exec_id: String::new(),
            }))
            .await
            .map_err(AgentError::containerd("tasks.Start"))?;
        Ok(())
    }

    /// Opens the network namespace of sandbox `id`, whose task was just
    /// created with init process `pid`, and keeps it in its entry.
    fn hold_netns(&self, id: &str, pid: u32, attachment: Option<&Attachment>) -> Result<()> {
        let path = attachment.map(|a| a.netns_path.as_path());
        let netns = crate::netns::NetnsHandle::for_sandbox(id, pid, path).map_err(
            AgentError::io(format!("opening the network namespace of sandbox {id}")),
        )?;
        if let Some(e) = self.table.write().get_mut(id) {
            e.netns = Some(Arc::new(netns));
        }
        Ok(())
    }

    /// How the agent reaches sandbox `id` while it is alive.
    fn upstream(&self, id: &str) -> Option<proxy::Upstream> {
        let e = self.table.read().get(id).cloned()?;
        self.upstream_of(&e)
    }

    /// How the agent reaches a live sandbox (see [`proxy::Upstream`]):
    /// through the namespace held since its task started, or, under gVisor,
    /// at its address (see [`crate::gvisor`]). None once its task exited.
    pub(crate) fn upstream_of(&self, e: &Entry) -> Option<proxy::Upstream> {
        let netns = e.netns.clone()?;
        if crate::gvisor::dials_by_address(&e.runtime) {
            return self.network()?.ip_of(&e.id).map(proxy::Upstream::Address);
        }
        Some(proxy::Upstream::Namespace(netns))
    }

    /// Records the started task's pid and turns the entry Running.
    fn mark_running(&self, id: &str, pid: u32) {
        if let Some(e) = self.table.write().get_mut(id) {
            e.pid = pid;
            // An exit event may have beaten us here.
            if e.phase == SandboxPhase::Creating {
                e.phase = SandboxPhase::Running;
            }
        }
    }

    /// Waits for execd when the request asks to.
    async fn wait_until_ready(
        &self,
        spec: &SandboxSpec,
        clock: &CreateClock,
        progress: &mut CreateProgress,
    ) -> Result<()> {
        if spec.wait_for_execd {
            let (ready, took) =
                timed(self.wait_for_execd(&spec.sandbox_id, &spec.access_token)).await;
            ready?;
            progress.timings.execd_ready_us = clock.elapsed_us();
            progress.stages.push((CreateStage::ExecdReady, took));
        }
        Ok(())
    }

    /// Polls execd's `/ping` inside the sandbox until it answers 200, the
    /// sandbox exits, or `execd_ready_timeout` passes.
    #[tracing::instrument(skip_all)]
    async fn wait_for_execd(&self, id: &str, token: &str) -> Result<()> {
        let timeout = self.cfg.execd_ready_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let ping = || self.ping_execd(id, token);
        ping.retry(retry::doubling(
            Duration::from_millis(2),
            Duration::from_millis(50),
        ))
        .when(|e| matches!(e, ExecdProbe::NoAnswer(_)))
        .adjust(retry::until(deadline))
        .await
        .map_err(|e| match e {
            ExecdProbe::Exited(code) => AgentError::ExitedAtStart {
                id: id.to_string(),
                code,
            },
            ExecdProbe::NoAnswer(last) => AgentError::ExecdNotReady {
                id: id.to_string(),
                reason: format!("no answer within {timeout:?}: {last}"),
            },
        })
    }

    /// One `/ping`; an exited sandbox is final, anything else is retried.
    async fn ping_execd(&self, id: &str, token: &str) -> Result<(), ExecdProbe> {
        let answer = match self.upstream(id) {
            Some(upstream) => {
                crate::netns::http_get_status(
                    &upstream,
                    self.cfg.execd_port,
                    "/ping",
                    &[(EXECD_TOKEN_HEADER, token)],
                    Duration::from_secs(2),
                )
                .await
            }
            None => Err(std::io::Error::other(
                "the sandbox's network namespace is gone",
            )),
        };
        let last = match answer {
            Ok(200) => return Ok(()),
            Ok(code) => format!("/ping answered {code}"),
            Err(e) => e.to_string(),
        };
        if let Some(e) = self.table.read().get(id)
            && matches!(e.phase, SandboxPhase::Stopped | SandboxPhase::Failed)
        {
            return Err(ExecdProbe::Exited(e.exit_code));
        }
        Err(ExecdProbe::NoAnswer(last))
    }

    /// Stops and removes a sandbox. Returns whether anything existed.
    pub async fn delete(&self, id: &str, grace: Option<Duration>) -> Result<bool> {
        validate_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let known = self.table.read().contains_key(id);
        let grace = grace.unwrap_or(self.cfg.stop_grace_period);
        let existed = self.stop_and_remove(id, grace, known).await? || known;
        // Only once the container is gone: its processes used the namespace
        // (and had the volumes mounted).
        self.release_network(id).await;
        self.volumes.release(id, None);
        self.table.write().remove(id);
        self.release_lock(id, &lock);
        if existed {
            tracing::info!(sandbox = %id, "sandbox deleted");
        }
        Ok(existed)
    }

    /// SIGTERM, grace, SIGKILL; then task, container, leftover bundle
    /// mounts, snapshot, log file ([`crate::teardown`]). Every step
    /// tolerates "already gone", so a half-created or half-deleted sandbox
    /// is finished off too. Containers without the
    /// managed label are never touched; a snapshot without a container is
    /// only removed when `ours` (known to the table or made by this create).
    async fn stop_and_remove(&self, id: &str, grace: Duration, ours: bool) -> Result<bool> {
        let container = match self
            .ctrd
            .containers()
            .get(self.ctrd.req(GetContainerRequest { id: id.to_string() }))
            .await
        {
            Ok(r) => r.into_inner().container,
            Err(s) if s.code() == Code::NotFound => None,
            Err(s) => return Err(AgentError::containerd("containers.Get")(s)),
        };
        if let Some(c) = &container
            && c.labels.get(labels::MANAGED).map(String::as_str) != Some("true")
        {
            return Err(AgentError::NotManaged(id.to_string()));
        }
        if container.is_none() && !ours {
            return Ok(false);
        }
        // The container's own snapshot key (a prepared one's is not the
        // id); without a container, the prepared key this agent gave it.
        let key = match &container {
            Some(c) if !c.snapshot_key.is_empty() => c.snapshot_key.clone(),
            _ => self.prepared.key_of(id).unwrap_or_else(|| id.to_string()),
        };
        let removed = self
            .teardown
            .all(
                id,
                Stop::Graceful(grace),
                SnapshotRef {
                    snapshotter: &self.cfg.snapshotter,
                    key: &key,
                },
            )
            .await?;
        self.prepared.forget(id);
        Ok(removed.anything())
    }

    /// Best-effort removal after a failed create.
    async fn cleanup(&self, id: &str) {
        if let Err(e) = self
            .stop_and_remove(id, Duration::from_millis(0), true)
            .await
        {
            tracing::warn!(sandbox = %id, error = %e, "cleanup after failed create incomplete");
        }
    }

    pub async fn pause(&self, id: &str) -> Result<SandboxStatus> {
        self.transition(id, Freeze::Pause).await
    }

    pub async fn resume(&self, id: &str) -> Result<SandboxStatus> {
        self.transition(id, Freeze::Resume).await
    }

    /// Pauses or resumes under the sandbox's lock; asking for the state it
    /// is already in answers its status (retries are harmless).
    async fn transition(&self, id: &str, to: Freeze) -> Result<SandboxStatus> {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let phase = self
            .table
            .read()
            .get(id)
            .filter(|e| e.warm.is_none())
            .map(|e| e.phase)
            .ok_or_else(|| AgentError::SandboxNotFound(id.to_string()))?;
        if phase == to.target() {
            return self.get(id);
        }
        if phase != to.source() {
            return Err(AgentError::WrongPhase {
                id: id.to_string(),
                phase: phase.as_str_name(),
                action: to.action(),
            });
        }
        let container_id = id.to_string();
        let mut tasks = self.ctrd.tasks();
        let res = match to {
            Freeze::Pause => tasks
                .pause(self.ctrd.req(PauseTaskRequest { container_id }))
                .await
                .map(|_| ()),
            Freeze::Resume => tasks
                .resume(self.ctrd.req(ResumeTaskRequest { container_id }))
                .await
                .map(|_| ()),
        };
        res.map_err(AgentError::containerd(to.rpc()))?;
        if let Some(e) = self.table.write().get_mut(id)
            && e.phase == to.source()
        {
            e.phase = to.target();
        }
        self.get(id)
    }

    /// Rebuilds the table from containerd: every container carrying the
    /// managed label and this agent's id, with its task's state. Warm
    /// containers (an earlier process's buffer) are removed instead
    /// (`remove_stale_warm`); the warm pool refills from targets.
    pub async fn recover(&self) -> Result<usize> {
        let containers = self
            .ctrd
            .containers()
            .list(self.ctrd.req(ListContainersRequest {
                filters: vec![format!(
                    "labels.\"{}\"==true,labels.\"{}\"=={}",
                    labels::MANAGED,
                    labels::AGENT_ID,
                    self.cfg.agent_id
                )],
            }))
            .await
            .map_err(AgentError::containerd("containers.List"))?
            .into_inner()
            .containers;
        let referenced: std::collections::HashSet<String> =
            containers.iter().map(|c| c.snapshot_key.clone()).collect();
        let mut n = 0;
        for c in containers {
            if c.labels.contains_key(labels::WARM_POOL) {
                self.remove_stale_warm(&c.id).await;
                continue;
            }
            self.adopt(&c).await?;
            if c.snapshot_key.starts_with(labels::PREPARED_KEY_PREFIX) {
                self.prepared.adopt(&c.id, &c.snapshot_key);
            }
            let entry = entry_from_labels(&c);
            let mut entry = match entry {
                Some(e) => e,
                None => {
                    tracing::warn!(container = %c.id, "managed container with unreadable labels; skipped");
                    continue;
                }
            };
            if c.labels.contains_key(labels::FROZEN_FOR_SNAPSHOT)
                && let Err(e) = snapshot::thaw_after_dead_capture(&self.ctrd, &c.id).await
            {
                tracing::warn!(sandbox = %c.id, error = %e, "could not thaw a sandbox a dead capture froze");
            }
            self.refresh_from_task(&mut entry).await;
            entry.netns = recovered_netns(&entry);
            self.volumes.adopt(&entry.id, &entry.volume_mounts);
            tracing::info!(sandbox = %entry.id, phase = ?entry.phase, pid = entry.pid, volumes = entry.volume_mounts.len(), "recovered sandbox");
            self.table.write().insert(entry.id.clone(), entry);
            n += 1;
        }
        // An earlier process's prepared snapshots that no container took.
        match self.prepared.remove_stale(&referenced).await {
            Ok(removed) if removed > 0 => {
                tracing::info!(
                    removed,
                    "removed prepared snapshots of an earlier agent process"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not list prepared snapshots to remove"),
        }
        self.snapshots.recover().await?;
        Ok(n)
    }

    /// Moves a recovered container to this agent pod: rewrites its
    /// [`labels::AGENT_POD_UID`] when it names another pod (the one this pod
    /// replaced). Recovery runs before the agent serves, and the agent pod
    /// turns Ready only once it serves, so the janitor — which reaps by this
    /// label only while a Ready agent pod exists — never sees a stale label
    /// it could mistake for an abandoned sandbox. A failure is an error: an
    /// agent that serves with stale labels would expose its sandboxes to
    /// that rule.
    async fn adopt(&self, c: &Container) -> Result<()> {
        let Some(uid) = self.cfg.pod_uid() else {
            return Ok(());
        };
        let old = c.labels.get(labels::AGENT_POD_UID).map(String::as_str);
        if old == Some(uid) {
            return Ok(());
        }
        // Only the one label: every other field (and label) stays exactly
        // as containerd has it.
        self.ctrd
            .set_container_label(&c.id, labels::AGENT_POD_UID, uid)
            .await
            .map_err(AgentError::containerd("containers.Update"))?;
        tracing::info!(sandbox = %c.id, from = old.unwrap_or(""), to = uid, "adopted sandbox into this agent pod");
        Ok(())
    }

    /// Sets phase/pid/exit code from the task's state in containerd.
    async fn refresh_from_task(&self, entry: &mut Entry) {
        match self
            .ctrd
            .tasks()
            .get(self.ctrd.req(GetRequest {
                container_id: entry.id.clone(),
                exec_id: String::new(),
            }))
            .await
        {
            Ok(r) => {
                let Some(p) = r.into_inner().process else {
                    return;
                };
                entry.pid = p.pid;
                match TaskStatus::try_from(p.status).unwrap_or(TaskStatus::Unknown) {
                    TaskStatus::Running => entry.phase = SandboxPhase::Running,
                    TaskStatus::Paused | TaskStatus::Pausing => entry.phase = SandboxPhase::Paused,
                    TaskStatus::Stopped => entry.exited(p.exit_status),
                    TaskStatus::Created => {
                        entry.phase = SandboxPhase::Failed;
                        entry.message =
                            "task created but never started (create interrupted)".into();
                    }
                    TaskStatus::Unknown => entry.phase = SandboxPhase::Unknown,
                }
            }
            Err(s) if s.code() == Code::NotFound => {
                if entry.phase != SandboxPhase::Creating {
                    entry.phase = SandboxPhase::Failed;
                    if entry.message.is_empty() {
                        entry.message = "no task (it was deleted or never created)".into();
                    }
                }
            }
            Err(s) => {
                tracing::warn!(sandbox = %entry.id, error = %s, "tasks.Get failed");
                entry.phase = SandboxPhase::Unknown;
            }
        }
    }

    /// Re-reads every known sandbox's task (after the event stream was
    /// interrupted, exits may have been missed).
    pub async fn reconcile(&self) {
        let ids: Vec<String> = self.table.read().keys().cloned().collect();
        for id in ids {
            let Some(mut e) = self.table.read().get(&id).cloned() else {
                continue;
            };
            if e.phase == SandboxPhase::Creating {
                continue;
            }
            self.refresh_from_task(&mut e).await;
            if let Some(cur) = self.table.write().get_mut(&id)
                && cur.phase != SandboxPhase::Creating
            {
                cur.phase = e.phase;
                cur.pid = e.pid;
                if e.netns.is_none() {
                    // It exited while the event stream was down.
                    cur.netns = None;
                }
                cur.exit_code = e.exit_code;
                cur.message = e.message;
            }
        }
    }

    /// Releases the network of every sandbox whose container is gone
    /// although nobody deleted it through this agent (the janitor reaped
    /// it, an operator removed it): its namespace, address and rules would
    /// otherwise stay until the agent restarts. A sandbox with an operation
    /// in flight (a create takes its namespace before its container exists)
    /// is left for the next round. Returns how many were released.
    pub async fn release_orphaned_networks(&self) -> usize {
        let Some(network) = self.network() else {
            return 0;
        };
        let mut released = 0;
        for id in network.attached_sandboxes() {
            let lock = self.lock_for(&id);
            let Ok(_guard) = lock.try_lock() else {
                continue;
            };
            if self.container_gone(&id).await {
                tracing::info!(sandbox = %id, "container gone without a delete: releasing its network");
                released += usize::from(network.release(&id).await);
            }
            self.release_lock(&id, &lock);
        }
        released
    }

    /// Releases the volume holds of sandboxes whose container is gone
    /// although nobody deleted it through this agent (the janitor reaped
    /// it, an operator removed it): an RWO volume would otherwise stay
    /// taken, and its restore and delete refused, until the agent restarts.
    /// Sandboxes with an operation in flight are left for the next round.
    /// Returns how many holds were released.
    pub async fn release_orphaned_volumes(&self) -> usize {
        let mut released = 0;
        for id in self.volumes.holding_sandboxes() {
            let lock = self.lock_for(&id);
            let Ok(_guard) = lock.try_lock() else {
                continue;
            };
            if self.container_gone(&id).await {
                tracing::info!(sandbox = %id, "container gone without a delete: releasing its volumes");
                released += self.volumes.release(&id, None);
                if let Some(e) = self.table.write().get_mut(&id) {
                    e.volume_mounts.clear();
                }
            }
            self.release_lock(&id, &lock);
        }
        released
    }

    /// Whether containerd says container `id` does not exist (a failed
    /// lookup is logged and taken for "still there": releasing is only
    /// safe on a definite answer).
    async fn container_gone(&self, id: &str) -> bool {
        let request = self.ctrd.req(GetContainerRequest { id: id.to_string() });
        match self.ctrd.containers().get(request).await {
            Err(s) if s.code() == Code::NotFound => true,
            Ok(_) => false,
            Err(s) => {
                tracing::warn!(sandbox = %id, error = %s, "containers.Get failed");
                false
            }
        }
    }

    /// Reserves the sandbox's named volumes in the mount table. A refusal
    /// because of another holder first releases the holds of sandboxes
    /// whose container is gone, then tries once more: a sandbox removed
    /// behind the agent's back must not keep a volume until the next round.
    async fn reserve_volumes(
        &self,
        id: &str,
        mounts: &[NamedVolumeMount],
        field: &str,
    ) -> Result<()> {
        match self.volumes.reserve(id, mounts, field).await {
            Err(AgentError::VolumeAccess { .. }) if self.release_orphaned_volumes().await > 0 => {
                self.volumes.reserve(id, mounts, field).await
            }
            r => r,
        }
    }

    /// The request's named volumes (reserved by the create), opened
    /// beneath their data and held like the host-path bindings; no two
    /// mounts may share a path.
    async fn with_named_volumes(
        &self,
        spec: &SandboxSpec,
        mut held: Vec<volumes::HeldMount>,
    ) -> Result<Vec<volumes::HeldMount>> {
        for (i, m) in spec.volume_mounts.iter().enumerate() {
            let field = format!("volume_mounts[{i}]");
            held.push(self.open_volume(&spec.sandbox_id, m, &field).await?);
        }
        volumes::check_distinct(&held).map_err(|e| AgentError::Volume(e.to_string()))?;
        Ok(held)
    }

    /// A named volume's directory, held for mounting; with user namespaces
    /// on, a writable one is moved into the sandboxes' id range (the whole
    /// tree once, while no other sandbox mounts it; see
    /// [`crate::userns::own_fd_for_range`]).
    async fn open_volume(
        &self,
        sandbox_id: &str,
        m: &NamedVolumeMount,
        field: &str,
    ) -> Result<volumes::HeldMount> {
        let held = self.volumes.open_mount(m, field).await?;
        if self.cfg.user_namespace.enabled() && !held.read_only {
            let exclusive = self
                .volumes
                .holders(&m.volume)
                .iter()
                .all(|h| h.sandbox_id == sandbox_id);
            let fd = held
                .fd()
                .try_clone()
                .map_err(AgentError::io("holding a volume"))?;
            let base = self.cfg.userns_base;
            tokio::task::spawn_blocking(move || {
                crate::userns::own_fd_for_range(&fd, base, exclusive)
            })
            .await
            .map_err(|e| AgentError::Volume(format!("{field}: {e}")))?
            .map_err(|e| {
                AgentError::Volume(format!(
                    "{field}: giving the volume to the sandboxes' user range: {e}"
                ))
            })?;
        }
        Ok(held)
    }

    /// The pid and named volumes of a sandbox whose task runs (or is
    /// paused): one a volume can be mounted into.
    fn live_task(&self, id: &str, action: &'static str) -> Result<(u32, Vec<NamedVolumeMount>)> {
        let table = self.table.read();
        let e = table
            .get(id)
            .filter(|e| e.warm.is_none())
            .ok_or_else(|| AgentError::SandboxNotFound(id.to_string()))?;
        if e.pid == 0 || !matches!(e.phase, SandboxPhase::Running | SandboxPhase::Paused) {
            return Err(AgentError::WrongPhase {
                id: id.to_string(),
                phase: e.phase.as_str_name(),
                action,
            });
        }
        if e.runtime == crate::gvisor::RUNSC {
            return Err(crate::gvisor::unsupported(
                id,
                action,
                "its file system is gVisor's, served by its gofer; mounts cannot be moved into it",
            ));
        }
        Ok((e.pid, e.volume_mounts.clone()))
    }

    /// Mounts a named volume into a running (or paused) sandbox, with the
    /// access mode enforced as at create. The label is written before the
    /// mount is made: a crash in between leaves the volume held (its
    /// restore and delete refused), never mounted but unrecorded.
    pub async fn attach_volume(
        &self,
        id: &str,
        mount: Option<NamedVolumeMount>,
    ) -> Result<SandboxStatus> {
        let mount = mount.ok_or_else(|| AgentError::InvalidArgument("mount is required".into()))?;
        volume_mounts::validate_one(&mount, "mount")?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let (pid, before) = self.live_task(id, "attach a volume")?;
        if let Some(m) = before.iter().find(|m| m.mount_path == mount.mount_path) {
            return Err(AgentError::InvalidArgument(format!(
                "mount.mount_path: {:?} is already used by volume {:?}",
                mount.mount_path, m.volume
            )));
        }
        self.reserve_volumes(id, std::slice::from_ref(&mount), "mount")
            .await?;
        if let Err(e) = self.attach_reserved(id, pid, &before, &mount).await {
            self.volumes.release(id, Some(&mount.volume));
            return Err(e);
        }
        tracing::info!(sandbox = %id, volume = %mount.volume, mount_path = %mount.mount_path, read_only = mount.read_only, "volume attached");
        self.get(id)
    }

    /// Label, then mount, of a reserved volume; the label is put back when
    /// the mount fails.
    async fn attach_reserved(
        &self,
        id: &str,
        pid: u32,
        before: &[NamedVolumeMount],
        mount: &NamedVolumeMount,
    ) -> Result<()> {
        let held = self.open_volume(id, mount, "mount").await?;
        let mut after = before.to_vec();
        after.push(mount.clone());
        volume_mounts::to_label(&after)?;
        self.write_volume_label(id, &after).await?;
        let sandbox_id = id.to_string();
        let attached = tokio::task::spawn_blocking(move || {
            crate::live_mount::attach(
                pid,
                &sandbox_id,
                held.fd(),
                &held.destination,
                held.read_only,
            )
        })
        .await
        .map_err(|e| AgentError::io("mounting a volume")(e.into()))?;
        if let Err(e) = attached {
            if let Err(undo) = self.write_volume_label(id, before).await {
                tracing::warn!(sandbox = %id, error = %undo, "could not put the volume label back after a failed attach");
            }
            return Err(e.into());
        }
        if let Some(e) = self.table.write().get_mut(id) {
            e.volume_mounts = after;
        }
        Ok(())
    }

    /// Unmounts a named volume from a sandbox (lazily: files open inside
    /// stay usable until closed) and releases it. A sandbox whose task is
    /// gone has nothing mounted any more: only its record changes.
    pub async fn detach_volume(&self, id: &str, volume: &str) -> Result<SandboxStatus> {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let entry = self
            .table
            .read()
            .get(id)
            .filter(|e| e.warm.is_none())
            .cloned()
            .ok_or_else(|| AgentError::SandboxNotFound(id.to_string()))?;
        let mount = entry
            .volume_mounts
            .iter()
            .find(|m| m.volume == volume)
            .cloned()
            .ok_or_else(|| AgentError::VolumeNotMounted {
                sandbox: id.to_string(),
                volume: volume.to_string(),
            })?;
        if entry.pid != 0 && matches!(entry.phase, SandboxPhase::Running | SandboxPhase::Paused) {
            self.unmount_in_task(entry.pid, id, &mount.mount_path)
                .await?;
        }
        let after: Vec<NamedVolumeMount> = entry
            .volume_mounts
            .into_iter()
            .filter(|m| m.volume != volume)
            .collect();
        match self.write_volume_label(id, &after).await {
            // The container went away meanwhile: there is no label to fix.
            Err(e) if e.is_not_found() => {}
            r => r?,
        }
        if let Some(e) = self.table.write().get_mut(id) {
            e.volume_mounts = after;
        }
        self.volumes.release(id, Some(volume));
        tracing::info!(sandbox = %id, volume, mount_path = %mount.mount_path, "volume detached");
        self.get(id)
    }

    /// Unmounts `mount_path` in the task's mount namespace; already
    /// unmounted, or the task gone, count as done.
    async fn unmount_in_task(&self, pid: u32, id: &str, mount_path: &str) -> Result<()> {
        use crate::live_mount::LiveMountError;
        let path = mount_path.to_string();
        let sandbox_id = id.to_string();
        let res =
            tokio::task::spawn_blocking(move || crate::live_mount::detach(pid, &sandbox_id, &path))
                .await
                .map_err(|e| AgentError::io("unmounting a volume")(e.into()))?;
        match res {
            // NotASandbox: the pid now names a process of the agent's own
            // mount namespace, i.e. the task is gone and its pid reused.
            Ok(())
            | Err(
                LiveMountError::NotMounted { .. }
                | LiveMountError::TaskGone { .. }
                | LiveMountError::NotASandbox { .. },
            ) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Rewrites the container's [`labels::VOLUME_MOUNTS`] label (only it:
    /// the mask keeps every other field and label as containerd has it).
    async fn write_volume_label(&self, id: &str, mounts: &[NamedVolumeMount]) -> Result<()> {
        self.ctrd
            .set_container_label(id, labels::VOLUME_MOUNTS, &volume_mounts::to_label(mounts)?)
            .await
            .map_err(AgentError::containerd("containers.Update"))
    }

    /// Captures sandbox `sandbox_id` as snapshot `snapshot_id` (see
    /// [`crate::snapshot`]) under the sandbox's lock (a pause, resume or
    /// delete of it waits for the capture) and the snapshot's. Idempotent
    /// by snapshot id.
    pub async fn create_snapshot(
        &self,
        snapshot_id: &str,
        sandbox_id: &str,
    ) -> Result<SnapshotInfo> {
        snapshot::validate_id(snapshot_id)?;
        validate_id(sandbox_id)?;
        let lock = self.lock_for(sandbox_id);
        let _guard = lock.lock().await;
        let key = snapshot_lock_key(snapshot_id);
        let snapshot_lock = self.lock_for(&key);
        let snapshot_guard = snapshot_lock.lock().await;
        let captured = self.capture_locked(snapshot_id, sandbox_id).await;
        drop(snapshot_guard);
        self.release_lock(&key, &snapshot_lock);
        if !self.table.read().contains_key(sandbox_id) {
            self.release_lock(sandbox_id, &lock);
        }
        captured
    }

    /// The capture, both locks held: the snapshot when it exists already,
    /// else a capture of the sandbox as the table has it.
    async fn capture_locked(&self, snapshot_id: &str, sandbox_id: &str) -> Result<SnapshotInfo> {
        if let Some(info) = self.snapshots.existing(snapshot_id, sandbox_id).await? {
            return Ok(info);
        }
        let source = self.capture_source(sandbox_id)?;
        let info = self.snapshots.capture(snapshot_id, &source).await?;
        // A reconcile that read the task while it was frozen saw it paused.
        if source.running
            && let Some(e) = self.table.write().get_mut(sandbox_id)
            && e.phase == SandboxPhase::Paused
        {
            e.phase = SandboxPhase::Running;
        }
        Ok(info)
    }

    /// What a capture needs of sandbox `id`: it must be a sandbox of the
    /// API (not warm), running or paused.
    fn capture_source(&self, id: &str) -> Result<snapshot::Source> {
        let table = self.table.read();
        let e = table
            .get(id)
            .filter(|e| e.warm.is_none())
            .ok_or_else(|| AgentError::SandboxNotFound(id.to_string()))?;
        if e.runtime == crate::gvisor::RUNSC {
            // gVisor caches file data in its sentry: the writable layer on
            // the node is not a consistent image of the sandbox's files.
            return Err(crate::gvisor::unsupported(
                id,
                "snapshot",
                "gVisor keeps file data in its own kernel, so the writable layer on the node is not a consistent copy; snapshots are for runc sandboxes",
            ));
        }
        let running = match e.phase {
            SandboxPhase::Running => true,
            SandboxPhase::Paused => false,
            phase => {
                return Err(AgentError::WrongPhase {
                    id: id.to_string(),
                    phase: phase.as_str_name(),
                    action: "snapshot",
                });
            }
        };
        Ok(snapshot::Source {
            sandbox_id: id.to_string(),
            name: e.name.clone(),
            namespace: e.namespace.clone(),
            image: e.image.clone(),
            running,
            volume_mounts: e.volume_mounts.clone(),
        })
    }

    /// Deletes snapshot `snapshot_id` (see [`Snapshots::delete`]) under its
    /// lock. Returns whether it existed.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<bool> {
        snapshot::validate_id(snapshot_id)?;
        let key = snapshot_lock_key(snapshot_id);
        let lock = self.lock_for(&key);
        let guard = lock.lock().await;
        let deleted = self.snapshots.delete(snapshot_id).await;
        drop(guard);
        self.release_lock(&key, &lock);
        deleted
    }

    /// For a restore (`snapshot_id` set): the parent of its writable layer,
    /// checked (see [`Snapshots::restore_parent`]), with the snapshot's
    /// lock, which keeps a delete off the snapshot until the layer exists.
    async fn restore_parent(
        &self,
        spec: &SandboxSpec,
    ) -> Result<Option<(String, tokio::sync::OwnedMutexGuard<()>)>> {
        if spec.snapshot_id.is_empty() {
            return Ok(None);
        }
        let held = self
            .lock_for(&snapshot_lock_key(&spec.snapshot_id))
            .lock_owned()
            .await;
        let parent = self
            .snapshots
            .restore_parent(&spec.snapshot_id, &spec.image)
            .await?;
        Ok(Some((parent, held)))
    }

    /// A task's init process exited.
    pub fn on_exit(&self, container_id: &str, exit_status: u32) {
        if let Some(e) = self.table.write().get_mut(container_id) {
            e.exited(exit_status);
            tracing::info!(sandbox = %container_id, exit_status, phase = ?e.phase, warm = e.warm.is_some(), "sandbox exited");
            if e.warm.is_some() {
                // The warm pool removes and replaces it.
                self.warm_wake.notify_one();
            }
        }
    }

    /// Running user sandboxes with an ephemeral-storage limit, and it.
    pub fn storage_limited(&self) -> Vec<(String, u64)> {
        self.table
            .read()
            .values()
            .filter(|e| e.warm.is_none() && e.phase == SandboxPhase::Running)
            .filter(|e| e.ephemeral_storage_limit > 0)
            .map(|e| (e.id.clone(), e.ephemeral_storage_limit))
            .collect()
    }

    /// Says why the agent stopped sandbox `id` (its status message).
    pub fn set_message(&self, id: &str, message: &str) {
        if let Some(e) = self.table.write().get_mut(id) {
            e.message = message.to_string();
        }
    }

    pub fn on_oom(&self, container_id: &str) {
        if let Some(e) = self.table.write().get_mut(container_id) {
            e.message = "out of memory: the memory limit was hit".into();
        }
    }
}

/// A recovered sandbox's namespace, opened from its task's init process
/// (checked to be in the sandbox's cgroup) while the task is alive.
fn recovered_netns(e: &Entry) -> Option<Arc<crate::netns::NetnsHandle>> {
    if e.pid == 0 || !matches!(e.phase, SandboxPhase::Running | SandboxPhase::Paused) {
        return None;
    }
    match crate::netns::NetnsHandle::of_task(e.pid, &e.id) {
        Ok(netns) => Some(Arc::new(netns)),
        Err(err) => {
            // Exited meanwhile (the exit event follows), or not the sandbox's
            // process: it is not routed.
            tracing::warn!(sandbox = %e.id, pid = e.pid, error = %err, "cannot open the network namespace of a recovered sandbox");
            None
        }
    }
}

impl proxy::SandboxLookup for Sandboxes {
    fn lookup(&self, sandbox_id: &str) -> Option<proxy::Route> {
        let t = self.table.read();
        // Warm sandboxes have no owner to route for.
        let e = t.get(sandbox_id).filter(|e| e.warm.is_none())?;
        // Only live sandboxes route, through the namespace held since
        // their task started (never a pid: it could name another process).
        if !matches!(e.phase, SandboxPhase::Running) {
            return None;
        }
        Some(proxy::Route {
            upstream: self.upstream_of(e)?,
            token_sha256: e.token_sha256,
        })
    }
}

/// The two freezer transitions: one of these, never a `bool`.
#[derive(Debug, Clone, Copy)]
enum Freeze {
    Pause,
    Resume,
}

impl Freeze {
    fn source(self) -> SandboxPhase {
        match self {
            Freeze::Pause => SandboxPhase::Running,
            Freeze::Resume => SandboxPhase::Paused,
        }
    }

    fn target(self) -> SandboxPhase {
        match self {
            Freeze::Pause => SandboxPhase::Paused,
            Freeze::Resume => SandboxPhase::Running,
        }
    }

    fn action(self) -> &'static str {
        match self {
            Freeze::Pause => "pause",
            Freeze::Resume => "resume",
        }
    }

    fn rpc(self) -> &'static str {
        match self {
            Freeze::Pause => "tasks.Pause",
            Freeze::Resume => "tasks.Resume",
        }
    }
}

/// A policy was asked for, and this agent runs without networking.
fn no_network_for_policy() -> AgentError {
    AgentError::NetworkUnavailable(
        "network_policy_json: this agent runs without sandbox networking (--network none), so it cannot enforce a network policy; only allow-all (empty) is accepted".into(),
    )
}

fn entry_from_labels(c: &Container) -> Option<Entry> {
    let l = &c.labels;
    let get = |k: &str| l.get(k).cloned().unwrap_or_default();
    let mut token_sha256 = [0u8; 32];
    hex::decode_to_slice(l.get(labels::TOKEN_SHA256)?, &mut token_sha256).ok()?;
    Some(Entry {
        id: c.id.clone(),
        name: get(labels::NAME),
        namespace: get(labels::NAMESPACE),
        record_uid: get(labels::RECORD_UID),
        image: get(labels::IMAGE),
        runtime: get(labels::RUNTIME),
        pool: get(labels::POOL),
        created_at_ms: get(labels::CREATED_AT).parse().unwrap_or(0),
        phase: SandboxPhase::Unknown,
        exit_code: 0,
        pid: 0,
        netns: None,
        message: get(crate::storage_limit::STOP_REASON_LABEL),
        exposed_ports: get(labels::EXPOSED_PORTS)
            .split(',')
            .filter_map(|p| p.parse().ok())
            .collect(),
        token_sha256,
        volume_mounts: volume_mounts_from_labels(c),
        ephemeral_storage_limit: get(crate::storage_limit::LIMIT_LABEL).parse().unwrap_or(0),
        warm: None,
    })
}

/// The sandbox's named volume mounts from its label. An unreadable label
/// (only the agent writes it) is logged and read as none: the sandbox is
/// still recovered, and deleting it stays possible.
fn volume_mounts_from_labels(c: &Container) -> Vec<NamedVolumeMount> {
    let value = c
        .labels
        .get(labels::VOLUME_MOUNTS)
        .map_or("", String::as_str);
    volume_mounts::from_label(value).unwrap_or_else(|e| {
        tracing::warn!(container = %c.id, error = %e, value, "unreadable volume mounts label; its volumes are not held");
        Vec::new()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_containerd_rules() {
        for ok in ["a", "sb-1", "A.b_c", &"x".repeat(76)] {
            assert!(validate_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a/b", "../x", "a b", &"x".repeat(77)] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn labels_round_trip_into_an_entry() {
        let token = sandbolt_proto::auth::token_digest(b"tok");
        let c = Container {
            id: "sb1".into(),
            labels: HashMap::from([
                (labels::MANAGED.to_string(), "true".to_string()),
                (labels::NAME.to_string(), "n".to_string()),
                (labels::TOKEN_SHA256.to_string(), hex::encode(token)),
                (labels::CREATED_AT.to_string(), "42".to_string()),
                (labels::EXPOSED_PORTS.to_string(), "8080,9000".to_string()),
            ]),
            ..Default::default()
        };
        let e = entry_from_labels(&c).unwrap();
        assert_eq!(e.name, "n");
        assert_eq!(e.token_sha256, token);
        assert_eq!(e.created_at_ms, 42);
        assert_eq!(e.exposed_ports, vec![8080, 9000]);
        assert!(e.volume_mounts.is_empty());
        let mut with_volume = c.clone();
        let mounts = vec![NamedVolumeMount {
            volume: "data".into(),
            sub_path: "a".into(),
            mount_path: "/data".into(),
            read_only: true,
        }];
        with_volume.labels.insert(
            labels::VOLUME_MOUNTS.to_string(),
            volume_mounts::to_label(&mounts).unwrap(),
        );
        assert_eq!(
            entry_from_labels(&with_volume).unwrap().volume_mounts,
            mounts
        );
        let mut no_token = c.clone();
        no_token.labels.remove(labels::TOKEN_SHA256);
        assert!(entry_from_labels(&no_token).is_none());
    }
}
