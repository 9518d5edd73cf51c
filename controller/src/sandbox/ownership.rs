//! `GetOwnership`: what the janitors ask before they reap anything.
//!
//! The answer combines three facts per sandbox id: the record (live,
//! terminal, absent; its uid and current sandbox id), whether a create for
//! the id is in flight in this process, and the liveness of the agent.
//!
//! Why an in-flight create can never be reaped (the janitor relies on it):
//! every create path registers its sandbox id in `Core::inflight` before it
//! calls the agent (so before the container can exist) and drops it only
//! after the record is committed or the create was given up. This handler
//! reads the in-flight set *before* the store. So if it answers "not in
//! flight" for a container that exists, the create that made the container
//! had already ended when the set was read, and its record — if it was ever
//! going to be written — was committed before the store read that follows.
//! A controller that dies takes its in-flight creates with it: nothing will
//! commit their records afterwards. Sandbox ids are fresh per create, so an
//! answer cannot be overtaken by a later create of the same id (the reset
//! restart reuses an id, but only under a live record).
//!
//! Why a silent agent's sandboxes are never reaped: agent liveness is only
//! reported, never turned into a record state here. A record is Terminal
//! only once the controller decided its container is lost (its agent is
//! gone, or its container vanished from a live agent: see `recovery.rs`),
//! and a silent agent changes no record. The janitor keeps a live record's
//! container whatever the agent's liveness (see `sandbolt_janitor::rules`).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use sandbolt_proto::agent::v1 as pb;

use crate::error::Result;
use crate::ids::{AgentId, SandboxId, SandboxKey};
use crate::registry::AgentInfo;
use crate::sandbox::Core;
use crate::sandbox::create::record_commit_waits;
use crate::store::{Phase, SandboxRecord};

fn liveness(agent_id: &str, a: Option<&AgentInfo>, now: Instant) -> pb::AgentLiveness {
    match a {
        Some(a) => pb::AgentLiveness {
            agent_id: a.agent_id.to_string(),
            registered: true,
            // False while silent: its sandboxes are unknown, not lost.
            heartbeating: !a.lost,
            instance_id: a.instance_id.clone(),
            last_heartbeat_age_ms: now.saturating_duration_since(a.last_seen).as_millis() as i64,
            node_name: a.node_name.clone(),
        },
        None => pb::AgentLiveness {
            agent_id: agent_id.to_string(),
            ..Default::default()
        },
    }
}

fn record_state(r: Option<&SandboxRecord>) -> pb::RecordState {
    match r.map(|r| r.phase) {
        None => pb::RecordState::Absent,
        // Failed is a decision (a gone agent, a vanished container, a
        // failed create, a recovery that gave up), never mere silence.
        Some(Phase::Failed) => pb::RecordState::Terminal,
        Some(Phase::Pending | Phase::Running | Phase::Paused | Phase::Recovering) => {
            pb::RecordState::Live
        }
    }
}

impl Core {
    pub fn ownership(&self, req: &pb::GetOwnershipRequest) -> Result<pb::GetOwnershipResponse> {
        // Order matters, see the module comment: in-flight set first, store after.
        let inflight: HashSet<String> = req
            .queries
            .iter()
            .filter(|q| self.is_inflight(&q.sandbox_id))
            .map(|q| q.sandbox_id.clone())
            .collect();
        let ready = self.is_ready();
        // Leftovers come without a name: the store's container-id index
        // finds them.
        let mut by_sid: HashMap<SandboxId, SandboxRecord> = HashMap::new();
        for q in req.queries.iter().filter(|q| q.name.is_empty()) {
            if let Some(r) = self.store.get_by_sandbox_id(&q.sandbox_id)? {
                by_sid.insert(r.sandbox_id.clone(), r);
            }
        }
        let agents: HashMap<AgentId, AgentInfo> = self
            .registry
            .agents()
            .into_iter()
            .map(|a| (a.agent_id.clone(), a))
            .collect();
        let now = Instant::now();
        let mut answers = Vec::with_capacity(req.queries.len());
        for q in &req.queries {
            let record = if q.name.is_empty() {
                by_sid.get(q.sandbox_id.as_str()).cloned()
            } else {
                self.store
                    .get(&SandboxKey::new(&q.namespace, q.name.clone()))?
            };
            let agent_id = if q.agent_id.is_empty() {
                record
                    .as_ref()
                    .map(|r| r.agent_id.to_string())
                    .unwrap_or_default()
            } else {
                q.agent_id.clone()
            };
            answers.push(pb::Ownership {
                sandbox_id: q.sandbox_id.clone(),
                record_state: record_state(record.as_ref()) as i32,
                record_uid: record.as_ref().map(|r| r.uid.clone()).unwrap_or_default(),
                record_sandbox_id: record
                    .as_ref()
                    .map(|r| r.sandbox_id.to_string())
                    .unwrap_or_default(),
                record_phase: record
                    .as_ref()
                    .map(|r| format!("{:?}", r.phase))
                    .unwrap_or_default(),
                create_in_flight: inflight.contains(&q.sandbox_id),
                agent: Some(liveness(&agent_id, agents.get(agent_id.as_str()), now)),
            });
        }
        let mut all: Vec<pb::AgentLiveness> = agents
            .values()
            .map(|a| liveness(&a.agent_id, Some(a), now))
            .collect();
        all.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
        Ok(pb::GetOwnershipResponse {
            ready,
            answers,
            agents: all,
            fast_commit_deadline_ms: self.fast_commit_deadline_ms(),
            snapshots: self.snapshot_ownership(&req.snapshot_ids)?,
        })
    }

    /// One answer per sandbox snapshot id, in order: whether a snapshot
    /// record (any phase) has it. The record is written before an agent is
    /// asked to capture, so a committed snapshot without one is nobody's.
    fn snapshot_ownership(&self, ids: &[String]) -> Result<Vec<pb::SnapshotOwnership>> {
        ids.iter()
            .map(|id| {
                Ok(pb::SnapshotOwnership {
                    snapshot_id: id.clone(),
                    recorded: self.store.get_snapshot(id)?.is_some(),
                })
            })
            .collect()
    }

    /// The longest a fast create can take from the agent call to the end of
    /// its record commit retries (the waits of `create_fast`), excluding the
    /// store's own write time.
    fn fast_commit_deadline_ms(&self) -> i64 {
        (self.config.create_deadline + record_commit_waits(&self.config)).as_millis() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SnapshotRecord;

    #[test]
    fn each_snapshot_id_is_answered_in_order_by_whether_a_record_has_it() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), "t");
        let store = crate::store::embedded::RedbStore::open(dir.path()).unwrap();
        let core = Core::new(cfg, std::sync::Arc::new(store)).unwrap();
        core.store
            .put_snapshot(&SnapshotRecord {
                id: "kept".into(),
                namespace: "default".into(),
                ..Default::default()
            })
            .unwrap();
        let req = pb::GetOwnershipRequest {
            node_name: "n".into(),
            queries: vec![],
            snapshot_ids: vec!["gone".into(), "kept".into(), "gone".into()],
        };
        let answer = core.ownership(&req).unwrap();
        let got: Vec<(&str, bool)> = answer
            .snapshots
            .iter()
            .map(|s| (s.snapshot_id.as_str(), s.recorded))
            .collect();
        assert_eq!(got, [("gone", false), ("kept", true), ("gone", false)]);
        // A sandbox-only question answers no snapshots.
        let req = pb::GetOwnershipRequest {
            snapshot_ids: vec![],
            ..req
        };
        assert!(core.ownership(&req).unwrap().snapshots.is_empty());
    }
}
