//! The node's volume store on real btrfs: each test makes its own
//! loop-backed btrfs image in a temporary directory (through the store's
//! own setup), and unmounts it at the end, panics included (the loop
//! device goes with the mount: autoclear).

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sandbolt_agent::volume_store::{
    AccessMode, BackendChoice, NewVolume, VolumeStore, VolumeStoreConfig, VolumeStoreError,
    unmount_root,
};

const MIB: u64 = 1 << 20;

/// A loop-backed btrfs pool in a temporary directory (named like a test
/// bed's, so the test beds' leftover check sees anything it leaks).
struct Pool {
    dir: tempfile::TempDir,
    size: u64,
}

impl Pool {
    fn new(size: u64) -> Pool {
        let dir = tempfile::Builder::new()
            .prefix(sandbolt_testbed::TESTBED_DIR_PREFIX)
            .tempdir_in("/tmp")
            .unwrap();
        // Test beds starting elsewhere sweep directories like this one
        // whose owner is gone (or that have none, after a minute).
        std::fs::write(dir.path().join("owner.pid"), std::process::id().to_string()).unwrap();
        Pool { dir, size }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("volumes")
    }

    fn image(&self) -> PathBuf {
        self.dir.path().join("state/volumes.btrfs.img")
    }

    fn config(&self) -> VolumeStoreConfig {
        VolumeStoreConfig {
            root: self.root(),
            backend: BackendChoice::Btrfs,
            loop_image: self.image(),
            loop_size_bytes: self.size,
        }
    }

    fn open(&self) -> VolumeStore {
        VolumeStore::open(&self.config()).expect("volume store opens")
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Stores are dropped before their pool (declared after it).
        if let Err(e) = unmount_root(&self.root()) {
            eprintln!("unmount {:?}: {e}", self.root());
        }
    }
}

fn new_volume(name: &str) -> NewVolume {
    NewVolume {
        name: name.into(),
        ..Default::default()
    }
}

/// `mib` MiB in which no two 4 KiB blocks are alike (each starts with its
/// seed and index), so nothing could be shared by accident.
fn write_pattern(path: &Path, mib: u64, seed: u64) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut buf = vec![seed as u8; MIB as usize];
    for i in 0..mib {
        for (j, block) in buf.chunks_mut(4096).enumerate() {
            block[..8].copy_from_slice(&seed.to_le_bytes());
            block[8..16].copy_from_slice(&(i * 256 + j as u64).to_le_bytes());
        }
        f.write_all(&buf).unwrap();
    }
    f.sync_all().unwrap();
}

/// sha256sum of a file (the tool: hashing in a debug build is slow).
fn sha(path: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(path));
    out.split_whitespace().next().unwrap().to_string()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Commits the filesystem (qgroup numbers are updated at commit).
fn fs_sync(root: &Path) {
    run(Command::new("btrfs").args(["filesystem", "sync"]).arg(root));
}

/// (total, exclusive) bytes of each path, from `btrfs filesystem du`.
fn btrfs_du(paths: &[PathBuf]) -> Vec<(u64, u64)> {
    let out = run(Command::new("btrfs")
        .args(["filesystem", "du", "-s", "--raw"])
        .args(paths));
    out.lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap())
        })
        .collect()
}

/// Subvolume paths (relative to the filesystem's top, here the root).
fn subvolumes(root: &Path) -> Vec<String> {
    let out = run(Command::new("btrfs").args(["subvolume", "list"]).arg(root));
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.split(" path ").nth(1).map(str::to_string))
        .collect();
    v.sort();
    v
}

/// The store's root once the cleanups of its deletes and restores (on
/// threads) are done.
fn settle(store: &VolumeStore) -> &Path {
    store.wait_for_cleanups();
    store.root()
}

