//! The egress policy of a running sandbox: the record holds it, the agent
//! enforces it.
//!
//! An update writes the new policy into the record first (generation
//! bumped, marked *pending*), then sends it to the sandbox's agent
//! (`AgentService.UpdateNetworkPolicy`), which answers once its rules are in
//! place; the mark is cleared when the agent confirmed.
//!
//! # Outages
//!
//! - The agent is silent, unreachable, times out or fails: the record keeps
//!   the new policy and the mark, and the caller hears UNAVAILABLE saying
//!   so. Every heartbeat of the agent that reports the sandbox re-sends the
//!   record's policy until the agent confirms it (applying one is
//!   idempotent); a restarted controller finds the marks in the records. A
//!   container recreated elsewhere (AUTO_RECREATE) gets the record's policy
//!   with its create, which clears the mark.
//! - The agent refuses the policy (INVALID_ARGUMENT, FAILED_PRECONDITION,
//!   UNIMPLEMENTED: it cannot enforce it): a policy that is not enforced
//!   must not stand in the record, so the previous one is restored and the
//!   refusal reaches the caller.
//! - Concurrent updates: pushes are serialized per sandbox and each sends
//!   the policy the record holds when it starts, so the last push always
//!   carries the newest policy.

use std::collections::HashSet;
use std::sync::Arc;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::egress::NetworkPolicy;
use tonic::Code;

use crate::clock;
use crate::error::{Error, Result};
use crate::ids::SandboxKey;
use crate::sandbox::Core;
use crate::store::{Phase, SandboxRecord};

/// The policy part of a record before an update, to restore on refusal.
#[derive(Debug, Clone, Default)]
pub(crate) struct PolicyBefore {
    json: String,
    pending: bool,
}

impl PolicyBefore {
    pub(crate) fn of(r: &SandboxRecord) -> Self {
        Self {
            json: r.spec.network_policy_json.clone(),
            pending: r.network_policy_pending,
        }
    }
}

/// Inside an update's write: replaces `r`'s policy; true if it changed.
pub(crate) fn record_policy(
    r: &mut SandboxRecord,
    policy: &NetworkPolicy,
    now_ms: i64,
) -> Result<bool> {
    if !matches!(r.phase, Phase::Running | Phase::Paused) {
        return Err(Error::FailedPrecondition(format!(
            "sandbox {} is {:?}; its network policy can be replaced while it is Running or Paused",
            r.key(),
            r.phase
        )));
    }
    let json = policy.to_json();
    if json == r.spec.network_policy_json {
        return Ok(false);
    }
    r.spec.network_policy_json = json;
    r.network_policy_pending = true;
    r.network_policy_transition_unix_ms = now_ms;
    r.push_event(
        "info",
        "controller",
        format!(
            "network policy replaced ({}, {} rules)",
            policy.mode(),
            policy.egress.len()
        ),
    );
    Ok(true)
}

/// The agent said the policy itself cannot be applied (not a health issue).
fn refused(e: &Error) -> bool {
    matches!(e, Error::Agent { status, .. } if matches!(
        status.code(),
        Code::InvalidArgument | Code::FailedPrecondition | Code::Unimplemented
    ))
}

impl Core {
    /// After an update recorded a new policy in `r`: the agent applies it,
    /// or the caller learns it is recorded and pending (see the module docs).
    pub(crate) async fn push_policy(
        &self,
        r: SandboxRecord,
        before: PolicyBefore,
    ) -> Result<SandboxRecord> {
        let key = r.key();
        self.policy_pending
            .lock()
            .entry(key.clone())
            .or_insert(false);
        match self.sync_policy(&key).await {
            Ok(x) => Ok(x),
            Err(e) if refused(&e) => {
                self.restore_policy(&r, before, &e);
                Err(e)
            }
            Err(e) => Err(Error::Unavailable(format!(
                "sandbox {key}: the network policy is recorded (generation {}) but agent {} has not applied it yet ({e}); it is re-sent when the agent reports the sandbox again",
                r.generation, r.agent_id
            ))),
        }
    }

    /// Sends the record's policy to its agent if it is pending, one push
    /// per sandbox at a time; clears the mark once the agent confirmed.
    pub(crate) async fn sync_policy(&self, key: &SandboxKey) -> Result<SandboxRecord> {
        let lock = self
            .policy_locks
            .lock()
            .entry(key.clone())
            .or_default()
            .clone();
        let result = {
            let _held = lock.lock().await;
            self.send_policy(key).await
        };
        let mut g = self.policy_locks.lock();
        // Clones are taken under this mutex: 2 = the map's and ours.
        if Arc::strong_count(&lock) == 2 {
            g.remove(key);
        }
        result
    }

