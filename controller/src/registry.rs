//! The agent registry: who is out there, how to reach them, what they hold.
//!
//! Agents push a heartbeat with their full inventory (capacity, images,
//! sandboxes); the first one registers the agent. An agent that has not been
//! heard from for `lost_agent_timeout` is marked lost and leaves placement.
//! Placement itself lives in [`crate::placement::PlacementIndex`]; the
//! registry keeps it and the agents' addresses under one lock so an agent
//! can never be chosen after it was marked lost.
//!
//! # Silent is not gone
//!
//! Lost only means *silent*: a DaemonSet rollout, a containerd restart or a
//! slow heartbeat all look like that, and the agent's sandboxes keep running
//! meanwhile. Their records stay as they are (their state is *unknown*, see
//! `Core::agent_silent`); nothing is failed or recreated for silence. A
//! silent agent is *gone* only when an [`AgentPresence`] source says so —
//! on Kubernetes: its pod no longer exists and no other agent pod runs on
//! its node — after `agent_gone_timeout` of silence. Without such a source
//! (one machine) an agent is never gone. The registry also tracks the
//! sandboxes a live agent stops reporting, so that a container that
//! vanished (a node reboot, a wiped containerd) is noticed once the agent
//! is back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::ids::{AgentId, SandboxId};
use crate::placement::{
    AgentState, Placement, PlacementError, PlacementIndex, PlacementRequest, PoolKey,
};
use crate::store::AgentRecord;
use crate::warm::book::WarmBook;

#[derive(Debug, Clone)]
pub struct AgentInfo {
    pub agent_id: AgentId,
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
    pub sandboxes: HashMap<SandboxId, pb::SandboxStatus>,
    pub images: Vec<pb::ImageInfo>,
    /// What the agent's pool promises (runtime, limit defaults and maxima),
    /// as the agent last reported it; `None` until it heartbeats.
    pub pool_policy: Option<pb::PoolPolicy>,
    /// OCI runtimes the agent can run.
    pub runtimes: Vec<String>,
    /// What its volume root can do; `None` without one (or until it
    /// heartbeats).
    pub volume_capabilities: Option<pb::VolumeCapabilities>,
    /// Its JuiceFS mount (shared volumes); `None` without one.
    pub juicefs: Option<pb::JuiceFsStatus>,
}

#[derive(Debug, Default)]
struct Inner {
    index: PlacementIndex,
    agents: HashMap<AgentId, AgentInfo>,
    /// Liveness bookkeeping beyond the heartbeat itself, by agent id.
    watch: HashMap<AgentId, Watch>,
    /// Warm sandboxes reported, claimed, and warm pool members.
    warm: WarmBook,
    /// `SandboxPool` `capacity.maxSandboxes` by pool name (Kubernetes; see
    /// [`Registry::set_pool_caps`]).
    pool_caps: HashMap<String, u32>,
}

/// What the registry keeps per agent to tell silent from gone, and to
/// notice sandboxes a live agent no longer reports.
#[derive(Debug, Default)]
struct Watch {
    /// The pod the agent's last heartbeat (to this process) named.
    pod: Option<pb::AgentPod>,
    /// Heartbeats applied; a presence check started before one more arrived
    /// is stale.
    heartbeats: u64,
    /// Judged gone; its failure policies were applied.
    gone: bool,
    /// A presence check is running.
    checking: bool,
    /// No presence check before this instant.
    next_check: Option<Instant>,
    /// Sandbox ids reserved on the agent but absent from its heartbeats.
    missing: HashMap<SandboxId, Missing>,
}

#[derive(Debug, Clone, Copy)]
struct Missing {
    /// When the first heartbeat without it was applied.
    since: Instant,
    /// Consecutive heartbeats without it.
    heartbeats: u32,
    /// Already handed to the caller as vanished.
    reported: bool,
}

/// When a sandbox counts as vanished from a live agent: absent from this
/// many consecutive heartbeats, over at least `min_age`. One heartbeat can be
/// stale (its inventory was taken before a create that committed before it
/// arrived); the next one is taken after that answer, so two in a row are
/// not.
#[derive(Debug, Clone, Copy)]
pub struct VanishRule {
    pub min_heartbeats: u32,
    pub min_age: Duration,
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

/// Every state [`Registry::gauges`] counts agents in: `ready` (heard since
/// this controller started), `unheard` (known from the store, not heard
/// yet), `lost` (silent), `gone` (silent, and judged gone).
pub const AGENT_STATES: [&str; 4] = ["ready", "unheard", "lost", "gone"];

/// See [`Registry::gauges`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryGauges {
    /// Agents by state, every one of [`AGENT_STATES`] present.
    pub agents: BTreeMap<&'static str, i64>,
    /// Sandbox slots of every known agent (what they can hold).
    pub capacity: i64,
    /// Slots reserved on them (what their sandboxes hold).
    pub allocated: i64,
}

/// What changed with a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatOutcome {
    /// First time this agent is seen (or its addresses changed): persist it.
    pub persist: bool,
    /// It had been marked lost and is back.
    pub came_back: bool,
}