fn staging_entries(root: &Path) -> Vec<String> {
    std::fs::read_dir(root.join("staging"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn create_write_read_get_list() {
    let pool = Pool::new(512 * MIB);
    let store = pool.open();
    let caps = store.capabilities();
    assert_eq!(
        (
            caps.backend,
            caps.instant_snapshots,
            caps.instant_forks,
            caps.quota
        ),
        ("btrfs", true, true, true)
    );
    let v = store.create(&new_volume("data")).unwrap();
    assert_eq!(v.access_mode, AccessMode::ReadWriteOnce);
    assert_eq!((v.size_bytes, v.forked_from.as_deref()), (0, None));
    assert!(v.snapshots.is_empty());
    let data = store.data_dir("data").unwrap();
    std::fs::write(data.join("hello.txt"), b"hello volume").unwrap();
    assert_eq!(
        std::fs::read(store.data_dir("data").unwrap().join("hello.txt")).unwrap(),
        b"hello volume"
    );
    let rox = store
        .create(&NewVolume {
            name: "shared".into(),
            access_mode: Some(AccessMode::ReadOnlyMany),
            size_bytes: Some(64 * MIB),
        })
        .unwrap();
    assert_eq!(
        (rox.access_mode, rox.size_bytes),
        (AccessMode::ReadOnlyMany, 64 * MIB)
    );
    let names: Vec<String> = store.list().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["data", "shared"]);
    assert_eq!(store.get("data").unwrap().created_at_ms, v.created_at_ms);

    let err = store.create(&new_volume("data")).unwrap_err();
    assert!(
        matches!(err, VolumeStoreError::AlreadyExists { .. }),
        "{err}"
    );
    assert_eq!(err.to_string(), "volume \"data\" already exists");
    let err = store.get("nope").unwrap_err();
    assert_eq!(err.to_string(), "volume \"nope\" not found");
    for bad in ["../etc", "Data", "a/b", "", "-x", ".staging"] {
        let err = store.create(&new_volume(bad)).unwrap_err();
        assert!(
            matches!(err, VolumeStoreError::InvalidName { .. }),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains("invalid volume name"), "{err}");
    }
    assert!(store.get("../volumes").is_err());
    assert!(staging_entries(settle(&store)).is_empty());
}

/// open_data: sub paths are created beneath the data root, symlinks are
/// refused (never followed), ".." and absolute paths are invalid.
#[test]
fn open_data_walks_beneath_without_symlinks() {
    let pool = Pool::new(512 * MIB);
    let store = pool.open();
    store.create(&new_volume("work")).unwrap();
    let data = store.data_dir("work").unwrap();

    let fd = store.open_data("work", "").unwrap();
    let at = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert_eq!(at, data);
    let fd = store.open_data("work", "a/b/c").unwrap();
    let at = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert_eq!(at, data.join("a/b/c"));
    assert!(data.join("a/b/c").is_dir());

    // A sandbox plants symlinks: to the host's root, and to a sibling
    // directory inside the volume. Neither is followed.
    std::os::unix::fs::symlink("/", data.join("escape")).unwrap();
    std::os::unix::fs::symlink("a", data.join("inside")).unwrap();
    for sub in ["escape", "escape/etc", "inside/b", "a/b/c/../../../escape"] {
        let err = store.open_data("work", sub).unwrap_err();
        assert!(
            matches!(err, VolumeStoreError::InvalidSubPath { .. }),
            "{sub}: {err}"
        );
    }
    let err = store.open_data("work", "escape/etc").unwrap_err();
    assert!(err.to_string().contains("symlink"), "{err}");
    std::fs::write(data.join("file"), b"x").unwrap();
    let err = store.open_data("work", "file/x").unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");
    for bad in ["/etc", "a//b", "./a", "a/./b", "a/"] {
        assert!(
            matches!(
                store.open_data("work", bad),
                Err(VolumeStoreError::InvalidSubPath { .. })
            ),
            "{bad}"
        );
    }
    assert!(!Path::new("/etc/escape").exists());
    assert!(matches!(
        store.open_data("missing", ""),
        Err(VolumeStoreError::NotFound { .. })
    ));
}

#[test]
fn snapshot_mutate_restore_gives_original_bytes() {
    let pool = Pool::new(1024 * MIB);
    let store = pool.open();
    store
        .create(&NewVolume {
            name: "proj".into(),
            access_mode: None,
            size_bytes: Some(256 * MIB),
        })
        .unwrap();
    let data = store.data_dir("proj").unwrap();
    write_pattern(&data.join("blob"), 8, 1);
    std::fs::create_dir(data.join("dir")).unwrap();
    std::fs::write(data.join("dir/note"), b"original").unwrap();
    let original = sha(&data.join("blob"));

    // Apart from the volume's creation, so its time cannot pass for the
    // snapshot's (a snapshot's root directory keeps its source's times).
    std::thread::sleep(Duration::from_millis(1100));
    let before = now_ms();
    let snap = store.snapshot("proj", "before").unwrap();
    assert_eq!(
        (snap.volume.as_str(), snap.name.as_str()),
        ("proj", "before")
    );
    assert!(
        snap.created_at_ms >= before - 20 && snap.created_at_ms <= now_ms() + 20,
        "{} vs {before}",
        snap.created_at_ms
    );
    assert_eq!(store.get("proj").unwrap().snapshots, vec![snap.clone()]);
    // Mutate: overwrite, add, delete.
    write_pattern(&data.join("blob"), 8, 2);
    std::fs::write(data.join("new"), b"new").unwrap();
    std::fs::remove_dir_all(data.join("dir")).unwrap();
    assert_ne!(sha(&data.join("blob")), original);

    let v = store.restore("proj", "before").unwrap();
    assert_eq!(v.snapshots.len(), 1);
    assert_eq!(v.size_bytes, 256 * MIB, "the size survives a restore");
    let data = store.data_dir("proj").unwrap();
    assert_eq!(sha(&data.join("blob")), original);
    assert_eq!(std::fs::read(data.join("dir/note")).unwrap(), b"original");
    assert!(!data.join("new").exists());
    // Restored data is writable, and the snapshot stays as it was.
    std::fs::write(data.join("after"), b"x").unwrap();
    let v = store.restore("proj", "before").unwrap();
    assert!(!store.data_dir("proj").unwrap().join("after").exists());
    assert_eq!(v.snapshots[0].name, "before");
    // The quota is on the restored data too.
    let err = std::fs::write(data.join("big"), vec![1u8; 300 * MIB as usize]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err}");

    let err = store.snapshot("proj", "before").unwrap_err();
    assert_eq!(
        err.to_string(),
        "snapshot \"before\" of volume \"proj\" already exists"
    );
    let err = store.restore("proj", "nope").unwrap_err();
    assert_eq!(
        err.to_string(),
        "snapshot \"nope\" of volume \"proj\" not found"
    );
    assert!(matches!(
        store.snapshot("proj", "Bad_Name"),
        Err(VolumeStoreError::InvalidName {
            kind: "snapshot",
            ..
        })
    ));
    assert!(store.delete_snapshot("proj", "before").unwrap());
    assert!(!store.delete_snapshot("proj", "before").unwrap());
    assert!(store.get("proj").unwrap().snapshots.is_empty());
    assert!(staging_entries(settle(&store)).is_empty());
    assert_eq!(subvolumes(settle(&store)), ["volumes/proj/data"]);
}

/// Ten forks of a 1 GiB volume take no space until written, and each is
/// independent of the source and of the others.
#[test]
fn ten_forks_of_a_gib_share_blocks_and_are_independent() {
    let pool = Pool::new(4096 * MIB);
    let store = pool.open();
    store.create(&new_volume("base")).unwrap();
    let base = store.data_dir("base").unwrap();
    write_pattern(&base.join("blob"), 1024, 7);
    let blob_sha = sha(&base.join("blob"));
    fs_sync(store.root());
    let used_before = used_bytes_of_fs(store.root());

    let mut forks = Vec::new();
    for i in 0..10 {
        let t = Instant::now();
        let v = store
            .fork("base", None, &new_volume(&format!("fork-{i}")))
            .unwrap();
        // A loose bound (the bench measures): a copy of 1 GiB takes seconds.
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "fork took {:?}",
            t.elapsed()
        );
        assert_eq!(v.forked_from.as_deref(), Some("base"));
        forks.push(store.data_dir(&v.name).unwrap());
    }
    fs_sync(store.root());
    let grown = used_bytes_of_fs(store.root()).saturating_sub(used_before);
    assert!(
        grown < 64 * MIB,
        "10 forks grew the filesystem by {grown} bytes"
    );
    for (total, exclusive) in btrfs_du(&forks) {
        assert!(
            total >= 1024 * MIB,
            "a fork references the whole GiB: {total}"
        );
        assert!(
            exclusive < MIB,
            "an unwritten fork owns nothing: {exclusive}"
        );
    }
    for i in 0..10 {
        // The qgroup counts shared blocks in what a fork references.
        let used = store.get(&format!("fork-{i}")).unwrap().used_bytes.unwrap();
        assert!(used >= 1024 * MIB, "fork-{i} references {used}");
    }

    // Independent: write into fork 3 and into the source.
    write_pattern(&forks[3].join("blob"), 4, 99);
    std::fs::write(base.join("extra"), b"only in base").unwrap();
    fs_sync(store.root());
    assert_eq!(sha(&forks[2].join("blob")), blob_sha);
    assert_ne!(sha(&forks[3].join("blob")), blob_sha);
    assert!(!forks[5].join("extra").exists());
    assert_eq!(sha(&base.join("blob")), blob_sha);
    let du = btrfs_du(&[forks[3].clone(), forks[4].clone()]);
    assert!(
        du[0].1 >= 4 * MIB,
        "the written fork owns what it wrote: {du:?}"
    );
    assert!(du[1].1 < MIB, "the others still own nothing: {du:?}");
}

/// Bytes in use on the filesystem of `root` (statvfs).
fn used_bytes_of_fs(root: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(root).unwrap();
    (st.blocks() - st.blocks_free()) * st.fragment_size()
}

#[test]
fn deleting_a_volume_removes_its_snapshots_and_keeps_its_forks() {
    let pool = Pool::new(512 * MIB);
    let store = pool.open();
    store.create(&new_volume("origin")).unwrap();
    let data = store.data_dir("origin").unwrap();
    std::fs::write(data.join("f"), b"v1").unwrap();
    store.snapshot("origin", "s1").unwrap();
    std::fs::write(data.join("f"), b"v2").unwrap();
    let from_snap = store
        .fork(
            "origin",
            Some("s1"),
            &NewVolume {
                name: "from-snap".into(),
                access_mode: Some(AccessMode::ReadWriteMany),
                size_bytes: None,
            },
        )
        .unwrap();
    assert_eq!(from_snap.forked_from.as_deref(), Some("origin@s1"));
    assert_eq!(from_snap.access_mode, AccessMode::ReadWriteMany);
    assert!(from_snap.snapshots.is_empty(), "a fork has no snapshots");
    store
        .fork("origin", None, &new_volume("from-live"))
        .unwrap();
    let err = store
        .fork("origin", Some("nope"), &new_volume("x"))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "snapshot \"nope\" of volume \"origin\" not found"
    );
    let err = store
        .fork("origin", None, &new_volume("from-live"))
        .unwrap_err();
    assert!(matches!(err, VolumeStoreError::AlreadyExists { .. }));

    assert!(store.delete("origin").unwrap());
    assert!(!store.delete("origin").unwrap());
    assert!(matches!(
        store.get("origin"),
        Err(VolumeStoreError::NotFound { .. })
    ));
    let read = |v: &str| std::fs::read(store.data_dir(v).unwrap().join("f")).unwrap();
    assert_eq!(read("from-snap"), b"v1");
    assert_eq!(read("from-live"), b"v2");
    assert!(staging_entries(settle(&store)).is_empty());
    assert_eq!(
        subvolumes(settle(&store)),
        ["volumes/from-live/data", "volumes/from-snap/data"]
    );
    let err = store.snapshot("origin", "s2").unwrap_err();
    assert!(matches!(err, VolumeStoreError::NotFound { .. }));
}

