//! The two create flows.
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

use std::time::Duration;

use crate::clock;
use crate::config::{Failpoint, failpoint};
use crate::error::{Error, Result};
use crate::placement::PlacementRequest;
use crate::sandboxes::{Core, CreateSpec, new_id};
use crate::store::{Consistency, Phase, SandboxRecord, StoreError};

impl Core {
    pub async fn create(&self, spec: CreateSpec) -> Result<SandboxRecord> {
        self.require_ready()?;
        let spec = self.validate(spec)?;
        if !spec.request_id.is_empty()
            && let Some(existing) = self.store.get_by_request_id(&spec.request_id)?
        {
            return self.finish_existing(existing, &spec).await;
        }
        // A name already taken is answered from the store before any
        // container exists. Strong mode would learn it from its record
        // commit anyway; fast mode would otherwise start a container just to
        // remove it again, and report that container's failure (e.g. an
        // image whose entrypoint exits) instead of ALREADY_EXISTS. The commit
        // still checks, for creates racing on one name.
        if let Some(holder) = self.store.get(&spec.namespace, &spec.name)? {
            return self.on_name_taken(holder, &spec).await;
        }
        match spec.consistency.unwrap_or(self.config.default_consistency) {
            Consistency::Strong => self.create_strong(spec).await,
            Consistency::Fast => self.create_fast(spec).await,
        }
    }

    fn new_record(&self, spec: &CreateSpec, consistency: Consistency) -> SandboxRecord {
        let now_ms = clock::now_unix_ms();
        SandboxRecord {
            uid: uuid::Uuid::new_v4().to_string(),
            name: spec.name.clone(),
            namespace: spec.namespace.clone(),
            sandbox_id: new_id("sb-"),
            agent_id: String::new(),
            pool: spec.pool.clone(),
            image: spec.image.clone(),
            command: spec.command.clone(),
            args: spec.args.clone(),
            envs: spec.envs.clone(),
            working_dir: spec.working_dir.clone(),
            exposed_ports: spec.exposed_ports.clone(),
            metadata: spec.metadata.clone(),
            expires_at: spec.expires_at,
            failure_policy: spec.failure_policy,
            recovery_timeout_seconds: spec.recovery_timeout_seconds,
            reset_revision: String::new(),
            generation: 1,
            phase: Phase::Pending,
            message: String::new(),
            request_id: spec.request_id.clone(),
            access_token: new_id(""),
            consistency,
            created_at_unix_ms: now_ms,
            assignment_attempt: 1,
            recovery_deadline_unix_ms: 0,
            events: Vec::new(),
            revision: String::new(),
            resources: spec.resources.clone(),
            volumes: spec.volumes.clone(),
            runtime: spec.runtime.clone(),
            last_transition_unix_ms: now_ms,
        }
    }

    /// Reserves a slot for `r` and fills in its agent.
    fn place(&self, r: &mut SandboxRecord, exclude: &[&str]) -> Result<()> {
        let pool = self.registry.pool_key(&r.namespace, &r.pool);
        let key = sandbolt_image_ref::match_key(&r.image);
        let req = PlacementRequest {
            pool: &pool,
            image_key: &key,
            ports: &r.exposed_ports,
            exclude,
            runtime: (!r.runtime.is_empty()).then_some(r.runtime.as_str()),
        };
        let p = self.registry.allocate(&req, &r.sandbox_id)?;
        r.agent_id = p.agent.clone();
        r.push_event(
            "info",
            "controller",
            format!(
                "placed on agent {} (score {}, image {})",
                p.agent,
                p.score,
                if p.image_cached {
                    "cached"
                } else {
                    "not cached"
                }
            ),
        );
        Ok(())
    }

    /// Asks the agent to create `r`'s container.
    async fn agent_create(&self, r: &SandboxRecord, wait_for_execd: bool) -> Result<String> {
        let agent = self
            .registry
            .agent(&r.agent_id)
            .ok_or_else(|| Error::Unavailable(format!("agent {} vanished", r.agent_id)))?;
        let resp = self
            .agents
            .create(
                &r.agent_id,
                &agent.api_endpoint,
                self.agent_spec(r, wait_for_execd),
                self.config.create_deadline,
            )
            .await?;
        let t = resp.timings.unwrap_or_default();
        Ok(format!(
            "container created on {} (image {} µs, container {} µs, task {} µs, execd {} µs)",
            r.agent_id,
            t.image_resolved_us,
            t.container_created_us,
            t.task_started_us,
            t.execd_ready_us
        ))
    }

    /// Best effort: the container must not outlive a failed create.
    async fn discard_container(&self, r: &SandboxRecord) {
        if let Some(a) = self.registry.agent(&r.agent_id)
            && let Err(e) = self
                .agents
                .delete(
                    &r.agent_id,
                    &a.api_endpoint,
                    &r.sandbox_id,
                    Duration::from_secs(30),
                )
                .await
        {
            tracing::warn!(sandbox = %r.name, agent = %r.agent_id, error = %e, "could not remove container of failed create");
        }
    }

