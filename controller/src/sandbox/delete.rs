//! Delete: the container, then the record, then the slot; then the named
//! volumes the sandbox's create made and asked to be removed with it; then
//! the snapshot it was restored from, if its deletion waited for it.

use crate::error::{Error, Result};
use crate::ids::SandboxKey;
use crate::sandbox::{Core, Precondition};
use crate::store::SandboxRecord;

/// Why a sandbox goes: the store keeps a tombstone of an expired one where
/// readers outside the controller look for it ([`Store::delete_expired`]).
///
/// [`Store::delete_expired`]: crate::store::Store::delete_expired
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeleteCause {
    Requested,
    Expired,
}

impl Core {
    pub async fn delete(&self, key: &SandboxKey, expect: &Precondition) -> Result<SandboxRecord> {
        self.delete_for(key, expect, DeleteCause::Requested).await
    }

    /// Deletes `key`, or, when no record holds it, the tombstone its expiry
    /// left (FastPath v2: the OpenSandbox server deletes a Terminated
    /// sandbox it shows).
    pub async fn delete_or_tombstone(&self, key: &SandboxKey, expect: &Precondition) -> Result<()> {
        match self.delete(key, expect).await {
            Err(Error::NotFound(_)) if self.store.delete_tombstone(key)? => {
                tracing::info!(sandbox = %key.name, namespace = %key.namespace, "expired sandbox's tombstone deleted");
                Ok(())
            }
            r => r.map(|_| ()),
        }
    }

    #[tracing::instrument(skip_all, fields(namespace = %key.namespace, sandbox = %key.name, ?cause, sandbox_id, agent))]
    pub(crate) async fn delete_for(
        &self,
        key: &SandboxKey,
        expect: &Precondition,
        cause: DeleteCause,
    ) -> Result<SandboxRecord> {
        let r = self.get(key, expect)?;
        let span = tracing::Span::current();
        span.record("sandbox_id", r.sandbox_id.as_str());
        span.record("agent", r.agent_id.as_str());
        let container_gone = self.remove_container(&r).await?;
        match cause {
            DeleteCause::Requested => self.store.delete(key)?,
            DeleteCause::Expired => self.store.delete_expired(key)?,
        };
        self.untrack_expiry(&r);
        if !r.agent_id.is_empty() {
            self.registry.release(&r.agent_id, &r.sandbox_id);
        }
        self.recovering.lock().remove(key);
        tracing::info!(sandbox = %r.name, namespace = %r.namespace, agent = %r.agent_id, "deleted");
        // After the container: a mounted volume cannot be removed.
        self.delete_sandbox_volumes(&r, container_gone).await;
        // Last: a snapshot whose deletion waited for this sandbox may go
        // (its writable layer, a child of the snapshot, went with the container).
        if !r.spec.snapshot_id.is_empty() {
            self.snapshot_released(&r.spec.snapshot_id).await;
        }
        Ok(r)
    }

    /// Removes a record's container; true when it is gone for sure. A lost
    /// or unknown agent cannot be asked: the record goes anyway and the
    /// janitor (or the controller's orphan check, when the agent comes
    /// back) removes the container later.
    async fn remove_container(&self, r: &SandboxRecord) -> Result<bool> {
        if r.agent_id.is_empty() || r.sandbox_id.is_empty() {
            return Ok(true);
        }
        let Some(agent) = self.registry.agent(&r.agent_id) else {
            return Ok(false);
        };
        if agent.lost {
            tracing::warn!(sandbox = %r.name, agent = %r.agent_id, "agent lost; container left to the janitor");
            return Ok(false);
        }
        self.delete_container(r, &agent).await?;
        Ok(true)
    }
}