/// A volume whose data holds a subvolume (anyone may make one: it takes no
/// privilege) can still be deleted.
#[test]
fn deleting_a_volume_with_nested_subvolumes() {
    let pool = Pool::new(512 * MIB);
    let store = pool.open();
    store.create(&new_volume("nest")).unwrap();
    let data = store.data_dir("nest").unwrap();
    std::fs::create_dir(data.join("deep")).unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(data.join("deep/sub")));
    run(Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(data.join("deep/sub/subsub")));
    std::fs::write(data.join("deep/sub/subsub/f"), b"x").unwrap();
    assert!(store.delete("nest").unwrap());
    assert_eq!(subvolumes(settle(&store)), Vec::<String>::new());
    assert!(staging_entries(settle(&store)).is_empty());
}

#[test]
fn size_is_a_qgroup_quota_writes_past_it_fail_with_edquot() {
    let pool = Pool::new(1024 * MIB);
    let store = pool.open();
    store
        .create(&NewVolume {
            name: "small".into(),
            access_mode: None,
            size_bytes: Some(16 * MIB),
        })
        .unwrap();
    let data = store.data_dir("small").unwrap();
    // Through dd, as a sandbox's process would.
    let out = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", data.join("dd").display()))
        .args(["bs=1M", "count=32"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Disk quota exceeded"), "{stderr}");
    std::fs::remove_file(data.join("dd")).unwrap();
    fs_sync(store.root());
    let mut f = std::fs::File::create(data.join("std")).unwrap();
    let err = (0..32)
        .find_map(|_| f.write_all(&vec![1u8; MIB as usize]).err())
        .expect("a write past the quota fails");
    assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err}");
    drop(f);
    fs_sync(store.root());
    let used = store.get("small").unwrap().used_bytes.unwrap();
    assert!(used > 8 * MIB && used <= 16 * MIB, "used {used}");

    // A fork keeps the source's size unless it names its own.
    let fork = store
        .fork("small", None, &new_volume("small-fork"))
        .unwrap();
    assert_eq!(fork.size_bytes, 16 * MIB);
    let big = store
        .fork(
            "small",
            None,
            &NewVolume {
                name: "bigger".into(),
                access_mode: None,
                size_bytes: Some(64 * MIB),
            },
        )
        .unwrap();
    assert_eq!(big.size_bytes, 64 * MIB);
    let bigger = store.data_dir("bigger").unwrap();
    std::fs::write(bigger.join("more"), vec![2u8; 20 * MIB as usize]).unwrap();
    let err = std::fs::write(
        store.data_dir("small-fork").unwrap().join("more"),
        vec![2u8; 20 * MIB as usize],
    )
    .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EDQUOT));
}

