//! `SandboxPool` status from the registry: the leader counts, for each pool
//! resource, the agents that heartbeat for it, the ready ones, the sandboxes
//! they hold and what they can hold (within the pool's `capacity` bound).
//!
//! Pools are matched by name: agents report the pool they were started for
//! (`--pool`, one DaemonSet per pool in the chart).

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use sandbolt_deploy::{SandboxPool, SandboxPoolStatus};

use crate::registry::PoolSummary;
use crate::sandbox::Core;

/// The status `pool` should show, given the registry's pool summaries.
pub fn status_for(pool: &SandboxPool, summaries: &[PoolSummary]) -> SandboxPoolStatus {
    let name = pool.metadata.name.as_deref().unwrap_or_default();
    let mut status = SandboxPoolStatus {
        observed_generation: pool.metadata.generation,
        ..Default::default()
    };
    for s in summaries.iter().filter(|s| s.pool.pool == name) {
        status.agents += s.total_agents.max(0) as u32;
        status.ready_agents += s.ready_agents.max(0) as u32;
        status.sandboxes += s.allocated.max(0) as u32;
    }
    status.capacity = pool.spec.capacity_for(status.ready_agents);
    // Keep the conditions someone else set; this loop owns only the counts.
    if let Some(old) = &pool.status {
        status.conditions = old.conditions.clone();
    }
    status
}

/// Writes every pool's status whose counts changed; returns how many.
pub async fn publish_once(core: &Core, pools: &Api<SandboxPool>) -> Result<usize, kube::Error> {
    let summaries = core.registry().pools();
    let mut written = 0;
    let listed = pools.list(&Default::default()).await?.items;
    // Creates honour each pool's `capacity.maxSandboxes` from here on.
    core.registry().set_pool_caps(pool_caps(&listed));
    for pool in listed {
        let status = status_for(&pool, &summaries);
        if pool.status.as_ref() == Some(&status) {
            continue;
        }
        let name = pool.metadata.name.clone().unwrap_or_default();
        pools
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": status })),
            )
            .await?;
        written += 1;
    }
    Ok(written)
}

/// `capacity.maxSandboxes` of every pool that sets it, by name.
pub fn pool_caps(pools: &[SandboxPool]) -> std::collections::HashMap<String, u32> {
    pools
        .iter()
        .filter_map(|p| {
            let max = p.spec.capacity.as_ref()?.max_sandboxes?;
            Some((p.metadata.name.clone()?, max))
        })
        .collect()
}

/// Publishes every `period` until the task is aborted.
pub fn spawn(
    core: Arc<Core>,
    pools: Api<SandboxPool>,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match publish_once(&core, &pools).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(pools = n, "pool status written"),
                Err(e) => tracing::warn!(error = %e, "pool status not written; will retry"),
            }
            tokio::time::sleep(period).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::PoolKey;
    use sandbolt_deploy::SandboxPoolSpec;
    use sandbolt_deploy::pool::CapacityBounds;

    fn summary(pool: &str, total: i32, ready: i32, allocated: i64) -> PoolSummary {
        PoolSummary {
            pool: PoolKey::new("", pool),
            total_agents: total,
            ready_agents: ready,
            allocated,
            ..Default::default()
        }
    }

    #[test]
    fn counts_come_from_the_pools_agents_within_its_bound() {
        let mut pool = SandboxPool::new(
            "gpu",
            SandboxPoolSpec {
                limits: None,
                node_selector: Default::default(),
                max_sandboxes_per_agent: 4,
                runtime: Default::default(),
                warm_images: vec![],
                capacity: Some(CapacityBounds {
                    min_agents: None,
                    max_sandboxes: Some(10),
                }),
            },
        );
        pool.metadata.generation = Some(3);
        let s = status_for(&pool, &[summary("gpu", 4, 3, 5), summary("cpu", 9, 9, 50)]);
        assert_eq!(
            (
                s.agents,
                s.ready_agents,
                s.sandboxes,
                s.capacity,
                s.observed_generation
            ),
            (4, 3, 5, 10, Some(3))
        );
        let empty = status_for(&pool, &[summary("cpu", 1, 1, 1)]);
        assert_eq!((empty.agents, empty.capacity), (0, 0));
    }

    #[test]
    fn only_pools_with_a_max_sandboxes_bound_creates() {
        let pool = |name: &str, max: Option<u32>| {
            SandboxPool::new(
                name,
                SandboxPoolSpec {
                    limits: None,
                    node_selector: Default::default(),
                    max_sandboxes_per_agent: 4,
                    runtime: Default::default(),
                    warm_images: vec![],
                    capacity: Some(CapacityBounds {
                        min_agents: Some(1),
                        max_sandboxes: max,
                    }),
                },
            )
        };
        let caps = pool_caps(&[pool("gpu", Some(10)), pool("cpu", None)]);
        assert_eq!(caps, [("gpu".to_string(), 10)].into());
    }
}
