//! The registry's bookkeeping of warm sandboxes (kept under the registry's
//! lock, beside the placement index, so that choosing a warm sandbox and
//! reserving its slot are one step).
//!
//! - What each agent last reported: its claimable warm sandboxes and how
//!   many it is starting, per warm pool.
//! - **Claimed** ids: a warm sandbox handed to a create is never handed out
//!   again. A heartbeat taken before the claim reached the agent (or
//!   applied out of order) still lists it as warm; the id stays claimed as
//!   long as any heartbeat lists it, and for [`CLAIM_MEMORY`] after the
//!   last one did (an agent never makes an id warm again: warm ids are
//!   fresh, and a claimed one stays a sandbox or is removed).
//! - **Members**: the sandbox ids placed in a warm pool (claimed or created
//!   cold within it), while they hold a slot: the pool's `allocated`, which
//!   `pool_max` bounds. The registry removes a member when its slot is
//!   released, the one path every end of a sandbox takes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sandbolt_proto::agent::v1 as apb;

use crate::ids::{AgentId, SandboxId};

/// How long a claimed id is remembered after the last heartbeat that still
/// listed it as warm.
pub const CLAIM_MEMORY: Duration = Duration::from_secs(300);

#[derive(Debug, Default)]
struct AgentWarm {
    warm: Vec<apb::WarmSandbox>,
    starting: HashMap<String, i32>,
}

#[derive(Debug, Clone)]
struct Claimed {
    agent: AgentId,
    last_listed: Instant,
}

#[derive(Debug, Default)]
pub struct WarmBook {
    agents: HashMap<AgentId, AgentWarm>,
    claimed: HashMap<SandboxId, Claimed>,
    members: HashMap<SandboxId, String>,
    allocated: HashMap<String, i64>,
}

/// Whether warm sandbox `w` serves a create of warm pool `pool` with image
/// match key `image_key`.
fn serves(w: &apb::WarmSandbox, pool: &str, image_key: &str) -> bool {
    w.class.as_ref().is_some_and(|c| {
        c.warm_pool == pool && sandbolt_image_ref::match_key(&c.image) == image_key
    })
}

fn pool_of(w: &apb::WarmSandbox) -> &str {
    w.class.as_ref().map_or("", |c| c.warm_pool.as_str())
}

impl WarmBook {
    /// Replaces what `agent` reported (one heartbeat).
    pub fn apply(&mut self, agent: &str, inv: &apb::Inventory, now: Instant) {
        let listed: std::collections::HashSet<&str> =
            inv.warm.iter().map(|w| w.sandbox_id.as_str()).collect();
        self.claimed.retain(|id, c| {
            if c.agent != agent {
                return true;
            }
            if listed.contains(id.as_str()) {
                c.last_listed = now;
            }
            now.duration_since(c.last_listed) < CLAIM_MEMORY
        });
        let a = self.agents.entry(agent.into()).or_default();
        a.warm.clone_from(&inv.warm);
        a.starting = inv.warm_starting.clone();
    }

