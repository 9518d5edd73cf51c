//! The registry's warm bookkeeping through its public calls: claims,
//! stale heartbeats, `pool_max`, implicit members, slot accounting.

use std::collections::HashSet;

use sandbolt_proto::agent::v1 as apb;

use crate::ids::SandboxId;
use crate::placement::{PlacementError, PlacementRequest, PoolKey};
use crate::registry::{Registry, WarmAsk, WarmPlacement};

fn warm(id: &str) -> apb::WarmSandbox {
    apb::WarmSandbox {
        sandbox_id: id.into(),
        class: Some(apb::WarmClass {
            warm_pool: "bb".into(),
            image: "docker.io/library/busybox:latest".into(),
            ..Default::default()
        }),
        created_at_unix_ms: id.len() as i64,
    }
}

fn beat(r: &Registry, agent: &str, capacity: i32, sandboxes: &[&str], ws: &[&str]) {
    r.heartbeat(&apb::Inventory {
        agent_id: agent.into(),
        max_sandboxes: capacity,
        sandboxes: sandboxes
            .iter()
            .map(|s| apb::SandboxStatus {
                sandbox_id: s.to_string(),
                ..Default::default()
            })
            .collect(),
        warm: ws.iter().map(|w| warm(w)).collect(),
        warm_starting: [("bb".to_string(), 1)].into(),
        ..Default::default()
    });
}

fn ask(pool_max: i32, implicit: bool) -> WarmAsk<'static> {
    WarmAsk {
        pool: "bb",
        pool_max,
        claim: true,
        implicit,
    }
}

fn place(r: &Registry, id: &str, a: &WarmAsk<'_>) -> Result<WarmPlacement, PlacementError> {
    let pool = PoolKey::default();
    let key = sandbolt_image_ref::match_key("busybox");
    let req = PlacementRequest {
        pool: &pool,
        image_key: &key,
        ports: &[],
        exclude: &[],
        runtime: None,
        pin: None,
        volume_root: false,
        shared_volumes: false,
    };
    r.allocate_warm(&req, &SandboxId::from(id), a)
}

fn claimed(p: Result<WarmPlacement, PlacementError>) -> (String, String) {
    match p {
        Ok(WarmPlacement::Claimed { agent, warm_id }) => (agent.to_string(), warm_id.to_string()),
        other => panic!("expected a claim, got {other:?}"),
    }
}

#[test]
fn one_warm_sandbox_goes_to_one_create_whatever_heartbeats_say() {
    let r = Registry::new();
    beat(&r, "a", 8, &[], &["w1", "w22"]);
    beat(&r, "b", 8, &[], &["w333"]);
    // The agent with the most warm ones first, its oldest first.
    assert_eq!(
        claimed(place(&r, "c1", &ask(10, false))),
        ("a".into(), "w1".into())
    );
    assert_eq!(r.allocated(&"a".into()), Some(1), "a claim takes a slot");
    // A heartbeat taken before the claim reached the agent lists w1 again.
    beat(&r, "a", 8, &[], &["w1", "w22"]);
    let mut got = HashSet::new();
    for i in 0..2 {
        got.insert(claimed(place(&r, &format!("c{}", i + 2), &ask(10, false))).1);
    }
    assert_eq!(got, HashSet::from(["w22".to_string(), "w333".to_string()]));
    // Nothing warm left: cold, counted in the pool.
    assert_eq!(
        place(&r, "cold", &ask(10, false)).map(|p| matches!(p, WarmPlacement::Cold(_))),
        Ok(true)
    );
    let c = r.warm_counts("bb", "default");
    assert_eq!(
        (c.allocated, c.available, c.starting, c.agents),
        (4, 0, 2, 2)
    );
    // Still listed as warm by stale heartbeats: still not claimable.
    beat(&r, "a", 8, &["w1"], &["w1", "w22"]);
    assert_eq!(r.warm_counts("bb", "default").available, 0);
    // An id a record holds is never claimable, whatever a report says.
    r.reserve(&"b".into(), &"held".into(), &[]);
    beat(&r, "b", 8, &[], &["held"]);
    assert!(matches!(
        place(&r, "c9", &ask(10, false)),
        Ok(WarmPlacement::Cold(_))
    ));
    // Released slots stop counting.
    r.release(&"a".into(), &"w1".into());
    r.release(&"a".into(), &"w1".into());
    assert_eq!(r.warm_counts("bb", "default").allocated, 4);
}

