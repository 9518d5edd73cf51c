//! Sandboxes and named volumes: a local volume pins the sandboxes that
//! mount it to its node.
//!
//! - create: every named volume of a sandbox must be on one node; placement
//!   is restricted to that node's agent (volume affinity, beside image
//!   affinity). Its agent silent → UNAVAILABLE naming the node, full →
//!   RESOURCE_EXHAUSTED; never another node. A missing volume with
//!   `create_if_missing` is made on the agent the sandbox is placed on
//!   (one with a volume root), before the sandbox, and marked
//!   `created_by_sandbox`; without it, NOT_FOUND naming the volume.
//! - delete: volumes this sandbox's create made and asked to be removed
//!   with it go once its container is gone.
//! - attach / detach: into a running sandbox on the volume's node; the
//!   record's `spec.pvc_volumes` follows (generation bump).
//! - recreate (AUTO_RECREATE) never moves such a sandbox: see `recover.rs`.
//! - a restore from a sandbox snapshot adds the snapshot's volumes, the
//!   read-write ones as forks made like missing volumes: see `restore.rs`.

use sandbolt_proto::agent::v1 as pb;

use crate::error::{Error, Result};
use crate::ids::{AgentId, SandboxKey};
use crate::limits::check_all_volumes;
use crate::registry::AgentInfo;
use crate::sandbox::shared::volume_mount;
use crate::sandbox::{Core, CreateRequest, Precondition};
use crate::store::{AccessMode, Phase, PvcVolume, SandboxRecord};
use crate::volume::{VOLUME_CALL, VOLUME_COPY, access_mode_out, info_access_mode, parse_size};

/// What a sandbox's named volumes ask of placement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct VolumeNeeds {
    /// The agent whose node holds the existing volumes.
    pub(crate) pin: Option<AgentId>,
    /// Claim names to create on the chosen agent.
    pub(crate) missing: Vec<String>,
    /// A missing volume is a local one: the chosen agent needs a volume
    /// root.
    pub(crate) local_missing: bool,
    /// A volume is shared (juicefs): the chosen agent must have its JuiceFS
    /// mount up. Shared volumes pin nothing.
    pub(crate) shared: bool,
}

impl VolumeNeeds {
    /// The chosen agent must have a volume root.
    pub(crate) fn volume_root(&self) -> bool {
        self.local_missing
    }
}

fn mode_name(m: pb::AccessMode) -> &'static str {
    match m {
        pb::AccessMode::ReadWriteOnce | pb::AccessMode::Unspecified => "ReadWriteOnce",
        pb::AccessMode::ReadOnlyMany => "ReadOnlyMany",
        pb::AccessMode::ReadWriteMany => "ReadWriteMany",
    }
}

/// A read-write mount of a ReadOnlyMany volume is refused, never turned
/// into a read-only one behind the client's back.
fn check_mode(v: &PvcVolume, mode: pb::AccessMode) -> Result<()> {
    if mode == pb::AccessMode::ReadOnlyMany && !v.read_only {
        return Err(Error::FailedPrecondition(format!(
            "volume {} is {}: volumes[{}] must be mounted read-only (readOnly: true)",
            v.claim_name,
            mode_name(mode),
            v.name
        )));
    }
    Ok(())
}

/// The spec of a volume a sandbox's create (or attach) makes; a fork
/// keeps its source's access mode unless the entry asks for one.
fn spec_for(v: &PvcVolume) -> Result<pb::VolumeSpec> {
    let mode = match v.access_mode {
        AccessMode::Unspecified if v.fork_from.is_empty() => AccessMode::ReadWriteOnce,
        m => m,
    };
    Ok(pb::VolumeSpec {
        name: v.claim_name.clone(),
        access_mode: access_mode_out(mode) as i32,
        size_bytes: parse_size(&format!("volumes[{}].pvc.size", v.name), &v.size)?,
        backend: match crate::volume::shared::is_juicefs(&v.backend) {
            true => crate::volume::BACKEND_JUICEFS.into(),
            false => String::new(),
        },
    })
}

pub(crate) fn node_label(agent: &AgentId, info: Option<&AgentInfo>) -> String {
    match info {
        Some(a) if !a.node_name.is_empty() => format!("node {} (agent {agent})", a.node_name),
        _ => format!("agent {agent}"),
    }
}

