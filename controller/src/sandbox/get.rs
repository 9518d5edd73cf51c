//! Get: one record (with the caller's preconditions), what a client should
//! be told about its state, and diagnostics (the record plus its agent).

use std::time::Duration;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::SandboxPhase as AgentPhase;

use crate::agent_client::StatusRpc;
use crate::error::Result;
use crate::ids::SandboxKey;
use crate::registry::SandboxView;
use crate::sandbox::{Core, Precondition};
use crate::store::{Phase, SandboxRecord};

pub struct Diagnostics {
    pub record: SandboxRecord,
    pub observed: Option<pb::SandboxStatus>,
    pub reachable: bool,
    pub agent_error: String,
}

/// What a client is told about a sandbox: its record's phase, unless what
/// its agent reports (or its silence) says more. Every API maps this one
/// answer into its own vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// The record's phase stands.
    Recorded(Phase),
    /// Running or Paused on an agent that is not heartbeating. Silence is
    /// not death: nothing is known, nothing is done; the sandbox is Running
    /// again when its agent reports it.
    AgentSilent { agent: String },
    /// Its agent reports the entrypoint exited (`failed`: with an error).
    Exited { failed: bool, message: String },
}

impl Observed {
    pub fn of(view: &SandboxView, r: &SandboxRecord) -> Self {
        if !matches!(r.phase, Phase::Running | Phase::Paused) || r.agent_id.is_empty() {
            return Self::Recorded(r.phase);
        }
        if !view.agent_live {
            return Self::AgentSilent {
                agent: r.agent_id.to_string(),
            };
        }
        match &view.observed {
            Some(s) if matches!(s.phase(), AgentPhase::Failed | AgentPhase::Stopped) => {
                Self::Exited {
                    failed: s.phase() == AgentPhase::Failed,
                    message: if s.message.is_empty() {
                        format!("entrypoint exited with status {}", s.exit_code)
                    } else {
                        s.message.clone()
                    },
                }
            }
            _ => Self::Recorded(r.phase),
        }
    }
}

impl Core {
    /// What a client is told about `r`, and where it runs.
    pub fn observe(&self, r: &SandboxRecord) -> (Observed, SandboxView) {
        let view = self.registry.sandbox_view(&r.agent_id, &r.sandbox_id);
        (Observed::of(&view, r), view)
    }

    pub fn get(&self, key: &SandboxKey, expect: &Precondition) -> Result<SandboxRecord> {
        let r = self.load(key)?;
        expect.check(&r)?;
        Ok(r)
    }

    /// The record and what its agent says about it right now.
    pub async fn diagnostics(&self, key: &SandboxKey) -> Result<Diagnostics> {
        let r = self.load(key)?;
        let observed = self.registry.observed(&r.agent_id, &r.sandbox_id);
        let (reachable, agent_error) = match self.registry.agent(&r.agent_id) {
            None => (
                false,
                format!("agent {:?} is not registered", r.agent_id.as_str()),
            ),
            Some(a) if a.lost => (
                false,
                format!("agent {} is lost (no heartbeat)", a.agent_id),
            ),
            Some(a) => match self
                .agents
                .status_rpc(
                    &r.agent_id,
                    &a.api_endpoint,
                    &r.sandbox_id,
                    StatusRpc::Get,
                    Duration::from_secs(3),
                )
                .await
            {
                Ok(_) => (true, String::new()),
                Err(e) => (false, e.to_string()),
            },
        };
        Ok(Diagnostics {
            record: r,
            observed,
            reachable,
            agent_error,
        })
    }
}
