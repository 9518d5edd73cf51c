//! Warm pools on the Kubernetes store, against the in-process API double
//! (`sandbolt-kube-double`, as in kube_store.rs): each pool is a
//! `SandboxWarmPool` in the controller's namespace, written with
//! resourceVersion preconditions and read from a watch cache, so a pool
//! applied with kubectl is one the controller lists; the leader publishes
//! each pool's counts as its status.
//!
//! The store blocks its caller for API round trips: multi-threaded runtime.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig, WARM_CREATED_ANNOTATION};
use sandbolt_controller::store::{
    Phase, Resources, SandboxRecord, SandboxSpec, Store, StoreError, WarmPoolRecord,
};
use sandbolt_controller::warm_pool_status::{self, WarmCounts};
use sandbolt_deploy::SandboxWarmPool;
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::control::v1 as pb;
use serde_json::json;

const NS: &str = "sandbolt-system";

fn open(api: &ApiDouble) -> KubeStore {
    let mut cfg = KubeStoreConfig::new(NS);
    cfg.write_timeout = Duration::from_secs(5);
    KubeStore::open(api.config(), cfg).expect("kube store opens on the double")
}

fn pool(name: &str) -> WarmPoolRecord {
    WarmPoolRecord {
        name: name.into(),
        agent_pool: "default".into(),
        image: "docker.io/library/python:3.12".into(),
        runtime: "runc".into(),
        limits: Resources {
            cpu_limit: "500m".into(),
            memory_limit: "256Mi".into(),
            pids_limit: 64,
            ..Default::default()
        },
        env: BTreeMap::from([("A".to_string(), "1".to_string())]),
        buffer_min: 1,
        buffer_max: 3,
        pool_min: 0,
        pool_max: 10,
        created_at_unix_ms: 1_700_000_000_123,
        generation: 1,
        revision: String::new(),
    }
}

/// Polls `f` until it answers; panics after 10 s.
async fn eventually<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    sandbolt_test_support::eventually(what, Duration::from_secs(10), f).await
}

