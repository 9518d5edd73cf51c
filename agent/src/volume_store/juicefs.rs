//! The JuiceFS backend: volumes on the cluster's JuiceFS filesystem,
//! mounted by the agent (see [`crate::juicefs_mount`]).
//!
//! The layout is the store's usual one, below `<mount point>/sandbolt`;
//! what differs is that every agent with the filesystem mounted sees the
//! same volumes, so:
//!
//! - each agent stages in `staging/<agent id>/` and recovers only that:
//!   a starting agent never deletes another agent's work in progress;
//! - the store's lock is a local file (`lock_file`), not one on JuiceFS:
//!   a JuiceFS flock belongs to the client session that took it, and a
//!   killed mount's session (and its locks) lives on in the metadata
//!   engine for minutes, which would keep the remounted store out. Two
//!   agents with one id on two nodes would therefore share a staging
//!   directory: agent ids must be unique across the cluster;
//! - snapshots and forks are `juicefs clone` (a metadata copy: no object is
//!   read or written, whatever the size), built in staging and published
//!   with one rename like everything else;
//! - quotas are JuiceFS directory quotas (`juicefs quota set --path`), set
//!   on the built directory before it is published (a quota belongs to the
//!   directory's inode, so it moves with the rename). A mount learns new
//!   quotas when it next refreshes them (about every 12 s), so writes past
//!   a fresh volume's size fail with EDQUOT from then on.

use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

use super::VolumeStoreError;
use super::error::io;

/// Where the store lives inside the filesystem.
pub const STORE_DIR: &str = "sandbolt";

/// How the store reaches the filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JuiceFsStoreConfig {
    /// Where the filesystem is mounted (its root).
    pub mount_point: PathBuf,
    /// The metadata engine's URL (for `juicefs quota`).
    pub meta_url: String,
    /// The `juicefs` binary.
    pub binary: PathBuf,
    /// This agent's id: names its staging directory.
    pub agent_id: String,
    /// The store's lock, on a local filesystem.
    pub lock_file: PathBuf,
}

impl JuiceFsStoreConfig {
    /// The store's root: `<mount point>/sandbolt`.
    pub fn root(&self) -> PathBuf {
        self.mount_point.join(STORE_DIR)
    }

    /// This agent's staging directory.
    pub fn staging(&self) -> PathBuf {
        self.root().join("staging").join(self.agent_dir_name())
    }

    /// The agent id as one safe path component: as it is when it is a
    /// plain name, else lowercased with other characters replaced and a
    /// hash of the original appended (two ids never share a directory).
    pub fn agent_dir_name(&self) -> String {
        let id = &self.agent_id;
        let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
        if !id.is_empty() && id.len() <= 64 && id.chars().all(plain) {
            return id.clone();
        }
        // FNV-1a: stable across builds (std's hasher is not).
        let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let cleaned: String = id
            .to_ascii_lowercase()
            .chars()
            .map(|c| if plain(c) { c } else { '-' })
            .take(40)
            .collect();
        format!("{cleaned}-{hash:016x}")
    }
}

/// The backend's tools and paths.
#[derive(Debug)]
pub(super) struct JuiceFs {
    cfg: JuiceFsStoreConfig,
    lock: RawFd,
}

impl JuiceFs {
    pub fn new(cfg: JuiceFsStoreConfig, lock: RawFd) -> Self {
        Self { cfg, lock }
    }

    /// An empty directory, with a quota of `limit` bytes (0: none).
    pub fn create(&self, path: &Path, limit: u64) -> Result<(), VolumeStoreError> {
        std::fs::create_dir(path).map_err(|e| io(format!("create {path:?}"), e))?;
        self.set_quota(path, limit)
    }

    /// `dst` as a metadata clone of `src` (no data copied), with a quota
    /// of `limit` bytes (0: none). Snapshots are clones too: JuiceFS has
    /// no read-only directories, and sandboxes never mount a snapshot
    /// (restore and fork clone it again).
    pub fn clone_tree(&self, src: &Path, dst: &Path, limit: u64) -> Result<(), VolumeStoreError> {
        if !src.is_dir() {
            return Err(io(
                format!("clone {src:?}"),
                std::io::Error::from_raw_os_error(libc::ENOENT),
            ));
        }
        if dst.exists() {
            return Err(io(
                format!("clone to {dst:?}"),
                std::io::Error::from_raw_os_error(libc::EEXIST),
            ));
        }
        self.run(&["clone".as_ref(), src.as_os_str(), dst.as_os_str()])?;
        self.set_quota(dst, limit)
    }

    /// Removes `path` and everything below it with `juicefs rmr` (one
    /// metadata walk in the mount, not a syscall per file). A missing path
    /// is not an error.
    pub fn remove_tree(&self, path: &Path) -> Result<(), VolumeStoreError> {
        if std::fs::symlink_metadata(path).is_err() {
            return Ok(());
        }
        if path.is_dir() {
            self.run(&["rmr".as_ref(), path.as_os_str()])?;
        }
        super::directory::remove_tree(path)
    }

    /// Sets `path`'s directory quota (0: none).
    fn set_quota(&self, path: &Path, limit: u64) -> Result<(), VolumeStoreError> {
        if limit == 0 {
            return Ok(());
        }
        let inside =
            Path::new("/").join(path.strip_prefix(&self.cfg.mount_point).map_err(|_| {
                VolumeStoreError::Setup(format!(
                    "{path:?} is not below the JuiceFS mount point {:?}",
                    self.cfg.mount_point
                ))
            })?);
        // `--capacity` is in GiB and takes a fraction; a byte count below
        // 2^53 divided by 2^30 is exact, and Rust prints the shortest text
        // that parses back to the same number, so the quota is exact too.
        let gib = format!("{}", limit as f64 / f64::from(1u32 << 30));
        self.run(&[
            "quota".as_ref(),
            "set".as_ref(),
            self.cfg.meta_url.as_ref(),
            "--path".as_ref(),
            inside.as_os_str(),
            "--capacity".as_ref(),
            gib.as_ref(),
        ])
        .map(drop)
    }

    fn run(&self, args: &[&std::ffi::OsStr]) -> Result<String, VolumeStoreError> {
        let bin = self.cfg.binary.to_string_lossy().into_owned();
        let out = super::root::tool(&bin, self.lock)
            .args(args)
            .output()
            .map_err(|e| io(format!("run {bin} (--juicefs-binary)"), e))?;
        if !out.status.success() {
            // The URL may carry a password: it never goes into an error.
            let shown: Vec<String> = args
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .map(|a| {
                    if a == self.cfg.meta_url {
                        "<meta-url>".into()
                    } else {
                        a
                    }
                })
                .collect();
            let stderr =
                String::from_utf8_lossy(&out.stderr).replace(&self.cfg.meta_url, "<meta-url>");
            return Err(VolumeStoreError::Command {
                command: format!("juicefs {}", shown.join(" ")),
                status: out.status.to_string(),
                stderr: last_lines(&stderr, 4),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The last `n` non-empty lines of a tool's output (its errors come last).
pub(crate) fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
