//! The controller's store read paths at scale (issue 25): what one lookup
//! costs with `SANDBOLT_BENCH_RECORDS` records (default 10,000) in the
//! embedded redb store (on /dev/shm, so the setup's fsyncs are cheap; reads
//! never fsync) and in the Kubernetes store on the in-process API double.
//!
//! Each path is measured the old way (what the controller did before: a scan
//! of every record) and the new way (the index) in the same run, so the
//! ratio is meaningful on a shared machine:
//!
//! - `reap_lookup`: the record of one container id (`ReportReaped`, the
//!   janitor's nameless ownership queries, vanished containers);
//! - `filter`: one namespace's records whose metadata match a filter that 1 %
//!   of them match (native and FastPath `ListSandboxes` with a filter);
//! - `page`: one page of 64 records in the middle of a namespace;
//! - `request_id`: the idempotency lookup every create with a request id
//!   makes;
//! - `full_list`: every record (what a rebuild reads).

use std::collections::BTreeMap;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use sandbolt_controller::store::embedded::RedbStore;
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_controller::store::{
    Consistency, FailurePolicy, ListRange, Phase, SandboxRecord, SandboxSpec, Store,
};
use sandbolt_kube_double::ApiDouble;

/// How many distinct metadata values: the filter matches 1 / TEAMS.
const TEAMS: usize = 100;

fn records() -> usize {
    std::env::var("SANDBOLT_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

fn record(i: usize) -> SandboxRecord {
    SandboxRecord {
        uid: format!("uid-{i}"),
        name: format!("fsb-{i:06}"),
        namespace: "default".into(),
        sandbox_id: format!("sb-{i:06}").into(),
        agent_id: format!("agent-{}", i % 1000).into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "docker.io/library/busybox:latest".into(),
            command: vec!["sleep".into(), "3600".into()],
            metadata: BTreeMap::from([("team".to_string(), format!("t{}", i % TEAMS))]),
            failure_policy: FailurePolicy::Manual,
            expires_at: 4_000_000_000,
            ..Default::default()
        },
        request_id: format!("req-{i:06}"),
        generation: 1,
        phase: Phase::Running,
        consistency: Consistency::Fast,
        created_at_unix_ms: 1_700_000_000_000,
        assignment_attempt: 1,
        ..Default::default()
    }
}

/// Writes `n` records from 4 threads (the Kubernetes store's writes are
/// round trips; the setup is not what is measured).
fn fill(store: &dyn Store, n: usize) {
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                for i in (t..n).step_by(4) {
                    store.create(&record(i)).expect("create");
                }
            });
        }
    });
}

fn filter() -> BTreeMap<String, String> {
    BTreeMap::from([("team".to_string(), "t7".to_string())])
}

fn paths(c: &mut Criterion, label: &str, store: &dyn Store, n: usize) {
    let mut g = c.benchmark_group(format!("{label}_{n}"));
    g.sample_size(10);
    let target = format!("sb-{:06}", n / 2);
    g.bench_function("reap_lookup/scan", |b| {
        b.iter(|| {
            let all = store.list(&ListRange::all()).unwrap();
            assert!(all.into_iter().any(|r| r.sandbox_id == target.as_str()));
        })
    });
    g.bench_function("reap_lookup/index", |b| {
        b.iter(|| {
            let r = store.get_by_sandbox_id(&target).unwrap();
            assert!(r.is_some());
        })
    });
    let f = filter();
    g.bench_function("filter/scan", |b| {
        b.iter(|| {
            let mut all = store.list(&ListRange::namespace("default")).unwrap();
            all.retain(|r| f.iter().all(|(k, v)| r.spec.metadata.get(k) == Some(v)));
            assert_eq!(all.len(), n / TEAMS);
        })
    });
    g.bench_function("filter/index", |b| {
        b.iter(|| {
            let got = store
                .list_filtered(&ListRange::namespace("default"), &f)
                .unwrap();
            assert_eq!(got.len(), n / TEAMS);
        })
    });
    let middle = format!("fsb-{:06}", n / 2);
    g.bench_function("page", |b| {
        b.iter(|| {
            let page = store
                .list(
                    &ListRange::namespace("default")
                        .after(Some(&middle))
                        .limit(64),
                )
                .unwrap();
            assert_eq!(page.len(), 64);
        })
    });
    let rid = format!("req-{:06}", n / 2);
    g.bench_function("request_id", |b| {
        b.iter(|| assert!(store.get_by_request_id(&rid).unwrap().is_some()))
    });
    g.bench_function("full_list", |b| {
        b.iter(|| assert_eq!(store.list(&ListRange::all()).unwrap().len(), n))
    });
    g.finish();
}

fn scale(c: &mut Criterion) {
    let n = records();
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let redb = RedbStore::open(dir.path()).unwrap();
    fill(&redb, n);
    paths(c, "embedded_redb", &redb, n);
    drop(redb);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(ApiDouble::start());
    let mut cfg = KubeStoreConfig::new("sandbolt-system");
    cfg.write_timeout = Duration::from_secs(30);
    let kube = KubeStore::open(api.config(), cfg).expect("kube store on the double");
    fill(&kube, n);
    // Reads come from the watch cache: wait until it holds every record.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while kube.list(&ListRange::all()).unwrap().len() < n {
        assert!(std::time::Instant::now() < deadline, "watch cache behind");
        std::thread::sleep(Duration::from_millis(100));
    }
    paths(c, "kubernetes_api_double", &kube, n);
    drop(kube);
    rt.block_on(api.shutdown());
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = scale
}
criterion_main!(benches);
