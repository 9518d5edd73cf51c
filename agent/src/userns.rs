//! User namespaces for sandboxes (`--user-namespace node`).
//!
//! Every sandbox of the node gets a user namespace mapping container ids
//! `0..65535` to host ids `base..base+65535` (uid and gid alike): root in a
//! sandbox is an unprivileged uid on the host, so a file it writes on a
//! bind mount belongs to `base`, and host files owned by root are "nobody"
//! to it. One range per node, not per sandbox: runc 1.1 has no idmapped
//! mounts, so a sandbox's files must be owned by host ids inside its range
//! on disk, and per-sandbox ranges would need a differently shifted copy of
//! the image per sandbox (idmapped mounts need runc >= 1.2 and containerd
//! >= 2.0 for the snapshotter's remap labels).
//!
//! The rootfs: a *shifted* snapshot per image, made once and kept
//! ([`Shifter::parent_for`]): a scratch snapshot is prepared on the
//! image's chain id, mounted, every entry chowned by `+base` (set-id bits,
//! which chown clears, put back; file capabilities rewritten as v3 with
//! the range's root as their owner, as the kernel then honours them inside
//! the namespace), and committed as `sandbolt-userns/<chain id>/<base>`.
//! Sandboxes' writable snapshots are its children. The overlay copies every
//! file up once (a full copy of the image, paid at the first create of the
//! image or by the warm-image task, never again). Ids above 65535 in an
//! image become 65534 (nobody) — they could not be mapped.
//!
//! Shifted snapshots carry `containerd.io/gc.root`, so containerd keeps
//! them (and, through them, the image's layers) until the agent removes
//! them; the janitor does not know them and leaves them alone. A removed
//! image's shifted snapshot stays until an operator removes it (`ctr
//! snapshots rm sandbolt-userns/...`); see the README.

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use containerd_client::services::v1::snapshots::CommitSnapshotRequest;
use containerd_client::types::Mount;
use nix::mount::{MntFlags, MsFlags};
use oci_spec::runtime::{
    LinuxIdMapping, LinuxIdMappingBuilder, LinuxNamespace, LinuxNamespaceType,
};

use crate::containerd::Containerd;
use crate::error::{AgentError, Result};
use crate::labels;

/// First host id of the node's range unless `--userns-base` says otherwise.
pub const DEFAULT_BASE: u32 = 100_000;
/// Ids per range: container ids 0..65535.
pub const SIZE: u32 = 65_536;
/// Where an id that cannot be mapped (>= [`SIZE`]) goes: nobody.
const OVERFLOW_ID: u32 = 65_534;
/// Committed shifted snapshots' name prefix.
pub const SHIFTED_PREFIX: &str = "sandbolt-userns/";
/// The scratch snapshot a shift works in.
const SCRATCH_PREFIX: &str = "sandbolt-userns-tmp/";
/// Label on a shifted snapshot: the chain id it shifts.
pub const SHIFTED_CHAIN_LABEL: &str = "io.sandbolt.userns.chain-id";

/// Whether sandboxes get user namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UserNamespaceMode {
    /// Container root is host root (as before).
    #[default]
    Off,
    /// One mapped range for every sandbox of the node.
    Node,
}

impl UserNamespaceMode {
    pub fn enabled(self) -> bool {
        self == Self::Node
    }
}

impl std::str::FromStr for UserNamespaceMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "node" => Ok(Self::Node),
            other => Err(format!(
                "user namespace mode {other:?}: expected \"off\" or \"node\""
            )),
        }
    }
}

/// Refuses a range that would map host root's ids (or overflow).
pub fn validate_base(base: u32) -> std::result::Result<(), String> {
    if base < SIZE {
        return Err(format!(
            "--userns-base {base} is below {SIZE}: the range would map host ids of system users (root included) into sandboxes"
        ));
    }
    if base.checked_add(SIZE).is_none() {
        return Err(format!(
            "--userns-base {base}: the range overflows 32-bit ids"
        ));
    }
    Ok(())
}

