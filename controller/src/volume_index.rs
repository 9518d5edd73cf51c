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
//!
//! A shared volume (`capabilities.shared`: the cluster's JuiceFS) is
//! reported by every agent that mounts the filesystem, each with its own
//! mount holders: it is one entry whose holders are merged per agent, and
//! it is gone only when no agent reports it any more. Its `agent` is one of
//! the agents that reported it (any of them can serve it).
//!
//! The index also keeps the writers the controller has placed but no
//! heartbeat lists yet ([`VolumeIndex::claim_writer`]): a ReadWriteOnce
//! shared volume has one writer in the whole cluster, and two creates on
//! two nodes must not both pass the check before either is reported.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::ids::AgentId;

/// One volume as the index knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeEntry {
    pub agent: AgentId,
    /// `mounts`: every agent's holders (a local volume has one agent).
    pub info: pb::VolumeInfo,
    /// The holders in `info.mounts`, each with the agent that reported it.
    pub holders: Vec<(AgentId, pb::VolumeMountHolder)>,
}

impl VolumeEntry {
    /// Reachable from every agent that mounts the shared filesystem.
    pub fn shared(&self) -> bool {
        is_shared(&self.info)
    }
}

/// A volume info of a shared (cluster filesystem) volume.
pub fn is_shared(info: &pb::VolumeInfo) -> bool {
    info.capabilities.as_ref().is_some_and(|c| c.shared)
}

#[derive(Debug)]
struct Slot {
    agent: AgentId,
    /// `None`: deleted by an RPC (a tombstone until `touched` is older than
    /// the hold). Its `mounts` are not used: see `holders`.
    info: Option<pb::VolumeInfo>,
    /// When an RPC answer last set this entry.
    touched: Option<Instant>,
    /// Mount holders by the agent that reported them; for a shared volume,
    /// also the set of agents that report it.
    holders: BTreeMap<AgentId, Vec<pb::VolumeMountHolder>>,
}

impl Slot {
    fn new(agent: &AgentId, info: &pb::VolumeInfo, touched: Option<Instant>) -> Self {
        Self {
            agent: agent.clone(),
            info: Some(info.clone()),
            touched,
            holders: BTreeMap::from([(agent.clone(), info.mounts.clone())]),
        }
    }

    fn shared(&self) -> bool {
        self.info.as_ref().is_some_and(is_shared)
    }

    /// `agent` reports the shared volume with its own holders.
    fn merge(&mut self, agent: &AgentId, info: &pb::VolumeInfo) {
        self.holders.insert(agent.clone(), info.mounts.clone());
        self.info = Some(info.clone());
    }

    fn entry(&self) -> Option<VolumeEntry> {
        let mut info = self.info.clone()?;
        let holders: Vec<(AgentId, pb::VolumeMountHolder)> = self
            .holders
            .iter()
            .flat_map(|(a, hs)| hs.iter().map(move |h| (a.clone(), h.clone())))
            .collect();
        info.mounts = holders.iter().map(|(_, h)| h.clone()).collect();
        Some(VolumeEntry {
            agent: self.agent.clone(),
            info,
            holders,
        })
    }
}

/// A read-write mount the controller placed (see
/// [`VolumeIndex::claim_writer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Claim {
    agent: AgentId,
    sandbox_id: String,
}

