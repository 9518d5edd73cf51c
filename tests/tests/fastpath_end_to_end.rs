//! End to end on the test bed: the real controller, the real agent, a
//! private containerd, busybox with execd as PID 1. No stand-ins.
//! (Kill -9 and restarts: `controller_kill_9_restart.rs`; lost agents:
//! `lost_agent_failure_policy.rs`; Python clients from the contract protos:
//! `python_fastpath_contract.rs`.)

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbolt_agent::AgentHandle;
use sandbolt_controller::store::embedded::RedbStore;
use sandbolt_controller::store::{
    AgentRecord, ListRange, SandboxRecord, SnapshotRecord, Store, StoreError, StoreResult,
    WarmPoolRecord,
};
use sandbolt_controller::{
    AgentId, Consistency, Controller, ControllerConfig, ControllerHandle, SandboxKey,
};
use sandbolt_e2e::bed::{
    V2, containers, eventually_true, ping_execd, reference, resolve_execd, running_tasks,
    sandbox_id, start_agent, start_bed, tasks, wait_agents,
};
use sandbolt_proto::fastpath::{v1, v2};
use sandbolt_test_support::now_unix_secs as now;
use sandbolt_testbed::{BUSYBOX_REF, Testbed};
use tonic::Code;

const TOKEN: &str = "e2e-agent-token";
const CAPACITY: u32 = 8;

type V1 = v1::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;

struct Env {
    agent: Option<AgentHandle>,
    controller: Option<ControllerHandle>,
    _state: tempfile::TempDir,
    _data: tempfile::TempDir,
    bed: Testbed,
}

