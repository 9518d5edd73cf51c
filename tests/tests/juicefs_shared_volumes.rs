//! Shared volumes on JuiceFS end to end (issue 22), through the lifecycle's
//! REST API: a real controller, real agents each with its own FUSE mount of
//! one JuiceFS filesystem (real PostgreSQL and `juicefs format` from the
//! test bed's `JuiceFs`), real containerd and runc, bytes written and read
//! by the sandboxes' own busybox through execd.
//!
//! Agents: `node-a` (pool default) and `node-b` (pool other) share the
//! filesystem; `node-dead` (pool default) is configured with a metadata
//! engine that does not answer, so its mount is never up.
//!
//! What it proves: a juicefs volume is created through the API without a
//! node and is shared; a sandbox on node-a writes and one on node-b reads
//! the same bytes at once (RWX); an RWO volume refuses a second writer on
//! the other node (and a reader is fine); sandboxes that mount a juicefs
//! volume never land on node-dead, while sandboxes without volumes still
//! run.

use crate::support::volumes;

use std::time::Duration;

use reqwest::{Method, StatusCode};
use sandbolt_agent::Agent;
use sandbolt_agent::juicefs_mount::JuiceFsConfig;
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_e2e::bed::*;
use sandbolt_testbed::JuiceFs;
use serde_json::{Value, json};
use volumes::*;

/// `POST /sandboxes` in `pool` with `vols`: the answer.
async fn try_create_in(api: &Rest, pool: &str, vols: Value) -> (StatusCode, Value) {
    let body = json!({
        "image": { "uri": sandbolt_testbed::BUSYBOX_REF },
        "entrypoint": ["sleep", "3600"],
        "timeout": 3600,
        "resourceLimits": {},
        "volumes": vols,
        "extensions": { "poolRef": pool },
    });
    api.call(Method::POST, "/sandboxes", Some(body)).await
}

/// A Running sandbox in `pool` with `vols`; its id. A 503 (the pool's
/// JuiceFS mount not up yet, right after the agents start) is retried.
async fn create_in(api: &Rest, pool: &str, vols: Value) -> String {
    let answer = std::sync::Mutex::new(None);
    eventually(
        "a create past the mounts' start",
        Duration::from_secs(60),
        || async {
            let (s, v) = try_create_in(api, pool, vols.clone()).await;
            let retry = s == StatusCode::SERVICE_UNAVAILABLE;
            *answer.lock().unwrap() = Some((s, v));
            !retry
        },
    )
    .await;
    let (s, v) = answer.into_inner().unwrap().unwrap();
    assert_eq!(s, StatusCode::ACCEPTED, "create in {pool} with {vols}: {v}");
    let id = v["id"].as_str().expect("id").to_string();
    api.wait_running(&id).await;
    id
}