impl Core {
    /// A create that names no pool and mounts existing volumes goes to the
    /// pool of their node's agent: the volumes decide where it runs.
    pub(crate) fn pool_from_volumes(&self, req: &mut CreateRequest) {
        if !req.spec.pool.trim().is_empty() {
            return;
        }
        let pool = req.spec.pvc_volumes.iter().find_map(|v| {
            // A shared volume is in no pool's node.
            let e = self.volumes.get(&v.claim_name).filter(|e| !e.shared())?;
            self.registry.agent(&e.agent).map(|a| a.pool.pool)
        });
        if let Some(p) = pool {
            req.spec.pool = p;
        }
    }

    /// Where `vols` pin a sandbox, and which of them are to be created.
    /// `may_create`: false for a recreate, which must find its data.
    pub(crate) fn resolve_pvcs(&self, vols: &[PvcVolume], may_create: bool) -> Result<VolumeNeeds> {
        let mut home: Option<(AgentId, &str)> = None;
        let mut missing = Vec::new();
        let (mut local_missing, mut shared) = (false, false);
        for v in vols {
            let Some(e) = self.volumes.get(&v.claim_name) else {
                if may_create && v.create_if_missing {
                    check_mode(v, access_mode_out(v.access_mode))?;
                    missing.push(v.claim_name.clone());
                    match self.missing_is_shared(v) {
                        true => shared = true,
                        false => local_missing = true,
                    }
                    continue;
                }
                return Err(Error::NotFoundOther(format!(
                    "volume {} (volumes[{}].pvc.claimName) not found{}",
                    v.claim_name,
                    v.name,
                    if may_create {
                        "; set createIfMissing to create it"
                    } else {
                        ""
                    }
                )));
            };
            check_mode(v, info_access_mode(&e.info))?;
            if e.shared() {
                shared = true;
                continue;
            }
            match &home {
                None => home = Some((e.agent, &v.claim_name)),
                Some((a, first)) if *a != e.agent => {
                    return Err(Error::FailedPrecondition(format!(
                        "volumes {first} and {} are on different nodes ({} and {}); a sandbox can only mount volumes of one node",
                        v.claim_name,
                        node_label(a, self.registry.agent(a).as_ref()),
                        node_label(&e.agent, self.registry.agent(&e.agent).as_ref()),
                    )));
                }
                Some(_) => {}
            }
        }
        if let Some((agent, claim)) = &home {
            let info = self.registry.agent(agent);
            if info.as_ref().is_none_or(|a| a.lost) {
                return Err(Error::Unavailable(format!(
                    "volume {claim} is on {}, which is not heartbeating; the sandbox can only run there (its data is there): retry when the node is back",
                    node_label(agent, info.as_ref())
                )));
            }
        }
        Ok(VolumeNeeds {
            pin: home.map(|h| h.0),
            missing,
            local_missing,
            shared,
        })
    }

    /// Places a new sandbox where its volumes are and creates the missing
    /// ones on the chosen agent (marking them `created_by_sandbox`). On
    /// error nothing is held: no slot, no volume made here.
    #[tracing::instrument(skip_all, fields(sandbox = %r.name, sandbox_id = %r.sandbox_id, snapshot = %r.spec.snapshot_id))]
    pub(crate) async fn place_for_create(&self, r: &mut SandboxRecord) -> Result<()> {
        let snapshot = self.restore_source(r)?;
        if r.spec.pvc_volumes.is_empty() && snapshot.is_none() {
            return self.place_create(r, &VolumeNeeds::default(), true);
        }
        // The names this create may make exist: the check that they are
        // free and the agent call that takes them are one step.
        let creatable = r
            .spec
            .pvc_volumes
            .iter()
            .filter(|v| v.create_if_missing)
            .map(|v| v.claim_name.clone())
            .collect();
        let _names = self.volume_names.lock_all(creatable).await;
        let mut needs = self.resolve_pvcs(&r.spec.pvc_volumes, true)?;
        // Named volumes: cold (within its warm pool, if any); see `warm`.
        // A restore: cold, on its snapshot's node.
        match &snapshot {
            None => self.place_create(r, &needs, false)?,
            Some(snap) => {
                self.pin_to_snapshot(r, &mut needs, snap)?;
                self.place_create(r, &needs, false)
                    .map_err(|e| self.restore_placement_error(snap, e))?;
            }
        }
        // ReadWriteOnce of shared volumes, cluster-wide (see volume/shared.rs).
        if let Err(e) = self.claim_shared_writers(r) {
            self.registry.release(&r.agent_id, &r.sandbox_id);
            return Err(e);
        }
        if let Err(e) = self.create_missing(r, &needs.missing).await {
            self.registry.release(&r.agent_id, &r.sandbox_id);
            return Err(e);
        }
        Ok(())
    }

