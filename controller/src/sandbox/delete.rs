//! Delete: the container, then the record, then the slot.

use crate::error::Result;
use crate::ids::SandboxKey;
use crate::sandbox::{Core, Precondition};
use crate::store::SandboxRecord;

impl Core {
    pub async fn delete(&self, key: &SandboxKey, expect: &Precondition) -> Result<SandboxRecord> {
        let r = self.get(key, expect)?;
        self.remove_container(&r).await?;
        self.store.delete(key)?;
        self.untrack_expiry(&r);
        if !r.agent_id.is_empty() {
            self.registry.release(&r.agent_id, &r.sandbox_id);
        }
        self.recovering.lock().remove(key);
        tracing::info!(sandbox = %r.name, namespace = %r.namespace, agent = %r.agent_id, "deleted");
        Ok(r)
    }

    /// Removes a record's container. A lost or unknown agent cannot be asked:
    /// the record goes anyway and the janitor (or the controller's orphan
    /// check, when the agent comes back) removes the container later.
    async fn remove_container(&self, r: &SandboxRecord) -> Result<()> {
        if r.agent_id.is_empty() || r.sandbox_id.is_empty() {
            return Ok(());
        }
        let Some(agent) = self.registry.agent(&r.agent_id) else {
            return Ok(());
        };
        if agent.lost {
            tracing::warn!(sandbox = %r.name, agent = %r.agent_id, "agent lost; container left to the janitor");
            return Ok(());
        }
        self.delete_container(r, &agent).await
    }
}