/// A crash leaves staging entries behind; the next open deletes them
/// (subvolumes included) and every published volume is whole.
#[test]
fn open_recovers_staging_left_by_a_crash() {
    let pool = Pool::new(512 * MIB);
    {
        let store = pool.open();
        store.create(&new_volume("keep")).unwrap();
        std::fs::write(store.data_dir("keep").unwrap().join("f"), b"kept").unwrap();
        store.snapshot("keep", "s").unwrap();
    }
    let root = pool.root();
    let btrfs = |args: &[&str], path: PathBuf| {
        run(Command::new("btrfs").args(args).arg(path));
    };
    // A create that died after making its subvolume.
    let op = root.join("staging/0001");
    std::fs::create_dir_all(op.join("volume/snapshots")).unwrap();
    std::fs::write(
        op.join("op.json"),
        br#"{"op":"create","volume":"half","started_at_ms":1}"#,
    )
    .unwrap();
    btrfs(&["subvolume", "create"], op.join("volume/data"));
    // A restore that died after its writable snapshot.
    let op = root.join("staging/0002");
    std::fs::create_dir_all(&op).unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot"])
        .arg(root.join("volumes/keep/snapshots/s"))
        .arg(op.join("data")));
    // A read-only subvolume (what a delete takes with a volume's snapshots).
    let op = root.join("staging/0003");
    std::fs::create_dir_all(op.join("snapshot")).unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(root.join("volumes/keep/data"))
        .arg(op.join("snapshot/data")));
    // A delete that died after taking the volume (no op.json at all).
    let op = root.join("staging/0004");
    std::fs::create_dir_all(op.join("volume")).unwrap();
    btrfs(&["subvolume", "create"], op.join("volume/data"));
    std::fs::write(op.join("volume/data/junk"), b"junk").unwrap();
    // A volume directory without data (what a power loss could leave if
    // the log replayed a rename but not the subvolume inside).
    std::fs::create_dir_all(root.join("volumes/nodata/snapshots")).unwrap();
    std::fs::write(
        root.join("volumes/nodata/meta.json"),
        br#"{"name":"nodata","access_mode":"ReadWriteOnce","size_bytes":0,"created_at_ms":1}"#,
    )
    .unwrap();
    assert_eq!(subvolumes(&root).len(), 6);

    let store = pool.open();
    assert!(staging_entries(settle(&store)).is_empty());
    assert_eq!(
        subvolumes(settle(&store)),
        ["volumes/keep/data", "volumes/keep/snapshots/s"]
    );
    let names: Vec<String> = store.list().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["keep"]);
    assert_eq!(
        std::fs::read(store.data_dir("keep").unwrap().join("f")).unwrap(),
        b"kept"
    );
    assert_eq!(store.get("keep").unwrap().snapshots.len(), 1);
}