    async fn create_strong(&self, spec: CreateSpec) -> Result<SandboxRecord> {
        let mut r = self.new_record(&spec, Consistency::Strong);
        let _inflight = self.inflight(&r.sandbox_id);
        self.place(&mut r, &[])?;
        r.push_event(
            "info",
            "controller",
            "record committed before create (strong)",
        );
        let r = match self.store.create(&r) {
            Ok(r) => r,
            Err(e) => {
                self.registry.release(&r.agent_id, &r.sandbox_id);
                return match e {
                    StoreError::AlreadyExists(holder) => self.on_name_taken(*holder, &spec).await,
                    e => Err(e.into()),
                };
            }
        };
        self.track_expiry(&r, None);
        failpoint(&self.config, Failpoint::StrongAfterRecord, &r.name).await;
        match self.agent_create(&r, spec.wait_for_execd).await {
            Ok(msg) => self.mark_running(&r, msg).await,
            Err(e) => {
                tracing::warn!(sandbox = %r.name, agent = %r.agent_id, error = %e, "strong create failed");
                self.discard_container(&r).await;
                let _ = self.store.delete(&r.namespace, &r.name);
                self.expiry
                    .lock()
                    .remove(&(r.expires_at, r.namespace.clone(), r.name.clone()));
                self.registry.release(&r.agent_id, &r.sandbox_id);
                Err(e)
            }
        }
    }

    /// Pending → Running once the agent confirmed the container.
    async fn mark_running(&self, r: &SandboxRecord, msg: String) -> Result<SandboxRecord> {
        let sid = r.sandbox_id.clone();
        match self.modify(&r.namespace, &r.name, |x| {
            if x.sandbox_id != sid {
                return Err(Error::Aborted(format!(
                    "sandbox {} was reassigned meanwhile",
                    x.name
                )));
            }
            x.phase = Phase::Running;
            x.push_event("info", "agent", msg.clone());
            Ok(())
        }) {
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

    async fn create_fast(&self, spec: CreateSpec) -> Result<SandboxRecord> {
        let mut r = self.new_record(&spec, Consistency::Fast);
        let _inflight = self.inflight(&r.sandbox_id);
        self.place(&mut r, &[])?;
        match self.agent_create(&r, spec.wait_for_execd).await {
            Ok(msg) => {
                r.set_phase(Phase::Running);
                r.push_event("info", "agent", msg);
            }
            Err(e) => {
                tracing::warn!(sandbox = %r.name, agent = %r.agent_id, error = %e, "fast create failed");
                self.discard_container(&r).await;
                self.registry.release(&r.agent_id, &r.sandbox_id);
                return Err(e);
            }
        }
        failpoint(&self.config, Failpoint::FastAfterCreate, &r.name).await;
        r.push_event("info", "controller", "record committed after create (fast)");
        let attempts = self.config.record_commit_attempts.max(1);
        let mut last = None;
        for attempt in 0..attempts {
            match self.store.create(&r) {
                Ok(r) => {
                    self.track_expiry(&r, None);
                    return Ok(r);
                }
                Err(StoreError::AlreadyExists(holder)) => {
                    self.discard_container(&r).await;
                    self.registry.release(&r.agent_id, &r.sandbox_id);
                    return self.on_name_taken(*holder, &spec).await;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %r.name, attempt, error = %e, "fast mode: record commit failed; retrying");
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(20 << attempt.min(6))).await;
                }
            }
        }
        // The client will hear "failed": the container must not stay behind.
        self.discard_container(&r).await;
        self.registry.release(&r.agent_id, &r.sandbox_id);
        Err(Error::Unavailable(format!(
            "sandbox {}: the record could not be written after {attempts} attempts ({}); the container was removed",
            r.name,
            last.map(|e| e.to_string()).unwrap_or_default()
        )))
    }

    /// The name or request id is taken by `holder`.
    async fn on_name_taken(
        &self,
        holder: SandboxRecord,
        spec: &CreateSpec,
    ) -> Result<SandboxRecord> {
        if !spec.request_id.is_empty() && holder.request_id == spec.request_id {
            return self.finish_existing(holder, spec).await;
        }
        Err(Error::AlreadyExists(holder.namespace, holder.name))
    }

    /// A retry of a create that already has a record: answer with it, after
    /// finishing it if the process that started it is gone.
    async fn finish_existing(
        &self,
        existing: SandboxRecord,
        spec: &CreateSpec,
    ) -> Result<SandboxRecord> {
        if existing.namespace != spec.namespace || existing.name != spec.name {
            return Err(Error::AlreadyExists(existing.namespace, existing.name));
        }
        if existing.phase != Phase::Pending {
            return Ok(existing);
        }
        let deadline = tokio::time::Instant::now() + self.config.create_deadline;
        let mut r = existing;
        while self.inflight.lock().contains(&r.sandbox_id) {
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "sandbox {} is still being created",
                    r.name
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            match self.store.get(&r.namespace, &r.name)? {
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
        self.redrive(r, spec.wait_for_execd).await
    }

    /// Completes a Pending record whose creator died (restart recovery, or a
    /// client retry). The agent create is idempotent by sandbox id.
    pub(crate) async fn redrive(
        &self,
        r: SandboxRecord,
        wait_for_execd: bool,
    ) -> Result<SandboxRecord> {
        let _inflight = self.inflight(&r.sandbox_id);
        // Someone else may have finished it between the check and the guard.
        let r = match self.store.get(&r.namespace, &r.name)? {
            Some(x) if x.phase == Phase::Pending && x.sandbox_id == r.sandbox_id => x,
            Some(x) => return Ok(x),
            None => return Err(Error::NotFound(r.namespace, r.name)),
        };
        if !self.registry.is_live(&r.agent_id) {
            return Err(Error::Unavailable(format!(
                "agent {} of pending sandbox {} is not live yet",
                r.agent_id, r.name
            )));
        }
        tracing::info!(sandbox = %r.name, agent = %r.agent_id, "re-driving pending create");
        let msg = self.agent_create(&r, wait_for_execd).await?;
        self.recovering
            .lock()
            .remove(&(r.namespace.clone(), r.name.clone()));
        self.mark_running(&r, format!("{msg} (re-driven after controller restart)"))
            .await
    }
}
