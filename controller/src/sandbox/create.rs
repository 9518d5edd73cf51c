//! Create: validate → place → (record) → agent create → (record).
//!
//! *Strong*: reserve a slot, commit the record (phase Pending), then ask the
//! agent; a crash after the commit leaves a record that a restarted
//! controller re-drives (the agent create is idempotent by sandbox id), so an
//! acknowledged sandbox is always backed by its record.
//!
//! *Fast*: reserve, ask the agent, then commit the record with retries; if the
//! record can never be written the container is deleted, so a sandbox the
//! client never heard about does not live on. A crash between the two leaves
//! a container without a record: its slot stays counted (the agent reports
//! it) and the controller's orphan check removes it.
//!
//! Both are idempotent by request id.

use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};

use crate::clock;
use crate::config::{ControllerConfig, Failpoint, failpoint};
use crate::error::{Error, Result};
use crate::ids::{AgentId, SandboxId, SandboxKey};
use crate::limits;
use crate::metrics::CreateStage;
use crate::placement::PlacementRequest;
use crate::sandbox::Core;
use crate::sandbox::shared::agent_spec;
use crate::sandbox::volumes::VolumeNeeds;
use crate::store::{Consistency, Phase, SandboxRecord, SandboxSpec, StoreError};
use crate::warm::Placed;

/// A create request, from any API. [`Core::create`] validates it and
/// applies the pool's defaults and maxima to its spec. Its `Debug` hides
/// the values of `secret_env_names` (see `token.rs`).
#[derive(Clone, Default)]
pub struct CreateRequest {
    /// Idempotency key; empty = none.
    pub request_id: String,
    /// Empty: the request id, or generated.
    pub name: String,
    pub namespace: String,
    /// `None`: the server default.
    pub consistency: Option<Consistency>,
    /// Answer only when execd inside answers (v2 completion READY).
    pub wait_for_execd: bool,
    /// Moved into the record as it is: the only copy is the agent's.
    pub spec: SandboxSpec,
    /// Names in `spec.envs` whose values are secret: [`Core::validate`]
    /// moves them into `spec.sealed_envs`, sealed.
    pub secret_env_names: Vec<String>,
}

/// What the agent answered a create with.
#[derive(Debug, Clone)]
pub(crate) struct AgentCreated {
    /// The record's event text (where, and the create's timings).
    pub(crate) event: String,
    /// The sandbox's address on the node's network ("" without networking).
    pub(crate) ip_address: String,
    /// Served by claiming a warm sandbox.
    pub(crate) claimed_warm: bool,
}

impl CreateRequest {
    fn key(&self) -> SandboxKey {
        SandboxKey::new(&self.namespace, self.name.clone())
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
}

pub(crate) fn new_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The waits between the fast mode's record commit attempts.
pub(crate) fn record_commit_backoff(config: &ControllerConfig) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(20))
        .with_factor(2.0)
        .with_max_delay(Duration::from_millis(1280))
        .with_max_times(config.record_commit_attempts.max(1) as usize - 1)
}

/// The sum of [`record_commit_backoff`]'s waits.
pub(crate) fn record_commit_waits(config: &ControllerConfig) -> Duration {
    record_commit_backoff(config).build().sum()
}

impl Core {
    pub async fn create(&self, mut req: CreateRequest) -> Result<SandboxRecord> {
        self.require_ready()?;
        self.pool_from_volumes(&mut req);
        let req = self.validate(req)?;
        if !req.request_id.is_empty()
            && let Some(existing) = self.store.get_by_request_id(&req.request_id)?
        {
            return self.finish_existing(existing, &req).await;
        }
        // A name already taken is answered from the store before any
        // container exists. Strong mode would learn it from its record
        // commit anyway; fast mode would otherwise start a container just to
        // remove it again, and report that container's failure (e.g. an
        // image whose entrypoint exits) instead of ALREADY_EXISTS. The commit
        // still checks, for creates racing on one name.
        if let Some(holder) = self.store.get(&req.key())? {
            return self.on_name_taken(holder, &req).await;
        }
        match req.consistency.unwrap_or(self.config.default_consistency) {
            Consistency::Strong => self.create_strong(req).await,
            Consistency::Fast => self.create_fast(req).await,
        }
    }

