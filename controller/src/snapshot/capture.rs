//! Create: check, answer a retried request, record PENDING, capture on the
//! source's agent (READY or FAILED), and re-drive captures a previous
//! leader left PENDING.

use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1 as apb;

use super::{SnapshotCreate, model};
use crate::clock;
use crate::error::{Error, Result};
use crate::registry::AgentInfo;
use crate::sandbox::{Core, Precondition};
use crate::store::{Phase, SandboxRecord, SnapshotPhase, SnapshotRecord};

/// How long one capture on an agent may take (freeze, copy, commit).
pub const CAPTURE_DEADLINE: Duration = Duration::from_secs(600);

/// How long removing what a failed capture left may take.
const DISCARD_DEADLINE: Duration = Duration::from_secs(30);

impl Core {
    /// Records a snapshot of `req.source` and captures it on the source's
    /// node (see [`SnapshotCreate::wait`]). A retried request id answers
    /// its snapshot; the same id for another source is ALREADY_EXISTS.
    #[tracing::instrument(skip_all, fields(namespace = %req.source.namespace, sandbox = %req.source.name, request_id = %req.request_id, snapshot))]
    pub async fn create_snapshot(self: &Arc<Self>, req: SnapshotCreate) -> Result<SnapshotRecord> {
        self.require_ready()?;
        model::check_create(&req.display_name, &req.metadata)?;
        let key = (req.source.namespace.clone(), req.request_id.clone());
        let guard = match req.request_id.is_empty() {
            true => None,
            false => Some(self.snapshot_requests.lock(key).await),
        };
        if let Some(existing) = self.snapshot_of_request(&req)? {
            drop(guard);
            tracing::Span::current().record("snapshot", existing.id.as_str());
            return match req.wait {
                true => self.settled_snapshot(&existing.id).await,
                false => Ok(existing),
            };
        }
        let (source, agent) = self.snapshot_source(&req)?;
        let record = self
            .store
            .put_snapshot(&new_record(&req, &source, &agent))?;
        drop(guard);
        tracing::Span::current().record("snapshot", record.id.as_str());
        tracing::info!(snapshot = %record.id, agent = %record.agent_id, sandbox_id = %record.source_sandbox_id, "snapshot recorded; capturing");
        // A task of its own: a client that stops waiting does not stop the
        // capture half way.
        let task = tokio::spawn(self.clone().capture(record.clone()));
        if !req.wait {
            return Ok(record);
        }
        task.await
            .map_err(|e| Error::Internal(format!("snapshot capture task: {e}")))
    }

    /// The snapshot an earlier call with this request id made, if any.
    fn snapshot_of_request(&self, req: &SnapshotCreate) -> Result<Option<SnapshotRecord>> {
        if req.request_id.is_empty() {
            return Ok(None);
        }
        let Some(r) = self.snapshot_of_request_id(&req.source.namespace, &req.request_id)? else {
            return Ok(None);
        };
        if r.source_sandbox != req.source.name {
            return Err(Error::AlreadyExistsOther(format!(
                "request_id {} made snapshot {} of sandbox {}, not of {}",
                req.request_id, r.id, r.source_sandbox, req.source.name
            )));
        }
        Ok(Some(r))
    }

