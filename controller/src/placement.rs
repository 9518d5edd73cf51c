//! The placement index: fast-sandbox's score, without the linear scan.
//!
//! Score (OSEP-0005): `allocated + 1000` when the image is not cached on the
//! agent, `allocated` when it is; lowest wins. Filters: pool, namespace, free
//! capacity, exposed-port conflicts.
//!
//! Instead of scoring every agent, agents with free capacity sit in ordered
//! sets keyed by `(allocated, name)`: one set per (namespace, pool) and one
//! per (namespace, pool, image key). The best cached candidate is the first
//! element of the image set, the best uncached candidate is the first element
//! of the pool set; comparing the two gives the global minimum in O(log n).
//! Ties are broken by load, then by name, so placement is deterministic.
//! A port filter skips conflicting agents in order (linear only in the number
//! of conflicting agents it has to skip).
//!
//! Reservations are part of the index: `allocate` takes the slot in the same
//! critical section that picks the agent, so concurrent allocations can never
//! hand out the same slot twice.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crate::ids::AgentId;

/// Penalty for an image that the agent does not have cached (OSEP-0005).
pub const IMAGE_MISS_PENALTY: u64 = 1000;

type Name = Arc<str>;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    pub namespace: String,
    pub pool: String,
}

impl PoolKey {
    pub fn new(namespace: &str, pool: &str) -> Self {
        Self {
            namespace: or_default(namespace).into(),
            pool: or_default(pool).into(),
        }
    }
}

/// Empty namespace and empty pool both mean `default`.
pub fn or_default(s: &str) -> &str {
    if s.is_empty() { "default" } else { s }
}

/// What an agent last told us about itself (from its heartbeat).
#[derive(Debug, Clone, Default)]
pub struct AgentState {
    pub pool: PoolKey,
    pub capacity: u32,
    /// Image match keys (see `sandbolt_image_ref::match_key`): references and digests.
    pub images: HashSet<String>,
    /// Sandbox ids the agent reported (each holds a slot until it is gone).
    pub reported: HashSet<String>,
    /// Ports in use on the agent, as it reported them.
    pub used_ports: HashSet<u32>,
    /// OCI runtimes the agent can run.
    pub runtimes: HashSet<String>,
    /// The agent has a volume root (it can hold named volumes).
    pub volume_root: bool,
    /// The agent's shared volume filesystem (JuiceFS) is mounted: it can
    /// run sandboxes that mount shared volumes.
    pub shared_volumes: bool,
}

impl Default for PoolKey {
    fn default() -> Self {
        Self::new("", "")
    }
}

#[derive(Debug)]
struct Slot {
    name: Name,
    state: AgentState,
    /// Slots the controller handed out (sandbox id → its exposed ports); a
    /// slot is held from placement until release, whatever the agent says.
    reserved: HashMap<String, Vec<u32>>,
    allocated: u32,
    schedulable: bool,
}

impl Slot {
    fn recount(&mut self) {
        let extra = self
            .state
            .reported
            .iter()
            .filter(|id| !self.reserved.contains_key(*id))
            .count();
        self.allocated = (self.reserved.len() + extra) as u32;
    }
    fn has_room(&self) -> bool {
        self.schedulable && self.allocated < self.state.capacity
    }
    fn port_conflict(&self, ports: &[u32]) -> bool {
        ports.iter().any(|p| {
            self.state.used_ports.contains(p) || self.reserved.values().any(|r| r.contains(p))
        })
    }
}

