//! Where every named volume is: name → the agent that holds it, with what
//! that agent last said about it.
//!
//! The agent is the record of its volumes (metadata on disk beside the
//! data), so the controller keeps no table of its own: the index is rebuilt
//! from every heartbeat's `Inventory.volumes` and updated from every
//! volume RPC's answer. A volume can never disagree with where its data is.
//!
//! A heartbeat's inventory can be older than an RPC answer the controller
//! already applied (taken before a create, a delete, a snapshot). So an
//! entry an RPC touched within `hold` is not changed by heartbeats: not
//! removed because a stale inventory lacks it, not brought back because a
//! stale inventory still lists it after a delete (a tombstone).
//!
//! Names are unique across the cluster. Should two agents ever report the
//! same name (a volume created while its agent's node was unknown), the
//! entry that was there first keeps the name and the other is logged once.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::ids::AgentId;

/// One volume as the index knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeEntry {
    pub agent: AgentId,
    pub info: pb::VolumeInfo,
}

#[derive(Debug)]
struct Slot {
    agent: AgentId,
    /// `None`: deleted by an RPC (a tombstone until `touched` is older than
    /// the hold).
    info: Option<pb::VolumeInfo>,
    /// When an RPC answer last set this entry.
    touched: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<String, Slot>,
    /// (name, agent) pairs already logged as duplicates.
    duplicates: HashSet<(String, AgentId)>,
}

#[derive(Debug)]
pub struct VolumeIndex {
    inner: Mutex<Inner>,
    hold: Duration,
}

impl Default for VolumeIndex {
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

impl VolumeIndex {
    /// `hold`: how long an RPC answer outranks heartbeats (a few heartbeat
    /// periods: a heartbeat taken before the answer arrives within that).
    pub fn new(hold: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            hold,
        }
    }

    fn recent(&self, touched: Option<Instant>, now: Instant) -> bool {
        touched.is_some_and(|t| now.duration_since(t) < self.hold)
    }

    /// Applies one heartbeat of `agent`: its volumes, all of them.
    pub fn apply_inventory(&self, agent: &AgentId, volumes: &[pb::VolumeInfo]) {
        let now = Instant::now();
        let mut g = self.inner.lock();
        let Inner { slots, duplicates } = &mut *g;
        let reported: HashSet<&str> = volumes.iter().map(volume_name).collect();
        slots.retain(|name, s| {
            let recent = self.recent(s.touched, now);
            if s.info.is_none() {
                // Tombstones outlive the heartbeats that could still be stale.
                return recent;
            }
            s.agent != *agent || recent || reported.contains(name.as_str())
        });
        for v in volumes {
            let name = volume_name(v);
            if name.is_empty() {
                continue;
            }
            match slots.get_mut(name) {
                None => {
                    slots.insert(
                        name.to_string(),
                        Slot {
                            agent: agent.clone(),
                            info: Some(v.clone()),
                            touched: None,
                        },
                    );
                }
                Some(s) if self.recent(s.touched, now) => {}
                Some(s) if s.agent == *agent || s.info.is_none() => {
                    s.agent = agent.clone();
                    s.info = Some(v.clone());
                }
                Some(s) => {
                    if duplicates.insert((name.to_string(), agent.clone())) {
                        tracing::warn!(volume = %name, holder = %s.agent, duplicate_on = %agent, "two agents report a volume of the same name; the first one keeps the name");
                    }
                }
            }
        }
    }

    /// An RPC answer from `agent` about one of its volumes.
    pub fn answered(&self, agent: &AgentId, info: &pb::VolumeInfo) {
        let name = volume_name(info);
        if name.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        g.duplicates.retain(|(n, _)| n != name);
        g.slots.insert(
            name.to_string(),
            Slot {
                agent: agent.clone(),
                info: Some(info.clone()),
                touched: Some(Instant::now()),
            },
        );
    }

    /// `agent` deleted (or does not have) `name`.
    pub fn removed(&self, agent: &AgentId, name: &str) {
        let mut g = self.inner.lock();
        if g.slots.get(name).is_some_and(|s| s.agent != *agent) {
            return;
        }
        g.slots.insert(
            name.to_string(),
            Slot {
                agent: agent.clone(),
                info: None,
                touched: Some(Instant::now()),
            },
        );
    }

    /// Changes the cached info of `name` on `agent` (a snapshot added or
    /// removed), as an RPC answer.
    pub fn update(&self, agent: &AgentId, name: &str, f: impl FnOnce(&mut pb::VolumeInfo)) {
        let mut g = self.inner.lock();
        if let Some(s) = g.slots.get_mut(name)
            && s.agent == *agent
            && let Some(info) = s.info.as_mut()
        {
            f(info);
            s.touched = Some(Instant::now());
        }
    }