    /// The source record and its agent: running or paused, agent heartbeating.
    fn snapshot_source(&self, req: &SnapshotCreate) -> Result<(SandboxRecord, AgentInfo)> {
        let source = self.load(&req.source)?;
        Precondition::uid(req.expected_uid.clone()).check(&source)?;
        if !matches!(source.phase, Phase::Running | Phase::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "sandbox {} is {:?}: only a running or paused sandbox can be snapshotted",
                req.source, source.phase
            )));
        }
        match self.registry.agent(&source.agent_id) {
            Some(a) if !a.lost && a.heartbeated => Ok((source, a)),
            _ => Err(Error::FailedPrecondition(format!(
                "the agent {} of sandbox {} is not heartbeating: a snapshot is taken on the sandbox's node; retry when it is back",
                source.agent_id, req.source
            ))),
        }
    }

    /// Polls a snapshot until it is no longer PENDING (a retried `wait`
    /// while the first call's capture runs).
    async fn settled_snapshot(&self, id: &str) -> Result<SnapshotRecord> {
        let deadline = tokio::time::Instant::now() + CAPTURE_DEADLINE;
        loop {
            let r = self
                .store
                .get_snapshot(id)?
                .ok_or_else(|| Error::NotFoundOther(format!("snapshot {id} not found")))?;
            if r.phase != SnapshotPhase::Pending || tokio::time::Instant::now() > deadline {
                return Ok(r);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Asks the agent for the capture and records the outcome: READY, or
    /// FAILED after removing what the agent may have left.
    #[tracing::instrument(skip_all, fields(snapshot = %r.id, agent = %r.agent_id, sandbox_id = %r.source_sandbox_id))]
    async fn capture(self: Arc<Self>, r: SnapshotRecord) -> SnapshotRecord {
        let outcome = self.capture_on_agent(&r).await;
        let now = clock::now_unix_ms();
        let recorded = match &outcome {
            Ok(info) => self.modify_snapshot(&r.id, |s| {
                mark_ready(s, info, now);
                Ok(())
            }),
            Err(e) => {
                tracing::warn!(snapshot = %r.id, agent = %r.agent_id, error = %e, "snapshot capture failed");
                self.discard_capture(&r).await;
                let message = format!("capture failed: {e}");
                self.modify_snapshot(&r.id, |s| {
                    s.phase = SnapshotPhase::Failed;
                    s.message = message.clone();
                    s.completed_at_unix_ms = now;
                    Ok(())
                })
            }
        };
        match recorded {
            Ok(s) => {
                tracing::info!(snapshot = %s.id, phase = ?s.phase, size_bytes = s.size_bytes, paused_us = s.paused_us, took_us = s.took_us, "snapshot capture finished");
                s
            }
            Err(e) => {
                tracing::error!(snapshot = %r.id, error = %e, "could not record the capture's outcome; it is re-driven at the next start");
                r
            }
        }
    }

    async fn capture_on_agent(&self, r: &SnapshotRecord) -> Result<apb::SnapshotInfo> {
        let (id, agent) = self.live_snapshot_agent(r).ok_or_else(|| {
            Error::Unavailable(format!("agent {} is not heartbeating", r.agent_id))
        })?;
        self.agents
            .create_snapshot(
                &id,
                &agent.api_endpoint,
                &r.id,
                &r.source_sandbox_id.clone().into(),
                CAPTURE_DEADLINE,
            )
            .await
    }

    /// Best effort: a failed capture leaves nothing on the node (the agent
    /// cleans up after itself; this covers a capture that finished after
    /// the controller stopped waiting). The janitor reaps what this misses.
    async fn discard_capture(&self, r: &SnapshotRecord) {
        let Some((id, a)) = self.live_snapshot_agent(r) else {
            return;
        };
        if let Err(e) = self
            .agents
            .delete_snapshot(&id, &a.api_endpoint, &r.id, DISCARD_DEADLINE)
            .await
        {
            tracing::warn!(snapshot = %r.id, agent = %r.agent_id, error = %e, "could not remove a failed capture");
        }
    }

    /// Starts the captures of `pending` whose agents heartbeat (the agent's
    /// create is idempotent by id: one that finished answers at once);
    /// those whose agent is unknown fail. Returns the ones still waiting.
    pub(crate) fn redrive_captures(
        self: &Arc<Self>,
        pending: Vec<SnapshotRecord>,
    ) -> Vec<SnapshotRecord> {
        let mut waiting = Vec::new();
        for r in pending {
            match self.registry.agent(&super::agent_of(&r)) {
                Some(a) if !a.lost => {
                    tracing::info!(snapshot = %r.id, agent = %r.agent_id, "re-driving a capture left pending");
                    tokio::spawn(self.clone().capture(r));
                }
                Some(_) => waiting.push(r),
                None => {
                    let message = format!("capture failed: agent {} is not registered", r.agent_id);
                    if let Err(e) = self.modify_snapshot(&r.id, |s| {
                        s.phase = SnapshotPhase::Failed;
                        s.message = message.clone();
                        s.completed_at_unix_ms = clock::now_unix_ms();
                        Ok(())
                    }) {
                        tracing::warn!(snapshot = %r.id, error = %e, "could not fail a pending snapshot");
                    }
                }
            }
        }
        waiting
    }

    /// PENDING records in the store (at start: captures a previous leader
    /// did not see finish).
    pub fn pending_snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        let mut all = self.store.list_snapshots()?;
        all.retain(|r| r.phase == SnapshotPhase::Pending);
        Ok(all)
    }
}

fn new_record(req: &SnapshotCreate, source: &SandboxRecord, agent: &AgentInfo) -> SnapshotRecord {
    let now = clock::now_unix_ms();
    SnapshotRecord {
        id: uuid::Uuid::new_v4().to_string(),
        namespace: source.namespace.clone(),
        uid: uuid::Uuid::new_v4().to_string(),
        display_name: req.display_name.clone(),
        request_id: req.request_id.clone(),
        source_sandbox: source.name.clone(),
        source_uid: source.uid.clone(),
        source_sandbox_id: source.sandbox_id.to_string(),
        phase: SnapshotPhase::Pending,
        agent_id: source.agent_id.to_string(),
        node_name: agent.node_name.clone(),
        image: sandbolt_image_ref::normalize(&source.spec.image),
        runtime: source.spec.runtime.clone(),
        metadata: req.metadata.clone(),
        created_at_unix_ms: now,
        last_transition_unix_ms: now,
        ..Default::default()
    }
}

fn mark_ready(s: &mut SnapshotRecord, info: &apb::SnapshotInfo, now: i64) {
    s.phase = SnapshotPhase::Ready;
    s.message.clear();
    s.size_bytes = info.size_bytes;
    s.paused_us = info.paused_us;
    s.took_us = info.took_us;
    s.volumes = model::volumes_in(info);
    // What the agent committed on is what a restore must name.
    if !info.image.is_empty() {
        s.image = sandbolt_image_ref::normalize(&info.image);
    }
    s.completed_at_unix_ms = now;
}
