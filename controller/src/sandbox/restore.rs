//! Restore: a create with `spec.snapshot_id` makes a new sandbox whose
//! filesystem is the snapshot's (its agent prepares the writable layer on
//! top of the committed snapshot, copy-on-write; nothing is copied).
//!
//! - validate: the snapshot must exist in the sandbox's namespace
//!   (NOT_FOUND) and be READY (FAILED_PRECONDITION naming its phase); the
//!   image defaults to the snapshot's and another one is refused; a restore
//!   is never a warm pool member (a warm sandbox runs its image's
//!   filesystem, not the snapshot's), so `spec.pool` names an agent pool
//!   only (empty: the pool of the snapshot's agent); no request volume may
//!   sit where a volume of the snapshot is mounted.
//! - placement: on the snapshot's agent only, never a warm claim. That
//!   agent silent, gone or full → FAILED_PRECONDITION: snapshots do not
//!   move between nodes yet.
//! - volumes: each named volume the source mounted read-write comes back
//!   as a fork of the volume snapshot taken with the capture (a new volume
//!   per restore, made where `create_if_missing` volumes are made, removed
//!   with the sandbox); read-only ones are mounted read-only again.
//! - recreate (AUTO_RECREATE) stays on the snapshot's node: see
//!   `recover.rs`.
//! - FastPath v2 has no `snapshot_id`: its creates restore by naming the
//!   snapshot as the image ([`Core::restore_snapshot_named_by_image`]).

use crate::error::{Error, Result};
use crate::ids::AgentId;
use crate::limits::check_all_volumes;
use crate::placement::PlacementError;
use crate::sandbox::volumes::{VolumeNeeds, node_label};
use crate::sandbox::{Core, CreateRequest};
use crate::store::{PvcVolume, SandboxRecord, SnapshotPhase, SnapshotRecord, SnapshotVolumeRecord};

/// How a volume fork's claim name keeps room for its suffix: a volume name
/// is a DNS label (at most 63), the suffix is `-` and 8 hex digits.
const FORK_PREFIX_MAX: usize = 54;

/// The claim name of the fork of `volume` that the restore whose record
/// has `record_uid` makes: one per restore, the same on every retry of it.
pub(crate) fn fork_claim(volume: &str, record_uid: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(record_uid.as_bytes());
    let hex = hex::encode(&digest[..4]);
    let prefix = &volume[..volume.len().min(FORK_PREFIX_MAX)];
    format!("{prefix}-{hex}")
}

/// How a restored sandbox mounts one volume of its snapshot.
fn restored_volume(
    snap: &SnapshotRecord,
    v: &SnapshotVolumeRecord,
    record_uid: &str,
) -> Result<PvcVolume> {
    let mount = PvcVolume {
        name: v.volume.clone(),
        sub_path: v.sub_path.clone(),
        mount_path: v.mount_path.clone(),
        ..Default::default()
    };
    if v.read_only {
        return Ok(PvcVolume {
            claim_name: v.volume.clone(),
            read_only: true,
            ..mount
        });
    }
    if v.volume_snapshot.is_empty() {
        return Err(Error::FailedPrecondition(format!(
            "snapshot {} has no volume snapshot of volume {}, which its source mounted read-write at {}",
            snap.id, v.volume, v.mount_path
        )));
    }
    Ok(PvcVolume {
        claim_name: fork_claim(&v.volume, record_uid),
        fork_from: format!("{}@{}", v.volume, v.volume_snapshot),
        create_if_missing: true,
        delete_on_sandbox_delete: true,
        ..mount
    })
}

fn phase_name(p: SnapshotPhase) -> &'static str {
    match p {
        SnapshotPhase::Pending => "PENDING (its capture is still running)",
        SnapshotPhase::Ready => "READY",
        SnapshotPhase::Failed => "FAILED",
        SnapshotPhase::Deleting => "DELETING (its deletion was asked)",
    }
}

impl Core {
    /// FastPath v2 restores by image: a create whose image names a snapshot
    /// of its namespace ([`Core::snapshot_named`]: its id or request id)
    /// restores that snapshot, as fast-sandbox, where a snapshot's restore
    /// image is its template name (the OpenSandbox server sends
    /// `GetSandboxSnapshot`'s `template_name`, which it sets to the request
    /// id). The create becomes `snapshot_id` = the snapshot's id with no
    /// image: [`Core::resolve_snapshot`] then checks it (READY, or
    /// FAILED_PRECONDITION naming its phase) and fills in its image. An
    /// image that names no snapshot is an image. The native APIs say
    /// `snapshot_id` instead and never come here.
    pub(crate) fn restore_snapshot_named_by_image(&self, req: &mut CreateRequest) -> Result<()> {
        let image = req.spec.image.trim();
        if image.is_empty() || !req.spec.snapshot_id.trim().is_empty() {
            return Ok(());
        }
        if let Some(snap) = self.snapshot_named(&req.namespace, image)? {
            tracing::info!(snapshot = %snap.id, image = %image, "the image names a snapshot: restoring it");
            req.spec.snapshot_id = snap.id;
            req.spec.image.clear();
        }
        Ok(())
    }