/// Another sandbox that writes to a ReadWriteOnce volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Writer {
    pub agent: AgentId,
    pub sandbox_id: String,
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<String, Slot>,
    /// (name, agent) pairs already logged as duplicates.
    duplicates: HashSet<(String, AgentId)>,
    /// Volume name → writers placed and not yet seen as holders.
    claims: HashMap<String, Vec<Claim>>,
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
        let reported: HashSet<&str> = volumes.iter().map(volume_name).collect();
        g.slots.retain(|name, s| {
            let recent = self.recent(s.touched, now);
            if s.info.is_none() {
                // Tombstones outlive the heartbeats that could still be stale.
                return recent;
            }
            if s.shared() {
                // Gone from this agent's view only; gone when nobody has it.
                if !reported.contains(name.as_str()) {
                    forget_reporter(s, agent);
                }
                return recent || !s.holders.is_empty();
            }
            s.agent != *agent || recent || reported.contains(name.as_str())
        });
        for v in volumes {
            self.apply_one(&mut g, agent, v, now);
        }
        // A claim its agent now reports as a holder is covered by it.
        let Inner { slots, claims, .. } = &mut *g;
        claims.retain(|name, cs| {
            let held: HashSet<&str> = slots
                .get(name)
                .map(|s| {
                    s.holders
                        .values()
                        .flatten()
                        .map(|h| h.sandbox_id.as_str())
                        .collect()
                })
                .unwrap_or_default();
            cs.retain(|c| !held.contains(c.sandbox_id.as_str()));
            !cs.is_empty()
        });
    }

    fn apply_one(&self, g: &mut Inner, agent: &AgentId, v: &pb::VolumeInfo, now: Instant) {
        let name = volume_name(v);
        if name.is_empty() {
            return;
        }
        let Inner {
            slots, duplicates, ..
        } = g;
        match slots.get_mut(name) {
            None => {
                slots.insert(name.to_string(), Slot::new(agent, v, None));
            }
            // A recent answer outranks the info; another agent's holders of
            // a shared volume are still news.
            Some(s) if self.recent(s.touched, now) => {
                if s.shared() && is_shared(v) {
                    s.holders.insert(agent.clone(), v.mounts.clone());
                }
            }
            Some(s) if s.info.is_none() => *s = Slot::new(agent, v, None),
            Some(s) if s.shared() && is_shared(v) => s.merge(agent, v),
            Some(s) if s.agent == *agent => *s = Slot::new(agent, v, None),
            Some(s) => {
                if duplicates.insert((name.to_string(), agent.clone())) {
                    tracing::warn!(volume = %name, holder = %s.agent, duplicate_on = %agent, "two agents report a volume of the same name; the first one keeps the name");
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
        let now = Some(Instant::now());
        match g.slots.get_mut(name) {
            Some(s) if s.shared() && is_shared(info) => {
                s.merge(agent, info);
                s.agent = agent.clone();
                s.touched = now;
            }
            _ => {
                g.slots
                    .insert(name.to_string(), Slot::new(agent, info, now));
            }
        }
    }

    /// `agent` deleted (or does not have) `name`. A shared volume is gone
    /// for every agent.
    pub fn removed(&self, agent: &AgentId, name: &str) {
        let mut g = self.inner.lock();
        if g.slots
            .get(name)
            .is_some_and(|s| s.agent != *agent && !s.shared())
        {
            return;
        }
        g.claims.remove(name);
        g.slots.insert(
            name.to_string(),
            Slot {
                agent: agent.clone(),
                info: None,
                touched: Some(Instant::now()),
                holders: BTreeMap::new(),
            },
        );
    }

    /// Changes the cached info of `name` on `agent` (a snapshot added or
    /// removed), as an RPC answer. Any agent may change a shared volume.
    pub fn update(&self, agent: &AgentId, name: &str, f: impl FnOnce(&mut pb::VolumeInfo)) {
        let mut g = self.inner.lock();
        if let Some(s) = g.slots.get_mut(name)
            && (s.agent == *agent || s.shared())
            && let Some(info) = s.info.as_mut()
        {
            f(info);
            s.touched = Some(Instant::now());
        }
    }

    pub fn get(&self, name: &str) -> Option<VolumeEntry> {
        self.inner.lock().slots.get(name)?.entry()
    }

    /// Every volume, by name.
    pub fn list(&self) -> Vec<VolumeEntry> {
        let g = self.inner.lock();
        let mut out: Vec<VolumeEntry> = g.slots.values().filter_map(Slot::entry).collect();
        out.sort_by(|a, b| volume_name(&a.info).cmp(volume_name(&b.info)));
        out
    }

    /// How many volumes each agent holds on its own node (shared volumes
    /// take no node's room and are not counted).
    pub fn count_by_agent(&self) -> HashMap<AgentId, usize> {
        let g = self.inner.lock();
        let mut out = HashMap::new();
        for s in g.slots.values().filter(|s| s.info.is_some() && !s.shared()) {
            *out.entry(s.agent.clone()).or_default() += 1;
        }
        out
    }

    /// Registers `sandbox_id` on `agent` as the writer of `name` unless
    /// another sandbox writes to it: a read-write holder any agent
    /// reported, or a writer claimed earlier and not yet reported.
    /// `live(agent, sandbox_id)`: that sandbox still holds its slot (the
    /// controller has not deleted it); other writers are stale and
    /// dropped. Check and claim are one step under the index's lock.
    pub fn claim_writer(
        &self,
        name: &str,
        agent: &AgentId,
        sandbox_id: &str,
        live: impl Fn(&AgentId, &str) -> bool,
    ) -> Result<(), Writer> {
        let mut g = self.inner.lock();
        let Inner { slots, claims, .. } = &mut *g;
        let claimed = claims.entry(name.to_string()).or_default();
        claimed.retain(|c| live(&c.agent, &c.sandbox_id));
        let reported = slots.get(name).into_iter().flat_map(|s| {
            s.holders.iter().flat_map(|(a, hs)| {
                hs.iter()
                    .filter(|h| !h.read_only)
                    .map(move |h| (a, h.sandbox_id.as_str()))
            })
        });
        let other = reported
            .chain(claimed.iter().map(|c| (&c.agent, c.sandbox_id.as_str())))
            .find(|(a, sid)| *sid != sandbox_id && live(a, sid));
        if let Some((a, sid)) = other {
            return Err(Writer {
                agent: a.clone(),
                sandbox_id: sid.to_string(),
            });
        }
        if !claimed.iter().any(|c| c.sandbox_id == sandbox_id) {
            claimed.push(Claim {
                agent: agent.clone(),
                sandbox_id: sandbox_id.to_string(),
            });
        }
        Ok(())
    }
}

/// `agent` no longer reports the shared volume of `s`.
fn forget_reporter(s: &mut Slot, agent: &AgentId) {
    s.holders.remove(agent);
    if s.agent == *agent
        && let Some(other) = s.holders.keys().next()
    {
        s.agent = other.clone();
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

    fn shared(name: &str, holders: &[(&str, bool)]) -> pb::VolumeInfo {
        let mut v = vol(name);
        v.capabilities = Some(pb::VolumeCapabilities {
            backend: "juicefs".into(),
            shared: true,
            ..Default::default()
        });
        v.mounts = holders
            .iter()
            .map(|(sid, ro)| pb::VolumeMountHolder {
                sandbox_id: sid.to_string(),
                mount_path: "/data".into(),
                read_only: *ro,
            })
            .collect();
        v
    }

    fn holders(ix: &VolumeIndex, name: &str) -> Vec<(String, String)> {
        ix.get(name)
            .unwrap()
            .holders
            .iter()
            .map(|(a, h)| (a.to_string(), h.sandbox_id.clone()))
            .collect()
    }

    #[test]
    fn a_shared_volume_is_one_entry_with_every_agents_holders() {
        let ix = VolumeIndex::new(Duration::ZERO);
        ix.apply_inventory(&"a".into(), &[shared("s", &[("sa", false)]), vol("x")]);
        ix.apply_inventory(&"b".into(), &[shared("s", &[("sb", true)])]);
        // One entry, no duplicate: b's report merged into it.
        assert_eq!(names(&ix), pairs(&[("s", "a"), ("x", "a")]));
        assert!(ix.inner.lock().duplicates.is_empty());
        assert_eq!(holders(&ix, "s"), pairs(&[("a", "sa"), ("b", "sb")]));
        assert_eq!(ix.get("s").unwrap().info.mounts.len(), 2);
        assert!(ix.get("s").unwrap().shared());
        // Shared volumes take no node's room.
        assert_eq!(ix.count_by_agent()[&AgentId::from("a")], 1);
        assert!(!ix.count_by_agent().contains_key(&AgentId::from("b")));
        // a's mount died (it reports none): b still has it, a's holders go.
        ix.apply_inventory(&"a".into(), &[vol("x")]);
        assert_eq!(names(&ix), pairs(&[("s", "b"), ("x", "a")]));
        assert_eq!(holders(&ix, "s"), pairs(&[("b", "sb")]));
        // Nobody reports it: gone.
        ix.apply_inventory(&"b".into(), &[]);
        assert!(ix.get("s").is_none());
    }

    #[test]
    fn any_agent_answers_for_a_shared_volume_and_a_delete_is_for_all() {
        let ix = VolumeIndex::new(Duration::from_secs(3600));
        ix.apply_inventory(&"a".into(), &[shared("s", &[("sa", false)])]);
        // b answers (a snapshot, say): a's holders stay.
        ix.answered(&"b".into(), &shared("s", &[]));
        ix.update(&"b".into(), "s", |v| v.used_bytes = 5);
        assert_eq!(ix.get("s").unwrap().info.used_bytes, 5);
        assert_eq!(holders(&ix, "s"), pairs(&[("a", "sa")]));
        // b deletes it: gone everywhere, and a's stale heartbeat does not
        // bring it back.
        ix.removed(&"b".into(), "s");
        ix.apply_inventory(&"a".into(), &[shared("s", &[("sa", false)])]);
        assert!(ix.get("s").is_none());
    }

    #[test]
    fn one_writer_of_a_shared_volume_in_the_whole_cluster() {
        let ix = VolumeIndex::new(Duration::ZERO);
        let all = |_: &AgentId, _: &str| true;
        ix.apply_inventory(&"a".into(), &[shared("s", &[("r1", true)])]);
        // Readers do not count; the first writer claims it before any
        // heartbeat lists it, the second (another node) is refused.
        assert!(ix.claim_writer("s", &"a".into(), "w1", all).is_ok());
        let e = ix.claim_writer("s", &"b".into(), "w2", all).unwrap_err();
        assert_eq!(
            e,
            Writer {
                agent: "a".into(),
                sandbox_id: "w1".into()
            }
        );
        // The same sandbox may claim again (a retry).
        assert!(ix.claim_writer("s", &"a".into(), "w1", all).is_ok());
        // Its agent reports it: the holder takes over from the claim.
        ix.apply_inventory(&"a".into(), &[shared("s", &[("w1", false)])]);
        assert!(ix.inner.lock().claims.is_empty());
        assert!(ix.claim_writer("s", &"b".into(), "w2", all).is_err());
        // w1 is deleted (its slot released): a stale holder does not block.
        let gone = |_: &AgentId, sid: &str| sid != "w1";
        assert!(ix.claim_writer("s", &"b".into(), "w2", gone).is_ok());
        // A writer that never got reported (its create failed) is dropped.
        let ix = VolumeIndex::new(Duration::ZERO);
        assert!(ix.claim_writer("t", &"a".into(), "x1", all).is_ok());
        let failed = |_: &AgentId, sid: &str| sid != "x1";
        assert!(ix.claim_writer("t", &"b".into(), "x2", failed).is_ok());
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