    /// Warm sandboxes of `agent` a create of `pool` may claim.
    pub fn claimable<'a>(
        &'a self,
        agent: &str,
        pool: &'a str,
        image_key: &'a str,
    ) -> impl Iterator<Item = &'a apb::WarmSandbox> + 'a {
        self.agents
            .get(agent)
            .into_iter()
            .flat_map(|a| a.warm.iter())
            .filter(move |w| {
                serves(w, pool, image_key) && !self.claimed.contains_key(w.sandbox_id.as_str())
            })
    }

    /// Agents that reported warm sandboxes (claimable or not).
    pub fn agents(&self) -> impl Iterator<Item = &AgentId> {
        self.agents.keys()
    }

    /// Hands `id` of `agent` to a create, for good.
    pub fn claim(&mut self, agent: &AgentId, id: &SandboxId, now: Instant) {
        self.claimed.insert(
            id.clone(),
            Claimed {
                agent: agent.clone(),
                last_listed: now,
            },
        );
    }

    pub fn is_claimed(&self, id: &str) -> bool {
        self.claimed.contains_key(id)
    }

    /// Counts `id` as allocated in `pool` (idempotent).
    pub fn add_member(&mut self, id: &SandboxId, pool: &str) {
        if pool.is_empty() {
            return;
        }
        if let Some(old) = self.members.insert(id.clone(), pool.to_string()) {
            *self.allocated.entry(old).or_default() -= 1;
        }
        *self.allocated.entry(pool.to_string()).or_default() += 1;
    }

    /// `id` no longer holds a slot (idempotent).
    pub fn remove_member(&mut self, id: &str) {
        if let Some(pool) = self.members.remove(id) {
            *self.allocated.entry(pool).or_default() -= 1;
        }
    }

    /// Live sandboxes placed in `pool`.
    pub fn allocated(&self, pool: &str) -> i64 {
        self.allocated.get(pool).copied().unwrap_or(0)
    }

    /// Unclaimed warm sandboxes of `pool` on the agents `live` accepts.
    pub fn available(&self, pool: &str, live: impl Fn(&str) -> bool) -> i64 {
        self.agents
            .iter()
            .filter(|(a, _)| live(a))
            .flat_map(|(_, a)| a.warm.iter())
            .filter(|w| pool_of(w) == pool && !self.claimed.contains_key(w.sandbox_id.as_str()))
            .count() as i64
    }

    /// Warm sandboxes of `pool` being started on the agents `live` accepts.
    pub fn starting(&self, pool: &str, live: impl Fn(&str) -> bool) -> i64 {
        self.agents
            .iter()
            .filter(|(a, _)| live(a))
            .filter_map(|(_, a)| a.starting.get(pool))
            .map(|n| i64::from((*n).max(0)))
            .sum()
    }

    /// Unclaimed warm sandboxes of any pool on `agent`.
    pub fn available_on(&self, agent: &str) -> i64 {
        self.agents.get(agent).map_or(0, |a| {
            a.warm
                .iter()
                .filter(|w| !self.claimed.contains_key(w.sandbox_id.as_str()))
                .count() as i64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warm(id: &str, pool: &str) -> apb::WarmSandbox {
        apb::WarmSandbox {
            sandbox_id: id.into(),
            class: Some(apb::WarmClass {
                warm_pool: pool.into(),
                image: "docker.io/library/busybox:latest".into(),
                ..Default::default()
            }),
            created_at_unix_ms: 1,
        }
    }

    fn inv(ws: &[apb::WarmSandbox]) -> apb::Inventory {
        apb::Inventory {
            agent_id: "a".into(),
            warm: ws.to_vec(),
            warm_starting: [("p".to_string(), 2)].into(),
            ..Default::default()
        }
    }

    fn key() -> String {
        sandbolt_image_ref::match_key("busybox")
    }

    #[test]
    fn a_claimed_id_never_becomes_claimable_again_from_stale_heartbeats() {
        let mut b = WarmBook::default();
        let t0 = Instant::now();
        b.apply(
            "a",
            &inv(&[warm("w1", "p"), warm("w2", "p"), warm("x", "q")]),
            t0,
        );
        let k = key();
        let ids = |b: &WarmBook| -> Vec<String> {
            b.claimable("a", "p", &k)
                .map(|w| w.sandbox_id.clone())
                .collect()
        };
        assert_eq!(ids(&b), ["w1", "w2"]);
        assert_eq!(b.available("p", |_| true), 2);
        assert_eq!(b.available("p", |_| false), 0, "only live agents count");
        assert_eq!(b.starting("p", |_| true), 2);
        assert_eq!(b.available_on("a"), 3);
        b.claim(&"a".into(), &"w1".into(), t0);
        assert_eq!(ids(&b), ["w2"]);
        // A heartbeat taken before the claim arrived still lists w1 as warm.
        b.apply(
            "a",
            &inv(&[warm("w1", "p"), warm("w2", "p")]),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(ids(&b), ["w2"]);
        assert_eq!(b.available("p", |_| true), 1);
        // Not listed any more: remembered for a while (an out-of-order
        // heartbeat could list it once more), then forgotten.
        b.apply("a", &inv(&[warm("w2", "p")]), t0 + Duration::from_secs(2));
        assert!(b.is_claimed("w1"));
        b.apply(
            "a",
            &inv(&[warm("w1", "p"), warm("w2", "p")]),
            t0 + Duration::from_secs(3),
        );
        assert_eq!(ids(&b), ["w2"], "a late stale heartbeat changes nothing");
        let later = t0 + Duration::from_secs(3) + CLAIM_MEMORY;
        b.apply("a", &inv(&[warm("w2", "p")]), later);
        assert!(!b.is_claimed("w1"));
        // Another pool or image is never claimable for this class.
        assert_eq!(b.claimable("a", "q", &k).count(), 0);
        assert_eq!(
            b.claimable("a", "p", "docker.io/library/alpine:latest")
                .count(),
            0
        );
        assert_eq!(b.claimable("b", "p", &k).count(), 0, "unknown agent");
    }

    #[test]
    fn members_count_per_pool_and_are_idempotent() {
        let mut b = WarmBook::default();
        b.add_member(&"s1".into(), "p");
        b.add_member(&"s1".into(), "p");
        b.add_member(&"s2".into(), "p");
        b.add_member(&"s3".into(), "");
        assert_eq!((b.allocated("p"), b.allocated("")), (2, 0));
        b.remove_member("s1");
        b.remove_member("s1");
        b.remove_member("s3");
        assert_eq!(b.allocated("p"), 1);
        b.add_member(&"s2".into(), "q");
        assert_eq!((b.allocated("p"), b.allocated("q")), (0, 1));
    }
}
