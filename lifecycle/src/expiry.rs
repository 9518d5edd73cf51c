//! Expiry sweep, for backends whose engine does not expire sandboxes itself
//! (Docker; the controller runs its own sweep over its records). Expiry
//! times are persisted by the backend (Docker labels plus renew files), so
//! this loop holds no state of its own: after a restart the first sweep
//! finds whatever expired while we were down, and a renew that races a
//! sweep is seen by the next one instead of being lost in a timer.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tokio::sync::watch;

use crate::api::App;
use crate::backend::Backend;

/// Deletes every sandbox whose expiry has passed; returns their ids.
pub async fn sweep_once<B: Backend>(backend: &B) -> Vec<String> {
    let now = Utc::now();
    let all = match backend.list().await {
        Ok(all) => all,
        Err(e) => {
            tracing::warn!(error = %e, "expiry sweep cannot list sandboxes");
            return Vec::new();
        }
    };
    let mut removed = Vec::new();
    for rec in all {
        if rec.expires_at.is_some_and(|t| t <= now) {
            match backend.delete(&rec.id).await {
                Ok(()) => {
                    tracing::info!(id = %rec.id, "sandbox expired and was deleted");
                    removed.push(rec.id);
                }
                Err(e) => tracing::warn!(id = %rec.id, error = %e, "cannot delete expired sandbox"),
            }
        }
    }
    removed
}

pub async fn sweep_forever<B: Backend>(
    app: Arc<App<B>>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        sweep_once(&app.backend).await;
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