/// The pool as the store would answer for it, without what the store sets.
fn spec_only(mut p: WarmPoolRecord) -> WarmPoolRecord {
    p.revision.clear();
    p.generation = 0;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pools_are_resources_with_exists_conflict_and_not_found() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let objects: Api<SandboxWarmPool> = Api::namespaced(api.client(), NS);

    // Create: one SandboxWarmPool in the controller's namespace.
    let created = store.put_warm_pool(&pool("py")).unwrap();
    assert!(!created.revision.is_empty());
    assert_eq!(created.generation, 1);
    assert_eq!(spec_only(created.clone()), spec_only(pool("py")));
    let obj = objects.get("py").await.unwrap();
    assert_eq!(
        obj.resource_version().as_deref(),
        Some(created.revision.as_str())
    );
    let v = serde_json::to_value(&obj).unwrap();
    assert_eq!(v["spec"]["agentPool"], "default");
    assert_eq!(
        v["spec"]["template"]["image"],
        "docker.io/library/python:3.12"
    );
    assert_eq!(v["spec"]["template"]["runtime"], "runc");
    assert_eq!(
        v["spec"]["template"]["limits"],
        json!({"cpu": "500m", "memory": "256Mi", "pids": 64})
    );
    assert_eq!(v["spec"]["template"]["env"], json!({"A": "1"}));
    assert_eq!(
        v["spec"]["capacity"],
        json!({"bufferMin": 1, "bufferMax": 3, "poolMin": 0, "poolMax": 10})
    );
    assert_eq!(obj.annotations()[WARM_CREATED_ANNOTATION], "1700000000123");
    assert!(
        obj.finalizers().is_empty(),
        "nothing waits on a pool's delete"
    );

    // Read own writes at once, through get and list.
    assert_eq!(store.get_warm_pool("py").unwrap(), Some(created.clone()));
    assert_eq!(store.list_warm_pools().unwrap(), vec![created.clone()]);

    // The name is taken.
    match store.put_warm_pool(&pool("py")) {
        Err(StoreError::WarmPoolExists(n)) => assert_eq!(n, "py"),
        other => panic!("expected WarmPoolExists, got {other:?}"),
    }

    // Replace with the revision read: new revision, the server's generation.
    let mut grown = created.clone();
    grown.buffer_max = 5;
    grown.pool_max = 20;
    let updated = store.put_warm_pool(&grown).unwrap();
    assert_ne!(updated.revision, created.revision);
    assert_eq!(updated.generation, 2);
    assert_eq!((updated.buffer_max, updated.pool_max), (5, 20));
    let obj = objects.get("py").await.unwrap();
    assert_eq!(obj.spec.capacity.buffer_max, 5);
    assert_eq!(obj.metadata.generation, Some(2));
    assert_eq!(store.get_warm_pool("py").unwrap(), Some(updated.clone()));

    // A stale revision is a conflict, and changes nothing.
    let mut stale = created.clone();
    stale.buffer_min = 0;
    match store.put_warm_pool(&stale) {
        Err(StoreError::WarmPoolConflict(n)) => assert_eq!(n, "py"),
        other => panic!("expected WarmPoolConflict, got {other:?}"),
    }
    assert_eq!(objects.get("py").await.unwrap().spec.capacity.buffer_min, 1);

    // Replacing a pool that does not exist.
    let mut ghost = pool("ghost");
    ghost.revision = created.revision.clone();
    match store.put_warm_pool(&ghost) {
        Err(StoreError::WarmPoolNotFound(n)) => assert_eq!(n, "ghost"),
        other => panic!("expected WarmPoolNotFound, got {other:?}"),
    }
    // An unknown runtime never reaches the API.
    let mut odd = pool("odd");
    odd.runtime = "kata".into();
    assert!(matches!(
        store.put_warm_pool(&odd),
        Err(StoreError::Invalid(m)) if m.contains("kata")
    ));

    // What someone else adds to the object survives the controller's
    // replace, whose base is the version it read (fetched when the cache
    // lags behind).
    let labelled = objects
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "ml"}}})),
        )
        .await
        .unwrap();
    let seen = eventually("the store sees the label write", || {
        store
            .get_warm_pool("py")
            .unwrap()
            .filter(|p| Some(&p.revision) == labelled.metadata.resource_version.as_ref())
    })
    .await;
    let mut shrunk = seen.clone();
    shrunk.buffer_max = 2;
    let after = store.put_warm_pool(&shrunk).unwrap();
    let obj = objects.get("py").await.unwrap();
    assert_eq!(obj.labels()["team"], "ml");
    assert_eq!(obj.spec.capacity.buffer_max, 2);
    assert_eq!(
        obj.resource_version().as_deref(),
        Some(after.revision.as_str())
    );

    // A second pool; the list is in name order.
    let other = store.put_warm_pool(&pool("a-node")).unwrap();
    let names: Vec<String> = store
        .list_warm_pools()
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(names, ["a-node", "py"]);

    // Delete answers with the pool removed; a second delete with nothing.
    let deleted = store.delete_warm_pool("py").unwrap().expect("py existed");
    assert_eq!(deleted.name, "py");
    assert_eq!(deleted.buffer_max, 2);
    assert!(objects.get_opt("py").await.unwrap().is_none());
    assert_eq!(store.get_warm_pool("py").unwrap(), None);
    assert_eq!(store.delete_warm_pool("py").unwrap(), None);
    // Replacing the deleted pool: gone.
    assert!(matches!(
        store.put_warm_pool(&after),
        Err(StoreError::WarmPoolNotFound(_))
    ));
    // Once the watch delivered everything, the cache agrees.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.list_warm_pools().unwrap(), vec![other]);
    // A name freed by a delete can be taken again.
    store.put_warm_pool(&pool("py")).unwrap();
}

fn warm_resource() -> ApiResource {
    ApiResource {
        group: "sandbolt.io".into(),
        version: "v1alpha1".into(),
        api_version: "sandbolt.io/v1alpha1".into(),
        kind: "SandboxWarmPool".into(),
        plural: "sandboxwarmpools".into(),
    }
}

