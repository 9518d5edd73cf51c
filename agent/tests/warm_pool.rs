//! Warm sandboxes on a real containerd: targets fill the buffer, a create
//! on a warm id claims it (the request's env, entrypoint, working dir,
//! limits and token), claimants never share anything, vanished ids and
//! identity mismatches, refill, capacity and target trims, agent restart,
//! and the janitor's warm rule.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use parking_lot::Mutex;
use sandbolt_janitor::rules::{
    AgentFacts, ContainerFacts, OwnershipAnswer, OwnershipReport, RecordState,
};
use sandbolt_janitor::{
    Janitor, JanitorConfig, KeepReason, OwnershipSource, ReapNotice, ReapReason,
};
use sandbolt_proto::agent::v1::registry_service_server::{RegistryService, RegistryServiceServer};
use sandbolt_proto::agent::v1::{
    EnrollRequest, EnrollResponse, GetInventoryRequest, GetOwnershipRequest, GetOwnershipResponse,
    HeartbeatRequest, HeartbeatResponse, Inventory, ReportReapedRequest, ReportReapedResponse,
    Resources, SandboxPhase, SandboxSpec, WarmClass, WarmTarget,
};
use tonic::Code;

const POOL: &str = "py";

fn class() -> WarmClass {
    WarmClass {
        warm_pool: POOL.into(),
        image: "busybox".into(),
        runtime: String::new(),
        // The template's limits: the claim's replace them.
        resources: Some(Resources {
            memory: "32Mi".into(),
            pids_limit: 50,
            ..Default::default()
        }),
    }
}

fn targets(count: i32) -> Vec<WarmTarget> {
    vec![WarmTarget {
        class: Some(class()),
        count,
    }]
}

fn fast(cfg: &mut sandbolt_agent::AgentConfig) {
    cfg.warm_pool_interval = Duration::from_millis(200);
    cfg.warm_refill_pause = Duration::from_millis(10);
}

async fn inventory(env: &Env) -> Inventory {
    env.client
        .clone()
        .get_inventory(GetInventoryRequest {})
        .await
        .expect("inventory")
        .into_inner()
}

/// Waits until the agent holds exactly `n` claimable warm sandboxes, starts
/// none and removes none (an exited or trimmed one leaves the inventory at
/// once, the agent's table only once its container is gone); returns their
/// ids.
async fn wait_warm(env: &Env, n: usize) -> BTreeSet<String> {
    eventually_async(&format!("{n} warm sandboxes"), WAIT, || async {
        let inv = inventory(env).await;
        let starting: i32 = inv.warm_starting.values().sum();
        let held = env.agent().sandboxes().warm_sandboxes().len();
        (inv.warm.len() == n && starting == 0 && held == n).then(|| {
            inv.warm
                .iter()
                .map(|w| w.sandbox_id.clone())
                .collect::<BTreeSet<_>>()
        })
    })
    .await
}

/// The containers carrying the warm-pool label.
fn warm_containers(env: &Env) -> BTreeSet<String> {
    env.ctr(&["containers", "list", "-q"])
        .lines()
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .filter(|id| labels_of(env, id).get("io.sandbolt.warm-pool").is_some())
        .map(String::from)
        .collect()
}

fn labels_of(env: &Env, id: &str) -> serde_json::Map<String, serde_json::Value> {
    let info: serde_json::Value = serde_json::from_str(&env.ctr(&["containers", "info", id]))
        .unwrap_or(serde_json::Value::Null);
    info["Labels"].as_object().cloned().unwrap_or_default()
}

