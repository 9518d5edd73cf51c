//! What a named volume's snapshot and fork cost on the btrfs backend,
//! against copying the same data in the same run (issue 16):
//!
//! - `VolumeStore::snapshot` (a read-only snapshot made in place)
//! - `VolumeStore::fork` (writable snapshot as a new volume, with meta)
//! - `VolumeStore::restore` (writable snapshot + RENAME_EXCHANGE)
//! - `cp -a --reflink=never` of the volume's data (a full copy)
//! - `cp -a` (coreutils 9 reflinks by default where it can: here, the same
//!   as the next one)
//! - `cp -a --reflink=always` (shared extents, but per file and per extent)
//!
//! at 1 MiB, 100 MiB and 1 GiB of data in one file, and 100 MiB in 25,600
//! files of 4 KiB (where per-file copying shows). One round times each
//! operation once, in an order that rotates per round; before each timed
//! operation everything is committed (`btrfs filesystem sync`) and deleted
//! subvolumes are cleaned (`btrfs subvolume sync`), and the copies,
//! snapshots and forks are removed after it, untimed.
//!
//! `cargo bench -p sandbolt-agent --bench volumes [-- ROUNDS]` (default 10
//! rounds; a 4 GiB sparse loop image in /tmp). Run without `--bench` (as
//! `cargo test --benches` does) it is a quick smoke run: 1 MiB and 16 MiB,
//! 2 rounds.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use sandbolt_agent::volume_store::{
    BackendChoice, NewVolume, VolumeStore, VolumeStoreConfig, unmount_root,
};

const MIB: u64 = 1 << 20;
const OPS: [&str; 6] = [
    "snapshot",
    "fork",
    "restore",
    "cp -a --reflink=never",
    "cp -a",
    "cp -a --reflink=always",
];

/// A data set: a volume holding `files` files of `bytes / files` each.
struct DataSet {
    label: &'static str,
    volume: &'static str,
    bytes: u64,
    files: u64,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn sh(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn fs_sync(root: &Path) {
    sh(Command::new("btrfs").args(["filesystem", "sync"]).arg(root));
}

/// Fills the volume's data with `set.files` files of distinct blocks.
fn fill(dir: &Path, set: &DataSet) {
    let per_file = set.bytes / set.files;
    let mut buf = vec![0u8; per_file.min(MIB) as usize];
    let mut block = 0u64;
    for f in 0..set.files {
        let sub = dir.join(format!("d{}", f / 1000));
        std::fs::create_dir_all(&sub).unwrap();
        let mut file = std::fs::File::create(sub.join(format!("f{f}"))).unwrap();
        let mut left = per_file;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            for chunk in buf[..n].chunks_mut(4096) {
                chunk[..8].copy_from_slice(&block.to_le_bytes());
                block += 1;
            }
            file.write_all(&buf[..n]).unwrap();
            left -= n as u64;
        }
    }
}

/// Waits for the store's cleanups (the old data of a restore), commits,
/// and waits until the kernel has cleaned deleted subvolumes.
fn settle(store: &VolumeStore) {
    store.wait_for_cleanups();
    fs_sync(store.root());
    sh(Command::new("btrfs")
        .args(["subvolume", "sync"])
        .arg(store.root()));
}

/// Times one operation of round `round` on `set`, in ms.
fn timed(store: &VolumeStore, copies: &Path, set: &DataSet, op: &str, round: usize) -> f64 {
    let data = store.data_dir(set.volume).unwrap();
    let dest = copies.join(format!("{}-{round}", set.volume));
    let fork = NewVolume {
        name: format!("{}-fork-{round}", set.volume),
        ..Default::default()
    };
    settle(store);
    let t = Instant::now();
    match op {
        "snapshot" => drop(store.snapshot(set.volume, &format!("s{round}")).unwrap()),
        "fork" => drop(store.fork(set.volume, None, &fork).unwrap()),
        "restore" => drop(store.restore(set.volume, "base").unwrap()),
        cp => {
            let args: Vec<&str> = cp.split(' ').skip(1).collect();
            sh(Command::new("cp").args(args).arg(&data).arg(&dest));
        }
    }
    let ms = t.elapsed().as_secs_f64() * 1e3;
    // Clean up, untimed.
    match op {
        "snapshot" => drop(store.delete_snapshot(set.volume, &format!("s{round}"))),
        "fork" => drop(store.delete(&fork.name).unwrap()),
        "restore" => {}
        _ => std::fs::remove_dir_all(&dest).unwrap(),
    }
    ms
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(if full { 10 } else { 2 });
    let sets: Vec<DataSet> = if full {
        vec![
            DataSet {
                label: "1 MiB, 1 file",
                volume: "one-mib",
                bytes: MIB,
                files: 1,
            },
            DataSet {
                label: "100 MiB, 1 file",
                volume: "hundred-mib",
                bytes: 100 * MIB,
                files: 1,
            },
            DataSet {
                label: "1 GiB, 1 file",
                volume: "one-gib",
                bytes: 1024 * MIB,
                files: 1,
            },
            DataSet {
                label: "100 MiB, 25,600 files",
                volume: "many-files",
                bytes: 100 * MIB,
                files: 25_600,
            },
        ]
    } else {
        vec![
            DataSet {
                label: "1 MiB, 1 file",
                volume: "one-mib",
                bytes: MIB,
                files: 1,
            },
            DataSet {
                label: "16 MiB, 1 file",
                volume: "sixteen-mib",
                bytes: 16 * MIB,
                files: 1,
            },
        ]
    };

    let dir = tempfile::Builder::new()
        .prefix(sandbolt_testbed::TESTBED_DIR_PREFIX)
        .tempdir_in("/tmp")
        .unwrap();
    // Test beds sweep directories like this one whose owner is gone.
    std::fs::write(dir.path().join("owner.pid"), std::process::id().to_string()).unwrap();
    let root = dir.path().join("volumes");
    let cfg = VolumeStoreConfig {
        root: root.clone(),
        backend: BackendChoice::Btrfs,
        loop_image: dir.path().join("volumes.btrfs.img"),
        loop_size_bytes: if full { 4096 * MIB } else { 512 * MIB },
    };
    let result = std::panic::catch_unwind(|| run(&cfg, &sets, rounds));
    unmount_root(&root).unwrap();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

fn run(cfg: &VolumeStoreConfig, sets: &[DataSet], rounds: usize) {
    let store = VolumeStore::open(cfg).unwrap();
    let copies = store.root().join("copies");
    std::fs::create_dir(&copies).unwrap();
    for set in sets {
        store
            .create(&NewVolume {
                name: set.volume.into(),
                ..Default::default()
            })
            .unwrap();
        fill(&store.data_dir(set.volume).unwrap(), set);
        store.snapshot(set.volume, "base").unwrap();
    }
    println!(
        "{rounds} rounds; btrfs on a loop image; p50 / p90 ms\n\n| data | {} |\n|---|{}",
        OPS.join(" | "),
        "---:|".repeat(OPS.len())
    );
    for set in sets {
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); OPS.len()];
        for round in 0..rounds {
            for k in 0..OPS.len() {
                let i = (k + round) % OPS.len();
                samples[i].push(timed(&store, &copies, set, OPS[i], round));
            }
        }
        let cells: Vec<String> = samples
            .iter_mut()
            .map(|xs| {
                xs.sort_by(f64::total_cmp);
                format!("{:.1} / {:.1}", pct(xs, 0.5), pct(xs, 0.9))
            })
            .collect();
        println!("| {} | {} |", set.label, cells.join(" | "));
    }
}
