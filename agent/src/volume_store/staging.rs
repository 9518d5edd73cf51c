//! Staged operations: each mutation builds its result in
//! `staging/<op-id>/` and publishes it with one rename. Whatever is left in
//! the op's directory afterwards (the old data of a restore, a deleted
//! volume, a result that failed half-way) is removed when the [`Op`] is
//! dropped, or by [`recover`] at the next open if the process died first.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::VolumeStoreError;
use super::error::io;
use super::meta::now_ms;
use super::names::Label;
use super::root::Backend;

/// What `staging/<op-id>/op.json` records (for the log of a recovery).
#[derive(Debug, Serialize, Deserialize)]
struct OpRecord {
    op: String,
    volume: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot: Option<String>,
    started_at_ms: i64,
}

/// One staged operation; its directory goes when it is dropped (or, after
/// [`Op::finish_in_background`], on a thread of its own).
pub(super) struct Op {
    dir: PathBuf,
    backend: Arc<Backend>,
    /// Cleared once the directory is someone else's to remove.
    owns_dir: bool,
}

impl Op {
    pub fn begin(
        staging: &Path,
        backend: Arc<Backend>,
        kind: &'static str,
        volume: Label<'_>,
        snapshot: Option<Label<'_>>,
    ) -> Result<Self, VolumeStoreError> {
        let dir = staging.join(uuid::Uuid::new_v4().simple().to_string());
        mkdir(&dir)?;
        let op = Self {
            dir,
            backend,
            owns_dir: true,
        };
        let record = OpRecord {
            op: kind.into(),
            volume: volume.as_str().into(),
            snapshot: snapshot.map(|s| s.as_str().into()),
            started_at_ms: now_ms(),
        };
        let body = serde_json::to_vec(&record).expect("op record serializes");
        let path = op.dir.join("op.json");
        std::fs::write(&path, body).map_err(|e| io(format!("write {path:?}"), e))?;
        Ok(op)
    }

    /// A path inside the op's directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// Publishes a built volume directory at `dest` (which must not exist).
    pub fn publish_new(
        &self,
        built: &Path,
        dest: &Path,
        name: Label<'_>,
    ) -> Result<(), VolumeStoreError> {
        match rename2(built, dest, libc::RENAME_NOREPLACE) {
            Ok(()) => sync_parent(dest),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                Err(VolumeStoreError::volume_exists(name))
            }
            Err(e) => Err(io(format!("publish {dest:?}"), e)),
        }
    }

    /// Publishes a built snapshot directory into the volume's `snapshots/`.
    pub fn publish_snapshot(
        &self,
        built: &Path,
        dest: &Path,
        volume: Label<'_>,
        snap: Label<'_>,
    ) -> Result<(), VolumeStoreError> {
        match rename2(built, dest, libc::RENAME_NOREPLACE) {
            Ok(()) => sync_parent(dest),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                Err(VolumeStoreError::snapshot_exists(volume, snap))
            }
            // The volume was deleted while we built.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                Err(VolumeStoreError::volume_not_found(volume))
            }
            Err(e) => Err(io(format!("publish {dest:?}"), e)),
        }
    }

    /// Swaps `built` and `live` in one RENAME_EXCHANGE; the old live data
    /// ends up in the op's directory and goes with it.
    pub fn exchange(
        &self,
        built: &Path,
        live: &Path,
        volume: Label<'_>,
    ) -> Result<(), VolumeStoreError> {
        match rename2(built, live, libc::RENAME_EXCHANGE) {
            Ok(()) => sync_parent(live),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                Err(VolumeStoreError::volume_not_found(volume))
            }
            Err(e) => Err(io(format!("exchange {built:?} with {live:?}"), e)),
        }
    }

    /// Moves `published` into the op's directory (as `rel`): from then on
    /// it is gone for everyone, and the op removes it. `Ok(false)`: there
    /// was nothing to take.
    pub fn take(&self, published: &Path, rel: &str) -> Result<bool, VolumeStoreError> {
        match std::fs::rename(published, self.path(rel)) {
            Ok(()) => {
                sync_parent(published)?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io(format!("move {published:?} to staging"), e)),
        }
    }

    /// Removes what is left of the op (an old volume, old data) on a
    /// thread: the result is published already, and deleting a subvolume
    /// evicts its files from the page cache, which takes time in
    /// proportion to how much of it was cached (about 200 ms per GiB here).
    pub fn finish_in_background(mut self) -> std::thread::JoinHandle<()> {
        self.owns_dir = false;
        let (dir, backend) = (self.dir.clone(), self.backend.clone());
        std::thread::spawn(move || remove_logged(&backend, &dir))
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if self.owns_dir {
            remove_logged(&self.backend, &self.dir);
        }
    }
}