/// The uid/gid mapping of every sandbox: container 0..65535 → host base...
pub fn mappings(base: u32) -> Vec<LinuxIdMapping> {
    vec![
        LinuxIdMappingBuilder::default()
            .container_id(0u32)
            .host_id(base)
            .size(SIZE)
            .build()
            .expect("an id mapping with every field set builds"),
    ]
}

/// Puts the sandbox in a new user namespace with the node's mapping.
///
/// `joins_network`: the sandbox joins a network namespace the agent
/// prepared, which belongs to the host's user namespace; the kernel then
/// refuses a sysfs mount from inside the sandbox's namespace (EPERM) and
/// runc 1.1 has no fallback, so /sys becomes a read-only recursive bind of
/// the host's /sys (what rootless runtimes do with a host network
/// namespace). Its files belong to the unmapped host root: readable where
/// they are world-readable, never writable.
pub fn apply(spec: &mut oci_spec::runtime::Spec, base: u32, joins_network: bool) {
    if joins_network && let Some(mounts) = spec.mounts_mut() {
        for m in mounts.iter_mut() {
            if m.destination() == Path::new("/sys") && m.typ().as_deref() == Some("sysfs") {
                m.set_typ(Some("bind".into()))
                    .set_source(Some("/sys".into()))
                    .set_options(Some(
                        ["rbind", "ro", "nosuid", "nodev", "noexec"]
                            .map(String::from)
                            .to_vec(),
                    ));
            }
        }
    }
    let Some(linux) = spec.linux_mut() else {
        return;
    };
    let mut namespaces = linux.namespaces().clone().unwrap_or_default();
    if !namespaces
        .iter()
        .any(|n| n.typ() == LinuxNamespaceType::User)
    {
        let mut user = LinuxNamespace::default();
        user.set_typ(LinuxNamespaceType::User);
        namespaces.push(user);
    }
    linux
        .set_namespaces(Some(namespaces))
        .set_uid_mappings(Some(mappings(base)))
        .set_gid_mappings(Some(mappings(base)));
}

/// The host id of container id `id`.
pub fn shift_id(id: u32, base: u32) -> u32 {
    base + if id < SIZE { id } else { OVERFLOW_ID }
}

/// The name of the shifted snapshot of `chain_id` for range `base`.
pub fn shifted_key(chain_id: &str, base: u32) -> String {
    format!("{SHIFTED_PREFIX}{chain_id}/{base}")
}

/// Makes and finds shifted snapshots (one per image and range).
pub struct Shifter {
    ctrd: Containerd,
    snapshotter: String,
    base: u32,
    /// Mount points of shifts in progress live below it.
    work_dir: PathBuf,
    /// One shift per chain id at a time; creates of that image wait for it.
    locks: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Shifts this process made (tests count them).
    shifts: AtomicUsize,
}

impl Shifter {
    pub fn new(ctrd: Containerd, snapshotter: &str, base: u32, state_dir: &Path) -> Self {
        Self {
            ctrd,
            snapshotter: snapshotter.to_string(),
            base,
            work_dir: state_dir.join("userns-work"),
            locks: Default::default(),
            shifts: AtomicUsize::new(0),
        }
    }

    /// How many images this process shifted.
    pub fn shifts(&self) -> usize {
        self.shifts.load(Ordering::Relaxed)
    }

    /// The parent of a sandbox's writable snapshot on image `chain_id`:
    /// its shifted snapshot, made now when missing.
    pub async fn parent_for(&self, chain_id: &str) -> Result<String> {
        let key = shifted_key(chain_id, self.base);
        let lock = self
            .locks
            .lock()
            .entry(chain_id.to_string())
            .or_default()
            .clone();
        let _held = lock.lock().await;
        if self.exists(&key).await? {
            return Ok(key);
        }
        let scratch = format!("{SCRATCH_PREFIX}{chain_id}/{}", self.base);
        // A scratch left by an interrupted shift (agent killed mid-way).
        self.ctrd
            .remove_snapshot(&self.snapshotter, &scratch)
            .await
            .map_err(AgentError::containerd("snapshots.Remove"))?;
        let result = self.shift(chain_id, &scratch, &key).await;
        if result.is_err() {
            let _ = self.ctrd.remove_snapshot(&self.snapshotter, &scratch).await;
        }
        result.map(|()| key)
    }

