//! Pause and resume: the agent freezes or thaws the container in place.

use crate::agent_client::StatusRpc;
use crate::error::{Error, Result};
use crate::ids::SandboxKey;
use crate::sandbox::{Core, Precondition};
use crate::store::{Phase, SandboxRecord};

/// Which way a sandbox is switched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Freeze {
    Pause,
    Resume,
}

impl Freeze {
    /// (the phase it needs, the phase it leaves).
    fn phases(self) -> (Phase, Phase) {
        match self {
            Self::Pause => (Phase::Running, Phase::Paused),
            Self::Resume => (Phase::Paused, Phase::Running),
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
        }
    }

    fn event(self) -> &'static str {
        match self {
            Self::Pause => "paused (frozen)",
            Self::Resume => "resumed (thawed)",
        }
    }
}

impl Core {
    /// Running → Paused; a paused sandbox is answered as it is.
    pub async fn pause(&self, key: &SandboxKey, expect: &Precondition) -> Result<SandboxRecord> {
        self.switch(key, expect, Freeze::Pause).await
    }

    /// Paused → Running; a running sandbox is answered as it is.
    pub async fn resume(&self, key: &SandboxKey, expect: &Precondition) -> Result<SandboxRecord> {
        self.switch(key, expect, Freeze::Resume).await
    }

    async fn switch(
        &self,
        key: &SandboxKey,
        expect: &Precondition,
        how: Freeze,
    ) -> Result<SandboxRecord> {
        let r = self.get(key, expect)?;
        let (from, to) = how.phases();
        if r.phase == to {
            return Ok(r);
        }
        if r.phase != from {
            return Err(Error::FailedPrecondition(format!(
                "sandbox {key} is {:?}; {} needs {from:?}",
                r.phase,
                how.verb(),
            )));
        }
        let agent = self.live_agent(&r)?;
        let rpc = match how {
            Freeze::Pause => StatusRpc::Pause,
            Freeze::Resume => StatusRpc::Resume,
        };
        self.agents
            .status_rpc(
                &r.agent_id,
                &agent.api_endpoint,
                &r.sandbox_id,
                rpc,
                self.config.create_deadline,
            )
            .await?;
        self.modify(key, |x| {
            x.phase = to;
            x.generation += 1;
            x.push_event("info", "agent", how.event());
            Ok(())
        })
    }
}
