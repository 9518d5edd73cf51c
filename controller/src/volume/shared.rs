//! Shared volumes (backend `juicefs`): the cluster's JuiceFS filesystem,
//! mounted by every agent configured with it.
//!
//! Such a volume lives on no node: any heartbeating agent whose mount is up
//! creates, snapshots, forks and deletes it, and sandboxes that mount it go
//! to any such agent (never one whose mount died: placement filters on
//! `Inventory.juicefs.mounted`). Each agent enforces access modes only among
//! its own sandboxes, so the controller enforces ReadWriteOnce for the
//! whole cluster: one read-write mount at a time, wherever it is
//! ([`Core::claim_shared_writers`]). ReadOnlyMany refuses read-write
//! mounts like a local volume (`check_mode`, before placement).

use sandbolt_proto::agent::v1 as pb;

use crate::error::{Error, Result};
use crate::ids::AgentId;
use crate::placement::or_default;
use crate::registry::{AgentInfo, VolumeNode};
use crate::sandbox::Core;
use crate::store::{PvcVolume, SandboxRecord};
use crate::volume::{BACKEND_JUICEFS, info_access_mode};
use crate::volume_index::{VolumeEntry, Writer};

/// Where a shared volume operation may go.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SharedTarget<'a> {
    /// Prefer this agent when it qualifies (the one that reported it).
    pub prefer: Option<&'a AgentId>,
    /// Only this node's agent ("" = any).
    pub node_name: &'a str,
    /// Only agents of this pool ("" = any).
    pub pool: &'a str,
}

/// The backend a request names means the shared filesystem.
pub fn is_juicefs(backend: &str) -> bool {
    backend == BACKEND_JUICEFS
}

fn mode_is_rwo(m: pb::AccessMode) -> bool {
    matches!(
        m,
        pb::AccessMode::ReadWriteOnce | pb::AccessMode::Unspecified
    )
}

impl Core {
    /// A heartbeating agent whose JuiceFS mount is up, per `to`.
    pub(crate) fn shared_agent(&self, to: SharedTarget<'_>) -> Result<AgentInfo> {
        let nodes = self.registry.volume_nodes();
        let fits = |n: &VolumeNode| {
            (to.node_name.is_empty() || n.node_name == to.node_name)
                && (to.pool.is_empty() || n.pool.pool == or_default(to.pool))
        };
        let ok: Vec<&VolumeNode> = nodes
            .iter()
            .filter(|n| n.live && n.heartbeated && n.shared_volumes && fits(n))
            .collect();
        let chosen = ok
            .iter()
            .find(|n| Some(&n.agent_id) == to.prefer)
            .or_else(|| {
                ok.iter()
                    .max_by_key(|n| (n.free_slots, std::cmp::Reverse(n.agent_id.clone())))
            });
        if let Some(n) = chosen
            && let Some(a) = self.registry.agent(&n.agent_id)
        {
            return Ok(a);
        }
        Err(self.no_shared_agent(to, &nodes))
    }

