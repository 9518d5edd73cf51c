//! `kill -9` of the agent during fork and restore, 20 rounds (issue 16):
//! the agent is a real `sandbolt agent` process on a test bed's containerd
//! whose volume pool is the loop-backed btrfs image it makes in its state
//! directory (inside the bed's private directory); each round fires a
//! ForkVolume or RestoreVolume at its gRPC API, SIGKILLs it 0–30 ms later,
//! starts it again on the same state and volume root, and checks that
//! nothing half-made is left:
//! - `<root>/staging` is empty;
//! - every fork is absent or whole (every byte checked), and present when
//!   its RPC had answered;
//! - the restored volume holds the old bytes or the snapshot's, entirely,
//!   and the snapshot's when its RPC had answered;
//! - `btrfs subvolume list` shows only the data and snapshot subvolumes
//!   of volumes the agent reports (layout of `sandbolt_agent::volume_store`):
//!   no orphan.
//!
//! The seed of the kill delays is printed; `SANDBOLT_TEST_SEED` replays it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use agent_proc::AgentProc;

use sandbolt_e2e::bed::start_bed;
use sandbolt_proto::agent::v1 as agent;
use sandbolt_proto::auth::BearerToken;
use sandbolt_testbed::Testbed;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;

use crate::support::agent_proc;

const TOKEN: &str = "volumes-kill-9-token";
const ROUNDS: u32 = 20;
/// Files of each version of the source volume, and their size: enough
/// that a copy (were the agent to copy) takes a while.
const FILES: usize = 48;
const FILE_SIZE: usize = 256 << 10;

type Client = agent::agent_service_client::AgentServiceClient<
    InterceptedService<tonic::transport::Channel, BearerToken>,
>;

/// A volume's files: relative path → bytes.
type Tree = BTreeMap<String, Vec<u8>>;

/// xorshift64*: reproducible from the printed seed, no crate needed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n.div_ceil(8))
            .flat_map(|_| self.next().to_le_bytes())
            .take(n)
            .collect()
    }
}

