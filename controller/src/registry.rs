//! The agent registry: who is out there, how to reach them, what they hold.
//!
//! Agents push a heartbeat with their full inventory (capacity, images,
//! sandboxes); the first one registers the agent. An agent that has not been
//! heard from for `lost_agent_timeout` is marked lost and leaves placement.
//! Placement itself lives in [`crate::placement::PlacementIndex`]; the
//! registry keeps it and the agents' addresses under one lock so an agent
//! can never be chosen after it was marked lost.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::placement::{
    AgentState, Placement, PlacementError, PlacementIndex, PlacementRequest, PoolKey,
};
use crate::store::AgentRecord;

#[derive(Debug, Clone)]
pub struct AgentInfo {
    pub agent_id: String,
    pub instance_id: String,
    pub node_name: String,
    pub pool: PoolKey,
    pub api_endpoint: String,
    pub proxy_endpoint: String,
    pub capacity: u32,
    pub last_seen: Instant,
    pub lost: bool,
    /// Heard from since this controller started (false for agents known only
    /// from the store).
    pub heartbeated: bool,
    /// Sandbox id → what the agent last reported about it.
    pub sandboxes: HashMap<String, pb::SandboxStatus>,
    pub images: Vec<pb::ImageInfo>,
}

#[derive(Debug, Default)]
struct Inner {
    index: PlacementIndex,
    agents: HashMap<String, AgentInfo>,
}

#[derive(Debug, Default)]
pub struct Registry {
    inner: Mutex<Inner>,
    /// Whether pools belong to a namespace (fast-sandbox: a SandboxPool is
    /// namespaced and serves only its namespace). Off by default: the agent
    /// fills `Inventory.namespace` with its containerd namespace (`k8s.io`),
    /// which is no sandbox namespace, so pools are global by name.
    namespaced_pools: bool,
}

/// What changed with a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatOutcome {
    /// First time this agent is seen (or its addresses changed): persist it.
    pub persist: bool,
    /// It had been marked lost and is back.
    pub came_back: bool,
}

/// Pool counts for GetPool/ListPools.
#[derive(Debug, Clone, Default)]
pub struct PoolSummary {
    pub pool: PoolKey,
    pub total_agents: i32,
    pub ready_agents: i32,
    pub idle_agents: i32,
    pub max_sandboxes_per_agent: i32,
    pub allocated: i64,
    pub capacity: i64,
    /// Normalized reference → agents that have it cached.
    pub images: BTreeMap<String, i32>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_namespaced_pools(namespaced_pools: bool) -> Self {
        Self {
            namespaced_pools,
            ..Self::default()
        }
    }

    /// The pool key placement uses for (namespace, pool).
    pub fn pool_key(&self, namespace: &str, pool: &str) -> PoolKey {
        PoolKey::new(if self.namespaced_pools { namespace } else { "" }, pool)
    }

    /// Applies a heartbeat: replaces what we know of the agent.
    pub fn heartbeat(&self, inv: &pb::Inventory) -> HeartbeatOutcome {
        let pool = self.pool_key(&inv.namespace, &inv.pool);
        let mut images = std::collections::HashSet::new();
        for img in &inv.images {
            for r in &img.references {
                images.insert(sandbolt_image_ref::match_key(r));
            }
            if !img.digest.is_empty() {
                images.insert(img.digest.to_ascii_lowercase());
            }
        }
        let state = AgentState {
            pool: pool.clone(),
            capacity: inv.max_sandboxes.max(0) as u32,
            images,
            reported: inv.sandboxes.iter().map(|s| s.sandbox_id.clone()).collect(),
            used_ports: inv.used_ports.iter().copied().collect(),
        };
        let mut g = self.inner.lock();
        g.index.upsert(&inv.agent_id, state);
        let sandboxes = inv
            .sandboxes
            .iter()
            .map(|s| (s.sandbox_id.clone(), s.clone()))
            .collect();
        let now = Instant::now();
        match g.agents.get_mut(&inv.agent_id) {
            Some(a) => {
                let persist = a.api_endpoint != inv.api_endpoint
                    || a.proxy_endpoint != inv.proxy_endpoint
                    || a.pool != pool
                    || a.capacity != inv.max_sandboxes.max(0) as u32;
                let came_back = a.lost;
                a.instance_id = inv.instance_id.clone();
                a.node_name = inv.node_name.clone();
                a.pool = pool;
                a.api_endpoint = inv.api_endpoint.clone();
                a.proxy_endpoint = inv.proxy_endpoint.clone();
                a.capacity = inv.max_sandboxes.max(0) as u32;
                a.last_seen = now;
                a.lost = false;
                a.heartbeated = true;
                a.sandboxes = sandboxes;
                a.images = inv.images.clone();
                HeartbeatOutcome { persist, came_back }
            }
            None => {
                g.agents.insert(
                    inv.agent_id.clone(),
                    AgentInfo {
                        agent_id: inv.agent_id.clone(),
                        instance_id: inv.instance_id.clone(),
                        node_name: inv.node_name.clone(),
                        pool,
                        api_endpoint: inv.api_endpoint.clone(),
                        proxy_endpoint: inv.proxy_endpoint.clone(),
                        capacity: inv.max_sandboxes.max(0) as u32,
                        last_seen: now,
                        lost: false,
                        heartbeated: true,
                        sandboxes,
                        images: inv.images.clone(),
                    },
                );
                HeartbeatOutcome {
                    persist: true,
                    came_back: false,
                }
            }
        }
    }

