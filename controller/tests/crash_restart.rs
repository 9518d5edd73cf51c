//! `kill -9` at the two dangerous points, with the controller as a real
//! child process and AgentService **stand-ins** in this process (the
//! test-bed variant with the real agent is in `e2e_testbed.rs`).

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sandbolt_proto::fastpath::v2;
use support::child::ChildController;
use support::standin::{AGENT_TOKEN, StandInAgent};
use tonic::Code;

type V2 = v2::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;

fn reference(name: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    })
}

fn req(name: &str) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: name.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "1000".into()],
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    }
}

async fn client(addr: std::net::SocketAddr) -> V2 {
    V2::connect(format!("http://{addr}")).await.unwrap()
}

/// Retries while the restarted controller waits for its agents.
async fn create_when_ready(
    c: &mut V2,
    r: v2::CreateSandboxRequest,
) -> Result<v2::CreateSandboxResponse, tonic::Status> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.create_sandbox(r.clone()).await {
            Err(e) if e.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => return other.map(|r| r.into_inner()),
        }
    }
}

async fn eventually<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strong_killed_between_record_and_container() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ChildController::spawn(
        dir.path(),
        "strong",
        Some("strong-after-record:victim"),
        AGENT_TOKEN,
    );
    let agent = StandInAgent::start(
        "agent-a",
        "default",
        2,
        &["busybox"],
        ctl.addr,
        Duration::from_millis(100),
    )
    .await;
    let mut c = client(ctl.addr).await;
    let acked = c.create_sandbox(req("acked")).await.unwrap().into_inner();
    let acked_uid = acked.sandbox.unwrap().identity.unwrap().uid;

    let mut c2 = c.clone();
    let pending = tokio::spawn(async move { c2.create_sandbox(req("victim")).await });
    let marker = tokio::task::spawn_blocking(move || {
        let m = ctl.wait_failpoint(Duration::from_secs(10));
        ctl.kill9();
        m
    })
    .await
    .unwrap();
    assert!(marker.contains("strong-after-record victim"), "{marker}");
    assert!(
        pending.await.unwrap().is_err(),
        "the victim was never acknowledged"
    );
    assert_eq!(agent.held(), 1, "the agent never saw the victim");

    let ctl = ChildController::spawn(dir.path(), "strong", None, AGENT_TOKEN);
    agent.retarget(ctl.addr);
    let mut c = client(ctl.addr).await;
    // The victim's record holds its slot: acked + victim fill capacity 2.
    let extra = create_when_ready(&mut c, req("extra")).await.unwrap_err();
    assert_eq!(extra.code(), Code::ResourceExhausted, "{extra:?}");
    // The acknowledged sandbox is intact.
    let got = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("acked"),
            expected_generation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let info = got.sandbox.unwrap();
    assert_eq!(info.identity.unwrap().uid, acked_uid);
    assert!(info.ready);
    // The committed record is re-driven to a container; a client retry gets it.
    eventually("victim re-driven", || agent.held() == 2).await;
    let retry = c.create_sandbox(req("victim")).await.unwrap().into_inner();
    assert!(retry.sandbox.unwrap().ready);
    assert_eq!(agent.held(), 2);
    assert_eq!(agent.state.overcommits.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_killed_between_container_and_record() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ChildController::spawn(
        dir.path(),
        "fast",
        Some("fast-after-create:victim"),
        AGENT_TOKEN,
    );
    let agent = StandInAgent::start(
        "agent-a",
        "default",
        2,
        &["busybox"],
        ctl.addr,
        Duration::from_millis(100),
    )
    .await;
    let mut c = client(ctl.addr).await;
    c.create_sandbox(req("acked")).await.unwrap();

    let mut c2 = c.clone();
    let pending = tokio::spawn(async move { c2.create_sandbox(req("victim")).await });
    tokio::task::spawn_blocking(move || {
        ctl.wait_failpoint(Duration::from_secs(10));
        ctl.kill9();
    })
    .await
    .unwrap();
    assert!(pending.await.unwrap().is_err());
    assert_eq!(
        agent.held(),
        2,
        "the victim's container exists without a record"
    );

    let ctl = ChildController::spawn(dir.path(), "fast", None, AGENT_TOKEN);
    agent.retarget(ctl.addr);
    let mut c = client(ctl.addr).await;
    // The orphan's slot is counted from the agent's inventory while it lives,
    // and the orphan is removed (no record owns it).
    eventually("orphan removed", || agent.held() == 1).await;
    let e = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("victim"),
            expected_generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let got = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("acked"),
            expected_generation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(got.sandbox.unwrap().ready);
    // The freed slot is usable once the agent stops reporting the orphan;
    // never more than capacity on the agent.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match create_when_ready(&mut c, req("extra")).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(agent.held(), 2);
    assert_eq!(agent.state.overcommits.load(Ordering::SeqCst), 0);
}
