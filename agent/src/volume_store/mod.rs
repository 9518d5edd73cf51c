//! The node's named volumes: a store on the agent's volume root.
//!
//! A named volume lives on one node. The store is the record of it: its
//! metadata sits beside its data on the volume root, so what the store
//! reports can never disagree with what is on disk.
//!
//! # Layout
//!
//! ```text
//! <root>/volumes/<name>/meta.json               VolumeMeta
//! <root>/volumes/<name>/data                    what sandboxes mount (btrfs: a subvolume)
//! <root>/volumes/<name>/snapshots/<snap>        btrfs: a read-only snapshot subvolume
//!                                               (directories: a copy)
//! <root>/staging/<op-id>/op.json                work in progress (what and when)
//! <root>/staging/<op-id>/...                    the result being built
//! ```
//!
//! A snapshot's creation time is its subvolume's (the root item's otime;
//! directories: the copy's birth time), so it needs no metadata file.
//!
//! # Crash safety
//!
//! Every mutation is built in `staging/<op-id>/` and published with one
//! rename: create and fork rename a whole volume directory into `volumes/`
//! (RENAME_NOREPLACE), restore exchanges (RENAME_EXCHANGE) a writable
//! snapshot of the snapshot with the live `data`, delete renames the volume
//! directory into staging before removing it. [`VolumeStore::open`]
//! deletes everything in `staging/`, so a kill -9 at any point leaves
//! either nothing or a whole result, never a half volume. It also removes a
//! volume directory without `data` (none is ever published; only a power
//! loss replaying a rename without the subvolume inside could make one).
//!
//! btrfs snapshots are the exception, because they need no staging: the
//! snapshot ioctl creates `snapshots/<snap>` in place atomically (in one
//! transaction, which it commits before returning), and deleting one is
//! one atomic ioctl too. (They could not be staged anyway: this kernel,
//! 6.18, refuses to move a read-only subvolume to another directory with
//! EROFS.) On directories a snapshot is a copy built in staging and renamed
//! into `snapshots/`.
//!
//! # Backends
//!
//! - `btrfs`: subvolumes; snapshots and forks share every block and take
//!   constant time; qgroup quotas (writes past the size fail with EDQUOT,
//!   "Disk quota exceeded", which is what the kernel returns for qgroups).
//! - `directory`: plain directories on any filesystem; snapshots, forks and
//!   restores copy every byte (`cp -a --reflink=auto`), no quota. The
//!   capabilities say so.
//!
//! Every call is synchronous (ioctls, fsyncs, `cp`): async callers use
//! `spawn_blocking`. Deletes and restores return once published; what they
//! leave in staging (the old data) is removed on a thread, which
//! [`VolumeStore::wait_for_cleanups`] and dropping the store wait for.
//! Whether a volume is mounted is the caller's business:
//! the agent's mount table refuses restore and delete of a mounted volume
//! before it calls the store.

mod beneath;
mod btrfs;
mod directory;
mod error;
mod juicefs;
mod meta;
mod names;
mod root;
mod staging;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use sandbolt_proto::agent::v1 as pb;

pub use error::VolumeStoreError;
pub use juicefs::{JuiceFsStoreConfig, STORE_DIR};
pub use root::unmount_root;

use meta::{VolumeMeta, now_ms};
use names::Label;
use root::Backend;
use staging::Op;

/// Which backend the store uses on its root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// btrfs when the root is on btrfs or a loop image can be made;
    /// directories otherwise.
    #[default]
    Auto,
    /// btrfs or nothing: open fails when the root cannot be btrfs.
    Btrfs,
    /// Plain directories (snapshots and forks copy).
    Directory,
}

impl FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "btrfs" => Ok(Self::Btrfs),
            "directory" => Ok(Self::Directory),
            other => Err(format!(
                "unknown volume backend {other:?} (expected auto, btrfs or directory)"
            )),
        }
    }
}

/// Where and how the node keeps its volumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeStoreConfig {
    /// The volume root (a btrfs filesystem, or where the loop image is
    /// mounted, or a plain directory).
    pub root: PathBuf,
    pub backend: BackendChoice,
    /// The loop-backed btrfs image made when the root is not on btrfs.
    pub loop_image: PathBuf,
    /// Size of that image (sparse); 0 = never create a loop image.
    pub loop_size_bytes: u64,
}

