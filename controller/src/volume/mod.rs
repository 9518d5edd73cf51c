//! Named volumes: create, get, list, delete, snapshots, restore and fork,
//! as plain calls on the [`Core`]; `service.rs` translates
//! `sandbolt.control.v1.VolumeService` into them.
//!
//! A volume lives on one node's volume root and its agent is the record of
//! it; the controller finds it through the [`crate::volume_index`] and
//! forwards every operation to that agent. Nothing moves a volume: when its
//! agent is silent, operations answer UNAVAILABLE naming the node, and
//! reads answer the last reported state with `available = false`.
//!
//! A shared volume (backend `juicefs`, on the cluster's JuiceFS) is on no
//! one node: it is created and served through any heartbeating agent whose
//! JuiceFS mount is up, and `available` says whether one is.
//!
//! Names are unique across the cluster. The check and the agent call that
//! makes a name exist run under the name's lock (`Core::volume_names`), and
//! not before the restarted controller has heard from every agent it knows
//! from its store (`Core::is_ready`): an agent not heard from yet may hold
//! a volume of that name.

pub mod service;
pub mod shared;

use std::time::Duration;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::quantity::{self, QuantityError};

use crate::error::{Error, Result};
use crate::ids::{AgentId, SandboxKey};
use crate::placement::or_default;
use crate::registry::{AgentInfo, VolumeNode};
use crate::sandbox::Core;
use crate::store::{AccessMode, ListRange};
use crate::volume::shared::{SharedTarget, is_juicefs};
use crate::volume_index::{VolumeEntry, volume_name};

/// Deadline of a quick volume call (get, create, attach, detach).
pub const VOLUME_CALL: Duration = Duration::from_secs(30);
/// Deadline of a call that may copy data: snapshot, fork, restore and
/// delete on a `directory` volume root copy or remove every byte.
pub const VOLUME_COPY: Duration = Duration::from_secs(600);

/// One volume as the controller answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeView {
    pub agent: AgentId,
    pub node_name: String,
    pub info: pb::VolumeInfo,
    /// Its agent heartbeats and this state is its answer (or its last
    /// heartbeat's); false: the last state reported, nothing can be done.
    pub available: bool,
    /// `info.mounts`, each with the agent that reported it (a shared
    /// volume's holders are on several agents).
    pub holders: Vec<(AgentId, pb::VolumeMountHolder)>,
}

impl VolumeView {
    /// On the cluster's shared filesystem (juicefs), not one node's.
    pub fn shared(&self) -> bool {
        crate::volume_index::is_shared(&self.info)
    }
}

impl VolumeView {
    pub fn name(&self) -> &str {
        volume_name(&self.info)
    }
}

/// A volume to create (VolumeService.CreateVolume).
#[derive(Debug, Clone, Default)]
pub struct NewVolume {
    pub name: String,
    pub access_mode: AccessMode,
    /// 0 = no quota.
    pub size_bytes: i64,
    /// Empty: the controller picks.
    pub node_name: String,
    /// Empty: any pool.
    pub pool: String,
    /// "" / "local" (a node's volume root) or "juicefs" (shared).
    pub backend: String,
}

