//! Volumes on the real Docker backend: the named-volume routes answer a
//! clear 501 (no snapshots or forks on Docker) naming the route; a `pvc`
//! is a Docker named volume whose `createIfNotExists` and
//! `deleteOnSandboxTermination` are honoured; a read-write host binding
//! never contains another sandbox's binding; the engine is checked to see
//! the allowed host-path roots where the lifecycle does.

use crate::common;

use bollard::Docker;
use bollard::models::VolumeCreateRequest;
use common::{call, sh};
use reqwest::{Method as M, StatusCode};
use serde_json::{Value, json};

fn engine(env: &common::DockerEnv) -> Docker {
    Docker::connect_with_unix(
        env.socket().to_str().unwrap(),
        120,
        bollard::API_DEFAULT_VERSION,
    )
    .expect("bollard connects to the bed's dockerd")
}

fn body(image: &str, volumes: Value) -> Value {
    json!({
        "image": {"uri": image},
        "entrypoint": ["sleep", "infinity"],
        "timeout": 600,
        "resourceLimits": {},
        "volumes": volumes,
    })
}

async fn create(base: &str, b: Value) -> (StatusCode, Value) {
    call(M::POST, format!("{base}/v1/sandboxes"), Some(b)).await
}

async fn delete(base: &str, id: &str) {
    let (s, v) = call(M::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
}

async fn volume_exists(docker: &Docker, name: &str) -> bool {
    match docker.inspect_volume(name).await {
        Ok(_) => true,
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => false,
        Err(e) => panic!("inspect volume {name}: {e}"),
    }
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_volume_routes_say_docker_has_none() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    for prefix in ["", "/v1"] {
        for (method, path, route, b) in [
            (
                M::POST,
                "/volumes",
                "POST /volumes",
                Some(json!({"name": "a"})),
            ),
            (M::GET, "/volumes", "GET /volumes", None),
            (M::GET, "/volumes/a", "GET /volumes/{name}", None),
            (M::DELETE, "/volumes/a", "DELETE /volumes/{name}", None),
            (
                M::POST,
                "/volumes/a/snapshots",
                "POST /volumes/{name}/snapshots",
                Some(json!({"name": "s"})),
            ),
            (
                M::GET,
                "/volumes/a/snapshots",
                "GET /volumes/{name}/snapshots",
                None,
            ),
            (
                M::DELETE,
                "/volumes/a/snapshots/s",
                "DELETE /volumes/{name}/snapshots/{snapshot}",
                None,
            ),
            (
                M::POST,
                "/volumes/a/restore",
                "POST /volumes/{name}/restore",
                Some(json!({"snapshot": "s"})),
            ),
            // Even a body that would be refused: the route itself is what
            // this runtime cannot serve, and that is said first.
            (
                M::POST,
                "/volumes/a/fork",
                "POST /volumes/{name}/fork",
                Some(json!({"bogus": 1})),
            ),
            (
                M::POST,
                "/sandboxes/x/volumes",
                "POST /sandboxes/{id}/volumes",
                Some(json!({"name": "d", "mountPath": "/d", "pvc": {"claimName": "a"}})),
            ),
            (
                M::DELETE,
                "/sandboxes/x/volumes/a",
                "DELETE /sandboxes/{id}/volumes/{volumeName}",
                None,
            ),
        ] {
            let (s, v) = call(method.clone(), format!("{base}{prefix}{path}"), b).await;
            assert_eq!(
                s,
                StatusCode::NOT_IMPLEMENTED,
                "{method} {prefix}{path}: {v}"
            );
            assert_eq!(v["code"], "VOLUME::NAMED_VOLUMES_UNSUPPORTED", "{v}");
            let msg = v["message"].as_str().unwrap();
            assert!(msg.starts_with(&format!("{route}:")), "{msg}");
            assert!(
                msg.contains("docker runtime") && msg.contains("containerd"),
                "{msg}"
            );
        }
    }
    // The served document lists the routes (on every backend: it is one
    // document).
    let (s, doc) = call(M::GET, format!("{base}/openapi.json"), None).await;
    assert_eq!(s, StatusCode::OK);
    for p in [
        "/volumes",
        "/v1/volumes/{volume_name}/fork",
        "/sandboxes/{sandbox_id}/volumes",
    ] {
        assert!(doc["paths"][p].is_object(), "{p} missing from the document");
    }
    assert!(doc["components"]["schemas"]["NamedVolume"].is_object());
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pvc_create_and_delete_hints_on_docker() {
    let env = common::docker_env();
    let docker = engine(&env);
    let h = env.start().await;
    let base = format!("http://{}", h.addr());

    // createIfNotExists=false on a missing volume: 404 naming it, nothing
    // created, no container left.
    let missing = unique("missing");
    let (s, v) = create(
        &base,
        body(
            &env.image,
            json!([{"name": "d", "mountPath": "/d", "pvc": {"claimName": missing, "createIfNotExists": false}}]),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["code"], "VOLUME_NOT_FOUND");
    assert!(
        v["message"].as_str().unwrap().contains(&missing)
            && v["message"].as_str().unwrap().contains("createIfNotExists"),
        "{v}"
    );
    assert!(!volume_exists(&docker, &missing).await);
    let (_, list) = call(M::GET, format!("{base}/v1/sandboxes"), None).await;
    assert_eq!(list["pagination"]["totalItems"], 0, "{list}");

    // ... and the same on an existing one works, and data survives (one
    // labelled for sandboxes: others are refused, docker_pvc_labels.rs).
    let existing = unique("existing");
    docker
        .create_volume(VolumeCreateRequest {
            name: Some(existing.clone()),
            labels: Some(std::collections::HashMap::from([(
                "opensandbox.io/sandbolt-managed".to_string(),
                "true".to_string(),
            )])),
            ..Default::default()
        })
        .await
        .unwrap();
    // What the "who created it" label relies on: the engine answers a
    // create of an existing name with the existing volume, labels and all.
    let again = docker
        .create_volume(VolumeCreateRequest {
            name: Some(existing.clone()),
            labels: Some(std::collections::HashMap::from([(
                "opensandbox.io/sandbolt-created-by".to_string(),
                "somebody".to_string(),
            )])),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        !again
            .labels
            .contains_key("opensandbox.io/sandbolt-created-by"),
        "{again:?}"
    );
    // deleteOnSandboxTermination on a volume that existed before: never removed.
    // The provisioning hints are ignored on Docker, as the contract says.
    let (s, a) = create(
        &base,
        body(
            &env.image,
            json!([{"name": "d", "mountPath": "/d", "pvc": {
                "claimName": existing, "createIfNotExists": false, "deleteOnSandboxTermination": true,
                "storage": "1Gi", "storageClass": "fast", "accessModes": ["ReadOnlyMany", "ReadWriteOnce"]}}]),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{a}");
    let a = a["id"].as_str().unwrap().to_string();
    let out = sh(&base, &a, "echo kept > /d/f && cat /d/f").await;
    assert_eq!(out.stdout, "kept\n", "{out:?}");
    delete(&base, &a).await;
    assert!(
        volume_exists(&docker, &existing).await,
        "a pre-existing volume was removed"
    );

    // Created by this request with deleteOnSandboxTermination: removed with it.
    let owned = unique("owned");
    let vols = json!([{"name": "d", "mountPath": "/d", "pvc": {"claimName": owned, "deleteOnSandboxTermination": true}}]);
    let (s, b) = create(&base, body(&env.image, vols.clone())).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let b = b["id"].as_str().unwrap().to_string();
    assert!(volume_exists(&docker, &owned).await);
    // A second sandbox mounts it too (it did not create it): it stays while
    // that one runs, and goes once the last user is deleted.
    let (s, c) = create(&base, body(&env.image, vols)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{c}");
    let c = c["id"].as_str().unwrap().to_string();
    delete(&base, &b).await;
    assert!(
        volume_exists(&docker, &owned).await,
        "removed while another sandbox mounts it"
    );
    let out = sh(&base, &c, "touch /d/still && echo ok").await;
    assert_eq!(out.stdout, "ok\n", "{out:?}");
    delete(&base, &c).await;
    assert!(
        !volume_exists(&docker, &owned).await,
        "the volume its sandbox created was not removed"
    );

    // Created without deleteOnSandboxTermination: kept.
    let kept = unique("kept");
    let (s, d) = create(
        &base,
        body(
            &env.image,
            json!([{"name": "d", "mountPath": "/d", "pvc": {"claimName": kept}}]),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{d}");
    delete(&base, d["id"].as_str().unwrap()).await;
    assert!(volume_exists(&docker, &kept).await);

    // Unknown pvc fields are refused, never ignored.
    let (s, v) = create(
        &base,
        body(
            &env.image,
            json!([{"name": "d", "mountPath": "/d", "pvc": {"claimName": kept, "sizeLimit": "1Gi"}}]),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("sizeLimit"), "{v}");

    for v in [existing, kept] {
        docker
            .remove_volume(&v, None::<bollard::query_parameters::RemoveVolumeOptions>)
            .await
            .unwrap();
    }
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_write_host_binding_never_contains_another() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    let root = env.host_root.path();
    for d in ["a/b", "w", "c"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let host = |path: &std::path::Path, rw: bool| json!([{"name": "h", "mountPath": "/h", "host": {"path": path}, "readOnly": !rw}]);
    // s1 binds a/b read-only; s2 binds w read-write.
    let (s, s1) = create(&base, body(&env.image, host(&root.join("a/b"), false))).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{s1}");
    let (s, s2) = create(&base, body(&env.image, host(&root.join("w"), true))).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{s2}");
    let s1 = s1["id"].as_str().unwrap().to_string();
    let s2 = s2["id"].as_str().unwrap().to_string();

    // A read-write parent of s1's binding: 400 naming both paths and s1.
    let (s, v) = create(&base, body(&env.image, host(&root.join("a"), true))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["code"], "VOLUME::HOST_PATH_CONTAINS_BINDING");
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("a/b") && msg.contains(&s1), "{msg}");
    // The whole root, read-write: contains both.
    let (s, v) = create(&base, body(&env.image, host(root, true))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // Anything inside s2's read-write binding, even read-only.
    std::fs::create_dir_all(root.join("w/task")).unwrap();
    let (s, v) = create(&base, body(&env.image, host(&root.join("w/task"), false))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains(&s2), "{v}");

    // Read-only parent, the same directory, and a sibling are fine.
    let mut ok = Vec::new();
    for (p, rw) in [("a", false), ("w", true), ("c", true)] {
        let (s, v) = create(&base, body(&env.image, host(&root.join(p), rw))).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{p}: {v}");
        ok.push(v["id"].as_str().unwrap().to_string());
    }
    // Once s1 is gone, its parent may be bound read-write again (the
    // read-only binding of "a" holds no binding inside... but "a" itself is
    // now bound read-only by another sandbox: read-write "a" is equal, fine).
    delete(&base, &s1).await;
    let (s, v) = create(&base, body(&env.image, host(&root.join("a"), true))).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    ok.push(v["id"].as_str().unwrap().to_string());
    for id in ok.iter().chain([&s2]) {
        delete(&base, id).await;
    }
    h.shutdown().await.unwrap();
}

/// Two creates at once, a read-write parent and a child of it: however
/// they interleave, exactly one passes (the check and the container's
/// creation are one step for host bindings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_both_pass_the_binding_rule() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    for round in 0..4 {
        let parent = env.host_root.path().join(format!("r{round}"));
        let child = parent.join("child");
        std::fs::create_dir_all(&child).unwrap();
        let mk = |p: &std::path::Path, rw: bool| {
            body(
                &env.image,
                json!([{"name": "h", "mountPath": "/h", "host": {"path": p}, "readOnly": !rw}]),
            )
        };
        let (a, b) = tokio::join!(
            create(&base, mk(&parent, true)),
            create(&base, mk(&child, false))
        );
        let passed: Vec<&Value> = [&a, &b]
            .into_iter()
            .filter(|(s, _)| *s == StatusCode::ACCEPTED)
            .map(|(_, v)| v)
            .collect();
        assert_eq!(passed.len(), 1, "round {round}: {a:?} {b:?}");
        let refused = if a.0 == StatusCode::ACCEPTED { &b } else { &a };
        assert_eq!(refused.0, StatusCode::BAD_REQUEST, "{refused:?}");
        assert_eq!(refused.1["code"], "VOLUME::HOST_PATH_CONTAINS_BINDING");
        delete(&base, passed[0]["id"].as_str().unwrap()).await;
    }
    h.shutdown().await.unwrap();
}

/// Env of the inner half of [`the_engine_must_see_allowed_roots_where_the_lifecycle_does`].
const PROBE_ENV: &str = "SANDBOLT_TEST_PROBE_INNER";

/// The lifecycle sees an allowed root that the engine resolves to another
/// directory (here: another mount namespace, as for a lifecycle in a
/// container): it refuses to start, naming the path. The same root seen
/// alike by both starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_must_see_allowed_roots_where_the_lifecycle_does() {
    // The same test, run again by itself inside the private namespace.
    if std::env::var_os(PROBE_ENV).is_some() {
        inner_probe_in_another_mount_namespace().await;
        return;
    }
    let env = common::docker_env();
    // Seen alike: starts (the probe file is gone afterwards).
    let h = env.start().await;
    h.shutdown().await.unwrap();
    let left: Vec<_> = std::fs::read_dir(env.host_root.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "probe files left: {left:?}");

    // Seen differently: the inner half runs this test binary in a private
    // mount namespace where `shown` is bind-mounted over `root`.
    let root = tempfile::tempdir().unwrap();
    let shown = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--"])
        .arg(exe)
        .args([
            "--exact",
            &sandbolt_test_support::test_name(
                module_path!(),
                "the_engine_must_see_allowed_roots_where_the_lifecycle_does",
            ),
            "--nocapture",
        ])
        .env(PROBE_ENV, "1")
        .env("PROBE_SOCKET", env.socket())
        .env("PROBE_EXECD", &env.execd)
        .env("PROBE_ROOT", root.path())
        .env("PROBE_SHOWN", shown.path())
        .env("PROBE_DATA", env.data.path())
        .output()
        .expect("unshare runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "inner half failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "the inner half did not run:\n{text}"
    );
    // Nothing left where the lifecycle wrote (the directory it saw) either.
    assert_eq!(std::fs::read_dir(shown.path()).unwrap().count(), 0);
}

/// The inner half: runs in the private mount namespace (see above).
async fn inner_probe_in_another_mount_namespace() {
    let var = |k: &str| std::path::PathBuf::from(std::env::var_os(k).unwrap());
    let (root, shown) = (var("PROBE_ROOT"), var("PROBE_SHOWN"));
    let st = std::process::Command::new("mount")
        .arg("--bind")
        .arg(&shown)
        .arg(&root)
        .status()
        .unwrap();
    assert!(st.success(), "bind mount in the private namespace");
    let mut docker = sandbolt_lifecycle::DockerConfig::new(var("PROBE_SOCKET"), var("PROBE_EXECD"));
    docker.isolation = false;
    let mut c = sandbolt_lifecycle::LifecycleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        sandbolt_lifecycle::BackendConfig::Docker(docker),
        var("PROBE_DATA"),
    );
    c.api_key = Some(common::API_KEY.into());
    c.allow_host_paths = vec![root.clone()];
    let e = match sandbolt_lifecycle::Lifecycle::start(c).await {
        Ok(_) => panic!("started although the engine sees another directory"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(&root.display().to_string()) && e.contains("another directory"),
        "{e}"
    );
}