#[test]
fn pool_max_bounds_members_claimed_or_cold_but_not_implicit_creates() {
    let r = Registry::new();
    beat(&r, "a", 8, &[], &["w1", "w22", "w333"]);
    claimed(place(&r, "c1", &ask(2, false)));
    claimed(place(&r, "c2", &ask(2, false)));
    // Two members of poolMax 2: even with warm ones left, full.
    match place(&r, "c3", &ask(2, false)) {
        Err(PlacementError::WarmPoolFull { pool, total, max }) => {
            assert_eq!((pool.as_str(), total, max), ("bb", 3, 2));
        }
        other => panic!("expected full, got {other:?}"),
    }
    // A create that did not ask for the pool still gets the warm one, and
    // a cold slot when none is left, never refused by the pool.
    claimed(place(&r, "i1", &ask(2, true)));
    assert!(matches!(
        place(&r, "i2", &ask(2, true)),
        Ok(WarmPlacement::Cold(_))
    ));
    assert_eq!(r.warm_counts("bb", "default").allocated, 3);
    // A full agent gives no claim (a claim takes a slot).
    let r = Registry::new();
    beat(&r, "a", 1, &["busy"], &["w1"]);
    assert!(matches!(
        place(&r, "x", &ask(5, false)),
        Err(PlacementError::NoCapacity(..))
    ));
}

#[test]
fn shares_follow_live_agents_and_their_room() {
    let r = Registry::new();
    beat(&r, "a", 4, &["s1", "s2", "s3"], &[]);
    beat(&r, "b", 4, &[], &[]);
    let mut agents = r.warm_agents("default");
    agents.sort();
    assert_eq!(agents, [("a".into(), 1), ("b".into(), 4)]);
    r.detect_lost(std::time::Duration::ZERO);
    assert!(
        r.warm_agents("default").is_empty(),
        "lost agents hold no buffer"
    );
}

#[test]
fn a_sandbox_pools_max_sandboxes_bounds_new_sandboxes_warm_or_cold() {
    let r = Registry::new();
    beat(&r, "a", 8, &["s1"], &["w1"]);
    beat(&r, "b", 8, &["s2"], &[]);
    r.set_pool_caps([("default".to_string(), 3)].into());
    // 2 live: one more (the warm claim), then full for every kind of create.
    claimed(place(&r, "c1", &ask(10, false)));
    for a in [ask(10, false), ask(10, true)] {
        match place(&r, "c2", &a) {
            Err(PlacementError::PoolFull { pool, used, max }) => {
                assert_eq!((pool.as_str(), used, max), ("default", 3, 3));
            }
            other => panic!("expected the pool's bound, got {other:?}"),
        }
    }
    let pool = PoolKey::default();
    let req = PlacementRequest {
        pool: &pool,
        image_key: "k",
        ports: &[],
        exclude: &[],
        runtime: None,
        pin: None,
        volume_root: false,
        shared_volumes: false,
    };
    let e = r.allocate_new(&req, &"c3".into()).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("pool default is full: 3 sandboxes"),
        "{e}"
    );
    // A recreate is no new sandbox: not bounded.
    assert!(r.allocate(&req, &"re".into()).is_ok());
    r.set_pool_caps(Default::default());
    assert!(r.allocate_new(&req, &"c4".into()).is_ok());
}