/// A pool as `kubectl apply` would send it: cpu as a number, no runtime,
/// no limits on memory, no controller annotations.
fn kubectl_pool(name: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "sandbolt.io/v1alpha1",
        "kind": "SandboxWarmPool",
        "metadata": {"name": name, "labels": {"owner": "ops"}},
        "spec": {
            "agentPool": "gpu",
            "template": {"image": "busybox:1.36", "limits": {"cpu": 2}},
            "capacity": {"bufferMin": 2, "bufferMax": 4, "poolMin": 1, "poolMax": 8}
        }
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_applied_with_kubectl_is_one_the_store_lists() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let raw: Api<DynamicObject> = Api::namespaced_with(api.client(), NS, &warm_resource());

    let made = raw
        .create(&PostParams::default(), &kubectl_pool("gpu-buffer"))
        .await
        .unwrap();
    // Another namespace's pools are not the controller's.
    let elsewhere: Api<DynamicObject> =
        Api::namespaced_with(api.client(), "team-a", &warm_resource());
    elsewhere
        .create(&PostParams::default(), &kubectl_pool("stray"))
        .await
        .unwrap();

    let listed = eventually("the store lists the kubectl-made pool", || {
        let all = store.list_warm_pools().unwrap();
        (!all.is_empty()).then_some(all)
    })
    .await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let p = &listed[0];
    assert_eq!(p.name, "gpu-buffer");
    assert_eq!(p.agent_pool, "gpu");
    assert_eq!(p.image, "busybox:1.36");
    assert_eq!(p.runtime, "", "unset: the agent pool's");
    assert_eq!(p.limits.cpu_limit, "2");
    assert_eq!(
        (p.limits.memory_limit.as_str(), p.limits.pids_limit),
        ("", 0)
    );
    assert!(p.env.is_empty());
    assert_eq!(
        (p.buffer_min, p.buffer_max, p.pool_min, p.pool_max),
        (2, 4, 1, 8)
    );
    assert_eq!(p.generation, 1);
    assert_eq!(Some(&p.revision), made.metadata.resource_version.as_ref());
    // No annotation: the creation time is the object's (whole seconds).
    let created = made.metadata.creation_timestamp.clone().unwrap();
    assert_eq!(p.created_at_unix_ms, created.0.as_millisecond());
    assert!(p.created_at_unix_ms > 0);
    assert_eq!(store.get_warm_pool("gpu-buffer").unwrap().as_ref(), Some(p));
    assert_eq!(store.get_warm_pool("stray").unwrap(), None);

    // kubectl edit: the new capacity and generation reach the store.
    raw.patch(
        "gpu-buffer",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"capacity": {"bufferMax": 6}}})),
    )
    .await
    .unwrap();
    let edited = eventually("the store sees the edit", || {
        store
            .get_warm_pool("gpu-buffer")
            .unwrap()
            .filter(|p| p.buffer_max == 6)
    })
    .await;
    assert_eq!(edited.generation, 2);

    // The controller updates it like its own; the kubectl label stays.
    let mut mine = edited.clone();
    mine.pool_max = 12;
    store.put_warm_pool(&mine).unwrap();
    let obj = raw.get("gpu-buffer").await.unwrap();
    assert_eq!(obj.data["spec"]["capacity"]["poolMax"], 12);
    assert_eq!(obj.labels()["owner"], "ops");
    // A create through the store is refused: the name is taken.
    assert!(matches!(
        store.put_warm_pool(&pool("gpu-buffer")),
        Err(StoreError::WarmPoolExists(_))
    ));

    // kubectl delete: gone from the store.
    raw.delete("gpu-buffer", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the store forgets the deleted pool", || {
        store.list_warm_pools().unwrap().is_empty().then_some(())
    })
    .await;
    assert_eq!(store.delete_warm_pool("gpu-buffer").unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_records_keep_their_warm_pool_and_claim() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let record = SandboxRecord {
        uid: "uid-w".into(),
        name: "fsb-warm".into(),
        namespace: "team-a".into(),
        agent_id: "agent-1".into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "docker.io/library/python:3.12".into(),
            warm_pool: "py".into(),
            ..Default::default()
        },
        generation: 1,
        phase: Phase::Running,
        access_token: "tok".into(),
        created_at_unix_ms: 1_700_000_000_000,
        claimed_warm: true,
        ..Default::default()
    };
    let created = store.create(&record).unwrap();
    let mut want = record.clone();
    want.revision = created.revision.clone();
    // The API server's identity of the object comes with the record.
    assert!(!created.api_uid.is_empty() && created.api_generation > 0);
    want.api_uid = created.api_uid.clone();
    want.api_generation = created.api_generation;
    assert_eq!(created, want);
    // Through the watch (a fresh store reads only the API's copy).
    drop(store);
    let store = open(&api);
    let read = store
        .get(&record.key())
        .unwrap()
        .expect("the record is read back");
    assert_eq!(read.spec.warm_pool, "py");
    assert!(read.claimed_warm);
    assert_eq!(read, want);
    // The Sandbox's poolRef stays the agent pool the OpenSandbox server reads.
    let sandboxes: Api<sandbolt_deploy::Sandbox> = Api::namespaced(api.client(), "team-a");
    assert_eq!(
        sandboxes.get("fsb-warm").await.unwrap().spec.pool_ref,
        "default"
    );

    // A cold one says so by leaving both out.
    let mut cold = record.clone();
    cold.name = "fsb-cold".into();
    cold.uid = "uid-c".into();
    cold.spec.warm_pool.clear();
    cold.claimed_warm = false;
    let created = store.create(&cold).unwrap();
    assert!(created.spec.warm_pool.is_empty() && !created.claimed_warm);
    let obj = sandboxes.get("fsb-cold").await.unwrap();
    let state = &obj.annotations()[sandbolt_controller::store::kube::STATE_ANNOTATION];
    assert!(
        !state.contains("warmPool") && !state.contains("claimedWarm"),
        "{state}"
    );
}