/// See [`Registry::sandbox_view`].
#[derive(Debug, Clone, Default)]
pub struct SandboxView {
    pub agent_live: bool,
    pub node_name: String,
    pub observed: Option<pb::SandboxStatus>,
}

/// See [`Registry::volume_nodes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeNode {
    pub agent_id: AgentId,
    pub node_name: String,
    pub pool: PoolKey,
    /// Heartbeating (not marked lost).
    pub live: bool,
    /// Heard from since this controller started: its volumes are known.
    pub heartbeated: bool,
    pub volume_root: bool,
    /// Its JuiceFS mount is up: it can serve shared volumes.
    pub shared_volumes: bool,
    pub free_slots: u32,
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
    /// The pool's policy, from its most recently heard live agent.
    pub policy: Option<pb::PoolPolicy>,
    /// Every runtime some live agent of the pool can run.
    pub runtimes: std::collections::BTreeSet<String>,
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
        let mut images = HashSet::new();
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
            runtimes: available_runtimes(inv).collect(),
            volume_root: inv.volume_capabilities.is_some(),
            shared_volumes: juicefs_mounted(inv.juicefs.as_ref()),
        };
        let mut g = self.inner.lock();
        g.index.upsert(&inv.agent_id, state);
        g.warm.apply(&inv.agent_id, inv, Instant::now());
        let sandboxes = inv
            .sandboxes
            .iter()
            .map(|s| (SandboxId::from(s.sandbox_id.as_str()), s.clone()))
            .collect();
        let now = Instant::now();
        // The pod as last persisted or heard (a new pod must be persisted).
        let g_pod = g
            .watch
            .get(inv.agent_id.as_str())
            .and_then(|w| w.pod.clone());
        match g.agents.get_mut(inv.agent_id.as_str()) {
            Some(a) => {
                let pod_changed = g_pod != inv.pod;
                let persist = a.api_endpoint != inv.api_endpoint
                    || a.proxy_endpoint != inv.proxy_endpoint
                    || a.pool != pool
                    || a.capacity != inv.max_sandboxes.max(0) as u32
                    || pod_changed;
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
                a.pool_policy = inv.pool_policy.clone();
                a.runtimes = available_runtimes(inv).collect();
                a.volume_capabilities = inv.volume_capabilities.clone();
                a.juicefs = inv.juicefs.clone();
                HeartbeatOutcome { persist, came_back }
            }
            None => {
                let agent_id = AgentId::from(inv.agent_id.as_str());
                g.agents.insert(
                    agent_id.clone(),
                    AgentInfo {
                        agent_id,
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
                        pool_policy: inv.pool_policy.clone(),
                        runtimes: available_runtimes(inv).collect(),
                        volume_capabilities: inv.volume_capabilities.clone(),
                        juicefs: inv.juicefs.clone(),
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
        if let Some(pod) = &a.pod {
            // Its pod, so the agent can be judged gone even if it never
            // heartbeats to this controller process.
            g.watch.entry(a.agent_id.clone()).or_default().pod = Some(pb::AgentPod {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                uid: pod.uid.clone(),
            });
        }
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
                pool_policy: None,
                runtimes: Vec::new(),
                volume_capabilities: None,
                juicefs: None,
            });
    }

    /// Chooses an agent and reserves a slot on it, atomically.
    pub fn allocate(
        &self,
        req: &PlacementRequest<'_>,
        sandbox_id: &SandboxId,
    ) -> Result<Placement, PlacementError> {
        self.inner.lock().index.allocate(req, sandbox_id)
    }

    /// Holds a slot for a sandbox that already lives on `agent`.
    pub fn reserve(&self, agent: &AgentId, sandbox_id: &SandboxId, ports: &[u32]) {
        let mut g = self.inner.lock();
        if !g.index.contains(agent) {
            // Known from a record only: hold the slot anyway so the agent's
            // first heartbeat cannot over-commit it.
            g.index.ensure_known(agent, PoolKey::default(), 0);
        }
        g.index.reserve(agent, sandbox_id, ports);
    }

    /// Gives a slot back; a warm pool member stops counting with it.
    pub fn release(&self, agent: &AgentId, sandbox_id: &SandboxId) {
        let mut g = self.inner.lock();
        g.index.release(agent, sandbox_id);
        g.warm.remove_member(sandbox_id);
    }

    pub fn agent(&self, agent: &AgentId) -> Option<AgentInfo> {
        self.inner.lock().agents.get(agent).cloned()
    }

    pub fn is_live(&self, agent: &AgentId) -> bool {
        self.inner.lock().agents.get(agent).is_some_and(|a| !a.lost)
    }

    /// `sandbox_id` still holds its slot on `agent` (placed, not released).
    pub fn is_reserved(&self, agent: &AgentId, sandbox_id: &str) -> bool {
        self.inner.lock().index.is_reserved(agent, sandbox_id)
    }

    /// What a status answer needs about one sandbox's agent, under one lock
    /// and without cloning the agent's inventory: whether it heartbeats, its
    /// node, and what it last reported about the sandbox.
    pub fn sandbox_view(&self, agent: &AgentId, sandbox_id: &SandboxId) -> SandboxView {
        let g = self.inner.lock();
        match g.agents.get(agent) {
            None => SandboxView::default(),
            Some(a) => SandboxView {
                agent_live: !a.lost,
                node_name: a.node_name.clone(),
                observed: a.sandboxes.get(sandbox_id).cloned(),
            },
        }
    }

    /// What the agent last reported about one sandbox.
    pub fn observed(&self, agent: &AgentId, sandbox_id: &SandboxId) -> Option<pb::SandboxStatus> {
        self.inner
            .lock()
            .agents
            .get(agent)
            .and_then(|a| a.sandboxes.get(sandbox_id).cloned())
    }

    pub fn allocated(&self, agent: &AgentId) -> Option<u32> {
        self.inner.lock().index.allocated(agent)
    }

    /// Marks agents silent for longer than `timeout` as lost; returns the ones
    /// that became lost now.
    pub fn detect_lost(&self, timeout: Duration) -> Vec<AgentId> {
        let mut g = self.inner.lock();
        let now = Instant::now();
        let lost: Vec<AgentId> = g
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

    /// Takes a live agent out of placement at once, as if lost, because a
    /// call could not reach it (see `Core::avoid_unreachable`); its next
    /// heartbeat brings it back. True when it was live.
    pub fn mark_unreachable(&self, agent: &AgentId) -> bool {
        let mut g = self.inner.lock();
        let Some(a) = g.agents.get_mut(agent) else {
            return false;
        };
        if a.lost {
            return false;
        }
        a.lost = true;
        g.index.set_schedulable(agent, false);
        true
    }

    /// Whether every agent known at startup has heartbeated since.
    pub fn all_known_heard(&self) -> bool {
        self.inner
            .lock()
            .agents
            .values()
            .all(|a| a.heartbeated || a.lost)
    }

    /// The policy of `pool`: from its most recently heard live agent (agents
    /// of one pool share their flags; during a rollout the newest wins).
    pub fn pool_policy(&self, pool: &PoolKey) -> Option<pb::PoolPolicy> {
        let g = self.inner.lock();
        g.agents
            .values()
            .filter(|a| &a.pool == pool && !a.lost && a.pool_policy.is_some())
            .max_by_key(|a| a.last_seen)
            .and_then(|a| a.pool_policy.clone())
    }

    pub fn pools(&self) -> Vec<PoolSummary> {
        let g = self.inner.lock();
        let mut out: BTreeMap<PoolKey, PoolSummary> = BTreeMap::new();
        let mut newest: HashMap<PoolKey, Instant> = HashMap::new();
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
            if !a.lost {
                s.runtimes.extend(a.runtimes.iter().cloned());
                if a.pool_policy.is_some() && newest.get(&a.pool).is_none_or(|t| *t < a.last_seen) {
                    newest.insert(a.pool.clone(), a.last_seen);
                    s.policy = a.pool_policy.clone();
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

    /// The counts the controller's gauges show (`crate::metrics`), under
    /// one lock and without cloning any agent's inventory.
    pub fn gauges(&self) -> RegistryGauges {
        let g = self.inner.lock();
        let mut agents: BTreeMap<&'static str, i64> =
            AGENT_STATES.iter().map(|s| (*s, 0)).collect();
        let (mut capacity, mut allocated) = (0, 0);
        for a in g.agents.values() {
            let gone = g.watch.get(&a.agent_id).is_some_and(|w| w.gone);
            let state = match (a.lost, gone, a.heartbeated) {
                (true, true, _) => "gone",
                (true, false, _) => "lost",
                (false, _, false) => "unheard",
                (false, _, true) => "ready",
            };
            *agents.entry(state).or_default() += 1;
            capacity += i64::from(a.capacity);
            allocated += i64::from(g.index.allocated(&a.agent_id).unwrap_or(0));
        }
        RegistryGauges {
            agents,
            capacity,
            allocated,
        }
    }

    /// Every known agent as a home for named volumes, by agent id.
    pub fn volume_nodes(&self) -> Vec<VolumeNode> {
        let g = self.inner.lock();
        let mut out: Vec<VolumeNode> = g
            .agents
            .values()
            .map(|a| VolumeNode {
                agent_id: a.agent_id.clone(),
                node_name: a.node_name.clone(),
                pool: a.pool.clone(),
                live: !a.lost,
                heartbeated: a.heartbeated,
                volume_root: a.volume_capabilities.is_some(),
                shared_volumes: juicefs_mounted(a.juicefs.as_ref()),
                free_slots: a
                    .capacity
                    .saturating_sub(g.index.allocated(&a.agent_id).unwrap_or(0)),
            })
            .collect();
        out.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
        out
    }

    // ----------------------------------------------------- warm pools --

    /// Holds a slot for a sandbox that lives on `agent` (like
    /// [`Registry::reserve`]) and counts it in its warm pool, if any.
    pub fn reserve_in(
        &self,
        agent: &AgentId,
        sandbox_id: &SandboxId,
        ports: &[u32],
        warm_pool: &str,
    ) {
        self.reserve(agent, sandbox_id, ports);
        self.add_warm_member(sandbox_id, warm_pool);
    }

    /// Counts `sandbox_id` (which holds a slot) in `warm_pool` ("" = none).
    pub fn add_warm_member(&self, sandbox_id: &SandboxId, warm_pool: &str) {
        self.inner.lock().warm.add_member(sandbox_id, warm_pool);
    }

    /// Places a create of a warm pool, in one step: a free warm sandbox of
    /// its class on an agent that can take it (the one with the most of
    /// them; its oldest), else a cold slot for `cold_id` while the pool's
    /// total stays below `pool_max`. Either way the id is reserved and
    /// counted in the pool.
    pub fn allocate_warm(
        &self,
        req: &PlacementRequest<'_>,
        cold_id: &SandboxId,
        ask: &WarmAsk<'_>,
    ) -> Result<WarmPlacement, PlacementError> {
        let mut g = self.inner.lock();
        // Never more members than pool_max, claimed or not (a refill may
        // briefly hold more warm ones than the pool's total allows).
        let below_max = ask.implicit || g.warm.allocated(ask.pool) < i64::from(ask.pool_max);
        if ask.claim
            && below_max
            && let Some((agent, id)) = Self::pick_warm(&g, req, ask)
        {
            Self::check_cap(&g, req.pool)?;
            g.index.reserve(&agent, &id, req.ports);
            g.warm.claim(&agent, &id, Instant::now());
            g.warm.add_member(&id, ask.pool);
            return Ok(WarmPlacement::Claimed { agent, warm_id: id });
        }
        if ask.implicit {
            Self::check_cap(&g, req.pool)?;
            return Ok(WarmPlacement::Cold(g.index.allocate(req, cold_id)?));
        }
        let available = {
            let Inner { index, warm, .. } = &*g;
            warm.available(ask.pool, |a| index.is_schedulable(a))
        };
        let total = g.warm.allocated(ask.pool) + available;
        if !below_max || total >= i64::from(ask.pool_max) {
            return Err(PlacementError::WarmPoolFull {
                pool: ask.pool.to_string(),
                total,
                max: ask.pool_max,
            });
        }
        Self::check_cap(&g, req.pool)?;
        let p = g.index.allocate(req, cold_id)?;
        g.warm.add_member(cold_id, ask.pool);
        Ok(WarmPlacement::Cold(p))
    }

    /// The bounds of the pools the controller knows as `SandboxPool`
    /// resources (name → `capacity.maxSandboxes`); replaces the last set.
    pub fn set_pool_caps(&self, caps: HashMap<String, u32>) {
        self.inner.lock().pool_caps = caps;
    }

    /// [`Registry::allocate`] for a new sandbox: refused when its pool is at
    /// its `capacity.maxSandboxes` (a recreate is not a new sandbox).
    pub fn allocate_new(
        &self,
        req: &PlacementRequest<'_>,
        sandbox_id: &SandboxId,
    ) -> Result<Placement, PlacementError> {
        let mut g = self.inner.lock();
        Self::check_cap(&g, req.pool)?;
        g.index.allocate(req, sandbox_id)
    }

    fn check_cap(g: &Inner, pool: &PoolKey) -> Result<(), PlacementError> {
        let Some(&max) = g.pool_caps.get(&pool.pool) else {
            return Ok(());
        };
        let used: u64 = g
            .index
            .agent_names()
            .filter(|a| g.index.state(a).is_some_and(|s| &s.pool == pool))
            .filter_map(|a| g.index.allocated(a))
            .map(u64::from)
            .sum();
        if used >= u64::from(max) {
            return Err(PlacementError::PoolFull {
                pool: pool.pool.clone(),
                used,
                max,
            });
        }
        Ok(())
    }

    fn pick_warm(
        g: &Inner,
        req: &PlacementRequest<'_>,
        ask: &WarmAsk<'_>,
    ) -> Option<(AgentId, SandboxId)> {
        let mut best: Option<(usize, &AgentId)> = None;
        for agent in g.warm.agents() {
            let usable = g.index.state(agent).is_some_and(|s| &s.pool == req.pool)
                && !req.exclude.contains(&agent.as_str())
                && req.pin.is_none_or(|p| p == agent.as_str())
                && g.index.can_take(agent, req.ports);
            if !usable {
                continue;
            }
            let n = Self::claimable(g, agent, ask, req).count();
            if n > 0 && best.is_none_or(|(m, a)| n > m || (n == m && agent < a)) {
                best = Some((n, agent));
            }
        }
        let (_, agent) = best?;
        let w = Self::claimable(g, agent, ask, req)
            .min_by_key(|w| (w.created_at_unix_ms, w.sandbox_id.clone()))?;
        Some((agent.clone(), SandboxId::from(w.sandbox_id.as_str())))
    }

    /// The warm sandboxes of `agent` a create may claim: reported warm, not
    /// claimed, and holding no slot (an id a record holds is that record's,
    /// whatever a heartbeat says).
    fn claimable<'a>(
        g: &'a Inner,
        agent: &'a AgentId,
        ask: &'a WarmAsk<'_>,
        req: &'a PlacementRequest<'_>,
    ) -> impl Iterator<Item = &'a pb::WarmSandbox> + 'a {
        g.warm
            .claimable(agent, ask.pool, req.image_key)
            .filter(move |w| !g.index.is_reserved(agent, &w.sandbox_id))
    }

    /// A warm pool's counts, over the live agents.
    pub fn warm_counts(&self, pool: &str, agent_pool: &str) -> WarmCounts {
        let g = self.inner.lock();
        let live = |a: &str| g.index.is_schedulable(a);
        WarmCounts {
            allocated: g.warm.allocated(pool),
            available: g.warm.available(pool, live),
            starting: g.warm.starting(pool, live),
            agents: g
                .agents
                .values()
                .filter(|a| !a.lost && a.pool.pool == agent_pool)
                .count() as i64,
        }
    }

    /// The live agents of the agent pool named `agent_pool`, each with its
    /// room (free slots for user sandboxes).
    pub fn warm_agents(&self, agent_pool: &str) -> Vec<(AgentId, u32)> {
        let g = self.inner.lock();
        g.agents
            .values()
            .filter(|a| !a.lost && a.pool.pool == agent_pool && g.index.is_schedulable(&a.agent_id))
            .map(|a| {
                let used = g.index.allocated(&a.agent_id).unwrap_or(0);
                (a.agent_id.clone(), a.capacity.saturating_sub(used))
            })
            .collect()
    }

    /// Unclaimed warm sandboxes on the live agents of `pool`.
    pub fn warm_available_in(&self, pool: &PoolKey) -> i64 {
        let g = self.inner.lock();
        g.agents
            .values()
            .filter(|a| !a.lost && &a.pool == pool)
            .map(|a| g.warm.available_on(&a.agent_id))
            .sum()
    }

    // ------------------------------------------------------- liveness --

    /// Registered and silent (marked lost): what it holds is unknown, not
    /// failed.
    pub fn is_silent(&self, agent: &AgentId) -> bool {
        self.inner.lock().agents.get(agent).is_some_and(|a| a.lost)
    }

    /// Liveness bookkeeping for one applied heartbeat (call it right after
    /// [`Registry::heartbeat`]). Returns the sandbox ids that `rule` now
    /// counts as vanished: reserved on the agent, not reported by it and
    /// not in `in_flight` (a create or recreate may not have reached the
    /// agent yet; its absence restarts the count). Each id is returned once
    /// per absence.
    pub fn note_heartbeat(
        &self,
        inv: &pb::Inventory,
        in_flight: &HashSet<SandboxId>,
        rule: VanishRule,
    ) -> Vec<SandboxId> {
        let mut g = self.inner.lock();
        let reserved = g.index.reserved_on(&inv.agent_id);
        let w = g.watch.entry(inv.agent_id.as_str().into()).or_default();
        w.heartbeats += 1;
        w.pod = inv.pod.clone();
        w.gone = false;
        w.next_check = None;
        let reported: HashSet<&str> = inv
            .sandboxes
            .iter()
            .map(|s| s.sandbox_id.as_str())
            .collect();
        let now = Instant::now();
        let absent: HashSet<SandboxId> = reserved
            .into_iter()
            .filter(|id| !reported.contains(id.as_str()) && !in_flight.contains(id.as_str()))
            .map(SandboxId::from)
            .collect();
        w.missing.retain(|id, _| absent.contains(id));
        let mut vanished = Vec::new();
        for id in absent {
            let m = w.missing.entry(id.clone()).or_insert(Missing {
                since: now,
                heartbeats: 0,
                reported: false,
            });
            m.heartbeats += 1;
            if !m.reported
                && m.heartbeats >= rule.min_heartbeats
                && now.duration_since(m.since) >= rule.min_age
            {
                m.reported = true;
                vanished.push(id);
            }
        }
        vanished.sort();
        vanished
    }

    /// Silent agents due for a presence check: silent for at least
    /// `gone_after`, not judged gone yet, no check running and none within
    /// the last re-check period. Each is marked as being checked; finish
    /// with [`Registry::presence_checked`]. The `u64` identifies the
    /// heartbeat state the check started from.
    pub fn due_presence_checks(&self, gone_after: Duration) -> Vec<(AgentWhereabouts, u64)> {
        let mut g = self.inner.lock();
        let now = Instant::now();
        let Inner { agents, watch, .. } = &mut *g;
        let mut due = Vec::new();
        for a in agents.values() {
            if !a.lost || now.duration_since(a.last_seen) < gone_after {
                continue;
            }
            let w = watch.entry(a.agent_id.clone()).or_default();
            if w.gone || w.checking || w.next_check.is_some_and(|t| now < t) {
                continue;
            }
            w.checking = true;
            due.push((
                AgentWhereabouts {
                    agent_id: a.agent_id.clone(),
                    node_name: a.node_name.clone(),
                    pool: a.pool.pool.clone(),
                    pod: w.pod.clone(),
                },
                w.heartbeats,
            ));
        }
        due
    }

    /// Ends a presence check started by [`Registry::due_presence_checks`];
    /// the next one waits `recheck`. True when the agent is now judged gone:
    /// the check said so and the agent stayed silent meanwhile (no heartbeat
    /// since the check began). The caller then applies the failure policies.
    pub fn presence_checked(
        &self,
        agent: &AgentId,
        seq: u64,
        gone: bool,
        recheck: Duration,
    ) -> bool {
        let mut g = self.inner.lock();
        let still_silent = g.agents.get(agent).is_some_and(|a| a.lost);
        let Some(w) = g.watch.get_mut(agent) else {
            return false;
        };
        w.checking = false;
        w.next_check = Some(Instant::now() + recheck);
        if gone && still_silent && w.heartbeats == seq && !w.gone {
            w.gone = true;
            return true;
        }
        false
    }

    /// Takes back a gone verdict whose failure policies could not all be
    /// applied, so the next check applies them again.
    pub fn presence_retry(&self, agent: &AgentId) {
        if let Some(w) = self.inner.lock().watch.get_mut(agent) {
            w.gone = false;
        }
    }
}

/// What a create of a warm pool asks [`Registry::allocate_warm`] for.
#[derive(Debug, Clone)]
pub struct WarmAsk<'a> {
    /// The warm pool.
    pub pool: &'a str,
    pub pool_max: i32,
    /// Whether a warm sandbox may serve it (false: cold only, still counted
    /// against `pool_max`).
    pub claim: bool,
    /// The create did not ask for the pool (same image and runtime): a
    /// claim serves it when one is free, else it is an ordinary cold create,
    /// neither counted in the pool nor bounded by its `pool_max`.
    pub implicit: bool,
}

/// Where [`Registry::allocate_warm`] put a create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WarmPlacement {
    /// Warm sandbox `warm_id` on `agent`: the create's id becomes it.
    Claimed { agent: AgentId, warm_id: SandboxId },
    /// A cold create (its slot reserved for the id asked with).
    Cold(Placement),
}

/// A warm pool's counts (see `WarmPoolStatus`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmCounts {
    pub allocated: i64,
    pub available: i64,
    pub starting: i64,
    pub agents: i64,
}