    /// Checks a create request and completes it: namespace, name, the
    /// snapshot it restores, the template its image names, the pool's
    /// limits and runtime.
    #[tracing::instrument(skip_all, fields(namespace = %req.namespace, sandbox = %req.name, pool = %req.spec.pool, snapshot = %req.spec.snapshot_id))]
    pub fn validate(&self, mut req: CreateRequest) -> Result<CreateRequest> {
        let key = req.key();
        req.namespace = key.namespace;
        if !valid_name(&req.namespace) {
            return Err(Error::InvalidArgument(format!(
                "invalid namespace {:?}",
                req.namespace
            )));
        }
        // Before the pool's default: a restore's pool defaults to its snapshot's.
        let restore = self.resolve_snapshot(&mut req)?;
        let spec = &mut req.spec;
        spec.pool = crate::placement::or_default(spec.pool.trim()).to_string();
        // A restore is never a warm pool member: `pool` is an agent pool.
        // A template names the image a warm pool may be of: resolved first.
        if !restore {
            self.resolve_template(&req.namespace, spec)?;
            self.resolve_warm_pool(spec)?;
        }
        if spec.image.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "image is required (unless pool names a warm pool, whose template gives it, or snapshot_id a snapshot)".into(),
            ));
        }
        sandbolt_image_ref::ImageRef::parse(&spec.image)
            .map_err(|e| Error::InvalidArgument(format!("image: {e}")))?;
        if req.name.is_empty() {
            req.name = if req.request_id.is_empty() {
                format!("sbx-{}", new_token())
            } else {
                req.request_id.clone()
            };
        }
        if !valid_name(&req.name) {
            return Err(Error::InvalidArgument(format!(
                "invalid sandbox name {:?}: use letters, digits, '-', '.', '_' (at most 253)",
                req.name
            )));
        }
        check_times_and_ports(spec)?;
        let policy = self
            .registry
            .pool_policy(&self.registry.pool_key(&req.namespace, &spec.pool));
        spec.resources = limits::resolve(&spec.resources, &spec.pool, policy.as_ref())?;
        spec.runtime = limits::runtime(&spec.runtime, policy.as_ref())?;
        limits::check_all_volumes(&spec.volumes, &spec.pvc_volumes)?;
        for v in &mut spec.pvc_volumes {
            // The controller's mark, whatever a request says.
            v.created_by_sandbox = false;
            crate::volume::check_backend(&format!("volumes[{}].pvc.backend", v.name), &v.backend)?;
            crate::volume::parse_size(&format!("volumes[{}].pvc.size", v.name), &v.size)?;
        }
        self.seal_secret_env(&mut req)?;
        Ok(req)
    }

    #[tracing::instrument(skip_all, fields(namespace = %req.namespace, sandbox = %req.name, sandbox_id))]
    async fn create_strong(&self, req: CreateRequest) -> Result<SandboxRecord> {
        let wait_for_execd = req.wait_for_execd;
        let (mut r, req) = new_record(req, Consistency::Strong);
        let cold_id = r.sandbox_id.clone();
        let _inflight = self.inflight(&cold_id);
        self.timed_place_for_create(&mut r).await?;
        // A claim gave the create the warm sandbox's id.
        let claimed = r.sandbox_id != cold_id;
        let _claimed = claimed.then(|| self.inflight(&r.sandbox_id));
        tracing::Span::current().record("sandbox_id", r.sandbox_id.as_str());
        r.push_event(
            "info",
            "controller",
            "record committed before create (strong)",
        );
        let r = match self.commit_record(&r) {
            Ok(r) => r,
            Err(e) => {
                self.registry.release(&r.agent_id, &r.sandbox_id);
                self.discard_created_volumes(&r).await;
                return match e {
                    StoreError::AlreadyExists(holder) => self.on_name_taken(*holder, &req).await,
                    e => Err(e.into()),
                };
            }
        };
        failpoint(&self.config, Failpoint::StrongAfterRecord, &r.name).await;
        match self.agent_create(&r, wait_for_execd).await {
            Ok(created) => self.mark_running(&r, created).await,
            Err(e) if claimed && refused_claim(&e) => {
                self.strong_after_refused_claim(r, wait_for_execd).await
            }
            Err(e) => {
                self.avoid_unreachable(&r, &e);
                tracing::warn!(sandbox = %r.name, agent = %r.agent_id, error = %e, "strong create failed");
                self.discard_container(&r).await;
                let _ = self.store.delete(&r.key());
                self.untrack_expiry(&r);
                self.registry.release(&r.agent_id, &r.sandbox_id);
                self.discard_created_volumes(&r).await;
                // Its record held the snapshot while it existed.
                if !r.spec.snapshot_id.is_empty() {
                    self.snapshot_released(&r.spec.snapshot_id).await;
                }
                Err(e)
            }
        }
    }

    #[tracing::instrument(skip_all, fields(namespace = %req.namespace, sandbox = %req.name, sandbox_id))]
    async fn create_fast(&self, req: CreateRequest) -> Result<SandboxRecord> {
        let wait_for_execd = req.wait_for_execd;
        let (mut r, req) = new_record(req, Consistency::Fast);
        let cold_id = r.sandbox_id.clone();
        let _inflight = self.inflight(&cold_id);
        self.timed_place_for_create(&mut r).await?;
        let claimed = r.sandbox_id != cold_id;
        let _claimed = claimed.then(|| self.inflight(&r.sandbox_id));
        tracing::Span::current().record("sandbox_id", r.sandbox_id.as_str());
        let mut created = self.agent_create(&r, wait_for_execd).await;
        let mut _retry = None;
        if claimed && created.as_ref().is_err_and(refused_claim) {
            // Nothing is committed: the create starts over, cold, under a
            // fresh id (the warm id is another sandbox's: never removed).
            self.registry.release(&r.agent_id, &r.sandbox_id);
            r.sandbox_id = SandboxId::generate();
            _retry = Some(self.inflight(&r.sandbox_id));
            self.place_cold_after_claim(&mut r)?;
            created = self.agent_create(&r, wait_for_execd).await;
        }
        if let Err(e) = &created
            && self.avoid_unreachable(&r, e)
            && !claimed
            && r.spec.pvc_volumes.is_empty()
            && r.spec.snapshot_id.is_empty()
        {
            // Nothing reached the agent and nothing is committed: the
            // create goes to another agent, once.
            let refused = r.agent_id.clone();
            self.registry.release(&refused, &r.sandbox_id);
            self.place_cold_elsewhere(&mut r, &refused)?;
            created = self.agent_create(&r, wait_for_execd).await;
        }
        match created {
            Ok(created) => {
                r.set_phase(Phase::Running);
                r.ip_address = created.ip_address;
                r.claimed_warm = created.claimed_warm;
                r.push_event("info", "agent", created.event);
            }
            Err(e) => {
                tracing::warn!(sandbox = %r.name, agent = %r.agent_id, error = %e, "fast create failed");
                self.discard_container(&r).await;
                self.registry.release(&r.agent_id, &r.sandbox_id);
                self.discard_created_volumes(&r).await;
                return Err(e);
            }
        }
        failpoint(&self.config, Failpoint::FastAfterCreate, &r.name).await;
        r.push_event("info", "controller", "record committed after create (fast)");
        let committed = (|| async { self.commit_record(&r) })
            .retry(record_commit_backoff(&self.config))
            .when(|e| !matches!(e, StoreError::AlreadyExists(_)))
            .notify(|e, wait| tracing::warn!(sandbox = %r.name, error = %e, ?wait, "fast mode: record commit failed; retrying"))
            .await;
        // From here on the client hears "failed" or another sandbox's name:
        // the container must not stay behind.
        let failed = match committed {
            Ok(r) => return Ok(r),
            Err(e) => e,
        };
        self.discard_container(&r).await;
        self.registry.release(&r.agent_id, &r.sandbox_id);
        self.discard_created_volumes(&r).await;
        match failed {
            StoreError::AlreadyExists(holder) => self.on_name_taken(*holder, &req).await,
            e => Err(Error::Unavailable(format!(
                "sandbox {}: the record could not be written after {} attempts ({e}); the container was removed",
                r.name,
                self.config.record_commit_attempts.max(1)
            ))),
        }
    }

    /// [`Core::place_for_create`], timed as the create's `place` stage.
    async fn timed_place_for_create(&self, r: &mut SandboxRecord) -> Result<()> {
        let started = Instant::now();
        self.place_for_create(r).await?;
        self.metrics
            .observe_stage(CreateStage::Place, started.elapsed());
        Ok(())
    }

    /// Reserves a slot for `r` and fills in its agent; `exclude` is an agent
    /// that must not get it (a gone agent, when recreating); `volumes` pins
    /// it to its volumes' agent or asks for a volume root.
    #[tracing::instrument(skip_all, fields(sandbox = %r.name, sandbox_id = %r.sandbox_id, agent))]
    pub(crate) fn place(
        &self,
        r: &mut SandboxRecord,
        exclude: Option<&AgentId>,
        volumes: &VolumeNeeds,
    ) -> Result<()> {
        self.place_with(r, exclude, volumes, None)?;
        // A recreated member of a warm pool stays one (never refused).
        if !r.spec.warm_pool.is_empty() {
            self.registry
                .add_warm_member(&r.sandbox_id, &r.spec.warm_pool);
        }
        Ok(())
    }

    /// Placement of a create: a warm claim when one serves it and `claim`
    /// allows it, else cold (within its warm pool's `pool_max`, if any).
    pub(crate) fn place_create(
        &self,
        r: &mut SandboxRecord,
        volumes: &VolumeNeeds,
        claim: bool,
    ) -> Result<()> {
        self.place_with(r, None, volumes, Some(claim))
    }

    /// After the agent refused a claim (the warm id is another sandbox's):
    /// a cold placement under `r`'s new id.
    pub(crate) fn place_cold_after_claim(&self, r: &mut SandboxRecord) -> Result<()> {
        r.push_event(
            "warning",
            "controller",
            "the agent refused the warm claim (its id is another sandbox's); creating cold",
        );
        self.place_with(r, None, &VolumeNeeds::default(), Some(false))
    }

    /// After `refused` could not be reached: a cold placement on another
    /// agent (a plain create only: no volumes or snapshot pin it).
    fn place_cold_elsewhere(&self, r: &mut SandboxRecord, refused: &AgentId) -> Result<()> {
        r.push_event(
            "warning",
            "controller",
            format!("agent {refused} refused the connection; placing on another agent"),
        );
        self.place_with(r, Some(refused), &VolumeNeeds::default(), Some(false))
    }

    /// When `e` says `r`'s agent could not be reached at all (connection
    /// refused: its API is down, e.g. the agent restarts), takes the agent
    /// out of placement until its next heartbeat, so the creates after this
    /// one do not pick it again (it looks least loaded: its creates fail and
    /// free their slots) until it is lost. True when that was the case.
    fn avoid_unreachable(&self, r: &SandboxRecord, e: &Error) -> bool {
        if !connection_refused(e) {
            return false;
        }
        if self.registry.mark_unreachable(&r.agent_id) {
            tracing::warn!(agent = %r.agent_id, "agent refused the connection: out of placement until it heartbeats again");
        }
        true
    }

    /// `warm`: `Some(claim)` for a create (see [`Core::place_create`]).
    fn place_with(
        &self,
        r: &mut SandboxRecord,
        exclude: Option<&AgentId>,
        volumes: &VolumeNeeds,
        warm: Option<bool>,
    ) -> Result<()> {
        let pool = self.registry.pool_key(&r.namespace, &r.spec.pool);
        let key = sandbolt_image_ref::match_key(&r.spec.image);
        let exclude: Vec<&str> = exclude.map(|a| a.as_str()).into_iter().collect();
        let (ports, runtime) = (r.spec.exposed_ports.clone(), r.spec.runtime.clone());
        let req = PlacementRequest {
            pool: &pool,
            image_key: &key,
            ports: &ports,
            exclude: &exclude,
            runtime: (!runtime.is_empty()).then_some(runtime.as_str()),
            pin: volumes.pin.as_deref(),
            volume_root: volumes.volume_root(),
            shared_volumes: volumes.shared,
        };
        let placed = match warm {
            Some(claim) => self.place_warm(r, &req, claim)?,
            None => None,
        };
        let p = match placed {
            Some(Placed::Claimed) => {
                tracing::Span::current().record("agent", r.agent_id.as_str());
                return Ok(());
            }
            Some(Placed::Cold(p)) => p,
            // A create (not a recreate) is bounded by its pool's maximum.
            None if warm.is_some() => self.registry.allocate_new(&req, &r.sandbox_id)?,
            None => self.registry.allocate(&req, &r.sandbox_id)?,
        };
        tracing::Span::current().record("agent", p.agent.as_str());
        r.agent_id = p.agent;
        r.push_event(
            "info",
            "controller",
            format!(
                "placed on agent {} (score {}, image {}{})",
                r.agent_id,
                p.score,
                if p.image_cached {
                    "cached"
                } else {
                    "not cached"
                },
                if volumes.pin.is_some() {
                    ", where its volumes are"
                } else {
                    ""
                }
            ),
        );
        Ok(())
    }

    /// Asks the agent to create `r`'s container.
    #[tracing::instrument(skip_all, fields(sandbox = %r.name, sandbox_id = %r.sandbox_id, agent = %r.agent_id))]
    pub(crate) async fn agent_create(
        &self,
        r: &SandboxRecord,
        wait_for_execd: bool,
    ) -> Result<AgentCreated> {
        let agent = self
            .registry
            .agent(&r.agent_id)
            .ok_or_else(|| Error::Unavailable(format!("agent {} vanished", r.agent_id)))?;
        let started = Instant::now();
        let resp = self
            .agents
            .create(
                &r.agent_id,
                &agent.api_endpoint,
                agent_spec(r, wait_for_execd, &self.secrets)?,
                self.config.create_deadline,
            )
            .await?;
        let stage = if resp.claimed_warm {
            CreateStage::WarmClaim
        } else {
            CreateStage::AgentCreate
        };
        self.metrics.observe_stage(stage, started.elapsed());
        let t = resp.timings.unwrap_or_default();
        let event = if resp.claimed_warm {
            format!(
                "claimed warm sandbox {} of pool {} on agent {} (claim {} µs)",
                r.sandbox_id, r.spec.warm_pool, r.agent_id, t.claimed_us
            )
        } else {
            format!(
                "container created on {} (image {} µs, container {} µs, task {} µs, execd {} µs)",
                r.agent_id,
                t.image_resolved_us,
                t.container_created_us,
                t.task_started_us,
                t.execd_ready_us
            )
        };
        Ok(AgentCreated {
            event,
            ip_address: resp.status.map(|s| s.ip_address).unwrap_or_default(),
            claimed_warm: resp.claimed_warm,
        })
    }

    /// Writes a new record and indexes its expiry.
    #[tracing::instrument(skip_all, fields(sandbox = %r.name, sandbox_id = %r.sandbox_id, agent = %r.agent_id, phase = ?r.phase))]
    fn commit_record(&self, r: &SandboxRecord) -> Result<SandboxRecord, StoreError> {
        let started = Instant::now();
        let written = self.store.create(r);
        self.metrics
            .observe_stage(CreateStage::Record, started.elapsed());
        let r = written?;
        self.track_expiry(&r, None);
        Ok(r)
    }

    /// Pending → Running once the agent confirmed the container.
    pub(crate) async fn mark_running(
        &self,
        r: &SandboxRecord,
        created: AgentCreated,
    ) -> Result<SandboxRecord> {
        let sid = r.sandbox_id.clone();
        let started = Instant::now();
        let marked = self.modify(&r.key(), |x| {
            if x.sandbox_id != sid {
                return Err(Error::Aborted(format!(
                    "sandbox {} was reassigned meanwhile",
                    x.name
                )));
            }
            x.phase = Phase::Running;
            x.ip_address.clone_from(&created.ip_address);
            x.claimed_warm |= created.claimed_warm;
            x.push_event("info", "agent", created.event.clone());
            Ok(())
        });
        self.metrics
            .observe_stage(CreateStage::Record, started.elapsed());
        match marked {
            Ok(r) => Ok(r),
            Err(e @ (Error::NotFound(..) | Error::Aborted(_))) => {
                // Deleted (or replaced) while we were creating: ours is an orphan.
                self.discard_container(r).await;
                self.registry.release(&r.agent_id, &r.sandbox_id);
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// The name or request id is taken by `holder`.
    async fn on_name_taken(
        &self,
        holder: SandboxRecord,
        req: &CreateRequest,
    ) -> Result<SandboxRecord> {
        if !req.request_id.is_empty() && holder.request_id == req.request_id {
            return self.finish_existing(holder, req).await;
        }
        Err(Error::AlreadyExists(holder.key()))
    }

    /// A retry of a create that already has a record: answer with it, after
    /// finishing it if the process that started it is gone.
    async fn finish_existing(
        &self,
        existing: SandboxRecord,
        req: &CreateRequest,
    ) -> Result<SandboxRecord> {
        if existing.namespace != req.namespace || existing.name != req.name {
            return Err(Error::AlreadyExists(existing.key()));
        }
        if existing.phase != Phase::Pending {
            return Ok(existing);
        }
        let deadline = tokio::time::Instant::now() + self.config.create_deadline;
        let mut r = existing;
        // Polls the creator in this process until it is done (not a retry).
        while self.is_inflight(&r.sandbox_id) {
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "sandbox {} is still being created",
                    r.name
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            match self.store.get(&r.key())? {
                Some(x) if x.phase != Phase::Pending => return Ok(x),
                Some(x) => r = x,
                None => {
                    return Err(Error::Unavailable(format!(
                        "sandbox {}: the create failed; retry",
                        r.name
                    )));
                }
            }
        }
        self.redrive(r, req.wait_for_execd).await
    }

    /// Completes a Pending record whose creator died (restart recovery, or a
    /// client retry). The agent create is idempotent by sandbox id.
    #[tracing::instrument(skip_all, fields(namespace = %r.namespace, sandbox = %r.name, sandbox_id = %r.sandbox_id, agent = %r.agent_id))]
    pub(crate) async fn redrive(
        &self,
        r: SandboxRecord,
        wait_for_execd: bool,
    ) -> Result<SandboxRecord> {
        let _inflight = self.inflight(&r.sandbox_id);
        // Someone else may have finished it between the check and the guard.
        let r = match self.store.get(&r.key())? {
            Some(x) if x.phase == Phase::Pending && x.sandbox_id == r.sandbox_id => x,
            Some(x) => return Ok(x),
            None => return Err(Error::NotFound(r.key())),
        };
        if !self.registry.is_live(&r.agent_id) {
            return Err(Error::Unavailable(format!(
                "agent {} of pending sandbox {} is not live yet",
                r.agent_id, r.name
            )));
        }
        tracing::info!("re-driving pending create");
        let mut created = self.agent_create(&r, wait_for_execd).await?;
        self.recovering.lock().remove(&r.key());
        created
            .event
            .push_str(" (re-driven after controller restart)");
        self.mark_running(&r, created).await
    }
}

fn check_times_and_ports(spec: &SandboxSpec) -> Result<()> {
    if spec.expires_at < 0 {
        return Err(Error::InvalidArgument(
            "expires_at_unix_seconds must not be negative".into(),
        ));
    }
    if spec.expires_at != 0 && spec.expires_at <= clock::now_unix_secs() {
        return Err(Error::InvalidArgument(format!(
            "expires_at_unix_seconds {} is not in the future",
            spec.expires_at
        )));
    }
    if spec.recovery_timeout_seconds < 0 {
        return Err(Error::InvalidArgument(
            "recovery_timeout_seconds must not be negative".into(),
        ));
    }
    if let Some(p) = spec.exposed_ports.iter().find(|p| **p == 0 || **p > 65535) {
        return Err(Error::InvalidArgument(format!(
            "exposed port {p} is out of range"
        )));
    }
    Ok(())
}

/// A Pending record for a validated request: its spec moves in as it is.
/// The request comes back without its spec, for the name-taken answer.
fn new_record(mut req: CreateRequest, consistency: Consistency) -> (SandboxRecord, CreateRequest) {
    let now_ms = clock::now_unix_ms();
    let r = SandboxRecord {
        uid: uuid::Uuid::new_v4().to_string(),
        name: req.name.clone(),
        namespace: req.namespace.clone(),
        sandbox_id: SandboxId::generate(),
        agent_id: AgentId::default(),
        spec: std::mem::take(&mut req.spec),
        reset_revision: String::new(),
        generation: 1,
        phase: Phase::Pending,
        message: String::new(),
        request_id: req.request_id.clone(),
        // Derived from the controller's key when needed, never stored.
        access_token: String::new(),
        consistency,
        created_at_unix_ms: now_ms,
        assignment_attempt: 1,
        recovery_deadline_unix_ms: 0,
        events: Vec::new(),
        revision: String::new(),
        last_transition_unix_ms: now_ms,
        network_policy_pending: false,
        network_policy_transition_unix_ms: now_ms,
        ip_address: String::new(),
        claimed_warm: false,
        // The store fills them from the object it writes (if it has one).
        api_uid: String::new(),
        api_generation: 0,
    };
    (r, req)
}

/// The agent call failed to connect (connection refused): the request
/// never left this process.
fn connection_refused(e: &Error) -> bool {
    let Error::Agent { status, .. } = e else {
        return false;
    };
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        source = s.source();
    }
    false
}

/// The agent refused a claim: the warm id names a sandbox of another
/// identity (never handed to a second create).
fn refused_claim(e: &Error) -> bool {
    matches!(e, Error::Agent { status, .. } if status.code() == tonic::Code::AlreadyExists)
}