fn counts(generation: i64, available: i32, allocated: i32) -> WarmCounts {
    WarmCounts {
        generation,
        status: pb::WarmPoolStatus {
            total: available + allocated,
            allocated,
            available,
            starting: 1,
            revision: "ignored".into(),
            agents: 2,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_publisher_writes_each_pools_counts() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let objects: Api<SandboxWarmPool> = Api::namespaced(api.client(), NS);
    store.put_warm_pool(&pool("py")).unwrap();
    store.put_warm_pool(&pool("unknown")).unwrap();

    let known = parking_lot::Mutex::new(counts(1, 2, 3));
    let lookup = |name: &str| (name == "py").then(|| known.lock().clone());

    // Both have no status yet: both are written.
    assert_eq!(
        warm_pool_status::publish_once(&objects, lookup)
            .await
            .unwrap(),
        2
    );
    let st = objects
        .get("py")
        .await
        .unwrap()
        .status
        .expect("status written");
    assert_eq!(
        (
            st.total,
            st.allocated,
            st.available,
            st.starting,
            st.agents,
            st.observed_generation
        ),
        (5, 3, 2, 1, 2, Some(1))
    );
    let unknown = objects.get("unknown").await.unwrap();
    let st = unknown
        .status
        .expect("zeros for a pool the controller does not know");
    assert_eq!((st.total, st.observed_generation), (0, None));
    // Status is not spec: no generation moved, the store's pool unchanged.
    assert_eq!(unknown.metadata.generation, Some(1));

    // Nothing changed: nothing written.
    let writes = api.requests("patch", "sandboxwarmpools");
    assert_eq!(
        warm_pool_status::publish_once(&objects, lookup)
            .await
            .unwrap(),
        0
    );
    assert_eq!(api.requests("patch", "sandboxwarmpools"), writes);

    // A claim: one write, with the new counts.
    *known.lock() = counts(1, 1, 4);
    assert_eq!(
        warm_pool_status::publish_once(&objects, lookup)
            .await
            .unwrap(),
        1
    );
    let st = objects.get("py").await.unwrap().status.unwrap();
    assert_eq!((st.available, st.allocated, st.total), (1, 4, 5));

    // The pool becomes unknown: its observedGeneration is removed, not left.
    let forget = |_: &str| None;
    assert_eq!(
        warm_pool_status::publish_once(&objects, forget)
            .await
            .unwrap(),
        1
    );
    let raw: Api<DynamicObject> = Api::namespaced_with(api.client(), NS, &warm_resource());
    let obj = raw.get("py").await.unwrap();
    assert!(
        obj.data["status"].get("observedGeneration").is_none(),
        "{}",
        obj.data["status"]
    );
    assert_eq!(obj.data["status"]["available"], 0);
}

/// The wiring: a leader over the Kubernetes store loads a kubectl-made pool
/// and publishes its status (the controller's own counts: no agents here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_publishes_the_status_of_a_kubectl_made_pool() {
    use sandbolt_controller::ControllerConfig;
    use sandbolt_controller::ha::{ElectedExit, StatusApis, run_elected};
    use sandbolt_controller::leader::{LeaderElector, LeaseConfig};

    let api = ApiDouble::start().await;
    let raw: Api<DynamicObject> = Api::namespaced_with(api.client(), NS, &warm_resource());
    raw.create(&PostParams::default(), &kubectl_pool("gpu-buffer"))
        .await
        .unwrap();

    let lease = LeaseConfig::new(NS, "sandbolt-controller", "ctrl-a").with_timings(
        Duration::from_millis(1500),
        Duration::from_millis(1000),
        Duration::from_millis(200),
    );
    let elector = LeaderElector::spawn(api.client(), lease).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ControllerConfig::new(
        ([127, 0, 0, 1], sandbolt_test_support::free_port()).into(),
        dir.path(),
        "warm-status-agent-token",
    );
    let kube_config = api.config();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(run_elected(
        cfg,
        elector,
        move || {
            let store = KubeStore::open(kube_config, KubeStoreConfig::new(NS))?;
            Ok(std::sync::Arc::new(store) as _)
        },
        Some(StatusApis::namespaced(api.client(), NS)),
        |_| {},
        async move {
            let _ = stopped.await;
        },
    ));

    let objects: Api<SandboxWarmPool> = Api::namespaced(api.client(), NS);
    let status = sandbolt_test_support::eventually_async(
        "the leader writes the pool's status",
        Duration::from_secs(30),
        || {
            let objects = objects.clone();
            async move {
                objects
                    .get("gpu-buffer")
                    .await
                    .ok()
                    .and_then(|o| o.status)
                    .filter(|s| s.observed_generation == Some(1))
            }
        },
    )
    .await;
    // No agent heartbeats: nothing warm, nothing allocated, no agents.
    assert_eq!(
        (
            status.total,
            status.available,
            status.allocated,
            status.agents
        ),
        (0, 0, 0, 0)
    );

    // An edit is observed: the controller reloads the pool, the status
    // follows its generation.
    raw.patch(
        "gpu-buffer",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"capacity": {"poolMax": 9}}})),
    )
    .await
    .unwrap();
    sandbolt_test_support::eventually_async(
        "the status follows the new generation",
        Duration::from_secs(30),
        || {
            let objects = objects.clone();
            async move {
                objects
                    .get("gpu-buffer")
                    .await
                    .ok()
                    .and_then(|o| o.status)
                    .filter(|s| s.observed_generation == Some(2))
            }
        },
    )
    .await;

    let _ = stop.send(());
    let exit = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the leader stops")
        .unwrap()
        .unwrap();
    assert_eq!(exit, ElectedExit::Shutdown);
}

