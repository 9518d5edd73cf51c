//! Delete: at once when no sandbox uses the snapshot, else DELETING until
//! the last sandbox restored from it is gone ([`Core::snapshot_released`],
//! and the sweep for releases nobody announced).

use std::time::Duration;

use crate::error::{Error, Result};
use crate::sandbox::Core;
use crate::store::{ListRange, SnapshotPhase, SnapshotRecord};

/// How long an agent may take to remove a snapshot.
const AGENT_DELETE_DEADLINE: Duration = Duration::from_secs(60);

impl Core {
    /// Removes the snapshot (answering it as it was), or marks it DELETING
    /// (answered) while sandboxes restored from it exist. A capture in
    /// progress is FAILED_PRECONDITION.
    #[tracing::instrument(skip_all, fields(namespace = %namespace, snapshot = %id))]
    pub async fn delete_snapshot(
        &self,
        namespace: &str,
        id: &str,
        expected_uid: &str,
    ) -> Result<SnapshotRecord> {
        self.require_ready()?;
        let r = self.get_snapshot(namespace, id, expected_uid)?;
        if r.phase == SnapshotPhase::Pending {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id} is being captured: delete it once it is READY or FAILED"
            )));
        }
        let users = self.snapshot_users(id)?;
        if !users.is_empty() {
            let why = format!(
                "deletion pending: sandboxes created from it exist ({})",
                users.join(", ")
            );
            tracing::info!(snapshot = %id, users = ?users, "snapshot in use: marked deleting");
            return self.mark_deleting(&r, why);
        }
        self.remove_snapshot(r).await
    }

    /// Called after a sandbox restored from `snapshot_id` was deleted (its
    /// record is gone): removes the snapshot when its deletion was asked
    /// and no sandbox uses it any more.
    pub async fn snapshot_released(&self, snapshot_id: &str) {
        let r = match self.store.get_snapshot(snapshot_id) {
            Ok(Some(r)) if r.phase == SnapshotPhase::Deleting => r,
            _ => return,
        };
        match self.snapshot_users(snapshot_id) {
            Ok(users) if users.is_empty() => {}
            _ => return,
        }
        if let Err(e) = self.remove_snapshot(r).await {
            tracing::warn!(snapshot = %snapshot_id, error = %e, "could not remove a released snapshot; the sweep retries");
        }
    }

    /// Removes every DELETING snapshot no sandbox record uses any more.
    #[tracing::instrument(skip_all)]
    pub async fn sweep_snapshots(&self) {
        let (snapshots, sandboxes) = match (
            self.store.list_snapshots(),
            self.store.list(&ListRange::all()),
        ) {
            (Ok(s), Ok(r)) => (s, r),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "snapshot sweep could not read the store");
                return;
            }
        };
        let users = super::model::users_by_snapshot(&sandboxes);
        for r in snapshots {
            if r.phase != SnapshotPhase::Deleting || users.contains_key(&r.id) {
                continue;
            }
            let id = r.id.clone();
            if let Err(e) = self.remove_snapshot(r).await {
                tracing::warn!(snapshot = %id, error = %e, "snapshot sweep could not remove a snapshot");
            }
        }
    }

    /// The snapshot off its node, then its record. When the agent refuses
    /// (a sandbox of the node still starts from it) or cannot be reached,
    /// the record stays DELETING for the sweep. A lost or unknown agent is
    /// not waited for: the janitor reaps what has no record.
    async fn remove_snapshot(&self, r: SnapshotRecord) -> Result<SnapshotRecord> {
        if let Some((agent, a)) = self.live_snapshot_agent(&r) {
            let removed = self
                .agents
                .delete_snapshot(&agent, &a.api_endpoint, &r.id, AGENT_DELETE_DEADLINE)
                .await;
            if let Err(e) = removed {
                tracing::info!(snapshot = %r.id, agent = %r.agent_id, error = %e, "agent did not remove the snapshot: stays deleting");
                return self.mark_deleting(&r, format!("deletion pending: {e}"));
            }
        }
        self.store.delete_snapshot(&r.id)?;
        tracing::info!(snapshot = %r.id, agent = %r.agent_id, "snapshot removed");
        Ok(r)
    }

    /// DELETING with `why`; a record gone meanwhile was removed by another
    /// caller and is answered as it was.
    fn mark_deleting(&self, r: &SnapshotRecord, why: String) -> Result<SnapshotRecord> {
        let marked = self.modify_snapshot(&r.id, |s| {
            s.phase = SnapshotPhase::Deleting;
            s.message = why.clone();
            Ok(())
        });
        match marked {
            Err(Error::Store(crate::store::StoreError::SnapshotNotFound(_))) => Ok(r.clone()),
            other => other,
        }
    }
}
