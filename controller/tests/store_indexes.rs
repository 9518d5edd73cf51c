//! The store's indexes (issue 25): the container id, the metadata filter and
//! the Kubernetes store's key order answer exactly what a scan of every
//! record answers, in both stores, through every write that moves a record
//! in or out of them; an old redb file gets its indexes at open; a reopened
//! store (the rebuild) sees every record; and `ReportReaped` finds its
//! record among thousands through the index.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_controller::store::embedded::RedbStore;
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_controller::store::{
    Consistency, ListRange, Phase, SandboxRecord, SandboxSpec, Store, metadata_matches,
};
use sandbolt_controller::{Controller, SandboxKey};
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use tonic::Request;

use crate::support::standin::AGENT_TOKEN;
use crate::support::standin_config;

fn record(ns: &str, i: usize) -> SandboxRecord {
    SandboxRecord {
        uid: format!("uid-{ns}-{i}"),
        name: format!("fsb-{i:05}"),
        namespace: ns.into(),
        sandbox_id: format!("sb-{ns}-{i}").into(),
        agent_id: "agent-gone".into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "docker.io/library/busybox:latest".into(),
            metadata: BTreeMap::from([
                ("team".to_string(), format!("t{}", i % 7)),
                ("env".to_string(), format!("e{}", i % 3)),
            ]),
            ..Default::default()
        },
        request_id: format!("req-{ns}-{i}"),
        generation: 1,
        phase: Phase::Running,
        consistency: Consistency::Fast,
        created_at_unix_ms: 1,
        assignment_attempt: 1,
        ..Default::default()
    }
}

