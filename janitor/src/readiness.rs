//! The janitor's readiness (`/readyz` of `--metrics-listen`): it is ready
//! unless its last scan could not reach containerd. A fail-safe scan (the
//! controller could not be asked) is not unready: the janitor is doing its
//! job, which then is to reap nothing.

use std::sync::Arc;

use parking_lot::Mutex;
use sandbolt_telemetry::Readiness;

use crate::error::{JanitorError, Result};

/// Why the last scan could not reach containerd; None when it could (or
/// before the first scan: the janitor connected at start).
#[derive(Debug, Clone, Default)]
pub(crate) struct ContainerdReach(Arc<Mutex<Option<String>>>);

impl ContainerdReach {
    /// Takes the outcome of a scan's listing of the node: containerd
    /// answered, failed to, or something else went wrong first (then what
    /// is known stays).
    pub(crate) fn record<T>(&self, listed: &Result<T>) {
        match listed {
            Ok(_) => *self.0.lock() = None,
            Err(e @ (JanitorError::Containerd { .. } | JanitorError::Connect(_))) => {
                *self.0.lock() = Some(format!("the last scan could not reach containerd: {e}"));
            }
            Err(_) => {}
        }
    }

    pub(crate) fn readiness(&self) -> Readiness {
        let reach = self.clone();
        Readiness::from_fn(move || {
            let unreachable = reach.0.lock().clone();
            async move { unreachable.map_or(Ok(()), Err) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_a_containerd_failure_makes_the_janitor_unready() {
        let reach = ContainerdReach::default();
        let ready = reach.readiness();
        assert_eq!(ready.check().await, Ok(()), "before the first scan");
        reach.record::<()>(&Err(JanitorError::containerd("containers.List")(
            tonic::Status::unavailable("connection refused"),
        )));
        let reason = ready.check().await.unwrap_err();
        assert!(
            reason.contains("containers.List") && reason.contains("connection refused"),
            "{reason}"
        );
        reach.record::<()>(&Err(JanitorError::OwnershipUnavailable("down".into())));
        assert!(ready.check().await.is_err(), "no news about containerd");
        reach.record(&Ok(()));
        assert_eq!(ready.check().await, Ok(()));
    }
}