/// The worker of `kill_9_during_operations_never_leaves_a_half_volume`:
/// runs operations on the store at SANDBOLT_VOLUME_CRASH_ROOT until killed.
/// (The test below runs again as this worker when the variable is set.)
fn crash_worker(root: std::ffi::OsString) -> ! {
    let round: u64 = std::env::var("SANDBOLT_VOLUME_CRASH_ROUND")
        .unwrap()
        .parse()
        .unwrap();
    let store = VolumeStore::open(&VolumeStoreConfig {
        root: root.into(),
        backend: BackendChoice::Btrfs,
        loop_image: PathBuf::new(),
        loop_size_bytes: 0,
    })
    .unwrap();
    std::fs::write(store.root().join("worker-ready"), b"").unwrap();
    for i in 0.. {
        let n = |p: &str| format!("{p}-{round}-{i}");
        store.fork("src", None, &new_volume(&n("f"))).unwrap();
        store
            .fork("src", Some("base"), &new_volume(&n("g")))
            .unwrap();
        store.snapshot(&n("f"), "s").unwrap();
        std::fs::write(store.data_dir(&n("f")).unwrap().join("scratch"), b"x").unwrap();
        store.restore(&n("f"), "s").unwrap();
        store.restore("src", "base").unwrap();
        store.delete(&n("g")).unwrap();
        if i > 0 {
            store.delete(&format!("f-{round}-{}", i - 1)).unwrap();
        }
    }
    unreachable!("the worker runs until it is killed")
}

