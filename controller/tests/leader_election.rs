//! Leader election over a `coordination.k8s.io/v1` Lease, against the
//! in-process API double.
//!
//! Timings are short (lease 2 s, renew deadline 1.2 s, retry 200 ms). The
//! waits are bounded for correctness ("a standby takes over within
//! lease_duration + 2 × retry_period of the leader's death", plus slack for
//! a loaded machine); none asserts on performance.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use sandbolt_controller::leader::{LeaderElector, LeaderState, LeaseConfig};
use sandbolt_kube_double::ApiDouble;
use tokio::sync::watch;

const NS: &str = "sandbolt-system";
const NAME: &str = "sandbolt-controller";
const LEASE: Duration = Duration::from_secs(2);
const RENEW: Duration = Duration::from_millis(1200);
const RETRY: Duration = Duration::from_millis(200);
/// Scheduling slack for a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(1);

fn init_tracing() {
    sandbolt_test_support::init_tracing("sandbolt_controller::leader=debug");
}

fn cfg(identity: &str) -> LeaseConfig {
    LeaseConfig::new(NS, NAME, identity).with_timings(LEASE, RENEW, RETRY)
}

async fn read_lease(client: &kube::Client) -> Lease {
    Api::<Lease>::namespaced(client.clone(), NS)
        .get(NAME)
        .await
        .expect("lease readable")
}

fn holder(lease: &Lease) -> Option<String> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty())
}

fn transitions(lease: &Lease) -> i32 {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_transitions)
        .unwrap_or(-1)
}

/// Waits until the published state satisfies `pred`, or panics after `limit`.
async fn wait_state(
    rx: &mut watch::Receiver<LeaderState>,
    limit: Duration,
    what: &str,
    pred: impl FnMut(&LeaderState) -> bool,
) -> LeaderState {
    let waited =
        tokio::time::timeout(limit, async { rx.wait_for(pred).await.map(|s| s.clone()) }).await;
    match waited {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => panic!("{what}: elector gone"),
        Err(_) => panic!("{what}: not within {limit:?}; state {:?}", *rx.borrow()),
    }
}

/// Starts `a`, waits until it leads, then starts `b` and waits until `b`
/// has observed `a` as the holder.
async fn leader_and_standby(client: &kube::Client) -> (LeaderElector, LeaderElector) {
    let a = LeaderElector::spawn(client.clone(), cfg("ctrl-a")).expect("valid config");
    wait_state(&mut a.subscribe(), LEASE + SLACK, "a leads", |s| {
        s.is_leader()
    })
    .await;
    let b = LeaderElector::spawn(client.clone(), cfg("ctrl-b")).expect("valid config");
    wait_state(&mut b.subscribe(), 5 * RETRY + SLACK, "b follows a", |s| {
        *s == LeaderState::Follower {
            holder: Some("ctrl-a".into()),
        }
    })
    .await;
    (a, b)
}

