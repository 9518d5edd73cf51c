//! Warm pools (issue 17): what one claimant leaves is never seen by the
//! next. Through the lifecycle's REST API on a real controller and agent
//! (test bed, runc, static execd): a pool of busybox with a buffer of 2;
//! round after round a create with `extensions.poolRef` is served by a claim
//! (the controller's native API says `claimed_warm`), looks for every
//! marker an earlier claimant wrote (files in /, /tmp and /root, a
//! background process), writes its own, and is deleted; the next round
//! claims again once the buffer has refilled. Every claim runs in a
//! container never handed out before, a deleted claimant's container is
//! gone (never put back into the buffer), and the buffer is whole again at
//! the end.

use crate::support::warm;

use std::collections::BTreeSet;

use serde_json::json;
use warm::*;

const POOL: &str = "warm-iso";
const BUFFER: i64 = 2;
const ROUNDS: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claimant_never_sees_what_an_earlier_one_wrote() {
    let mut env = WarmEnv::start().await;
    env.api
        .create_pool(pool_body(
            POOL,
            sandbolt_testbed::BUSYBOX_REF,
            &[],
            (BUFFER, BUFFER),
            (0, 10),
        ))
        .await;
    env.api.wait_available(POOL, BUFFER, FILLED_WITHIN).await;

    let mut handed_out = BTreeSet::new();
    for round in 0..ROUNDS {
        // Claims, not cold creates, are what this is about: wait for the
        // refill rather than race it.
        env.api.wait_available(POOL, 1, FILLED_WITHIN).await;
        let id = env
            .api
            .create(json!({
                "image": { "uri": sandbolt_testbed::BUSYBOX_REF },
                "entrypoint": ["sleep", "3600"],
                "timeout": 3600,
                "resourceLimits": {},
                "extensions": { "poolRef": POOL },
            }))
            .await;
        let (claimed, container, pool) = claim_of(&mut env.native, &id).await;
        assert!(claimed, "round {round}: {id} was created cold");
        assert_eq!(pool, POOL, "round {round}");
        assert!(
            handed_out.insert(container.clone()),
            "round {round}: container {container} handed out twice"
        );

        let found = env
            .api
            .sh_ok(
                &id,
                "find / -xdev -name 'warm-marker-*' 2>/dev/null; ps -o args | grep -c '^sleep 2999' || true",
            )
            .await;
        let lines: Vec<&str> = found.lines().collect();
        assert_eq!(
            lines,
            ["0"],
            "round {round}: {id} sees an earlier claimant's files or processes: {found:?}"
        );
        env.api
            .sh_ok(
                &id,
                &format!(
                    "for d in / /tmp /root; do echo {round} > $d/warm-marker-{round}; done; \
                     nohup sleep 2999 >/dev/null 2>&1 & \
                     ls /tmp/warm-marker-{round} /root/warm-marker-{round} /warm-marker-{round}"
                ),
            )
            .await;
        env.api.delete(&id).await;
        let bed = &env.bed;
        sandbolt_e2e::bed::eventually_true(
            &format!("round {round}: the claimed container {container} is removed"),
            std::time::Duration::from_secs(30),
            || {
                tokio::task::block_in_place(|| bed.containers(sandbolt_e2e::bed::NS))
                    .map(|c| !c.contains(&container))
                    .unwrap_or(false)
            },
        )
        .await;
    }
    // The buffer refilled behind the claims, with sandboxes never handed out.
    env.api.wait_available(POOL, BUFFER, FILLED_WITHIN).await;
    let warm_now: BTreeSet<String> = env.containers().await.into_iter().collect();
    assert_eq!(warm_now.len() as i64, BUFFER, "{warm_now:?}");
    assert!(
        warm_now.is_disjoint(&handed_out),
        "a claimed container is back in the buffer: {warm_now:?}"
    );
    env.stop(POOL).await;
}
