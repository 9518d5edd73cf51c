//! Sandbox diagnostics for people and the OpenSandbox diagnostics routes:
//! the record (its events) and the end of the container log, read from the
//! sandbox's agent. The record always comes; a log that cannot be read
//! (agent lost, no container yet) comes as the reason instead.

use std::time::Duration;

use sandbolt_proto::agent::v1 as agent_pb;

use crate::error::{Error, Result};
use crate::ids::SandboxKey;
use crate::sandbox::{Core, Precondition};
use crate::store::{Event, SandboxRecord};

/// The most log lines one diagnostics call reads (the OpenSandbox API's
/// `tail` maximum; the agent caps there too).
pub const MAX_LOG_LINES: u32 = 10_000;
/// The most log bytes one diagnostics call reads (the agent's cap too).
pub const MAX_LOG_BYTES: u64 = 1 << 20;
/// How long the log read may take: a diagnostics call must answer while
/// its agent is sick, that is when people call it.
const LOG_READ_DEADLINE: Duration = Duration::from_secs(5);

/// How much of a sandbox's history to bring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiagnosticsBounds {
    /// The last this many log lines; 0 = no log read.
    pub log_tail_lines: u32,
    /// At most this many log bytes; 0 = [`MAX_LOG_BYTES`].
    pub log_max_bytes: u64,
    /// The newest this many events; 0 = every event the record keeps.
    pub event_limit: u32,
}

/// The end of a container log as its agent answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogTail {
    pub content: String,
    /// Older output exists that is not in `content`.
    pub truncated: bool,
}

pub struct SandboxDiagnostics {
    pub record: SandboxRecord,
    /// Oldest first.
    pub events: Vec<Event>,
    /// Older events exist that the limit left out.
    pub events_truncated: bool,
    /// `Ok(None)`: no log was asked for. `Err`: why it could not be read.
    pub log: std::result::Result<Option<LogTail>, String>,
}

/// The newest `limit` events (all for 0), and whether any were left out.
fn newest_events(events: &[Event], limit: u32) -> (Vec<Event>, bool) {
    let keep = match limit {
        0 => events.len(),
        n => (n as usize).min(events.len()),
    };
    let skip = events.len() - keep;
    (events[skip..].to_vec(), skip > 0)
}

impl Core {
    /// The record of `key` (checked against `expect`), its newest events
    /// and the end of its container log, within `bounds`.
    #[tracing::instrument(skip_all, fields(namespace = %key.namespace, sandbox = %key.name))]
    pub async fn sandbox_diagnostics(
        &self,
        key: &SandboxKey,
        expect: &Precondition,
        bounds: DiagnosticsBounds,
    ) -> Result<SandboxDiagnostics> {
        let record = self.get(key, expect)?;
        let (events, events_truncated) = newest_events(&record.events, bounds.event_limit);
        let log = match bounds.log_tail_lines {
            0 => Ok(None),
            lines => self
                .read_container_log(&record, lines, bounds.log_max_bytes)
                .await
                .map(Some),
        };
        Ok(SandboxDiagnostics {
            record,
            events,
            events_truncated,
            log,
        })
    }

    /// The end of `r`'s container log from its agent, or why there is none.
    #[tracing::instrument(skip_all, fields(sandbox_id = %r.sandbox_id, agent_id = %r.agent_id))]
    async fn read_container_log(
        &self,
        r: &SandboxRecord,
        tail_lines: u32,
        max_bytes: u64,
    ) -> std::result::Result<LogTail, String> {
        if r.sandbox_id.is_empty() || r.agent_id.is_empty() {
            return Err(format!(
                "sandbox {} has no container yet ({:?})",
                r.name, r.phase
            ));
        }
        let agent = match self.registry.agent(&r.agent_id) {
            None => return Err(format!("agent {} is not registered", r.agent_id)),
            Some(a) if a.lost => {
                return Err(format!("agent {} is lost (no heartbeat)", r.agent_id));
            }
            Some(a) => a,
        };
        let body = agent_pb::ReadSandboxLogRequest {
            sandbox_id: r.sandbox_id.to_string(),
            tail_lines: tail_lines.min(MAX_LOG_LINES),
            max_bytes: match max_bytes {
                0 => MAX_LOG_BYTES,
                n => n.min(MAX_LOG_BYTES),
            },
        };
        let answer = self
            .fetch_log(&r.agent_id, &agent.api_endpoint, body)
            .await
            .map_err(|e| format!("reading the log from agent {}: {e}", r.agent_id))?;
        Ok(LogTail {
            content: answer.content,
            truncated: answer.truncated,
        })
    }

    async fn fetch_log(
        &self,
        agent: &crate::ids::AgentId,
        endpoint: &str,
        body: agent_pb::ReadSandboxLogRequest,
    ) -> Result<agent_pb::SandboxLog> {
        let mut client = self.agents.client(agent, endpoint)?;
        let mut req = tonic::Request::new(body);
        req.set_timeout(LOG_READ_DEADLINE);
        match tokio::time::timeout(LOG_READ_DEADLINE, client.read_sandbox_log(req)).await {
            Ok(answer) => answer
                .map(tonic::Response::into_inner)
                .map_err(|status| Error::Unavailable(status.message().to_string())),
            Err(_) => Err(Error::Unavailable(format!(
                "no answer within {LOG_READ_DEADLINE:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(message: &str) -> Event {
        Event {
            at_unix_nanos: 1,
            level: "info".into(),
            source: "controller".into(),
            phase: "Running".into(),
            message: message.into(),
        }
    }

    #[test]
    fn the_newest_events_come_and_a_cut_is_said() {
        let all: Vec<Event> = ["a", "b", "c"].into_iter().map(event).collect();
        let (kept, cut) = newest_events(&all, 2);
        assert_eq!(
            kept.iter().map(|e| e.message.as_str()).collect::<Vec<_>>(),
            ["b", "c"]
        );
        assert!(cut);
        assert_eq!(newest_events(&all, 0), (all.clone(), false));
        assert_eq!(newest_events(&all, 5), (all, false));
    }
}
