//! Limits on growth, on the test bed's real containerd/runc: sandbox logs
//! are capped and rotated, a sandbox over its ephemeral-storage limit is
//! stopped with the reason, and sandboxes' cgroups sit under the
//! configured parent.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use sandbolt_proto::agent::v1::{ReadSandboxLogRequest, Resources, SandboxPhase};

const MIB: u64 = 1 << 20;

/// Bytes of `log` and its rotated file on disk now.
fn log_bytes(log: &Path) -> (u64, u64) {
    let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    (len(log), len(&rotated(log)))
}

fn rotated(log: &Path) -> PathBuf {
    sandbolt_agent::log_rotation::rotated_path(log)
}

/// 50 MiB to stdout in 1 MiB chunks ("chunk-<i>" lines), then a last line.
const WRITE_50_MIB: &str = "i=0; while [ $i -lt 50 ]; do yes chunk-$i | head -c 1048576; \
     i=$((i+1)); sleep 0.02; done; echo; echo final-line; exec sleep 1000";

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_writing_50_mib_leaves_at_most_twice_the_cap_and_its_newest_lines() {
    let cap = 4 * MIB;
    let interval = Duration::from_millis(100);
    let mut env = Env::start_with(|c| {
        c.log_max_bytes = cap;
        c.log_check_interval = interval;
    })
    .await;
    let id = "growth-logs";
    env.create(sh_spec(id, WRITE_50_MIB)).await.expect("create");
    let log = env.log_path(id);
    // Sampled while the sandbox writes: what the node's disk holds at once.
    let mut most = 0;
    let tail = eventually_async("the last line in the sandbox log", WAIT, || {
        let (cur, old) = log_bytes(&log);
        most = most.max(cur + old);
        let mut client = env.client.clone();
        async move {
            let got = client
                .read_sandbox_log(ReadSandboxLogRequest {
                    sandbox_id: id.into(),
                    tail_lines: 3,
                    max_bytes: 0,
                })
                .await
                .expect("ReadSandboxLog")
                .into_inner();
            got.content.contains("final-line").then_some(got)
        }
    })
    .await;
    // The newest lines come: the last chunk, then the last line.
    assert!(tail.content.contains("chunk-49"), "{:?}", tail.content);
    assert!(tail.content.ends_with("final-line\n"), "{:?}", tail.content);
    assert!(tail.truncated);
    let (cur, old) = log_bytes(&log);
    // Stated bound: two files of at most `cap`, plus what the sandbox
    // writes in one check interval (at most a few chunks at this pace;
    // 4 MiB allowed). Without rotation the log holds all 50 MiB.
    let bound = 2 * cap + 4 * MIB;
    assert!(old > 0, "the log was rotated at least once");
    assert!(old <= cap, "the rotated file holds at most the cap: {old}");
    assert!(
        cur + old <= bound,
        "{cur} + {old} bytes on disk, bound {bound}"
    );
    assert!(
        most <= bound,
        "at most {most} bytes seen on disk, bound {bound}"
    );
    assert!(tail.size_bytes <= bound, "{}", tail.size_bytes);

    env.delete_leaving_nothing(id, 0).await;
    assert!(
        !rotated(&log).exists(),
        "delete removes the rotated log too"
    );
    env.shutdown().await;
}

fn limited(id: &str, script: &str, limit: &str) -> sandbolt_proto::agent::v1::SandboxSpec {
    let mut s = sh_spec(id, script);
    s.resources = Some(Resources {
        ephemeral_storage: limit.into(),
        ..Default::default()
    });
    s
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_over_its_ephemeral_storage_limit_is_stopped_with_the_reason() {
    let mut env = Env::start_with(|c| c.log_check_interval = Duration::from_millis(200)).await;
    // Under its limit: 5 MiB of 20 MiB.
    let under = "growth-under";
    env.create(limited(
        under,
        "dd if=/dev/zero of=/tmp/fill bs=1048576 count=5 && sync && echo written; exec sleep 1000",
        "20Mi",
    ))
    .await
    .expect("create under");
    let under_log = env.log_path(under);
    eventually("the sandbox under its limit wrote its file", WAIT, || {
        std::fs::read_to_string(&under_log)
            .ok()
            .filter(|l| l.contains("written"))
    })
    .await;

    // Over its limit: 50 MiB of 20 MiB.
    let over = "growth-over";
    env.create(limited(
        over,
        "dd if=/dev/zero of=/tmp/fill bs=1048576 count=50; sync; exec sleep 1000",
        "20Mi",
    ))
    .await
    .expect("create over");
    let stopped = wait_for_phase(&env.client, over, SandboxPhase::Failed).await;
    assert!(
        stopped.message.starts_with("ephemeral storage ")
            && stopped.message.contains("over its 20Mi limit"),
        "{:?}",
        stopped.message
    );
    // Several checks later the one under its limit still runs.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let still = get(&mut env.client, under).await.unwrap();
    assert_eq!(still.phase(), SandboxPhase::Running, "{still:?}");

    // A restarted agent still says why (the reason is in a label).
    env.restart_agent(|c| c.log_check_interval = Duration::from_millis(200))
        .await;
    let recovered = get(&mut env.client, over).await.unwrap();
    assert_eq!(recovered.phase(), SandboxPhase::Failed, "{recovered:?}");
    assert_eq!(recovered.message, stopped.message);

    // A limit that is no quantity is refused by name.
    let bad = env
        .create(limited("growth-bad", "exec sleep 1000", "lots"))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(
        bad.message().contains("resources.ephemeral_storage"),
        "{bad:?}"
    );

    env.delete_leaving_nothing(over, 0).await;
    env.delete_leaving_nothing(under, 0).await;
    env.shutdown().await;
}

/// The sandbox's cgroup in controller `ctl` as `/proc/<pid>/cgroup` says.
fn cgroup_of(pid: u32, ctl: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    text.lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctls, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctls.split(',').any(|c| c == ctl).then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("no {ctl} line in {text}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cgroup_path_follows_the_cgroup_parent_flag() {
    let parent = "/sandbolt-growth-test/nested";
    let mut env = Env::start_with(|c| c.cgroup_parent = parent.into()).await;
    let id = "growth-cgroup";
    let status = env
        .create(sh_spec(id, "exec sleep 1000"))
        .await
        .expect("create")
        .status
        .unwrap();
    for ctl in ["memory", "pids"] {
        assert_eq!(
            cgroup_of(status.pid, ctl),
            format!("{parent}/{id}"),
            "{ctl}"
        );
    }
    env.delete_leaving_nothing(id, 0).await;
    for ctl in ["memory", "pids", "cpu", "freezer"] {
        let dir = Path::new("/sys/fs/cgroup").join(ctl).join(&parent[1..]);
        assert!(!dir.join(id).exists(), "{} left", dir.join(id).display());
    }
    // runc leaves the parents it made, in every hierarchy; the test
    // removes its own.
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        let dir = hierarchy.path().join(&parent[1..]);
        let _ = std::fs::remove_dir(&dir);
        let _ = std::fs::remove_dir(dir.parent().unwrap());
    }
    env.shutdown().await;

    // A parent runc would misread, or that climbs, stops the agent.
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    for bad in ["sandbolt", "/a/../b", "/a//b"] {
        let mut cfg = config(&bed, state.path(), "agent-test");
        cfg.cgroup_parent = bad.into();
        let e = sandbolt_agent::Agent::start(cfg).await.err().expect(bad);
        assert!(e.to_string().contains("--cgroup-parent"), "{e}");
    }
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
