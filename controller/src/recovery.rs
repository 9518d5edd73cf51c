//! Keeping records and reality together: the restart rebuild, lost agents
//! and their failure policies, re-driving creates a dead controller left
//! Pending, and removing containers that no record owns.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sandbolt_proto::agent::v1 as pb;

use crate::clock;
use crate::error::{Error, Result};
use crate::placement::or_default;
use crate::sandboxes::{Core, new_id};
use crate::store::{AgentRecord, FailurePolicy, Phase, SandboxRecord};

impl Core {
    /// Start-up: agents and records from the store back into memory. Writes
    /// stay closed (`ready` false) until the known agents have heartbeated
    /// or `startup_grace` passed, so placement sees their real inventories.
    pub fn rebuild(&self) -> Result<()> {
        let agents = self.store.list_agents()?;
        for a in &agents {
            self.registry.load_known(a);
        }
        let records = self.store.list(None, None, 0)?;
        let mut held = 0;
        for r in &records {
            if r.holds_slot() {
                self.registry
                    .reserve(&r.agent_id, &r.sandbox_id, &r.exposed_ports);
                held += 1;
            }
            self.track_expiry(r, None);
            if matches!(r.phase, Phase::Pending | Phase::Recovering) {
                self.recovering
                    .lock()
                    .insert((r.namespace.clone(), r.name.clone()));
            }
        }
        self.ready.store(agents.is_empty(), Ordering::Release);
        tracing::info!(
            agents = agents.len(),
            records = records.len(),
            slots = held,
            "registry rebuilt from the store"
        );
        Ok(())
    }

    /// Applies one agent heartbeat.
    pub fn on_heartbeat(self: &Arc<Self>, inv: &pb::Inventory) -> Result<()> {
        if inv.agent_id.is_empty() {
            return Err(Error::InvalidArgument(
                "inventory.agent_id is required".into(),
            ));
        }
        let outcome = self.registry.heartbeat(inv);
        if outcome.persist {
            tracing::info!(agent = %inv.agent_id, pool = %or_default(&inv.pool), api = %inv.api_endpoint, proxy = %inv.proxy_endpoint, capacity = inv.max_sandboxes, "agent registered");
            self.store.put_agent(&AgentRecord {
                agent_id: inv.agent_id.clone(),
                namespace: or_default(&inv.namespace).into(),
                pool: or_default(&inv.pool).into(),
                api_endpoint: inv.api_endpoint.clone(),
                proxy_endpoint: inv.proxy_endpoint.clone(),
                capacity: inv.max_sandboxes.max(0) as u32,
                node_name: inv.node_name.clone(),
            })?;
        }
        if outcome.came_back {
            tracing::info!(agent = %inv.agent_id, "lost agent is back");
        }
        self.update_ready(None);
        if self.is_ready() {
            self.collect_orphans(inv);
        }
        Ok(())
    }

    pub(crate) fn update_ready(&self, started: Option<Instant>) {
        if self.is_ready() {
            return;
        }
        let grace_over = started.is_some_and(|s| s.elapsed() >= self.config.startup_grace);
        if self.registry.all_known_heard() || grace_over {
            self.ready.store(true, Ordering::Release);
            tracing::info!("registry complete; serving writes");
        }
    }

    /// Containers an agent runs that no record owns (a fast create whose
    /// controller died before the commit, a sandbox recreated elsewhere
    /// while its agent was away) are removed. In-flight creates are checked
    /// first: their record may not be committed yet.
    fn collect_orphans(self: &Arc<Self>, inv: &pb::Inventory) {
        let mut orphans = Vec::new();
        for s in &inv.sandboxes {
            if s.name.is_empty() || self.inflight.lock().contains(&s.sandbox_id) {
                continue;
            }
            match self.store.get(or_default(&s.namespace), &s.name) {
                Ok(Some(r)) if r.sandbox_id == s.sandbox_id => {}
                Ok(_) => orphans.push(s.sandbox_id.clone()),
                Err(e) => {
                    tracing::warn!(error = %e, "orphan check skipped: store read failed");
                    return;
                }
            }
        }
        if orphans.is_empty() {
            return;
        }
        let core = self.clone();
        let (agent, endpoint) = (inv.agent_id.clone(), inv.api_endpoint.clone());
        tokio::spawn(async move {
            for sid in orphans {
                // Re-check: a create may have started and committed meanwhile.
                if core.inflight.lock().contains(&sid) {
                    continue;
                }
                tracing::warn!(agent = %agent, sandbox_id = %sid, "removing container without a record");
                if let Err(e) = core
                    .agents
                    .delete(&agent, &endpoint, &sid, Duration::from_secs(30))
                    .await
                {
                    tracing::warn!(agent = %agent, sandbox_id = %sid, error = %e, "orphan removal failed");
                }
            }
        });
    }