    async fn exists(&self, key: &str) -> Result<bool> {
        self.ctrd
            .stat_snapshot(&self.snapshotter, key)
            .await
            .map(|info| info.is_some())
            .map_err(AgentError::containerd("snapshots.Stat"))
    }

    async fn shift(&self, chain_id: &str, scratch: &str, key: &str) -> Result<()> {
        let started = std::time::Instant::now();
        let gc_root = HashMap::from([(
            labels::GC_ROOT.to_string(),
            crate::sandbox::now_ms().to_string(),
        )]);
        let mounts = self
            .ctrd
            .prepare_snapshot(&self.snapshotter, scratch, chain_id, gc_root.clone())
            .await
            .map_err(AgentError::containerd("snapshots.Prepare"))?;
        let dir = self.work_dir.join(uuid::Uuid::new_v4().to_string());
        let base = self.base;
        let shifted = tokio::task::spawn_blocking(move || shift_mounted(&mounts, &dir, base))
            .await
            .map_err(|e| AgentError::InvalidArgument(format!("shift task: {e}")))?
            .map_err(|e| AgentError::Volume(format!("shifting image {chain_id}: {e}")))?;
        let mut labels = gc_root;
        labels.insert(SHIFTED_CHAIN_LABEL.to_string(), chain_id.to_string());
        self.ctrd
            .snapshots()
            .commit(self.ctrd.req(CommitSnapshotRequest {
                snapshotter: self.snapshotter.clone(),
                name: key.to_string(),
                key: scratch.to_string(),
                labels,
            }))
            .await
            .map_err(AgentError::containerd("snapshots.Commit"))?;
        self.shifts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            chain_id,
            snapshot = key,
            entries = shifted,
            took_ms = started.elapsed().as_millis() as u64,
            "image shifted for user namespaces"
        );
        Ok(())
    }
}

/// Mounts `mounts` at `dir`, shifts every entry, unmounts (also on error).
fn shift_mounted(mounts: &[Mount], dir: &Path, base: u32) -> std::io::Result<usize> {
    std::fs::create_dir_all(dir)?;
    mount_all(mounts, dir)?;
    let shifted = shift_tree(dir, base);
    let unmounted = nix::mount::umount2(dir, MntFlags::MNT_DETACH).map_err(std::io::Error::from);
    let _ = std::fs::remove_dir(dir);
    let shifted = shifted?;
    unmounted?;
    Ok(shifted)
}

/// Mounts containerd's rootfs mounts (one overlay or bind) at `target`.
fn mount_all(mounts: &[Mount], target: &Path) -> std::io::Result<()> {
    let [m] = mounts else {
        return Err(std::io::Error::other(format!(
            "expected one rootfs mount, got {}",
            mounts.len()
        )));
    };
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for o in &m.options {
        match o.as_str() {
            "bind" => flags |= MsFlags::MS_BIND,
            "rbind" => flags |= MsFlags::MS_BIND | MsFlags::MS_REC,
            "ro" => flags |= MsFlags::MS_RDONLY,
            "rw" => {}
            other => data.push(other),
        }
    }
    let data = data.join(",");
    nix::mount::mount(
        Some(m.source.as_str()),
        target,
        Some(m.r#type.as_str()),
        flags,
        (!data.is_empty()).then_some(data.as_str()),
    )
    .map_err(std::io::Error::from)
}

/// Chowns every entry below (and including) `root` by `+base`, once per
/// inode; returns how many it changed.
pub fn shift_tree(root: &Path, base: u32) -> std::io::Result<usize> {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    let mut count = 0;
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        }
        // Hard links: where names share the inode (overlay with index=on,
        // a plain directory) the first name shifted it already; where each
        // name was copied up on its own (containerd's index=off), the next
        // name still shows the old owner and is shifted too.
        let in_range = (base..base + SIZE).contains(&meta.uid());
        if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) && in_range
        {
            continue;
        }
        shift_entry(&path, &meta, base)?;
        count += 1;
    }
    Ok(count)
}