/// The nodes the volume's holders run on, sorted.
fn holder_nodes(v: &Value) -> Vec<String> {
    let mut n: Vec<String> = v["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["nodeName"].as_str().unwrap_or_default().to_string())
        .collect();
    n.sort();
    n
}

/// The agent the controller placed sandbox `id` on (its "placed on agent"
/// event).
async fn agent_of(v2: &V2, id: &str) -> String {
    let d = diagnostics(&mut v2.clone(), id).await;
    d.events
        .iter()
        .find_map(|e| e.message.strip_prefix("placed on agent "))
        .and_then(|m| m.split_whitespace().next())
        .unwrap_or_else(|| panic!("no placement event for {id}: {:?}", d.events))
        .to_string()
}

fn jfs_config(fs: &JuiceFs, id: &str, meta_url: &str) -> JuiceFsConfig {
    JuiceFsConfig {
        meta_url: meta_url.to_string(),
        mount_point: fs.mount_point(id).expect("mount point"),
        binary: fs.binary().to_path_buf(),
        cache_dir: fs.scratch(id).expect("cache dir"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_share_a_juicefs_volume_and_rwo_holds_across_them() {
    let bed = start_bed().await;
    let fs = tokio::task::spawn_blocking(JuiceFs::start)
        .await
        .unwrap()
        .expect("JuiceFS (PostgreSQL + juicefs format) starts");
    let controller_dir = tempfile::tempdir().unwrap();
    let mut cfg =
        ControllerConfig::new("127.0.0.1:0".parse().unwrap(), controller_dir.path(), TOKEN);
    cfg.heartbeat_interval = Duration::from_millis(200);
    let ctl = Controller::start(cfg).await.expect("controller starts");
    let addr = ctl.local_addr();
    let mut agents = Vec::new();
    // A metadata URL nothing answers: that agent's mount never comes up.
    let dead_url = format!(
        "postgres://postgres@127.0.0.1:{}/juicefs?sslmode=disable",
        {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        }
    );
    for (id, pool, url) in [
        ("node-a", "default", fs.meta_url().to_string()),
        ("node-b", "other", fs.meta_url().to_string()),
        ("node-dead", "default", dead_url),
    ] {
        let state = bed.root().join(format!("{id}-state"));
        let mut c = agent_config(&bed, id, &state, addr, TOKEN);
        c.heartbeat_interval = Duration::from_millis(200);
        c.max_sandboxes = 8;
        c.pool = pool.into();
        c.juicefs = Some(jfs_config(&fs, id, &url));
        agents.push(Agent::start(c).await.expect("agent starts"));
    }
    let fp = connect(addr).await;
    wait_agents(&fp, 2).await;
    eventually("pool other ready", Duration::from_secs(30), || {
        let mut c = fp.clone();
        async move {
            let r = sandbolt_proto::fastpath::v2::GetPoolRequest {
                pool_name: "other".into(),
                ..Default::default()
            };
            c.get_pool(r)
                .await
                .is_ok_and(|p| p.into_inner().ready_fastlets == 1)
        }
    })
    .await;
    let lifecycle = start_lifecycle(&format!("http://{addr}"), controller_dir.path()).await;
    let api = &Rest::new(lifecycle.addr());

    // Created through the API, on no node: any mounted agent made it (the
    // mounts come up a moment after the agents: 503 until then).
    let body = json!({"name": "shared-rwx", "accessMode": "ReadWriteMany", "backend": "juicefs", "size": "1Gi"});
    eventually(
        "a juicefs volume created",
        Duration::from_secs(60),
        || async {
            let (s, v) = api.call(Method::POST, "/volumes", Some(body.clone())).await;
            assert!(
                s == StatusCode::CREATED || s == StatusCode::SERVICE_UNAVAILABLE,
                "{s} {v}"
            );
            s == StatusCode::CREATED
        },
    )
    .await;
    let (_, v) = api.volume("shared-rwx").await;
    assert_eq!(v["backend"], "juicefs", "{v}");
    assert_eq!(v["nodeName"], "", "{v}");
    assert_eq!(v["capabilities"]["shared"], true, "{v}");
    assert_eq!(v["capabilities"]["instantForks"], true, "{v}");

    // RWX: a writer on node-a and a reader on node-b at the same time.
    let mount = |name: &str, ro: bool| {
        json!([pvc(
            "data",
            name,
            "/data",
            ro,
            json!({"createIfNotExists": false})
        )])
    };
    let a = create_in(api, "default", mount("shared-rwx", false)).await;
    let b = create_in(api, "other", mount("shared-rwx", false)).await;
    api.sh_ok(&a, "head -c 2000000 /dev/urandom > /data/blob && sync")
        .await;
    let sum_a = api.sh_ok(&a, "md5sum /data/blob").await;
    let sum_b = api.sh_ok(&b, "md5sum /data/blob").await;
    assert_eq!(
        sum_a.split_whitespace().next(),
        sum_b.split_whitespace().next(),
        "node-b reads what node-a wrote"
    );
    api.sh_ok(&b, "echo from-b > /data/b.txt && sync").await;
    assert_eq!(api.sh_ok(&a, "cat /data/b.txt").await.trim(), "from-b");
    eventually("both holders listed", Duration::from_secs(10), || async {
        let (_, v) = api.volume("shared-rwx").await;
        holder_nodes(&v) == ["node-a", "node-b"]
    })
    .await;

    // RWO: one writer in the cluster; a reader elsewhere is fine.
    api.create_volume(json!({"name": "shared-rwo", "backend": "juicefs"}))
        .await;
    let w = create_in(api, "default", mount("shared-rwo", false)).await;
    let (s, e) = try_create_in(api, "other", mount("shared-rwo", false)).await;
    assert_eq!(s, StatusCode::CONFLICT, "second writer on node-b: {e}");
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("ReadWriteOnce") && msg.contains("node-a"),
        "the refusal names the mode and the writer's node: {msg}"
    );
    let r = create_in(api, "other", mount("shared-rwo", true)).await;
    assert_eq!(api.sh_ok(&r, "ls /data").await.trim(), "");
    // Once the writer is gone, node-b may write.
    api.delete(&w).await;
    let w2 = create_in(api, "other", mount("shared-rwo", false)).await;
    api.sh_ok(&w2, "echo ok > /data/f").await;

    // node-dead never mounted: it gets no sandbox that needs the
    // filesystem (node-a takes them all, loaded or not) ...
    let (_, dead) = api.volume("shared-rwx").await;
    assert_eq!(dead["available"], true, "{dead}");
    let mut more = Vec::new();
    for _ in 0..3 {
        more.push(create_in(api, "default", mount("shared-rwx", true)).await);
    }
    let (_, v) = api.volume("shared-rwx").await;
    eventually(
        "the new readers listed",
        Duration::from_secs(10),
        || async {
            let (_, v) = api.volume("shared-rwx").await;
            v["mounts"].as_array().map(Vec::len) == Some(5)
        },
    )
    .await;
    let (_, v2) = api.volume("shared-rwx").await;
    assert!(
        !holder_nodes(&v2).iter().any(|n| n == "node-dead"),
        "a dead mount got a sandbox: {v} / {v2}"
    );
    for id in &more {
        assert_eq!(
            agent_of(&fp, id).await,
            "node-a",
            "a reader of a juicefs volume"
        );
    }
    // ... while sandboxes without volumes go there (it is the least loaded
    // agent of the pool: only the mount kept the readers away).
    let plain = create_in(api, "default", json!([])).await;
    let plain2 = create_in(api, "default", json!([])).await;
    for id in [&plain, &plain2] {
        assert_eq!(
            agent_of(&fp, id).await,
            "node-dead",
            "a sandbox without volumes"
        );
    }
    assert_eq!(agent_of(&fp, &a).await, "node-a");
    assert_eq!(agent_of(&fp, &b).await, "node-b");
    // Delete and restore are refused while any node mounts it (the agent
    // asked knows only its own holders); snapshot and fork go through any
    // mounted agent and stay on JuiceFS.
    let (s, e) = api.delete_volume("shared-rwx").await;
    assert_eq!(s, StatusCode::CONFLICT, "delete while mounted: {e}");
    let (s, e) = api.snapshot("shared-rwx", "s1").await;
    assert!(s.is_success(), "snapshot: {s} {e}");
    let (s, f) = api
        .fork(
            "shared-rwx",
            json!({"name": "shared-fork", "snapshot": "s1"}),
        )
        .await;
    assert!(s.is_success(), "fork: {s} {f}");
    assert_eq!(f["capabilities"]["shared"], true, "{f}");
    let (s, e) = api.restore("shared-rwx", "s1").await;
    assert_eq!(s, StatusCode::CONFLICT, "restore while mounted: {e}");
    let reader = create_in(api, "other", mount("shared-fork", true)).await;
    assert_eq!(
        api.sh_ok(&reader, "md5sum /data/blob")
            .await
            .split_whitespace()
            .next(),
        sum_a.split_whitespace().next(),
        "the fork on node-b has the snapshot's bytes"
    );
    api.delete(&reader).await;
    for id in [&a, &w2, &plain, &plain2] {
        api.delete(id).await;
    }
    for id in more.iter().chain([&b, &r]) {
        api.delete(id).await;
    }
    let (s, v) = api.delete_volume("shared-rwo").await;
    assert!(s.is_success(), "{s} {v}");
    let (s, _) = api.volume("shared-rwo").await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    lifecycle.shutdown().await.expect("lifecycle stops");
    for a in agents {
        a.shutdown().await;
    }
    ctl.shutdown().await;
    drop(fs);
    drop_bed(bed).await;
}
