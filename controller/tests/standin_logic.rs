//! Placement and consistency logic through the controller's real gRPC port,
//! with in-process AgentService **stand-ins** (see `support/standin.rs`) in
//! place of agents. Only what the real-agent tests cannot reach stays here;
//! each test says why it needs a stand-in. Everything else runs on the test
//! bed with the real agent, in the cross-component tests of `tests/tests/`:
//! `fastpath_end_to_end.rs` (v2 surface, v1, both modes),
//! `controller_kill_9_restart.rs` (kill -9, expiry across a restart),
//! `lost_agent_failure_policy.rs` (AUTO_RECREATE / MANUAL),
//! `python_fastpath_contract.rs` (grpcio clients).

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use sandbolt_controller::{AgentId, Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v1;
use sandbolt_proto::fastpath::v2;
use sandbolt_test_support::now_unix_secs as now;
use support::standin::{StandInAgent, create_request as create_req};
use support::{HB, sref, standin_config};
use tonic::Code;

type V2 = v2::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;
type V1 = v1::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;

fn config(dir: &Path, mode: Consistency) -> ControllerConfig {
    let mut c = standin_config(dir);
    c.default_consistency = mode;
    c.expiry_sweep_interval = Duration::from_millis(100);
    c.default_recovery_timeout = Duration::from_secs(10);
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

async fn start(dir: &Path, mode: Consistency) -> ControllerHandle {
    Controller::start(config(dir, mode)).await.unwrap()
}

/// Stand-in because: this is the controller's own validation and error-code
/// mapping (exact FAILED_PRECONDITION text, `expected_generation` /
/// `expected_uid` on reads, past expiry, capacity, unknown pool); the agent
/// only has to exist. Not covered by the real-agent tests.
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
///
/// Stand-in because: 1,000 real containers on 2 cores is not a unit test,
/// and the stand-in counts every create beyond its capacity (`overcommits`),
/// which is the property asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_creates_never_double_allocate() {
    let dir = tempfile::tempdir().unwrap();
    // The stand-ins heartbeat once (at start): placement then works from
    // reservations alone. They must not be declared lost while 1,000
    // creates run on a loaded machine (that refuses creates for lack of
    // agents, not of slots), so the lost-agent timeout is out of reach here.
    let mut cfg = config(dir.path(), Consistency::Fast);
    cfg.lost_agent_timeout = Duration::from_secs(3600);
    let h = Controller::start(cfg).await.unwrap();
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
        assert_eq!(a.state.overcommits.load(SeqCst), 0);
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
                        runtime: None,
                        pin: None,
                        volume_root: false,
                        shared_volumes: false,
                    },
                    &format!("s{i}").into(),
                )
                .ok()
                .map(|p| p.agent)
            })
        })
        .collect();
    let mut per_agent: HashMap<AgentId, u32> = HashMap::new();
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

/// Stand-in because: image affinity needs agents with *different* image
/// caches; real agents on one test bed share containerd's `k8s.io` image
/// store, so they all report busybox cached.
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

/// Stand-in because: it needs an agent that fails creates on demand
/// (`fail_creates`) and then succeeds on the same slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strong_mode_agent_failure_leaves_no_record_and_frees_the_slot() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let a = StandInAgent::start("agent-a", "default", 1, &[], h.local_addr(), HB).await;
    let mut c = v2c(h.local_addr()).await;
    a.state.fail_creates.store(true, SeqCst);
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
    a.state.fail_creates.store(false, SeqCst);
    c.create_sandbox(create_req("s1", 0)).await.unwrap();
    h.shutdown().await;
}

/// Stand-in because: v1-specific controller semantics (expiry 0 = remove,
/// AlreadyExists, list filters) and v2 pagination over many records, which
/// the real-agent v1 flow (`fastpath_end_to_end`, `python_fastpath_contract`)
/// does not
/// exercise; no data-plane traffic here.
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

/// Stand-in because: it is about the controller's auth interceptors
/// (FastPath token, agent token on RegistryService); no container is made.
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

