//! Placement and consistency logic through the controller's real gRPC port,
//! with in-process AgentService **stand-ins** (see `support/standin.rs`) in
//! place of agents. The end-to-end tests with the real agent and containerd
//! are in `e2e_testbed.rs`.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbolt_controller::store::embedded::RedbStore;
use sandbolt_controller::store::{AgentRecord, SandboxRecord, Store, StoreError, StoreResult};
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::fastpath::v1;
use sandbolt_proto::fastpath::v2;
use support::standin::{AGENT_TOKEN, StandInAgent};
use tonic::Code;

type V2 = v2::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;
type V1 = v1::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;

const HB: Duration = Duration::from_millis(100);

fn config(dir: &Path, mode: Consistency) -> ControllerConfig {
    let mut c = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, AGENT_TOKEN);
    c.default_consistency = mode;
    c.heartbeat_interval = HB;
    c.lost_agent_timeout = Duration::from_millis(600);
    c.startup_grace = Duration::from_secs(3);
    c.expiry_sweep_interval = Duration::from_millis(100);
    c.create_deadline = Duration::from_secs(10);
    c.default_recovery_timeout = Duration::from_secs(10);
    c.failpoint = None;
    c
}

async fn v2c(addr: SocketAddr) -> V2 {
    V2::connect(format!("http://{addr}")).await.unwrap()
}

async fn v1c(addr: SocketAddr) -> V1 {
    V1::connect(format!("http://{addr}")).await.unwrap()
}

fn reference(name: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: String::new(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    })
}

fn create_req(rid: &str, expires: i64) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: rid.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "1000".into()],
        expires_at_unix_seconds: expires,
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