/// Samples both electors for `period`, failing if both lead at once.
/// Returns how many samples had exactly one leader.
async fn sample_never_two(a: &LeaderElector, b: &LeaderElector, period: Duration) -> usize {
    let end = Instant::now() + period;
    let mut one = 0;
    while Instant::now() < end {
        let (la, lb) = (a.is_leader(), b.is_leader());
        assert!(!(la && lb), "two leaders at once");
        // The published state never claims more than `is_leader` allows.
        let (sa, sb) = (a.state().is_leader(), b.state().is_leader());
        assert!(!(sa && sb), "two published leaders at once");
        if la ^ lb {
            one += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    one
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_candidate_acquires_and_renews() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    let a = LeaderElector::spawn(client.clone(), cfg("ctrl-a")).expect("valid config");
    assert_eq!(a.identity(), "ctrl-a");
    let state = wait_state(&mut a.subscribe(), LEASE + SLACK, "a leads", |s| {
        s.is_leader()
    })
    .await;
    assert!(
        matches!(state, LeaderState::Leader { term: 0, .. }),
        "{state:?}"
    );
    assert!(a.is_leader());

    let lease = read_lease(&client).await;
    let spec = lease.spec.clone().expect("spec");
    assert_eq!(holder(&lease).as_deref(), Some("ctrl-a"));
    assert_eq!(spec.lease_transitions, Some(0));
    assert_eq!(spec.lease_duration_seconds, Some(2));
    assert!(spec.acquire_time.is_some());
    let first_renew = spec.renew_time.expect("renewTime");
    assert_eq!(api.requests("create", "leases"), 1);

    // It keeps renewing: renewTime moves, acquireTime does not.
    let later = sandbolt_test_support::eventually_async(
        "renewTime to move, over at least two renewals",
        LEASE * 4,
        || async {
            let later = read_lease(&client).await.spec.expect("spec");
            let moved = later.renew_time.clone().expect("renewTime") > first_renew;
            (moved && api.requests("update", "leases") >= 2).then_some(later)
        },
    )
    .await;
    assert_eq!(later.acquire_time, spec.acquire_time);
    assert_eq!(later.holder_identity.as_deref(), Some("ctrl-a"));
    assert_eq!(later.lease_transitions, Some(0));
    assert!(a.is_leader());
    assert!(api.requests("update", "leases") >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_candidates_have_exactly_one_leader() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    // Both start at once: they race to create the Lease.
    let a = LeaderElector::spawn(client.clone(), cfg("ctrl-a")).expect("valid config");
    let b = LeaderElector::spawn(client.clone(), cfg("ctrl-b")).expect("valid config");
    let deadline = Instant::now() + LEASE + SLACK;
    while !(a.is_leader() || b.is_leader()) {
        assert!(Instant::now() < deadline, "nobody leads");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let single = sample_never_two(&a, &b, 3 * LEASE).await;
    assert!(single > 0);

    let (leader, follower) = if a.is_leader() { (&a, &b) } else { (&b, &a) };
    assert!(
        leader.is_leader() && !follower.is_leader(),
        "leadership moved"
    );
    let lease = read_lease(&client).await;
    assert_eq!(holder(&lease).as_deref(), Some(leader.identity()));
    assert_eq!(transitions(&lease), 0, "nobody took over");
    assert_eq!(
        follower.state(),
        LeaderState::Follower {
            holder: Some(leader.identity().to_string())
        }
    );

    // A follower's release does not touch the leader's Lease.
    let leader_id = leader.identity().to_string();
    let (leader, follower) = if a.is_leader() { (a, b) } else { (b, a) };
    follower.release().await;
    let lease = read_lease(&client).await;
    assert_eq!(holder(&lease), Some(leader_id));
    assert!(leader.is_leader());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_when_the_leader_dies() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    let (a, b) = leader_and_standby(&client).await;
    let before = read_lease(&client).await;
    assert_eq!(transitions(&before), 0);

    // Death: the task stops without releasing the Lease.
    let died = Instant::now();
    a.abort();
    let state = wait_state(
        &mut b.subscribe(),
        LEASE + 2 * RETRY + SLACK,
        "b takes over",
        |s| s.is_leader(),
    )
    .await;
    let took = died.elapsed();
    // Not before the Lease could have expired: a's last renewal was at most
    // one retry period (plus a round) before its death.
    assert!(
        took >= LEASE - 2 * RETRY,
        "took over after {took:?}, before the lease expired"
    );
    assert!(
        matches!(state, LeaderState::Leader { term: 1, .. }),
        "{state:?}"
    );
    assert!(b.is_leader());

    let after = read_lease(&client).await;
    assert_eq!(holder(&after).as_deref(), Some("ctrl-b"));
    assert_eq!(transitions(&after), 1);
    let acquired = |l: &Lease| l.spec.as_ref().and_then(|s| s.acquire_time.clone());
    assert!(acquired(&after) > acquired(&before), "acquireTime reset");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_several_standbys_takes_over() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    let (a, b) = leader_and_standby(&client).await;
    let c = LeaderElector::spawn(client.clone(), cfg("ctrl-c")).expect("valid config");
    let d = LeaderElector::spawn(client.clone(), cfg("ctrl-d")).expect("valid config");
    for s in [&c, &d] {
        wait_state(
            &mut s.subscribe(),
            5 * RETRY + SLACK,
            "standby follows a",
            |st| st.holder(s.identity()) == Some("ctrl-a"),
        )
        .await;
    }
    a.abort();
    let standbys = [&b, &c, &d];
    let leaders = || standbys.iter().filter(|e| e.is_leader()).count();
    let deadline = Instant::now() + LEASE + 2 * RETRY + SLACK;
    while leaders() == 0 {
        assert!(Instant::now() < deadline, "no standby took over");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Exactly one, and it stays the only one.
    let end = Instant::now() + LEASE;
    while Instant::now() < end {
        assert_eq!(leaders(), 1, "leaders: {:?}", standbys.map(|e| e.state()));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let leader = standbys.iter().find(|e| e.is_leader()).expect("one leads");
    let lease = read_lease(&client).await;
    assert_eq!(holder(&lease).as_deref(), Some(leader.identity()));
    assert_eq!(transitions(&lease), 1, "more than one take-over");
    for e in standbys.iter().filter(|e| !e.is_leader()) {
        assert_eq!(e.state().holder(e.identity()), Some(leader.identity()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_release_hands_over_before_expiry() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    // A long lease, so a take-over by expiry is clearly told apart.
    let long = |id: &str| {
        LeaseConfig::new(NS, NAME, id).with_timings(
            Duration::from_secs(8),
            Duration::from_secs(5),
            RETRY,
        )
    };
    let a = LeaderElector::spawn(client.clone(), long("ctrl-a")).expect("valid config");
    let mut a_rx = a.subscribe();
    wait_state(&mut a_rx, Duration::from_secs(3), "a leads", |s| {
        s.is_leader()
    })
    .await;
    let b = LeaderElector::spawn(client.clone(), long("ctrl-b")).expect("valid config");
    let mut b_rx = b.subscribe();
    wait_state(&mut b_rx, Duration::from_secs(3), "b follows a", |s| {
        s.holder("ctrl-b") == Some("ctrl-a")
    })
    .await;

    let released = Instant::now();
    a.release().await;
    // a published Follower before giving the Lease up.
    assert!(!a_rx.borrow().is_leader());
    let lease = read_lease(&client).await;
    assert!(
        holder(&lease).is_none() || holder(&lease).as_deref() == Some("ctrl-b"),
        "lease not released: {lease:?}"
    );

    let state = wait_state(&mut b_rx, Duration::from_secs(4), "b takes over", |s| {
        s.is_leader()
    })
    .await;
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "hand-over took {took:?}: waited for expiry (8 s)?"
    );
    assert!(
        matches!(state, LeaderState::Leader { term: 1, .. }),
        "{state:?}"
    );
    assert_eq!(
        holder(&read_lease(&client).await).as_deref(),
        Some("ctrl-b")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_steps_down_when_the_api_is_unreachable() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    let (a, b) = leader_and_standby(&client).await;
    let mut a_rx = a.subscribe();

    let outage = Instant::now();
    api.set_unavailable(true);
    // is_leader() lapses at the renew deadline by itself: the last
    // successful round started before the outage.
    tokio::time::sleep_until((outage + RENEW + Duration::from_millis(20)).into()).await;
    assert!(
        !a.is_leader(),
        "still leading past renew_deadline without renewing"
    );
    assert!(!b.is_leader());
    // And the task publishes the step-down.
    wait_state(&mut a_rx, SLACK, "a steps down", |s| !s.is_leader()).await;

    // Keep the outage well past the lease: nobody may lead meanwhile.
    let end = outage + 2 * LEASE;
    while Instant::now() < end {
        assert!(
            !a.is_leader() && !b.is_leader(),
            "a leader without an API server"
        );
        assert!(!a.state().is_leader() && !b.state().is_leader());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    api.set_unavailable(false);
    // Exactly one of them leads again, and never both.
    let deadline = Instant::now() + LEASE + 2 * RETRY + SLACK;
    while !(a.is_leader() || b.is_leader()) {
        assert!(Instant::now() < deadline, "nobody leads after the outage");
        assert!(!(a.is_leader() && b.is_leader()));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(sample_never_two(&a, &b, 2 * LEASE).await > 0);
    let leader = if a.is_leader() { &a } else { &b };
    assert_eq!(
        holder(&read_lease(&client).await).as_deref(),
        Some(leader.identity())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_conflict_does_not_cost_leadership() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    let (a, b) = leader_and_standby(&client).await;
    let mut a_rx = a.subscribe();
    a_rx.borrow_and_update();
    let updates_before = api.requests("update", "leases");

    api.fail_next("update", "leases", 409, 1);
    // Wait for the faulted renewal and a few good ones after it.
    let deadline = Instant::now() + 10 * RETRY + SLACK;
    while api.requests("update", "leases") < updates_before + 4 {
        assert!(Instant::now() < deadline, "renewals stopped");
        assert!(a.is_leader(), "lost leadership over one conflict");
        assert!(!b.is_leader());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(a.is_leader());
    assert!(
        !a_rx.has_changed().expect("elector alive"),
        "state flapped: {:?}",
        *a_rx.borrow()
    );
    let lease = read_lease(&client).await;
    assert_eq!(holder(&lease).as_deref(), Some("ctrl-a"));
    assert_eq!(transitions(&lease), 0);

    // Conflicts on the standby's reads do not matter either; a's renewals
    // keep it a follower.
    sample_never_two(&a, &b, LEASE).await;
    assert!(a.is_leader() && !b.is_leader());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_that_lost_the_lease_steps_down() {
    init_tracing();
    let api = ApiDouble::start().await;
    let client = api.client();
    let a = LeaderElector::spawn(client.clone(), cfg("ctrl-a")).expect("valid config");
    let mut a_rx = a.subscribe();
    wait_state(&mut a_rx, LEASE + SLACK, "a leads", |s| s.is_leader()).await;

    // Someone else (an operator, or a partitioned peer's stale view) writes
    // the Lease with another holder: a must notice and stop leading.
    let leases = Api::<Lease>::namespaced(client.clone(), NS);
    loop {
        let mut lease = leases.get(NAME).await.expect("lease");
        let spec = lease.spec.as_mut().expect("spec");
        spec.holder_identity = Some("intruder".into());
        spec.lease_transitions = Some(1);
        match leases.replace(NAME, &Default::default(), &lease).await {
            Ok(_) => break,
            // Raced with a's renewal: read again.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => panic!("replace: {e}"),
        }
    }
    let state = wait_state(&mut a_rx, 3 * RETRY + SLACK, "a steps down", |s| {
        !s.is_leader()
    })
    .await;
    assert!(!a.is_leader());
    assert!(matches!(state, LeaderState::Follower { .. }), "{state:?}");

    // The intruder never renews: a takes the Lease back once it expires,
    // as a new term.
    let state = wait_state(
        &mut a_rx,
        LEASE + 2 * RETRY + SLACK,
        "a takes it back",
        |s| s.is_leader(),
    )
    .await;
    assert!(
        matches!(state, LeaderState::Leader { term: 2, .. }),
        "{state:?}"
    );
    let lease = read_lease(&client).await;
    assert_eq!(holder(&lease).as_deref(), Some("ctrl-a"));
    assert_eq!(transitions(&lease), 2);
}

/// The controller on top of the elector: a leader that can no longer reach
/// the API server closes its port and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_stops_serving() {
    use sandbolt_controller::ControllerConfig;
    use sandbolt_controller::ha::{ElectedExit, run_elected};
    use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};

    init_tracing();
    let api = ApiDouble::start().await;
    let lease = LeaseConfig::new(NS, NAME, "in-process").with_timings(
        Duration::from_millis(1500),
        Duration::from_millis(1000),
        Duration::from_millis(200),
    );
    let elector = LeaderElector::spawn(api.client(), lease).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ControllerConfig::new(
        ([127, 0, 0, 1], sandbolt_test_support::free_port()).into(),
        dir.path(),
        "cut-off-agent-token",
    );
    let (serving_tx, serving_rx) = tokio::sync::oneshot::channel();
    let mut serving_tx = Some(serving_tx);
    let kube_config = api.config();
    let run = tokio::spawn(run_elected(
        cfg,
        elector,
        move || {
            let store = KubeStore::open(kube_config, KubeStoreConfig::new(NS))?;
            Ok(std::sync::Arc::new(store) as _)
        },
        None,
        move |h| {
            if let Some(tx) = serving_tx.take() {
                let _ = tx.send(h.local_addr());
            }
        },
        std::future::pending(),
    ));
    let addr = tokio::time::timeout(Duration::from_secs(20), serving_rx)
        .await
        .expect("leads and serves")
        .unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_ok());

    api.set_unavailable(true);
    let exit = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the cut-off leader gives up")
        .unwrap()
        .unwrap();
    assert_eq!(exit, ElectedExit::LostLeadership);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the port is closed once leadership is lost"
    );
    api.set_unavailable(false);
    api.shutdown().await;
}
