//! `kill -9` of the controller at the two dangerous points, and across an
//! expiry, with real components only: the controller is a child process
//! (`sandbolt controller`) on a fixed address over its redb store; the agent
//! is the real one (`sandbolt_agent::Agent`) on a test bed (private
//! containerd, busybox, static execd as PID 1), and it re-heartbeats to the
//! restarted controller on that same address. Containers are counted
//! through containerd itself, never through the controller or the agent.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use backon::{ConstantBuilder, Retryable};
use sandbolt_agent::AgentHandle;
use sandbolt_e2e::bed::busybox_create as req;
use sandbolt_e2e::bed::{
    V2, connect as client, containers, eventually, free_port, ping_execd, reference, running_tasks,
    sandbox_id, start_agent, start_bed, wait_agents,
};
use sandbolt_e2e::controller_process::ControllerProcess;
use sandbolt_proto::fastpath::v2;
use sandbolt_test_support::now_unix_secs as now;
use sandbolt_testbed::Testbed;
use tonic::Code;

const TOKEN: &str = "crash-restart-agent-token";
/// Slots on the one agent: two, so "no double allocation" is observable.
const CAPACITY: u32 = 2;
const WAIT: Duration = Duration::from_secs(30);

/// The controller binary the tests start and kill.
fn sandbolt() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_e2e-sandbolt"))
}

/// Creates `r`, retried for up to [`WAIT`] while the answer is one of
/// `retry_on`.
async fn create_retrying(
    c: &V2,
    r: v2::CreateSandboxRequest,
    retry_on: &[Code],
    every: Duration,
) -> Result<v2::CreateSandboxResponse, tonic::Status> {
    let attempts = usize::try_from(WAIT.as_millis() / every.as_millis()).unwrap_or(usize::MAX);
    (|| {
        let (mut c, r) = (c.clone(), r.clone());
        async move { c.create_sandbox(r).await.map(tonic::Response::into_inner) }
    })
    .retry(
        ConstantBuilder::default()
            .with_delay(every)
            .with_max_times(attempts),
    )
    .when(|e: &tonic::Status| retry_on.contains(&e.code()))
    .await
}

/// Retries while the restarted controller waits for its agents (writes
/// answer UNAVAILABLE until the registry is complete).
async fn create_when_ready(
    c: &mut V2,
    r: v2::CreateSandboxRequest,
) -> Result<v2::CreateSandboxResponse, tonic::Status> {
    create_retrying(c, r, &[Code::Unavailable], Duration::from_millis(50)).await
}

/// Waits (off the runtime) until the controller reached its failpoint, then
/// SIGKILLs it; returns the failpoint's marker line.
async fn kill_at_failpoint(mut ctl: ControllerProcess) -> String {
    tokio::task::spawn_blocking(move || {
        let marker = ctl.wait_failpoint(WAIT);
        ctl.kill9();
        marker
    })
    .await
    .expect("the wait does not panic")
}

async fn get(c: &mut V2, name: &str) -> Result<v2::GetSandboxResponse, tonic::Status> {
    c.get_sandbox(v2::GetSandboxRequest {
        sandbox: reference(name),
        expected_generation: 0,
    })
    .await
    .map(|r| r.into_inner())
}

/// Test bed, store directory, fixed controller address, one real agent.
struct Env {
    bed: Testbed,
    data: tempfile::TempDir,
    _state: tempfile::TempDir,
    listen: SocketAddr,
    agent: Option<AgentHandle>,
}

impl Env {
    async fn start(mode: &str, failpoint: Option<&str>) -> (Env, ControllerProcess) {
        let bed = start_bed().await;
        let data = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let listen = free_port();
        let ctl = ControllerProcess::start_embedded(
            sandbolt(),
            data.path(),
            listen,
            mode,
            failpoint,
            TOKEN,
        );
        let agent = start_agent(
            &bed,
            "agent-a",
            state.path(),
            listen,
            TOKEN,
            CAPACITY,
            Duration::from_millis(100),
        )
        .await;
        wait_agents(&client(listen).await, 1).await;
        let env = Env {
            bed,
            data,
            _state: state,
            listen,
            agent: Some(agent),
        };
        (env, ctl)
    }