    /// The validation step of a restore (none when `spec.snapshot_id` is
    /// empty): checks the snapshot and the request against it and fills in
    /// the image and the pool. True for a restore. `req.namespace` is
    /// normalized already.
    pub(crate) fn resolve_snapshot(&self, req: &mut CreateRequest) -> Result<bool> {
        let id = req.spec.snapshot_id.trim().to_string();
        req.spec.snapshot_id.clone_from(&id);
        if id.is_empty() {
            return Ok(false);
        }
        if !req.spec.warm_pool.trim().is_empty() {
            return Err(Error::InvalidArgument(format!(
                "warmPool {:?}: a sandbox restored from snapshot {id} cannot be a warm pool member (warm sandboxes run their image, not the snapshot); leave warmPool empty",
                req.spec.warm_pool
            )));
        }
        let snap = self.ready_snapshot(&id, &req.namespace)?;
        let spec = &mut req.spec;
        let image = spec.image.trim();
        if image.is_empty() {
            spec.image.clone_from(&snap.image);
        } else if sandbolt_image_ref::match_key(image) != sandbolt_image_ref::match_key(&snap.image)
        {
            return Err(Error::InvalidArgument(format!(
                "image {image:?} is not snapshot {id}'s image {} (leave image empty to use it)",
                snap.image
            )));
        }
        if spec.pool.trim().is_empty()
            && let Some(a) = self.registry.agent(&AgentId::from(snap.agent_id.clone()))
        {
            spec.pool = a.pool.pool;
        }
        check_snapshot_mounts(req, &snap)?;
        Ok(true)
    }

    /// The snapshot `id` of `namespace`, which must be READY.
    fn ready_snapshot(&self, id: &str, namespace: &str) -> Result<SnapshotRecord> {
        let snap = self.get_snapshot(namespace, id, "")?;
        if snap.phase != SnapshotPhase::Ready {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id} is {}; only a READY snapshot can be restored",
                phase_name(snap.phase)
            )));
        }
        Ok(snap)
    }

    /// The placement step of a restore, before its volumes are resolved:
    /// re-reads the snapshot (still READY), checks that its agent is
    /// heartbeating and adds its volumes to `r` (forks named after the
    /// record). `None` for a create from an image.
    pub(crate) fn restore_source(&self, r: &mut SandboxRecord) -> Result<Option<SnapshotRecord>> {
        if r.spec.snapshot_id.is_empty() {
            return Ok(None);
        }
        let snap = self.ready_snapshot(&r.spec.snapshot_id, &r.namespace)?;
        let agent = AgentId::from(snap.agent_id.clone());
        let info = self.registry.agent(&agent);
        if info.as_ref().is_none_or(|a| a.lost) {
            return Err(not_here(
                &snap,
                &node_label(&agent, info.as_ref()),
                "is not heartbeating",
            ));
        }
        for v in &snap.volumes {
            let restored = restored_volume(&snap, v, &r.uid)?;
            r.spec.pvc_volumes.push(restored);
        }
        check_all_volumes(&r.spec.volumes, &r.spec.pvc_volumes)?;
        Ok(Some(snap))
    }

    /// Pins the placement of a restore to the snapshot's agent; volumes
    /// of another node cannot be mounted with it.
    pub(crate) fn pin_to_snapshot(
        &self,
        r: &SandboxRecord,
        needs: &mut VolumeNeeds,
        snap: &SnapshotRecord,
    ) -> Result<()> {
        let home = AgentId::from(snap.agent_id.clone());
        if let Some(pin) = needs.pin.as_ref().filter(|p| **p != home) {
            let claim = r
                .spec
                .pvc_volumes
                .iter()
                .find(|v| {
                    self.volumes
                        .get(&v.claim_name)
                        .is_some_and(|e| e.agent == *pin)
                })
                .map(|v| v.claim_name.as_str())
                .unwrap_or_default();
            return Err(Error::FailedPrecondition(format!(
                "volume {claim} is on {}, but snapshot {} lives on {}; a sandbox restored from it runs there and only mounts volumes of that node",
                node_label(pin, self.registry.agent(pin).as_ref()),
                snap.id,
                node_label(&home, self.registry.agent(&home).as_ref()),
            )));
        }
        needs.pin = Some(home);
        Ok(())
    }

    /// A placement failure of a restore in the snapshot's words: its node
    /// is the only one it can use.
    pub(crate) fn restore_placement_error(&self, snap: &SnapshotRecord, e: Error) -> Error {
        let agent = AgentId::from(snap.agent_id.clone());
        let node = node_label(&agent, self.registry.agent(&agent).as_ref());
        match e {
            Error::Placement(PlacementError::PinnedUnavailable(_)) => {
                not_here(snap, &node, "is not heartbeating")
            }
            Error::Placement(PlacementError::PinnedFull(_)) => not_here(
                snap,
                &node,
                "has no free slot (or a requested port is taken)",
            ),
            Error::Placement(PlacementError::PinnedPool { have, want, .. }) => {
                Error::FailedPrecondition(format!(
                    "snapshot {} lives on {node}, whose agent serves pool {have}, not {want}; leave pool empty to restore it there",
                    snap.id
                ))
            }
            e => e,
        }
    }
}