/// A claim: the entrypoint writes what it was given (env, working dir,
/// the cgroup limits it runs under) to /tmp/claim.out, and a file only this
/// claimant has.
fn claim_spec(id: &str, who: &str) -> SandboxSpec {
    let script = format!(
        "{{ echo greeting=$GREETING; echo cwd=$(pwd); echo token=$EXECD_ACCESS_TOKEN; \
         echo mem=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes); \
         echo pids=$(cat /sys/fs/cgroup/pids/pids.max); \
         echo quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us); }} > /tmp/claim.tmp; \
         echo {who} > /tmp/only-{who}; mv /tmp/claim.tmp /tmp/claim.out; exec sleep 100000"
    );
    let mut s = sh_spec(id, &script);
    s.name = format!("claimant-{who}");
    s.record_uid = format!("uid-{who}");
    s.envs.insert("GREETING".into(), format!("hello-{who}"));
    s.working_dir = "/tmp".into();
    s.wait_for_execd = true;
    s.resources = Some(Resources {
        cpu: "500m".into(),
        memory: "64Mi".into(),
        pids_limit: 77,
        ..Default::default()
    });
    s
}

/// What the claimant's entrypoint wrote, read through its root.
async fn claim_output(pid: u32) -> String {
    let path = format!("/proc/{pid}/root/tmp/claim.out");
    eventually_async("the entrypoint's output", WAIT, || {
        let path = path.clone();
        async move { std::fs::read_to_string(&path).ok() }
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn warm_sandboxes_fill_are_claimed_refilled_and_trimmed() {
    let mut env = Env::start_with(|cfg| {
        fast(cfg);
        cfg.max_sandboxes = 4;
    })
    .await;
    let mut seen: BTreeSet<String> = BTreeSet::new();
    // Nothing before the first targets.
    assert!(inventory(&env).await.warm.is_empty());
    env.agent().set_warm_targets(targets(2));
    let first = wait_warm(&env, 2).await;
    seen.extend(first.iter().cloned());
    let inv = inventory(&env).await;
    assert!(inv.sandboxes.is_empty(), "warm ones are not sandboxes");
    let w = &inv.warm[0];
    assert!(w.sandbox_id.starts_with("sb-"), "{}", w.sandbox_id);
    let c = w.class.clone().unwrap();
    assert_eq!(
        (c.warm_pool.as_str(), c.image.as_str(), c.runtime.as_str()),
        (POOL, "docker.io/library/busybox:latest", "runc")
    );
    let labels = labels_of(&env, &w.sandbox_id);
    assert_eq!(labels["io.sandbolt.warm-pool"], POOL);
    assert_eq!(
        labels["io.sandbolt.agent-instance"],
        env.agent().instance_id()
    );

    let (a, b) = claim_two(&mut env, &first).await;
    check_isolation(&a, &b);

    // Refilled with new ids.
    let second = wait_warm(&env, 2).await;
    assert!(second.is_disjoint(&first), "{first:?} / {second:?}");
    seen.extend(second.iter().cloned());
    check_identity(&mut env, &a.0).await;

    // A trimmed (vanished) warm id is a cold create under that id.
    env.agent().set_warm_targets(targets(1));
    let third = wait_warm(&env, 1).await;
    let vanished = second.difference(&third).next().unwrap().clone();
    assert_eq!(leftovers(&env, &vanished), Vec::<String>::new());
    let cold = env
        .create(claim_spec(&vanished, "c"))
        .await
        .expect("create on a vanished warm id");
    assert!(!cold.claimed_warm);
    let st = cold.status.unwrap();
    assert_eq!(st.phase(), SandboxPhase::Running);
    assert!(claim_output(st.pid).await.contains("greeting=hello-c"));

    check_capacity(&mut env, &mut seen).await;

    // Drained: no warm container left.
    env.agent().set_warm_targets(vec![]);
    wait_warm(&env, 0).await;
    assert!(warm_containers(&env).is_empty());
    for id in [&a.0, &b.0, &vanished] {
        assert!(env.delete_leaving_nothing(id, 0).await);
    }
    for id in &seen {
        assert_eq!(leftovers(&env, id), Vec::<String>::new(), "{id}");
    }
    env.shutdown().await;
}

/// Claims two warm sandboxes for two claimants; returns (id, pid) of each.
async fn claim_two(env: &mut Env, warm: &BTreeSet<String>) -> ((String, u32), (String, u32)) {
    let mut out = Vec::new();
    for (id, who) in warm.iter().zip(["a", "b"]) {
        let resp = env.create(claim_spec(id, who)).await.expect("claim");
        assert!(resp.claimed_warm, "{id} claimed");
        assert!(resp.timings.unwrap().claimed_us > 0);
        let st = resp.status.unwrap();
        assert_eq!(
            (st.sandbox_id.as_str(), st.name.as_str(), st.phase()),
            (
                id.as_str(),
                format!("claimant-{who}").as_str(),
                SandboxPhase::Running
            )
        );
        assert_eq!(st.record_uid, format!("uid-{who}"));
        let out_text = claim_output(st.pid).await;
        for want in [
            format!("greeting=hello-{who}"),
            "cwd=/tmp".into(),
            // execd keeps its token from user processes, as in a cold create.
            "token=".into(),
            format!("mem={}", 64 << 20),
            "pids=77".into(),
            "quota=50000".into(),
        ] {
            assert!(out_text.lines().any(|l| l == want), "{want} in {out_text}");
        }
        // execd answers the request's token (/ping checks none).
        for (token, want) in [(format!("token-{id}"), 200), ("warm-or-wrong".into(), 401)] {
            let netns = sandbolt_agent::netns::NetnsHandle::of_process(st.pid).unwrap();
            let code = sandbolt_agent::netns::http_get_status(
                &sandbolt_agent::proxy::Upstream::Namespace(Arc::new(netns)),
                sandbolt_proto::wire::EXECD_PORT,
                "/files/info?path=/",
                &[(sandbolt_proto::wire::EXECD_TOKEN_HEADER, &token)],
                Duration::from_secs(5),
            )
            .await
            .expect("execd answers");
            assert_eq!(code, want, "{token}");
        }
        // The labels are a cold create's: the warm ones are gone.
        let labels = labels_of(env, id);
        assert!(labels.get("io.sandbolt.warm-pool").is_none(), "{labels:?}");
        assert!(labels.get("io.sandbolt.agent-instance").is_none());
        assert_eq!(labels["io.sandbolt.name"], format!("claimant-{who}"));
        assert_eq!(labels["io.sandbolt.record-uid"], format!("uid-{who}"));
        out.push((id.clone(), st.pid));
    }
    let inv = inventory(env).await;
    let listed: BTreeSet<_> = inv.sandboxes.iter().map(|s| s.sandbox_id.clone()).collect();
    assert_eq!(&listed, warm, "claimed ones are sandboxes now");
    assert!(inv.warm.iter().all(|w| !warm.contains(&w.sandbox_id)));
    (out[0].clone(), out[1].clone())
}

/// Each claimant sees only its own files.
fn check_isolation(a: &(String, u32), b: &(String, u32)) {
    let root = |pid: u32| std::path::PathBuf::from(format!("/proc/{pid}/root/tmp"));
    assert!(root(a.1).join("only-a").exists());
    assert!(root(b.1).join("only-b").exists());
    assert!(!root(b.1).join("only-a").exists(), "A's file seen by B");
    assert!(!root(a.1).join("only-b").exists(), "B's file seen by A");
}

/// A re-driven create of a claimed id is idempotent for the same identity,
/// ALREADY_EXISTS for another.
async fn check_identity(env: &mut Env, id: &str) {
    let again = env
        .create(claim_spec(id, "a"))
        .await
        .expect("same identity");
    assert!(!again.claimed_warm);
    let st = again.status.unwrap();
    assert_eq!(
        (st.name.as_str(), st.phase()),
        ("claimant-a", SandboxPhase::Running)
    );
    let mut other_name = claim_spec(id, "a");
    other_name.name = "someone-else".into();
    let mut other_uid = claim_spec(id, "a");
    other_uid.record_uid = "uid-other".into();
    for spec in [other_name, other_uid] {
        let err = env.create(spec).await.unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    }
    let mut no_uid = claim_spec(id, "a");
    no_uid.record_uid.clear();
    env.create(no_uid).await.expect("no uid to compare");
}

/// max_sandboxes is 4 and 3 user sandboxes run: one warm fits, a create
/// beyond makes the pool trim it, and a delete makes room again.
async fn check_capacity(env: &mut Env, seen: &mut BTreeSet<String>) {
    env.agent().set_warm_targets(targets(2));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let one = wait_warm(env, 1).await;
    seen.extend(one.iter().cloned());
    let extra = spec("sb-extra", &["sleep", "100000"]);
    env.create(extra).await.expect("a 4th user sandbox fits");
    wait_warm(env, 0).await;
    assert!(env.delete_leaving_nothing("sb-extra", 0).await);
    let refilled = wait_warm(env, 1).await;
    seen.extend(refilled.iter().cloned());
}

/// The janitor's view of ownership: no records; the agent heartbeats with
/// the instance id the test sets.
struct Owner {
    instance: Mutex<String>,
}

#[tonic::async_trait]
impl OwnershipSource for Owner {
    async fn ownership(
        &self,
        _node_name: &str,
        queries: &[ContainerFacts],
    ) -> sandbolt_janitor::Result<OwnershipReport> {
        let agent = AgentFacts {
            agent_id: "agent-test".into(),
            registered: true,
            heartbeating: true,
            instance_id: self.instance.lock().clone(),
            ..Default::default()
        };
        Ok(OwnershipReport {
            ready: true,
            answers: queries
                .iter()
                .map(|q| OwnershipAnswer {
                    sandbox_id: q.sandbox_id.clone(),
                    record: RecordState::Absent,
                    agent: agent.clone(),
                    ..Default::default()
                })
                .collect(),
            agents: vec![agent],
            fast_commit_deadline_ms: 0,
        })
    }

    async fn report_reaped(&self, _reaped: &ReapNotice<'_>) -> sandbolt_janitor::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_replaces_warm_sandboxes_and_the_janitor_reaps_only_old_instances() {
    let mut env = Env::start_with(fast).await;
    env.agent().set_warm_targets(targets(2));
    let first = wait_warm(&env, 2).await;
    let first_instance = env.agent().instance_id().to_string();
    let owner = Arc::new(Owner {
        instance: Mutex::new(first_instance.clone()),
    });
    let mut jcfg = JanitorConfig::new(
        "node-test",
        env.bed.containerd_socket(),
        "http://127.0.0.1:1",
        TOKEN,
        env.state.path().join("janitor"),
    );
    jcfg.grace_period = Duration::ZERO;
    jcfg.agent_state_dir = Some(env.state.path().to_path_buf());
    let janitor = Janitor::with_source(jcfg, owner.clone())
        .await
        .expect("janitor");

    // The live agent process's warm sandboxes are kept.
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    for id in &first {
        assert_eq!(r.kept_reason(id), Some(KeepReason::WarmOwned), "{r:?}");
    }

    // A restarted agent removes them before it serves, and refills once it
    // has targets again.
    env.restart_agent(fast).await;
    assert_ne!(env.agent().instance_id(), first_instance);
    for id in &first {
        assert_eq!(leftovers(&env, id), Vec::<String>::new(), "{id}");
    }
    assert!(inventory(&env).await.warm.is_empty(), "no targets yet");
    env.agent().set_warm_targets(targets(2));
    let second = wait_warm(&env, 2).await;
    assert!(second.is_disjoint(&first));

    // Warm sandboxes whose instance is not the heartbeating one are
    // orphans: reaped, and the agent replaces them.
    *owner.instance.lock() = first_instance.clone();
    let r = janitor.scan_once().await.expect("scan");
    let reaped: BTreeSet<(String, ReapReason)> = r
        .reaped
        .iter()
        .map(|x| (x.sandbox_id.clone(), x.reason))
        .collect();
    let want: BTreeSet<_> = second
        .iter()
        .map(|id| (id.clone(), ReapReason::WarmOrphan))
        .collect();
    // The agent removes a reaped one as soon as its task exits: a removal
    // racing the janitor's fails there and is finished by the agent.
    assert!(!reaped.is_empty() && reaped.is_subset(&want), "{r:?}");
    for id in &second {
        let handled = reaped.iter().any(|(r, _)| r == id)
            || r.errors.iter().any(|e| e.starts_with(id.as_str()));
        assert!(handled, "{id}: {r:?}");
    }
    assert!(r.kept.is_empty(), "{r:?}");
    let third = wait_warm(&env, 2).await;
    for id in &second {
        assert_eq!(leftovers(&env, id), Vec::<String>::new(), "{id}");
    }
    assert!(third.is_disjoint(&second));
    *owner.instance.lock() = env.agent().instance_id().to_string();
    let r = janitor.scan_once().await.expect("scan");
    // Only the journal of a removal the agent finished first may remain
    // to be closed; the live process's warm sandboxes are kept.
    assert!(
        r.reaped
            .iter()
            .all(|x| x.leftover && second.contains(&x.sandbox_id)),
        "{r:?}"
    );
    for id in &third {
        assert_eq!(r.kept_reason(id), Some(KeepReason::WarmOwned), "{r:?}");
    }

    env.agent().set_warm_targets(vec![]);
    wait_warm(&env, 0).await;
    for id in first.iter().chain(&second).chain(&third) {
        assert_eq!(leftovers(&env, id), Vec::<String>::new(), "{id}");
    }
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_that_fails_half_way_becomes_a_cold_create_under_the_same_id() {
    let mut env = Env::start_with(|cfg| {
        fast(cfg);
        // The claim's call to execd gives up after this.
        cfg.execd_ready_timeout = Duration::from_secs(3);
    })
    .await;
    env.agent().set_warm_targets(targets(1));
    let warm = wait_warm(&env, 1).await;
    let id = warm.first().unwrap().clone();
    // Frozen behind the agent's back: execd cannot answer the claim, after
    // the claim has already rewritten labels and limits.
    env.ctr(&["tasks", "pause", &id]);
    let resp = env.create(claim_spec(&id, "a")).await.expect("create");
    assert!(!resp.claimed_warm, "served by a cold create");
    let st = resp.status.unwrap();
    assert_eq!(
        (st.sandbox_id.as_str(), st.phase()),
        (id.as_str(), SandboxPhase::Running)
    );
    let out = claim_output(st.pid).await;
    assert!(out.lines().any(|l| l == "greeting=hello-a"), "{out}");
    assert!(out.lines().any(|l| l == "pids=77"), "{out}");
    let labels = labels_of(&env, &id);
    assert!(labels.get("io.sandbolt.warm-pool").is_none(), "{labels:?}");
    // The buffer is refilled with another id.
    let refilled = wait_warm(&env, 1).await;
    assert!(!refilled.contains(&id));

    env.agent().set_warm_targets(vec![]);
    wait_warm(&env, 0).await;
    assert!(env.delete_leaving_nothing(&id, 0).await);
    for w in &refilled {
        assert_eq!(leftovers(&env, w), Vec::<String>::new(), "{w}");
    }
    env.shutdown().await;
}

/// A controller's RegistryService whose answers carry warm targets.
#[derive(Default, Clone)]
struct Registry {
    /// `Some`: answers set these targets; `None`: answers leave them.
    targets: Arc<Mutex<Option<Vec<WarmTarget>>>>,
    inventories: Arc<Mutex<Vec<Inventory>>>,
}

#[tonic::async_trait]
impl RegistryService for Registry {
    async fn heartbeat(
        &self,
        request: tonic::Request<HeartbeatRequest>,
    ) -> Result<tonic::Response<HeartbeatResponse>, tonic::Status> {
        let inv = request.into_inner().inventory.unwrap_or_default();
        self.inventories.lock().push(inv);
        let targets = self.targets.lock().clone();
        Ok(tonic::Response::new(HeartbeatResponse {
            interval_ms: 100,
            warm_targets_set: targets.is_some(),
            warm_targets: targets.unwrap_or_default(),
        }))
    }

    async fn report_reaped(
        &self,
        _request: tonic::Request<ReportReapedRequest>,
    ) -> Result<tonic::Response<ReportReapedResponse>, tonic::Status> {
        Ok(tonic::Response::new(ReportReapedResponse {}))
    }

    async fn get_ownership(
        &self,
        _request: tonic::Request<GetOwnershipRequest>,
    ) -> Result<tonic::Response<GetOwnershipResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not part of this test"))
    }

    async fn enroll(
        &self,
        request: tonic::Request<EnrollRequest>,
    ) -> Result<tonic::Response<EnrollResponse>, tonic::Status> {
        Ok(tonic::Response::new(EnrollResponse {
            credential: format!("cred-{}", request.into_inner().agent_id),
        }))
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heartbeat_answers_set_the_targets_and_heartbeats_report_the_buffer() {
    let registry = Registry::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistryServiceServer::new(registry.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let env = Env::start_with(|cfg| {
        fast(cfg);
        cfg.controller_endpoint = Some(format!("http://{addr}"));
        cfg.heartbeat_interval = Duration::from_millis(100);
    })
    .await;
    // Answers without targets: nothing is started.
    let seen = registry.inventories.clone();
    eventually("a few heartbeats", WAIT, || {
        (seen.lock().len() >= 3).then_some(())
    })
    .await;
    assert!(env.agent().warm_pool().targets().is_none());
    assert!(inventory(&env).await.warm.is_empty());

    *registry.targets.lock() = Some(targets(2));
    let ids = wait_warm(&env, 2).await;
    let reported = eventually("a heartbeat reporting the buffer", WAIT, || {
        seen.lock()
            .iter()
            .rev()
            .find(|inv| inv.warm.len() == 2)
            .map(|inv| {
                inv.warm
                    .iter()
                    .map(|w| w.sandbox_id.clone())
                    .collect::<BTreeSet<_>>()
            })
    })
    .await;
    assert_eq!(reported, ids);

    // Answers without `warm_targets_set` leave the targets as they were.
    *registry.targets.lock() = None;
    let n = seen.lock().len();
    eventually("more heartbeats", WAIT, || {
        (seen.lock().len() >= n + 3).then_some(())
    })
    .await;
    assert_eq!(wait_warm(&env, 2).await, ids);

    // An empty set drains.
    *registry.targets.lock() = Some(vec![]);
    wait_warm(&env, 0).await;
    for id in &ids {
        assert_eq!(leftovers(&env, id), Vec::<String>::new(), "{id}");
    }
    env.shutdown().await;
    server.abort();
}

/// Runs `body` on its own runtime; after a panic, removes what the agent's
/// networking left on the host (as agent/tests/network.rs does).
fn cleaning_up<F: Future<Output = ()>>(body: impl FnOnce(std::path::PathBuf) -> F) {
    let state = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let path = state.path().to_path_buf();
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(body(path))));
    rt.shutdown_timeout(Duration::from_secs(10));
    if let Err(panic) = outcome {
        let cni = std::path::Path::new(sandbolt_agent::config::DEFAULT_CNI_BIN_DIR);
        if let Err(e) = sandbolt_agent::network::purge(state.path(), cni) {
            eprintln!("purge after the failed test: {e}");
        }
        std::panic::resume_unwind(panic);
    }
}

/// The pid of `id`'s task, from containerd.
fn task_pid(bed: &sandbolt_testbed::Testbed, id: &str) -> u32 {
    let tasks = bed.ctr_output(NS, &["tasks", "list"]).unwrap();
    tasks
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(id)).then(|| f.next()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no task {id} in {tasks}"))
}

#[test]
fn a_claim_brings_its_network_policy_to_the_warm_sandbox() {
    cleaning_up(warm_network_in);
}

async fn warm_network_in(state: std::path::PathBuf) {
    use sandbolt_test_support::nethost::{
        DocRange, PORT, TestHost, connects_in_netns, fetch_in_netns,
    };
    let host = TestHost::start(DocRange::TestNet3);
    let addr = std::net::SocketAddr::from((host.addr(), PORT));
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let mut cfg = config(&bed, &state, "agent-warm-net");
    fast(&mut cfg);
    let mut net = sandbolt_agent::config::NetworkConfig::new(vec!["127.0.0.1:9".parse().unwrap()]);
    net.pool_size = 1;
    cfg.network = Some(net);
    let agent = sandbolt_agent::Agent::start(cfg)
        .await
        .expect("agent starts");
    let mut c = client(agent.grpc_addr(), TOKEN).await;
    let net = agent.sandboxes().network().unwrap().clone();
    let (table, subnet) = (net.table_name().to_string(), net.subnet());
    agent.set_warm_targets(targets(2));
    let warm: Vec<String> = eventually_async("2 warm sandboxes", WAIT, || async {
        let inv = agent.inventory().await.unwrap();
        let ids: Vec<String> = inv.warm.iter().map(|w| w.sandbox_id.clone()).collect();
        (ids.len() == 2 && inv.warm_starting.values().sum::<i32>() == 0).then_some(ids)
    })
    .await;
    let netns = |pid: u32| std::path::PathBuf::from(format!("/proc/{pid}/ns/net"));
    let in_ns = |pid: u32| {
        let ns = netns(pid);
        move || (fetch_in_netns(&ns, addr), connects_in_netns(&ns, addr))
    };
    // Warm: the egress of a create without a policy (node isolation only).
    let pid = task_pid(&bed, &warm[1]);
    let (fetched, _) = tokio::task::spawn_blocking(in_ns(pid)).await.unwrap();
    assert_eq!(fetched, Some(host.line()), "a warm sandbox's egress");

    let deny_all = r#"{"defaultAction":"deny","egress":[]}"#;
    let mut statuses = Vec::new();
    for (id, (who, policy)) in warm.iter().zip([("a", ""), ("b", deny_all)]) {
        let mut s = claim_spec(id, who);
        s.network_policy_json = policy.into();
        let resp = c
            .create_sandbox(create_req(s))
            .await
            .expect("claim")
            .into_inner();
        assert!(resp.claimed_warm);
        let st = resp.status.unwrap();
        assert!(!st.ip_address.is_empty(), "{st:?}");
        statuses.push(st);
    }
    let (fetched, _) = tokio::task::spawn_blocking(in_ns(statuses[0].pid))
        .await
        .unwrap();
    assert_eq!(fetched, Some(host.line()), "allow-all after the claim");
    let (_, connects) = tokio::task::spawn_blocking(in_ns(statuses[1].pid))
        .await
        .unwrap();
    assert!(!connects, "the claim's deny-all");

    agent.set_warm_targets(vec![]);
    let mut left = Vec::new();
    eventually_async("the buffer drained", WAIT, || async {
        let inv = agent.inventory().await.unwrap();
        (inv.warm.is_empty() && agent.sandboxes().warm_sandboxes().is_empty()).then_some(())
    })
    .await;
    for st in &statuses {
        delete(&mut c, &st.sandbox_id, 0).await;
    }
    agent.shutdown().await;
    let all = warm.iter().chain(statuses.iter().map(|s| &s.sandbox_id));
    for id in all {
        left.extend(leftovers_in(&bed, &state, id));
    }
    // A graceful stop with no sandbox left removes all networking.
    let nft = std::process::Command::new("nft")
        .args(["list", "table", "inet", &table])
        .output()
        .unwrap();
    if nft.status.success() {
        left.push(format!("nft table {table}"));
    }
    for dir in ["network/netns", "network/members"] {
        for e in std::fs::read_dir(state.join(dir))
            .into_iter()
            .flatten()
            .flatten()
        {
            left.push(format!("{dir}/{}", e.file_name().to_string_lossy()));
        }
    }
    let lock = std::path::Path::new(sandbolt_agent::network::subnet::CLAIMS_DIR)
        .join(format!("{}.lock", subnet.slug()));
    if lock.exists() {
        left.push(format!("subnet lock {}", lock.display()));
    }
    assert_eq!(left, Vec::<String>::new());
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
