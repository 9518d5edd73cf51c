//! Sandbox snapshot records on the Kubernetes store, against the in-process
//! API double (`sandbolt-kube-double`, as in kube_warm_pools.rs): each
//! record is a `SandboxSnapshot` named after its id in the controller's
//! namespace, written with resourceVersion preconditions (create, replace,
//! conflict as the embedded store's) and read from a watch cache, so a
//! restarted controller finds every snapshot again.
//!
//! The store blocks its caller for API round trips: multi-threaded runtime.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_controller::store::{
    SnapshotPhase, SnapshotRecord, SnapshotVolumeRecord, Store, StoreError, WarmPoolRecord,
};
use sandbolt_deploy::{SandboxSnapshot, SandboxSnapshotSpec};
use sandbolt_kube_double::ApiDouble;
use serde_json::json;

const NS: &str = "sandbolt-system";

fn open(api: &ApiDouble) -> KubeStore {
    let mut cfg = KubeStoreConfig::new(NS);
    cfg.write_timeout = Duration::from_secs(5);
    KubeStore::open(api.config(), cfg).expect("kube store opens on the double")
}

/// A snapshot as the controller records it before the capture.
fn pending(id: &str) -> SnapshotRecord {
    SnapshotRecord {
        id: id.into(),
        namespace: "team-a".into(),
        uid: format!("uid-{id}"),
        display_name: "before the upgrade".into(),
        request_id: format!("req-{id}"),
        source_sandbox: "fsb-src".into(),
        source_uid: "uid-src".into(),
        source_sandbox_id: "ctr-src".into(),
        phase: SnapshotPhase::Pending,
        agent_id: "agent-1".into(),
        node_name: "node-1".into(),
        image: "docker.io/library/python:3.12".into(),
        runtime: "runc".into(),
        metadata: BTreeMap::from([
            ("team".to_string(), "ml".to_string()),
            ("step".to_string(), "3".to_string()),
        ]),
        created_at_unix_ms: 1_700_000_000_123,
        last_transition_unix_ms: 1_700_000_000_123,
        ..SnapshotRecord::default()
    }
}

/// `s` captured: every field the capture sets, volumes of both kinds.
fn ready(mut s: SnapshotRecord) -> SnapshotRecord {
    s.phase = SnapshotPhase::Ready;
    s.message = "captured".into();
    s.size_bytes = 104_857_600;
    s.paused_us = 1_234;
    s.took_us = 567_890;
    s.volumes = vec![
        SnapshotVolumeRecord {
            volume: "work".into(),
            mount_path: "/work".into(),
            sub_path: "proj".into(),
            read_only: false,
            volume_snapshot: format!("sbs-{}", s.id),
        },
        SnapshotVolumeRecord {
            volume: "datasets".into(),
            mount_path: "/data".into(),
            sub_path: String::new(),
            read_only: true,
            volume_snapshot: String::new(),
        },
    ];
    s.completed_at_unix_ms = 1_700_000_001_456;
    s.last_transition_unix_ms = 1_700_000_001_456;
    s
}

/// `s` with the revision the store gave it.
fn stored(s: &SnapshotRecord, revision: &str) -> SnapshotRecord {
    SnapshotRecord {
        revision: revision.into(),
        ..s.clone()
    }
}

