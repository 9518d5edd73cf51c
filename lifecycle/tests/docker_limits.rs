//! Resource limits on the Docker backend, seen from inside the sandbox (the
//! test bed's private dockerd on this host's cgroup v1): the same limits the
//! containerd path applies, and they hold.

use crate::common;

use common::{call, sh};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

/// cgroup v1 files a Docker container sees at `/sys/fs/cgroup` (its own
/// subtree, bind-mounted by the engine).
const CGROUP_FILES: &[&str] = &[
    "memory/memory.limit_in_bytes",
    "memory/memory.memsw.limit_in_bytes",
    "memory/memory.soft_limit_in_bytes",
    "cpu/cpu.cfs_quota_us",
    "cpu/cpu.cfs_period_us",
    "cpu/cpu.shares",
    "pids/pids.max",
];

async fn cgroup_values(base: &str, id: &str) -> Vec<String> {
    let script = CGROUP_FILES
        .iter()
        .map(|f| format!("cat /sys/fs/cgroup/{f}"))
        .collect::<Vec<_>>()
        .join(" && ");
    let out = sh(base, id, &script).await;
    assert!(out.error.is_none(), "{out:?}");
    out.stdout.lines().map(str::to_owned).collect()
}

/// Asks for a sleeping sandbox with `extensions`; status and answer.
async fn create_with_extensions(base: &str, image: &str, extensions: Value) -> (StatusCode, Value) {
    let body = json!({
        "image": {"uri": image},
        "entrypoint": ["sleep", "infinity"],
        "resourceLimits": {},
        "extensions": extensions,
    });
    call(Method::POST, format!("{base}/v1/sandboxes"), Some(body)).await
}

async fn create(base: &str, body: Value) -> String {
    let (s, v) = call(Method::POST, format!("{base}/v1/sandboxes"), Some(body)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_inside_a_docker_sandbox() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());

    let id = create(
        &base,
        json!({
            "image": {"uri": env.image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 300,
            "resourceLimits": {"cpu": "500m", "memory": "64Mi"},
            "resourceRequests": {"cpu": "250m", "memory": "32Mi"},
        }),
    )
    .await;

    // The engine was told...
    let hc = env.inspect(&id)["HostConfig"].clone();
    assert_eq!(hc["Memory"], 64 << 20, "{hc}");
    assert_eq!(hc["MemorySwap"], 64 << 20, "{hc}");
    assert_eq!(hc["NanoCpus"], 500_000_000, "{hc}");
    assert_eq!(hc["CpuShares"], 256, "{hc}");
    assert_eq!(hc["MemoryReservation"], 32 << 20, "{hc}");
    assert_eq!(hc["PidsLimit"], 4096, "{hc}");
    // ...and the sandbox's cgroup says so: memory and memory+swap both at
    // 64 MiB (no swapping past the limit), a 50 ms per 100 ms CFS quota,
    // shares from the request, and the default pids bound (the containerd
    // agent's 4096) although the request named none.
    assert_eq!(
        cgroup_values(&base, &id).await,
        [
            (64u64 << 20).to_string(),
            (64u64 << 20).to_string(),
            (32u64 << 20).to_string(),
            "50000".into(),
            "100000".into(),
            "256".into(),
            "4096".into(),
        ]
    );

    // 200 MiB in a 64 MiB sandbox: the allocating process is OOM-killed...
    let out = sh(&base, &id, "dd if=/dev/zero of=/dev/null bs=200M count=1").await;
    let err = out.error.expect("dd of 200 MiB must not succeed");
    assert!(err.contains("signal 9"), "{err}");
    // ...by the sandbox's own OOM killer, while execd (PID 1) lives on and
    // the sandbox stays Running.
    let out = sh(
        &base,
        &id,
        "echo alive; grep oom_kill /sys/fs/cgroup/memory/memory.oom_control",
    )
    .await;
    assert!(out.error.is_none(), "{out:?}");
    let mut lines = out.stdout.lines();
    assert_eq!(lines.next(), Some("alive"));
    let kills: u64 = lines
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no oom_kill counter: {}", out.stdout));
    assert!(kills >= 1, "{}", out.stdout);
    let (s, v) = call(Method::GET, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"]["state"], "Running", "{v}");

    // Two CPU burners together get at most about the quota: half a CPU
    // over 2 s of wall time (a margin for the timers). Unlimited, they would
    // take both of this host's CPUs, or what the other tests leave of them.
    let out = sh(
        &base,
        &id,
        "u=/sys/fs/cgroup/cpuacct/cpuacct.usage; a=$(cat $u); \
         timeout 2 sh -c 'while :; do :; done' & timeout 2 sh -c 'while :; do :; done'; \
         wait; b=$(cat $u); echo $((b - a)); grep nr_throttled /sys/fs/cgroup/cpu/cpu.stat",
    )
    .await;
    let mut lines = out.stdout.lines();
    let used_ns: f64 = lines.next().unwrap().trim().parse().unwrap();
    let share = used_ns / 2e9;
    assert!(
        share < 0.62,
        "burners used {share:.2} CPU against a 0.5 quota"
    );
    let throttled: u64 = lines
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no nr_throttled: {}", out.stdout));
    // Reaching the quota means being throttled at it. (On a host so busy
    // the burners never reached it, the bound above is what holds.)
    if share > 0.45 {
        assert!(
            throttled > 0,
            "at the quota but never throttled: {}",
            out.stdout
        );
    }

    // A process limit the request names replaces the default.
    let capped = create(
        &base,
        json!({
            "image": {"uri": env.image},
            "entrypoint": ["sleep", "infinity"],
            "resourceLimits": {"pids": "64"},
        }),
    )
    .await;
    let out = sh(&base, &capped, "cat /sys/fs/cgroup/pids/pids.max").await;
    assert_eq!(out.stdout.trim(), "64", "{out:?}");
    let hc = env.inspect(&capped)["HostConfig"].clone();
    // No memory asked: no memory cap, and no swap setting of its own.
    assert_eq!(hc["Memory"], 0, "{hc}");
    assert_eq!(hc["NanoCpus"], 0, "{hc}");

    for id in [&id, &capped] {
        let (s, _) = call(Method::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    }
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_refuses_what_it_cannot_honour() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    for (ext, words) in [
        (json!({"poolRef": "gpu"}), "extensions.poolRef"),
        (
            json!({"failure_policy": "auto_recreate"}),
            "extensions.failurePolicy",
        ),
        (json!({"storage.id": "x"}), "extensions.storage.id"),
    ] {
        let (s, v) = create_with_extensions(&base, &env.image, ext.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{ext}: {v}");
        assert!(v["message"].as_str().unwrap().contains(words), "{ext}: {v}");
    }
    // Docker bounds a writable layer only on some storage drivers: an
    // ephemeral-storage limit is refused by name, not dropped.
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": env.image},
            "entrypoint": ["sleep", "infinity"],
            "resourceLimits": {"ephemeral-storage": "20Mi"},
        })),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("resourceLimits.ephemeral-storage"),
        "{v}"
    );
    // What it can honour is accepted: manual failure policy, either
    // consistency (the container and its labels are one write).
    let (s, v) = create_with_extensions(
        &base,
        &env.image,
        json!({"failurePolicy": "manual", "consistencyMode": "strong"}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = v["id"].as_str().unwrap();
    let (s, _) = call(Method::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    // Nothing was left behind by the refused requests.
    let (_, list) = call(Method::GET, format!("{base}/v1/sandboxes"), None).await;
    assert_eq!(list["pagination"]["totalItems"], 0, "{list}");
    h.shutdown().await.unwrap();
}