    async fn send_policy(&self, key: &SandboxKey) -> Result<SandboxRecord> {
        let r = self.load(key)?;
        if !r.network_policy_pending {
            self.policy_pending.lock().remove(key);
            return Ok(r);
        }
        if !matches!(r.phase, Phase::Running | Phase::Paused) {
            return Err(Error::Unavailable(format!(
                "sandbox {key} is {:?}; its next container gets the policy",
                r.phase
            )));
        }
        let agent = self.live_agent(&r)?;
        let (sent, sid) = (r.spec.network_policy_json.clone(), r.sandbox_id.clone());
        let status = self
            .agents
            .update_network_policy(
                &r.agent_id,
                &agent.api_endpoint,
                &sid,
                &sent,
                self.config.create_deadline,
            )
            .await?;
        let now = clock::now_unix_ms();
        let confirmed = self.modify(key, |x| {
            if x.sandbox_id != sid || x.spec.network_policy_json != sent {
                return Err(Error::Aborted("changed".into()));
            }
            if !status.ip_address.is_empty() {
                x.ip_address.clone_from(&status.ip_address);
            }
            if x.network_policy_pending {
                x.network_policy_pending = false;
                x.network_policy_transition_unix_ms = now;
                x.push_event(
                    "info",
                    "agent",
                    format!("network policy applied on agent {}", x.agent_id),
                );
            }
            Ok(())
        });
        match confirmed {
            Ok(x) => {
                self.policy_pending.lock().remove(key);
                Ok(x)
            }
            // A newer policy (its push waits for the lock) or a new
            // container (its create carried the policy).
            Err(Error::Aborted(_)) => self.load(key),
            Err(e) => Err(e),
        }
    }

    /// The agent refused the policy `r` holds: the previous one stands again.
    fn restore_policy(&self, r: &SandboxRecord, before: PolicyBefore, why: &Error) {
        let (refused, sid) = (&r.spec.network_policy_json, &r.sandbox_id);
        let now = clock::now_unix_ms();
        let restored = self.modify(&r.key(), |x| {
            if x.sandbox_id != *sid || x.spec.network_policy_json != *refused {
                return Err(Error::Aborted("changed".into()));
            }
            x.spec.network_policy_json.clone_from(&before.json);
            x.network_policy_pending = before.pending;
            x.network_policy_transition_unix_ms = now;
            x.generation += 1;
            x.push_event(
                "warning",
                "agent",
                format!("the agent refused the network policy ({why}); the previous one is kept"),
            );
            Ok(())
        });
        match restored {
            Ok(x) if !x.network_policy_pending => {
                self.policy_pending.lock().remove(&x.key());
            }
            Ok(_) | Err(Error::Aborted(_)) => {}
            Err(e) => {
                tracing::warn!(sandbox = %r.key(), error = %e, "a refused network policy could not be taken back from the record");
            }
        }
    }

    /// On a heartbeat: re-sends the pending policies of the sandboxes this
    /// agent reports, one push per sandbox at a time.
    pub(crate) fn resend_policies(self: &Arc<Self>, inv: &pb::Inventory) {
        let due: Vec<SandboxKey> = {
            let g = self.policy_pending.lock();
            g.iter()
                .filter(|(_, running)| !**running)
                .map(|(k, _)| k.clone())
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let reported: HashSet<&str> = inv
            .sandboxes
            .iter()
            .map(|s| s.sandbox_id.as_str())
            .collect();
        for key in due {
            let r = match self.store.get(&key) {
                Ok(Some(r)) if r.network_policy_pending => r,
                Ok(_) => {
                    self.policy_pending.lock().remove(&key);
                    continue;
                }
                Err(e) => {
                    tracing::debug!(sandbox = %key, error = %e, "pending network policy not re-sent: store read failed");
                    continue;
                }
            };
            if r.agent_id.as_str() != inv.agent_id
                || !reported.contains(r.sandbox_id.as_str())
                || !matches!(r.phase, Phase::Running | Phase::Paused)
            {
                continue;
            }
            match self.policy_pending.lock().get_mut(&key) {
                Some(running) if !*running => *running = true,
                _ => continue,
            }
            let core = self.clone();
            tokio::spawn(async move { core.resend_policy(key).await });
        }
    }

    #[tracing::instrument(skip_all, fields(sandbox = %key))]
    async fn resend_policy(self: Arc<Self>, key: SandboxKey) {
        match self.sync_policy(&key).await {
            Ok(r) if !r.network_policy_pending => {
                tracing::info!(agent = %r.agent_id, "pending network policy applied by the agent");
            }
            Ok(_) => {}
            Err(e) if refused(&e) => {
                tracing::warn!(error = %e, "the agent refuses the recorded network policy; not re-sent again until the controller restarts");
                let _ = self.modify(&key, |x| {
                    x.push_event(
                        "error",
                        "agent",
                        format!("the agent refuses the recorded network policy: {e}"),
                    );
                    Ok(())
                });
                self.policy_pending.lock().remove(&key);
            }
            Err(e) => tracing::debug!(error = %e, "pending network policy not applied yet"),
        }
        if let Some(running) = self.policy_pending.lock().get_mut(&key) {
            *running = false;
        }
    }
}