/// A replace whose revision the cache has not seen (its watch is down) is
/// built on the API's copy of that version, so what others wrote to the
/// object is kept, and nothing is written on a guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replace_ahead_of_the_cache_builds_on_the_apis_copy() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let raw: Api<DynamicObject> = Api::namespaced_with(api.client(), NS, &warm_resource());

    // Cut the watch: every re-list and re-watch fails for a while.
    api.fail_next("list", "sandboxwarmpools", 500, 10_000);
    api.fail_next("watch", "sandboxwarmpools", 500, 10_000);
    api.close_watches();
    let made = raw
        .create(&PostParams::default(), &kubectl_pool("blind"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        store.get_warm_pool("blind").unwrap(),
        None,
        "the cache lags"
    );

    let mut p = pool("blind");
    p.agent_pool = "gpu".into();
    p.revision = made.metadata.resource_version.clone().unwrap();
    let gets = api.requests("get", "sandboxwarmpools");
    let written = store.put_warm_pool(&p).unwrap();
    assert_eq!(
        api.requests("get", "sandboxwarmpools"),
        gets + 1,
        "read the API's copy"
    );
    let obj = raw.get("blind").await.unwrap();
    assert_eq!(obj.labels()["owner"], "ops", "kept from the API's copy");
    assert_eq!(
        obj.data["spec"]["template"]["image"],
        "docker.io/library/python:3.12"
    );
    assert_eq!(obj.resource_version(), Some(written.revision.clone()));
    // Own writes are read back even while the watch is down.
    assert_eq!(store.get_warm_pool("blind").unwrap(), Some(written.clone()));

    // A revision that is not the API's: the server refuses the replace.
    let mut stale = written.clone();
    stale.revision = made.metadata.resource_version.clone().unwrap();
    assert!(matches!(
        store.put_warm_pool(&stale),
        Err(StoreError::WarmPoolConflict(_))
    ));
}