/// kill -9 of a process in the middle of forks, snapshots, restores and
/// deletes, 20 rounds: after each, open() leaves no staging, no stray
/// subvolume, and every volume and snapshot is whole (its payload intact).
#[test]
fn kill_9_during_operations_never_leaves_a_half_volume() {
    if let Some(root) = std::env::var_os("SANDBOLT_VOLUME_CRASH_ROOT") {
        crash_worker(root);
    }
    let pool = Pool::new(1024 * MIB);
    let payload_sha;
    {
        let store = pool.open();
        store.create(&new_volume("src")).unwrap();
        write_pattern(&store.data_dir("src").unwrap().join("payload"), 8, 3);
        payload_sha = sha(&store.data_dir("src").unwrap().join("payload"));
        store.snapshot("src", "base").unwrap();
    }
    let root = pool.root();
    let mut interrupted = 0;
    for round in 0..20u64 {
        let _ = std::fs::remove_file(root.join("worker-ready"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                &sandbolt_test_support::test_name(
                    module_path!(),
                    "kill_9_during_operations_never_leaves_a_half_volume",
                ),
                "--exact",
                "--nocapture",
            ])
            .env("SANDBOLT_VOLUME_CRASH_ROOT", &root)
            .env("SANDBOLT_VOLUME_CRASH_ROUND", round.to_string())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !root.join("worker-ready").exists() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "worker never got ready"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Somewhere inside an operation: they take a few ms each.
        std::thread::sleep(Duration::from_millis(20 + (round * 37) % 200));
        child.kill().unwrap();
        child.wait().unwrap();
        if !staging_entries(&root).is_empty() {
            interrupted += 1;
        }

        let store = pool.open();
        check_whole(&store, &payload_sha);
    }
    eprintln!("{interrupted} of 20 kills landed inside an operation");
    // The kills did land inside operations (and not all between them).
    assert!(
        interrupted >= 10,
        "only {interrupted} of 20 kills interrupted an operation"
    );
    let store = pool.open();
    assert!(store.list().unwrap().len() >= 2, "the worker made volumes");
}

/// Every volume and snapshot published is whole, nothing else is left.
fn check_whole(store: &VolumeStore, payload_sha: &str) {
    let root = store.root();
    assert!(staging_entries(root).is_empty());
    let mut expected = Vec::new();
    for v in store.list().unwrap() {
        let data = store.data_dir(&v.name).unwrap();
        assert_eq!(sha(&data.join("payload")), payload_sha, "volume {}", v.name);
        expected.push(format!("volumes/{}/data", v.name));
        for s in &v.snapshots {
            let snap = root.join(format!("volumes/{}/snapshots/{}", v.name, s.name));
            assert_eq!(
                sha(&snap.join("payload")),
                payload_sha,
                "{}@{}",
                v.name,
                s.name
            );
            expected.push(format!("volumes/{}/snapshots/{}", v.name, s.name));
        }
    }
    expected.sort();
    assert_eq!(subvolumes(root), expected, "no stray subvolume");
}

#[test]
fn concurrent_forks_and_a_fork_while_writing() {
    let pool = Pool::new(1024 * MIB);
    let store = Arc::new(pool.open());
    store.create(&new_volume("busy")).unwrap();
    write_pattern(&store.data_dir("busy").unwrap().join("blob"), 16, 5);

    // Two forks at once, different names: both succeed.
    let fork = |name: &'static str| {
        let store = store.clone();
        std::thread::spawn(move || store.fork("busy", None, &new_volume(name)))
    };
    let (a, b) = (fork("twin-a"), fork("twin-b"));
    a.join().unwrap().unwrap();
    b.join().unwrap().unwrap();
    // Two forks at once, one name: exactly one wins.
    let results: Vec<_> = (0..2)
        .map(|_| fork("same"))
        .map(|h| h.join().unwrap())
        .collect();
    let won = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 1, "{results:?}");
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(VolumeStoreError::AlreadyExists { .. })))
    );

    // Forks while a writer appends records to the source: every fork
    // holds a prefix of whole records, and the writer never fails.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, path) = (stop.clone(), store.data_dir("busy").unwrap().join("log"));
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(path).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                f.write_all(format!("{n:016}\n").as_bytes()).unwrap();
                n += 1;
            }
            n
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    for i in 0..5 {
        store
            .fork("busy", None, &new_volume(&format!("live-{i}")))
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    assert!(written > 0);
    for i in 0..5 {
        let log =
            std::fs::read_to_string(store.data_dir(&format!("live-{i}")).unwrap().join("log"))
                .unwrap();
        for (n, line) in log.lines().enumerate() {
            // A fork may end in a record cut short; all before are whole.
            if line.len() == 16 {
                assert_eq!(line, format!("{n:016}"), "fork live-{i}");
            }
        }
    }
    assert!(staging_entries(settle(&store)).is_empty());
}

