//! The metadata files beside the data: `meta.json` of a volume and of each
//! snapshot. Written (and fsynced) in staging before publication, never
//! changed afterwards.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::io;
use super::names::Label;
use super::{AccessMode, VolumeStoreError};

const META: &str = "meta.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct VolumeMeta {
    pub name: String,
    /// The Kubernetes name ("ReadWriteOnce", ...).
    #[serde(with = "access_mode_name")]
    pub access_mode: AccessMode,
    /// 0 = no quota.
    pub size_bytes: u64,
    pub created_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
}

mod access_mode_name {
    use super::AccessMode;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &AccessMode, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(m.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<AccessMode, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl VolumeMeta {
    pub fn new(
        name: Label<'_>,
        access_mode: AccessMode,
        size_bytes: u64,
        forked_from: Option<String>,
    ) -> Self {
        Self {
            name: name.as_str().into(),
            access_mode,
            size_bytes,
            created_at_ms: now_ms(),
            forked_from,
        }
    }

    /// Writes `dir/meta.json`. `commit_follows`: a btrfs snapshot comes
    /// next and commits the transaction, so the file is only written back
    /// (sync_file_range: a small file becomes an inline extent in the
    /// metadata that commit persists) instead of fsynced (a log sync and a
    /// device flush of its own, 3–10 ms).
    pub fn write(&self, dir: &Path, commit_follows: bool) -> Result<(), VolumeStoreError> {
        write_json(dir, self, commit_follows)
    }

    /// NotFound when there is no such volume (no meta.json).
    pub fn read(dir: &Path, name: Label<'_>) -> Result<Self, VolumeStoreError> {
        let meta: Self = read_json(dir, name)?;
        if meta.name != name.as_str() {
            return Err(VolumeStoreError::Corrupt {
                volume: name.as_str().into(),
                reason: format!("meta.json names {:?}", meta.name),
            });
        }
        Ok(meta)
    }
}

/// Writes `dir/meta.json` durably (see [`VolumeMeta::write`]): the rename
/// that publishes it must never publish an empty file after a power loss.
fn write_json<T: Serialize>(
    dir: &Path,
    value: &T,
    commit_follows: bool,
) -> Result<(), VolumeStoreError> {
    let path = dir.join(META);
    let body = serde_json::to_vec_pretty(value).expect("metadata serializes");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create_new(&path)?;
        f.write_all(&body)?;
        if !commit_follows {
            return f.sync_all();
        }
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: a valid fd; no memory is passed.
        if unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, flags) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    write().map_err(|e| io(format!("write {path:?}"), e))
}

fn read_json<T: serde::de::DeserializeOwned>(
    dir: &Path,
    volume: Label<'_>,
) -> Result<T, VolumeStoreError> {
    let path = dir.join(META);
    let body = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(VolumeStoreError::volume_not_found(volume));
        }
        Err(e) => return Err(io(format!("read {path:?}"), e)),
    };
    serde_json::from_slice(&body).map_err(|e| VolumeStoreError::Corrupt {
        volume: volume.as_str().into(),
        reason: format!("{}: {e}", path.display()),
    })
}

/// Names of the entries of `dir` (non-UTF-8 names are skipped: the store
/// never makes one).
pub(super) fn dir_names(dir: &Path) -> Result<Vec<String>, VolumeStoreError> {
    let entries = std::fs::read_dir(dir).map_err(|e| io(format!("list {dir:?}"), e))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io(format!("list {dir:?}"), e))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}
