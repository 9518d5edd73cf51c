//! A pool's promise holds through every API: a real controller, a real
//! agent on the test bed's containerd whose pool has limit defaults and
//! maxima (its flags, reported in its heartbeat).
//!
//! - native create above a maximum: INVALID_ARGUMENT naming the field;
//! - FastPath v2 create (which cannot say limits): the pool's defaults
//!   apply, seen in the record and in the sandbox's cgroup;
//! - a runtime no agent of the pool has: INVALID_ARGUMENT naming it;
//! - GetPool / ListPools (native and v2) tell the pool's real runtime,
//!   limits and warm images.

use std::time::Duration;

use sandbolt_agent::Agent;
use sandbolt_agent::config::PoolLimits;
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_e2e::bed::{
    V2, agent_config, free_port, native_busybox_create, native_limits, native_ref, start_bed,
    wait_agents,
};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2;

const TOKEN: &str = "pool-policy-token";

fn native_create(
    name: &str,
    resources: Option<native::Resources>,
    runtime: &str,
) -> native::CreateSandboxRequest {
    let spec = native::SandboxSpec {
        resources,
        runtime: runtime.into(),
        ..Default::default()
    };
    native_busybox_create(name, spec)
}

/// Asserts the limits the sandbox runs with: `want` is (cpu, memory, pids).
fn assert_limits(s: &native::Sandbox, want: (&str, &str, i64)) {
    let got = s
        .spec
        .as_ref()
        .and_then(|spec| spec.resources.as_ref()?.limits.as_ref())
        .expect("the sandbox has limits");
    assert_eq!((got.cpu.as_str(), got.memory.as_str(), got.pids), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_defaults_and_maxima_hold_on_every_api() {
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new(free_port(), dir.path().join("controller"), TOKEN);
    cfg.heartbeat_interval = Duration::from_millis(100);
    let controller = Controller::start(cfg).await.unwrap();
    let addr = controller.local_addr();

    let mut agent_cfg = agent_config(&bed, "agent-pp", &dir.path().join("agent"), addr, TOKEN);
    agent_cfg.heartbeat_interval = Duration::from_millis(100);
    agent_cfg.pool_default_limits = PoolLimits {
        cpu: "300m".into(),
        memory: "96Mi".into(),
        pids: 200,
    };
    agent_cfg.pool_max_limits = PoolLimits {
        cpu: "1".into(),
        memory: "128Mi".into(),
        pids: 300,
    };
    let agent = Agent::start(agent_cfg).await.unwrap();

    let mut v2c = V2::connect(format!("http://{addr}")).await.unwrap();
    wait_agents(&v2c, 1).await;
    let mut n = SandboxServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();

    // Above a maximum: refused before anything is created, field named.
    for (resources, field) in [
        (native_limits("", "256Mi", 0), "resources.limits.memory"),
        (native_limits("2", "", 0), "resources.limits.cpu"),
        (native_limits("", "", 301), "resources.limits.pids"),
    ] {
        let e = n
            .create_sandbox(native_create("too-big", resources, ""))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(field), "{} names {field}", e.message());
    }
    // A runtime nobody in the pool runs.
    let e = n
        .create_sandbox(native_create("gvisor", None, "runsc"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("runsc"), "{}", e.message());
    let e = n
        .create_sandbox(native_create("kata", None, "kata"))
        .await
        .unwrap_err();
    assert!(e.message().contains("runtime"), "{}", e.message());

    // Within the maxima: what was asked, the rest from the defaults.
    let s = n
        .create_sandbox(native_create("asked", native_limits("", "64Mi", 0), "runc"))
        .await
        .unwrap()
        .into_inner();
    assert_limits(&s, ("300m", "64Mi", 200));
    assert_eq!(s.status.unwrap().runtime, "runc");

    // FastPath v2 cannot say limits: the pool's defaults hold anyway, in
    // the record and in the cgroup the kernel enforces.
    v2c.create_sandbox(v2::CreateSandboxRequest {
        request_id: "via-v2".into(),
        image: "busybox".into(),
        command: vec![
            "sh".into(),
            "-c".into(),
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/cpu/cpu.cfs_quota_us \
             /sys/fs/cgroup/pids/pids.max > /tmp/limits; exec sleep 3600"
                .into(),
        ],
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    })
    .await
    .unwrap();
    let s = n
        .get_sandbox(native::GetSandboxRequest {
            sandbox: native_ref("via-v2"),
        })
        .await
        .unwrap()
        .into_inner();
    assert_limits(&s, ("300m", "96Mi", 200));
    let container = s.status.unwrap().container_id;
    let mut seen = String::new();
    for _ in 0..100 {
        let out = bed
            .ctr(sandbolt_e2e::bed::NS)
            .args([
                "tasks",
                "exec",
                "--exec-id",
                "read-limits",
                &container,
                "cat",
                "/tmp/limits",
            ])
            .output()
            .unwrap();
        seen = String::from_utf8_lossy(&out.stdout).into_owned();
        if seen.lines().count() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let values: Vec<&str> = seen.lines().map(str::trim).collect();
    assert_eq!(
        values,
        [&(96u64 << 20).to_string(), "30000", "200"],
        "{seen}"
    );

    // The pool tells the truth, on both APIs.
    let pool = n
        .get_pool(native::GetPoolRequest {
            name: "default".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pool.runtime, "runc");
    assert!(
        pool.runtimes.contains(&"runc".to_string()),
        "{:?}",
        pool.runtimes
    );
    assert!(
        !pool.runtimes.contains(&"runsc".to_string()),
        "{:?}",
        pool.runtimes
    );
    let d = pool.default_limits.unwrap();
    assert_eq!(
        (d.cpu.as_str(), d.memory.as_str(), d.pids),
        ("300m", "96Mi", 200)
    );
    let m = pool.max_limits.unwrap();
    assert_eq!(
        (m.cpu.as_str(), m.memory.as_str(), m.pids),
        ("1", "128Mi", 300)
    );
    assert_eq!((pool.agents, pool.ready_agents, pool.sandboxes), (1, 1, 2));
    let info = v2c
        .get_pool(v2::GetPoolRequest {
            namespace: String::new(),
            pool_name: "default".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            info.runtime.as_str(),
            info.sandbox_cpu.as_str(),
            info.sandbox_memory.as_str(),
            info.sandbox_pids
        ),
        ("runc", "300m", "96Mi", 200)
    );

    // Listing: every phase filter and paging of the native API.
    let list = |phases: Vec<native::Phase>, page_size: i32, page_token: String| {
        native::ListSandboxesRequest {
            namespace: "default".into(),
            phases: phases.into_iter().map(|p| p as i32).collect(),
            page_size,
            page_token,
            ..Default::default()
        }
    };
    let names = |r: &native::ListSandboxesResponse| {
        r.items.iter().map(|s| s.name.clone()).collect::<Vec<_>>()
    };
    let mut listed = async |phases: Vec<native::Phase>, page_size: i32, page_token: String| {
        n.list_sandboxes(list(phases, page_size, page_token))
            .await
            .map(tonic::Response::into_inner)
    };
    let all = listed(vec![], 0, String::new()).await.unwrap();
    assert_eq!(names(&all), ["asked", "via-v2"]);
    let running = listed(vec![native::Phase::Running], 0, String::new())
        .await
        .unwrap();
    assert_eq!(names(&running), ["asked", "via-v2"]);
    let failed = listed(vec![native::Phase::Failed], 0, String::new())
        .await
        .unwrap();
    assert!(failed.items.is_empty(), "{:?}", names(&failed));
    let first = listed(vec![], 1, String::new()).await.unwrap();
    assert_eq!(names(&first), ["asked"]);
    assert!(!first.next_page_token.is_empty());
    let second = listed(vec![], 1, first.next_page_token.clone())
        .await
        .unwrap();
    assert_eq!(names(&second), ["via-v2"]);
    assert!(second.next_page_token.is_empty());
    let e = listed(vec![], -1, String::new()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let pools = n
        .list_pools(native::ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        pools
            .items
            .iter()
            .map(|p| (p.name.as_str(), p.runtime.as_str()))
            .collect::<Vec<_>>(),
        [("default", "runc")]
    );

    for name in ["asked", "via-v2"] {
        n.delete_sandbox(native::DeleteSandboxRequest {
            sandbox: native_ref(name),
        })
        .await
        .unwrap();
    }
    agent.shutdown().await;
    controller.shutdown().await;
}