impl Env {
    async fn start(mode: Consistency) -> Env {
        let bed = start_bed().await;
        let data = tempfile::tempdir().unwrap();
        let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
        cfg.default_consistency = mode;
        cfg.heartbeat_interval = Duration::from_millis(200);
        cfg.expiry_sweep_interval = Duration::from_millis(200);
        cfg.failpoint = None;
        let controller = Controller::start(cfg).await.expect("controller starts");
        let state = tempfile::tempdir().unwrap();
        let agent = start_agent(
            &bed,
            "agent-e2e",
            state.path(),
            controller.local_addr(),
            TOKEN,
            CAPACITY,
            Duration::from_millis(200),
        )
        .await;
        let core = controller.core().clone();
        wait("agent registered", || {
            core.registry()
                .agent(&AgentId::from("agent-e2e"))
                .is_some_and(|a| a.heartbeated)
        })
        .await;
        Env {
            agent: Some(agent),
            controller: Some(controller),
            _state: state,
            _data: data,
            bed,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.controller.as_ref().unwrap().local_addr()
    }

    async fn stop(mut self) {
        if let Some(c) = self.controller.take() {
            c.shutdown().await;
        }
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
    }
}

async fn wait(what: &str, f: impl FnMut() -> bool) {
    eventually_true(what, Duration::from_secs(20), f).await
}

async fn get_v2(c: &mut V2, name: &str) -> Result<v2::GetSandboxResponse, tonic::Status> {
    let req = v2::GetSandboxRequest {
        sandbox: reference(name),
        expected_generation: 0,
    };
    c.get_sandbox(req).await.map(tonic::Response::into_inner)
}

async fn delete_v2(c: &mut V2, name: &str) -> Result<(), tonic::Status> {
    let req = v2::DeleteRequest {
        sandbox: reference(name),
    };
    c.delete_sandbox(req).await.map(drop)
}

async fn v2_flow(addr: SocketAddr, name: &str) {
    let mut c = V2::connect(format!("http://{addr}")).await.unwrap();
    let created = c
        .create_sandbox(v2::CreateSandboxRequest {
            request_id: name.into(),
            image: "busybox".into(),
            command: vec!["sleep".into(), "3600".into()],
            expires_at_unix_seconds: now() + 600,
            completion: v2::CreateCompletion::Ready as i32,
            ..Default::default()
        })
        .await
        .expect("v2 create")
        .into_inner();
    let info = created.sandbox.unwrap();
    assert!(info.ready, "{info:?}");
    let got = get_v2(&mut c, name).await.unwrap();
    assert_eq!(
        got.sandbox.unwrap().runtime.unwrap().state,
        v2::RuntimeState::Ready as i32
    );
    let ep = resolve_execd(&mut c, name).await;
    let headers: Vec<(String, String)> = ep.required_headers.clone().into_iter().collect();
    let (status, _) = sandbolt_test_support::http::get(&ep.proxy_endpoint, "/ping", &headers).await;
    assert_eq!(
        status, 200,
        "execd /ping through the agent proxy with the required headers"
    );
    let (status, _) = sandbolt_test_support::http::get(&ep.proxy_endpoint, "/ping", &[]).await;
    assert!(
        status == 401 || status == 403,
        "no token must be refused, got {status}"
    );
    let upd = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference(name),
            expected_generation: got.generation,
            update: Some(v2::update_sandbox_request::Update::ExpiresAtUnixSeconds(
                now() + 1200,
            )),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(upd.committed_generation, got.generation + 1);
    delete_v2(&mut c, name).await.unwrap();
    assert_eq!(
        get_v2(&mut c, name).await.unwrap_err().code(),
        Code::NotFound
    );
    let (status, _) = sandbolt_test_support::http::get(&ep.proxy_endpoint, "/ping", &headers).await;
    assert_ne!(status, 200, "the sandbox is gone");
}

/// v2 snapshots of a running sandbox on the real agent: created CREATING,
/// captured (SUCCEEDED) on the sandbox's agent, read back by id, deleted
/// (then NOT_FOUND); a missing source is NOT_FOUND.
async fn v2_snapshot(c: &mut V2, name: &str) {
    let created = c
        .create_sandbox_snapshot(v2::CreateSandboxSnapshotRequest {
            request_id: "snap-surface".into(),
            sandbox: reference(name),
            template_name: "surface".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let id = created.identity.clone().unwrap().name;
    assert_eq!(created.sandbox_name, name);
    assert_eq!(created.template_name, "surface");
    let get = v2::GetSandboxSnapshotRequest {
        snapshot: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: id.clone(),
        }),
        expected_uid: String::new(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let done = loop {
        let s = c
            .get_sandbox_snapshot(get.clone())
            .await
            .unwrap()
            .into_inner();
        let s = s.snapshot.unwrap();
        if s.phase != v2::SnapshotPhase::Creating as i32 || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(done.phase, v2::SnapshotPhase::Succeeded as i32, "{done:?}");
    assert_eq!(done.fastlet_name, "agent-e2e");
    assert_eq!(done.identity, created.identity);
    c.delete_sandbox_snapshot(v2::DeleteSandboxSnapshotRequest {
        snapshot: reference(&id),
    })
    .await
    .unwrap();
    let gone = c.get_sandbox_snapshot(get).await.unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    let e = c
        .create_sandbox_snapshot(v2::CreateSandboxSnapshotRequest {
            sandbox: reference("no-such-sandbox"),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

/// The whole v2 surface on the real agent, strong mode (ported from the
/// former stand-in test): idempotent create, endpoint + token headers,
/// generation checks, metadata, list filters, pause/resume as a real
/// freeze/thaw in containerd, diagnostics events, pool counts, snapshots,
/// delete. Every "how many containers" is asked of containerd.
async fn v2_surface(env: &Env) {
    let mut c = V2::connect(format!("http://{}", env.addr())).await.unwrap();
    let name = "sbx-surface";
    let before = containers(&env.bed).await.len();
    let exp = now() + 3600;
    let mut req = v2::CreateSandboxRequest {
        request_id: name.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "3600".into()],
        expires_at_unix_seconds: exp,
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    };
    req.metadata.insert("team".into(), "red".into());
    let created = c.create_sandbox(req.clone()).await.unwrap().into_inner();
    let info = created.sandbox.unwrap();
    assert!(info.ready);
    assert_eq!(info.runtime.unwrap().state, v2::RuntimeState::Ready as i32);
    assert_eq!(info.identity.as_ref().unwrap().name, name);
    assert_eq!(info.identity.as_ref().unwrap().namespace, "default");
    assert_eq!(created.generation, 1);
    let sid = sandbox_id(&mut c, name).await;
    assert_eq!(containers(&env.bed).await.len(), before + 1);
    assert!(running_tasks(&env.bed).await.contains_key(&sid));

    // Idempotent by request id: same identity, no second container.
    let again = c.create_sandbox(req).await.unwrap().into_inner();
    assert_eq!(again.sandbox.unwrap().identity, info.identity);
    assert_eq!(containers(&env.bed).await.len(), before + 1);

    // Endpoint: the agent's proxy, no scheme, both token headers, the expiry.
    let ep = resolve_execd(&mut c, name).await;
    let proxy = env.agent.as_ref().unwrap().proxy_addr().to_string();
    assert!(
        ep.proxy_endpoint.starts_with(&format!("{proxy}/"))
            && ep.proxy_endpoint.ends_with("/44772"),
        "{} on {proxy}",
        ep.proxy_endpoint
    );
    let token = &ep.required_headers["X-Sandbolt-Access-Token"];
    assert!(token.len() >= 32);
    assert_eq!(&ep.required_headers["X-EXECD-ACCESS-TOKEN"], token);
    assert_eq!(ep.expires_at_unix_seconds, exp);

    // Update: expiry with the right generation, then a stale generation.
    let u = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference(name),
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
            sandbox: reference(name),
            expected_generation: 1,
            metadata_upsert: [("a".to_string(), "b".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::Aborted);
    let u = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference(name),
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

    // Pause / resume: the task is frozen and thawed in containerd.
    pause_or_resume(&mut c, &env.bed, name, &sid, v2::SandboxState::Paused).await;
    pause_or_resume(&mut c, &env.bed, name, &sid, v2::SandboxState::Running).await;
    let (_, status) = ping_execd(&mut c, name).await;
    assert_eq!(status, 200, "execd answers again after the thaw");

    // Diagnostics carry the events recorded on the way.
    let d = c
        .get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
            sandbox_name: name.into(),
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
            .any(|m| m.starts_with("placed on agent agent-e2e")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("record committed before create")),
        "{msgs:?}"
    );
    assert!(msgs.iter().any(|m| m.contains("paused")), "{msgs:?}");

    // Pools have real counts, from the agent's heartbeats.
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
    assert_eq!(pool.max_sandboxes_per_pod, CAPACITY as i32);
    assert!(
        pool.warm_images.iter().any(|i| i.image == BUSYBOX_REF),
        "{:?}",
        pool.warm_images
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

    v2_snapshot(&mut c, name).await;

    delete_v2(&mut c, name).await.unwrap();
    assert!(!containers(&env.bed).await.contains(&sid));
    assert_eq!(containers(&env.bed).await.len(), before);
    assert_eq!(
        get_v2(&mut c, name).await.unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(
        delete_v2(&mut c, name).await.unwrap_err().code(),
        Code::NotFound
    );
}

/// Pauses (`want` Paused) or resumes (`want` Running) `name` through v2 and
/// checks that the reply and containerd's task agree on the new state.
async fn pause_or_resume(c: &mut V2, bed: &Testbed, name: &str, sid: &str, want: v2::SandboxState) {
    let (sandbox, task_status) = if want == v2::SandboxState::Paused {
        let req = v2::PauseSandboxRequest {
            sandbox: reference(name),
            ..Default::default()
        };
        (
            c.pause_sandbox(req).await.unwrap().into_inner().sandbox,
            "PAUSED",
        )
    } else {
        let req = v2::ResumeSandboxRequest {
            sandbox: reference(name),
            ..Default::default()
        };
        (
            c.resume_sandbox(req).await.unwrap().into_inner().sandbox,
            "RUNNING",
        )
    };
    assert_eq!(sandbox.unwrap().state, want as i32);
    let tasks = tasks(bed).await;
    assert_eq!(tasks.get(sid).map(|t| t.1.as_str()), Some(task_status));
}

async fn v1_flow(env: &Env, name: &str, mode: v1::ConsistencyMode) {
    let mut c = V1::connect(format!("http://{}", env.addr())).await.unwrap();
    let r = c
        .create_sandbox(v1::CreateRequest {
            image: "docker.io/library/busybox:latest".into(),
            command: vec!["sleep".into(), "3600".into()],
            exposed_ports: vec![44772],
            name: name.into(),
            consistency_mode: mode as i32,
            ..Default::default()
        })
        .await
        .expect("v1 create")
        .into_inner();
    assert_eq!(r.agent_pod, "agent-e2e");
    let info = c
        .get_sandbox(v1::GetRequest {
            sandbox_name: name.into(),
            namespace: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.phase, "Running");
    // A second create of the same name is ALREADY_EXISTS from the record,
    // in both modes, before any agent work: its image cannot be pulled
    // (`.invalid` never resolves), so reaching the agent would surface as
    // that failure instead.
    let before = containers(&env.bed).await;
    let dup = c
        .create_sandbox(v1::CreateRequest {
            image: "registry.sandbolt.invalid/none/never:1".into(),
            name: name.into(),
            consistency_mode: mode as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists, "{dup:?}");
    assert_eq!(
        containers(&env.bed).await,
        before,
        "no container for the duplicate"
    );
    // v1 carries no token on the wire; the route is the same as v2's.
    let core = env.controller.as_ref().unwrap().core();
    let token = core.access_token(
        &core
            .store()
            .get(&SandboxKey::new("default", name))
            .unwrap()
            .unwrap(),
    );
    let headers = vec![
        ("X-Sandbolt-Access-Token".to_string(), token.clone()),
        ("X-EXECD-ACCESS-TOKEN".to_string(), token),
    ];
    let (status, _) = sandbolt_test_support::http::get(&r.endpoints[0], "/ping", &headers).await;
    assert_eq!(status, 200, "v1 endpoint reaches execd");
    // v1: created without expiry (manual); a renew is refused, labels work.
    let e = c
        .update_sandbox(v1::UpdateRequest {
            sandbox_name: name.into(),
            update: Some(v1::update_request::Update::ExpireTimeSeconds(now() + 600)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        c.update_sandbox(v1::UpdateRequest {
            sandbox_name: name.into(),
            labels: [("k".into(), "v".into())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .success
    );
    assert!(
        c.list_sandboxes(v1::ListRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items
            .iter()
            .any(|i| i.sandbox_name == name)
    );
    assert!(
        c.delete_sandbox(v1::DeleteRequest {
            sandbox_name: name.into(),
            namespace: String::new()
        })
        .await
        .unwrap()
        .into_inner()
        .success
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_strong_mode_v2_and_v1() {
    let env = Env::start(Consistency::Strong).await;
    v2_flow(env.addr(), "e2e-strong-v2").await;
    v2_surface(&env).await;
    v1_flow(&env, "e2e-strong-v1", v1::ConsistencyMode::Strong).await;
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_fast_mode_v2_and_v1() {
    let env = Env::start(Consistency::Fast).await;
    v2_flow(env.addr(), "e2e-fast-v2").await;
    // FAST (= unset) takes the server default: fast here.
    v1_flow(&env, "e2e-fast-v1", v1::ConsistencyMode::Fast).await;
    env.stop().await;
}

/// A store that refuses to create records (every other call goes to redb):
/// the one test double here, standing for "the record can never be
/// written". Agent and containerd are real.
struct RefusingStore(RedbStore);

impl Store for RefusingStore {
    fn create(&self, _: &SandboxRecord) -> StoreResult<SandboxRecord> {
        Err(StoreError::Unavailable("refusing store (test)".into()))
    }
    fn get(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        self.0.get(key)
    }
    fn get_by_request_id(&self, id: &str) -> StoreResult<Option<SandboxRecord>> {
        self.0.get_by_request_id(id)
    }
    fn replace(&self, r: &SandboxRecord) -> StoreResult<SandboxRecord> {
        self.0.replace(r)
    }
    fn delete(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        self.0.delete(key)
    }
    fn list(&self, range: &ListRange<'_>) -> StoreResult<Vec<SandboxRecord>> {
        self.0.list(range)
    }
    fn put_agent(&self, a: &AgentRecord) -> StoreResult<()> {
        self.0.put_agent(a)
    }
    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>> {
        self.0.list_agents()
    }
    fn put_warm_pool(&self, p: &WarmPoolRecord) -> StoreResult<WarmPoolRecord> {
        self.0.put_warm_pool(p)
    }
    fn list_warm_pools(&self) -> StoreResult<Vec<WarmPoolRecord>> {
        self.0.list_warm_pools()
    }
    fn delete_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        self.0.delete_warm_pool(name)
    }
    fn put_snapshot(&self, s: &SnapshotRecord) -> StoreResult<SnapshotRecord> {
        self.0.put_snapshot(s)
    }
    fn get_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        self.0.get_snapshot(id)
    }
    fn list_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        self.0.list_snapshots()
    }
    fn delete_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        self.0.delete_snapshot(id)
    }
}

/// Fast mode: the container is made first; when its record can never be
/// written the controller removes the container again (asked of
/// containerd), answers UNAVAILABLE, and the slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_fast_mode_removes_the_container_when_the_record_cannot_be_written() {
    let bed = start_bed().await;
    let data = tempfile::tempdir().unwrap();
    let store = Arc::new(RefusingStore(RedbStore::open(data.path()).unwrap()));
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data.path(), TOKEN);
    cfg.default_consistency = Consistency::Fast;
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.record_commit_attempts = 3;
    cfg.failpoint = None;
    let h = Controller::start_with_store(cfg, store).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    // One slot: the second attempt below only gets one if the first was freed.
    let agent = start_agent(
        &bed,
        "agent-e2e",
        state.path(),
        h.local_addr(),
        TOKEN,
        1,
        Duration::from_millis(200),
    )
    .await;
    let mut c = V2::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap();
    wait_agents(&c, 1).await;
    let req = |name: &str| v2::CreateSandboxRequest {
        request_id: name.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "3600".into()],
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    };
    // containerd's own event stream proves the container existed.
    let mut events = bed.ctr(sandbolt_e2e::bed::NS);
    events
        .arg("events")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut events = events.spawn().expect("ctr events");
    let stdout = events.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(l);
        }
    });
    // `ctr events` subscribes asynchronously: label the namespace until the
    // stream shows that update, then it is listening.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    'subscribed: loop {
        assert!(Instant::now() < deadline, "ctr events never subscribed");
        let mut label = bed.ctr(sandbolt_e2e::bed::NS);
        label.args([
            "namespaces",
            "label",
            sandbolt_e2e::bed::NS,
            "sandbolt-probe=1",
        ]);
        let st = tokio::task::spawn_blocking(move || label.status())
            .await
            .unwrap()
            .unwrap();
        assert!(st.success());
        tokio::time::sleep(Duration::from_millis(100)).await;
        while let Ok(l) = rx.try_recv() {
            if l.contains("/namespaces/update") {
                break 'subscribed;
            }
            seen.push(l);
        }
    }
    let e = c.create_sandbox(req("doomed")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("the container was removed"), "{e:?}");
    events.kill().unwrap();
    events.wait().unwrap();
    seen.extend(rx.iter());
    assert!(
        seen.iter().any(|l| l.contains("/containers/create")),
        "containerd saw the create: {seen:?}"
    );
    assert!(
        seen.iter().any(|l| l.contains("/containers/delete")),
        "containerd saw the delete: {seen:?}"
    );
    assert_eq!(
        containers(&bed).await,
        Vec::<String>::new(),
        "the container made first was removed"
    );
    let held = agent.sandboxes().list();
    assert!(held.is_empty(), "the agent holds nothing: {held:?}");
    // The slot comes back once the agent's heartbeat no longer lists the
    // container: the next attempt reaches the agent again (and is removed
    // again), rather than being refused for capacity.
    let core = h.core().clone();
    wait("slot released", || {
        core.registry().allocated(&AgentId::from("agent-e2e")) == Some(0)
    })
    .await;
    let e = c.create_sandbox(req("doomed2")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(containers(&bed).await.is_empty());
    h.shutdown().await;
    agent.shutdown().await;
}