/// Polls `f` until it answers; panics after 10 s.
async fn eventually<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    sandbolt_test_support::eventually(what, Duration::from_secs(10), f).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_resources_with_exists_conflict_and_not_found() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let objects: Api<SandboxSnapshot> = Api::namespaced(api.client(), NS);
    let id = "7f1c2a9e-0b4d-4c6e-9a57-3d2e1f0a8b6c";

    // Create: one SandboxSnapshot named after the id, in the controller's
    // namespace, the record in its spec.
    let created = store.put_snapshot(&pending(id)).unwrap();
    assert!(!created.revision.is_empty());
    assert_eq!(created, stored(&pending(id), &created.revision));
    let obj = objects.get(id).await.unwrap();
    assert_eq!(
        obj.resource_version().as_deref(),
        Some(created.revision.as_str())
    );
    assert!(obj.finalizers().is_empty(), "nothing waits on a record");
    let v = serde_json::to_value(&obj).unwrap();
    assert_eq!(v["apiVersion"], "sandbolt.io/v1alpha1");
    assert_eq!(v["spec"]["sandboxNamespace"], "team-a");
    assert_eq!(v["spec"]["sourceSandbox"], "fsb-src");
    assert_eq!(v["spec"]["phase"], "Pending");
    assert_eq!(v["spec"]["createdAtUnixMs"], 1_700_000_000_123_i64);
    assert_eq!(v["spec"]["metadata"], json!({"team": "ml", "step": "3"}));
    assert!(
        v["spec"].get("sizeBytes").is_none() && v["spec"].get("volumes").is_none(),
        "unset until captured: {v}"
    );

    // Own writes are read at once, through get and list.
    assert_eq!(store.get_snapshot(id).unwrap(), Some(created.clone()));
    assert_eq!(store.list_snapshots().unwrap(), vec![created.clone()]);
    assert_eq!(store.get_snapshot("other").unwrap(), None);

    // The id is taken.
    match store.put_snapshot(&pending(id)) {
        Err(StoreError::SnapshotExists(n)) => assert_eq!(n, id),
        other => panic!("expected SnapshotExists, got {other:?}"),
    }

    // Replace with the revision read: every field the capture sets is
    // stored and read back as written.
    let captured = ready(created.clone());
    let updated = store.put_snapshot(&captured).unwrap();
    assert_ne!(updated.revision, created.revision);
    assert_eq!(updated, stored(&captured, &updated.revision));
    assert_eq!(store.get_snapshot(id).unwrap(), Some(updated.clone()));
    let v = serde_json::to_value(objects.get(id).await.unwrap()).unwrap();
    assert_eq!(v["spec"]["phase"], "Ready");
    assert_eq!(v["spec"]["sizeBytes"], 104_857_600);
    assert_eq!(
        v["spec"]["volumes"],
        json!([
            {"volume": "work", "mountPath": "/work", "subPath": "proj",
             "volumeSnapshot": format!("sbs-{id}")},
            {"volume": "datasets", "mountPath": "/data", "readOnly": true},
        ])
    );

    // A stale revision is a conflict, and changes nothing.
    let mut stale = created.clone();
    stale.phase = SnapshotPhase::Failed;
    match store.put_snapshot(&stale) {
        Err(StoreError::SnapshotConflict(n)) => assert_eq!(n, id),
        other => panic!("expected SnapshotConflict, got {other:?}"),
    }
    let v = serde_json::to_value(objects.get(id).await.unwrap()).unwrap();
    assert_eq!(v["spec"]["phase"], "Ready");
    assert_eq!(store.get_snapshot(id).unwrap(), Some(updated.clone()));

    // Replacing a snapshot that does not exist.
    let mut ghost = pending("ghost");
    ghost.revision = created.revision.clone();
    match store.put_snapshot(&ghost) {
        Err(StoreError::SnapshotNotFound(n)) => assert_eq!(n, "ghost"),
        other => panic!("expected SnapshotNotFound, got {other:?}"),
    }

    // Every phase is stored as itself.
    let mut current = updated.clone();
    for phase in [
        SnapshotPhase::Deleting,
        SnapshotPhase::Failed,
        SnapshotPhase::Pending,
        SnapshotPhase::Ready,
    ] {
        current.phase = phase;
        current = store.put_snapshot(&current).unwrap();
        assert_eq!(current.phase, phase);
        assert_eq!(store.get_snapshot(id).unwrap().unwrap().phase, phase);
    }

    // A second snapshot; the list is in id order.
    let first = store.put_snapshot(&pending("0a-first")).unwrap();
    let ids: Vec<String> = store
        .list_snapshots()
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(ids, ["0a-first", id]);

    // Delete answers with the record removed; a second delete with nothing.
    let deleted = store.delete_snapshot(id).unwrap().expect("it existed");
    assert_eq!(deleted, current);
    assert!(objects.get_opt(id).await.unwrap().is_none());
    assert_eq!(store.get_snapshot(id).unwrap(), None);
    assert_eq!(store.delete_snapshot(id).unwrap(), None);
    // Replacing the deleted snapshot: gone.
    assert!(matches!(
        store.put_snapshot(&current),
        Err(StoreError::SnapshotNotFound(_))
    ));
    // Once the watch delivered everything, the cache agrees.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.list_snapshots().unwrap(), vec![first]);
    // An id freed by a delete can be taken again.
    store.put_snapshot(&pending(id)).unwrap();
}