/// FAILED_PRECONDITION: the snapshot's node cannot take the restore now.
fn not_here(snap: &SnapshotRecord, node: &str, why: &str) -> Error {
    Error::FailedPrecondition(format!(
        "snapshot {} lives on {node}, which {why}; snapshots do not move between nodes yet: retry when it can take the sandbox, or create from the image",
        snap.id
    ))
}

/// No request volume may be mounted where the snapshot mounts one, nor
/// mount a volume the snapshot mounts (read-only) again.
fn check_snapshot_mounts(req: &CreateRequest, snap: &SnapshotRecord) -> Result<()> {
    let spec = &req.spec;
    let taken = |path: &str| snap.volumes.iter().find(|v| v.mount_path == path);
    let request_mounts = spec
        .volumes
        .iter()
        .map(|v| (&v.name, &v.mount_path))
        .chain(spec.pvc_volumes.iter().map(|v| (&v.name, &v.mount_path)));
    for (name, path) in request_mounts {
        if let Some(v) = taken(path) {
            return Err(Error::InvalidArgument(format!(
                "volumes[{name}].mountPath {path:?} is where snapshot {} mounts volume {}, which the restore mounts there; use another mountPath",
                snap.id, v.volume
            )));
        }
    }
    for v in &spec.pvc_volumes {
        if snap
            .volumes
            .iter()
            .any(|s| s.read_only && s.volume == v.claim_name)
        {
            return Err(Error::InvalidArgument(format!(
                "volumes[{}].pvc.claimName {:?} is mounted by snapshot {} already (read-only); a volume is mounted at most once per sandbox",
                v.name, v.claim_name, snap.id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_claims_are_dns_labels_one_per_record() {
        let a = fork_claim("work", "uid-1");
        assert!(
            a.starts_with("work-") && a.len() == "work-".len() + 8,
            "{a}"
        );
        assert_eq!(a, fork_claim("work", "uid-1"), "stable for one record");
        assert_ne!(a, fork_claim("work", "uid-2"));
        let long = "v".repeat(63);
        let c = fork_claim(&long, "uid-1");
        assert_eq!(c.len(), 63, "{c}");
        assert!(crate::volume::is_dns_label(&c));
    }

    #[test]
    fn read_write_volumes_become_forks_and_read_only_ones_mount_again() {
        let snap = SnapshotRecord {
            id: "s1".into(),
            ..Default::default()
        };
        let rw = SnapshotVolumeRecord {
            volume: "work".into(),
            mount_path: "/work".into(),
            sub_path: "a".into(),
            read_only: false,
            volume_snapshot: "sbs-s1".into(),
        };
        let v = restored_volume(&snap, &rw, "uid").unwrap();
        assert_eq!(v.fork_from, "work@sbs-s1");
        assert_eq!(v.claim_name, fork_claim("work", "uid"));
        assert!(v.create_if_missing && v.delete_on_sandbox_delete && !v.read_only);
        assert!(!v.created_by_sandbox, "set once the fork is made");
        assert_eq!((v.mount_path.as_str(), v.sub_path.as_str()), ("/work", "a"));
        let ro = SnapshotVolumeRecord {
            read_only: true,
            volume_snapshot: String::new(),
            ..rw.clone()
        };
        let v = restored_volume(&snap, &ro, "uid").unwrap();
        assert_eq!(v.claim_name, "work");
        assert!(v.read_only && v.fork_from.is_empty() && !v.create_if_missing);
        let broken = SnapshotVolumeRecord {
            volume_snapshot: String::new(),
            ..rw
        };
        let e = restored_volume(&snap, &broken, "uid").unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    }
}