/// One placement request.
#[derive(Debug, Clone)]
pub struct PlacementRequest<'a> {
    pub pool: &'a PoolKey,
    /// `sandbolt_image_ref::match_key` of the requested image.
    pub image_key: &'a str,
    pub ports: &'a [u32],
    /// Agents not to use (e.g. the lost one a sandbox is recreated from).
    pub exclude: &'a [&'a str],
    /// Only agents that can run this OCI runtime; `None`: any agent.
    pub runtime: Option<&'a str>,
    /// Volume affinity: the sandbox mounts named volumes that live on this
    /// agent's node, so only this agent will do (a local volume's data
    /// cannot follow the sandbox elsewhere).
    pub pin: Option<&'a str>,
    /// Only agents with a volume root (a named volume is to be created on
    /// the chosen agent).
    pub volume_root: bool,
    /// Only agents whose shared volume filesystem (JuiceFS) is mounted: the
    /// sandbox mounts a shared volume (never an agent whose mount died).
    pub shared_volumes: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub agent: AgentId,
    pub score: u64,
    pub image_cached: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("pool {0}/{1} has no live agents")]
    NoAgents(String, String),
    #[error("no agent in pool {0}/{1} has a free slot (and free ports) for this sandbox")]
    NoCapacity(String, String),
    /// No warm sandbox of the pool is free and a cold create would take
    /// the pool above its `pool_max`.
    #[error("warm pool {pool} is full: {total} of poolMax {max}")]
    WarmPoolFull { pool: String, total: i64, max: i32 },
    /// The agent pool's `SandboxPool` bounds its live sandboxes.
    #[error("pool {pool} is full: {used} sandboxes of its capacity.maxSandboxes {max}")]
    PoolFull { pool: String, used: u64, max: u32 },
    #[error("sandbox id {0} already holds a slot")]
    AlreadyReserved(String),
    #[error("no live agent in pool {0}/{1} can run OCI runtime {2:?}")]
    NoRuntime(String, String, String),
    #[error("no live agent in pool {0}/{1} has a volume root for named volumes")]
    NoVolumeRoot(String, String),
    #[error(
        "no live agent in pool {0}/{1} has the shared volume filesystem (JuiceFS) mounted; the sandbox mounts a juicefs volume"
    )]
    NoSharedVolumes(String, String),
    /// The pinned agent (its node holds the sandbox's local volumes) has no
    /// JuiceFS mount, and the sandbox also mounts a juicefs volume.
    #[error(
        "agent {0}, whose node holds the sandbox's local volumes, has no JuiceFS mount for its juicefs volumes"
    )]
    PinnedNoSharedVolumes(String),
    /// The pinned agent (its node holds the sandbox's volumes) is not
    /// heartbeating.
    #[error("agent {0}, whose node holds the sandbox's volumes, is not heartbeating")]
    PinnedUnavailable(String),
    /// The pinned agent has no free slot (or a requested port is taken).
    #[error(
        "agent {0}, whose node holds the sandbox's volumes, has no free slot (and free ports) for this sandbox"
    )]
    PinnedFull(String),
    /// The pinned agent serves another pool than the sandbox asks for.
    #[error(
        "agent {agent}, whose node holds the sandbox's volumes, serves pool {have}, not {want}"
    )]
    PinnedPool {
        agent: String,
        have: String,
        want: String,
    },
}

#[derive(Debug, Default)]
struct PoolSets {
    all: BTreeSet<(u32, Name)>,
    by_image: HashMap<String, BTreeSet<(u32, Name)>>,
}

#[derive(Debug, Default)]
pub struct PlacementIndex {
    slots: HashMap<Name, Slot>,
    /// Schedulable agents with free capacity, per pool, and the same per
    /// cached image. Nested maps so lookups borrow (no key allocation).
    by_pool: HashMap<PoolKey, PoolSets>,
    /// Schedulable agents per pool, whatever their load (for `NoAgents`).
    live_per_pool: HashMap<PoolKey, usize>,
}