    /// Creates `missing` on `r`'s agent; on error removes those it made.
    async fn create_missing(&self, r: &mut SandboxRecord, missing: &[String]) -> Result<()> {
        if missing.is_empty() {
            return Ok(());
        }
        let agent = self.live_agent(r)?;
        for claim in missing {
            let v = r
                .spec
                .pvc_volumes
                .iter()
                .find(|v| &v.claim_name == claim)
                .expect("missing volumes come from the spec");
            let made = match spec_for(v) {
                Ok(spec) if v.fork_from.is_empty() => self.create_volume_on(&agent, spec).await,
                Ok(mut spec) => {
                    // A fork stays on its source's filesystem.
                    if self.missing_is_shared(v) {
                        spec.backend = crate::volume::BACKEND_JUICEFS.into();
                    }
                    self.fork_volume_on(&agent, &v.fork_from, spec).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = made {
                // The caller holds these names' locks: remove without them.
                for v in r.spec.pvc_volumes.iter().filter(|v| v.created_by_sandbox) {
                    self.remove_volume_of(r, &v.claim_name).await;
                }
                return Err(e);
            }
            let v = r
                .spec
                .pvc_volumes
                .iter_mut()
                .find(|v| &v.claim_name == claim)
                .expect("present");
            v.created_by_sandbox = true;
            let how = match v.fork_from.as_str() {
                "" => "created".to_string(),
                from => format!("forked from {from}"),
            };
            r.push_event(
                "info",
                "controller",
                format!("volume {claim} {how} on {}", agent.node_name),
            );
        }
        Ok(())
    }

    /// Asks `agent` to fork `from` (`<volume>@<volume snapshot>`) into a new
    /// volume `spec` (access mode and size: the source's unless set) and
    /// indexes it; the caller holds the new name's lock.
    async fn fork_volume_on(
        &self,
        agent: &AgentInfo,
        from: &str,
        spec: pb::VolumeSpec,
    ) -> Result<pb::VolumeInfo> {
        let (source, snapshot) = from.split_once('@').unwrap_or((from, ""));
        let body = pb::ForkVolumeRequest {
            source: source.to_string(),
            snapshot: snapshot.to_string(),
            spec: Some(spec),
        };
        let info = self
            .agents
            .fork_volume(&agent.agent_id, &agent.api_endpoint, body, VOLUME_COPY)
            .await
            .map_err(|e| match e.volume_agent(&agent.node_name) {
                // The snapshot record outlived the data it names.
                Error::VolumeAgent {
                    code: tonic::Code::NotFound,
                    message,
                    ..
                } => Error::FailedPrecondition(format!(
                    "volume snapshot {from} is gone from {}: {message}",
                    agent.node_name
                )),
                e => e,
            })?;
        self.volumes.answered(&agent.agent_id, &info);
        Ok(info)
    }

    /// Best effort: removes the volumes `r`'s create made (a create that
    /// failed; the client never got the sandbox).
    pub(crate) async fn discard_created_volumes(&self, r: &SandboxRecord) {
        for v in r.spec.pvc_volumes.iter().filter(|v| v.created_by_sandbox) {
            self.remove_sandbox_volume(r, &v.claim_name).await;
        }
    }

    /// At sandbox delete, once its container is gone: removes the volumes
    /// its create made and asked to be removed with it.
    pub(crate) async fn delete_sandbox_volumes(&self, r: &SandboxRecord, container_gone: bool) {
        for v in r
            .spec
            .pvc_volumes
            .iter()
            .filter(|v| v.delete_on_sandbox_delete && v.created_by_sandbox)
        {
            if !container_gone {
                tracing::warn!(sandbox = %r.name, volume = %v.claim_name, agent = %r.agent_id, "volume not removed with its sandbox: the agent is not heartbeating, the container may still mount it; delete the volume later");
                continue;
            }
            self.remove_sandbox_volume(r, &v.claim_name).await;
        }
    }

    /// Removes `claim` if it is still on `r`'s agent; failures are logged.
    async fn remove_sandbox_volume(&self, r: &SandboxRecord, claim: &str) {
        let _name = self.volume_names.lock(claim.to_string()).await;
        self.remove_volume_of(r, claim).await;
    }

    /// [`Core::remove_sandbox_volume`] for a caller that holds the name's
    /// lock already.
    async fn remove_volume_of(&self, r: &SandboxRecord, claim: &str) {
        let removed = match self.volume_home(claim) {
            Ok((e, a)) if e.agent == r.agent_id || e.shared() => self
                .agents
                .delete_volume(&a.agent_id, &a.api_endpoint, claim, VOLUME_COPY)
                .await
                .map(|_| self.volumes.removed(&a.agent_id, claim))
                .map_err(|e| e.volume_agent(&a.node_name)),
            Ok(_) => Err(Error::FailedPrecondition(
                "a volume of that name is on another node now".into(),
            )),
            Err(e) => Err(e),
        };
        match removed {
            Ok(()) => {
                tracing::info!(sandbox = %r.name, volume = %claim, "volume removed with its sandbox")
            }
            Err(e) => {
                tracing::warn!(sandbox = %r.name, volume = %claim, error = %e, "volume made for the sandbox not removed")
            }
        }
    }
}

impl Core {
    /// Mounts a named volume into a running sandbox (on the volume's node)
    /// and records it in the sandbox's spec.
    #[tracing::instrument(skip_all, fields(namespace = %key.namespace, sandbox = %key.name, volume = %v.claim_name))]
    pub async fn attach_volume(
        &self,
        key: &SandboxKey,
        expect: &Precondition,
        mut v: PvcVolume,
    ) -> Result<SandboxRecord> {
        let _sandbox = self.volume_mounts.lock(key.clone()).await;
        let r = self.get(key, expect)?;
        let mut all = r.spec.pvc_volumes.clone();
        all.push(v.clone());
        check_all_volumes(&r.spec.volumes, &all)?;
        let agent = self.mountable(&r)?;
        v.created_by_sandbox = self.volume_for_attach(&r, &agent, &v).await?;
        let status = self
            .agents
            .attach_volume(
                &agent.agent_id,
                &agent.api_endpoint,
                &r.sandbox_id,
                volume_mount(&v),
                VOLUME_CALL,
            )
            .await
            .map_err(|e| e.volume_agent(&agent.node_name));
        if let Err(e) = status {
            if v.created_by_sandbox {
                self.remove_sandbox_volume(&r, &v.claim_name).await;
            }
            return Err(e);
        }
        let sid = r.sandbox_id.clone();
        let recorded = self.modify(key, |x| {
            if x.sandbox_id != sid {
                return Err(Error::Aborted(format!(
                    "sandbox {key} was recreated meanwhile; attach again"
                )));
            }
            x.spec.pvc_volumes.push(v.clone());
            x.generation += 1;
            x.push_event(
                "info",
                "controller",
                format!("volume {} attached at {}", v.claim_name, v.mount_path),
            );
            Ok(())
        });
        if recorded.is_err() {
            // Not in the record: it must not stay mounted either.
            let _ = self
                .agents
                .detach_volume(
                    &agent.agent_id,
                    &agent.api_endpoint,
                    &sid,
                    &v.claim_name,
                    VOLUME_CALL,
                )
                .await;
        }
        self.refresh_volume(&agent, &v.claim_name).await;
        recorded
    }

    /// The agent of a sandbox that takes mounts now: Running or Paused, on
    /// a heartbeating agent.
    fn mountable(&self, r: &SandboxRecord) -> Result<AgentInfo> {
        if !matches!(r.phase, Phase::Running | Phase::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "sandbox {}/{} is {:?}; volumes are attached to and detached from running sandboxes",
                r.namespace, r.name, r.phase
            )));
        }
        match self.registry.agent(&r.agent_id) {
            Some(a) if !a.lost => Ok(a),
            a => Err(Error::Unavailable(format!(
                "sandbox {}/{} runs on {}, which is not heartbeating; retry when it is back",
                r.namespace,
                r.name,
                node_label(&r.agent_id, a.as_ref())
            ))),
        }
    }

    /// Checks that `v` is on the sandbox's node, or creates it there when
    /// it is missing and may be; true when created here.
    async fn volume_for_attach(
        &self,
        r: &SandboxRecord,
        agent: &AgentInfo,
        v: &PvcVolume,
    ) -> Result<bool> {
        let _name = match v.create_if_missing {
            true => Some(self.volume_names.lock(v.claim_name.clone()).await),
            false => None,
        };
        match self.volumes.get(&v.claim_name) {
            Some(e) if e.shared() => {
                check_mode(v, info_access_mode(&e.info))?;
                self.attach_shared(r, agent, v, &e).map(|()| false)
            }
            Some(e) if e.agent != r.agent_id => Err(Error::FailedPrecondition(format!(
                "volume {} is on {}, but sandbox {}/{} runs on {}; a volume is only mounted on its node",
                v.claim_name,
                node_label(&e.agent, self.registry.agent(&e.agent).as_ref()),
                r.namespace,
                r.name,
                node_label(&r.agent_id, Some(agent)),
            ))),
            Some(e) => check_mode(v, info_access_mode(&e.info)).map(|()| false),
            None if v.create_if_missing => {
                check_mode(v, access_mode_out(v.access_mode))?;
                if !self.is_ready() {
                    return Err(Error::Unavailable(
                        "controller restarted and still waits for the agents it knows to report their volumes; retry shortly".into(),
                    ));
                }
                self.create_volume_on(agent, spec_for(v)?).await?;
                Ok(true)
            }
            None => Err(Error::NotFoundOther(format!(
                "volume {} not found; set createIfMissing to create it",
                v.claim_name
            ))),
        }
    }

    /// Unmounts a named volume from a running sandbox and removes it from
    /// the record's spec. The volume itself stays.
    #[tracing::instrument(skip_all, fields(namespace = %key.namespace, sandbox = %key.name, volume = %claim))]
    pub async fn detach_volume(
        &self,
        key: &SandboxKey,
        expect: &Precondition,
        claim: &str,
    ) -> Result<SandboxRecord> {
        crate::volume::check_name("volume", claim)?;
        let _sandbox = self.volume_mounts.lock(key.clone()).await;
        let r = self.get(key, expect)?;
        if !r.spec.pvc_volumes.iter().any(|v| v.claim_name == claim) {
            return Err(Error::NotFoundOther(format!(
                "sandbox {key} does not mount volume {claim}"
            )));
        }
        let agent = self.mountable(&r)?;
        let detached = self
            .agents
            .detach_volume(
                &agent.agent_id,
                &agent.api_endpoint,
                &r.sandbox_id,
                claim,
                VOLUME_CALL,
            )
            .await
            .map_err(|e| e.volume_agent(&agent.node_name));
        match detached {
            // Not mounted there (any more): the record follows the node.
            Ok(_)
            | Err(Error::VolumeAgent {
                code: tonic::Code::NotFound,
                ..
            }) => {}
            Err(e) => return Err(e),
        }
        let sid = r.sandbox_id.clone();
        let recorded = self.modify(key, |x| {
            if x.sandbox_id != sid {
                return Err(Error::Aborted(format!(
                    "sandbox {key} was recreated meanwhile; detach again"
                )));
            }
            x.spec.pvc_volumes.retain(|v| v.claim_name != claim);
            x.generation += 1;
            x.push_event("info", "controller", format!("volume {claim} detached"));
            Ok(())
        });
        self.refresh_volume(&agent, claim).await;
        recorded
    }

    /// Best effort: the volume's mounts changed; ask its agent once.
    async fn refresh_volume(&self, agent: &AgentInfo, name: &str) {
        if let Ok(info) = self
            .agents
            .get_volume(&agent.agent_id, &agent.api_endpoint, name, VOLUME_CALL)
            .await
        {
            self.volumes.answered(&agent.agent_id, &info);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::shared::agent_spec;
    use crate::store::HostVolume;

    #[test]
    fn the_agent_gets_named_volumes_as_volume_mounts_and_host_paths_as_host_mounts() {
        let mut r = crate::store::tests_support::record("default", "s", "");
        r.spec.volumes = vec![HostVolume {
            name: "h".into(),
            host_path: "/srv/h".into(),
            mount_path: "/h".into(),
            ..Default::default()
        }];
        r.spec.pvc_volumes = vec![PvcVolume {
            name: "w".into(),
            claim_name: "work".into(),
            sub_path: "sub".into(),
            mount_path: "/work".into(),
            read_only: true,
            ..Default::default()
        }];
        let spec =
            agent_spec(&r, false, &crate::secrets::Secrets::from_material(&[0; 32])).unwrap();
        assert_eq!(spec.host_mounts.len(), 1);
        assert_eq!(spec.host_mounts[0].host_path, "/srv/h");
        assert_eq!(
            spec.volume_mounts,
            [pb::NamedVolumeMount {
                volume: "work".into(),
                sub_path: "sub".into(),
                mount_path: "/work".into(),
                read_only: true,
            }]
        );
    }

    #[test]
    fn a_read_write_mount_of_a_read_only_many_volume_is_refused_naming_the_mode() {
        let v = PvcVolume {
            name: "w".into(),
            claim_name: "work".into(),
            ..Default::default()
        };
        let e = check_mode(&v, pb::AccessMode::ReadOnlyMany).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)));
        assert!(e.to_string().contains("ReadOnlyMany"), "{e}");
        assert!(check_mode(&v, pb::AccessMode::ReadWriteOnce).is_ok());
        let ro = PvcVolume {
            read_only: true,
            ..v
        };
        assert!(check_mode(&ro, pb::AccessMode::ReadOnlyMany).is_ok());
    }
}
