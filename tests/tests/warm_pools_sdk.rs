//! Warm pools end to end (issue 17), as a client uses them: a pool made
//! with a plain `POST /pools` (the OpenSandbox contract's CreatePoolRequest)
//! on the lifecycle, in front of a real controller and a real agent on the
//! test bed (private containerd, runc, static execd); then the official
//! Python SDK (`tests/python/warm_pools_sdk_test.py`) creates with
//! `extensions={"poolRef": ...}` and without, and checks what the sandbox
//! sees, and that REST says each was a claim. This side asks the
//! controller's native API too (`status.claimed_warm`, the container id),
//! checks the claims took distinct warm sandboxes, that the buffer refills,
//! and that the bed is left clean.

use crate::support::warm;

use std::collections::BTreeMap;

use warm::*;

const POOL: &str = "warm-sdk";
const BUFFER: i64 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sdk_creates_with_and_without_pool_ref_are_claimed() {
    let mut env = WarmEnv::start().await;
    let created = env
        .api
        .create_pool(pool_body(
            POOL,
            APP_IMAGE,
            &[("TEMPLATE_ONLY", "from-template"), ("BOTH", "template")],
            (BUFFER, BUFFER),
            (0, 10),
        ))
        .await;
    assert_eq!(created["name"], POOL, "{created}");
    assert_eq!(created["capacitySpec"]["bufferMin"], BUFFER, "{created}");
    env.api.wait_available(POOL, BUFFER, FILLED_WITHIN).await;
    let warm_before = env.containers().await;
    assert_eq!(
        warm_before.len() as i64,
        BUFFER,
        "the buffer is the only thing running: {warm_before:?}"
    );

    let ids_file = env.dir.path().join("ids.json");
    let addr = env.lifecycle.as_ref().unwrap().addr();
    let py_env = vec![
        ("WARM_POOL", POOL.to_string()),
        ("WARM_IMAGE", APP_IMAGE.to_string()),
        ("WARM_IDS", ids_file.display().to_string()),
    ];
    let suite =
        tokio::task::spawn_blocking(move || run_pytest("warm_pools_sdk_test.py", addr, &py_env))
            .await;
    if let Err(panic) = suite {
        std::panic::resume_unwind(panic.into_panic());
    }

    let ids: BTreeMap<String, String> =
        serde_json::from_str(&std::fs::read_to_string(&ids_file).expect("the suite wrote ids"))
            .unwrap();
    assert_eq!(
        ids.keys().collect::<Vec<_>>(),
        ["plain", "pool_ref"],
        "{ids:?}"
    );
    let mut containers = Vec::new();
    for (test, id) in &ids {
        let (claimed, container, pool) = claim_of(&mut env.native, id).await;
        assert!(claimed, "{test}: {id} was created cold, not claimed");
        assert_eq!(pool, POOL, "{test}: {id}");
        // The first create (poolRef) can only have taken one of the buffer
        // seen before the suite; the second may take a refilled one.
        assert!(
            test != "pool_ref" || warm_before.contains(&container),
            "{test}: {id} runs in {container}, which was not one of the warm ones {warm_before:?}"
        );
        containers.push(container);
    }
    assert_ne!(containers[0], containers[1], "one warm sandbox, two claims");

    // The buffer refills behind the claims: BUFFER warm ones again, none of
    // them a claimed one.
    env.api.wait_available(POOL, BUFFER, FILLED_WITHIN).await;
    let pool = env
        .api
        .expect(
            reqwest::Method::GET,
            &format!("/pools/{POOL}"),
            None,
            reqwest::StatusCode::OK,
        )
        .await;
    assert_eq!(pool["status"]["allocated"], 2, "{pool}");
    assert_eq!(pool["status"]["total"], BUFFER + 2, "{pool}");
    for id in ids.values() {
        env.api.delete(id).await;
    }
    env.stop(POOL).await;
}