fn shift_entry(path: &Path, meta: &std::fs::Metadata, base: u32) -> std::io::Result<()> {
    const CAPS: &str = "security.capability";
    let caps = if meta.is_file() {
        xattr::get(path, CAPS).ok().flatten()
    } else {
        None
    };
    std::os::unix::fs::lchown(
        path,
        Some(shift_id(meta.uid(), base)),
        Some(shift_id(meta.gid(), base)),
    )?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    // chown clears set-id bits (and file capabilities): put them back.
    if meta.mode() & 0o6000 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    }
    if let Some(caps) = caps.and_then(|c| caps_for_range(&c, base)) {
        xattr::set(path, CAPS, &caps)?;
    }
    Ok(())
}

/// A file capability xattr (v2 or v3) rewritten as v3 owned by the range's
/// root, which the kernel honours only inside the sandboxes' namespace.
fn caps_for_range(caps: &[u8], base: u32) -> Option<Vec<u8>> {
    const REVISION_MASK: u32 = 0xFF00_0000;
    const REVISION_2: u32 = 0x0200_0000;
    const REVISION_3: u32 = 0x0300_0000;
    let magic = u32::from_le_bytes(caps.get(..4)?.try_into().ok()?);
    if !matches!(magic & REVISION_MASK, REVISION_2 | REVISION_3) || caps.len() < 20 {
        return None;
    }
    let mut out = ((magic & !REVISION_MASK) | REVISION_3)
        .to_le_bytes()
        .to_vec();
    out.extend_from_slice(&caps[4..20]);
    out.extend_from_slice(&base.to_le_bytes());
    Some(out)
}

/// The xattr on a named volume's directory that says its data was moved
/// into the range starting at its value.
const VOLUME_MARK: &str = "trusted.sandbolt.userns-base";

/// Makes the directory `fd` holds (`O_PATH` is fine; a named volume's
/// directory a sandbox writes) usable by the range's root.
///
/// `exclusive` (no sandbox mounts the volume now, so nothing inside one can
/// swap a directory for a symlink during the walk): the first time, every
/// entry whose owner is outside the range is moved into it (ids below
/// 65536 by `+base`, others to nobody) — data written before user
/// namespaces were on, or from the host — and the directory is marked so
/// that later mounts skip the walk. Otherwise only the directory itself.
pub fn own_fd_for_range(
    fd: &std::os::fd::OwnedFd,
    base: u32,
    exclusive: bool,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // The held directory itself, whatever its path is now.
    let dir = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    let mark = base.to_string();
    // The descriptor's magic link is followed for the directory itself
    // (never for the entries below it).
    if xattr::get_deref(&dir, VOLUME_MARK)?.as_deref() == Some(mark.as_bytes()) {
        return Ok(());
    }
    into_range(&dir, &std::fs::metadata(&dir)?, base, true)?;
    if !exclusive {
        return Ok(());
    }
    let mut stack = vec![dir.clone()];
    while let Some(path) = stack.pop() {
        for entry in std::fs::read_dir(&path)? {
            let child = entry?.path();
            let meta = std::fs::symlink_metadata(&child)?;
            if meta.is_dir() {
                stack.push(child.clone());
            }
            into_range(&child, &meta, base, false)?;
        }
    }
    xattr::set_deref(&dir, VOLUME_MARK, mark.as_bytes())
}

