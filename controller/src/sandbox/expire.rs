//! Expiry: persisted in each record (`expires_at`, 0 = manual cleanup), kept
//! in an ordered in-memory index rebuilt from the store on start, and swept
//! periodically. The sweep re-reads the record before deleting, so a renew
//! racing the sweep wins.

use crate::clock;
use crate::ids::SandboxKey;
use crate::sandbox::delete::DeleteCause;
use crate::sandbox::{Core, Precondition};

impl Core {
    /// Deletes every sandbox whose expiry has passed; returns their keys.
    /// A delete that fails (agent unreachable) is retried on the next sweep.
    pub async fn sweep_expired(&self) -> Vec<SandboxKey> {
        let now = clock::now_unix_secs();
        let due: Vec<(i64, SandboxKey)> = {
            let g = self.expiry.lock();
            g.iter().take_while(|(t, _)| *t <= now).cloned().collect()
        };
        let mut deleted = Vec::new();
        for (t, key) in due {
            match self.store.get(&key) {
                Ok(Some(r)) if r.spec.expires_at != 0 && r.spec.expires_at <= now => {
                    match self
                        .delete_for(&key, &Precondition::uid(r.uid), DeleteCause::Expired)
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(sandbox = %key.name, namespace = %key.namespace, expired_at = t, "expired sandbox deleted");
                            deleted.push(key);
                        }
                        Err(e) => {
                            tracing::warn!(sandbox = %key.name, error = %e, "expired sandbox not deleted yet; will retry")
                        }
                    }
                }
                Ok(_) => {
                    // Renewed, made manual or already gone: this entry is stale.
                    self.expiry.lock().remove(&(t, key));
                }
                Err(e) => tracing::warn!(error = %e, "expiry sweep: store read failed"),
            }
        }
        deleted
    }
}

impl Core {
    /// Deletes the sandboxes whose deletion was asked for in the store by
    /// someone else (a `kubectl delete` of the Sandbox): the container goes
    /// first, then the record. Failures are retried on the next sweep.
    pub async fn sweep_deletion_requests(&self) -> Vec<SandboxKey> {
        let mut deleted = Vec::new();
        for key in self.store.deletions_requested() {
            match self.delete(&key, &Precondition::default()).await {
                Ok(_) => {
                    tracing::info!(sandbox = %key.name, namespace = %key.namespace, "sandbox deleted through the store");
                    deleted.push(key);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %key.name, namespace = %key.namespace, error = %e, "requested deletion not done yet; will retry")
                }
            }
        }
        deleted
    }
}