impl PlacementIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn unindex(&mut self, name: &Name) {
        let Some(slot) = self.slots.get(name) else {
            return;
        };
        if !slot.has_room() {
            return;
        }
        let key = (slot.allocated, name.clone());
        let Some(sets) = self.by_pool.get_mut(&slot.state.pool) else {
            return;
        };
        sets.all.remove(&key);
        for img in &slot.state.images {
            if let Some(set) = sets.by_image.get_mut(img.as_str()) {
                set.remove(&key);
                if set.is_empty() {
                    sets.by_image.remove(img.as_str());
                }
            }
        }
    }

    fn index(&mut self, name: &Name) {
        let Some(slot) = self.slots.get(name) else {
            return;
        };
        if !slot.has_room() {
            return;
        }
        let key = (slot.allocated, name.clone());
        if !self.by_pool.contains_key(&slot.state.pool) {
            self.by_pool
                .insert(slot.state.pool.clone(), PoolSets::default());
        }
        let sets = self
            .by_pool
            .get_mut(&slot.state.pool)
            .expect("just ensured");
        sets.all.insert(key.clone());
        for img in &slot.state.images {
            match sets.by_image.get_mut(img.as_str()) {
                Some(set) => {
                    set.insert(key.clone());
                }
                None => {
                    sets.by_image
                        .insert(img.clone(), BTreeSet::from([key.clone()]));
                }
            }
        }
    }

    /// Runs `f` on a slot with the indexes kept consistent around it.
    fn with_slot<R>(&mut self, name: &str, f: impl FnOnce(&mut Slot) -> R) -> Option<R> {
        let name: Name = self.slots.get_key_value(name)?.0.clone();
        self.unindex(&name);
        let slot = self.slots.get_mut(&name).expect("slot present");
        let (was_live, cap) = (slot.schedulable, slot.state.capacity);
        let old_pool = slot.state.pool.clone();
        let r = f(slot);
        slot.recount();
        let is_live = slot.schedulable;
        // Reservations (the hot path) change neither pool nor liveness.
        if was_live != is_live || old_pool != slot.state.pool || cap != slot.state.capacity {
            let new_pool = slot.state.pool.clone();
            if was_live {
                *self.live_per_pool.entry(old_pool).or_default() -= 1;
            }
            if is_live {
                *self.live_per_pool.entry(new_pool).or_default() += 1;
            }
        }
        self.index(&name);
        Some(r)
    }

    /// The hot path: changes one agent's reservations only (pool, capacity
    /// and liveness stay), so only its position in the ordered sets moves.
    fn with_reservations<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut HashMap<String, Vec<u32>>) -> R,
    ) -> Option<R> {
        let name: Name = self.slots.get_key_value(name)?.0.clone();
        self.unindex(&name);
        let slot = self.slots.get_mut(&name).expect("slot present");
        let r = f(&mut slot.reserved);
        slot.recount();
        self.index(&name);
        Some(r)
    }

    /// Adds an agent or replaces what we know of it (heartbeat). Reservations
    /// survive: they are the controller's, not the agent's.
    pub fn upsert(&mut self, name: &str, state: AgentState) {
        if !self.slots.contains_key(name) {
            let n: Name = Arc::from(name);
            self.slots.insert(
                n.clone(),
                Slot {
                    name: n,
                    state: AgentState::default(),
                    reserved: HashMap::new(),
                    allocated: 0,
                    schedulable: false,
                },
            );
        }
        self.with_slot(name, |s| {
            s.state = state;
            s.schedulable = true;
        });
    }

    /// Takes an agent out of placement (lost) without forgetting its slots.
    pub fn set_schedulable(&mut self, name: &str, schedulable: bool) {
        self.with_slot(name, |s| s.schedulable = schedulable);
    }

    pub fn remove(&mut self, name: &str) {
        self.set_schedulable(name, false);
        self.slots.remove(name);
    }

    pub fn contains(&self, name: &str) -> bool {
        self.slots.contains_key(name)
    }

    /// Picks the best agent and reserves a slot on it for `sandbox_id`, in one
    /// step.
    pub fn allocate(
        &mut self,
        req: &PlacementRequest<'_>,
        sandbox_id: &str,
    ) -> Result<Placement, PlacementError> {
        let chosen = self.choose(req)?;
        self.with_reservations(&chosen.agent, |r| {
            r.insert(sandbox_id.to_string(), req.ports.to_vec());
        });
        Ok(chosen)
    }

    /// Picks without reserving (diagnostics, tests).
    pub fn choose(&self, req: &PlacementRequest<'_>) -> Result<Placement, PlacementError> {
        if let Some(pin) = req.pin {
            return self.choose_pinned(req, pin);
        }
        let err = || {
            if self.live_per_pool.get(req.pool).copied().unwrap_or(0) == 0 {
                PlacementError::NoAgents(req.pool.namespace.clone(), req.pool.pool.clone())
            } else {
                PlacementError::NoCapacity(req.pool.namespace.clone(), req.pool.pool.clone())
            }
        };
        let usable = |name: &Name| -> bool {
            !req.exclude.contains(&name.as_ref())
                && (!req.volume_root || self.slots[name].state.volume_root)
                && (!req.shared_volumes || self.slots[name].state.shared_volumes)
                && (req.ports.is_empty() || !self.slots[name].port_conflict(req.ports))
                && req
                    .runtime
                    .is_none_or(|rt| self.slots[name].state.runtimes.contains(rt))
        };
        let sets = self.by_pool.get(req.pool);
        let cached = sets
            .and_then(|s| s.by_image.get(req.image_key))
            .and_then(|set| set.iter().find(|(_, n)| usable(n)))
            .map(|(a, n)| (*a as u64, *a, n.clone()));
        let any = sets
            .and_then(|s| s.all.iter().find(|(_, n)| usable(n)))
            .map(|(a, n)| {
                let hit = self.slots[n].state.images.contains(req.image_key);
                let score = *a as u64 + if hit { 0 } else { IMAGE_MISS_PENALTY };
                (score, *a, n.clone())
            });
        // Lowest (score, load, name) wins.
        let best = match (cached, any) {
            (Some(c), Some(a)) => std::cmp::min(c, a),
            (Some(c), None) => c,
            (None, Some(a)) => a,
            (None, None) => {
                // Say which constraint failed: a runtime nobody in the pool
                // has is the caller's to change, not a capacity problem.
                if let Some(rt) = req.runtime
                    && !self.slots.values().any(|s| {
                        &s.state.pool == req.pool && s.schedulable && s.state.runtimes.contains(rt)
                    })
                    && self.live_per_pool.get(req.pool).copied().unwrap_or(0) > 0
                {
                    return Err(PlacementError::NoRuntime(
                        req.pool.namespace.clone(),
                        req.pool.pool.clone(),
                        rt.to_string(),
                    ));
                }
                if req.volume_root
                    && !self
                        .slots
                        .values()
                        .any(|s| &s.state.pool == req.pool && s.schedulable && s.state.volume_root)
                    && self.live_per_pool.get(req.pool).copied().unwrap_or(0) > 0
                {
                    return Err(PlacementError::NoVolumeRoot(
                        req.pool.namespace.clone(),
                        req.pool.pool.clone(),
                    ));
                }
                if req.shared_volumes
                    && !self.slots.values().any(|s| {
                        &s.state.pool == req.pool && s.schedulable && s.state.shared_volumes
                    })
                    && self.live_per_pool.get(req.pool).copied().unwrap_or(0) > 0
                {
                    return Err(PlacementError::NoSharedVolumes(
                        req.pool.namespace.clone(),
                        req.pool.pool.clone(),
                    ));
                }
                return Err(err());
            }
        };
        let image_cached = self.slots[&best.2].state.images.contains(req.image_key);
        Ok(Placement {
            agent: AgentId::from(&*best.2),
            score: best.0,
            image_cached,
        })
    }

    /// Holds a slot for a sandbox known to live on `agent` (restart rebuild,
    /// recovery). Fails if the agent is unknown.
    pub fn reserve(&mut self, agent: &str, sandbox_id: &str, ports: &[u32]) -> bool {
        self.with_reservations(agent, |r| {
            r.insert(sandbox_id.to_string(), ports.to_vec());
        })
        .is_some()
    }

    /// Gives a slot back. Releasing twice is harmless.
    pub fn release(&mut self, agent: &str, sandbox_id: &str) -> bool {
        self.with_reservations(agent, |r| r.remove(sandbox_id).is_some())
            .unwrap_or(false)
    }

    /// Volume affinity: the one agent whose node holds the sandbox's
    /// volumes, if it can take the sandbox; never another one.
    fn choose_pinned(
        &self,
        req: &PlacementRequest<'_>,
        pin: &str,
    ) -> Result<Placement, PlacementError> {
        let slot = match self.slots.get(pin) {
            Some(s) if s.schedulable && !req.exclude.contains(&pin) => s,
            _ => return Err(PlacementError::PinnedUnavailable(pin.to_string())),
        };
        if &slot.state.pool != req.pool {
            return Err(PlacementError::PinnedPool {
                agent: pin.to_string(),
                have: format!("{}/{}", slot.state.pool.namespace, slot.state.pool.pool),
                want: format!("{}/{}", req.pool.namespace, req.pool.pool),
            });
        }
        if let Some(rt) = req.runtime
            && !slot.state.runtimes.contains(rt)
        {
            return Err(PlacementError::NoRuntime(
                req.pool.namespace.clone(),
                req.pool.pool.clone(),
                rt.to_string(),
            ));
        }
        if req.shared_volumes && !slot.state.shared_volumes {
            return Err(PlacementError::PinnedNoSharedVolumes(pin.to_string()));
        }
        if !slot.has_room() || (!req.ports.is_empty() && slot.port_conflict(req.ports)) {
            return Err(PlacementError::PinnedFull(pin.to_string()));
        }
        let hit = slot.state.images.contains(req.image_key);
        Ok(Placement {
            agent: AgentId::from(pin),
            score: slot.allocated as u64 + if hit { 0 } else { IMAGE_MISS_PENALTY },
            image_cached: hit,
        })
    }

    /// Adds a placeholder for an agent known only from the store, so its
    /// slots can be held before it heartbeats. Not schedulable until then.
    pub fn ensure_known(&mut self, name: &str, pool: PoolKey, capacity: u32) {
        if self.slots.contains_key(name) {
            return;
        }
        let n: Name = Arc::from(name);
        self.slots.insert(
            n.clone(),
            Slot {
                name: n,
                state: AgentState {
                    pool,
                    capacity,
                    ..Default::default()
                },
                reserved: HashMap::new(),
                allocated: 0,
                schedulable: false,
            },
        );
    }

    pub fn allocated(&self, agent: &str) -> Option<u32> {
        self.slots.get(agent).map(|s| s.allocated)
    }

    pub fn capacity(&self, agent: &str) -> Option<u32> {
        self.slots.get(agent).map(|s| s.state.capacity)
    }

    /// Whether `agent` is schedulable and has a free slot and `ports` free
    /// (a warm claim takes a slot like any create).
    pub fn can_take(&self, agent: &str, ports: &[u32]) -> bool {
        self.slots
            .get(agent)
            .is_some_and(|s| s.has_room() && (ports.is_empty() || !s.port_conflict(ports)))
    }

    pub fn is_schedulable(&self, agent: &str) -> bool {
        self.slots.get(agent).is_some_and(|s| s.schedulable)
    }

    /// Whether `sandbox_id` holds a slot on `agent`.
    pub fn is_reserved(&self, agent: &str, sandbox_id: &str) -> bool {
        self.slots
            .get(agent)
            .is_some_and(|s| s.reserved.contains_key(sandbox_id))
    }

    pub fn reserved_on(&self, agent: &str) -> Vec<String> {
        self.slots
            .get(agent)
            .map(|s| s.reserved.keys().cloned().collect())
            .unwrap_or_default()
    }

    pub fn agent_names(&self) -> impl Iterator<Item = &str> {
        self.slots.values().map(|s| s.name.as_ref())
    }

    pub fn state(&self, agent: &str) -> Option<&AgentState> {
        self.slots.get(agent).map(|s| &s.state)
    }
}