fn filter(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn names(v: &[SandboxRecord]) -> Vec<String> {
    v.iter().map(|r| r.name.clone()).collect()
}

/// What a scan of every record answers: the reference for the indexes.
fn scanned(store: &dyn Store, ns: &str, f: &BTreeMap<String, String>) -> Vec<String> {
    let all = store.list(&ListRange::namespace(ns)).unwrap();
    let matching: Vec<SandboxRecord> = all.into_iter().filter(|r| metadata_matches(r, f)).collect();
    names(&matching)
}

/// Every page of `f` in `ns`, `size` at a time, joined.
fn paged(store: &dyn Store, ns: &str, f: &BTreeMap<String, String>, size: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    loop {
        let after = out.last().cloned();
        let page = store
            .list_filtered(
                &ListRange::namespace(ns).after(after.as_deref()).limit(size),
                f,
            )
            .unwrap();
        assert!(page.len() <= size);
        let done = page.len() < size;
        out.extend(names(&page));
        if done {
            return out;
        }
    }
}

/// The checks every store passes, on `n` records in two namespaces.
fn check_indexes(store: &dyn Store, n: usize) {
    for i in 0..n {
        store.create(&record("a", i)).unwrap();
        if i % 10 == 0 {
            store.create(&record("b", i)).unwrap();
        }
    }
    check_reads(store, n);

    // The container id finds its record among all of them, in its
    // namespace, and nothing else.
    let mid = n / 2;
    let got = store.get_by_sandbox_id(&format!("sb-a-{mid}")).unwrap();
    assert_eq!(
        got.map(|r| r.key()),
        Some(SandboxKey::new("a", record("a", mid).name))
    );
    assert_eq!(
        store.sandbox_owner(&format!("sb-a-{mid}")).unwrap(),
        Some(SandboxKey::new("a", record("a", mid).name))
    );
    assert!(store.sandbox_owner("sb-none").unwrap().is_none());
    assert!(store.get_by_sandbox_id("sb-none").unwrap().is_none());
    assert!(store.get_by_sandbox_id("").unwrap().is_none());

    // A recreate moves the container id; a relabel moves the record
    // between filters.
    let key = SandboxKey::new("a", record("a", mid).name);
    let mut r = store.get(&key).unwrap().unwrap();
    r.sandbox_id = "sb-recreated".into();
    r.spec.metadata.insert("team".into(), "moved".into());
    r.spec.metadata.remove("env");
    store.replace(&r).unwrap();
    assert!(
        store
            .get_by_sandbox_id(&format!("sb-a-{mid}"))
            .unwrap()
            .is_none()
    );
    assert_eq!(
        store
            .get_by_sandbox_id("sb-recreated")
            .unwrap()
            .map(|r| r.key()),
        Some(key.clone())
    );
    let moved = store
        .list_filtered(&ListRange::namespace("a"), &filter(&[("team", "moved")]))
        .unwrap();
    assert_eq!(names(&moved), vec![key.name.clone()]);
    check_reads(store, n);

    // A delete takes it out of every index.
    store.delete(&key).unwrap();
    assert!(store.get_by_sandbox_id("sb-recreated").unwrap().is_none());
    assert!(store.sandbox_owner("sb-recreated").unwrap().is_none());
    let moved = store
        .list_filtered(&ListRange::namespace("a"), &filter(&[("team", "moved")]))
        .unwrap();
    assert!(moved.is_empty());
    check_reads(store, n);
}

/// Filters (one pair, two pairs, none, none matching) and pages answer
/// what the scan answers.
fn check_reads(store: &dyn Store, n: usize) {
    for ns in ["a", "b"] {
        for f in [
            filter(&[("team", "t3")]),
            filter(&[("team", "t3"), ("env", "e1")]),
            filter(&[("env", "e2"), ("team", "t0")]),
            filter(&[]),
            filter(&[("team", "nobody")]),
        ] {
            let want = scanned(store, ns, &f);
            let got = store.list_filtered(&ListRange::namespace(ns), &f).unwrap();
            assert_eq!(names(&got), want, "{ns} {f:?}");
            assert_eq!(paged(store, ns, &f, 7), want, "{ns} {f:?} in pages");
        }
    }
    // Pages of the whole namespace join to the namespace.
    let mut joined: Vec<String> = Vec::new();
    loop {
        let after = joined.last().cloned();
        let page = store
            .list(&ListRange::namespace("a").after(after.as_deref()).limit(64))
            .unwrap();
        let done = page.len() < 64;
        joined.extend(names(&page));
        if done {
            break;
        }
    }
    assert_eq!(joined, scanned(store, "a", &filter(&[])));
    assert!(joined.len() >= n - 1);
}

#[test]
fn redb_indexes_answer_what_a_scan_answers() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    check_indexes(&store, 600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_indexes_answer_what_a_scan_answers() {
    let api = ApiDouble::start().await;
    let store = tokio::task::spawn_blocking({
        let config = api.config();
        move || {
            let store = open_kube(config);
            check_indexes(&store, 300);
            store
        }
    })
    .await
    .unwrap();
    drop(store);
    api.shutdown().await;
}

fn open_kube(config: kube::Config) -> KubeStore {
    let mut cfg = KubeStoreConfig::new("sandbolt-system");
    cfg.write_timeout = Duration::from_secs(10);
    KubeStore::open(config, cfg).expect("kube store opens on the double")
}

/// Another writer's records (a second controller, or one before a
/// restart) come through the watch into this store's index, and a store
/// opened afterwards (the rebuild) finds every record by request id,
/// container id and page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_index_follows_other_writers_and_a_reopened_store_sees_everything() {
    let api = ApiDouble::start().await;
    let config = api.config();
    tokio::task::spawn_blocking(move || {
        let reader = open_kube(config.clone());
        let writer = open_kube(config.clone());
        let n = 200;
        for i in 0..n {
            writer.create(&record("w", i)).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while reader.list(&ListRange::namespace("w")).unwrap().len() < n {
            assert!(std::time::Instant::now() < deadline, "the watch delivers");
            std::thread::sleep(Duration::from_millis(50));
        }
        let last = format!("sb-w-{}", n - 1);
        assert_eq!(
            reader.get_by_sandbox_id(&last).unwrap().map(|r| r.name),
            Some(record("w", n - 1).name)
        );
        // The other writer deletes: this store's index lets go of it.
        writer
            .delete(&SandboxKey::new("w", record("w", 0).name))
            .unwrap();
        while reader.get_by_sandbox_id("sb-w-0").unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline, "the delete arrives");
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(reader);
        drop(writer);

        let reopened = open_kube(config);
        let all = reopened.list(&ListRange::all()).unwrap();
        assert_eq!(all.len(), n - 1);
        for i in 1..n {
            let by_rid = reopened.get_by_request_id(&format!("req-w-{i}")).unwrap();
            assert_eq!(by_rid.map(|r| r.name), Some(record("w", i).name), "{i}");
            let by_sid = reopened.get_by_sandbox_id(&format!("sb-w-{i}")).unwrap();
            assert_eq!(by_sid.map(|r| r.name), Some(record("w", i).name), "{i}");
        }
        check_reads_w(&reopened);
    })
    .await
    .unwrap();
    api.shutdown().await;
}

fn check_reads_w(store: &dyn Store) {
    let f = filter(&[("team", "t4")]);
    assert_eq!(paged(store, "w", &f, 5), scanned(store, "w", &f));
}

/// A redb file written before the indexes existed (simulated by dropping
/// their tables) gets them built when it is opened, and a reopened store
/// (the rebuild) sees every record.
#[test]
fn redb_builds_its_indexes_for_an_older_file() {
    let dir = tempfile::tempdir().unwrap();
    let n = 300;
    {
        let store = RedbStore::open(dir.path()).unwrap();
        for i in 0..n {
            store.create(&record("a", i)).unwrap();
        }
    }
    {
        let db = redb::Database::create(dir.path().join("controller.redb")).unwrap();
        let tx = db.begin_write().unwrap();
        let sids: redb::TableDefinition<'_, &str, &str> = redb::TableDefinition::new("sandbox_ids");
        let metadata: redb::TableDefinition<'_, &str, ()> =
            redb::TableDefinition::new("metadata_index");
        let meta: redb::TableDefinition<'_, &str, u64> = redb::TableDefinition::new("meta");
        assert!(tx.delete_table(sids).unwrap(), "sandbox_ids existed");
        assert!(tx.delete_table(metadata).unwrap(), "metadata_index existed");
        assert!(tx.delete_table(meta).unwrap(), "meta existed");
        tx.commit().unwrap();
    }
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.list(&ListRange::all()).unwrap().len(), n);
    for i in 0..n {
        let got = store.get_by_sandbox_id(&format!("sb-a-{i}")).unwrap();
        assert_eq!(got.map(|r| r.name), Some(record("a", i).name), "{i}");
    }
    let f = filter(&[("team", "t5")]);
    let got = store.list_filtered(&ListRange::namespace("a"), &f).unwrap();
    assert_eq!(names(&got), scanned(&store, "a", &f));
    assert!(!got.is_empty());
}