    pub fn get(&self, name: &str) -> Option<VolumeEntry> {
        let g = self.inner.lock();
        let s = g.slots.get(name)?;
        Some(VolumeEntry {
            agent: s.agent.clone(),
            info: s.info.clone()?,
        })
    }

    /// Every volume, by name.
    pub fn list(&self) -> Vec<VolumeEntry> {
        let g = self.inner.lock();
        let mut out: Vec<VolumeEntry> = g
            .slots
            .values()
            .filter_map(|s| {
                Some(VolumeEntry {
                    agent: s.agent.clone(),
                    info: s.info.clone()?,
                })
            })
            .collect();
        out.sort_by(|a, b| volume_name(&a.info).cmp(volume_name(&b.info)));
        out
    }

    /// How many volumes each agent holds.
    pub fn count_by_agent(&self) -> HashMap<AgentId, usize> {
        let g = self.inner.lock();
        let mut out = HashMap::new();
        for s in g.slots.values().filter(|s| s.info.is_some()) {
            *out.entry(s.agent.clone()).or_default() += 1;
        }
        out
    }
}

/// The name a volume info carries.
pub fn volume_name(v: &pb::VolumeInfo) -> &str {
    v.spec.as_ref().map(|s| s.name.as_str()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(name: &str) -> pb::VolumeInfo {
        pb::VolumeInfo {
            spec: Some(pb::VolumeSpec {
                name: name.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn names(ix: &VolumeIndex) -> Vec<(String, String)> {
        ix.list()
            .iter()
            .map(|e| (volume_name(&e.info).to_string(), e.agent.to_string()))
            .collect()
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn heartbeats_rebuild_the_index_per_agent() {
        let ix = VolumeIndex::new(Duration::from_secs(3600));
        ix.apply_inventory(&"a".into(), &[vol("x"), vol("y")]);
        ix.apply_inventory(&"b".into(), &[vol("z")]);
        assert_eq!(names(&ix), pairs(&[("x", "a"), ("y", "a"), ("z", "b")]));
        // a no longer has y; b's volumes are not a's to drop.
        ix.apply_inventory(&"a".into(), &[vol("x")]);
        assert_eq!(names(&ix), pairs(&[("x", "a"), ("z", "b")]));
        assert_eq!(ix.count_by_agent()[&AgentId::from("a")], 1);
    }

    #[test]
    fn a_stale_heartbeat_neither_drops_a_new_volume_nor_revives_a_deleted_one() {
        let ix = VolumeIndex::new(Duration::from_secs(3600));
        ix.apply_inventory(&"a".into(), &[vol("old")]);
        ix.answered(&"a".into(), &vol("new"));
        ix.removed(&"a".into(), "old");
        // Taken before both answers.
        ix.apply_inventory(&"a".into(), &[vol("old")]);
        assert_eq!(names(&ix), pairs(&[("new", "a")]));
        assert!(ix.get("old").is_none());
        // Once the hold is over, heartbeats rule again.
        let ix2 = VolumeIndex::new(Duration::ZERO);
        ix2.answered(&"a".into(), &vol("new"));
        ix2.apply_inventory(&"a".into(), &[]);
        assert!(ix2.get("new").is_none());
        ix2.removed(&"a".into(), "gone");
        ix2.apply_inventory(&"a".into(), &[vol("gone")]);
        assert!(ix2.get("gone").is_some());
    }

    #[test]
    fn the_first_holder_keeps_a_duplicated_name() {
        let ix = VolumeIndex::new(Duration::ZERO);
        ix.apply_inventory(&"a".into(), &[vol("x")]);
        ix.apply_inventory(&"b".into(), &[vol("x")]);
        assert_eq!(names(&ix), pairs(&[("x", "a")]));
        // a deleted it: b's is the one now.
        ix.apply_inventory(&"a".into(), &[]);
        ix.apply_inventory(&"b".into(), &[vol("x")]);
        assert_eq!(names(&ix), pairs(&[("x", "b")]));
    }

    #[test]
    fn updates_apply_to_the_holder_only() {
        let ix = VolumeIndex::new(Duration::from_secs(3600));
        ix.answered(&"a".into(), &vol("x"));
        ix.update(&"b".into(), "x", |v| v.used_bytes = 7);
        ix.update(&"a".into(), "x", |v| v.used_bytes = 9);
        assert_eq!(ix.get("x").unwrap().info.used_bytes, 9);
        // A removal reported by another agent does not drop a's volume.
        ix.removed(&"b".into(), "x");
        assert!(ix.get("x").is_some());
    }
}
