//! Allocation cost at 100 / 1,000 / 10,000 agents: the controller's indexed
//! registry (lock + pick + reserve, then release so capacity stays) against
//! fast-sandbox's linear scan (same score and tie-break) in the same bench.
//! Every measured allocation succeeds.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use sandbolt_controller::SandboxId;
use sandbolt_controller::placement::{PlacementRequest, PoolKey, reference};
use sandbolt_controller::registry::Registry;
use sandbolt_proto::agent::v1 as pb;

const IMAGES: usize = 50;
const CAPACITY: i32 = 64;

/// Deterministic pseudo-random loads and image sets.
fn agent_shape(i: usize) -> (u32, Vec<String>) {
    let mut x = (i as u64).wrapping_mul(0x9E3779B97F4A7C15) ^ 0xDEADBEEF;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let load = (next() % (CAPACITY as u64 / 2)) as u32;
    let images = (0..3)
        .map(|_| format!("docker.io/library/img{}:latest", next() % IMAGES as u64))
        .collect();
    (load, images)
}

/// An image the agent holds, as its heartbeat reports it.
fn image_info(reference: String) -> pb::ImageInfo {
    pb::ImageInfo {
        references: vec![reference],
        ..Default::default()
    }
}

fn setup_registry(n: usize) -> Registry {
    let reg = Registry::new();
    for i in 0..n {
        let (load, images) = agent_shape(i);
        reg.heartbeat(&pb::Inventory {
            agent_id: format!("agent-{i:05}"),
            max_sandboxes: CAPACITY,
            images: images.iter().cloned().map(image_info).collect(),
            ..Default::default()
        });
        for s in 0..load {
            let id = format!("agent-{i:05}");
            reg.reserve(&id.as_str().into(), &format!("pre-{i}-{s}").into(), &[]);
        }
    }
    reg
}

fn setup_reference(n: usize) -> Vec<reference::Agent> {
    (0..n)
        .map(|i| {
            let (load, images) = agent_shape(i);
            reference::Agent {
                name: format!("agent-{i:05}"),
                pool: PoolKey::new("", ""),
                capacity: CAPACITY as u32,
                allocated: load,
                images,
                used_ports: vec![],
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocation");
    let pool = PoolKey::new("", "");
    let image = "docker.io/library/img7:latest";
    let req = PlacementRequest {
        pool: &pool,
        image_key: image,
        ports: &[],
        exclude: &[],
        runtime: None,
        pin: None,
        volume_root: false,
        shared_volumes: false,
    };
    for n in [100usize, 1_000, 10_000] {
        let reg = setup_registry(n);
        let sandbox = SandboxId::from("bench-sandbox");
        g.bench_with_input(BenchmarkId::new("indexed", n), &n, |b, _| {
            b.iter(|| {
                let p = reg
                    .allocate(black_box(&req), &sandbox)
                    .expect("allocation succeeds");
                reg.release(&p.agent, &sandbox);
                black_box(p.score)
            })
        });
        let mut agents = setup_reference(n);
        g.bench_with_input(BenchmarkId::new("linear_reference", n), &n, |b, _| {
            b.iter(|| {
                let i = reference::choose(black_box(&agents), &req).expect("allocation succeeds");
                agents[i].allocated += 1;
                agents[i].allocated -= 1;
                black_box(i)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
