//! Keeping records and reality together: the restart rebuild, silent and
//! gone agents, vanished containers and their failure policies, re-driving
//! creates a dead controller left Pending, and removing containers that no
//! record owns.
//!
//! # Silence kills nothing
//!
//! An agent that stops heartbeating is *silent* (lost): it leaves placement
//! and [`Core::agent_silent`] tells readers its sandboxes' state is unknown,
//! but no record is written and no failure policy applies — its sandboxes
//! normally still run (a rollout, a containerd restart, a slow heartbeat).
//! When it reports them again they simply are Running, as their records
//! always said. Failure policies apply only when a sandbox is known to be
//! lost:
//! - its agent is *gone*: silent for `agent_gone_timeout` and the
//!   configured [`AgentPresence`](crate::registry::AgentPresence) source
//!   (Kubernetes: the agent's pod) says it no longer exists. Without a
//!   source (one machine) an agent is never gone;
//! - its container *vanished*: its agent heartbeats but has stopped
//!   reporting it (a node reboot, a wiped containerd), see
//!   [`crate::registry::VanishRule`].
//!
//! Then AUTO_RECREATE recreates the sandbox (on another agent when its own
//! is gone) and MANUAL marks it Failed, which lets the janitor reap what is
//! left of its container. A sandbox whose named volumes or snapshot (it was
//! restored from one) are on a gone node is marked Failed instead: its data
//! cannot follow it; recreated on a live node, it stays there.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sandbolt_proto::agent::v1 as pb;

use crate::clock;
use crate::error::{Error, Result};
use crate::ids::{AgentId, SandboxId, SandboxKey};
use crate::placement::or_default;
use crate::registry::{Presence, VanishRule};
use crate::sandbox::Core;
use crate::sandbox::shared::DISCARD_DEADLINE;
use crate::store::{AgentRecord, FailurePolicy, ListRange, Phase, SandboxRecord};

impl Core {
    /// Start-up: agents and records from the store back into memory. Writes
    /// stay closed (`ready` false) until the known agents have heartbeated
    /// or `startup_grace` passed, so placement sees their real inventories.
    pub fn rebuild(&self) -> Result<()> {
        let agents = self.store.list_agents()?;
        for a in &agents {
            self.registry.load_known(a);
        }
        self.reload_warm_pools()?;
        let records = self.store.list(&ListRange::all())?;
        let mut held = 0;
        for r in &records {
            if r.holds_slot() {
                self.registry.reserve_in(
                    &r.agent_id,
                    &r.sandbox_id,
                    &r.spec.exposed_ports,
                    &r.spec.warm_pool,
                );
                held += 1;
            }
            self.track_expiry(r, None);
            if matches!(r.phase, Phase::Pending | Phase::Recovering) {
                self.recovering.lock().insert(r.key());
            }
            if r.network_policy_pending {
                self.policy_pending.lock().insert(r.key(), false);
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
        self.volumes
            .apply_inventory(&inv.agent_id.as_str().into(), &inv.volumes);
        if outcome.persist {
            tracing::info!(agent = %inv.agent_id, pool = %or_default(&inv.pool), api = %inv.api_endpoint, proxy = %inv.proxy_endpoint, capacity = inv.max_sandboxes, "agent registered");
            self.store.put_agent(&AgentRecord {
                agent_id: inv.agent_id.as_str().into(),
                namespace: or_default(&inv.namespace).into(),
                pool: or_default(&inv.pool).into(),
                api_endpoint: inv.api_endpoint.clone(),
                proxy_endpoint: inv.proxy_endpoint.clone(),
                capacity: inv.max_sandboxes.max(0) as u32,
                node_name: inv.node_name.clone(),
                pod: inv.pod.as_ref().map(|p| crate::store::AgentPod {
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    uid: p.uid.clone(),
                }),
            })?;
        }
        if outcome.came_back {
            tracing::info!(agent = %inv.agent_id, sandboxes = inv.sandboxes.len(), "silent agent is back; its sandboxes are known again");
        }
        let in_flight = self.inflight.lock().clone();
        let vanished = self
            .registry
            .note_heartbeat(inv, &in_flight, self.vanish_rule());
        self.update_ready(None);
        if self.is_ready() {
            self.collect_orphans(inv);
            self.resend_policies(inv);
            if !vanished.is_empty() {
                self.on_vanished(&inv.agent_id.as_str().into(), &vanished);
            }
        }
        Ok(())
    }

    /// Whether `agent_id` is registered and silent (no heartbeat for
    /// `lost_agent_timeout`). The records of its sandboxes keep the phase
    /// they had (Running, Paused…): read that as *unknown* while this is
    /// true. It turns false with the agent's next heartbeat; records it no
    /// longer holds by then are dealt with by the failure policies. False
    /// for agents the controller does not know at all.
    pub fn agent_silent(&self, agent_id: &AgentId) -> bool {
        self.registry.is_silent(agent_id)
    }

    fn vanish_rule(&self) -> VanishRule {
        VanishRule {
            min_heartbeats: 2,
            // Several heartbeat periods, and never under a few seconds: a
            // reset restart deletes and re-creates one id, a delete removes
            // the container before the record.
            min_age: (self.config.heartbeat_interval * 3).max(Duration::from_secs(5)),
        }
    }

    /// Sandboxes a live agent has stopped reporting: their containers are
    /// gone (the agent finds every container of its own at start), so the
    /// failure policy applies.
    fn on_vanished(&self, agent: &AgentId, ids: &[SandboxId]) {
        for sid in ids {
            let r = match self.store.get_by_sandbox_id(sid) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(%agent, error = %e, "vanished sandboxes not handled: store read failed");
                    return;
                }
            };
            if r.agent_id != *agent || !matches!(r.phase, Phase::Running | Phase::Paused) {
                continue;
            }
            let why = format!(
                "container {} vanished: agent {agent} is running but no longer reports it (node restarted, or containerd lost it)",
                r.sandbox_id
            );
            tracing::warn!(sandbox = %r.name, namespace = %r.namespace, "{why}");
            let still_missing = |x: &SandboxRecord| {
                matches!(x.phase, Phase::Running | Phase::Paused)
                    && self.registry.is_live(agent)
                    && self.registry.observed(agent, &x.sandbox_id).is_none()
                    && !self.is_inflight(&x.sandbox_id)
            };
            self.give_up(&r, "agent", &why, still_missing);
        }
    }