/// Where a silent agent ran: what an [`AgentPresence`] source checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentWhereabouts {
    pub agent_id: AgentId,
    pub node_name: String,
    /// The pool it serves (a successor pod serves the same one).
    pub pool: String,
    /// Its pod, as its last heartbeat to this controller process named it;
    /// `None` outside Kubernetes or when it has not heartbeated since this
    /// process started (the store does not keep it).
    pub pod: Option<pb::AgentPod>,
}

/// What an [`AgentPresence`] source says about a silent agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presence {
    /// What runs the agent is still there: it is only away.
    Present,
    /// Its pod is gone but another agent pod is on its node (a restart or a
    /// rollout under way): the sandboxes wait for it. Carries that pod.
    Replacing(String),
    /// Gone for good, and its sandboxes with it. Carries why.
    Gone(String),
    /// Nothing to check (no pod identity): treated as present.
    Unknown,
}

/// Tells a silent agent from a gone one. Errors mean "cannot tell" and
/// decide nothing.
#[async_trait::async_trait]
pub trait AgentPresence: std::fmt::Debug + Send + Sync + 'static {
    async fn check(&self, agent: &AgentWhereabouts) -> crate::Result<Presence>;
}

/// [`AgentPresence`] from the Kubernetes API: an agent is gone when its pod
/// (`Inventory.pod`) no longer exists (deleted, or garbage-collected with a
/// deleted node), was replaced by a new pod of the same name, or terminated
/// for good — and no successor is on its node: another agent pod (label
/// selector) of the same pool (pool label), which would adopt the
/// sandboxes once it runs. A pod that exists, even on an unreachable node,
/// keeps the agent merely silent: only a deleted pod or Node proves the
/// sandboxes are gone.
#[derive(Clone)]
pub struct KubeAgentPresence {
    client: kube::Client,
    selector: String,
    pool_label: Option<String>,
    timeout: Duration,
}