/// Starts `agent` (again) and waits until its API answers; a client of it.
async fn start_serving(agent: &mut AgentProc, bed: &Testbed) -> Client {
    agent.start(bed);
    let endpoint = format!("http://{}", agent.listen);
    let proc = agent.proc_mut();
    let started = std::time::Instant::now();
    loop {
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        {
            let mut c = agent::agent_service_client::AgentServiceClient::with_interceptor(
                ch,
                BearerToken::new(TOKEN).unwrap(),
            );
            if c.list_volumes(agent::ListVolumesRequest {}).await.is_ok() {
                return c;
            }
        }
        assert!(
            !proc.has_exited() && started.elapsed() < Duration::from_secs(60),
            "the agent did not serve volumes within 60 s:\n{}",
            proc.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every regular file below `dir`, by relative path.
fn read_tree(dir: &Path) -> Tree {
    fn walk(base: &Path, dir: &Path, out: &mut Tree) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .flatten()
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                walk(base, &p, out);
            } else {
                let rel = p.strip_prefix(base).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = Tree::new();
    walk(dir, dir, &mut out);
    out
}

/// Replaces what `dir` holds with `tree` (on the host: this test is about
/// the store, not about sandboxes).
fn write_tree(dir: &Path, tree: &Tree) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            std::fs::remove_dir_all(e.path()).unwrap();
        } else {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    for (rel, bytes) in tree {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
    }
    let status = Command::new("sync").arg("-f").arg(dir).status().unwrap();
    assert!(status.success());
}

fn version(rng: &mut Rng, tag: &str) -> Tree {
    (0..FILES)
        .map(|i| (format!("{tag}/d{}/f{i}", i % 4), rng.bytes(FILE_SIZE)))
        .collect()
}

/// Which version a tree is, if any.
fn which(tree: &Tree, a: &Tree, b: &Tree) -> Option<&'static str> {
    if tree == a {
        Some("A")
    } else if tree == b {
        Some("B")
    } else {
        None
    }
}

/// What one round fired and what it got back.
#[derive(Debug)]
enum Op {
    Fork {
        name: String,
        snapshot: String,
        answered: bool,
    },
    Restore {
        to: &'static str,
        answered: bool,
    },
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_fork_and_restore_never_leaves_half_a_volume() {
    let seed = std::env::var("SANDBOLT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("SANDBOLT_TEST_SEED={seed}");
    let mut rng = Rng(seed);
    let bed = start_bed().await;
    let root = bed.root().join("agent-k9-volumes");
    let mut agent = AgentProc::new(
        "agent-k9",
        "node-k9",
        TOKEN,
        bed.root().join("agent-k9-state"),
    )
    .args(["--network", "none", "--volume-root"])
    .args([&root])
    .args(["--volume-backend", "auto", "--volume-pool-size", "4Gi"]);
    let mut c = start_serving(&mut agent, &bed).await;

    let src = c
        .create_volume(agent::CreateVolumeRequest {
            spec: Some(agent::VolumeSpec {
                name: "src".into(),
                access_mode: agent::AccessMode::ReadWriteOnce as i32,
                size_bytes: 1 << 30,
                backend: String::new(),
            }),
        })
        .await
        .expect("create src")
        .into_inner();
    let caps = src.capabilities.clone().unwrap_or_default();
    assert_eq!(caps.backend, "btrfs", "a loop-backed btrfs pool: {src:?}");
    let data = root.join("volumes/src/data");
    let (a, b) = (version(&mut rng, "a"), version(&mut rng, "b"));
    write_tree(&data, &a);
    snapshot(&mut c, "sa").await;
    write_tree(&data, &b);
    snapshot(&mut c, "sb").await;

    let mut state = "B";
    let mut interrupted = 0;
    for round in 0..ROUNDS {
        let delay = Duration::from_micros(rng.next() % 30_001);
        let op = if round % 2 == 0 {
            let snapshot = if round % 4 == 0 { "" } else { "sa" };
            let name = format!("fork-{round}");
            let req = agent::ForkVolumeRequest {
                source: "src".into(),
                snapshot: snapshot.into(),
                spec: Some(agent::VolumeSpec {
                    name: name.clone(),
                    ..Default::default()
                }),
            };
            let mut cc = c.clone();
            let call = tokio::spawn(async move { cc.fork_volume(req).await });
            tokio::time::sleep(delay).await;
            agent.kill9();
            let answered = call.await.unwrap().is_ok();
            Op::Fork {
                name,
                snapshot: snapshot.into(),
                answered,
            }
        } else {
            let to = if state == "A" { "B" } else { "A" };
            let req = agent::RestoreVolumeRequest {
                volume: "src".into(),
                snapshot: if to == "A" { "sa" } else { "sb" }.into(),
            };
            let mut cc = c.clone();
            let call = tokio::spawn(async move { cc.restore_volume(req).await });
            tokio::time::sleep(delay).await;
            agent.kill9();
            let answered = call.await.unwrap().is_ok();
            Op::Restore { to, answered }
        };
        // What the kill left for the restart to clean up (the recovery
        // path is exercised when this is not empty).
        let left = entries(&root.join("staging"));
        eprintln!("round {round}: killed after {delay:?}: {op:?}; staging left: {left:?}");
        if !left.is_empty() {
            interrupted += 1;
        }
        c = start_serving(&mut agent, &bed).await;

        let staging = entries(&root.join("staging"));
        assert!(
            staging.is_empty(),
            "round {round}: staging not emptied at start: {staging:?}"
        );
        let now = which(&read_tree(&data), &a, &b)
            .unwrap_or_else(|| panic!("round {round}: src is neither A nor B entirely"));
        match &op {
            Op::Restore { to, answered } => {
                assert!(
                    !answered || now == *to,
                    "round {round}: restore to {to} answered, src is {now}"
                );
            }
            Op::Fork {
                name,
                snapshot,
                answered,
            } => {
                let dir = root.join("volumes").join(name);
                let got = c.get_volume(agent::VolumeRef { name: name.clone() }).await;
                if dir.exists() {
                    let info = got
                        .unwrap_or_else(|e| {
                            panic!("round {round}: {name} is on disk, the agent says {e:?}")
                        })
                        .into_inner();
                    assert_eq!(
                        info.forked_from,
                        if snapshot.is_empty() {
                            "src".to_string()
                        } else {
                            format!("src@{snapshot}")
                        }
                    );
                    let want = if snapshot.is_empty() {
                        if state == "A" { &a } else { &b }
                    } else {
                        &a
                    };
                    assert!(
                        read_tree(&dir.join("data")) == *want,
                        "round {round}: fork {name} is not whole"
                    );
                } else {
                    assert!(
                        !answered,
                        "round {round}: fork {name} answered, then vanished"
                    );
                    assert_eq!(
                        got.map(|_| ()).unwrap_err().code(),
                        Code::NotFound,
                        "round {round}: {name}"
                    );
                }
            }
        }
        state = now;
        assert_no_orphans(&mut c, &root, round).await;
    }
    eprintln!("{interrupted} of {ROUNDS} kills left work in staging");
    agent.stop();
    // The agent leaves its pool mounted (a restart finds it so); the bed's
    // teardown unmounts it and detaches its loop device.
    let dir = bed.root().display().to_string();
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
    let left = sandbolt_testbed::leftovers();
    assert!(
        !left.iter().any(|l| l.contains(&dir)),
        "the bed left: {left:?}"
    );
}

/// A host command that must succeed; its stdout.
fn host(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The names in `dir` (none when it does not exist).
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

async fn snapshot(c: &mut Client, name: &str) {
    c.create_volume_snapshot(agent::CreateVolumeSnapshotRequest {
        volume: "src".into(),
        name: name.into(),
    })
    .await
    .unwrap_or_else(|e| panic!("snapshot {name}: {e:?}"));
}

/// Every subvolume of the pool is the data or a snapshot of a volume the
/// agent lists, every volume it lists has its data subvolume, and the
/// volume directories are exactly the volumes it lists.
async fn assert_no_orphans(c: &mut Client, root: &Path, round: u32) {
    let listed = c
        .list_volumes(agent::ListVolumesRequest {})
        .await
        .expect("list volumes")
        .into_inner()
        .volumes;
    let mut expected = BTreeSet::new();
    let mut names = BTreeSet::new();
    for v in &listed {
        let name = v.spec.as_ref().unwrap().name.clone();
        expected.insert(format!("volumes/{name}/data"));
        for s in &v.snapshots {
            expected.insert(format!("volumes/{name}/snapshots/{}", s.name));
        }
        names.insert(name);
    }
    let out = Command::new("btrfs")
        .args(["subvolume", "list"])
        .arg(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let found: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.split(" path ").nth(1))
        .map(|p| {
            // Paths are relative to the filesystem's top level; the pool
            // may live in a subvolume of it.
            p.find("volumes/")
                .or_else(|| p.find("staging/"))
                .map_or(p, |i| &p[i..])
                .trim()
        })
        // A snapshot may be its read-only subvolume or a directory around
        // it (`snapshots/<s>/data`): either is the snapshot.
        .map(|p| match p.strip_suffix("/data") {
            Some(dir) if dir.contains("/snapshots/") => dir.to_string(),
            _ => p.to_string(),
        })
        .collect();
    assert_eq!(
        found, expected,
        "round {round}: subvolumes vs what the agent lists:\n{text}"
    );
    // Quota groups: one per subvolume, live or deleted and not yet cleaned
    // up (`subvolume list -d`; the kernel drops a deleted subvolume's
    // qgroup when its cleaner is done, which can take a commit interval),
    // and the top level.
    let deleted = host(
        Command::new("btrfs")
            .args(["subvolume", "list", "-d"])
            .arg(root),
    );
    let ids: BTreeSet<String> = text
        .lines()
        .chain(deleted.lines())
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|id| format!("0/{id}"))
        .chain(["0/5".to_string()])
        .collect();
    let qgroups = host(
        Command::new("btrfs")
            .args(["qgroup", "show", "--raw"])
            .arg(root),
    );
    let stale: Vec<&str> = qgroups
        .lines()
        .filter(|l| l.starts_with("0/"))
        .filter(|l| !ids.contains(l.split_whitespace().next().unwrap_or_default()))
        .collect();
    assert!(
        stale.is_empty(),
        "round {round}: qgroups of no subvolume: {stale:?}\n{qgroups}"
    );
    let dirs: BTreeSet<String> = std::fs::read_dir(root.join("volumes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        dirs, names,
        "round {round}: volume directories vs listed volumes"
    );
}
