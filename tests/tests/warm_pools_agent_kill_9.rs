//! Warm pools (issue 17): `kill -9` of the agent with a full buffer leaks
//! nothing. The agent is a real `sandbolt agent` process (sandbox
//! networking on: every warm sandbox has its own network namespace and
//! veth) on a test bed's containerd, heartbeating to a real controller that
//! holds a warm pool of busybox with a buffer of 4. Once the buffer is
//! full, the agent is SIGKILLed: its warm sandboxes keep running (checked),
//! with nobody owning them. The agent is started again on the same state:
//! every old warm sandbox is removed (container, task, rootfs snapshot,
//! namespace) and the buffer is rebuilt with new ones, which the controller
//! sees. Then the pool is deleted (the buffer drains), the agent stops
//! gracefully and the controller too, and nothing is left: no container,
//! no active snapshot, no namespace, veth or nftables table of the agent
//! (`sandbolt_agent::network::purge` finds nothing to remove), no mount,
//! process or directory of the bed.

use crate::support::warm;

use crate::support::agent_proc;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use agent_proc::AgentProc;

use sandbolt_e2e::bed::{CNI_BIN_DIR, connect, eventually, running_tasks, start_bed};
use sandbolt_proto::control::v1 as native;
use sandbolt_testbed::Testbed;
use warm::{FILLED_WITHIN, TOKEN, active_snapshots, drop_bed_checked};

type WarmPools = native::warm_pool_service_client::WarmPoolServiceClient<tonic::transport::Channel>;

const POOL: &str = "warm-k9";
const BUFFER: usize = 4;
/// Network namespaces the agent keeps prepared ahead of creates.
const NET_POOL: usize = 2;

/// Whatever happens to the test, the agent process goes and its network
/// state is purged from the host (a passing test purges nothing: it checks
/// that first, see [`assert_network_clean`]).
struct Cleanup {
    agent: AgentProc,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.agent.kill9();
        if let Err(e) = sandbolt_agent::network::purge(&self.agent.state, Path::new(CNI_BIN_DIR)) {
            eprintln!("purging the agent's network state: {e}");
        }
    }
}

/// Mounted network namespaces under the agent's state dir.
fn netns_mounts(state: &Path) -> Vec<String> {
    let dir = state.join("network/netns").display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&dir))
        .map(String::from)
        .collect()
}

async fn available(pools: &mut WarmPools) -> i32 {
    pools
        .get_warm_pool(native::WarmPoolRef { name: POOL.into() })
        .await
        .expect("GetWarmPool")
        .into_inner()
        .status
        .map(|s| s.available)
        .unwrap_or(0)
}

