//! Create → running → output → delete on the test bed's real containerd/runc,
//! through the agent's gRPC API.

use crate::common;

use std::time::Duration;

use common::*;
use sandbolt_proto::agent::v1::{
    DeleteSandboxRequest, GetInventoryRequest, Resources, SandboxPhase, SandboxRef,
};

fn log_contains(env: &Env, id: &str, needle: &str) -> Option<String> {
    let text = std::fs::read_to_string(env.log_path(id)).ok()?;
    text.contains(needle).then_some(text)
}

#[tokio::test(flavor = "multi_thread")]
async fn entrypoint_output_labels_and_delete_leaves_nothing() {
    let mut env = Env::start().await;
    let mut s = sh_spec(
        "sb-output",
        "echo hello-$GREETING; echo to-stderr >&2; exec sleep 1000",
    );
    s.envs.insert("GREETING".into(), "world".into());
    s.record_uid = "uid-123".into();
    s.labels.insert("user.example/team".into(), "blue".into());
    let resp = env.create(s).await.expect("create");
    let status = resp.status.unwrap();
    assert_eq!(status.phase(), SandboxPhase::Running, "{status:?}");
    assert!(status.pid > 0);
    assert_eq!(status.image, "docker.io/library/busybox:latest");
    assert_eq!(status.proxy_path, "/sb-output");
    let t = resp.timings.unwrap();
    assert!(t.image_resolved_us > 0 && t.container_created_us >= t.image_resolved_us);
    assert!(t.task_started_us >= t.container_created_us);

    let log = eventually("entrypoint output in the log", WAIT, || {
        log_contains(&env, "sb-output", "to-stderr").filter(|l| l.contains("hello-world"))
    })
    .await;
    assert!(log.contains("hello-world\n"), "{log}");

    // Labels: the agent's identity and the user's metadata.
    let info = env.ctr(&["containers", "info", "sb-output"]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    let labels = &info["Labels"];
    assert_eq!(labels["io.sandbolt.managed"], "true");
    assert_eq!(labels["io.sandbolt.sandbox-id"], "sb-output");
    assert_eq!(labels["io.sandbolt.name"], "name-sb-output");
    assert_eq!(labels["io.sandbolt.namespace"], "tests");
    assert_eq!(labels["io.sandbolt.agent-id"], "agent-test");
    assert_eq!(labels["io.sandbolt.record-uid"], "uid-123");
    assert_eq!(labels["io.sandbolt.pool"], "default");
    assert_eq!(
        labels["io.sandbolt.image"],
        "docker.io/library/busybox:latest"
    );
    assert_eq!(labels["user.example/team"], "blue");
    assert!(
        labels["io.sandbolt.created-at"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap()
            > 0
    );
    use sha2::Digest;
    assert_eq!(
        labels["io.sandbolt.access-token-sha256"],
        hex::encode(sha2::Sha256::digest(b"token-sb-output"))
    );
    // The plaintext token reaches execd through the env only.
    let spec = &info["Spec"];
    let env_list: Vec<String> = serde_json::from_value(spec["process"]["env"].clone()).unwrap();
    assert!(env_list.contains(&"EXECD_ACCESS_TOKEN=token-sb-output".to_string()));
    assert!(!info["Labels"].to_string().contains("token-sb-output\""));
    assert_eq!(
        spec["process"]["args"][0], "/opt/sandbolt/execd",
        "execd is the sandbox's PID 1"
    );

    // Idempotent create: same id answers the existing sandbox.
    let again = env
        .client
        .create_sandbox(create_req(spec_for_again()))
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(again.pid, status.pid);

    let deleted = delete(&mut env.client, "sb-output", 500).await;
    assert!(deleted);
    assert_eq!(leftovers(&env, "sb-output"), Vec::<String>::new());
    assert!(
        !std::path::Path::new(&format!("/proc/{}", status.pid)).exists()
            || std::fs::read_to_string(format!("/proc/{}/cmdline", status.pid))
                .map(|c| !c.contains("execd"))
                .unwrap_or(true),
        "the sandbox's PID 1 is gone"
    );
    let err = env
        .client
        .get_sandbox(SandboxRef {
            sandbox_id: "sb-output".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Deleting again: nothing existed.
    let deleted = delete(&mut env.client, "sb-output", 0).await;
    assert!(!deleted);
    env.shutdown().await;
}

fn spec_for_again() -> sandbolt_proto::agent::v1::SandboxSpec {
    spec("sb-output", &["true"])
}

#[tokio::test(flavor = "multi_thread")]
async fn limits_are_visible_from_inside() {
    let mut env = Env::start().await;
    let mut s = sh_spec(
        "sb-limits",
        "echo mem=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes); \
             echo memsw=$(cat /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes); \
             echo soft=$(cat /sys/fs/cgroup/memory/memory.soft_limit_in_bytes); \
             echo shares=$(cat /sys/fs/cgroup/cpu/cpu.shares); \
             echo quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us); \
             echo period=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us); \
             echo pids=$(cat /sys/fs/cgroup/pids/pids.max); \
             echo nnp=$(grep NoNewPrivs /proc/self/status | tr -d '\\t '); \
             echo seccomp=$(grep '^Seccomp:' /proc/self/status | tr -d '\\t '); \
             echo capeff=$(grep CapEff /proc/self/status | tr -d '\\t '); \
             echo done; exec sleep 1000",
    );
    s.resources = Some(Resources {
        cpu: "500m".into(),
        memory: "64Mi".into(),
        pids_limit: 77,
        cpu_request: "250m".into(),
        memory_request: "32Mi".into(),
        ..Default::default()
    });
    env.client
        .create_sandbox(create_req(s))
        .await
        .expect("create");
    let log = eventually("limits printed", WAIT, || {
        log_contains(&env, "sb-limits", "done")
    })
    .await;
    assert!(log.contains(&format!("mem={}\n", 64 << 20)), "{log}");
    // Swap held to the memory limit (this host accounts swap per cgroup).
    assert!(log.contains(&format!("memsw={}\n", 64 << 20)), "{log}");
    // Requests: a soft limit and a CPU weight of 1024 per requested CPU.
    assert!(log.contains(&format!("soft={}\n", 32 << 20)), "{log}");
    assert!(log.contains("shares=256\n"), "{log}");
    assert!(log.contains("quota=50000\n"), "{log}");
    assert!(log.contains("period=100000\n"), "{log}");
    assert!(log.contains("pids=77\n"), "{log}");
    // Hardening seen from inside: no-new-privileges, seccomp filter mode,
    // and not the full capability set.
    assert!(log.contains("nnp=NoNewPrivs:1\n"), "{log}");
    assert!(log.contains("seccomp=Seccomp:2\n"), "{log}");
    assert!(!log.contains("capeff=CapEff:000001ffffffffff"), "{log}");
    env.delete_leaving_nothing("sb-limits", 0).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exit_codes_become_stopped_or_failed_and_pause_resume_work() {
    let mut env = Env::start().await;
    env.client
        .create_sandbox(create_req(spec("sb-ok", &["sh", "-c", "exit 0"])))
        .await
        .unwrap();
    env.client
        .create_sandbox(create_req(spec("sb-bad", &["sh", "-c", "exit 3"])))
        .await
        .unwrap();
    let mut c = env.client.clone();
    for (id, phase, code) in [
        ("sb-ok", SandboxPhase::Stopped, 0),
        ("sb-bad", SandboxPhase::Failed, 3),
    ] {
        let st = wait_for_phase(&c, id, phase).await;
        assert_eq!(st.exit_code, code, "{st:?}");
    }

    env.client
        .create_sandbox(create_req(spec("sb-pause", &["sleep", "1000"])))
        .await
        .unwrap();
    let paused = c
        .pause_sandbox(SandboxRef {
            sandbox_id: "sb-pause".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.phase(), SandboxPhase::Paused);
    let freezer = std::fs::read_to_string("/sys/fs/cgroup/freezer/sandbolt/sb-pause/freezer.state")
        .expect("freezer state");
    assert_eq!(freezer.trim(), "FROZEN");
    let resumed = c
        .resume_sandbox(SandboxRef {
            sandbox_id: "sb-pause".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resumed.phase(), SandboxPhase::Running);
    // Delete of a paused sandbox works too.
    c.pause_sandbox(SandboxRef {
        sandbox_id: "sb-pause".into(),
    })
    .await
    .unwrap();
    for id in ["sb-ok", "sb-bad", "sb-pause"] {
        let existed = delete(&mut c, id, 200).await;
        assert!(existed);
        assert_eq!(leftovers(&env, id), Vec::<String>::new());
    }
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn auth_refused_without_or_with_wrong_token() {
    let env = Env::start().await;
    let addr = env.agent().grpc_addr();
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut bare =
        sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient::new(channel);
    let err = bare
        .get_inventory(GetInventoryRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let err = bare
        .create_sandbox(create_req(spec("sb-noauth", &["true"])))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut wrong = client(addr, "not-the-token").await;
    let err = wrong
        .get_inventory(GetInventoryRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(leftovers(&env, "sb-noauth").is_empty());
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_of_a_missing_image_fails_clearly_and_unknown_runtimes_are_reported() {
    let mut env = Env::start_with(|cfg| cfg.pull_timeout = Duration::from_secs(3)).await;
    let mut s = spec("sb-pull", &["true"]);
    s.image = "registry.invalid/nobody/nothing:1".into();
    let err = env.client.create_sandbox(create_req(s)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message()
            .contains("pull of registry.invalid/nobody/nothing:1 failed"),
        "{}",
        err.message()
    );
    assert!(leftovers(&env, "sb-pull").is_empty());
    // A registry that never answers (TEST-NET-1 address): bounded by the
    // pull timeout, still a clear error naming the reference.
    let mut s = spec("sb-pull2", &["true"]);
    s.image = "192.0.2.1:5000/x:1".into();
    let err = env.client.create_sandbox(create_req(s)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("pull of 192.0.2.1:5000/x:1 failed"),
        "{}",
        err.message()
    );
    assert!(leftovers(&env, "sb-pull2").is_empty());

    // A runtime that cannot run here is an error, never swapped for runc.
    let inv = env
        .client
        .get_inventory(GetInventoryRequest {})
        .await
        .unwrap()
        .into_inner();
    let crun = inv.runtimes.iter().find(|r| r.name == "crun").unwrap();
    let runc = inv.runtimes.iter().find(|r| r.name == "runc").unwrap();
    assert!(runc.available, "{runc:?}");
    let mut s = spec("sb-crun", &["true"]);
    s.runtime = "crun".into();
    match env.client.create_sandbox(create_req(s)).await {
        Err(e) => {
            assert!(
                !crun.available,
                "crun advertised available but failed: {e:?}"
            );
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
            assert!(e.message().contains("crun"), "{}", e.message());
        }
        Ok(r) => {
            assert!(crun.available, "crun advertised unavailable but ran");
            assert_eq!(r.into_inner().status.unwrap().runtime, "crun");
            delete(&mut env.client, "sb-crun", 0).await;
        }
    }
    let mut s = spec("sb-nort", &["true"]);
    s.runtime = "kata".into();
    let e = env.client.create_sandbox(create_req(s)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(leftovers(&env, "sb-crun").is_empty());

    // Inventory: busybox by normalized reference and digest.
    let img = inv
        .images
        .iter()
        .find(|i| {
            i.references
                .contains(&"docker.io/library/busybox:latest".to_string())
        })
        .unwrap_or_else(|| panic!("busybox missing from {:?}", inv.images));
    assert!(img.digest.starts_with("sha256:") && img.size_bytes > 0);
    assert_eq!(inv.agent_id, "agent-test");
    assert!(!inv.instance_id.is_empty());
    assert_eq!(inv.namespace, "default", "the pool's namespace");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn foreign_containers_are_never_touched() {
    let mut env = Env::start().await;
    // A container someone else made in the same namespace (no sandbolt labels).
    env.ctr(&[
        "run",
        "-d",
        "docker.io/library/busybox:latest",
        "foreign",
        "sleep",
        "1000",
    ]);
    let err = env
        .client
        .create_sandbox(create_req(spec("foreign", &["true"])))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    let err = env
        .client
        .delete_sandbox(DeleteSandboxRequest {
            sandbox_id: "foreign".into(),
            grace_period_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let tasks = env.ctr(&["tasks", "list"]);
    assert!(
        tasks
            .lines()
            .any(|l| l.starts_with("foreign") && l.contains("RUNNING")),
        "the foreign container is untouched: {tasks}"
    );
    env.ctr(&["tasks", "rm", "-f", "foreign"]);
    env.ctr(&["containers", "rm", "foreign"]);
    env.shutdown().await;
}