    /// Applies the failure policy to one record whose container is lost:
    /// AUTO_RECREATE → Recovering (recreated by the recovery loop), MANUAL →
    /// Failed. `applies` re-checks the record inside the write. Returns
    /// false when the record could not be written (the caller may retry).
    fn give_up(
        &self,
        r: &SandboxRecord,
        source: &str,
        why: &str,
        applies: impl Fn(&SandboxRecord) -> bool,
    ) -> bool {
        let now_ms = clock::now_unix_ms();
        let sid = r.sandbox_id.clone();
        let updated = self.modify(&r.key(), |x| {
            if x.sandbox_id != sid || !applies(x) {
                return Err(Error::Aborted("changed".into()));
            }
            self.apply_failure_policy(x, source, why, now_ms);
            Ok(())
        });
        match updated {
            Ok(x) if x.phase == Phase::Recovering => {
                self.recovering.lock().insert(x.key());
                true
            }
            Ok(x) => {
                self.registry.release(&x.agent_id, &x.sandbox_id);
                true
            }
            // Deleted, reassigned, or back meanwhile: nothing to apply.
            Err(Error::Aborted(_) | Error::NotFound(..)) => true,
            Err(e) => {
                tracing::warn!(sandbox = %r.name, error = %e, "could not apply the failure policy");
                false
            }
        }
    }