/// The naive reference: fast-sandbox's linear scan, with the same tie-break
/// (score, load, name). Used by the benchmark as the baseline and by the tests
/// as an oracle for the index.
pub mod reference {
    use super::*;

    #[derive(Debug, Clone)]
    pub struct Agent {
        pub name: String,
        pub pool: PoolKey,
        pub capacity: u32,
        pub allocated: u32,
        pub images: Vec<String>,
        pub used_ports: Vec<u32>,
    }

    /// Returns the index of the chosen agent.
    pub fn choose(agents: &[Agent], req: &PlacementRequest<'_>) -> Option<usize> {
        let mut best: Option<(u64, u32, &str, usize)> = None;
        for (i, a) in agents.iter().enumerate() {
            if &a.pool != req.pool
                || a.allocated >= a.capacity
                || req.exclude.contains(&a.name.as_str())
            {
                continue;
            }
            if req.ports.iter().any(|p| a.used_ports.contains(p)) {
                continue;
            }
            let miss = !a.images.iter().any(|i| i == req.image_key);
            let score = a.allocated as u64 + if miss { IMAGE_MISS_PENALTY } else { 0 };
            let cand = (score, a.allocated, a.name.as_str(), i);
            if best.is_none_or(|b| (cand.0, cand.1, cand.2) < (b.0, b.1, b.2)) {
                best = Some(cand);
            }
        }
        best.map(|b| b.3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(pool: &str, cap: u32, images: &[&str]) -> AgentState {
        AgentState {
            pool: PoolKey::new("default", pool),
            capacity: cap,
            images: images.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn req<'a>(pool: &'a PoolKey, image: &'a str) -> PlacementRequest<'a> {
        PlacementRequest {
            pool,
            image_key: image,
            ports: &[],
            exclude: &[],
            runtime: None,
            pin: None,
            volume_root: false,
            shared_volumes: false,
        }
    }

    #[test]
    fn image_affinity_beats_load_below_the_penalty() {
        let mut ix = PlacementIndex::new();
        ix.upsert("a", state("p", 10, &[]));
        ix.upsert("b", state("p", 10, &["img"]));
        let pool = PoolKey::new("default", "p");
        // b has the image: score 0 vs 1000.
        for i in 0..5 {
            assert_eq!(
                ix.allocate(&req(&pool, "img"), &format!("s{i}"))
                    .unwrap()
                    .agent,
                "b"
            );
        }
        // b now has 5 allocated: score 5 vs a's 1000 — still b.
        let p = ix.choose(&req(&pool, "img")).unwrap();
        assert_eq!((p.agent.as_str(), p.score, p.image_cached), ("b", 5, true));
        // An image nobody has goes to the least loaded agent.
        let p = ix.choose(&req(&pool, "other")).unwrap();
        assert_eq!(
            (p.agent.as_str(), p.score, p.image_cached),
            ("a", 1000, false)
        );
    }

    #[test]
    fn filters_pool_namespace_capacity_and_ports() {
        let mut ix = PlacementIndex::new();
        ix.upsert("a", state("p", 1, &["img"]));
        let mut other_ns = state("p", 5, &["img"]);
        other_ns.pool = PoolKey::new("team", "p");
        ix.upsert("b", other_ns);
        ix.upsert("c", state("q", 5, &["img"]));
        let mut ported = state("p", 5, &[]);
        ported.used_ports.insert(8080);
        ix.upsert("d", ported);
        let pool = PoolKey::new("", "p");
        assert_eq!(ix.allocate(&req(&pool, "img"), "s1").unwrap().agent, "a");
        // a is full; b/c are elsewhere; d has no image but room.
        assert_eq!(ix.choose(&req(&pool, "img")).unwrap().agent, "d");
        let r = PlacementRequest {
            pool: &pool,
            image_key: "img",
            ports: &[8080],
            exclude: &[],
            runtime: None,
            pin: None,
            volume_root: false,
            shared_volumes: false,
        };
        assert_eq!(
            ix.choose(&r),
            Err(PlacementError::NoCapacity("default".into(), "p".into()))
        );
        let none = PoolKey::new("", "nope");
        assert_eq!(
            ix.choose(&req(&none, "img")),
            Err(PlacementError::NoAgents("default".into(), "nope".into()))
        );
        // Reserved ports conflict too.
        let r = PlacementRequest {
            pool: &pool,
            image_key: "img",
            ports: &[9000],
            exclude: &[],
            runtime: None,
            pin: None,
            volume_root: false,
            shared_volumes: false,
        };
        assert_eq!(ix.allocate(&r, "s2").unwrap().agent, "d");
        assert!(ix.choose(&r).is_err());
        ix.release("d", "s2");
        assert_eq!(ix.choose(&r).unwrap().agent, "d");
    }

    #[test]
    fn only_agents_with_the_runtime_are_considered() {
        let mut ix = PlacementIndex::new();
        ix.upsert("a", state("p", 5, &["img"]));
        let mut gvisor = state("p", 5, &[]);
        gvisor.runtimes.insert("runsc".into());
        ix.upsert("b", gvisor);
        let pool = PoolKey::new("", "p");
        let mut r = req(&pool, "img");
        // Without a runtime, image affinity picks a.
        assert_eq!(ix.choose(&r).unwrap().agent, "a");
        r.runtime = Some("runsc");
        assert_eq!(ix.choose(&r).unwrap().agent, "b");
        r.runtime = Some("crun");
        assert_eq!(
            ix.choose(&r),
            Err(PlacementError::NoRuntime(
                "default".into(),
                "p".into(),
                "crun".into()
            ))
        );
    }

    #[test]
    fn volume_affinity_pins_to_one_agent_and_never_elsewhere() {
        let mut ix = PlacementIndex::new();
        ix.upsert("a", state("p", 1, &["img"]));
        ix.upsert("b", state("p", 5, &[]));
        let pool = PoolKey::new("", "p");
        let pinned = PlacementRequest {
            pin: Some("b"),
            ..req(&pool, "img")
        };
        // a has the image and room, but the volumes are on b.
        let p = ix.allocate(&pinned, "s1").unwrap();
        assert_eq!((p.agent.as_str(), p.score), ("b", IMAGE_MISS_PENALTY));
        // b full: no other agent is taken.
        let mut full = state("p", 1, &[]);
        full.reported = ["s1".to_string()].into();
        ix.upsert("b", full);
        assert_eq!(
            ix.choose(&pinned),
            Err(PlacementError::PinnedFull("b".into()))
        );
        // b silent: unavailable, still not a.
        ix.set_schedulable("b", false);
        assert_eq!(
            ix.choose(&pinned),
            Err(PlacementError::PinnedUnavailable("b".into()))
        );
        // An agent nobody knows, or another pool.
        let ghost = PlacementRequest {
            pin: Some("ghost"),
            ..req(&pool, "img")
        };
        assert_eq!(
            ix.choose(&ghost),
            Err(PlacementError::PinnedUnavailable("ghost".into()))
        );
        let q = PoolKey::new("", "q");
        let other_pool = PlacementRequest {
            pin: Some("a"),
            ..req(&q, "img")
        };
        assert!(matches!(
            ix.choose(&other_pool),
            Err(PlacementError::PinnedPool { .. })
        ));
    }

    #[test]
    fn a_volume_root_is_required_when_a_volume_is_to_be_made() {
        let mut ix = PlacementIndex::new();
        ix.upsert("a", state("p", 5, &["img"]));
        let mut rooted = state("p", 5, &[]);
        rooted.volume_root = true;
        ix.upsert("b", rooted);
        let pool = PoolKey::new("", "p");
        let r = PlacementRequest {
            volume_root: true,
            ..req(&pool, "img")
        };
        assert_eq!(ix.choose(&req(&pool, "img")).unwrap().agent, "a");
        assert_eq!(ix.choose(&r).unwrap().agent, "b");
        ix.set_schedulable("b", false);
        assert_eq!(
            ix.choose(&r),
            Err(PlacementError::NoVolumeRoot("default".into(), "p".into()))
        );
    }

    #[test]
    fn a_shared_volume_needs_a_live_juicefs_mount_and_pins_nothing() {
        let mut ix = PlacementIndex::new();
        // a: the image, no mount; b, c: mounts (c's died: reported false).
        ix.upsert("a", state("p", 5, &["img"]));
        let mut mounted = state("p", 5, &[]);
        mounted.shared_volumes = true;
        ix.upsert("b", mounted.clone());
        ix.upsert("c", mounted);
        let pool = PoolKey::new("", "p");
        let r = PlacementRequest {
            shared_volumes: true,
            ..req(&pool, "img")
        };
        assert_eq!(ix.choose(&req(&pool, "img")).unwrap().agent, "a");
        // Any mounted agent will do: load spreads them over b and c.
        assert_eq!(ix.allocate(&r, "s1").unwrap().agent, "b");
        assert_eq!(ix.allocate(&r, "s2").unwrap().agent, "c");
        // c's mount dies: it gets nothing that needs it.
        ix.upsert("c", state("p", 5, &[]));
        for i in 3..6 {
            assert_eq!(ix.allocate(&r, &format!("s{i}")).unwrap().agent, "b");
        }
        ix.set_schedulable("b", false);
        assert_eq!(
            ix.choose(&r),
            Err(PlacementError::NoSharedVolumes(
                "default".into(),
                "p".into()
            ))
        );
        // A local volume pins to a; a has no mount for the shared one.
        let pinned = PlacementRequest {
            pin: Some("a"),
            ..r.clone()
        };
        assert_eq!(
            ix.choose(&pinned),
            Err(PlacementError::PinnedNoSharedVolumes("a".into()))
        );
    }

    #[test]
    fn ties_break_by_load_then_name_deterministically() {
        let mut ix = PlacementIndex::new();
        for n in ["c", "a", "b"] {
            ix.upsert(n, state("p", 3, &["img"]));
        }
        let pool = PoolKey::new("", "p");
        let order: Vec<AgentId> = (0..6)
            .map(|i| {
                ix.allocate(&req(&pool, "img"), &format!("s{i}"))
                    .unwrap()
                    .agent
            })
            .collect();
        assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
        // Equal score, cached (load 1001) vs uncached (load 0 + 1000): lower load wins.
        let mut ix = PlacementIndex::new();
        ix.upsert("hot", state("p", 5000, &["img"]));
        ix.upsert("cold", state("p", 5000, &[]));
        for i in 0..1000 {
            ix.allocate(&req(&pool, "img"), &format!("s{i}")).unwrap();
        }
        let p = ix.choose(&req(&pool, "img")).unwrap();
        assert_eq!((p.agent.as_str(), p.score), ("cold", 1000));
    }

    #[test]
    fn reported_and_reserved_slots_are_counted_once() {
        let mut ix = PlacementIndex::new();
        let pool = PoolKey::new("", "p");
        ix.upsert("a", state("p", 2, &[]));
        ix.allocate(&req(&pool, "img"), "s1").unwrap();
        let mut st = state("p", 2, &[]);
        st.reported = ["s1".to_string(), "orphan".to_string()].into();
        ix.upsert("a", st);
        assert_eq!(ix.allocated("a"), Some(2));
        assert!(ix.choose(&req(&pool, "img")).is_err());
        ix.release("a", "s1");
        // Still reported by the agent: still held.
        assert_eq!(ix.allocated("a"), Some(2));
        ix.upsert("a", state("p", 2, &[]));
        assert_eq!(ix.allocated("a"), Some(0));
    }

    #[test]
    fn lost_agents_leave_placement_and_keep_their_slots() {
        let mut ix = PlacementIndex::new();
        let pool = PoolKey::new("", "p");
        ix.upsert("a", state("p", 2, &[]));
        ix.allocate(&req(&pool, "img"), "s1").unwrap();
        ix.set_schedulable("a", false);
        assert_eq!(
            ix.choose(&req(&pool, "img")),
            Err(PlacementError::NoAgents("default".into(), "p".into()))
        );
        ix.set_schedulable("a", true);
        assert_eq!(ix.allocated("a"), Some(1));
    }

    /// The index agrees with the linear reference after a random walk of
    /// allocations and releases.
    #[test]
    fn index_matches_linear_reference() {
        let mut ix = PlacementIndex::new();
        let mut agents = Vec::new();
        let mut seed = 0x2545F4914F6CDD1Du64;
        let mut rnd = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let imgs = ["i0", "i1", "i2", "i3"];
        for i in 0..60 {
            let name = format!("agent-{:03}", rnd(1000));
            if ix.contains(&name) {
                continue;
            }
            let pool = PoolKey::new("", if i % 3 == 0 { "q" } else { "p" });
            let images: Vec<String> = imgs
                .iter()
                .filter(|_| rnd(2) == 0)
                .map(|s| s.to_string())
                .collect();
            let capacity = 1 + rnd(4) as u32;
            ix.upsert(
                &name,
                AgentState {
                    pool: pool.clone(),
                    capacity,
                    images: images.iter().cloned().collect(),
                    ..Default::default()
                },
            );
            agents.push(reference::Agent {
                name,
                pool,
                capacity,
                allocated: 0,
                images,
                used_ports: vec![],
            });
        }
        let mut held: Vec<(String, String)> = Vec::new();
        for step in 0..2000 {
            if rnd(3) == 0 && !held.is_empty() {
                let (agent, sid) = held.swap_remove(rnd(held.len() as u64) as usize);
                assert!(ix.release(&agent, &sid));
                agents
                    .iter_mut()
                    .find(|a| a.name == agent)
                    .unwrap()
                    .allocated -= 1;
                continue;
            }
            let pool = PoolKey::new("", if rnd(3) == 0 { "q" } else { "p" });
            let image = imgs[rnd(4) as usize];
            let r = req(&pool, image);
            let want = reference::choose(&agents, &r);
            let sid = format!("s{step}");
            match (ix.allocate(&r, &sid), want) {
                (Ok(p), Some(i)) => {
                    assert_eq!(p.agent, agents[i].name, "step {step}");
                    agents[i].allocated += 1;
                    held.push((p.agent.to_string(), sid));
                }
                (Err(_), None) => {}
                (got, want) => panic!("step {step}: index {got:?}, reference {want:?}"),
            }
        }
    }
}
