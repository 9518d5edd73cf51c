//! What one record costs in each store: the life of a strong-mode record
//! (create Pending → replace Running → read → delete) in the embedded redb
//! store (fsync per write) and in the Kubernetes store against the
//! in-process API double (HTTP + JSON per request, finalizer and status
//! writes included), in the same process, so the ratio is meaningful.
//!
//! The double keeps objects in memory: a real API server adds etcd's
//! consensus and fsync to every write. The ratio says what the Kubernetes
//! store's protocol costs, not what a cluster costs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use sandbolt_controller::SandboxKey;
use sandbolt_controller::store::embedded::RedbStore;
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_controller::store::{
    Consistency, FailurePolicy, Phase, SandboxRecord, SandboxSpec, Store,
};
use sandbolt_kube_double::ApiDouble;

/// A strong-mode Pending record; every field left out is its default.
fn record(name: &str) -> SandboxRecord {
    SandboxRecord {
        uid: format!("uid-{name}"),
        name: name.into(),
        namespace: "default".into(),
        agent_id: "agent-1".into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "docker.io/library/busybox:latest".into(),
            command: vec!["sleep".into(), "3600".into()],
            metadata: BTreeMap::from([("team".to_string(), "bench".to_string())]),
            failure_policy: FailurePolicy::Manual,
            ..Default::default()
        },
        generation: 1,
        phase: Phase::Pending,
        access_token: "token".into(),
        consistency: Consistency::Strong,
        created_at_unix_ms: 1_700_000_000_000,
        assignment_attempt: 1,
        ..Default::default()
    }
}

/// One record's life; names never repeat, so no run waits on another's
/// terminating object.
fn life(store: &dyn Store, seq: &AtomicU64) {
    let name = format!("fsb-bench-{}", seq.fetch_add(1, Ordering::Relaxed));
    let created = store.create(&record(&name)).expect("create");
    let mut running = created;
    running.phase = Phase::Running;
    running.sandbox_id = format!("sb-{name}").into();
    store.replace(&running).expect("replace");
    let key = SandboxKey::new("default", &name);
    assert!(store.get(&key).expect("get").is_some());
    store.delete(&key).expect("delete");
}

fn stores(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(ApiDouble::start());
    let kube = KubeStore::open(api.config(), KubeStoreConfig::new("sandbolt-system"))
        .expect("kube store on the double");
    let dir = tempfile::tempdir().unwrap();
    let redb = RedbStore::open(dir.path()).unwrap();
    let seq = AtomicU64::new(0);

    let mut g = c.benchmark_group("record_life");
    g.sample_size(30);
    g.bench_function("embedded_redb", |b| b.iter(|| life(&redb, &seq)));
    g.bench_function("kubernetes_api_double", |b| b.iter(|| life(&kube, &seq)));
    g.finish();
    drop(kube);
    rt.block_on(api.shutdown());
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1));
    targets = stores
}
criterion_main!(benches);