#[test]
fn directory_backend_copies_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let store = VolumeStore::open(&VolumeStoreConfig {
        root: dir.path().join("root"),
        backend: BackendChoice::Directory,
        loop_image: PathBuf::new(),
        loop_size_bytes: 0,
    })
    .unwrap();
    let caps = store.capabilities();
    assert_eq!(
        (
            caps.backend,
            caps.instant_snapshots,
            caps.instant_forks,
            caps.quota
        ),
        ("directory", false, false, false)
    );
    let err = store
        .create(&NewVolume {
            name: "sized".into(),
            access_mode: None,
            size_bytes: Some(MIB),
        })
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "volume \"sized\" asks for a size, but the directory backend of this node enforces no quota"
    );
    let v = store.create(&new_volume("plain")).unwrap();
    assert_eq!(v.used_bytes, None);
    let data = store.data_dir("plain").unwrap();
    std::fs::write(data.join("f"), b"one").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", data.join("link")).unwrap();
    store.snapshot("plain", "s").unwrap();
    std::fs::write(data.join("f"), b"two").unwrap();
    store.fork("plain", Some("s"), &new_volume("copy")).unwrap();
    store.restore("plain", "s").unwrap();
    let read = |v: &str| std::fs::read(store.data_dir(v).unwrap().join("f")).unwrap();
    assert_eq!(read("plain"), b"one");
    assert_eq!(read("copy"), b"one");
    // Symlinks are copied as symlinks, never followed.
    let copy = store.data_dir("copy").unwrap().join("link");
    assert!(
        std::fs::symlink_metadata(&copy)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(store.delete("plain").unwrap());
    assert_eq!(read("copy"), b"one");
    let names: Vec<String> = store.list().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["copy"]);
    assert!(staging_entries(settle(&store)).is_empty());
    drop(store);
    // Reopened with auto on a non-btrfs root holding directory volumes:
    // kept as they are, not mounted over.
    let store = VolumeStore::open(&VolumeStoreConfig {
        root: dir.path().join("root"),
        backend: BackendChoice::Auto,
        loop_image: dir.path().join("img"),
        loop_size_bytes: 512 * MIB,
    })
    .unwrap();
    assert_eq!(store.capabilities().backend, "directory");
    assert!(!dir.path().join("img").exists());
}

