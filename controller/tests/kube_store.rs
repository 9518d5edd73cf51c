//! The Kubernetes store against the in-process Kubernetes API double
//! (`sandbolt-kube-double`): no real API server can be installed here. The
//! double keeps the API's semantics (resourceVersion conflicts, finalizers,
//! the status subresource, watch), and these tests check the store through
//! them — and, with a real agent on the test bed, the controller on top.
//!
//! The store blocks its caller for API round trips, so the tests run on the
//! multi-threaded runtime (the double serves on the same process).

use std::collections::BTreeMap;
use std::time::Duration;

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use sandbolt_controller::SandboxKey;
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig, STATE_ANNOTATION};
use sandbolt_controller::store::{
    AccessMode, AgentPod, AgentRecord, Consistency, FailurePolicy, HostVolume, ListRange, Phase,
    PvcVolume, Resources, SandboxRecord, SandboxSpec, Store, StoreError,
};
use sandbolt_deploy::Sandbox;
use sandbolt_deploy::sandbox::FINALIZER;
use sandbolt_kube_double::ApiDouble;

fn record(ns: &str, name: &str, request_id: &str) -> SandboxRecord {
    SandboxRecord {
        uid: format!("uid-{name}"),
        name: name.into(),
        namespace: ns.into(),
        sandbox_id: Default::default(),
        agent_id: "agent-1".into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "docker.io/library/busybox:latest".into(),
            command: vec!["sleep".into()],
            args: vec!["1000".into()],
            envs: BTreeMap::from([("A".to_string(), "1".to_string())]),
            working_dir: "/".into(),
            exposed_ports: vec![8080],
            metadata: BTreeMap::from([("team".to_string(), "red".to_string())]),
            expires_at: 1_900_000_000,
            failure_policy: FailurePolicy::AutoRecreate,
            recovery_timeout_seconds: 30,
            resources: Resources {
                cpu_limit: "500m".into(),
                memory_limit: "64Mi".into(),
                pids_limit: 128,
                cpu_request: "250m".into(),
                memory_request: String::new(),
                ephemeral_storage_limit: "1Gi".into(),
            },
            volumes: vec![HostVolume {
                name: "data".into(),
                host_path: "/srv/data".into(),
                sub_path: "x".into(),
                mount_path: "/data".into(),
                read_only: true,
            }],
            pvc_volumes: vec![PvcVolume {
                name: "work".into(),
                claim_name: "work-vol".into(),
                mount_path: "/work".into(),
                create_if_missing: true,
                access_mode: AccessMode::ReadWriteMany,
                size: "1Gi".into(),
                delete_on_sandbox_delete: true,
                created_by_sandbox: true,
                ..Default::default()
            }],
            runtime: "runc".into(),
            network_policy_json:
                r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"}]}"#
                    .into(),
            // Warm pool membership rides in the state annotation.
            warm_pool: "py".into(),
            snapshot_id: "snap-1".into(),
            // Secret env rides sealed in the state annotation.
            sealed_envs: BTreeMap::from([("S".to_string(), "v1:00ff".to_string())]),
        },
        reset_revision: String::new(),
        generation: 1,
        phase: Phase::Pending,
        message: String::new(),
        request_id: request_id.into(),
        access_token: "tok".into(),
        consistency: Consistency::Strong,
        created_at_unix_ms: 1_700_000_000_000,
        assignment_attempt: 1,
        recovery_deadline_unix_ms: 0,
        events: vec![],
        revision: String::new(),
        last_transition_unix_ms: 1_700_000_000_123,
        network_policy_pending: true,
        network_policy_transition_unix_ms: 1_700_000_000_456,
        ip_address: "10.203.0.9".into(),
        claimed_warm: true,
        // The store's to fill from the object.
        api_uid: String::new(),
        api_generation: 0,
    }
}

fn open(api: &ApiDouble) -> KubeStore {
    let mut cfg = KubeStoreConfig::new("sandbolt-system");
    cfg.write_timeout = Duration::from_secs(5);
    KubeStore::open(api.config(), cfg).expect("kube store opens on the double")
}