    /// Registers an agent known from the store (controller restart): its
    /// slots can be held and it can be reached, but it takes no new sandboxes
    /// until it heartbeats.
    pub fn load_known(&self, a: &AgentRecord) {
        let mut g = self.inner.lock();
        let pool = self.pool_key(&a.namespace, &a.pool);
        g.index.ensure_known(&a.agent_id, pool.clone(), a.capacity);
        g.agents
            .entry(a.agent_id.clone())
            .or_insert_with(|| AgentInfo {
                agent_id: a.agent_id.clone(),
                instance_id: String::new(),
                node_name: a.node_name.clone(),
                pool,
                api_endpoint: a.api_endpoint.clone(),
                proxy_endpoint: a.proxy_endpoint.clone(),
                capacity: a.capacity,
                last_seen: Instant::now(),
                lost: false,
                heartbeated: false,
                sandboxes: HashMap::new(),
                images: Vec::new(),
            });
    }

    /// Chooses an agent and reserves a slot on it, atomically.
    pub fn allocate(
        &self,
        req: &PlacementRequest<'_>,
        sandbox_id: &str,
    ) -> Result<Placement, PlacementError> {
        self.inner.lock().index.allocate(req, sandbox_id)
    }

    /// Holds a slot for a sandbox that already lives on `agent`.
    pub fn reserve(&self, agent: &str, sandbox_id: &str, ports: &[u32]) {
        let mut g = self.inner.lock();
        if !g.index.contains(agent) {
            // Known from a record only: hold the slot anyway so the agent's
            // first heartbeat cannot over-commit it.
            g.index.ensure_known(agent, PoolKey::default(), 0);
        }
        g.index.reserve(agent, sandbox_id, ports);
    }

    pub fn release(&self, agent: &str, sandbox_id: &str) {
        self.inner.lock().index.release(agent, sandbox_id);
    }

    pub fn agent(&self, agent: &str) -> Option<AgentInfo> {
        self.inner.lock().agents.get(agent).cloned()
    }

    pub fn is_live(&self, agent: &str) -> bool {
        self.inner.lock().agents.get(agent).is_some_and(|a| !a.lost)
    }

    /// What the agent last reported about one sandbox.
    pub fn observed(&self, agent: &str, sandbox_id: &str) -> Option<pb::SandboxStatus> {
        self.inner
            .lock()
            .agents
            .get(agent)
            .and_then(|a| a.sandboxes.get(sandbox_id).cloned())
    }

    pub fn allocated(&self, agent: &str) -> Option<u32> {
        self.inner.lock().index.allocated(agent)
    }

    /// Marks agents silent for longer than `timeout` as lost; returns the ones
    /// that became lost now.
    pub fn detect_lost(&self, timeout: Duration) -> Vec<String> {
        let mut g = self.inner.lock();
        let now = Instant::now();
        let lost: Vec<String> = g
            .agents
            .values()
            .filter(|a| !a.lost && now.duration_since(a.last_seen) > timeout)
            .map(|a| a.agent_id.clone())
            .collect();
        for id in &lost {
            g.agents.get_mut(id).expect("present").lost = true;
            g.index.set_schedulable(id, false);
        }
        lost
    }

    /// Whether every agent known at startup has heartbeated since.
    pub fn all_known_heard(&self) -> bool {
        self.inner
            .lock()
            .agents
            .values()
            .all(|a| a.heartbeated || a.lost)
    }

    pub fn pools(&self) -> Vec<PoolSummary> {
        let g = self.inner.lock();
        let mut out: BTreeMap<PoolKey, PoolSummary> = BTreeMap::new();
        for a in g.agents.values() {
            let s = out.entry(a.pool.clone()).or_insert_with(|| PoolSummary {
                pool: a.pool.clone(),
                ..Default::default()
            });
            let allocated = g.index.allocated(&a.agent_id).unwrap_or(0);
            s.total_agents += 1;
            if !a.lost && a.heartbeated {
                s.ready_agents += 1;
                if allocated == 0 {
                    s.idle_agents += 1;
                }
            }
            s.max_sandboxes_per_agent = s.max_sandboxes_per_agent.max(a.capacity as i32);
            s.allocated += allocated as i64;
            s.capacity += a.capacity as i64;
            for img in &a.images {
                if let Some(r) = img.references.first() {
                    *s.images
                        .entry(sandbolt_image_ref::normalize(r))
                        .or_default() += 1;
                }
            }
        }
        out.into_values().collect()
    }

    pub fn agents(&self) -> Vec<AgentInfo> {
        self.inner.lock().agents.values().cloned().collect()
    }
}
