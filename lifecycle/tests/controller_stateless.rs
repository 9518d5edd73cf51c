//! The lifecycle on the controller backend keeps nothing: a real controller
//! and a real agent on the test bed's containerd, a lifecycle stopped and
//! replaced by another on a fresh data dir (and a second replica beside it)
//! answering GET, list and renew exactly as the first did; the TTL sandbox
//! still expires on time with no lifecycle running at all (the controller's
//! sweep). Limits, metadata and volumes reach the sandbox; controller errors
//! keep their meaning.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{call, sh};
use reqwest::{Method, StatusCode};
use sandbolt_lifecycle::{BackendConfig, ControllerConfig, Lifecycle, LifecycleConfig, StartError};
use sandbolt_test_support::eventually_async;
use serde_json::{Value, json};

fn time(v: &Value) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(v.as_str().unwrap_or_else(|| panic!("not a time: {v}")))
        .unwrap()
        .with_timezone(&Utc)
}

/// Every sandbox as `GET /sandboxes/{id}` answers it, by id.
async fn get_all(base: &str, ids: &[&str]) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for id in ids {
        let (s, v) = call(Method::GET, format!("{base}/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::OK, "{id}: {v}");
        out.insert(id.to_string(), v);
    }
    out
}

async fn list(base: &str, query: &str) -> Value {
    let (s, v) = call(Method::GET, format!("{base}/v1/sandboxes?{query}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_lifecycle_gives_the_same_answers_and_ttl_still_expires() {
    // Room for exactly the three sandboxes below: the fourth finds none.
    let env = common::controller_env(3).await;
    let first_dir = tempfile::tempdir().unwrap();
    let first = env.lifecycle(first_dir.path()).await;
    let base = format!("http://{}", first.addr());
    let image = env.image.clone();

    // ttl: the shortest timeout the API allows, with limits and metadata.
    let (s, ttl) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 60,
            "metadata": {"team": "red", "job": "ttl"},
            "resourceLimits": {"cpu": "500m", "memory": "64Mi"},
            "env": {"GREETING": "hello"},
        })),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{ttl}");
    assert_eq!(ttl["status"]["state"], "Running", "{ttl}");
    let ttl_id = ttl["id"].as_str().unwrap().to_string();
    // long: renewed later; manual: no expiry at all.
    let (s, long) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sh", "-c", "sleep 100000"],
            "timeout": 3600,
            "metadata": {"team": "red", "job": "long"},
            "resourceLimits": {"cpu": "250m", "memory": "32Mi", "pids": "100"},
            "resourceRequests": {"cpu": "100m"},
        })),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{long}");
    let long_id = long["id"].as_str().unwrap().to_string();
    let (s, manual) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "infinity"],
            "metadata": {"team": "blue"},
            "resourceLimits": {},
        })),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{manual}");
    let manual_id = manual["id"].as_str().unwrap().to_string();
    let ids = [ttl_id.as_str(), long_id.as_str(), manual_id.as_str()];

    // No agent has room for a fourth: RESOURCE_EXHAUSTED is a 429.
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({"image": {"uri": image}, "entrypoint": ["sleep", "1"], "resourceLimits": {}})),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");

    // Everything the REST create carried is in the controller's record.
    let mut native = env.native().await;
    let rec = native.get(&long_id).await.expect("native get");
    let spec = rec.spec.unwrap();
    let res = spec.resources.unwrap();
    let limits = res.limits.unwrap();
    assert_eq!(
        (limits.cpu.as_str(), limits.memory.as_str(), limits.pids),
        ("250m", "32Mi", 100)
    );
    assert_eq!(res.requests.unwrap().cpu, "100m");
    assert_eq!(spec.command, ["sh", "-c", "sleep 100000"]);
    // ...and the limits hold inside: memory with swap held to it, the CFS
    // quota, pids.
    let out = sh(
        &base,
        &ttl_id,
        "cd /sys/fs/cgroup && cat memory/memory.limit_in_bytes memory/memory.memsw.limit_in_bytes cpu/cpu.cfs_quota_us && echo $GREETING",
    )
    .await;
    assert!(out.error.is_none(), "{out:?}");
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        [
            (64u64 << 20).to_string().as_str(),
            (64u64 << 20).to_string().as_str(),
            "50000",
            "hello"
        ]
    );
    let out = sh(&base, &long_id, "cat /sys/fs/cgroup/pids/pids.max").await;
    assert_eq!(out.stdout.trim(), "100", "{out:?}");

    let before = get_all(&base, &ids).await;
    let list_before = list(&base, "metadata=team%3Dred&pageSize=10").await;
    assert_eq!(list_before["pagination"]["totalItems"], 2, "{list_before}");
    let all_before = list(&base, "pageSize=10").await;
    assert_eq!(before[&ttl_id]["entrypoint"], json!(["sleep", "infinity"]));
    assert_eq!(
        before[&long_id]["entrypoint"],
        json!(["sh", "-c", "sleep 100000"])
    );
    assert_eq!(before[&ttl_id]["image"]["uri"], image.as_str());
    assert_eq!(
        before[&ttl_id]["metadata"],
        json!({"team": "red", "job": "ttl"})
    );
    assert!(before[&manual_id].get("expiresAt").is_none());
    let ttl_expires = time(&before[&ttl_id]["expiresAt"]);
    let created = time(&before[&ttl_id]["createdAt"]);
    // The expiry is in whole seconds (rounded up) from the lifecycle's
    // clock; the creation time is the controller's, a few ms later.
    let ttl_secs = (ttl_expires - created).num_milliseconds();
    assert!((59_000..=61_000).contains(&ttl_secs), "{}", before[&ttl_id]);
    assert!(before[&ttl_id]["status"]["lastTransitionAt"].is_string());

    // The first lifecycle goes away and left nothing behind.
    first.shutdown().await.unwrap();
    assert_eq!(files_under(first_dir.path()), Vec::<String>::new());

    // A new one on a new data dir, and a second replica beside it.
    let second_dir = tempfile::tempdir().unwrap();
    let second = env.lifecycle(second_dir.path()).await;
    let replica_dir = tempfile::tempdir().unwrap();
    let replica = env.lifecycle(replica_dir.path()).await;
    let base = format!("http://{}", second.addr());
    let replica_base = format!("http://{}", replica.addr());
    for b in [&base, &replica_base] {
        assert_eq!(
            get_all(b, &ids).await,
            before,
            "GET changed after the restart"
        );
        assert_eq!(
            list(b, "metadata=team%3Dred&pageSize=10").await,
            list_before,
            "list changed after the restart"
        );
        assert_eq!(list(b, "pageSize=10").await, all_before);
    }

    // Renew on one replica; the other answers the same.
    let want = Utc::now() + chrono::Duration::hours(2);
    let (s, renewed) = call(
        Method::POST,
        format!("{base}/v1/sandboxes/{long_id}/renew-expiration"),
        Some(json!({"expiresAt": want.to_rfc3339()})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{renewed}");
    let renewed_at = time(&renewed["expiresAt"]);
    // Whole seconds on the controller, never earlier than asked.
    assert!(renewed_at >= want && renewed_at - want < chrono::Duration::seconds(1));
    for b in [&base, &replica_base] {
        let (_, v) = call(Method::GET, format!("{b}/v1/sandboxes/{long_id}"), None).await;
        assert_eq!(time(&v["expiresAt"]), renewed_at, "{v}");
        assert_eq!(v["createdAt"], before[&long_id]["createdAt"]);
        assert_eq!(v["entrypoint"], before[&long_id]["entrypoint"]);
        let l = list(b, "metadata=job%3Dlong").await;
        assert_eq!(time(&l["items"][0]["expiresAt"]), renewed_at, "{l}");
    }
    // A manual-cleanup sandbox cannot be renewed, restart or not.
    let (s, v) = call(
        Method::POST,
        format!("{replica_base}/v1/sandboxes/{manual_id}/renew-expiration"),
        Some(json!({"expiresAt": want.to_rfc3339()})),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["code"], "SANDBOX_MANUAL_CLEANUP", "{v}");

    // The replicas go too: nothing but the controller runs while the TTL
    // sandbox's time comes, and it still expires on time.
    second.shutdown().await.unwrap();
    replica.shutdown().await.unwrap();
    for d in [&second_dir, &replica_dir] {
        assert_eq!(files_under(d.path()), Vec::<String>::new());
    }
    let deadline = ttl_expires + chrono::Duration::seconds(15);
    loop {
        let now = Utc::now();
        match native.get(&ttl_id).await {
            Err(e) if e.code() == tonic::Code::NotFound => {
                // One second of slack for the controller's whole-second clock.
                assert!(
                    now >= ttl_expires - chrono::Duration::seconds(1),
                    "deleted at {now}, before its expiry {ttl_expires}"
                );
                break;
            }
            Err(e) => panic!("native get: {e}"),
            Ok(_) => assert!(
                now < deadline,
                "still there at {now}, expiry was {ttl_expires}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // A lifecycle started afterwards sees exactly that.
    let last_dir = tempfile::tempdir().unwrap();
    let last = env.lifecycle(last_dir.path()).await;
    let base = format!("http://{}", last.addr());
    let (s, v) = call(Method::GET, format!("{base}/v1/sandboxes/{ttl_id}"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let l = list(&base, "pageSize=10").await;
    assert_eq!(l["pagination"]["totalItems"], 2, "{l}");
    for id in [&long_id, &manual_id] {
        let (s, v) = call(Method::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    }
    last.shutdown().await.unwrap();
    assert_eq!(files_under(last_dir.path()), Vec::<String>::new());
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_extensions_and_errors_reach_the_controller() {
    let env = common::controller_env(8).await;
    let dir = tempfile::tempdir().unwrap();
    let lc = env.lifecycle(dir.path()).await;
    let base = format!("http://{}", lc.addr());
    let body = |extra: Value| {
        let mut b = json!({
            "image": {"uri": env.image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 300,
            "resourceLimits": {},
        });
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };

    // A host volume under the agent's allowlist, with a subPath: mounted.
    // The path does not need to exist for the lifecycle; it does for the
    // agent, which checks on the node.
    let task = env.host_root.path().join("task-1");
    std::fs::create_dir(&task).unwrap();
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(json!({
            "volumes": [{"name": "work", "host": {"path": env.host_root.path()}, "subPath": "task-1", "mountPath": "/mnt/work"}],
            "extensions": {"poolRef": "default", "consistency_mode": "strong", "failurePolicy": "manual"},
        }))),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let out = sh(&base, &id, "echo artifact > /mnt/work/out.txt && echo ok").await;
    assert_eq!(out.stdout, "ok\n", "{out:?}");
    assert_eq!(
        std::fs::read_to_string(task.join("out.txt")).unwrap(),
        "artifact\n"
    );
    let rec = env.native().await.get(&id).await.unwrap();
    let spec = rec.spec.unwrap();
    assert_eq!(spec.pool, "default");
    assert_eq!(
        spec.failure_policy,
        sandbolt_proto::control::v1::FailurePolicy::Manual as i32
    );
    assert_eq!(spec.volumes.len(), 1);
    assert_eq!(spec.volumes[0].sub_path, "task-1");

    // The lifecycle's proxy answers while running and refuses (no hang on a
    // frozen process) while paused; after resume it answers again.
    let ping = format!("{base}/v1/sandboxes/{id}/proxy/44772/ping");
    let (s, v) = call(Method::GET, ping.clone(), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes/{id}/pause"),
        None,
    )
    .await;
    assert!(s.is_success(), "{s} {v}");
    let (s, v) = call(Method::GET, ping.clone(), None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["code"], "SANDBOX_PAUSED", "{v}");
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes/{id}/resume"),
        None,
    )
    .await;
    assert!(s.is_success(), "{s} {v}");
    let (s, v) = call(Method::GET, ping, None).await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // The node refuses what its allowlist does not cover: 400 with the
    // agent's reason, not a lifecycle-side guess about another machine.
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(json!({
            "volumes": [{"name": "etc", "host": {"path": "/etc"}, "mountPath": "/mnt/etc"}],
        }))),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("/etc"), "{v}");
    // A pvc is a named volume, made on first use on the sandbox's node;
    // this agent has no volume root, so there is nowhere to make it:
    // RESOURCE_EXHAUSTED, named (controller_volumes.rs has agents with one).
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(json!({
            "volumes": [{"name": "data", "pvc": {"claimName": "claim-a"}, "mountPath": "/data"}],
        }))),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("volume root"),
        "{v}"
    );
    // ... and one the request will not create is a 404 naming it.
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(json!({
            "volumes": [{"name": "data", "pvc": {"claimName": "claim-a", "createIfNotExists": false}, "mountPath": "/data"}],
        }))),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["code"], "VOLUME_NOT_FOUND", "{v}");
    assert!(v["message"].as_str().unwrap().contains("claim-a"), "{v}");
    // A pool no agent serves is the controller's to refuse, not to ignore:
    // no room there (RESOURCE_EXHAUSTED), named.
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(json!({"extensions": {"poolRef": "no-such-pool"}}))),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("no-such-pool"),
        "{v}"
    );
    // An extension nobody knows: 400 naming it, before any controller call.
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(json!({"extensions": {"storage.id": "x"}}))),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("extensions.storage.id")
    );
    // Only the first sandbox exists.
    let l = list(&base, "").await;
    assert_eq!(l["pagination"]["totalItems"], 1, "{l}");

    let (s, _) = call(Method::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    lc.shutdown().await.unwrap();
    env.stop().await;
}