// ------------------------------------------------------------ egress policy --

type Native = sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient<
    tonic::transport::Channel,
>;

const DENY_BUT_ONE: &str =
    r#"{"defaultAction":"DENY","egress":[{"action":"Allow","target":"Pypi.ORG."}]}"#;
const DENY_BUT_ONE_NORMALIZED: &str =
    r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"pypi.org"}]}"#;
const ALLOW_BUT_ONE: &str =
    r#"{"defaultAction":"allow","egress":[{"action":"deny","target":"203.0.113.0/24"}]}"#;

async fn nativec(addr: SocketAddr) -> Native {
    Native::connect(format!("http://{addr}")).await.unwrap()
}

async fn native_get(c: &mut Native, name: &str) -> native::Sandbox {
    c.get_sandbox(native::GetSandboxRequest {
        sandbox: sref(name),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn set_policy(
    c: &mut Native,
    name: &str,
    json: &str,
) -> Result<native::Sandbox, tonic::Status> {
    c.update_sandbox(native::UpdateSandboxRequest {
        sandbox: sref(name),
        network_policy_json: Some(json.into()),
        ..Default::default()
    })
    .await
    .map(tonic::Response::into_inner)
}

fn egress(input: &str) -> v2::ActionBinding {
    v2::ActionBinding {
        handler: "egress".into(),
        input: input.into(),
    }
}

async fn bindings(c: &mut V2, name: &str) -> Vec<v2::ActionBindingInfo> {
    c.get_sandbox(v2::GetSandboxRequest {
        sandbox: reference(name),
        expected_generation: 0,
    })
    .await
    .unwrap()
    .into_inner()
    .sandbox
    .unwrap()
    .action_bindings
}

fn container_id(s: &native::Sandbox) -> String {
    s.status.as_ref().unwrap().container_id.clone()
}

/// Stand-in because: it reads back exactly which policy JSON the agent
/// received with each create and UpdateNetworkPolicy call, and makes the
/// agent refuse one; the real agent's enforcement is tested in agent/tests
/// and tests/tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_reaches_the_agent_at_create_and_update() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let a = StandInAgent::start("agent-a", "default", 4, &[], h.local_addr(), HB).await;
    let (mut c, mut n) = (v2c(h.local_addr()).await, nativec(h.local_addr()).await);

    // Create through v2 action bindings: the agent gets the normalized policy.
    let mut req = create_req("eg", 0);
    req.action_bindings = vec![egress(DENY_BUT_ONE)];
    let created = c.create_sandbox(req).await.unwrap().into_inner();
    let info = &created.sandbox.unwrap().action_bindings;
    assert_eq!(info.len(), 1);
    assert_eq!(
        (info[0].handler.as_str(), info[0].state),
        ("egress", v2::ActionState::Ready as i32)
    );
    assert!(info[0].last_transition_unix_seconds > 0);
    let s = native_get(&mut n, "eg").await;
    let sid = container_id(&s);
    assert_eq!(
        a.state.policy(&sid).as_deref(),
        Some(DENY_BUT_ONE_NORMALIZED)
    );
    assert_eq!(s.spec.unwrap().network_policy_json, DENY_BUT_ONE_NORMALIZED);
    assert_eq!(
        s.status.unwrap().ip_address,
        "10.203.0.2",
        "the address the agent answered the create with"
    );

    // Replace through v2 (generation checked), then remove (no egress item).
    let replace = |items: Vec<v2::ActionBinding>, generation| v2::UpdateSandboxRequest {
        sandbox: reference("eg"),
        expected_generation: generation,
        update: Some(v2::update_sandbox_request::Update::ActionBindings(
            v2::ReplaceActionBindings { items },
        )),
        ..Default::default()
    };
    let calls = a.state.policy_calls.lock().len();
    let stale = c
        .update_sandbox(replace(vec![egress(ALLOW_BUT_ONE)], 7))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::Aborted);
    assert_eq!(
        a.state.policy_calls.lock().len(),
        calls,
        "a refused update sends nothing"
    );
    let done = c
        .update_sandbox(replace(vec![egress(ALLOW_BUT_ONE)], 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.committed_generation, 2);
    assert_eq!(a.state.policy(&sid).as_deref(), Some(ALLOW_BUT_ONE));
    assert_eq!(
        bindings(&mut c, "eg").await[0].state,
        v2::ActionState::Ready as i32
    );
    c.update_sandbox(replace(vec![], 2)).await.unwrap();
    assert_eq!(
        a.state.policy(&sid).as_deref(),
        Some(""),
        "no egress item = allow all"
    );
    assert!(bindings(&mut c, "eg").await.is_empty());
    assert_eq!(
        native_get(&mut n, "eg")
            .await
            .spec
            .unwrap()
            .network_policy_json,
        ""
    );

    // A paused sandbox's policy can be replaced (rules live on the node).
    c.pause_sandbox(v2::PauseSandboxRequest {
        sandbox: reference("eg"),
        ..Default::default()
    })
    .await
    .unwrap();
    set_policy(&mut n, "eg", DENY_BUT_ONE).await.unwrap();
    assert_eq!(
        a.state.policy(&sid).as_deref(),
        Some(DENY_BUT_ONE_NORMALIZED)
    );

    // An agent that cannot enforce it: the record keeps the previous policy.
    a.state.refuse_policy_updates.store(true, SeqCst);
    let e = set_policy(&mut n, "eg", ALLOW_BUT_ONE).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    a.state.refuse_policy_updates.store(false, SeqCst);
    let s = native_get(&mut n, "eg").await;
    assert_eq!(s.spec.unwrap().network_policy_json, DENY_BUT_ONE_NORMALIZED);
    assert_eq!(
        bindings(&mut c, "eg").await[0].state,
        v2::ActionState::Ready as i32
    );
    h.shutdown().await;
}

/// Stand-in because: bad input must be refused by the controller before any
/// agent is asked, which only a stand-in that counts calls can show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_policies_and_handlers_are_invalid_argument_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Strong).await;
    let a = StandInAgent::start("agent-a", "default", 4, &[], h.local_addr(), HB).await;
    let (mut c, mut n) = (v2c(h.local_addr()).await, nativec(h.local_addr()).await);
    let cases: [(Vec<v2::ActionBinding>, &str); 4] = [
        (
            vec![v2::ActionBinding {
                handler: "ingress".into(),
                input: "{}".into(),
            }],
            "action_bindings[0].handler \"ingress\"",
        ),
        (vec![egress("{not json")], "action_bindings[0].input"),
        (
            vec![egress(r#"{"egress":[{"action":"allow","target":"a b"}]}"#)],
            "action_bindings[0].input: networkPolicy.egress[0].target",
        ),
        (
            vec![egress("{}"), egress(DENY_BUT_ONE)],
            "action_bindings[1]: a second \"egress\" binding",
        ),
    ];
    for (items, field) in cases {
        let mut req = create_req("bad", 0);
        req.action_bindings = items;
        let e = c.create_sandbox(req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(
            e.message().contains(field),
            "{} should name {field}",
            e.message()
        );
    }
    assert_eq!(a.state.creates.load(SeqCst), 0);

    c.create_sandbox(create_req("ok", 0)).await.unwrap();
    let e = set_policy(&mut n, "ok", r#"{"defaultAction":"maybe"}"#)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message()
            .contains("network_policy_json: networkPolicy.defaultAction"),
        "{}",
        e.message()
    );
    let e = c
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference("ok"),
            update: Some(v2::update_sandbox_request::Update::ActionBindings(
                v2::ReplaceActionBindings {
                    items: vec![v2::ActionBinding {
                        handler: "audit".into(),
                        input: String::new(),
                    }],
                },
            )),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("action_bindings.items[0].handler"),
        "{}",
        e.message()
    );
    assert!(a.state.policy_calls.lock().is_empty(), "no agent was asked");
    h.shutdown().await;
}

/// Stand-in because: it needs an agent that fails policy updates, falls
/// silent and loses a container on demand, and that reports exactly which
/// policy each of its sandboxes got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_agent_gets_the_recorded_policy_later() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), Consistency::Fast).await;
    let a = StandInAgent::start("agent-a", "default", 4, &[], h.local_addr(), HB).await;
    let (mut c, mut n) = (v2c(h.local_addr()).await, nativec(h.local_addr()).await);
    n.create_sandbox(native::CreateSandboxRequest {
        name: "out".into(),
        spec: Some(native::SandboxSpec {
            image: "busybox".into(),
            network_policy_json: ALLOW_BUT_ONE.into(),
            failure_policy: native::FailurePolicy::AutoRecreate as i32,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let sid = container_id(&native_get(&mut n, "out").await);
    assert_eq!(a.state.policy(&sid).as_deref(), Some(ALLOW_BUT_ONE));

    // 1. The agent fails the call: UNAVAILABLE, the record holds the policy,
    //    and the agent gets it with a later heartbeat.
    a.state.fail_policy_updates.store(true, SeqCst);
    let e = set_policy(&mut n, "out", DENY_BUT_ONE).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.message().contains("recorded"), "{}", e.message());
    let s = native_get(&mut n, "out").await;
    assert_eq!(s.generation, 2);
    assert_eq!(s.spec.unwrap().network_policy_json, DENY_BUT_ONE_NORMALIZED);
    assert_eq!(
        bindings(&mut c, "out").await[0].state,
        v2::ActionState::Pending as i32
    );
    assert_eq!(a.state.policy(&sid).as_deref(), Some(ALLOW_BUT_ONE));
    a.state.fail_policy_updates.store(false, SeqCst);
    let state = a.state.clone();
    sandbolt_test_support::eventually("the re-sent policy applied", Duration::from_secs(5), || {
        (state.policy(&sid).as_deref() == Some(DENY_BUT_ONE_NORMALIZED)).then_some(())
    })
    .await;
    sandbolt_test_support::eventually_async("binding ready", Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            (bindings(&mut c, "out").await[0].state == v2::ActionState::Ready as i32).then_some(())
        }
    })
    .await;

    // 2. The agent is silent: the update is recorded, the agent gets it when
    //    it heartbeats again.
    a.set_heartbeats(false);
    sandbolt_test_support::eventually_async("agent silent", Duration::from_secs(5), || {
        let mut n = n.clone();
        async move {
            let phase = native_get(&mut n, "out").await.status.unwrap().phase;
            (phase == native::Phase::Unknown as i32).then_some(())
        }
    })
    .await;
    let e = set_policy(&mut n, "out", "").await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(
        a.state.policy(&sid).as_deref(),
        Some(DENY_BUT_ONE_NORMALIZED)
    );
    a.set_heartbeats(true);
    let state = a.state.clone();
    sandbolt_test_support::eventually(
        "policy applied after silence",
        Duration::from_secs(5),
        || (state.policy(&sid).as_deref() == Some("")).then_some(()),
    )
    .await;

    // 3. Pending, then the container vanishes: AUTO_RECREATE's create carries
    //    the record's policy and the pending mark is cleared with it.
    a.state.fail_policy_updates.store(true, SeqCst);
    set_policy(&mut n, "out", ALLOW_BUT_ONE).await.unwrap_err();
    a.state.sandboxes.lock().remove(&sid);
    let new_sid = sandbolt_test_support::eventually_async(
        "sandbox recreated",
        Duration::from_secs(20),
        || {
            let mut n = n.clone();
            let sid = sid.clone();
            async move {
                let s = native_get(&mut n, "out").await;
                let now = container_id(&s);
                (now != sid && s.status.unwrap().phase == native::Phase::Running as i32)
                    .then_some(now)
            }
        },
    )
    .await;
    assert_eq!(a.state.policy(&new_sid).as_deref(), Some(ALLOW_BUT_ONE));
    assert_eq!(
        bindings(&mut c, "out").await[0].state,
        v2::ActionState::Ready as i32
    );
    h.shutdown().await;
}