/// Kubernetes access modes, enforced by the agent at mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AccessMode {
    #[default]
    ReadWriteOnce,
    ReadOnlyMany,
    ReadWriteMany,
}

impl AccessMode {
    /// The Kubernetes name ("ReadWriteOnce", ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReadWriteOnce => "ReadWriteOnce",
            Self::ReadOnlyMany => "ReadOnlyMany",
            Self::ReadWriteMany => "ReadWriteMany",
        }
    }

    /// From the proto's `access_mode` field: `Ok(None)` for UNSPECIFIED (the
    /// caller's default applies), an error for a value the proto does not
    /// define.
    pub fn from_proto(value: i32) -> Result<Option<Self>, VolumeStoreError> {
        match pb::AccessMode::try_from(value) {
            Ok(pb::AccessMode::Unspecified) => Ok(None),
            Ok(pb::AccessMode::ReadWriteOnce) => Ok(Some(Self::ReadWriteOnce)),
            Ok(pb::AccessMode::ReadOnlyMany) => Ok(Some(Self::ReadOnlyMany)),
            Ok(pb::AccessMode::ReadWriteMany) => Ok(Some(Self::ReadWriteMany)),
            Err(_) => Err(VolumeStoreError::InvalidAccessMode {
                value: value.to_string(),
            }),
        }
    }
}

impl From<AccessMode> for pb::AccessMode {
    fn from(m: AccessMode) -> Self {
        match m {
            AccessMode::ReadWriteOnce => Self::ReadWriteOnce,
            AccessMode::ReadOnlyMany => Self::ReadOnlyMany,
            AccessMode::ReadWriteMany => Self::ReadWriteMany,
        }
    }
}

impl TryFrom<pb::AccessMode> for AccessMode {
    type Error = VolumeStoreError;
    /// UNSPECIFIED is an error here; use [`AccessMode::from_proto`] where it
    /// means "the default".
    fn try_from(m: pb::AccessMode) -> Result<Self, Self::Error> {
        Self::from_proto(m as i32)?.ok_or(VolumeStoreError::InvalidAccessMode {
            value: "ACCESS_MODE_UNSPECIFIED".into(),
        })
    }
}

/// Long Kubernetes names and their abbreviations.
impl FromStr for AccessMode {
    type Err = VolumeStoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ReadWriteOnce" | "RWO" => Ok(Self::ReadWriteOnce),
            "ReadOnlyMany" | "ROX" => Ok(Self::ReadOnlyMany),
            "ReadWriteMany" | "RWX" => Ok(Self::ReadWriteMany),
            other => Err(VolumeStoreError::InvalidAccessMode {
                value: other.into(),
            }),
        }
    }
}

impl std::fmt::Display for AccessMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the store's backend can do, as reported with every volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// "btrfs" or "directory".
    pub backend: &'static str,
    /// Snapshots take constant time and share blocks (no copy).
    pub instant_snapshots: bool,
    /// Forks take constant time and share blocks until written.
    pub instant_forks: bool,
    /// `size_bytes` is enforced (qgroups; JuiceFS directory quotas).
    pub quota: bool,
    /// Every agent that mounts the same filesystem reaches the volume
    /// (JuiceFS); false: this node only.
    pub shared: bool,
}

impl From<Capabilities> for pb::VolumeCapabilities {
    fn from(c: Capabilities) -> Self {
        Self {
            backend: c.backend.into(),
            instant_snapshots: c.instant_snapshots,
            instant_forks: c.instant_forks,
            quota: c.quota,
            shared: c.shared,
        }
    }
}

/// A volume to create (or the new volume of a fork).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NewVolume {
    pub name: String,
    /// None: ReadWriteOnce (for a fork: the source's).
    pub access_mode: Option<AccessMode>,
    /// Quota in bytes. None: no quota (for a fork: the source's); Some(0)
    /// also means no quota.
    pub size_bytes: Option<u64>,
}