/// A fork (VolumeService.ForkVolume).
#[derive(Debug, Clone, Default)]
pub struct ForkVolume {
    pub source: String,
    /// Empty: the source's current data.
    pub snapshot: String,
    pub name: String,
    /// Unspecified: the source's.
    pub access_mode: AccessMode,
    /// 0: the source's.
    pub size_bytes: i64,
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// DNS-1123 label: lowercase alphanumerics and '-', alphanumeric at both
/// ends, at most 63 characters.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A volume or snapshot name, checked; errors name `field`.
pub fn check_name(field: &str, s: &str) -> Result<()> {
    if s.is_empty() {
        return Err(invalid(format!("{field} is required")));
    }
    if !is_dns_label(s) {
        return Err(invalid(format!(
            "{field} {s:?} must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters"
        )));
    }
    Ok(())
}

/// A quota quantity ("1Gi") in bytes; empty = 0 (no quota). Errors name
/// `field`.
pub fn parse_size(field: &str, s: &str) -> Result<i64> {
    if s.trim().is_empty() {
        return Ok(0);
    }
    let b = quantity::bytes(s).map_err(|e| {
        invalid(match e {
            QuantityError::Invalid { input, reason, .. } => {
                format!("{field} {input:?} is not a Kubernetes quantity: {reason}")
            }
            QuantityError::Negative { input, .. } => format!("{field} {input:?} is negative"),
            QuantityError::Zero { input, .. } => {
                format!("{field} {input:?} is zero; leave it empty for no quota")
            }
            QuantityError::Overflow { input, .. } => format!("{field} {input:?} is too large"),
            QuantityError::Empty { .. } => format!("{field} is empty"),
        })
    })?;
    i64::try_from(b).map_err(|_| invalid(format!("{field} {s:?} is too large")))
}

/// The shared volume backend: the cluster's JuiceFS filesystem.
pub const BACKEND_JUICEFS: &str = "juicefs";

/// The backend a request names: `local` (or empty) or `juicefs`.
pub fn check_backend(field: &str, s: &str) -> Result<()> {
    match s {
        "" | "local" | BACKEND_JUICEFS => Ok(()),
        other => Err(invalid(format!(
            "{field} {other:?} is not a volume backend sandbolt has; use \"local\" (or leave it empty) or \"juicefs\""
        ))),
    }
}

/// The agent's access mode for a stored one (same numbering as the
/// control API's).
pub fn access_mode_out(m: AccessMode) -> pb::AccessMode {
    match m {
        AccessMode::Unspecified => pb::AccessMode::Unspecified,
        AccessMode::ReadWriteOnce => pb::AccessMode::ReadWriteOnce,
        AccessMode::ReadOnlyMany => pb::AccessMode::ReadOnlyMany,
        AccessMode::ReadWriteMany => pb::AccessMode::ReadWriteMany,
    }
}

/// An access mode from the wire (control or agent API: one numbering).
pub fn access_mode_in(field: &str, v: i32) -> Result<AccessMode> {
    match pb::AccessMode::try_from(v) {
        Ok(pb::AccessMode::Unspecified) => Ok(AccessMode::Unspecified),
        Ok(pb::AccessMode::ReadWriteOnce) => Ok(AccessMode::ReadWriteOnce),
        Ok(pb::AccessMode::ReadOnlyMany) => Ok(AccessMode::ReadOnlyMany),
        Ok(pb::AccessMode::ReadWriteMany) => Ok(AccessMode::ReadWriteMany),
        Err(_) => Err(invalid(format!("{field} {v} is not an access mode"))),
    }
}

/// The access mode a volume info carries.
pub fn info_access_mode(info: &pb::VolumeInfo) -> pb::AccessMode {
    info.spec
        .as_ref()
        .map(|s| s.access_mode())
        .unwrap_or(pb::AccessMode::Unspecified)
}

fn not_found(name: &str) -> Error {
    Error::NotFoundOther(format!("volume {name} not found"))
}

/// The spec backend of an indexed volume: "juicefs" for a shared one.
pub fn backend_of(entry: &VolumeEntry) -> &'static str {
    if entry.shared() { BACKEND_JUICEFS } else { "" }
}

/// The node a volume lives on, for messages.
fn node_of(entry: &VolumeEntry, agent: Option<&AgentInfo>) -> String {
    match agent {
        Some(a) if !a.node_name.is_empty() => a.node_name.clone(),
        _ if !entry.info.node_name.is_empty() => entry.info.node_name.clone(),
        _ => entry.agent.to_string(),
    }
}

impl Core {
    /// Refuses a new volume name while a restarted controller still waits
    /// for agents it knows: one of them may hold a volume of that name.
    fn require_volume_writes(&self) -> Result<()> {
        if self.is_ready() {
            return Ok(());
        }
        Err(Error::Unavailable(
            "controller restarted and still waits for the agents it knows to report their volumes; retry shortly".into(),
        ))
    }

    /// ALREADY_EXISTS when any agent reports `name` (also a silent one).
    pub(crate) fn refuse_taken(&self, name: &str) -> Result<()> {
        match self.volumes.get(name) {
            None => Ok(()),
            Some(e) if e.shared() => Err(Error::AlreadyExistsOther(format!(
                "volume {name} already exists (shared, on JuiceFS)"
            ))),
            Some(e) => {
                let node = node_of(&e, self.registry.agent(&e.agent).as_ref());
                Err(Error::AlreadyExistsOther(format!(
                    "volume {name} already exists (on node {node})"
                )))
            }
        }
    }

