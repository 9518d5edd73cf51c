//! `SandboxWarmPool` status from the controller's counts: the leader
//! writes, for each warm pool resource of its namespace, what
//! `WarmPoolService` answers as the pool's status (total, allocated,
//! available, starting, agents), so `kubectl get sbwarm` shows it too.
//!
//! The counts come from the controller's in-memory warm pool table and
//! registry ([`Core::warm_status`]); a resource the controller does not know
//! (yet: the table is reloaded from the store every few seconds) gets zeros
//! and no `observedGeneration`.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use sandbolt_deploy::{SandboxWarmPool, SandboxWarmPoolStatus};
use sandbolt_proto::control::v1 as pb;

use crate::sandbox::Core;

/// What the controller knows of one warm pool: the generation of the spec
/// it acts on, and its counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WarmCounts {
    pub generation: i64,
    pub status: pb::WarmPoolStatus,
}

/// The status a warm pool resource should show, given what the controller
/// knows of the pool.
pub fn status_for(known: Option<&WarmCounts>) -> SandboxWarmPoolStatus {
    let Some(k) = known else {
        return SandboxWarmPoolStatus::default();
    };
    let s = &k.status;
    SandboxWarmPoolStatus {
        total: s.total,
        allocated: s.allocated,
        available: s.available,
        starting: s.starting,
        agents: s.agents,
        observed_generation: Some(k.generation),
    }
}

/// Writes the status of every warm pool of `pools` whose counts changed;
/// `counts` answers for a pool name. Returns how many were written.
pub async fn publish_once(
    pools: &Api<SandboxWarmPool>,
    counts: impl Fn(&str) -> Option<WarmCounts>,
) -> Result<usize, kube::Error> {
    let mut written = 0;
    for pool in pools.list(&Default::default()).await?.items {
        let name = pool.metadata.name.clone().unwrap_or_default();
        let status = status_for(counts(&name).as_ref());
        if pool.status.as_ref() == Some(&status) {
            continue;
        }
        let mut body = serde_json::to_value(&status).expect("a status serializes");
        // A merge patch keeps what it does not mention: say "unknown" out
        // loud rather than leave an old observedGeneration standing.
        body["observedGeneration"] = serde_json::json!(status.observed_generation);
        match pools
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": body })),
            )
            .await
        {
            Ok(_) => written += 1,
            // Deleted since the list: nothing to show it on.
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// The controller's counts of warm pool `name`, if it knows the pool.
pub fn counts_of(core: &Core, name: &str) -> Option<WarmCounts> {
    let pool = core.warm_pools().get(name)?;
    Some(WarmCounts {
        generation: pool.generation,
        status: core.warm_status(&pool),
    })
}

/// Publishes every `period` until the task is aborted.
pub fn spawn(
    core: Arc<Core>,
    pools: Api<SandboxWarmPool>,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match publish_once(&pools, |name| counts_of(&core, name)).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(pools = n, "warm pool status written"),
                // No CRD (an upgraded cluster, see the store): nothing to do.
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    tracing::debug!("no SandboxWarmPool resources to write status on")
                }
                Err(e) => tracing::warn!(error = %e, "warm pool status not written; will retry"),
            }
            tokio::time::sleep(period).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_the_controllers_and_unknown_pools_show_none() {
        let known = WarmCounts {
            generation: 4,
            status: pb::WarmPoolStatus {
                total: 5,
                allocated: 3,
                available: 2,
                starting: 1,
                revision: "9".into(),
                agents: 2,
            },
        };
        let s = status_for(Some(&known));
        assert_eq!(
            (
                s.total,
                s.allocated,
                s.available,
                s.starting,
                s.agents,
                s.observed_generation
            ),
            (5, 3, 2, 1, 2, Some(4))
        );
        assert_eq!(status_for(None), SandboxWarmPoolStatus::default());
        assert_eq!(status_for(None).observed_generation, None);
    }
}
