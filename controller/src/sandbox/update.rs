//! Update: metadata plus at most one other field (v2's `oneof update`) and
//! the egress policy, with optimistic concurrency; a reset revision restarts
//! the container in place, a new policy is pushed to the agent
//! (`policy.rs`).

use std::collections::BTreeMap;

use sandbolt_proto::egress::NetworkPolicy;

use crate::clock;
use crate::error::{Error, Result};
use crate::ids::SandboxKey;
use crate::sandbox::policy::{PolicyBefore, record_policy};
use crate::sandbox::shared::agent_spec;
use crate::sandbox::{Core, Precondition};
use crate::store::{FailurePolicy, Phase, SandboxRecord};

/// The one field an update changes besides metadata.
#[derive(Debug, Clone, PartialEq)]
pub enum UpdateOp {
    None,
    /// v2 semantics: a new absolute expiry; only for sandboxes that expire.
    Expiry(i64),
    /// v1 semantics: 0 removes the expiry, anything else sets it.
    ExpiryV1(i64),
    ResetRevision(String),
    FailurePolicy(FailurePolicy),
    RecoveryTimeout(i32),
}

#[derive(Debug, Clone, Default)]
pub struct UpdateSpec {
    pub expect: Precondition,
    pub metadata_upsert: BTreeMap<String, String>,
    pub metadata_delete: Vec<String>,
    /// Replaces the whole egress policy (checked by the caller, which names
    /// its own field in errors); `None` = unchanged.
    pub network_policy: Option<NetworkPolicy>,
}

impl Core {
    pub async fn update(
        &self,
        key: &SandboxKey,
        op: UpdateOp,
        spec: UpdateSpec,
    ) -> Result<SandboxRecord> {
        if let Some(k) = spec
            .metadata_upsert
            .keys()
            .chain(spec.metadata_delete.iter())
            .find(|k| k.is_empty())
        {
            return Err(Error::InvalidArgument(format!("empty metadata key {k:?}")));
        }
        let now = clock::now_unix_secs();
        let now_ms = clock::now_unix_ms();
        let mut old_expiry = None;
        let mut policy_before = PolicyBefore::default();
        let r = self.modify(key, |r| {
            spec.expect.check(r)?;
            old_expiry = Some(r.spec.expires_at);
            policy_before = PolicyBefore::of(r);
            let mut changed = apply_op(r, &op, now)?;
            changed |= apply_metadata(r, &spec);
            if let Some(p) = &spec.network_policy {
                changed |= record_policy(r, p, now_ms)?;
            }
            if changed {
                r.generation += 1;
            }
            Ok(())
        })?;
        self.track_expiry(&r, old_expiry);
        if let UpdateOp::ResetRevision(rev) = &op {
            return self.restart(r, rev).await;
        }
        // Also when unchanged but still pending: the caller retries a push
        // that did not reach the agent.
        if spec.network_policy.is_some() && r.network_policy_pending {
            return self.push_policy(r, policy_before).await;
        }
        Ok(r)
    }

    /// Reset revision: the same sandbox (id, token, spec) starts afresh.
    async fn restart(&self, r: SandboxRecord, revision: &str) -> Result<SandboxRecord> {
        let agent = self.live_agent(&r)?;
        self.delete_container(&r, &agent).await?;
        let _g = self.inflight(&r.sandbox_id);
        let created = self
            .agents
            .create(
                &r.agent_id,
                &agent.api_endpoint,
                agent_spec(&r, true, &self.secrets)?,
                self.config.create_deadline,
            )
            .await?;
        let ip = created.status.map(|s| s.ip_address).unwrap_or_default();
        self.modify(&r.key(), |x| {
            x.phase = Phase::Running;
            x.ip_address.clone_from(&ip);
            x.push_event(
                "info",
                "agent",
                format!("restarted for reset revision {revision}"),
            );
            Ok(())
        })
    }
}

/// Applies `op` to `r`; true if it changed the desired state.
fn apply_op(r: &mut SandboxRecord, op: &UpdateOp, now: i64) -> Result<bool> {
    match op {
        UpdateOp::None => return Ok(false),
        UpdateOp::ExpiryV1(0) => {
            r.spec.expires_at = 0;
            r.push_event("info", "controller", "expiry removed: manual cleanup");
        }
        UpdateOp::Expiry(t) | UpdateOp::ExpiryV1(t) => renew(r, *t, now)?,
        UpdateOp::ResetRevision(s) => {
            if s.is_empty() {
                return Err(Error::InvalidArgument(
                    "reset_revision must not be empty".into(),
                ));
            }
            r.reset_revision = s.clone();
            r.push_event(
                "info",
                "controller",
                format!("reset revision {s} requested"),
            );
        }
        UpdateOp::FailurePolicy(p) => {
            r.spec.failure_policy = *p;
            r.push_event("info", "controller", format!("failure policy set to {p:?}"));
        }
        UpdateOp::RecoveryTimeout(t) => {
            if *t < 0 {
                return Err(Error::InvalidArgument(
                    "recovery_timeout_seconds must not be negative".into(),
                ));
            }
            r.spec.recovery_timeout_seconds = *t;
        }
    }
    Ok(true)
}

/// A new expiry for a sandbox that expires.
fn renew(r: &mut SandboxRecord, t: i64, now: i64) -> Result<()> {
    if t <= 0 {
        return Err(Error::InvalidArgument(
            "expires_at_unix_seconds must be a positive unix time".into(),
        ));
    }
    if r.spec.expires_at == 0 {
        // OpenSandbox #442: renew is not a mode switch.
        return Err(Error::FailedPrecondition(format!(
            "Sandbox {} does not have automatic expiration enabled.",
            r.name
        )));
    }
    if t <= now {
        return Err(Error::InvalidArgument(format!(
            "expiry {t} is not in the future"
        )));
    }
    r.spec.expires_at = t;
    r.push_event("info", "controller", format!("expiry set to {t}"));
    Ok(())
}

/// Applies the metadata changes; true if any changed a value.
fn apply_metadata(r: &mut SandboxRecord, spec: &UpdateSpec) -> bool {
    let mut changed = false;
    for (k, v) in &spec.metadata_upsert {
        changed |= r.spec.metadata.insert(k.clone(), v.clone()).as_ref() != Some(v);
    }
    for k in &spec.metadata_delete {
        changed |= r.spec.metadata.remove(k).is_some();
    }
    changed
}