/// Waits until containerd runs exactly [`BUFFER`] containers, none of them
/// in `not`, and the controller counts [`BUFFER`] available; the set.
async fn wait_buffer(
    bed: &Testbed,
    pools: &WarmPools,
    not: &BTreeSet<String>,
    agent: &AgentProc,
) -> BTreeSet<String> {
    let what = format!("a buffer of {BUFFER} warm sandboxes, none of {not:?}");
    let mut last = BTreeSet::new();
    let started = std::time::Instant::now();
    loop {
        let running: BTreeSet<String> = running_tasks(bed).await.into_keys().collect();
        let all: BTreeSet<String> = sandbolt_e2e::bed::containers(bed)
            .await
            .into_iter()
            .collect();
        let ready = all.len() == BUFFER
            && running == all
            && all.is_disjoint(not)
            && available(&mut pools.clone()).await == BUFFER as i32;
        if ready {
            return all;
        }
        if all != last {
            eprintln!("containers now: {all:?} (running {running:?})");
            last = all;
        }
        assert!(
            started.elapsed() < FILLED_WITHIN,
            "{what}: not within {FILLED_WITHIN:?}; containers {last:?}\nagent log:\n{}",
            agent.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_kill_9_with_a_full_buffer_leaks_nothing() {
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let ctl = agent_proc::start_controller(dir.path(), TOKEN).await;
    let addr = ctl.local_addr();
    let mut guard = Cleanup {
        agent: AgentProc::new(
            "agent-warm-k9",
            "node-warm-k9",
            TOKEN,
            bed.root().join("agent-warm-k9-state"),
        )
        .controller(addr)
        .args(["--max-sandboxes", "16", "--volume-backend", "none"])
        .args(["--network", "egress", "--dns-upstream", "127.0.0.1:9"])
        .args(["--network-pool-size", &NET_POOL.to_string()])
        .args(["--cni-bin-dir", CNI_BIN_DIR]),
    };
    guard.agent.start(&bed);
    sandbolt_e2e::bed::wait_agents(&connect(addr).await, 1).await;

    let mut pools = WarmPools::connect(format!("http://{addr}"))
        .await
        .expect("WarmPoolService");
    pools
        .create_warm_pool(native::CreateWarmPoolRequest {
            pool: Some(native::WarmPool {
                name: POOL.into(),
                template: Some(native::WarmTemplate {
                    image: sandbolt_testbed::BUSYBOX_REF.into(),
                    ..Default::default()
                }),
                capacity: Some(native::WarmCapacity {
                    buffer_min: BUFFER as i32,
                    buffer_max: BUFFER as i32,
                    pool_min: 0,
                    pool_max: 10,
                }),
                ..Default::default()
            }),
        })
        .await
        .expect("CreateWarmPool");
    let first = wait_buffer(&bed, &pools, &BTreeSet::new(), &guard.agent).await;
    let ns_full = netns_mounts(&guard.agent.state);
    assert!(
        ns_full.len() >= BUFFER,
        "every warm sandbox has its own namespace: {ns_full:?}"
    );

    // The agent keeps prepared rootfs snapshots for cold creates; the
    // killed one's must go, the restarted one makes its own when it likes.
    let prepared_before: BTreeSet<String> = prepared(&active_snapshots(&bed).await);
    guard.agent.kill9();
    // The kill leaves them running, owned by nobody: this is what the
    // restart must clean up.
    let running: BTreeSet<String> = running_tasks(&bed).await.into_keys().collect();
    assert_eq!(running, first, "the warm sandboxes outlive their agent");

    guard.agent.start(&bed);
    let second = wait_buffer(&bed, &pools, &first, &guard.agent).await;
    eprintln!("buffer before the kill: {first:?}; rebuilt: {second:?}");
    // Nothing of the old ones: no active snapshot beyond the live
    // containers' own, no namespace beyond the live ones' and the prepared.
    let snaps = active_snapshots(&bed).await;
    let rootfs: Vec<&String> = snaps
        .iter()
        .filter(|s| !s.starts_with(PREPARED_PREFIX))
        .collect();
    assert_eq!(
        rootfs.len(),
        BUFFER,
        "one rootfs per live container, none of the killed agent's: {snaps:?}"
    );
    let survivors: Vec<String> = prepared(&snaps)
        .intersection(&prepared_before)
        .cloned()
        .collect();
    assert!(
        survivors.is_empty(),
        "the killed agent's prepared snapshots survived: {survivors:?}"
    );
    for id in &first {
        assert!(
            !snaps.iter().any(|s| s.starts_with(id.as_str())),
            "{id}'s snapshot survived: {snaps:?}"
        );
    }
    let ns = netns_mounts(&guard.agent.state);
    assert!(
        ns.len() <= BUFFER + NET_POOL,
        "namespaces of the killed agent's sandboxes are left: {ns:?}"
    );

    // Drain, stop, and check that nothing is left.
    pools
        .delete_warm_pool(native::WarmPoolRef { name: POOL.into() })
        .await
        .expect("DeleteWarmPool");
    eventually("the buffer drained", FILLED_WITHIN, || async {
        sandbolt_e2e::bed::containers(&bed).await.is_empty()
    })
    .await;
    guard.agent.stop();
    ctl.shutdown().await;
    let left = netns_mounts(&guard.agent.state);
    assert!(left.is_empty(), "namespaces left after the stop: {left:?}");
    let purged = sandbolt_agent::network::purge(&guard.agent.state, Path::new(CNI_BIN_DIR))
        .expect("purge after the agent stopped");
    assert_eq!(
        (purged.namespaces, purged.table.clone()),
        (0, None),
        "the stopped agent left network state: {purged:?}"
    );
    drop_bed_checked(bed).await;
}

/// Key prefix of the agent's prepared rootfs snapshots (issue 17).
const PREPARED_PREFIX: &str = sandbolt_node::labels::PREPARED_KEY_PREFIX;

/// The keys of the prepared snapshots among `ctr snapshots ls` lines.
fn prepared(lines: &[String]) -> BTreeSet<String> {
    lines
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|k| k.starts_with(PREPARED_PREFIX))
        .map(String::from)
        .collect()
}