/// WarmPoolService on a leader over the Kubernetes store: its pools are
/// SandboxWarmPools, its errors the store's, and a kubectl edit is what it
/// answers next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_pool_service_keeps_its_pools_as_resources() {
    use sandbolt_controller::ControllerConfig;
    use sandbolt_controller::ha::{StatusApis, run_elected};
    use sandbolt_controller::leader::{LeaderElector, LeaseConfig};
    use sandbolt_proto::control::v1::warm_pool_service_client::WarmPoolServiceClient;

    let api = ApiDouble::start().await;
    let lease = LeaseConfig::new(NS, "sandbolt-controller", "ctrl-svc");
    let elector = LeaderElector::spawn(api.client(), lease).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ControllerConfig::new(
        ([127, 0, 0, 1], sandbolt_test_support::free_port()).into(),
        dir.path(),
        "warm-svc-agent-token",
    );
    let kube_config = api.config();
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let mut addr_tx = Some(addr_tx);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(run_elected(
        cfg,
        elector,
        move || {
            let store = KubeStore::open(kube_config, KubeStoreConfig::new(NS))?;
            Ok(std::sync::Arc::new(store) as _)
        },
        Some(StatusApis::namespaced(api.client(), NS)),
        move |h| {
            if let Some(tx) = addr_tx.take() {
                let _ = tx.send(h.local_addr());
            }
        },
        async move {
            let _ = stopped.await;
        },
    ));
    let addr = tokio::time::timeout(Duration::from_secs(20), addr_rx)
        .await
        .expect("leads and serves")
        .unwrap();
    let mut svc = WarmPoolServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();

    let want = pb::WarmPool {
        name: "py".into(),
        agent_pool: String::new(),
        template: Some(pb::WarmTemplate {
            image: "python:3.12".into(),
            runtime: "crun".into(),
            limits: None,
            env: [("A".to_string(), "1".to_string())].into(),
        }),
        capacity: Some(pb::WarmCapacity {
            buffer_min: 1,
            buffer_max: 2,
            pool_min: 0,
            pool_max: 5,
        }),
        ..Default::default()
    };
    let created = svc
        .create_warm_pool(pb::CreateWarmPoolRequest {
            pool: Some(want.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    let objects: Api<SandboxWarmPool> = Api::namespaced(api.client(), NS);
    let obj = objects.get("py").await.unwrap();
    assert_eq!(obj.spec.agent_pool(), "default");
    assert!(
        obj.spec.template.image.ends_with("python:3.12"),
        "{}",
        obj.spec.template.image
    );
    assert_eq!(obj.spec.template.env["A"], "1");
    assert_eq!(obj.spec.capacity.pool_max, 5);
    assert_eq!(
        created.status.as_ref().map(|s| s.revision.clone()),
        obj.resource_version()
    );
    let dup = svc
        .create_warm_pool(pb::CreateWarmPoolRequest {
            pool: Some(want.clone()),
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), tonic::Code::AlreadyExists, "{dup:?}");

    // Resize through the service: the object's spec and generation move.
    let resized = svc
        .update_warm_pool(pb::UpdateWarmPoolRequest {
            name: "py".into(),
            capacity: Some(pb::WarmCapacity {
                buffer_min: 1,
                buffer_max: 3,
                pool_min: 0,
                pool_max: 6,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resized.capacity.unwrap().pool_max, 6);
    let obj = objects.get("py").await.unwrap();
    assert_eq!(
        (obj.spec.capacity.buffer_max, obj.metadata.generation),
        (3, Some(2))
    );

    // kubectl edit: the service answers with it.
    objects
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"capacity": {"poolMax": 7}}})),
        )
        .await
        .unwrap();
    let mut svc2 = svc.clone();
    sandbolt_test_support::eventually_async(
        "the service sees the kubectl edit",
        Duration::from_secs(10),
        || {
            let mut svc = svc2.clone();
            async move {
                let p = svc
                    .get_warm_pool(pb::WarmPoolRef { name: "py".into() })
                    .await
                    .ok()?
                    .into_inner();
                (p.capacity?.pool_max == 7).then_some(())
            }
        },
    )
    .await;
    let listed = svc2
        .list_warm_pools(pb::ListWarmPoolsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.items.len(), 1);

    // The leader's status reaches the object.
    sandbolt_test_support::eventually_async(
        "the leader writes the pool's status",
        Duration::from_secs(30),
        || {
            let objects = objects.clone();
            async move {
                objects
                    .get("py")
                    .await
                    .ok()?
                    .status
                    .filter(|s| s.observed_generation == Some(3))
            }
        },
    )
    .await;

    // Delete: the object goes; a second delete is NOT_FOUND.
    svc.delete_warm_pool(pb::WarmPoolRef { name: "py".into() })
        .await
        .unwrap();
    assert!(objects.get_opt("py").await.unwrap().is_none());
    let gone = svc
        .delete_warm_pool(pb::WarmPoolRef { name: "py".into() })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the leader stops")
        .unwrap()
        .unwrap();
}

