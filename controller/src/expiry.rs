//! Expiry: persisted in each record (`expires_at`, 0 = manual cleanup), kept
//! in an ordered in-memory index rebuilt from the store on start, and swept
//! periodically. The sweep re-reads the record before deleting, so a renew
//! racing the sweep wins.

use crate::clock;
use crate::sandboxes::Core;

impl Core {
    /// Deletes every sandbox whose expiry has passed; returns their names.
    /// A delete that fails (agent unreachable) is retried on the next sweep.
    pub async fn sweep_expired(&self) -> Vec<(String, String)> {
        let now = clock::now_unix_secs();
        let due: Vec<(i64, String, String)> = {
            let g = self.expiry.lock();
            g.iter()
                .take_while(|(t, _, _)| *t <= now)
                .cloned()
                .collect()
        };
        let mut deleted = Vec::new();
        for (t, ns, name) in due {
            match self.store.get(&ns, &name) {
                Ok(Some(r)) if r.expires_at != 0 && r.expires_at <= now => {
                    match self.delete(&ns, &name, &r.uid).await {
                        Ok(_) => {
                            tracing::info!(sandbox = %name, namespace = %ns, expired_at = t, "expired sandbox deleted");
                            deleted.push((ns, name));
                        }
                        Err(e) => {
                            tracing::warn!(sandbox = %name, error = %e, "expired sandbox not deleted yet; will retry")
                        }
                    }
                }
                Ok(_) => {
                    // Renewed, made manual or already gone: this entry is stale.
                    self.expiry.lock().remove(&(t, ns, name));
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
    pub async fn sweep_deletion_requests(&self) -> Vec<(String, String)> {
        let mut deleted = Vec::new();
        for (ns, name) in self.store.deletions_requested() {
            match self.delete(&ns, &name, "").await {
                Ok(_) => {
                    tracing::info!(sandbox = %name, namespace = %ns, "sandbox deleted through the store");
                    deleted.push((ns, name));
                }
                Err(e) => {
                    tracing::warn!(sandbox = %name, namespace = %ns, error = %e, "requested deletion not done yet; will retry")
                }
            }
        }
        deleted
    }
}