fn lifecycle_config(controller: String, token: Option<&str>) -> LifecycleConfig {
    let mut backend = ControllerConfig::new(controller);
    backend.token = token.map(str::to_owned);
    let mut c = LifecycleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::Controller(backend),
        std::env::temp_dir().join("sandbolt-lifecycle-never-written"),
    );
    c.api_key = Some(common::API_KEY.into());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_controller_token_is_named_not_a_bare_500() {
    common::init_tracing();
    // A port nothing listens on yet: the lifecycle starts (the controller
    // may come up after it) ...
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let lc = Lifecycle::start(lifecycle_config(
        format!("http://{addr}"),
        Some("wrong-token"),
    ))
    .await
    .expect("a controller that is not up yet does not stop the lifecycle");
    let base = format!("http://{}", lc.addr());
    let (s, v) = call(Method::GET, format!("{base}/v1/sandboxes"), None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");

    // ... then a controller with another token comes up there.
    let data = tempfile::tempdir().unwrap();
    let mut ccfg = sandbolt_controller::ControllerConfig::new(
        addr.parse().unwrap(),
        data.path(),
        common::AGENT_TOKEN,
    );
    ccfg.fastpath_token = Some(common::CONTROLLER_TOKEN.into());
    let controller = sandbolt_controller::Controller::start(ccfg)
        .await
        .expect("controller starts on the freed port");
    let (s, v) = eventually_async(
        "the lifecycle to reach the restarted controller",
        Duration::from_secs(10),
        || async {
            let (s, v) = call(Method::GET, format!("{base}/v1/sandboxes"), None).await;
            (s != StatusCode::SERVICE_UNAVAILABLE).then_some((s, v))
        },
    )
    .await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
    assert_eq!(v["code"], "CONTROLLER::UNAUTHENTICATED", "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("controller token"),
        "{v}"
    );
    lc.shutdown().await.unwrap();

    // Started against a running controller, a missing or wrong token stops
    // the lifecycle at once, saying why.
    for token in [None, Some("wrong-token")] {
        match Lifecycle::start(lifecycle_config(
            format!("http://{}", controller.local_addr()),
            token,
        ))
        .await
        {
            Err(StartError::Backend(msg)) => assert!(msg.contains("token"), "{msg}"),
            Err(e) => panic!("{token:?}: wrong error: {e}"),
            Ok(_) => panic!("{token:?}: started with a token the controller refuses"),
        }
    }
    // The right one starts.
    let lc = Lifecycle::start(lifecycle_config(
        format!("http://{}", controller.local_addr()),
        Some(common::CONTROLLER_TOKEN),
    ))
    .await
    .expect("the right token starts");
    let (s, v) = call(
        Method::GET,
        format!("http://{}/v1/sandboxes", lc.addr()),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    lc.shutdown().await.unwrap();
    controller.shutdown().await;
}