/// `ReportReaped` for one container among 2,000 records marks exactly its
/// record Failed (the report names no agent, and the record's agent is
/// not live, so the bootstrap token may touch it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_reaped_finds_its_record_among_thousands() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(RedbStore::open(&dir.path().join("store")).unwrap());
    let n = 2_000;
    for i in 0..n {
        store.create(&record("default", i)).unwrap();
    }
    let h = Controller::start_with_store(standin_config(dir.path()), store.clone())
        .await
        .unwrap();
    let mut r = RegistryServiceClient::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap();
    let target = 1_234;
    let mut req = Request::new(pb::ReportReapedRequest {
        node_name: "node-gone".into(),
        sandbox_id: format!("sb-default-{target}"),
        agent_id: String::new(),
        reason: "terminal".into(),
    });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {AGENT_TOKEN}").parse().unwrap(),
    );
    r.report_reaped(req).await.unwrap();
    let phase = |i: usize| {
        store
            .get(&SandboxKey::new("default", record("default", i).name))
            .unwrap()
            .unwrap()
            .phase
    };
    assert_eq!(phase(target), Phase::Failed);
    for other in [0, target - 1, target + 1, n - 1] {
        assert_eq!(phase(other), Phase::Running, "{other} untouched");
    }
    h.shutdown().await;
}