/// The loop image: made sparse at first open, mounted again after a
/// "restart" (unmounted), refused when unsafe, and gone with the unmount.
#[test]
fn loop_image_setup_remount_and_refusals() {
    let pool = Pool::new(512 * MIB);
    {
        let store = pool.open();
        store.create(&new_volume("persist")).unwrap();
        std::fs::write(store.data_dir("persist").unwrap().join("f"), b"still here").unwrap();
        // A second store on the same root is refused (its recovery would
        // delete the first one's work in progress).
        let err = VolumeStore::open(&pool.config()).unwrap_err();
        assert!(
            err.to_string().contains("in use by another volume store"),
            "{err}"
        );
    }
    let md = std::fs::metadata(pool.image()).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(md.len(), 512 * MIB);
    assert!(md.blocks() * 512 < 64 * MIB, "the image is sparse");
    assert!(unmount_root(&pool.root()).unwrap());
    assert!(
        loop_devices_of(&pool.image()).is_empty(),
        "autoclear frees the loop device"
    );

    // Restart: the root is an empty directory again; the image is mounted.
    let store = pool.open();
    assert_eq!(
        std::fs::read(store.data_dir("persist").unwrap().join("f")).unwrap(),
        b"still here"
    );
    drop(store);

    // The image already attached elsewhere: refused, not mounted twice.
    let elsewhere = pool.dir.path().join("elsewhere");
    let err = VolumeStore::open(&VolumeStoreConfig {
        root: elsewhere.clone(),
        ..pool.config()
    })
    .unwrap_err();
    assert!(err.to_string().contains("already attached"), "{err}");

    // Not btrfs, not empty: refused with and without a loop image.
    let full = pool.dir.path().join("full");
    std::fs::create_dir_all(full.join("something")).unwrap();
    let cfg = VolumeStoreConfig {
        root: full.clone(),
        backend: BackendChoice::Btrfs,
        loop_image: pool.dir.path().join("other.img"),
        loop_size_bytes: 0,
    };
    let err = VolumeStore::open(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("is not on btrfs") && err.contains("no loop image size"),
        "{err}"
    );
    let err = VolumeStore::open(&VolumeStoreConfig {
        loop_size_bytes: 512 * MIB,
        ..cfg.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("is not empty") && err.contains("refusing"),
        "{err}"
    );
    assert!(!pool.dir.path().join("other.img").exists());
    // Auto without a loop image on a non-btrfs root: directories.
    let store = VolumeStore::open(&VolumeStoreConfig {
        root: pool.dir.path().join("plain"),
        backend: BackendChoice::Auto,
        loop_image: PathBuf::new(),
        loop_size_bytes: 0,
    })
    .unwrap();
    assert_eq!(store.capabilities().backend, "directory");
}

fn loop_devices_of(image: &Path) -> Vec<String> {
    let image = std::fs::canonicalize(image).unwrap();
    std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file"))
                .is_ok_and(|b| Path::new(b.trim()) == image)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Facts about this kernel the store's design rests on.
#[test]
fn kernel_facts_rename_exchange_and_read_only_snapshots() {
    let pool = Pool::new(512 * MIB);
    let store = pool.open();
    let root = store.root().to_path_buf();
    let sv = |p: &str| {
        run(Command::new("btrfs")
            .args(["subvolume", "create"])
            .arg(root.join(p)));
    };
    std::fs::create_dir_all(root.join("x/a")).unwrap();
    std::fs::create_dir_all(root.join("y")).unwrap();
    sv("x/a/data");
    sv("y/data");
    std::fs::write(root.join("x/a/data/f"), b"x").unwrap();
    std::fs::write(root.join("y/data/f"), b"y").unwrap();
    // RENAME_EXCHANGE of two subvolumes in different directories.
    let rc = unsafe_renameat2(
        &root.join("x/a/data"),
        &root.join("y/data"),
        libc::RENAME_EXCHANGE,
    );
    assert_eq!(rc, Ok(()));
    assert_eq!(std::fs::read(root.join("y/data/f")).unwrap(), b"x");
    assert_eq!(std::fs::read(root.join("x/a/data/f")).unwrap(), b"y");
    // A read-only snapshot cannot move to another directory (EROFS)...
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(root.join("y/data"))
        .arg(root.join("x/ro")));
    let err = std::fs::rename(root.join("x/ro"), root.join("y/ro")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    // ...but it can be renamed within its directory, and the plain
    // directory around it can move anywhere (how snapshots are published).
    std::fs::rename(root.join("x/ro"), root.join("x/ro2")).unwrap();
    std::fs::create_dir(root.join("wrap")).unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(root.join("y/data"))
        .arg(root.join("wrap/data")));
    std::fs::rename(root.join("wrap"), root.join("x/a/wrapped")).unwrap();
    assert_eq!(
        std::fs::read(root.join("x/a/wrapped/data/f")).unwrap(),
        b"x"
    );
}

fn unsafe_renameat2(from: &Path, to: &Path, flags: u32) -> Result<(), i32> {
    use std::os::unix::ffi::OsStrExt;
    let from = std::ffi::CString::new(from.as_os_str().as_bytes()).unwrap();
    let to = std::ffi::CString::new(to.as_os_str().as_bytes()).unwrap();
    // SAFETY: two valid NUL-terminated paths.
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
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

/// `auto` on a host that cannot make a btrfs image (here: no mkfs.btrfs on
/// PATH) falls back to plain directories and says so in its capabilities;
/// `btrfs` refuses, naming what is missing. (nextest runs each test in its
/// own process, so changing PATH here touches no other test.)
#[test]
fn auto_without_btrfs_progs_uses_directories_and_btrfs_refuses() {
    // tmpfs: never btrfs, whatever /tmp is on this machine.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let empty_path = dir.path().join("bin");
    std::fs::create_dir_all(&empty_path).unwrap();
    let old_path = std::env::var_os("PATH");
    // SAFETY: this test process runs this one test (nextest), no threads yet.
    unsafe { std::env::set_var("PATH", &empty_path) };
    let config = |backend| VolumeStoreConfig {
        root: dir.path().join("root"),
        backend,
        loop_image: dir.path().join("volumes.img"),
        loop_size_bytes: 512 * MIB,
    };
    let err = VolumeStore::open(&config(BackendChoice::Btrfs)).unwrap_err();
    assert!(err.to_string().contains("mkfs.btrfs"), "{err}");
    assert!(!dir.path().join("volumes.img").exists());

    let store = VolumeStore::open(&config(BackendChoice::Auto)).unwrap();
    let caps = store.capabilities();
    assert_eq!(caps.backend, "directory");
    assert!(!caps.instant_forks && !caps.quota);
    assert!(
        !dir.path().join("volumes.img").exists(),
        "no half image left"
    );
    store.create(&new_volume("plain")).unwrap();
    drop(store);
    if let Some(p) = old_path {
        // SAFETY: as above.
        unsafe { std::env::set_var("PATH", p) };
    }
}