    /// The index entry of `name` and its agent, which must be heartbeating.
    /// A shared volume's is any agent with its filesystem mounted.
    pub(crate) fn volume_home(&self, name: &str) -> Result<(VolumeEntry, AgentInfo)> {
        let entry = self.volumes.get(name).ok_or_else(|| not_found(name))?;
        if entry.shared() {
            let to = SharedTarget {
                prefer: Some(&entry.agent),
                ..Default::default()
            };
            return match self.shared_agent(to) {
                Ok(a) => Ok((entry, a)),
                Err(Error::Unavailable(why) | Error::FailedPrecondition(why)) => Err(
                    Error::Unavailable(format!("volume {name} is shared (juicefs): {why}")),
                ),
                Err(e) => Err(e),
            };
        }
        match self.registry.agent(&entry.agent) {
            Some(a) if !a.lost => Ok((entry, a)),
            a => Err(Error::Unavailable(format!(
                "volume {name} is on node {} (agent {}), which is not heartbeating; its data stays there: retry when the node is back",
                node_of(&entry, a.as_ref()),
                entry.agent
            ))),
        }
    }

    fn view(&self, entry: VolumeEntry, available: bool) -> VolumeView {
        if entry.shared() {
            let reachable = self.shared_agent(SharedTarget::default()).is_ok();
            return VolumeView {
                node_name: String::new(),
                available: available && reachable,
                agent: entry.agent,
                info: entry.info,
                holders: entry.holders,
            };
        }
        let agent = self.registry.agent(&entry.agent);
        VolumeView {
            node_name: node_of(&entry, agent.as_ref()),
            available: available && agent.is_some_and(|a| !a.lost),
            agent: entry.agent,
            info: entry.info,
            holders: entry.holders,
        }
    }

    /// Indexes an agent's answer and views the volume as indexed (a shared
    /// volume's holders on other agents included).
    fn answered(&self, agent: &AgentInfo, info: pb::VolumeInfo) -> VolumeView {
        self.volumes.answered(&agent.agent_id, &info);
        let entry = self
            .volumes
            .get(volume_name(&info))
            .unwrap_or_else(|| VolumeEntry {
                agent: agent.agent_id.clone(),
                holders: Vec::new(),
                info,
            });
        self.view(entry, true)
    }

    /// Creates a volume; see [`NewVolume`] for the choice of node.
    #[tracing::instrument(skip_all, fields(volume = %req.name))]
    pub async fn create_volume(&self, req: NewVolume) -> Result<VolumeView> {
        check_name("name", &req.name)?;
        self.require_volume_writes()?;
        let _name = self.volume_names.lock(req.name.clone()).await;
        self.refuse_taken(&req.name)?;
        let agent = if is_juicefs(&req.backend) {
            self.shared_agent(SharedTarget {
                prefer: None,
                node_name: &req.node_name,
                pool: &req.pool,
            })?
        } else {
            let node = self.choose_volume_node(&req.node_name, &req.pool)?;
            self.registry
                .agent(&node.agent_id)
                .ok_or_else(|| Error::Unavailable(format!("agent {} vanished", node.agent_id)))?
        };
        let spec = pb::VolumeSpec {
            name: req.name.clone(),
            access_mode: access_mode_out(match req.access_mode {
                AccessMode::Unspecified => AccessMode::ReadWriteOnce,
                m => m,
            }) as i32,
            size_bytes: req.size_bytes,
            backend: if is_juicefs(&req.backend) {
                BACKEND_JUICEFS.into()
            } else {
                String::new()
            },
        };
        let info = self.create_volume_on(&agent, spec).await?;
        tracing::info!(node = %agent.node_name, agent = %agent.agent_id, backend = %req.backend, "volume created");
        Ok(self.answered(&agent, info))
    }

