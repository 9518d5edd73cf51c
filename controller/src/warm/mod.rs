//! Warm pools: buffers of started, idle sandboxes of one image kept on the
//! agents of an agent pool, so that a create is a claim (the agent rebinds
//! identity, limits, network, mounts and the entrypoint in a running
//! sandbox) instead of a container start.
//!
//! - `model.rs`: a pool as the API carries it, validated;
//! - `book.rs`: the registry's view of warm sandboxes (reported, claimed)
//!   and of each pool's members;
//! - `targets.rs`: each agent's share of a pool's buffer;
//! - `claim.rs`: a create's warm pool (`spec.pool` naming one, or a pool of
//!   the same image) and the claim step of placement;
//! - `service.rs`: `sandbolt.control.v1.WarmPoolService`.
//!
//! The pools live in the [`Store`](crate::store::Store); the controller
//! keeps them in memory ([`WarmPools`]), reloaded at start and every few
//! seconds (another writer, e.g. `kubectl` on the Kubernetes store, is
//! seen that late) and updated at once by the service's own writes.

pub mod book;
mod claim;
pub mod model;
#[cfg(test)]
mod registry_tests;
pub mod service;
pub mod targets;

pub(crate) use claim::Placed;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use sandbolt_proto::agent::v1 as apb;
use sandbolt_proto::control::v1 as pb;

use crate::error::Result;
use crate::sandbox::Core;
use crate::store::WarmPoolRecord;

/// How often the in-memory table is reloaded from the store.
const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// The warm pools, by name.
#[derive(Debug, Default)]
pub struct WarmPools {
    pools: RwLock<BTreeMap<String, WarmPoolRecord>>,
    loaded_at: Mutex<Option<Instant>>,
}

impl WarmPools {
    pub fn get(&self, name: &str) -> Option<WarmPoolRecord> {
        self.pools.read().get(name).cloned()
    }

    pub fn all(&self) -> Vec<WarmPoolRecord> {
        self.pools.read().values().cloned().collect()
    }

    /// The pools whose buffers the agents of `agent_pool` keep.
    pub fn of_agent_pool(&self, agent_pool: &str) -> Vec<WarmPoolRecord> {
        self.pools
            .read()
            .values()
            .filter(|p| p.agent_pool == agent_pool)
            .cloned()
            .collect()
    }

    pub(crate) fn put(&self, p: WarmPoolRecord) {
        self.pools.write().insert(p.name.clone(), p);
    }

    pub(crate) fn remove(&self, name: &str) {
        self.pools.write().remove(name);
    }

    fn replace_all(&self, pools: Vec<WarmPoolRecord>) {
        *self.pools.write() = pools.into_iter().map(|p| (p.name.clone(), p)).collect();
        *self.loaded_at.lock() = Some(Instant::now());
    }

    fn due(&self) -> bool {
        self.loaded_at
            .lock()
            .is_none_or(|t| t.elapsed() >= RELOAD_EVERY)
    }
}

impl Core {
    /// Loads the warm pools from the store (start, and every few seconds).
    pub fn reload_warm_pools(&self) -> Result<()> {
        let pools = self.store.list_warm_pools()?;
        self.warm_pools.replace_all(pools);
        Ok(())
    }

    /// [`Core::reload_warm_pools`] if the last load is old enough.
    pub(crate) fn reload_warm_pools_if_due(&self) {
        if self.warm_pools.due()
            && let Err(e) = self.reload_warm_pools()
        {
            tracing::warn!(error = %e, "warm pools not reloaded from the store");
        }
    }

    pub fn warm_pools(&self) -> &WarmPools {
        &self.warm_pools
    }

    /// A pool's status from the registry's counts.
    pub fn warm_status(&self, p: &WarmPoolRecord) -> pb::WarmPoolStatus {
        let c = self.registry.warm_counts(&p.name, &p.agent_pool);
        let n = |v: i64| i32::try_from(v.max(0)).unwrap_or(i32::MAX);
        pb::WarmPoolStatus {
            total: n(c.available + c.allocated),
            allocated: n(c.allocated),
            available: n(c.available),
            starting: n(c.starting),
            revision: p.revision.clone(),
            agents: n(c.agents),
        }
    }

    /// What the heartbeating agent should hold: its share of every warm
    /// pool of its agent pool (the whole set; a pool not listed is drained).
    pub fn warm_targets(&self, inv: &apb::Inventory) -> Vec<apb::WarmTarget> {
        let agent_pool = crate::placement::or_default(&inv.pool);
        self.warm_pools
            .of_agent_pool(agent_pool)
            .iter()
            .map(|p| {
                let allocated = self.registry.warm_counts(&p.name, agent_pool).allocated;
                let desired = targets::desired_available(p, allocated);
                let agents = self.registry.warm_agents(agent_pool);
                let count = targets::shares(desired, &agents)
                    .get(inv.agent_id.as_str())
                    .copied()
                    .unwrap_or(0);
                apb::WarmTarget {
                    class: Some(model::class_of(p)),
                    count: i32::try_from(count).unwrap_or(i32::MAX),
                }
            })
            .collect()
    }

    /// The desired available count of `p` now (FastPath's `desired_fastlets`).
    pub fn warm_desired(&self, p: &WarmPoolRecord) -> u32 {
        let allocated = self.registry.warm_counts(&p.name, &p.agent_pool).allocated;
        targets::desired_available(p, allocated)
    }
}