/// Moves one entry's owner into the range unless it is there already.
fn into_range(
    path: &Path,
    meta: &std::fs::Metadata,
    base: u32,
    follow: bool,
) -> std::io::Result<()> {
    let range = base..base + SIZE;
    let (uid, gid) = (meta.uid(), meta.gid());
    if range.contains(&uid) && range.contains(&gid) {
        return Ok(());
    }
    let new = |id: u32| {
        if range.contains(&id) {
            id
        } else {
            shift_id(id, base)
        }
    };
    if follow {
        std::os::unix::fs::chown(path, Some(new(uid)), Some(new(gid)))?;
    } else {
        std::os::unix::fs::lchown(path, Some(new(uid)), Some(new(gid)))?;
    }
    if !meta.file_type().is_symlink() && meta.mode() & 0o6000 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_adds_the_namespace_and_mapping_and_binds_sys_with_a_joined_network() {
        let input = crate::spec::SpecInput {
            hostname: "sb",
            user_command: &[],
            warm: true,
            env: &[],
            cwd: "/",
            execd_host_path: Path::new("/execd"),
            cgroups_path: "/sandbolt/sb",
            network: None,
        };
        let mut spec = crate::spec::build(&input);
        apply(&mut spec, 100_000, true);
        let v = serde_json::to_value(&spec).unwrap();
        let ns = v["linux"]["namespaces"].as_array().unwrap();
        assert!(ns.iter().any(|n| n["type"] == "user"));
        assert!(ns.iter().any(|n| n["type"] == "cgroup"));
        let map = serde_json::json!([{"containerID": 0, "hostID": 100000, "size": 65536}]);
        assert_eq!(v["linux"]["uidMappings"], map);
        assert_eq!(v["linux"]["gidMappings"], map);
        let sys = v["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == "/sys")
            .unwrap();
        assert_eq!(sys["type"], "bind");
        assert!(sys["options"].as_array().unwrap().contains(&"ro".into()));
    }

    #[test]
    fn base_below_the_range_size_is_refused() {
        assert!(validate_base(1000).is_err());
        assert!(validate_base(u32::MAX - 10).is_err());
        assert!(validate_base(DEFAULT_BASE).is_ok());
    }

    #[test]
    fn ids_shift_and_unmappable_ones_become_nobody() {
        assert_eq!(shift_id(0, 100_000), 100_000);
        assert_eq!(shift_id(65_535, 100_000), 165_535);
        assert_eq!(shift_id(70_000, 100_000), 100_000 + 65_534);
    }

    #[test]
    fn v2_capabilities_become_v3_owned_by_the_range_root() {
        // cap_net_raw+ep as v2: magic 0x02000001 (effective), permitted bit 13.
        let mut v2 = 0x0200_0001u32.to_le_bytes().to_vec();
        v2.extend_from_slice(&(1u32 << 13).to_le_bytes());
        v2.extend_from_slice(&[0; 12]);
        let v3 = caps_for_range(&v2, 100_000).unwrap();
        assert_eq!(&v3[..4], &0x0300_0001u32.to_le_bytes());
        assert_eq!(&v3[4..20], &v2[4..20]);
        assert_eq!(&v3[20..], &100_000u32.to_le_bytes());
        assert!(caps_for_range(&[1, 2], 100_000).is_none());
    }

    #[test]
    fn a_tree_shifts_once_per_inode_keeping_setid_bits() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("d")).unwrap();
        std::fs::write(root.join("d/f"), b"x").unwrap();
        std::fs::hard_link(root.join("d/f"), root.join("link")).unwrap();
        std::fs::write(root.join("suid"), b"x").unwrap();
        std::fs::set_permissions(root.join("suid"), std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::os::unix::fs::symlink("d/f", root.join("sym")).unwrap();
        shift_tree(root, 200_000).unwrap();
        for p in ["", "d", "d/f", "link", "suid", "sym"] {
            let m = std::fs::symlink_metadata(root.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (200_000, 200_000), "{p}");
        }
        let suid = std::fs::metadata(root.join("suid")).unwrap();
        assert_eq!(suid.mode() & 0o7777, 0o4755);
    }
}