/// A cluster upgraded without the new CRD (Helm installs CRDs only on a
/// first install) still gets a working store: no warm pools, and writes
/// that say what to install.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_crd_the_store_runs_without_warm_pools() {
    let api = ApiDouble::start().await;
    // The API server's answer for a resource it does not serve.
    api.fail_next("list", "sandboxwarmpools", 404, 1);
    let store = open(&api);
    assert_eq!(store.list_warm_pools().unwrap(), vec![]);
    assert_eq!(store.get_warm_pool("py").unwrap(), None);
    assert_eq!(store.delete_warm_pool("py").unwrap(), None);
    match store.put_warm_pool(&pool("py")) {
        Err(StoreError::Backend(m)) => {
            assert!(m.contains("sandboxwarmpools.sandbolt.io.yaml"), "{m}")
        }
        other => panic!("expected a Backend error naming the CRD, got {other:?}"),
    }
    assert_eq!(api.requests("create", "sandboxwarmpools"), 0);
    // Sandboxes are unaffected.
    let record = SandboxRecord {
        uid: "uid-1".into(),
        name: "fsb-1".into(),
        namespace: "team-a".into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "busybox".into(),
            ..Default::default()
        },
        generation: 1,
        ..Default::default()
    };
    store.create(&record).unwrap();
    assert!(store.get(&record.key()).unwrap().is_some());
}