async fn eventually<F: FnMut() -> bool>(what: &str, timeout: Duration, mut f: F) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn start(dir: &Path, mode: Consistency) -> ControllerHandle {
    Controller::start(config(dir, mode)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_strong_lifecycle_against_stand_in() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let a = StandInAgent::start(
        "agent-a",
        "default",
        4,
        &["docker.io/library/busybox:latest"],
        h.local_addr(),
        HB,
    )
    .await;
    let mut c = v2c(h.local_addr()).await;

    let exp = now() + 3600;
    let mut req = create_req("sbx-1", exp);
    req.metadata.insert("team".into(), "red".into());
    let created = c.create_sandbox(req.clone()).await.unwrap().into_inner();
    let info = created.sandbox.unwrap();
    assert!(info.ready);
    assert_eq!(info.runtime.unwrap().state, v2::RuntimeState::Ready as i32);
    assert_eq!(info.identity.as_ref().unwrap().name, "sbx-1");
    assert_eq!(info.identity.as_ref().unwrap().namespace, "default");
    assert_eq!(created.generation, 1);
    assert_eq!(a.held(), 1);

    // Idempotent by request id: same identity, no second container.
    let again = c.create_sandbox(req).await.unwrap().into_inner();
    assert_eq!(again.sandbox.unwrap().identity, info.identity);
    assert_eq!(a.held(), 1);

    let got = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("sbx-1"),
            expected_generation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.sandbox.unwrap().identity, info.identity);

    // Endpoint: proxy route and both token headers.
    let ep = c
        .resolve_endpoint(v2::ResolveEndpointRequest {
            sandbox: reference("sbx-1"),
            target: Some(v2::EndpointTarget {
                target: Some(v2::endpoint_target::Target::Port(44772)),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let sid = a.state.sandboxes.lock().keys().next().unwrap().clone();
    assert_eq!(
        ep.proxy_endpoint,
        format!("127.0.0.1:{}/{sid}/44772", a.addr.port() + 10000)
    );
    assert!(!ep.proxy_endpoint.contains("://"));
    let token = &ep.required_headers["X-Sandbolt-Access-Token"];
    assert!(token.len() >= 32);
    assert_eq!(&ep.required_headers["X-EXECD-ACCESS-TOKEN"], token);
    assert_eq!(ep.expires_at_unix_seconds, exp);

    // Update: expiry with the right generation, then a stale generation.
    let u = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference("sbx-1"),
            expected_generation: 1,
            update: Some(v2::update_sandbox_request::Update::ExpiresAtUnixSeconds(
                exp + 60,
            )),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(u.committed_generation, 2);
    let stale = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference("sbx-1"),
            expected_generation: 1,
            metadata_upsert: [("a".to_string(), "b".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::Aborted);
    let u = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference("sbx-1"),
            expected_generation: 2,
            metadata_upsert: [("env".to_string(), "prod".to_string())].into(),
            metadata_delete_keys: vec!["team".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(u.committed_generation, 3);
    let l = c
        .list_sandboxes(v2::ListSandboxesRequest {
            metadata: [("env".to_string(), "prod".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(l.items.len(), 1);
    let l = c
        .list_sandboxes(v2::ListSandboxesRequest {
            metadata: [("team".to_string(), "red".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(l.items.is_empty());

    // Pause / resume through the agent.
    let p = c
        .pause_sandbox(v2::PauseSandboxRequest {
            sandbox: reference("sbx-1"),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.sandbox.unwrap().state, v2::SandboxState::Paused as i32);
    assert_eq!(a.state.sandboxes.lock()[&sid].phase, 3);
    let r = c
        .resume_sandbox(v2::ResumeSandboxRequest {
            sandbox: reference("sbx-1"),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.sandbox.unwrap().state, v2::SandboxState::Running as i32);

    // Diagnostics carry the events recorded on the way.
    let d = c
        .get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
            sandbox_name: "sbx-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.fastlet_reachable);
    assert_eq!(d.runtime_instance_id, sid);
    let msgs: Vec<&str> = d.events.iter().map(|e| e.message.as_str()).collect();
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("placed on agent agent-a")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("record committed before create")),
        "{msgs:?}"
    );
    assert!(msgs.iter().any(|m| m.contains("paused")), "{msgs:?}");

    // Pools have real counts.
    let pool = c
        .get_pool(v2::GetPoolRequest {
            namespace: String::new(),
            pool_name: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            pool.name.as_str(),
            pool.total_fastlets,
            pool.ready_fastlets,
            pool.idle_fastlets
        ),
        ("default", 1, 1, 0)
    );
    assert_eq!(pool.max_sandboxes_per_pod, 4);
    assert_eq!(
        pool.warm_images[0].image,
        "docker.io/library/busybox:latest"
    );
    assert_eq!(
        c.list_pools(v2::ListPoolsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items
            .len(),
        1
    );
    assert_eq!(
        c.get_pool(v2::GetPoolRequest {
            namespace: String::new(),
            pool_name: "nope".into()
        })
        .await
        .unwrap_err()
        .code(),
        Code::NotFound
    );

    // Snapshots are not built: UNIMPLEMENTED, with a message.
    let e = c
        .create_sandbox_snapshot(v2::CreateSandboxSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    assert!(e.message().contains("not implemented"));

    c.delete_sandbox(v2::DeleteRequest {
        sandbox: reference("sbx-1"),
    })
    .await
    .unwrap();
    assert_eq!(a.held(), 0);
    let e = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("sbx-1"),
            expected_generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .delete_sandbox(v2::DeleteRequest {
            sandbox: reference("sbx-1"),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_cleanup_renew_is_failed_precondition_and_errors_use_codes() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let _a = StandInAgent::start("agent-a", "default", 2, &[], h.local_addr(), HB).await;
    let mut c = v2c(h.local_addr()).await;
    // No expiry: manual cleanup.
    c.create_sandbox(create_req("manual", 0)).await.unwrap();
    let e = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference("manual"),
            update: Some(v2::update_sandbox_request::Update::ExpiresAtUnixSeconds(
                now() + 100,
            )),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(
        e.message(),
        "Sandbox manual does not have automatic expiration enabled."
    );
    let got = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("manual"),
            expected_generation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.generation, 1, "a refused renew changes nothing");
    let e = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("manual"),
            expected_generation: 7,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted);
    // Wrong uid: the sandbox meant is gone.
    let mut r = reference("manual");
    r.as_mut().unwrap().expected_uid = "not-the-uid".into();
    assert_eq!(
        c.get_sandbox(v2::GetSandboxRequest {
            sandbox: r,
            expected_generation: 0
        })
        .await
        .unwrap_err()
        .code(),
        Code::NotFound
    );
    // Invalid input.
    let mut bad = create_req("bad", 0);
    bad.image = String::new();
    assert_eq!(
        c.create_sandbox(bad).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        c.create_sandbox(create_req("past", now() - 10))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    // Capacity: 2 slots.
    c.create_sandbox(create_req("second", 0)).await.unwrap();
    assert_eq!(
        c.create_sandbox(create_req("third", 0))
            .await
            .unwrap_err()
            .code(),
        Code::ResourceExhausted
    );
    // Unknown pool.
    let mut other = create_req("elsewhere", 0);
    other.pool_ref = "gpu".into();
    assert_eq!(
        c.create_sandbox(other).await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    h.shutdown().await;
}

/// 1,000 concurrent creates against 5 agents with 100 slots each: exactly
/// 500 succeed, no agent is ever asked beyond its capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_creates_never_double_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Fast).await;
    let mut agents = Vec::new();
    for i in 0..5 {
        agents.push(
            StandInAgent::start(
                &format!("agent-{i}"),
                "default",
                100,
                &["busybox"],
                h.local_addr(),
                Duration::from_secs(3600),
            )
            .await,
        );
    }
    let c = v2c(h.local_addr()).await;
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move {
                c.create_sandbox(create_req(&format!("c-{i}"), 0))
                    .await
                    .map(|_| ())
                    .map_err(|e| e.code())
            })
        })
        .collect();
    let mut ok = 0;
    let mut codes = HashMap::new();
    for t in futures::future::join_all(tasks).await {
        match t.unwrap() {
            Ok(()) => ok += 1,
            Err(code) => *codes.entry(code).or_insert(0) += 1,
        }
    }
    assert_eq!(ok, 500, "errors: {codes:?}");
    assert_eq!(codes.get(&Code::ResourceExhausted), Some(&500), "{codes:?}");
    for a in &agents {
        assert_eq!(a.held(), 100, "{}", a.id);
        assert_eq!(
            a.state
                .overcommits
                .load(std::sync::atomic::Ordering::SeqCst),
            0
        );
    }
    h.shutdown().await;
}

/// The same property on the registry alone, from 1,000 OS threads.
#[test]
fn thousand_threads_allocate_each_slot_once() {
    use sandbolt_controller::placement::{PlacementRequest, PoolKey};
    use sandbolt_controller::registry::Registry;
    use sandbolt_proto::agent::v1 as pb;
    let reg = Arc::new(Registry::new());
    for i in 0..10 {
        reg.heartbeat(&pb::Inventory {
            agent_id: format!("a{i}"),
            max_sandboxes: 50,
            ..Default::default()
        });
    }
    let barrier = Arc::new(std::sync::Barrier::new(1000));
    let handles: Vec<_> = (0..1000)
        .map(|i| {
            let (reg, barrier) = (reg.clone(), barrier.clone());
            std::thread::spawn(move || {
                let pool = PoolKey::new("", "");
                barrier.wait();
                reg.allocate(
                    &PlacementRequest {
                        pool: &pool,
                        image_key: "x",
                        ports: &[],
                        exclude: &[],
                    },
                    &format!("s{i}"),
                )
                .ok()
                .map(|p| p.agent)
            })
        })
        .collect();
    let mut per_agent: HashMap<String, u32> = HashMap::new();
    let mut failed = 0;
    for h in handles {
        match h.join().unwrap() {
            Some(a) => *per_agent.entry(a).or_default() += 1,
            None => failed += 1,
        }
    }
    assert_eq!(failed, 500);
    assert_eq!(per_agent.len(), 10);
    for (a, n) in per_agent {
        assert_eq!(n, 50, "{a}");
        assert_eq!(reg.allocated(&a), Some(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_mode_idempotent_and_image_affinity() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Fast).await;
    let cold = StandInAgent::start("agent-cold", "default", 10, &[], h.local_addr(), HB).await;
    let warm = StandInAgent::start(
        "agent-warm",
        "default",
        10,
        &["docker.io/library/busybox:latest"],
        h.local_addr(),
        HB,
    )
    .await;
    let mut c = v2c(h.local_addr()).await;
    for i in 0..3 {
        c.create_sandbox(create_req(&format!("f-{i}"), 0))
            .await
            .unwrap();
    }
    // `busybox` == `docker.io/library/busybox:latest`: all on the warm agent.
    assert_eq!((warm.held(), cold.held()), (3, 0));
    let mut other = create_req("f-other", 0);
    other.image = "ghcr.io/acme/tool:1".into();
    c.create_sandbox(other).await.unwrap();
    assert_eq!(cold.held(), 1);
    // A retry in fast mode returns the same record and leaves no extra container.
    let again = c
        .create_sandbox(create_req("f-0", 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.sandbox.unwrap().identity.unwrap().name, "f-0");
    assert_eq!(warm.held() + cold.held(), 4);
    let d = c
        .get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
            sandbox_name: "f-0".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        d.events
            .iter()
            .any(|e| e.message.contains("record committed after create (fast)"))
    );
    h.shutdown().await;
}

/// A store that refuses to create records: a test double for the Store seam
/// (the fast path must then remove the container it made).
struct RefusingStore(RedbStore);

impl Store for RefusingStore {
    fn create(&self, _: &SandboxRecord) -> StoreResult<SandboxRecord> {
        Err(StoreError::Unavailable("refusing store (test)".into()))
    }
    fn get(&self, ns: &str, n: &str) -> StoreResult<Option<SandboxRecord>> {
        self.0.get(ns, n)
    }
    fn get_by_request_id(&self, id: &str) -> StoreResult<Option<SandboxRecord>> {
        self.0.get_by_request_id(id)
    }
    fn replace(&self, r: &SandboxRecord) -> StoreResult<SandboxRecord> {
        self.0.replace(r)
    }
    fn delete(&self, ns: &str, n: &str) -> StoreResult<Option<SandboxRecord>> {
        self.0.delete(ns, n)
    }
    fn list(
        &self,
        ns: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> StoreResult<Vec<SandboxRecord>> {
        self.0.list(ns, after, limit)
    }
    fn put_agent(&self, a: &AgentRecord) -> StoreResult<()> {
        self.0.put_agent(a)
    }
    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>> {
        self.0.list_agents()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_mode_removes_the_container_when_the_record_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(RefusingStore(RedbStore::open(dir.path()).unwrap()));
    let mut cfg = config(dir.path(), Consistency::Fast);
    cfg.record_commit_attempts = 3;
    let h = Controller::start_with_store(cfg, store).await.unwrap();
    let a = StandInAgent::start("agent-a", "default", 1, &[], h.local_addr(), HB).await;
    let mut c = v2c(h.local_addr()).await;
    let e = c.create_sandbox(create_req("doomed", 0)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(
        a.state.creates.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the container was created"
    );
    assert_eq!(a.held(), 0, "and removed again");
    // The slot comes back (once the agent's next heartbeat no longer lists
    // the container): with capacity 1 the stand-in accepts another create.
    let core = h.core().clone();
    eventually("slot released", Duration::from_secs(5), || {
        core.registry().allocated("agent-a") == Some(0)
    })
    .await;
    let e = c
        .create_sandbox(create_req("doomed2", 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(a.state.creates.load(std::sync::atomic::Ordering::SeqCst), 2);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strong_mode_agent_failure_leaves_no_record_and_frees_the_slot() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let a = StandInAgent::start("agent-a", "default", 1, &[], h.local_addr(), HB).await;
    let mut c = v2c(h.local_addr()).await;
    a.state
        .fail_creates
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        c.create_sandbox(create_req("s1", 0))
            .await
            .unwrap_err()
            .code(),
        Code::Unavailable
    );
    assert_eq!(
        c.get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("s1"),
            expected_generation: 0
        })
        .await
        .unwrap_err()
        .code(),
        Code::NotFound
    );
    a.state
        .fail_creates
        .store(false, std::sync::atomic::Ordering::SeqCst);
    c.create_sandbox(create_req("s1", 0)).await.unwrap();
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_sweep_deletes_and_expiry_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let a = StandInAgent::start("agent-a", "default", 4, &[], h.local_addr(), HB).await;
    let mut c = v2c(h.local_addr()).await;
    c.create_sandbox(create_req("short", now() + 2))
        .await
        .unwrap();
    c.create_sandbox(create_req("forever", 0)).await.unwrap();
    assert_eq!(a.held(), 2);
    // Restart the controller before the expiry passes, on a new port.
    h.shutdown().await;
    let mut cfg = config(dir.path(), Consistency::Strong);
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    let h2 = Controller::start(cfg).await.unwrap();
    // The stand-in heartbeats to the new address from now on.
    a.retarget(h2.local_addr());
    let mut c2 = v2c(h2.local_addr()).await;
    let store_has = |name: &str| {
        let s = h2.core().store().get("default", name).unwrap();
        s.is_some()
    };
    assert!(store_has("short"));
    // Writes wait for agent-a's heartbeat or the grace; the sweep deletes anyway.
    eventually(
        "expired sandbox deleted after restart",
        Duration::from_secs(8),
        || !store_has("short"),
    )
    .await;
    assert_eq!(a.held(), 1, "the container went with the record");
    assert!(store_has("forever"));
    let got = c2
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("forever"),
            expected_generation: 0,
        })
        .await
        .unwrap();
    assert_eq!(got.into_inner().generation, 1);
    h2.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_agent_auto_recreates_elsewhere_and_manual_is_marked_failed() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let first =
        StandInAgent::start("agent-1", "default", 4, &["busybox"], h.local_addr(), HB).await;
    let second = StandInAgent::start("agent-2", "default", 4, &[], h.local_addr(), HB).await;
    let mut c = v2c(h.local_addr()).await;
    let mut auto = create_req("auto", 0);
    auto.failure_policy = v2::FailurePolicy::AutoRecreate as i32;
    auto.recovery_timeout_seconds = 30;
    c.create_sandbox(auto).await.unwrap();
    c.create_sandbox(create_req("manual", 0)).await.unwrap();
    assert_eq!(
        (first.held(), second.held()),
        (2, 0),
        "image affinity put both on agent-1"
    );
    let before = c
        .get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
            sandbox_name: "auto".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    first.go_silent();
    eventually(
        "auto sandbox recreated on agent-2",
        Duration::from_secs(10),
        || second.held() == 1,
    )
    .await;
    let diag = |c: &mut V2, name: &'static str| {
        let mut c = c.clone();
        async move {
            c.get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
                sandbox_name: name.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
        }
    };
    let mut after = diag(&mut c, "auto").await;
    for _ in 0..50 {
        if after.assignment_state == "Assigned" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = diag(&mut c, "auto").await;
    }
    assert_eq!(after.assignment_state, "Assigned");
    assert_ne!(after.runtime_instance_id, before.runtime_instance_id);
    assert_eq!(after.assignment_attempt, 2);
    assert!(
        second
            .state
            .sandboxes
            .lock()
            .contains_key(&after.runtime_instance_id)
    );
    assert!(
        after
            .events
            .iter()
            .any(|e| e.message.contains("recreated on agent agent-2"))
    );
    assert!(after.sandbox.unwrap().ready);

    let manual = diag(&mut c, "manual").await;
    assert_eq!(manual.assignment_state, "Failed");
    assert_eq!(
        manual.sandbox.unwrap().runtime.unwrap().state,
        v2::RuntimeState::Failed as i32
    );
    assert!(
        manual
            .events
            .iter()
            .any(|e| e.message.contains("MANUAL policy"))
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_lifecycle_and_pagination() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Fast).await;
    let a = StandInAgent::start("agent-a", "default", 20, &[], h.local_addr(), HB).await;
    let mut c = v1c(h.local_addr()).await;
    let r = c
        .create_sandbox(v1::CreateRequest {
            image: "busybox".into(),
            exposed_ports: vec![8080],
            name: "v1-box".into(),
            consistency_mode: v1::ConsistencyMode::Strong as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (r.sandbox_name.as_str(), r.agent_pod.as_str()),
        ("v1-box", "agent-a")
    );
    assert_eq!(
        r.endpoints,
        vec![format!(
            "127.0.0.1:{}/{}/8080",
            a.addr.port() + 10000,
            r.sandbox_id
        )]
    );
    let dup = c
        .create_sandbox(v1::CreateRequest {
            image: "busybox".into(),
            name: "v1-box".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists);
    let got = c
        .get_sandbox(v1::GetRequest {
            sandbox_name: "v1-box".into(),
            namespace: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            got.phase.as_str(),
            got.pool_ref.as_str(),
            got.sandbox_id.as_str()
        ),
        ("Running", "default", r.sandbox_id.as_str())
    );
    // v1: 0 removes the expiry, a time sets it (the sandbox now expires).
    let u = c
        .update_sandbox(v1::UpdateRequest {
            sandbox_name: "v1-box".into(),
            update: Some(v1::update_request::Update::ExpireTimeSeconds(now() + 3600)),
            labels: [("k".to_string(), "v".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        u.code(),
        Code::FailedPrecondition,
        "created without expiry: manual"
    );
    let u = c
        .update_sandbox(v1::UpdateRequest {
            sandbox_name: "v1-box".into(),
            labels: [("k".to_string(), "v".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(u.success);
    for i in 0..7 {
        c.create_sandbox(v1::CreateRequest {
            image: "busybox".into(),
            name: format!("p-{i}"),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert_eq!(
        c.list_sandboxes(v1::ListRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items
            .len(),
        8
    );
    // v2 pagination over the same records.
    let mut c2 = v2c(h.local_addr()).await;
    let mut token = String::new();
    let mut seen = Vec::new();
    loop {
        let page = c2
            .list_sandboxes(v2::ListSandboxesRequest {
                page_size: 3,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.items.len() <= 3);
        seen.extend(page.items.into_iter().map(|i| i.identity.unwrap().name));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen.len(), 8);
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(seen, sorted);
    assert!(
        c.delete_sandbox(v1::DeleteRequest {
            sandbox_name: "v1-box".into(),
            namespace: String::new()
        })
        .await
        .unwrap()
        .into_inner()
        .success
    );
    assert_eq!(a.held(), 7);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), Consistency::Strong);
    cfg.fastpath_token = Some("fp-secret".into());
    let h = Controller::start(cfg).await.unwrap();
    let mut c = v2c(h.local_addr()).await;
    let e = c
        .list_pools(v2::ListPoolsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let mut req = tonic::Request::new(v2::ListPoolsRequest::default());
    req.metadata_mut()
        .insert("authorization", "Bearer fp-secret".parse().unwrap());
    c.list_pools(req).await.unwrap();
    // Registry without the agent token.
    use sandbolt_proto::agent::v1 as pb;
    let mut r = pb::registry_service_client::RegistryServiceClient::connect(format!(
        "http://{}",
        h.local_addr()
    ))
    .await
    .unwrap();
    let e = r
        .heartbeat(pb::HeartbeatRequest {
            inventory: Some(pb::Inventory {
                agent_id: "x".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    h.shutdown().await;
}