    /// A new controller process on the same address and store.
    fn restart(&self, mode: &str) -> ControllerProcess {
        ControllerProcess::start_embedded(
            sandbolt(),
            self.data.path(),
            self.listen,
            mode,
            None,
            TOKEN,
        )
    }

    async fn stop(mut self) {
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
    }
}

/// Acknowledged sandbox: same container, same task (not recreated), and
/// execd answers through the agent's proxy.
async fn assert_intact(env: &Env, c: &mut V2, name: &str, sid: &str, pid: u32) {
    let got = get(c, name).await.unwrap();
    let info = got.sandbox.unwrap();
    assert!(info.ready, "{name} is ready: {info:?}");
    assert_eq!(sandbox_id(c, name).await, sid, "{name} keeps its container");
    let tasks = running_tasks(&env.bed).await;
    assert_eq!(
        tasks.get(sid),
        Some(&pid),
        "{name}'s task still runs, not restarted: {tasks:?}"
    );
    let (ep, status) = ping_execd(c, name).await;
    assert_eq!(status, 200, "execd of {name} answers through {ep}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strong_killed_between_record_and_container() {
    let (env, ctl) = Env::start("strong", Some("strong-after-record:victim")).await;
    let mut c = client(env.listen).await;
    create_when_ready(&mut c, req("acked", 0)).await.unwrap();
    let acked_uid = get(&mut c, "acked")
        .await
        .unwrap()
        .sandbox
        .unwrap()
        .identity
        .unwrap()
        .uid;
    let acked_sid = sandbox_id(&mut c, "acked").await;
    let acked_pid = running_tasks(&env.bed).await[&acked_sid];

    let mut c2 = c.clone();
    let pending = tokio::spawn(async move { c2.create_sandbox(req("victim", 0)).await });
    let marker = kill_at_failpoint(ctl).await;
    assert!(marker.contains("strong-after-record victim"), "{marker}");
    assert!(
        pending.await.unwrap().is_err(),
        "the victim was never acknowledged"
    );
    assert_eq!(
        containers(&env.bed).await,
        vec![acked_sid.clone()],
        "killed after the record, before the agent was called: no victim container"
    );

    let _ctl = env.restart("strong");
    let mut c = client(env.listen).await;
    // The victim's committed record holds its slot: acked + victim fill the
    // agent's two slots, so a third sandbox is refused, not double-booked.
    let extra = create_when_ready(&mut c, req("extra", 0))
        .await
        .unwrap_err();
    assert_eq!(extra.code(), Code::ResourceExhausted, "{extra:?}");
    let got = get(&mut c, "acked").await.unwrap();
    assert_eq!(got.sandbox.unwrap().identity.unwrap().uid, acked_uid);
    assert_intact(&env, &mut c, "acked", &acked_sid, acked_pid).await;

    // The committed record is re-driven to a container; a client retry of
    // the same request gets that sandbox, not a second one.
    eventually("victim re-driven to a container", WAIT, || async {
        containers(&env.bed).await.len() == 2
    })
    .await;
    let retry = create_when_ready(&mut c, req("victim", 0)).await.unwrap();
    assert!(retry.sandbox.unwrap().ready);
    let victim_sid = sandbox_id(&mut c, "victim").await;
    let mut expected = vec![acked_sid.clone(), victim_sid.clone()];
    expected.sort();
    assert_eq!(containers(&env.bed).await, expected);
    assert!(running_tasks(&env.bed).await.contains_key(&victim_sid));
    let (_, status) = ping_execd(&mut c, "victim").await;
    assert_eq!(status, 200, "the re-driven victim's execd answers");
    let extra = c.create_sandbox(req("extra", 0)).await.unwrap_err();
    assert_eq!(extra.code(), Code::ResourceExhausted, "{extra:?}");
    assert_eq!(containers(&env.bed).await.len(), CAPACITY as usize);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_killed_between_container_and_record() {
    let (env, ctl) = Env::start("fast", Some("fast-after-create:victim")).await;
    let mut c = client(env.listen).await;
    create_when_ready(&mut c, req("acked", 0)).await.unwrap();
    let acked_sid = sandbox_id(&mut c, "acked").await;
    let acked_pid = running_tasks(&env.bed).await[&acked_sid];

    let mut c2 = c.clone();
    let pending = tokio::spawn(async move { c2.create_sandbox(req("victim", 0)).await });
    let marker = kill_at_failpoint(ctl).await;
    assert!(marker.contains("fast-after-create victim"), "{marker}");
    assert!(pending.await.unwrap().is_err(), "never acknowledged");
    let before = containers(&env.bed).await;
    assert_eq!(
        before.len(),
        2,
        "the victim's container exists without a record: {before:?}"
    );
    let orphan = before.iter().find(|id| **id != acked_sid).unwrap().clone();

    let _ctl = env.restart("fast");
    let mut c = client(env.listen).await;
    // No record owns the orphan: the restarted controller removes it.
    eventually("orphan container removed", WAIT, || async {
        containers(&env.bed).await == vec![acked_sid.clone()]
    })
    .await;
    assert!(!running_tasks(&env.bed).await.contains_key(&orphan));
    let e = get(&mut c, "victim").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_intact(&env, &mut c, "acked", &acked_sid, acked_pid).await;

    // The freed slot is usable (once the agent stops reporting the orphan);
    // the agent never holds more than its capacity.
    let extra = create_retrying(
        &c,
        req("extra", 0),
        // Full until the agent stops reporting the orphan.
        &[Code::Unavailable, Code::ResourceExhausted],
        Duration::from_millis(100),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:?}"));
    assert!(extra.sandbox.unwrap().ready);
    let (_, status) = ping_execd(&mut c, "extra").await;
    assert_eq!(status, 200);
    assert_eq!(containers(&env.bed).await.len(), CAPACITY as usize);
    let full = c.create_sandbox(req("one-more", 0)).await.unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    env.stop().await;
}

/// The expiry lives in the store: a controller SIGKILLed before a sandbox
/// expires still deletes it (record and container) after its restart; a
/// manual-cleanup sandbox beside it is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_survives_kill_and_restart() {
    let (env, ctl) = Env::start("strong", None).await;
    let mut c = client(env.listen).await;
    let expires = now() + 5;
    create_when_ready(&mut c, req("short", expires))
        .await
        .unwrap();
    create_when_ready(&mut c, req("forever", 0)).await.unwrap();
    let forever_sid = sandbox_id(&mut c, "forever").await;
    let forever_pid = running_tasks(&env.bed).await[&forever_sid];
    assert_eq!(containers(&env.bed).await.len(), 2);
    assert!(
        now() < expires,
        "test precondition: the controller must die before the expiry passes"
    );
    let mut ctl = ctl;
    ctl.kill9();
    assert_eq!(
        containers(&env.bed).await.len(),
        2,
        "nothing deleted before the restart"
    );

    let _ctl = env.restart("strong");
    let mut c = client(env.listen).await;
    eventually("expired sandbox deleted after restart", WAIT, || {
        let mut c = c.clone();
        async move {
            get(&mut c, "short")
                .await
                .is_err_and(|e| e.code() == Code::NotFound)
        }
    })
    .await;
    eventually("expired sandbox's container removed", WAIT, || async {
        containers(&env.bed).await == vec![forever_sid.clone()]
    })
    .await;
    assert_intact(&env, &mut c, "forever", &forever_sid, forever_pid).await;
    let got = get(&mut c, "forever").await.unwrap();
    assert_eq!(got.generation, 1);
    env.stop().await;
}
