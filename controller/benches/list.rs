//! What a lifecycle `GET /sandboxes` costs the controller with 1,000
//! sandboxes, old way vs new, same process, same controller, same records:
//!
//! - *old*: what the lifecycle did over FastPath v2 — `ListSandboxes` (names
//!   only, 500 a page) and then one `GetSandbox` per sandbox (1 + N calls;
//!   the rest came from a local file that is gone now);
//! - *new*: one native `ListSandboxes` (`page_size` 0) that carries every
//!   sandbox whole.
//!
//! Records are written straight into the store the controller serves from;
//! the agent they name never heartbeats, which does not matter to a list.

use criterion::{Criterion, criterion_group, criterion_main};
use sandbolt_controller::store::embedded::RedbStore;
use sandbolt_controller::store::{Phase, Resources, SandboxRecord, SandboxSpec, Store};
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;

const SANDBOXES: usize = 1_000;

fn record(i: usize) -> SandboxRecord {
    SandboxRecord {
        uid: format!("uid-{i}"),
        name: format!("sbx-{i:05}"),
        namespace: "default".into(),
        sandbox_id: format!("sb-{i}").into(),
        agent_id: "agent-1".into(),
        spec: SandboxSpec {
            pool: "default".into(),
            image: "docker.io/library/busybox:latest".into(),
            command: vec!["sleep".into(), "3600".into()],
            metadata: [("team".to_string(), "bench".to_string())].into(),
            expires_at: 4_000_000_000,
            resources: Resources {
                cpu_limit: "500m".into(),
                memory_limit: "256Mi".into(),
                pids_limit: 512,
                ..Default::default()
            },
            ..Default::default()
        },
        generation: 1,
        phase: Phase::Running,
        access_token: "token".into(),
        created_at_unix_ms: 1_700_000_000_000,
        ..Default::default()
    }
}

async fn old_way(client: &mut FastPathServiceClient<tonic::transport::Channel>) -> usize {
    let mut names = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_sandboxes(fp::ListSandboxesRequest {
                namespace: "default".into(),
                page_size: 500,
                page_token: token,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        names.extend(
            page.items
                .into_iter()
                .filter_map(|s| s.identity.map(|i| i.name)),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let mut got = 0;
    for name in names {
        let info = client
            .get_sandbox(fp::GetSandboxRequest {
                sandbox: Some(fp::SandboxReference {
                    namespaced_name: Some(fp::NamespacedName {
                        namespace: "default".into(),
                        name,
                    }),
                    expected_uid: String::new(),
                }),
                expected_generation: 0,
            })
            .await
            .unwrap()
            .into_inner();
        got += usize::from(info.sandbox.is_some());
    }
    got
}

async fn new_way(client: &mut SandboxServiceClient<tonic::transport::Channel>) -> usize {
    client
        .list_sandboxes(native::ListSandboxesRequest {
            namespace: "default".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .items
        .len()
}

fn list(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path()).unwrap();
    for i in 0..SANDBOXES {
        store.create(&record(i)).unwrap();
    }
    let cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), "agent-token");
    let (handle, mut old, mut new) = rt.block_on(async {
        let handle = Controller::start_with_store(cfg, std::sync::Arc::new(store))
            .await
            .unwrap();
        let url = format!("http://{}", handle.local_addr());
        let old = FastPathServiceClient::connect(url.clone()).await.unwrap();
        let new = SandboxServiceClient::connect(url).await.unwrap();
        (handle, old, new)
    });
    // Both ways see every sandbox, or the comparison means nothing.
    assert_eq!(rt.block_on(old_way(&mut old)), SANDBOXES);
    assert_eq!(rt.block_on(new_way(&mut new)), SANDBOXES);

    let mut g = c.benchmark_group("lifecycle_list_1000");
    g.sample_size(20);
    g.bench_function("old_fastpath_v2_1_plus_n", |b| {
        b.iter(|| rt.block_on(old_way(&mut old)))
    });
    g.bench_function("new_native_one_call", |b| {
        b.iter(|| rt.block_on(new_way(&mut new)))
    });
    g.finish();
    rt.block_on(handle.shutdown());
}

criterion_group!(benches, list);
criterion_main!(benches);