impl std::fmt::Debug for KubeAgentPresence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeAgentPresence")
            .field("selector", &self.selector)
            .field("pool_label", &self.pool_label)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl KubeAgentPresence {
    /// The chart's agent pods (the janitor uses the same selector).
    pub const DEFAULT_SELECTOR: &'static str = "app.kubernetes.io/component=agent";
    /// The chart's label naming an agent pod's pool.
    pub const DEFAULT_POOL_LABEL: &'static str = "sandbolt.io/pool";

    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            selector: Self::DEFAULT_SELECTOR.into(),
            pool_label: Some(Self::DEFAULT_POOL_LABEL.into()),
            timeout: Duration::from_secs(10),
        }
    }

    /// Label selector of the pods that run agents (a successor must match).
    pub fn with_selector(mut self, selector: impl Into<String>) -> Self {
        self.selector = selector.into();
        self
    }

    /// Label whose value is an agent pod's pool (a successor must serve the
    /// silent agent's pool); `None`: any agent pod on the node counts.
    pub fn with_pool_label(mut self, label: Option<String>) -> Self {
        self.pool_label = label;
        self
    }

    fn successor_selector(&self, pool: &str) -> String {
        match &self.pool_label {
            Some(l) if !pool.is_empty() => format!("{},{l}={pool}", self.selector),
            _ => self.selector.clone(),
        }
    }

    async fn call<T>(
        &self,
        what: &str,
        f: impl Future<Output = kube::Result<T>>,
    ) -> crate::Result<T> {
        tokio::time::timeout(self.timeout, f)
            .await
            .map_err(|_| {
                crate::Error::Unavailable(format!("{what}: no answer within {:?}", self.timeout))
            })?
            .map_err(|e| crate::Error::Unavailable(format!("{what}: {e}")))
    }
}