/// A volume as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub name: String,
    pub access_mode: AccessMode,
    /// Quota in bytes; 0 = none.
    pub size_bytes: u64,
    pub created_at_ms: i64,
    /// Bytes the live data references (blocks shared with snapshots and
    /// forks included), from the qgroup; None when quotas are off. The
    /// kernel updates it at transaction commit (within 30 s of a write).
    pub used_bytes: Option<u64>,
    /// "<volume>" or "<volume>@<snapshot>" it was forked from.
    pub forked_from: Option<String>,
    /// Oldest first.
    pub snapshots: Vec<Snapshot>,
}

impl Volume {
    /// The proto spec (name, access mode, size) of this volume.
    pub fn spec(&self) -> pb::VolumeSpec {
        pb::VolumeSpec {
            name: self.name.clone(),
            access_mode: pb::AccessMode::from(self.access_mode) as i32,
            size_bytes: i64::try_from(self.size_bytes).unwrap_or(i64::MAX),
            // Which store holds it is the agent's to say (see VolumeMounts).
            backend: String::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub volume: String,
    pub name: String,
    pub created_at_ms: i64,
}

impl From<&Snapshot> for pb::VolumeSnapshot {
    fn from(s: &Snapshot) -> Self {
        Self {
            volume: s.volume.clone(),
            name: s.name.clone(),
            created_at_unix_ms: s.created_at_ms,
        }
    }
}

/// The node's named volumes on one volume root. `Send + Sync`: concurrent
/// calls are safe (each builds in its own staging directory and publishes
/// with one rename; two that collide on a name get AlreadyExists).
#[derive(Debug)]
pub struct VolumeStore {
    root: PathBuf,
    /// Where operations build their results: `<root>/staging`, or on
    /// JuiceFS this agent's own `<root>/staging/<agent id>`.
    staging: PathBuf,
    /// Holds the root's lock for the store's lifetime (and the lifetime
    /// of its cleanups).
    backend: Arc<Backend>,
    /// Threads removing what published operations left in staging.
    cleanups: Mutex<Vec<JoinHandle<()>>>,
}

/// Waits for the cleanups: the next store on this root must not recover
/// (delete) staging entries this one is still removing.
impl Drop for VolumeStore {
    fn drop(&mut self) {
        self.wait_for_cleanups();
    }
}

impl VolumeStore {
    /// Sets up the root (btrfs as it is, a loop image made or mounted, or
    /// plain directories), enables quotas on btrfs, then deletes whatever
    /// an interrupted operation left in `staging/`.
    pub fn open(cfg: &VolumeStoreConfig) -> Result<Self, VolumeStoreError> {
        let backend = root::prepare(cfg)?;
        let root = cfg.root.clone();
        for dir in [root.join("volumes"), root.join("staging")] {
            std::fs::create_dir_all(&dir).map_err(|e| error::io(format!("create {dir:?}"), e))?;
        }
        staging::recover(&root.join("staging"), &backend)?;
        staging::remove_volumes_without_data(&root, &backend)?;
        tracing::info!(root = %root.display(), capabilities = ?backend.capabilities(), "volume store open");
        Ok(Self {
            staging: root.join("staging"),
            root,
            backend: Arc::new(backend),
            cleanups: Mutex::new(Vec::new()),
        })
    }

    /// The store on a mounted JuiceFS filesystem (see [`juicefs`]): takes
    /// this agent's lock, then deletes what this agent's interrupted
    /// operations left in its own staging directory (never another
    /// agent's).
    pub fn open_juicefs(cfg: &JuiceFsStoreConfig) -> Result<Self, VolumeStoreError> {
        let root = cfg.root();
        let staging = cfg.staging();
        for dir in [root.join("volumes"), staging.clone()] {
            std::fs::create_dir_all(&dir).map_err(|e| error::io(format!("create {dir:?}"), e))?;
        }
        let backend = root::prepare_juicefs(cfg)?;
        staging::recover(&staging, &backend)?;
        tracing::info!(root = %root.display(), staging = %staging.display(), "JuiceFS volume store open");
        Ok(Self {
            root,
            staging,
            backend: Arc::new(backend),
            cleanups: Mutex::new(Vec::new()),
        })
    }

    /// Whether a volume of this name exists in this store.
    pub fn contains(&self, name: &str) -> bool {
        Label::volume(name).is_ok_and(|n| self.read_meta(n).is_ok())
    }

    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn volume_dir(&self, name: Label<'_>) -> PathBuf {
        self.root.join("volumes").join(name.as_str())
    }

    fn snapshot_dir(&self, volume: Label<'_>, snapshot: Label<'_>) -> PathBuf {
        self.volume_dir(volume)
            .join("snapshots")
            .join(snapshot.as_str())
    }

    /// Waits until what deletes and restores left behind (the old data,
    /// removed on threads) is gone from staging.
    pub fn wait_for_cleanups(&self) {
        let pending = std::mem::take(&mut *self.cleanups.lock());
        for handle in pending {
            let _ = handle.join();
        }
    }

    fn clean_up_later(&self, op: Op) {
        let mut cleanups = self.cleanups.lock();
        cleanups.retain(|h| !h.is_finished());
        cleanups.push(op.finish_in_background());
    }

    fn begin(
        &self,
        kind: &'static str,
        volume: Label<'_>,
        snapshot: Option<Label<'_>>,
    ) -> Result<Op, VolumeStoreError> {
        Op::begin(&self.staging, self.backend.clone(), kind, volume, snapshot)
    }

    /// The volume's `data` directory (the volume must exist). Mount through
    /// [`VolumeStore::open_data`], not this path: a path can be raced.
    pub fn data_dir(&self, name: &str) -> Result<PathBuf, VolumeStoreError> {
        let name = Label::volume(name)?;
        self.read_meta(name)?;
        Ok(self.volume_dir(name).join("data"))
    }

    /// Creates an empty volume.
    pub fn create(&self, v: &NewVolume) -> Result<Volume, VolumeStoreError> {
        let name = Label::volume(&v.name)?;
        let size = v.size_bytes.unwrap_or(0);
        self.check_quota(name, size)?;
        let meta = VolumeMeta::new(name, v.access_mode.unwrap_or_default(), size, None);
        self.refuse_existing(name)?;
        let op = self.begin("create", name, None)?;
        let vol = op.path("volume");
        staging::mkdir(&vol.join("snapshots"))?;
        // Creating a subvolume commits nothing: the metadata is fsynced.
        meta.write(&vol, false)?;
        self.backend.create_data(&vol.join("data"), size)?;
        op.publish_new(&vol, &self.volume_dir(name), name)?;
        self.get(name.as_str())
    }

    pub fn get(&self, name: &str) -> Result<Volume, VolumeStoreError> {
        let name = Label::volume(name)?;
        let meta = self.read_meta(name)?;
        let dir = self.volume_dir(name);
        Ok(Volume {
            name: meta.name,
            access_mode: meta.access_mode,
            size_bytes: meta.size_bytes,
            created_at_ms: meta.created_at_ms,
            used_bytes: self.backend.used_bytes(&dir.join("data")),
            forked_from: meta.forked_from,
            snapshots: self.snapshots_of(name)?,
        })
    }

    /// Every volume, by name. One deleted while listing is left out.
    pub fn list(&self) -> Result<Vec<Volume>, VolumeStoreError> {
        let dir = self.root.join("volumes");
        let mut out = Vec::new();
        for name in meta::dir_names(&dir)? {
            // Entries that are not valid names are not volumes (nothing
            // the store publishes has one).
            if Label::volume(&name).is_err() {
                continue;
            }
            match self.get(&name) {
                Ok(v) => out.push(v),
                Err(VolumeStoreError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Deletes a volume and its snapshots (its forks stay). `Ok(false)`:
    /// there was no such volume.
    pub fn delete(&self, name: &str) -> Result<bool, VolumeStoreError> {
        let name = Label::volume(name)?;
        let op = self.begin("delete", name, None)?;
        // Gone for everyone the moment it is renamed into staging; it is
        // removed on a thread, or by open() if we die first.
        let existed = op.take(&self.volume_dir(name), "volume")?;
        self.clean_up_later(op);
        Ok(existed)
    }

    /// A read-only snapshot of the volume's data as it is now. On btrfs
    /// one ioctl makes it in place, atomically, and commits it; on
    /// directories it is copied in staging and renamed into place.
    pub fn snapshot(&self, volume: &str, snapshot: &str) -> Result<Snapshot, VolumeStoreError> {
        let volume = Label::volume(volume)?;
        let snap = Label::snapshot(snapshot)?;
        self.read_meta(volume)?;
        let dest = self.snapshot_dir(volume, snap);
        if dest.exists() {
            return Err(VolumeStoreError::snapshot_exists(volume, snap));
        }
        let data = self.volume_dir(volume).join("data");
        if self.backend.in_place_snapshots() {
            self.backend
                .clone_data(&data, &dest, true, 0)
                .map_err(|e| match e.os_error() {
                    Some(libc::EEXIST) => VolumeStoreError::snapshot_exists(volume, snap),
                    Some(libc::ENOENT) => VolumeStoreError::volume_not_found(volume),
                    _ => e,
                })?;
        } else {
            let op = self.begin("snapshot", volume, Some(snap))?;
            let built = op.path("snapshot");
            self.backend
                .clone_data(&data, &built, true, 0)
                .map_err(|e| self.not_found_if_gone(volume, None, e))?;
            op.publish_snapshot(&built, &dest, volume, snap)?;
        }
        Ok(Snapshot {
            volume: volume.as_str().into(),
            name: snap.as_str().into(),
            created_at_ms: self.backend.created_at_ms(&dest).unwrap_or_else(now_ms),
        })
    }

    /// `Ok(false)`: the volume has no such snapshot.
    pub fn delete_snapshot(&self, volume: &str, snapshot: &str) -> Result<bool, VolumeStoreError> {
        let volume = Label::volume(volume)?;
        let snap = Label::snapshot(snapshot)?;
        self.read_meta(volume)?;
        let dest = self.snapshot_dir(volume, snap);
        if self.backend.in_place_snapshots() {
            return self.backend.delete_in_place(&dest);
        }
        let op = self.begin("delete-snapshot", volume, Some(snap))?;
        let existed = op.take(&dest, "snapshot")?;
        self.clean_up_later(op);
        Ok(existed)
    }

    /// Replaces the volume's data with a writable copy of the snapshot, in
    /// one RENAME_EXCHANGE. The caller makes sure nothing mounts it.
    pub fn restore(&self, volume: &str, snapshot: &str) -> Result<Volume, VolumeStoreError> {
        let volume = Label::volume(volume)?;
        let snap = Label::snapshot(snapshot)?;
        let meta = self.read_meta(volume)?;
        let source = self.snapshot_dir(volume, snap);
        if !source.exists() {
            return Err(VolumeStoreError::snapshot_not_found(volume, snap));
        }
        let op = self.begin("restore", volume, Some(snap))?;
        let built = op.path("data");
        self.backend
            .clone_data(&source, &built, false, meta.size_bytes)
            .map_err(|e| self.not_found_if_gone(volume, Some(snap), e))?;
        op.exchange(&built, &self.volume_dir(volume).join("data"), volume)?;
        // The old data goes with the op, on a thread.
        self.clean_up_later(op);
        self.get(volume.as_str())
    }

    /// A new volume from the source's data (or one of its snapshots).
    /// Access mode and size default to the source's.
    pub fn fork(
        &self,
        source: &str,
        snapshot: Option<&str>,
        new: &NewVolume,
    ) -> Result<Volume, VolumeStoreError> {
        let source = Label::volume(source)?;
        let snap = snapshot.map(Label::snapshot).transpose()?;
        let name = Label::volume(&new.name)?;
        let src_meta = self.read_meta(source)?;
        let size = new.size_bytes.unwrap_or(src_meta.size_bytes);
        self.check_quota(name, size)?;
        let (from, src_data) = match snap {
            Some(s) => (
                format!("{}@{}", source.as_str(), s.as_str()),
                self.snapshot_dir(source, s),
            ),
            None => (source.as_str().into(), self.volume_dir(source).join("data")),
        };
        if let Some(s) = snap.filter(|_| !src_data.exists()) {
            return Err(VolumeStoreError::snapshot_not_found(source, s));
        }
        let mode = new.access_mode.unwrap_or(src_meta.access_mode);
        let meta = VolumeMeta::new(name, mode, size, Some(from));
        self.refuse_existing(name)?;
        let op = self.begin("fork", name, None)?;
        let vol = op.path("volume");
        staging::mkdir(&vol.join("snapshots"))?;
        meta.write(&vol, self.backend.clone_commits())?;
        self.backend
            .clone_data(&src_data, &vol.join("data"), false, size)
            .map_err(|e| self.not_found_if_gone(source, snap, e))?;
        op.publish_new(&vol, &self.volume_dir(name), name)?;
        self.get(name.as_str())
    }

    /// An `O_PATH | O_DIRECTORY` descriptor of `data/<sub_path>`, for
    /// mounting that very directory (no path to race). `sub_path` is
    /// relative ("" = the data root) and walked one component at a time
    /// with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
    /// RESOLVE_NO_XDEV)`: a symlink anywhere on it is refused, never
    /// followed. Missing directories are created (as the kubelet does for
    /// subPath), with the data root's permission bits.
    pub fn open_data(&self, name: &str, sub_path: &str) -> Result<OwnedFd, VolumeStoreError> {
        let name = Label::volume(name)?;
        let parts = beneath::sub_path_components(name, sub_path)?;
        let data = self.volume_dir(name).join("data");
        let root = beneath::open_dir_nofollow(&data).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => VolumeStoreError::volume_not_found(name),
            _ => error::io(format!("open {data:?}"), e),
        })?;
        beneath::walk_creating(root, &parts)
            .map_err(|(part, e)| beneath::sub_path_error(name, sub_path, part, e))
    }

    fn read_meta(&self, name: Label<'_>) -> Result<VolumeMeta, VolumeStoreError> {
        VolumeMeta::read(&self.volume_dir(name), name)
    }

    fn snapshots_of(&self, volume: Label<'_>) -> Result<Vec<Snapshot>, VolumeStoreError> {
        let dir = self.volume_dir(volume).join("snapshots");
        let names = match meta::dir_names(&dir) {
            Ok(n) => n,
            // Deleted while we looked.
            Err(VolumeStoreError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(VolumeStoreError::volume_not_found(volume));
            }
            Err(e) => return Err(e),
        };
        let mut out: Vec<Snapshot> = names
            .iter()
            .filter_map(|name| {
                let snap = Label::snapshot(name).ok()?;
                // None: deleted while we looked.
                let created_at_ms = self.backend.created_at_ms(&dir.join(name))?;
                Some(Snapshot {
                    volume: volume.as_str().into(),
                    name: snap.as_str().into(),
                    created_at_ms,
                })
            })
            .collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.name).cmp(&(b.created_at_ms, &b.name)));
        Ok(out)
    }

    fn check_quota(&self, name: Label<'_>, size: u64) -> Result<(), VolumeStoreError> {
        if size > 0 && !self.backend.capabilities().quota {
            return Err(VolumeStoreError::QuotaUnsupported {
                volume: name.as_str().into(),
                backend: self.backend.capabilities().backend,
            });
        }
        Ok(())
    }

    /// A cheap early answer; the publishing rename (RENAME_NOREPLACE) is
    /// what really decides a race between two creates of one name.
    fn refuse_existing(&self, name: Label<'_>) -> Result<(), VolumeStoreError> {
        if self.volume_dir(name).exists() {
            return Err(VolumeStoreError::volume_exists(name));
        }
        Ok(())
    }

    /// A clone that failed because its source vanished meanwhile (deleted
    /// concurrently) is NotFound, not a command failure.
    fn not_found_if_gone(
        &self,
        volume: Label<'_>,
        snapshot: Option<Label<'_>>,
        err: VolumeStoreError,
    ) -> VolumeStoreError {
        if self.read_meta(volume).is_err() {
            return VolumeStoreError::volume_not_found(volume);
        }
        match snapshot {
            Some(s) if !self.snapshot_dir(volume, s).exists() => {
                VolumeStoreError::snapshot_not_found(volume, s)
            }
            _ => err,
        }
    }
}