/// Polls `f` until it holds; panics after 10 s.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    sandbolt_test_support::eventually(what, Duration::from_secs(10), || f().then_some(())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_sandbox_resources_with_conflicts_and_finalizers() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let sandboxes: Api<Sandbox> = Api::namespaced(api.client(), "team-a");

    // Create: one Sandbox with the spec, labels, finalizer, state annotation.
    let created = store.create(&record("team-a", "fsb-one", "req-1")).unwrap();
    assert!(!created.revision.is_empty());
    let obj = sandboxes.get("fsb-one").await.unwrap();
    assert_eq!(obj.spec.image, "docker.io/library/busybox:latest");
    assert_eq!(obj.spec.pool_ref, "default");
    assert_eq!(obj.spec.env["A"], "1");
    // The whole sandbox is in the resource: limits in Kubernetes' shape.
    let res = obj.spec.resources.clone().unwrap();
    assert_eq!(res.limits["cpu"], "500m");
    assert_eq!(res.limits["memory"], "64Mi");
    assert_eq!(res.limits["pids"], "128");
    assert_eq!(res.requests["cpu"], "250m");
    assert_eq!(obj.spec.volumes[0].host_path, "/srv/data");
    assert_eq!(obj.spec.runtime.as_deref(), Some("runc"));
    // The egress policy is structured in the resource (kubectl-readable).
    let policy = obj.spec.network_policy.clone().expect("spec.networkPolicy");
    assert_eq!(policy.egress[0].target, "*.example.com");
    assert_eq!(
        serde_json::to_value(&policy).unwrap()["defaultAction"],
        "deny"
    );
    assert_eq!(
        obj.metadata.labels.as_ref().unwrap()["metadata.sandbox.fast.io/team"],
        "red"
    );
    assert_eq!(obj.metadata.finalizers.clone().unwrap(), vec![FINALIZER]);
    assert!(
        obj.metadata
            .annotations
            .as_ref()
            .unwrap()
            .contains_key(STATE_ANNOTATION)
    );
    // The status subresource was written: Pending, not ready.
    assert_eq!(
        obj.metadata.resource_version.as_deref(),
        Some(created.revision.as_str())
    );
    assert!(!obj.is_ready());
    assert!(obj.status.is_some(), "status written through /status");

    // Read-your-writes, before or after the watch caught up.
    assert_eq!(
        store
            .get(&SandboxKey::new("team-a", "fsb-one"))
            .unwrap()
            .unwrap(),
        created
    );

    // Name and request id are unique; the holder comes back.
    match store.create(&record("team-a", "fsb-one", "")) {
        Err(StoreError::AlreadyExists(holder)) => assert_eq!(holder.uid, "uid-fsb-one"),
        other => panic!("name reuse: {other:?}"),
    }
    match store.create(&record("team-a", "fsb-other", "req-1")) {
        Err(StoreError::AlreadyExists(holder)) => assert_eq!(holder.name, "fsb-one"),
        other => panic!("request id reuse: {other:?}"),
    }
    assert_eq!(
        store.get_by_request_id("req-1").unwrap().unwrap().name,
        "fsb-one"
    );

    // Replace: the status follows the phase; the Sandbox turns ready.
    let mut running = created.clone();
    running.phase = Phase::Running;
    running.sandbox_id = "sb-1".into();
    let running = store.replace(&running).unwrap();
    assert_ne!(running.revision, created.revision);
    let obj = sandboxes.get("fsb-one").await.unwrap();
    assert!(obj.is_ready(), "{:?}", obj.status);
    assert_eq!(obj.metadata.resource_version.unwrap(), running.revision);

    // A stale revision conflicts.
    let mut stale = created.clone();
    stale.message = "stale".into();
    assert!(matches!(
        store.replace(&stale),
        Err(StoreError::Conflict(..))
    ));

    // Someone else writes (kubectl label): the watch brings the new version
    // and the old one conflicts; the new one replaces.
    sandboxes
        .patch(
            "fsb-one",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"owner": "ops"}}})),
        )
        .await
        .unwrap();
    assert!(matches!(
        store.replace(&running),
        Err(StoreError::Conflict(..))
    ));
    eventually("the watch delivers the foreign write", || {
        store
            .get(&SandboxKey::new("team-a", "fsb-one"))
            .unwrap()
            .unwrap()
            .revision
            != running.revision
    })
    .await;
    let mut fresh = store
        .get(&SandboxKey::new("team-a", "fsb-one"))
        .unwrap()
        .unwrap();
    fresh.message = "after a foreign write".into();
    store.replace(&fresh).unwrap();
    let obj = sandboxes.get("fsb-one").await.unwrap();
    assert_eq!(
        obj.metadata.labels.unwrap()["owner"],
        "ops",
        "foreign label kept"
    );

    // Listing: namespace, order, pagination.
    for n in ["fsb-b", "fsb-a", "fsb-c"] {
        store.create(&record("team-b", n, "")).unwrap();
    }
    let names = |rs: Vec<SandboxRecord>| rs.into_iter().map(|r| r.name).collect::<Vec<_>>();
    assert_eq!(
        names(
            store
                .list(&ListRange::namespace("team-b").limit(2))
                .unwrap()
        ),
        ["fsb-a", "fsb-b"]
    );
    assert_eq!(
        names(
            store
                .list(&ListRange::namespace("team-b").after(Some("fsb-b")))
                .unwrap()
        ),
        ["fsb-c"]
    );
    assert_eq!(store.list(&ListRange::all()).unwrap().len(), 4);

    // Delete: terminating behind the finalizer, then gone.
    let deleted = store
        .delete(&SandboxKey::new("team-b", "fsb-a"))
        .unwrap()
        .unwrap();
    assert_eq!(deleted.name, "fsb-a");
    let team_b: Api<Sandbox> = Api::namespaced(api.client(), "team-b");
    assert!(team_b.get_opt("fsb-a").await.unwrap().is_none());
    assert!(
        store
            .get(&SandboxKey::new("team-b", "fsb-a"))
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .delete(&SandboxKey::new("team-b", "fsb-a"))
            .unwrap()
            .is_none()
    );

    // kubectl delete: the object waits for the controller, which sees it.
    team_b
        .delete("fsb-b", &DeleteParams::default())
        .await
        .unwrap();
    let obj = team_b.get("fsb-b").await.unwrap();
    assert!(obj.metadata.deletion_timestamp.is_some());
    eventually("the deletion request is seen", || {
        store.deletions_requested() == vec![SandboxKey::new("team-b", "fsb-b")]
    })
    .await;
    store.delete(&SandboxKey::new("team-b", "fsb-b")).unwrap();
    assert!(team_b.get_opt("fsb-b").await.unwrap().is_none());
    eventually("the deletion request is gone", || {
        store.deletions_requested().is_empty()
    })
    .await;

    // Agents: Leases, listed back.
    let agent = AgentRecord {
        agent_id: "Node_1".into(),
        namespace: "default".into(),
        pool: "default".into(),
        api_endpoint: "10.0.0.1:9091".into(),
        proxy_endpoint: "10.0.0.1:9092".into(),
        capacity: 8,
        node_name: "node-1".into(),
        // Kept, so a new leader can judge a silent agent's pod gone.
        pod: Some(AgentPod {
            namespace: "sandbolt-system".into(),
            name: "sandbolt-agent-x7k2p".into(),
            uid: "0b5c".into(),
        }),
    };
    store.put_agent(&agent).unwrap();
    let mut moved = agent.clone();
    moved.api_endpoint = "10.0.0.2:9091".into();
    store.put_agent(&moved).unwrap();
    assert_eq!(store.list_agents().unwrap(), vec![moved]);

    // A second store (a new leader) rebuilds the same records.
    let other = open(&api);
    let mut a = store.list(&ListRange::all()).unwrap();
    let mut b = other.list(&ListRange::all()).unwrap();
    a.sort_by(|x, y| (&x.namespace, &x.name).cmp(&(&y.namespace, &y.name)));
    b.sort_by(|x, y| (&x.namespace, &x.name).cmp(&(&y.namespace, &y.name)));
    assert_eq!(a, b);
    assert_eq!(b.len(), 2);
    drop(other);
    drop(store);
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_failures_surface_as_store_errors_and_the_cache_survives_lost_watches() {
    let api = ApiDouble::start().await;
    let store = open(&api);

    // An invalid name is the caller's fault, not an outage.
    match store.create(&record("default", "Not_A_Name", "")) {
        Err(StoreError::Invalid(msg)) => assert!(!msg.is_empty()),
        other => panic!("invalid name: {other:?}"),
    }
    // A failing API server is a backend error, and nothing is remembered.
    api.fail_next("create", "sandboxes", 500, 1);
    assert!(matches!(
        store.create(&record("default", "fsb-x", "")),
        Err(StoreError::Backend(_))
    ));
    assert!(
        store
            .get(&SandboxKey::new("default", "fsb-x"))
            .unwrap()
            .is_none()
    );
    // A failed status write leaves the record whole (the next write fixes
    // the status).
    api.fail_next("update", "sandboxes", 500, 1);
    let r = store.create(&record("default", "fsb-x", "")).unwrap();
    let mut running = r.clone();
    running.phase = Phase::Running;
    store.replace(&running).unwrap();
    let obj = Api::<Sandbox>::namespaced(api.client(), "default")
        .get("fsb-x")
        .await
        .unwrap();
    assert!(obj.is_ready());

    // Watches break and history is compacted: the cache relists and still
    // sees writes made meanwhile by others.
    api.close_watches();
    api.compact();
    Api::<Sandbox>::namespaced(api.client(), "default")
        .patch(
            "fsb-x",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"labels": {"metadata.sandbox.fast.io/k": "v"}}}),
            ),
        )
        .await
        .unwrap();
    eventually("the relisted cache sees the foreign write", || {
        store
            .get(&SandboxKey::new("default", "fsb-x"))
            .unwrap()
            .is_some_and(|r| r.spec.metadata.get("k").map(String::as_str) == Some("v"))
    })
    .await;

    // While the API server is down, writes fail (reads keep coming from
    // the cache).
    api.set_unavailable(true);
    let mut r = store
        .get(&SandboxKey::new("default", "fsb-x"))
        .unwrap()
        .unwrap();
    r.message = "x".into();
    assert!(store.replace(&r).is_err());
    assert!(
        store
            .get(&SandboxKey::new("default", "fsb-x"))
            .unwrap()
            .is_some()
    );
    api.set_unavailable(false);
    drop(store);
    api.shutdown().await;
}