    /// Why no agent can serve a shared volume: none configured with
    /// JuiceFS (a setup to change) or every mount down (retry).
    fn no_shared_agent(&self, to: SharedTarget<'_>, nodes: &[VolumeNode]) -> Error {
        let scope = match (to.node_name, to.pool) {
            ("", "") => String::new(),
            (n, "") => format!(" on node {n}"),
            ("", p) => format!(" in pool {}", or_default(p)),
            (n, p) => format!(" on node {n} in pool {}", or_default(p)),
        };
        if !to.node_name.is_empty() && !nodes.iter().any(|n| n.node_name == to.node_name) {
            return Error::InvalidArgument(format!(
                "node_name {:?}: no agent runs on that node",
                to.node_name
            ));
        }
        let configured: Vec<AgentInfo> = self
            .registry
            .agents()
            .into_iter()
            .filter(|a| a.juicefs.is_some())
            .collect();
        if configured.is_empty() {
            return Error::FailedPrecondition(format!(
                "no agent{scope} has JuiceFS configured for backend \"juicefs\" volumes; start agents with --juicefs-meta-url (chart: juicefs.enabled)"
            ));
        }
        let why: Vec<String> = configured
            .iter()
            .filter_map(|a| {
                let j = a.juicefs.as_ref()?;
                (!j.error.is_empty()).then(|| format!("{}: {}", a.node_name, j.error))
            })
            .collect();
        Error::Unavailable(format!(
            "no heartbeating agent{scope} has the JuiceFS filesystem mounted now{}; retry when a mount is back",
            if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            }
        ))
    }

    /// Takes the cluster-wide write claim of every ReadWriteOnce shared
    /// volume `r` mounts read-write, for `r`'s sandbox on its (already
    /// chosen) agent. Refused when another live sandbox writes to one of
    /// them, on any node; the claims taken so far stay until `r`'s slot is
    /// released (a failed create releases it).
    pub(crate) fn claim_shared_writers(&self, r: &SandboxRecord) -> Result<()> {
        for v in r.spec.pvc_volumes.iter().filter(|v| !v.read_only) {
            let Some(mode) = self.shared_mode(v) else {
                continue;
            };
            if !mode_is_rwo(mode) {
                continue;
            }
            let live = |a: &AgentId, sid: &str| self.registry.is_reserved(a, sid);
            if let Err(w) =
                self.volumes
                    .claim_writer(&v.claim_name, &r.agent_id, r.sandbox_id.as_str(), live)
            {
                return Err(self.second_writer(&v.claim_name, &w));
            }
        }
        Ok(())
    }

    /// A volume `v` asks to create is a shared one: backend "juicefs", or
    /// a fork (restore) of a shared volume.
    pub(crate) fn missing_is_shared(&self, v: &PvcVolume) -> bool {
        if is_juicefs(&v.backend) {
            return true;
        }
        let source = v
            .fork_from
            .split_once('@')
            .map_or(v.fork_from.as_str(), |s| s.0);
        !source.is_empty() && self.volumes.get(source).is_some_and(|e| e.shared())
    }

    /// Checks a live attach of the shared volume `e` into `r` (running on
    /// `agent`): a JuiceFS mount on that agent, and the
    /// cluster-wide writer of a ReadWriteOnce volume.
    pub(crate) fn attach_shared(
        &self,
        r: &SandboxRecord,
        agent: &AgentInfo,
        v: &PvcVolume,
        e: &VolumeEntry,
    ) -> Result<()> {
        // The caller checked the mode against `v` (read-only of ROX).
        let mode = info_access_mode(&e.info);
        if !crate::registry::juicefs_mounted(agent.juicefs.as_ref()) {
            return Err(Error::FailedPrecondition(format!(
                "volume {} is shared (juicefs), but sandbox {}/{} runs on node {}, whose agent has no JuiceFS mount up{}",
                v.claim_name,
                r.namespace,
                r.name,
                agent.node_name,
                agent
                    .juicefs
                    .as_ref()
                    .filter(|j| !j.error.is_empty())
                    .map(|j| format!(" ({})", j.error))
                    .unwrap_or_default()
            )));
        }
        if v.read_only || !mode_is_rwo(mode) {
            return Ok(());
        }
        let live = |a: &AgentId, sid: &str| self.registry.is_reserved(a, sid);
        self.volumes
            .claim_writer(&v.claim_name, &r.agent_id, r.sandbox_id.as_str(), live)
            .map_err(|w| self.second_writer(&v.claim_name, &w))
    }

    /// Refuses `action` (delete, restore) of a shared volume that a live
    /// sandbox on any node mounts: the agent that does it only knows its
    /// own holders.
    pub(crate) fn refuse_shared_mounted(&self, e: &VolumeEntry, action: &str) -> Result<()> {
        if !e.shared() {
            return Ok(());
        }
        let live: Vec<String> = e
            .holders
            .iter()
            .filter(|(a, h)| self.registry.is_reserved(a, &h.sandbox_id))
            .map(|(a, h)| {
                let who = self
                    .mount_holder(a, &h.sandbox_id, &mut None)
                    .map_or_else(|| h.sandbox_id.clone(), |k| k.to_string());
                format!("{who} on node {} at {}", self.node_name_of(a), h.mount_path)
            })
            .collect();
        if live.is_empty() {
            return Ok(());
        }
        Err(Error::FailedPrecondition(format!(
            "volume {} is mounted by {}; unmount it (or delete those sandboxes) before {action}",
            crate::volume_index::volume_name(&e.info),
            live.join(", ")
        )))
    }

    /// The access mode of `v`'s volume when it is (or will be made) a
    /// shared one; `None` for a local volume.
    fn shared_mode(&self, v: &PvcVolume) -> Option<pb::AccessMode> {
        match self.volumes.get(&v.claim_name) {
            Some(e) if e.shared() => Some(info_access_mode(&e.info)),
            Some(_) => None,
            None if is_juicefs(&v.backend) => Some(crate::volume::access_mode_out(v.access_mode)),
            None => None,
        }
    }

    /// The refusal of a second writer, naming the one there is.
    fn second_writer(&self, volume: &str, w: &Writer) -> Error {
        let holder = self
            .mount_holder(&w.agent, &w.sandbox_id, &mut None)
            .map(|k| format!("sandbox {k}"))
            .unwrap_or_else(|| format!("sandbox {}", w.sandbox_id));
        let node = self
            .registry
            .agent(&w.agent)
            .map(|a| a.node_name)
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| w.agent.to_string());
        Error::FailedPrecondition(format!(
            "volume {volume} is ReadWriteOnce and {holder} on node {node} mounts it read-write; a second read-write mount is refused on every node (mount it readOnly, or use a ReadWriteMany volume)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_juicefs_is_shared_and_unspecified_means_read_write_once() {
        assert!(is_juicefs("juicefs"));
        assert!(!is_juicefs("") && !is_juicefs("local"));
        assert!(mode_is_rwo(pb::AccessMode::Unspecified));
        assert!(mode_is_rwo(pb::AccessMode::ReadWriteOnce));
        assert!(!mode_is_rwo(pb::AccessMode::ReadWriteMany));
        assert!(!mode_is_rwo(pb::AccessMode::ReadOnlyMany));
    }
}