    /// Asks `agent` to create a volume (the caller holds the name's lock
    /// and checked that the name is free) and indexes it.
    pub(crate) async fn create_volume_on(
        &self,
        agent: &AgentInfo,
        spec: pb::VolumeSpec,
    ) -> Result<pb::VolumeInfo> {
        let info = self
            .agents
            .create_volume(&agent.agent_id, &agent.api_endpoint, spec, VOLUME_CALL)
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))?;
        self.volumes.answered(&agent.agent_id, &info);
        Ok(info)
    }

    /// Where a new volume goes: `node_name`'s agent (which must have a
    /// volume root), else the ready agent with a volume root (of `pool`,
    /// if given) that holds the fewest volumes, then has the most free
    /// slots.
    fn choose_volume_node(&self, node_name: &str, pool: &str) -> Result<VolumeNode> {
        let nodes = self.registry.volume_nodes();
        let in_pool = |n: &VolumeNode| pool.is_empty() || n.pool.pool == or_default(pool);
        if !node_name.is_empty() {
            let on: Vec<&VolumeNode> = nodes.iter().filter(|n| n.node_name == node_name).collect();
            if on.is_empty() {
                return Err(invalid(format!(
                    "node_name {node_name:?}: no agent runs on that node"
                )));
            }
            let on: Vec<&VolumeNode> = on.into_iter().filter(|n| in_pool(n)).collect();
            if on.is_empty() {
                return Err(invalid(format!(
                    "node_name {node_name:?}: no agent of pool {pool:?} runs on that node"
                )));
            }
            if let Some(n) = on.iter().find(|n| n.live && n.volume_root) {
                return Ok((*n).clone());
            }
            if on.iter().any(|n| n.live) {
                return Err(Error::FailedPrecondition(format!(
                    "node {node_name} has no volume root (its agent runs without named volumes)"
                )));
            }
            return Err(Error::Unavailable(format!(
                "node {node_name} (agent {}) is not heartbeating; retry when it is back",
                on[0].agent_id
            )));
        }
        let counts = self.volumes.count_by_agent();
        nodes
            .into_iter()
            .filter(|n| n.live && n.heartbeated && n.volume_root && in_pool(n))
            .min_by_key(|n| {
                (
                    counts.get(&n.agent_id).copied().unwrap_or(0),
                    std::cmp::Reverse(n.free_slots),
                    n.agent_id.clone(),
                )
            })
            .ok_or_else(|| {
                Error::ResourceExhausted(if pool.is_empty() {
                    "no ready agent has a volume root for named volumes".into()
                } else {
                    format!(
                        "no ready agent of pool {} has a volume root for named volumes",
                        or_default(pool)
                    )
                })
            })
    }

    /// The volume, fresh from its agent when that agent heartbeats; else
    /// the last state reported, with `available = false`.
    pub async fn get_volume(&self, name: &str) -> Result<VolumeView> {
        check_name("name", name)?;
        let entry = self.volumes.get(name).ok_or_else(|| not_found(name))?;
        let agent = match self.registry.agent(&entry.agent) {
            _ if entry.shared() => match self.volume_home(name) {
                Ok((_, a)) => a,
                Err(_) => return Ok(self.view(entry, false)),
            },
            Some(a) if !a.lost => a,
            _ => return Ok(self.view(entry, false)),
        };
        match self
            .agents
            .get_volume(&agent.agent_id, &agent.api_endpoint, name, VOLUME_CALL)
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))
        {
            Ok(info) => Ok(self.answered(&agent, info)),
            Err(Error::VolumeAgent {
                code: tonic::Code::NotFound,
                ..
            }) => {
                self.volumes.removed(&agent.agent_id, name);
                Err(not_found(name))
            }
            Err(e) => {
                tracing::warn!(volume = %name, agent = %agent.agent_id, error = %e, "volume get: agent did not answer; showing the last reported state");
                Ok(self.view(entry, false))
            }
        }
    }

    /// Every volume the agents reported, by name (no agent is asked).
    pub fn list_volumes(&self) -> Vec<VolumeView> {
        self.volumes
            .list()
            .into_iter()
            .map(|e| self.view(e, true))
            .collect()
    }

    /// Removes the volume and its snapshots (its forks stay); refused while
    /// a sandbox mounts it. Answers the volume as it was.
    #[tracing::instrument(skip_all, fields(volume = %name))]
    pub async fn delete_volume(&self, name: &str) -> Result<VolumeView> {
        check_name("name", name)?;
        let _name = self.volume_names.lock(name.to_string()).await;
        let (entry, agent) = self.volume_home(name)?;
        self.refuse_shared_mounted(&entry, "deleting it")?;
        let existed = self
            .agents
            .delete_volume(&agent.agent_id, &agent.api_endpoint, name, VOLUME_COPY)
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))?;
        self.volumes.removed(&agent.agent_id, name);
        if !existed {
            return Err(not_found(name));
        }
        tracing::info!(node = %agent.node_name, "volume deleted");
        Ok(self.view(entry, true))
    }
}