    /// One pass of the background loop: lost agents, recoveries, re-drives.
    pub async fn recovery_tick(self: &Arc<Self>, started: Instant) {
        self.update_ready(Some(started));
        for agent in self.registry.detect_lost(self.config.lost_agent_timeout) {
            tracing::warn!(%agent, timeout = ?self.config.lost_agent_timeout, "agent lost (no heartbeat)");
            if let Err(e) = self.on_agent_lost(&agent) {
                tracing::warn!(%agent, error = %e, "failure policies not applied yet");
            }
        }
        let work: Vec<(String, String)> = self.recovering.lock().iter().cloned().collect();
        for (ns, name) in work {
            let r = match self.store.get(&ns, &name) {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.recovering.lock().remove(&(ns, name));
                    continue;
                }
                Err(_) => continue,
            };
            match r.phase {
                Phase::Pending if self.is_ready() => self.spawn_once(&r, |core, r| async move {
                    core.redrive(r, true).await.map(|_| ())
                }),
                Phase::Recovering => self.recover(r),
                Phase::Pending => {}
                _ => {
                    self.recovering.lock().remove(&(ns, name));
                }
            }
        }
    }

    /// Runs `f` for a record unless something already works on it.
    fn spawn_once<F, Fut>(self: &Arc<Self>, r: &SandboxRecord, f: F)
    where
        F: FnOnce(Arc<Core>, SandboxRecord) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<()>> + Send + 'static,
    {
        if !self.inflight.lock().insert(r.sandbox_id.clone()) {
            return;
        }
        let core = self.clone();
        let r = r.clone();
        tokio::spawn(async move {
            let sid = r.sandbox_id.clone();
            let name = r.name.clone();
            // Release the marker first so `f` can take its own guard.
            core.inflight.lock().remove(&sid);
            if let Err(e) = f(core.clone(), r).await {
                tracing::debug!(sandbox = %name, error = %e, "recovery step did not finish; will retry");
            }
        });
    }

    fn on_agent_lost(&self, agent: &str) -> Result<()> {
        let now_ms = clock::now_unix_ms();
        for r in self.store.list(None, None, 0)? {
            if r.agent_id != agent
                || !matches!(r.phase, Phase::Running | Phase::Paused | Phase::Pending)
            {
                continue;
            }
            let sid = r.sandbox_id.clone();
            let updated = self.modify(&r.namespace, &r.name, |x| {
                if x.sandbox_id != sid {
                    return Err(Error::Aborted("reassigned".into()));
                }
                match x.failure_policy {
                    FailurePolicy::AutoRecreate => {
                        let timeout = match x.recovery_timeout_seconds {
                            0 => self.config.default_recovery_timeout,
                            s => Duration::from_secs(s as u64),
                        };
                        x.phase = Phase::Recovering;
                        x.recovery_deadline_unix_ms = now_ms + timeout.as_millis() as i64;
                        x.message = format!("agent {agent} lost; recreating elsewhere");
                        x.push_event(
                            "warning",
                            "registry",
                            format!("agent {agent} lost; AUTO_RECREATE within {timeout:?}"),
                        );
                    }
                    FailurePolicy::Manual => {
                        x.phase = Phase::Failed;
                        x.message = format!("agent {agent} lost");
                        x.push_event(
                            "error",
                            "registry",
                            format!("agent {agent} lost; MANUAL policy: marked failed"),
                        );
                    }
                }
                Ok(())
            });
            match updated {
                Ok(x) if x.phase == Phase::Recovering => {
                    self.recovering
                        .lock()
                        .insert((x.namespace.clone(), x.name.clone()));
                }
                Ok(x) => self.registry.release(&x.agent_id, &x.sandbox_id),
                Err(e) => {
                    tracing::warn!(sandbox = %r.name, error = %e, "could not apply failure policy")
                }
            }
        }
        Ok(())
    }

    fn recover(self: &Arc<Self>, r: SandboxRecord) {
        // The agent came back before we moved the sandbox: keep it there.
        if self.registry.is_live(&r.agent_id)
            && self.registry.observed(&r.agent_id, &r.sandbox_id).is_some()
        {
            let sid = r.sandbox_id.clone();
            if let Ok(x) = self.modify(&r.namespace, &r.name, |x| {
                if x.sandbox_id != sid || x.phase != Phase::Recovering {
                    return Err(Error::Aborted("changed".into()));
                }
                x.phase = Phase::Running;
                x.message.clear();
                x.push_event(
                    "info",
                    "registry",
                    format!("agent {} is back; sandbox kept in place", x.agent_id),
                );
                Ok(())
            }) {
                self.registry
                    .reserve(&x.agent_id, &x.sandbox_id, &x.exposed_ports);
                self.recovering.lock().remove(&(x.namespace, x.name));
            }
            return;
        }
        if clock::now_unix_ms() > r.recovery_deadline_unix_ms {
            let sid = r.sandbox_id.clone();
            let _ = self.modify(&r.namespace, &r.name, |x| {
                if x.sandbox_id != sid || x.phase != Phase::Recovering {
                    return Err(Error::Aborted("changed".into()));
                }
                x.phase = Phase::Failed;
                x.message = "recovery timeout passed without a new placement".into();
                x.push_event(
                    "error",
                    "controller",
                    "AUTO_RECREATE gave up: recovery timeout passed",
                );
                Ok(())
            });
            self.registry.release(&r.agent_id, &r.sandbox_id);
            self.recovering.lock().remove(&(r.namespace, r.name));
            return;
        }
        self.spawn_once(&r, |core, r| async move { core.recreate(r).await });
    }

    /// AUTO_RECREATE: a new container for the same record on another agent.
    async fn recreate(self: Arc<Self>, r: SandboxRecord) -> Result<()> {
        let (old_agent, old_sid) = (r.agent_id.clone(), r.sandbox_id.clone());
        let mut n = r.clone();
        n.sandbox_id = new_id("sb-");
        let _inflight = self.inflight(&n.sandbox_id);
        let _old = self.inflight(&old_sid);
        self.place_for_recovery(&mut n, &old_agent)?;
        if let Err(e) = self.create_for_recovery(&n).await {
            self.registry.release(&n.agent_id, &n.sandbox_id);
            return Err(e);
        }
        let (new_agent, new_sid) = (n.agent_id.clone(), n.sandbox_id.clone());
        let result = self.modify(&r.namespace, &r.name, |x| {
            if x.sandbox_id != old_sid || x.phase != Phase::Recovering {
                return Err(Error::Aborted("changed while recreating".into()));
            }
            x.agent_id = new_agent.clone();
            x.sandbox_id = new_sid.clone();
            x.phase = Phase::Running;
            x.assignment_attempt += 1;
            x.recovery_deadline_unix_ms = 0;
            x.message.clear();
            x.push_event(
                "info",
                "controller",
                format!("recreated on agent {new_agent} as {new_sid} (agent {old_agent} lost)"),
            );
            Ok(())
        });
        match result {
            Ok(x) => {
                tracing::info!(sandbox = %x.name, from = %old_agent, to = %x.agent_id, "sandbox recreated");
                self.registry.release(&old_agent, &old_sid);
                self.recovering.lock().remove(&(x.namespace, x.name));
                Ok(())
            }
            Err(e) => {
                if let Some(a) = self.registry.agent(&n.agent_id) {
                    let _ = self
                        .agents
                        .delete(
                            &n.agent_id,
                            &a.api_endpoint,
                            &n.sandbox_id,
                            Duration::from_secs(30),
                        )
                        .await;
                }
                self.registry.release(&n.agent_id, &n.sandbox_id);
                Err(e)
            }
        }
    }

    fn place_for_recovery(&self, n: &mut SandboxRecord, exclude: &str) -> Result<()> {
        let pool = self.registry.pool_key(&n.namespace, &n.pool);
        let key = sandbolt_image_ref::match_key(&n.image);
        let req = crate::placement::PlacementRequest {
            pool: &pool,
            image_key: &key,
            ports: &n.exposed_ports,
            exclude: &[exclude],
        };
        let p = self.registry.allocate(&req, &n.sandbox_id)?;
        n.agent_id = p.agent;
        Ok(())
    }

    async fn create_for_recovery(&self, n: &SandboxRecord) -> Result<()> {
        let agent = self
            .registry
            .agent(&n.agent_id)
            .ok_or_else(|| Error::Unavailable("agent vanished".into()))?;
        self.agents
            .create(
                &n.agent_id,
                &agent.api_endpoint,
                self.agent_spec(n, true),
                self.config.create_deadline,
            )
            .await?;
        Ok(())
    }
}