fn remove_logged(backend: &Backend, dir: &Path) {
    if let Err(e) = backend.remove(dir) {
        // Left for the next open's recovery.
        tracing::warn!(dir = %dir.display(), error = %e, "could not remove a staging directory");
    }
}

/// Deletes everything in `staging/` (subvolumes with `btrfs subvolume
/// delete`): each entry is an operation that did not finish, or the
/// leftovers of one that did.
pub(super) fn recover(staging: &Path, backend: &Backend) -> Result<(), VolumeStoreError> {
    let entries = std::fs::read_dir(staging).map_err(|e| io(format!("list {staging:?}"), e))?;
    for entry in entries {
        let path = entry
            .map_err(|e| io(format!("list {staging:?}"), e))?
            .path();
        let record = std::fs::read(path.join("op.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<OpRecord>(&b).ok());
        tracing::warn!(dir = %path.display(), op = ?record, "removing an interrupted volume operation");
        backend.remove(&path)?;
    }
    Ok(())
}

/// Removes volume directories that have no `data`. Publication makes
/// none (a volume directory is renamed into place whole), but after a
/// power loss the filesystem's log replay could in principle bring back a
/// renamed directory without a subvolume made in the same transaction;
/// such a directory holds nothing worth keeping.
pub(super) fn remove_volumes_without_data(
    root: &Path,
    backend: &Backend,
) -> Result<(), VolumeStoreError> {
    let volumes = root.join("volumes");
    for name in super::meta::dir_names(&volumes)? {
        let dir = volumes.join(&name);
        let data = std::fs::symlink_metadata(dir.join("data"));
        if !dir.is_dir() || !matches!(&data, Err(e) if e.kind() == io::ErrorKind::NotFound) {
            continue;
        }
        tracing::warn!(dir = %dir.display(), "removing a volume directory without data");
        let trash = root
            .join("staging")
            .join(uuid::Uuid::new_v4().simple().to_string());
        std::fs::rename(&dir, &trash).map_err(|e| io(format!("move {dir:?} to staging"), e))?;
        backend.remove(&trash)?;
    }
    Ok(())
}

pub(super) fn mkdir(path: &Path) -> Result<(), VolumeStoreError> {
    std::fs::create_dir_all(path).map_err(|e| io(format!("create {path:?}"), e))
}

/// `renameat2(2)` by syscall: libc's wrapper is glibc-only.
fn rename2(from: &Path, to: &Path, flags: libc::c_uint) -> io::Result<()> {
    let from = CString::new(from.as_os_str().as_bytes())?;
    let to = CString::new(to.as_os_str().as_bytes())?;
    // SAFETY: two valid NUL-terminated paths; the call touches no memory
    // of ours beyond reading them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            flags,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// fsyncs the directory holding `path`, so the rename that published (or
/// took) it survives a power loss, not only a kill -9.
fn sync_parent(path: &Path) -> Result<(), VolumeStoreError> {
    let Some(parent) = path.parent() else {
        return Ok(());
    };
    std::fs::File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(format!("fsync {parent:?}"), e))
}