impl Core {
    /// A read-only point-in-time copy of `volume`; allowed while mounted.
    #[tracing::instrument(skip_all, fields(volume = %volume, snapshot = %name))]
    pub async fn create_volume_snapshot(
        &self,
        volume: &str,
        name: &str,
    ) -> Result<pb::VolumeSnapshot> {
        check_name("volume", volume)?;
        check_name("name", name)?;
        let (_, agent) = self.volume_home(volume)?;
        let snap = self
            .agents
            .create_volume_snapshot(
                &agent.agent_id,
                &agent.api_endpoint,
                volume,
                name,
                VOLUME_COPY,
            )
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))?;
        self.volumes.update(&agent.agent_id, volume, |v| {
            v.snapshots.retain(|s| s.name != snap.name);
            v.snapshots.push(snap.clone());
        });
        Ok(snap)
    }

    /// The volume's snapshots, fresh from its agent (see
    /// [`Core::get_volume`]).
    pub async fn list_volume_snapshots(&self, volume: &str) -> Result<Vec<pb::VolumeSnapshot>> {
        Ok(self.get_volume(volume).await?.info.snapshots)
    }

    /// Removes one snapshot; answers it as it was.
    #[tracing::instrument(skip_all, fields(volume = %volume, snapshot = %name))]
    pub async fn delete_volume_snapshot(
        &self,
        volume: &str,
        name: &str,
    ) -> Result<pb::VolumeSnapshot> {
        check_name("volume", volume)?;
        check_name("name", name)?;
        let (entry, agent) = self.volume_home(volume)?;
        let existed = self
            .agents
            .delete_volume_snapshot(
                &agent.agent_id,
                &agent.api_endpoint,
                volume,
                name,
                VOLUME_COPY,
            )
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))?;
        self.volumes.update(&agent.agent_id, volume, |v| {
            v.snapshots.retain(|s| s.name != name);
        });
        if !existed {
            return Err(Error::NotFoundOther(format!(
                "snapshot {name} of volume {volume} not found"
            )));
        }
        Ok(entry
            .info
            .snapshots
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| pb::VolumeSnapshot {
                volume: volume.to_string(),
                name: name.to_string(),
                created_at_unix_ms: 0,
            }))
    }

    /// Replaces the volume's data with the snapshot's, atomically; refused
    /// while mounted.
    #[tracing::instrument(skip_all, fields(volume = %volume, snapshot = %snapshot))]
    pub async fn restore_volume(&self, volume: &str, snapshot: &str) -> Result<VolumeView> {
        check_name("volume", volume)?;
        check_name("snapshot", snapshot)?;
        let (entry, agent) = self.volume_home(volume)?;
        self.refuse_shared_mounted(&entry, "restoring it")?;
        let info = self
            .agents
            .restore_volume(
                &agent.agent_id,
                &agent.api_endpoint,
                volume,
                snapshot,
                VOLUME_COPY,
            )
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))?;
        Ok(self.answered(&agent, info))
    }

    /// A new, independent volume from the source's data or one of its
    /// snapshots, on the source's node.
    #[tracing::instrument(skip_all, fields(source = %req.source, volume = %req.name))]
    pub async fn fork_volume(&self, req: ForkVolume) -> Result<VolumeView> {
        check_name("source", &req.source)?;
        check_name("name", &req.name)?;
        if !req.snapshot.is_empty() {
            check_name("snapshot", &req.snapshot)?;
        }
        self.require_volume_writes()?;
        let _name = self.volume_names.lock(req.name.clone()).await;
        self.refuse_taken(&req.name)?;
        let (source, agent) = self.volume_home(&req.source)?;
        let body = pb::ForkVolumeRequest {
            source: req.source.clone(),
            snapshot: req.snapshot.clone(),
            spec: Some(pb::VolumeSpec {
                name: req.name.clone(),
                access_mode: access_mode_out(req.access_mode) as i32,
                size_bytes: req.size_bytes,
                // A fork stays on its source's filesystem.
                backend: backend_of(&source).into(),
            }),
        };
        let info = self
            .agents
            .fork_volume(&agent.agent_id, &agent.api_endpoint, body, VOLUME_COPY)
            .await
            .map_err(|e| e.volume_agent(&agent.node_name))?;
        tracing::info!(node = %agent.node_name, "volume forked");
        Ok(self.answered(&agent, info))
    }

    /// The node an agent runs on (its id when unknown), for answers.
    pub(crate) fn node_name_of(&self, agent: &AgentId) -> String {
        self.registry
            .agent(agent)
            .map(|a| a.node_name)
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| agent.to_string())
    }

    /// The sandbox a volume mount holder names: from what its agent
    /// reports, else from the records (`records` is filled on first need).
    pub(crate) fn mount_holder(
        &self,
        agent: &AgentId,
        sandbox_id: &str,
        records: &mut Option<Vec<(String, SandboxKey)>>,
    ) -> Option<SandboxKey> {
        if let Some(s) = self.registry.observed(agent, &sandbox_id.into())
            && !s.name.is_empty()
        {
            return Some(SandboxKey::new(&s.namespace, s.name));
        }
        let all = records.get_or_insert_with(|| {
            self.store
                .list(&ListRange::all())
                .map(|rs| {
                    rs.into_iter()
                        .map(|r| (r.sandbox_id.to_string(), r.key()))
                        .collect()
                })
                .unwrap_or_default()
        });
        all.iter()
            .find(|(sid, _)| sid == sandbox_id)
            .map(|(_, k)| k.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for ok in ["a", "work-1", "0", &"x".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"x".repeat(64), "é"] {
            assert!(!is_dns_label(bad), "{bad}");
        }
        let e = check_name("name", "Bad").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("name \"Bad\" must be a DNS-1123 label")
        );
        assert_eq!(
            check_name("name", "").unwrap_err().to_string(),
            "name is required"
        );
    }

    #[test]
    fn sizes_are_quantities_named_by_field() {
        assert_eq!(parse_size("size", "").unwrap(), 0);
        assert_eq!(parse_size("size", "1Gi").unwrap(), 1 << 30);
        assert_eq!(parse_size("size", "1.5k").unwrap(), 1500);
        for (bad, want) in [
            ("lots", "size \"lots\" is not a Kubernetes quantity"),
            ("-1Gi", "size \"-1Gi\" is negative"),
            ("0", "size \"0\" is zero"),
            ("100Ei", "size \"100Ei\" is too large"),
        ] {
            let e = parse_size("size", bad).unwrap_err().to_string();
            assert!(e.starts_with(want), "{e} should start with {want}");
            assert!(!e.contains("memory"), "{e}");
        }
        assert!(check_backend("backend", "local").is_ok() && check_backend("b", "").is_ok());
        let e = check_backend("backend", "ceph").unwrap_err().to_string();
        assert!(e.starts_with("backend \"ceph\""), "{e}");
    }

    #[test]
    fn access_modes_keep_their_numbers_across_apis() {
        use sandbolt_proto::control::v1 as control;
        for (c, m) in [
            (control::AccessMode::Unspecified, AccessMode::Unspecified),
            (
                control::AccessMode::ReadWriteOnce,
                AccessMode::ReadWriteOnce,
            ),
            (control::AccessMode::ReadOnlyMany, AccessMode::ReadOnlyMany),
            (
                control::AccessMode::ReadWriteMany,
                AccessMode::ReadWriteMany,
            ),
        ] {
            assert_eq!(access_mode_in("m", c as i32).unwrap(), m);
            assert_eq!(access_mode_out(m) as i32, c as i32);
        }
        assert!(access_mode_in("m", 7).is_err());
    }
}