/// A pod that has stopped for good runs no agent (its containers do not
/// restart).
fn terminated(p: &k8s_openapi::api::core::v1::Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

#[async_trait::async_trait]
impl AgentPresence for KubeAgentPresence {
    async fn check(&self, agent: &AgentWhereabouts) -> crate::Result<Presence> {
        use k8s_openapi::api::core::v1::Pod;
        use kube::api::{Api, ListParams};

        let Some(pod) = &agent.pod else {
            return Ok(Presence::Unknown);
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        let named = format!("pod {}/{}", pod.namespace, pod.name);
        let current = self.call(&named, api.get_opt(&pod.name)).await?;
        let why = match &current {
            None => format!("{named} no longer exists"),
            Some(p) if p.metadata.uid.as_deref() != Some(pod.uid.as_str()) => {
                format!("{named} (uid {}) was replaced", pod.uid)
            }
            Some(p) if terminated(p) => format!("{named} terminated"),
            Some(_) => return Ok(Presence::Present),
        };
        if !agent.node_name.is_empty() {
            // A successor on the same node adopts the sandboxes when it
            // starts (the agent id is the node's): wait for it, however long
            // it takes to pull or to stop crash-looping.
            let lp = ListParams::default()
                .labels(&self.successor_selector(&agent.pool))
                .fields(&format!("spec.nodeName={}", agent.node_name));
            let pods = self.call("agent pods", api.list(&lp)).await?;
            if let Some(p) = pods.items.iter().find(|p| {
                p.metadata.uid.as_deref() != Some(pod.uid.as_str())
                    && p.metadata.deletion_timestamp.is_none()
                    && !terminated(p)
            }) {
                let name = p.metadata.name.clone().unwrap_or_default();
                return Ok(Presence::Replacing(format!(
                    "{why}; agent pod {name} is on node {}",
                    agent.node_name
                )));
            }
        }
        Ok(Presence::Gone(why))
    }
}

/// An agent's JuiceFS mount is up (it can serve shared volumes).
pub fn juicefs_mounted(j: Option<&pb::JuiceFsStatus>) -> bool {
    j.is_some_and(|j| j.mounted)
}

/// The runtimes an inventory says the agent can run.
fn available_runtimes(inv: &pb::Inventory) -> impl Iterator<Item = String> + '_ {
    inv.runtimes
        .iter()
        .filter(|r| r.available)
        .map(|r| r.name.clone())
}

#[cfg(test)]
mod liveness_tests {
    use std::collections::HashSet;

    use super::*;

    fn inv(agent: &str, sandboxes: &[&str]) -> pb::Inventory {
        pb::Inventory {
            agent_id: agent.into(),
            node_name: "node-1".into(),
            max_sandboxes: 8,
            sandboxes: sandboxes
                .iter()
                .map(|s| pb::SandboxStatus {
                    sandbox_id: s.to_string(),
                    ..Default::default()
                })
                .collect(),
            pod: Some(pb::AgentPod {
                namespace: "ns".into(),
                name: format!("{agent}-pod"),
                uid: "uid-1".into(),
            }),
            ..Default::default()
        }
    }

    const NOW: VanishRule = VanishRule {
        min_heartbeats: 2,
        min_age: Duration::ZERO,
    };

    fn beat(r: &Registry, i: &pb::Inventory) -> Vec<SandboxId> {
        r.heartbeat(i);
        r.note_heartbeat(i, &HashSet::new(), NOW)
    }

    #[test]
    fn a_silent_agent_is_checked_after_the_timeout_and_once_per_recheck() {
        let r = Registry::new();
        beat(&r, &inv("a", &[]));
        assert!(!r.is_silent(&"a".into()) && !r.is_silent(&"unknown".into()));
        assert!(
            r.due_presence_checks(Duration::ZERO).is_empty(),
            "not silent"
        );
        r.detect_lost(Duration::ZERO);
        assert!(r.is_silent(&"a".into()));
        assert!(
            r.due_presence_checks(Duration::from_secs(3600)).is_empty(),
            "not silent for long enough"
        );
        let due = r.due_presence_checks(Duration::ZERO);
        assert_eq!(due.len(), 1);
        let (who, seq) = &due[0];
        assert_eq!(who.agent_id, "a");
        assert_eq!(who.node_name, "node-1");
        assert_eq!(who.pool, "default");
        assert_eq!(who.pod.as_ref().unwrap().name, "a-pod");
        assert!(
            r.due_presence_checks(Duration::ZERO).is_empty(),
            "one check at a time"
        );
        // Present: asked again only after the re-check period.
        assert!(!r.presence_checked(&"a".into(), *seq, false, Duration::from_secs(3600)));
        assert!(r.due_presence_checks(Duration::ZERO).is_empty());
        let mut due = Vec::new();
        while due.is_empty() {
            r.presence_checked(&"a".into(), *seq, false, Duration::ZERO);
            due = r.due_presence_checks(Duration::ZERO);
        }
        // Gone: judged once, never checked again while it stays silent.
        assert!(r.presence_checked(&"a".into(), due[0].1, true, Duration::ZERO));
        assert!(r.due_presence_checks(Duration::ZERO).is_empty());
        // Its policies could not all be applied: checked again.
        r.presence_retry(&"a".into());
        let due = r.due_presence_checks(Duration::ZERO);
        assert_eq!(due.len(), 1);
        assert!(r.presence_checked(&"a".into(), due[0].1, true, Duration::ZERO));
    }

    #[test]
    fn a_heartbeat_during_a_check_voids_a_gone_verdict() {
        let r = Registry::new();
        let i = inv("a", &[]);
        beat(&r, &i);
        r.detect_lost(Duration::ZERO);
        let (_, seq) = r.due_presence_checks(Duration::ZERO).remove(0);
        beat(&r, &i);
        assert!(!r.presence_checked(&"a".into(), seq, true, Duration::ZERO));
        // Silent again: a check from before the heartbeat still counts for
        // nothing.
        r.detect_lost(Duration::ZERO);
        assert!(!r.presence_checked(&"a".into(), seq, true, Duration::ZERO));
        // A fresh one does.
        let (_, seq) = r.due_presence_checks(Duration::ZERO).remove(0);
        assert!(r.presence_checked(&"a".into(), seq, true, Duration::ZERO));
        // Back after being judged gone: that verdict is over.
        beat(&r, &i);
        r.detect_lost(Duration::ZERO);
        assert_eq!(r.due_presence_checks(Duration::ZERO).len(), 1);
    }

    #[test]
    fn a_sandbox_vanishes_after_consecutive_heartbeats_without_it_once() {
        let r = Registry::new();
        beat(&r, &inv("a", &["s1", "s2"]));
        r.reserve(&"a".into(), &"s1".into(), &[]);
        r.reserve(&"a".into(), &"s2".into(), &[]);
        let without = inv("a", &["s2"]);
        assert!(beat(&r, &without).is_empty(), "one heartbeat may be stale");
        assert_eq!(beat(&r, &without), ["s1"]);
        assert!(beat(&r, &without).is_empty(), "reported once");
        // Back in the inventory: a later absence counts from zero.
        beat(&r, &inv("a", &["s1", "s2"]));
        assert!(beat(&r, &without).is_empty());
        assert_eq!(beat(&r, &without), ["s1"]);
        // Released (failed, deleted, moved): no longer missing.
        r.release(&"a".into(), &"s1".into());
        beat(&r, &inv("a", &["s1", "s2"]));
        let none = inv("a", &[]);
        assert!(beat(&r, &none).is_empty());
        assert_eq!(beat(&r, &none), ["s2"]);
    }

    #[test]
    fn a_create_in_flight_is_never_missing_and_restarts_the_count() {
        let r = Registry::new();
        let empty = inv("a", &[]);
        beat(&r, &empty);
        r.reserve(&"a".into(), &"new".into(), &[]);
        let in_flight: HashSet<SandboxId> = ["new".into()].into();
        for _ in 0..5 {
            r.heartbeat(&empty);
            assert!(r.note_heartbeat(&empty, &in_flight, NOW).is_empty());
        }
        // Committed: the stale heartbeat that still misses it is one.
        assert!(beat(&r, &empty).is_empty());
        beat(&r, &inv("a", &["new"]));
        // A rule with an age floor waits it out.
        let slow = VanishRule {
            min_heartbeats: 2,
            min_age: Duration::from_secs(3600),
        };
        for _ in 0..5 {
            r.heartbeat(&empty);
            assert!(r.note_heartbeat(&empty, &HashSet::new(), slow).is_empty());
        }
    }
}