    /// Writes the failure policy's outcome into `x` (inside a `modify`).
    fn apply_failure_policy(&self, x: &mut SandboxRecord, source: &str, why: &str, now_ms: i64) {
        let left_behind = if self.registry.is_live(&x.agent_id) {
            None
        } else {
            data_left_behind(x)
        };
        match (x.spec.failure_policy, left_behind) {
            // Its data is on the lost node: a recreate elsewhere would run
            // without it. Say so instead of moving it.
            (FailurePolicy::AutoRecreate, Some(what)) => {
                let msg = format!("{why}; AUTO_RECREATE cannot move it: {what}");
                x.phase = Phase::Failed;
                x.message = msg.clone();
                x.push_event("error", source, msg);
            }
            (FailurePolicy::AutoRecreate, None) => {
                let timeout = match x.spec.recovery_timeout_seconds {
                    0 => self.config.default_recovery_timeout,
                    s => Duration::from_secs(s as u64),
                };
                x.phase = Phase::Recovering;
                x.recovery_deadline_unix_ms = now_ms + timeout.as_millis() as i64;
                x.message = format!("{why}; recreating");
                x.push_event(
                    "warning",
                    source,
                    format!("{why}; AUTO_RECREATE within {timeout:?}"),
                );
            }
            (FailurePolicy::Manual, _) => {
                x.phase = Phase::Failed;
                x.message = why.to_string();
                x.push_event(
                    "error",
                    source,
                    format!("{why}; MANUAL policy: marked failed"),
                );
            }
        }
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
            if s.name.is_empty() || self.is_inflight(&s.sandbox_id) {
                continue;
            }
            let key = SandboxKey::new(&s.namespace, s.name.clone());
            // The index answers the common case (owned) without decoding
            // the record; only a container it does not place there is
            // confirmed on the record itself.
            match self.store.sandbox_owner(&s.sandbox_id) {
                Ok(Some(owner)) if owner == key => continue,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "orphan check skipped: store read failed");
                    return;
                }
            }
            match self.store.get(&key) {
                Ok(Some(r)) if r.sandbox_id == s.sandbox_id => {}
                Ok(_) => orphans.push(SandboxId::from(s.sandbox_id.clone())),
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
        let (agent, endpoint) = (
            AgentId::from(inv.agent_id.clone()),
            inv.api_endpoint.clone(),
        );
        tokio::spawn(async move {
            for sid in orphans {
                // Re-check: a create may have started and committed meanwhile.
                if core.is_inflight(&sid) {
                    continue;
                }
                tracing::warn!(agent = %agent, sandbox_id = %sid, "removing container without a record");
                if let Err(e) = core
                    .agents
                    .delete(&agent, &endpoint, &sid, DISCARD_DEADLINE)
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
        self.reload_warm_pools_if_due();
        for agent in self.registry.detect_lost(self.config.lost_agent_timeout) {
            tracing::warn!(%agent, timeout = ?self.config.lost_agent_timeout, gone_after = ?self.config.agent_gone_timeout, "agent silent (no heartbeat): its sandboxes are unknown until it reports again; none is failed for silence");
        }
        self.check_presence();
        let work: Vec<SandboxKey> = self.recovering.lock().iter().cloned().collect();
        for key in work {
            let r = match self.store.get(&key) {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.recovering.lock().remove(&key);
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
                    self.recovering.lock().remove(&key);
                }
            }
        }
    }

    /// Runs `f` for a record unless something already works on it.
    fn spawn_once<F, Fut>(self: &Arc<Self>, r: &SandboxRecord, f: F)
    where
        F: FnOnce(Arc<Core>, SandboxRecord) -> Fut + Send + 'static,
        Fut: Future<Output = Result<()>> + Send + 'static,
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

    /// Asks the presence source about agents silent for
    /// `agent_gone_timeout`; one that is gone has its sandboxes' failure
    /// policies applied. Checks run in the background, one per agent at a
    /// time, repeated while the agent stays silent.
    fn check_presence(self: &Arc<Self>) {
        let Some(presence) = self.config.agent_presence.clone() else {
            return;
        };
        let gone_after = self.config.agent_gone_timeout;
        // Re-asked often enough that a deleted pod is acted on promptly,
        // rarely enough to cost the API server nothing.
        let recheck = (gone_after / 10).clamp(Duration::from_secs(1), Duration::from_secs(30));
        for (who, seq) in self.registry.due_presence_checks(gone_after) {
            let core = self.clone();
            let presence = presence.clone();
            tokio::spawn(async move {
                let agent = who.agent_id.clone();
                let why = match presence.check(&who).await {
                    Ok(Presence::Gone(why)) => Some(why),
                    Ok(Presence::Replacing(why)) => {
                        tracing::info!(%agent, %why, "silent agent's pod is being replaced; its sandboxes wait for it");
                        None
                    }
                    Ok(Presence::Present) => {
                        tracing::debug!(%agent, "silent agent's pod still exists; its sandboxes wait for it");
                        None
                    }
                    Ok(Presence::Unknown) => {
                        tracing::debug!(%agent, "silent agent has no known pod; its sandboxes wait for it");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(%agent, error = %e, "cannot tell whether the silent agent is gone; its sandboxes wait");
                        None
                    }
                };
                if !core
                    .registry
                    .presence_checked(&agent, seq, why.is_some(), recheck)
                {
                    return;
                }
                let why = why.unwrap_or_default();
                tracing::warn!(%agent, %why, silent_for_at_least = ?gone_after, "agent gone: applying failure policies");
                if !core.on_agent_gone(&agent, &why) {
                    core.registry.presence_retry(&agent);
                }
            });
        }
    }

    /// Failure policies for every sandbox of a gone agent. False when some
    /// could not be applied (the next presence check retries those).
    fn on_agent_gone(&self, agent: &AgentId, why: &str) -> bool {
        let records = match self.store.list(&ListRange::all()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%agent, error = %e, "failure policies not applied yet: store read failed");
                return false;
            }
        };
        let why = format!("agent {agent} is gone ({why}); its containers went with it");
        let mut all = true;
        for r in records {
            if r.agent_id != *agent
                || !matches!(r.phase, Phase::Running | Phase::Paused | Phase::Pending)
            {
                continue;
            }
            let still_gone = |x: &SandboxRecord| {
                x.agent_id == *agent
                    && matches!(x.phase, Phase::Running | Phase::Paused | Phase::Pending)
                    && !self.registry.is_live(agent)
            };
            all &= self.give_up(&r, "registry", &why, still_gone);
        }
        all
    }

    fn recover(self: &Arc<Self>, r: SandboxRecord) {
        // The agent came back before we moved the sandbox: keep it there.
        if self.registry.is_live(&r.agent_id)
            && self.registry.observed(&r.agent_id, &r.sandbox_id).is_some()
        {
            let sid = r.sandbox_id.clone();
            if let Ok(x) = self.modify(&r.key(), |x| {
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
                self.registry.reserve_in(
                    &x.agent_id,
                    &x.sandbox_id,
                    &x.spec.exposed_ports,
                    &x.spec.warm_pool,
                );
                self.recovering.lock().remove(&x.key());
            }
            return;
        }
        if clock::now_unix_ms() > r.recovery_deadline_unix_ms {
            let sid = r.sandbox_id.clone();
            let _ = self.modify(&r.key(), |x| {
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
            self.recovering.lock().remove(&r.key());
            return;
        }
        self.spawn_once(&r, |core, r| async move { core.recreate(r).await });
    }

    /// AUTO_RECREATE: a new container for the same record on another agent.
    #[tracing::instrument(skip_all, fields(namespace = %r.namespace, sandbox = %r.name, old_sandbox_id = %r.sandbox_id, old_agent = %r.agent_id))]
    async fn recreate(self: Arc<Self>, r: SandboxRecord) -> Result<()> {
        let (old_agent, old_sid) = (r.agent_id.clone(), r.sandbox_id.clone());
        let mut n = r.clone();
        n.sandbox_id = SandboxId::generate();
        let _inflight = self.inflight(&n.sandbox_id);
        let _old = self.inflight(&old_sid);
        // A gone agent cannot take it back; a live one whose container
        // vanished can.
        let exclude = (!self.registry.is_live(&old_agent)).then_some(&old_agent);
        // Named volumes pin it where their data is; none is made anew.
        let mut volumes = self.resolve_pvcs(&n.spec.pvc_volumes, false)?;
        // A restored sandbox's snapshot is on its node: it stays there.
        if !n.spec.snapshot_id.is_empty() {
            volumes.pin = Some(old_agent.clone());
        }
        self.place(&mut n, exclude, &volumes)?;
        let created = match self.agent_create(&n, true).await {
            Ok(c) => c,
            Err(e) => {
                self.registry.release(&n.agent_id, &n.sandbox_id);
                return Err(e);
            }
        };
        let (new_agent, new_sid) = (n.agent_id.clone(), n.sandbox_id.clone());
        let result = self.modify(&r.key(), |x| {
            if x.sandbox_id != old_sid || x.phase != Phase::Recovering {
                return Err(Error::Aborted("changed while recreating".into()));
            }
            x.agent_id = new_agent.clone();
            x.sandbox_id = new_sid.clone();
            x.ip_address.clone_from(&created.ip_address);
            if x.network_policy_pending && x.spec.network_policy_json == n.spec.network_policy_json {
                // The new container's create carried the record's policy.
                x.network_policy_pending = false;
                x.network_policy_transition_unix_ms = clock::now_unix_ms();
            }
            x.phase = Phase::Running;
            x.assignment_attempt += 1;
            x.recovery_deadline_unix_ms = 0;
            x.message.clear();
            x.push_event(
                "info",
                "controller",
                format!("recreated on agent {new_agent} as {new_sid} (was {old_sid} on agent {old_agent})"),
            );
            Ok(())
        });
        match result {
            Ok(x) => {
                tracing::info!(to = %x.agent_id, sandbox_id = %x.sandbox_id, "sandbox recreated");
                self.registry.release(&old_agent, &old_sid);
                self.recovering.lock().remove(&x.key());
                Ok(())
            }
            Err(e) => {
                self.discard_container(&n).await;
                self.registry.release(&n.agent_id, &n.sandbox_id);
                Err(e)
            }
        }
    }
}

/// What of a sandbox stays on its node when the node is lost: the snapshot
/// it was restored from, its named volumes; `None` when nothing does.
fn data_left_behind(x: &SandboxRecord) -> Option<String> {
    if !x.spec.snapshot_id.is_empty() {
        return Some(format!(
            "it was restored from snapshot {}, and its snapshot lived on the lost node (snapshots do not move between nodes yet)",
            x.spec.snapshot_id
        ));
    }
    if x.spec.pvc_volumes.is_empty() {
        return None;
    }
    let claims: Vec<&str> = x
        .spec
        .pvc_volumes
        .iter()
        .map(|v| v.claim_name.as_str())
        .collect();
    Some(format!(
        "its named volumes ({}) live on that node and their data cannot follow",
        claims.join(", ")
    ))
}