/// A restarted controller (a new store over the same API) reads every
/// snapshot back from the API alone, and the old and new instance guard
/// each other's writes with the revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_sees_the_snapshots() {
    let api = ApiDouble::start().await;
    let before = open(&api);
    let a = before.put_snapshot(&pending("snap-a")).unwrap();
    let b = before.put_snapshot(&pending("snap-b")).unwrap();
    let b = before.put_snapshot(&ready(b)).unwrap();
    let gone = before.put_snapshot(&pending("snap-gone")).unwrap();
    before
        .delete_snapshot(&gone.id)
        .unwrap()
        .expect("it existed");

    let after = open(&api);
    assert_eq!(after.list_snapshots().unwrap(), vec![a.clone(), b.clone()]);
    assert_eq!(after.get_snapshot("snap-b").unwrap(), Some(b.clone()));
    assert_eq!(after.get_snapshot("snap-gone").unwrap(), None);

    // The new instance finishes the capture the old one recorded…
    let a2 = after.put_snapshot(&ready(a.clone())).unwrap();
    // …and the old one, still holding the previous revision, cannot
    // overwrite it.
    let mut late = a.clone();
    late.phase = SnapshotPhase::Failed;
    assert!(matches!(
        before.put_snapshot(&late),
        Err(StoreError::SnapshotConflict(_))
    ));
    let seen = eventually("the old instance's watch sees the new write", || {
        before
            .get_snapshot("snap-a")
            .unwrap()
            .filter(|s| s.revision == a2.revision)
    })
    .await;
    assert_eq!(seen, a2);
    assert_eq!(seen.phase, SnapshotPhase::Ready);
    drop(before);

    // A third instance sees the final state.
    let third = open(&api);
    assert_eq!(third.list_snapshots().unwrap(), vec![a2, b]);
}

/// Others may touch the objects: what they add to the metadata survives
/// the controller's replace, a `kubectl delete` forgets the record, and
/// other namespaces' objects are not the controller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_touched_with_kubectl() {
    let api = ApiDouble::start().await;
    let store = open(&api);
    let objects: Api<SandboxSnapshot> = Api::namespaced(api.client(), NS);

    let created = store.put_snapshot(&pending("snap-k")).unwrap();
    let labelled = objects
        .patch(
            "snap-k",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"keep": "yes"}}})),
        )
        .await
        .unwrap();
    let seen = eventually("the store sees the label write", || {
        store
            .get_snapshot("snap-k")
            .unwrap()
            .filter(|s| Some(&s.revision) == labelled.metadata.resource_version.as_ref())
    })
    .await;
    assert_eq!(seen, stored(&created, &seen.revision));
    let written = store.put_snapshot(&ready(seen)).unwrap();
    let obj = objects.get("snap-k").await.unwrap();
    assert_eq!(obj.labels()["keep"], "yes");
    assert_eq!(obj.resource_version(), Some(written.revision.clone()));

    // Another namespace's SandboxSnapshot is not a record.
    let elsewhere: Api<SandboxSnapshot> = Api::namespaced(api.client(), "team-a");
    let stray = SandboxSnapshot::new(
        "stray",
        SandboxSnapshotSpec {
            sandbox_namespace: "team-a".into(),
            source_sandbox: "fsb-x".into(),
            ..SandboxSnapshotSpec::default()
        },
    );
    elsewhere
        .create(&PostParams::default(), &stray)
        .await
        .unwrap();

    objects
        .delete("snap-k", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the store forgets the deleted snapshot", || {
        store.list_snapshots().unwrap().is_empty().then_some(())
    })
    .await;
    assert_eq!(store.get_snapshot("stray").unwrap(), None);
    assert_eq!(store.delete_snapshot("snap-k").unwrap(), None);
}

/// A cluster upgraded without the new CRD still gets a working store: no
/// snapshots, writes that say what to install, warm pools unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_crd_the_store_runs_without_snapshots() {
    let api = ApiDouble::start().await;
    // The API server's answer for a resource it does not serve.
    api.fail_next("list", "sandboxsnapshots", 404, 1);
    let store = open(&api);
    assert_eq!(store.list_snapshots().unwrap(), vec![]);
    assert_eq!(store.get_snapshot("snap-1").unwrap(), None);
    assert_eq!(store.delete_snapshot("snap-1").unwrap(), None);
    match store.put_snapshot(&pending("snap-1")) {
        Err(StoreError::Backend(m)) => {
            assert!(m.contains("sandboxsnapshots.sandbolt.io.yaml"), "{m}")
        }
        other => panic!("expected a Backend error naming the CRD, got {other:?}"),
    }
    assert_eq!(api.requests("create", "sandboxsnapshots"), 0);
    let pool = WarmPoolRecord {
        name: "py".into(),
        image: "busybox".into(),
        buffer_max: 1,
        pool_max: 1,
        ..WarmPoolRecord::default()
    };
    store.put_warm_pool(&pool).unwrap();
    assert_eq!(store.list_warm_pools().unwrap().len(), 1);
}
