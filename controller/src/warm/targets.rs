//! How many warm sandboxes each agent should hold for one warm pool.
//!
//! The pool's desired *available* count follows OpenSandbox's capacitySpec:
//! at least `buffer_min` idle, enough idle to bring the total up to
//! `pool_min`, never more than `buffer_max` idle, and never a total above
//! `pool_max`:
//!
//! `desired = min(clamp(max(buffer_min, pool_min - allocated), 0, buffer_max), pool_max - allocated)`
//!
//! It is spread over the agent pool's live agents: an even split, the
//! remainder to the agents with the most room (free slots for user
//! sandboxes; ties by agent id, so every heartbeat computes the same
//! split), and no agent above its room (what it cannot take goes to the
//! others). Each heartbeat answer carries the agent's own share.

use std::collections::BTreeMap;

use crate::ids::AgentId;
use crate::store::WarmPoolRecord;

/// The pool's desired count of available (idle) warm sandboxes, given
/// `allocated` live sandboxes of the pool.
pub fn desired_available(p: &WarmPoolRecord, allocated: i64) -> u32 {
    let (bmin, bmax) = (i64::from(p.buffer_min), i64::from(p.buffer_max));
    let want = bmin
        .max(i64::from(p.pool_min) - allocated)
        .clamp(0, bmax.max(0));
    let headroom = (i64::from(p.pool_max) - allocated).max(0);
    u32::try_from(want.min(headroom)).unwrap_or(u32::MAX)
}

/// Splits `desired` over `agents` (agent, room): see the module docs.
pub fn shares(desired: u32, agents: &[(AgentId, u32)]) -> BTreeMap<AgentId, u32> {
    let mut order: Vec<&(AgentId, u32)> = agents.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut share = vec![0u32; order.len()];
    let mut remaining = desired;
    while remaining > 0 {
        let open: Vec<usize> = (0..order.len())
            .filter(|&i| share[i] < order[i].1)
            .collect();
        if open.is_empty() {
            break;
        }
        let base = remaining / open.len() as u32;
        if base == 0 {
            // Fewer left than open agents: one each, most room first.
            for &i in open.iter().take(remaining as usize) {
                share[i] += 1;
            }
            break;
        }
        for &i in &open {
            let add = base.min(order[i].1 - share[i]);
            share[i] += add;
            remaining -= add;
        }
    }
    order
        .iter()
        .zip(share)
        .map(|((a, _), n)| (a.clone(), n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(bmin: i32, bmax: i32, pmin: i32, pmax: i32) -> WarmPoolRecord {
        WarmPoolRecord {
            buffer_min: bmin,
            buffer_max: bmax,
            pool_min: pmin,
            pool_max: pmax,
            ..Default::default()
        }
    }

    #[test]
    fn desired_follows_the_capacity_spec() {
        // The buffer floor.
        assert_eq!(desired_available(&pool(2, 5, 0, 100), 0), 2);
        assert_eq!(desired_available(&pool(2, 5, 0, 100), 50), 2);
        // pool_min pulls the idle count up, bounded by buffer_max.
        assert_eq!(desired_available(&pool(1, 5, 4, 100), 0), 4);
        assert_eq!(desired_available(&pool(1, 5, 4, 100), 2), 2);
        assert_eq!(desired_available(&pool(1, 3, 10, 100), 0), 3);
        // pool_max caps the total.
        assert_eq!(desired_available(&pool(4, 5, 0, 10), 8), 2);
        assert_eq!(desired_available(&pool(4, 5, 0, 10), 10), 0);
        assert_eq!(desired_available(&pool(4, 5, 0, 10), 12), 0);
        assert_eq!(desired_available(&pool(0, 0, 0, 0), 0), 0);
    }

    fn split(desired: u32, agents: &[(&str, u32)]) -> Vec<u32> {
        let a: Vec<(AgentId, u32)> = agents.iter().map(|(n, r)| ((*n).into(), *r)).collect();
        let s = shares(desired, &a);
        agents.iter().map(|(n, _)| s[*n]).collect()
    }

    #[test]
    fn even_split_remainder_to_most_room_and_never_above_room() {
        assert_eq!(split(10, &[("a", 8), ("b", 8)]), [5, 5]);
        // Remainder to the most room, then by id.
        assert_eq!(split(5, &[("a", 8), ("b", 9)]), [2, 3]);
        assert_eq!(split(5, &[("b", 8), ("a", 8)]), [2, 3]);
        // A full agent's share goes to the others.
        assert_eq!(split(6, &[("a", 0), ("b", 8), ("c", 8)]), [0, 3, 3]);
        assert_eq!(split(10, &[("a", 2), ("b", 20)]), [2, 8]);
        // More than the room of all: everyone full.
        assert_eq!(split(50, &[("a", 2), ("b", 3)]), [2, 3]);
        assert_eq!(split(0, &[("a", 2)]), [0]);
        assert!(shares(3, &[]).is_empty());
        // Deterministic whatever the input order, and sums to desired.
        let s = split(7, &[("c", 4), ("a", 4), ("b", 4)]);
        assert_eq!(s.iter().sum::<u32>(), 7);
        assert_eq!(s, [2, 3, 2]);
    }
}
