//! create→running latency: the agent's gRPC API (a plain cold create, and
//! a prepared cold create that takes a writable snapshot prepared ahead, see
//! `sandbolt_agent::prepared`) against `ctr run -d` and against the raw
//! containerd floor (the same five calls the agent makes, with the agent's
//! own OCI spec), interleaved in one run on the test bed. Two agents share
//! the bed: one with prepared snapshots off, one keeping them for busybox.
//!
//! `cargo bench -p sandbolt-agent --bench create_latency [-- ITERATIONS]`
//! (default 50 sequential creates per system, after one warm-up each).

use std::time::{Duration, Instant};

use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, RemoveSnapshotRequest};
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest,
    DeleteTaskRequest, GetContainerRequest, GetImageRequest, KillRequest, StartRequest,
    WaitRequest,
};
use sandbolt_agent::containerd::Containerd;
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::agent::v1::{CreateSandboxRequest, DeleteSandboxRequest, SandboxSpec};
use sandbolt_proto::auth::BearerToken;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

type Client = AgentServiceClient<InterceptedService<Channel, BearerToken>>;

const NS: &str = "k8s.io";
const IMAGE: &str = "docker.io/library/busybox:latest";

fn spec(id: &str) -> SandboxSpec {
    SandboxSpec {
        sandbox_id: id.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "1000".into()],
        access_token: "bench".into(),
        ..Default::default()
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Prepared snapshots kept by the prepared agent.
const PREPARED: usize = 2;

/// One agent on the bed, with its client.
async fn start_agent(
    bed: &Testbed,
    state: &std::path::Path,
    id: &str,
    prepared: usize,
) -> (AgentHandle, Client) {
    let mut cfg = AgentConfig::new(
        id,
        bed.containerd_socket(),
        execd_binary().expect("execd"),
        state,
        "bench-token",
    );
    cfg.prepared_snapshots = prepared;
    if prepared > 0 {
        cfg.warm_images = vec![IMAGE.into()];
    }
    let agent = Agent::start(cfg).await.expect("agent");
    let channel = Channel::from_shared(format!("http://{}", agent.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client =
        AgentServiceClient::with_interceptor(channel, BearerToken::new("bench-token").unwrap());
    (agent, client)
}

/// What the raw floor needs: the agent's container (spec and runtime
/// options) and the image's chain id.
async fn template(
    agent: &AgentHandle,
    client: &mut Client,
    ctrd: &Containerd,
) -> (Container, String) {
    client
        .create_sandbox(CreateSandboxRequest {
            spec: Some(spec("template")),
        })
        .await
        .unwrap();
    let template = ctrd
        .containers()
        .get(ctrd.req(GetContainerRequest {
            id: "template".into(),
        }))
        .await
        .unwrap()
        .into_inner()
        .container
        .unwrap();
    let chain_id = agent
        .sandboxes()
        .images
        .resolve(IMAGE)
        .await
        .unwrap()
        .chain_id
        .clone();
    client
        .delete_sandbox(DeleteSandboxRequest {
            sandbox_id: "template".into(),
            grace_period_ms: 1,
        })
        .await
        .unwrap();
    (template, chain_id)
}

/// One agent create (then its delete): (total µs, container_created_us,
/// whether its container ran on a prepared snapshot).
async fn agent_create(client: &mut Client, ctrd: &Containerd, id: &str) -> (f64, f64, bool) {
    let t = Instant::now();
    let resp = client
        .create_sandbox(CreateSandboxRequest {
            spec: Some(spec(id)),
        })
        .await
        .expect("agent create")
        .into_inner();
    let d = t.elapsed();
    let key = ctrd
        .containers()
        .get(ctrd.req(GetContainerRequest { id: id.into() }))
        .await
        .unwrap()
        .into_inner()
        .container
        .unwrap()
        .snapshot_key;
    client
        .delete_sandbox(DeleteSandboxRequest {
            sandbox_id: id.into(),
            grace_period_ms: 1,
        })
        .await
        .unwrap();
    let container_us = resp.timings.unwrap_or_default().container_created_us as f64;
    (
        d.as_micros() as f64,
        container_us,
        key.starts_with(sandbolt_agent::labels::PREPARED_KEY_PREFIX),
    )
}

/// The raw floor: the agent's five containerd calls, then removal.
async fn raw_create(
    ctrd: &Containerd,
    template: &Container,
    chain_id: &str,
    state: &std::path::Path,
    id: &str,
) -> f64 {
    let t = Instant::now();
    ctrd.images()
        .get(ctrd.req(GetImageRequest { name: IMAGE.into() }))
        .await
        .unwrap();
    ctrd.containers()
        .create(ctrd.req(CreateContainerRequest {
            container: Some(Container {
                id: id.into(),
                labels: Default::default(),
                snapshot_key: id.into(),
                created_at: None,
                updated_at: None,
                ..template.clone()
            }),
        }))
        .await
        .unwrap();
    let mounts = ctrd
        .snapshots()
        .prepare(ctrd.req(PrepareSnapshotRequest {
            snapshotter: "overlayfs".into(),
            key: id.into(),
            parent: chain_id.into(),
            labels: Default::default(),
        }))
        .await
        .unwrap()
        .into_inner()
        .mounts;
    let log = format!("file://{}/raw-{id}.log", state.display());
    ctrd.tasks()
        .create(ctrd.req(CreateTaskRequest {
            container_id: id.into(),
            rootfs: mounts,
            stdout: log.clone(),
            stderr: log,
            ..Default::default()
        }))
        .await
        .unwrap();
    ctrd.tasks()
        .start(ctrd.req(StartRequest {
            container_id: id.into(),
            exec_id: String::new(),
        }))
        .await
        .unwrap();
    let d = t.elapsed();
    raw_remove(ctrd, id).await;
    d.as_micros() as f64
}

async fn raw_remove(ctrd: &Containerd, id: &str) {
    let mut tasks = ctrd.tasks();
    let wait = tokio::spawn({
        let req = ctrd.req(WaitRequest {
            container_id: id.into(),
            exec_id: String::new(),
        });
        async move { tasks.wait(req).await }
    });
    ctrd.tasks()
        .kill(ctrd.req(KillRequest {
            container_id: id.into(),
            exec_id: String::new(),
            signal: 9,
            all: true,
        }))
        .await
        .unwrap();
    let _ = wait.await;
    ctrd.tasks()
        .delete(ctrd.req(DeleteTaskRequest {
            container_id: id.into(),
        }))
        .await
        .unwrap();
    ctrd.containers()
        .delete(ctrd.req(DeleteContainerRequest { id: id.into() }))
        .await
        .unwrap();
    // containerd's GC may have taken the snapshot with the container.
    let _ = ctrd
        .snapshots()
        .remove(ctrd.req(RemoveSnapshotRequest {
            snapshotter: "overlayfs".into(),
            key: id.into(),
        }))
        .await;
}

/// `ctr run -d` (whole process, as a user would run it), then removal.
fn ctr_create(bed: &Testbed, id: &str) -> f64 {
    let t = Instant::now();
    let out = bed
        .ctr(NS)
        .args(["run", "-d", IMAGE, id, "sleep", "1000"])
        .output()
        .unwrap();
    let d = t.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = bed.ctr(NS).args(["task", "rm", "-f", id]).output();
    let _ = bed.ctr(NS).args(["containers", "rm", id]).output();
    d.as_micros() as f64
}

/// Samples of one run.
#[derive(Default)]
struct Samples {
    cold: Vec<f64>,
    cold_container: Vec<f64>,
    prepared: Vec<f64>,
    prepared_container: Vec<f64>,
    prepared_hits: usize,
    raw: Vec<f64>,
    ctr: Vec<f64>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn report(iterations: usize, s: &mut Samples) {
    println!("create→running, {iterations} sequential creates each (runc), µs:");
    println!("| system | p50 | p95 | p99 |");
    println!("|---|---|---|---|");
    let mut p50 = Vec::new();
    for (name, v) in [
        ("agent gRPC, cold", &mut s.cold),
        ("agent gRPC, prepared cold", &mut s.prepared),
        ("ctr run -d", &mut s.ctr),
        ("raw containerd floor", &mut s.raw),
    ] {
        v.sort_by(f64::total_cmp);
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} |",
            pct(v, 0.5),
            pct(v, 0.95),
            pct(v, 0.99)
        );
        p50.push(pct(v, 0.5));
    }
    println!(
        "agent p50 / ctr p50 = {:.2} (goal ≤ 0.9); agent p50 / raw p50 = {:.2} (goal ≤ 1.1)",
        p50[0] / p50[2],
        p50[0] / p50[3]
    );
    println!(
        "prepared cold p50 / cold p50 = {:.2}; prepared cold p50 / raw p50 = {:.2}; prepared snapshot taken by {} of {iterations} prepared creates",
        p50[1] / p50[0],
        p50[1] / p50[3],
        s.prepared_hits
    );
    println!(
        "mean container_created_us (image resolved + container + rootfs): cold {:.0}, prepared cold {:.0}",
        mean(&s.cold_container),
        mean(&s.prepared_container)
    );
}

#[tokio::main]
async fn main() {
    let iterations: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(50);
    let bed = tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed");
        bed.import_image(&busybox_image().expect("busybox"), NS)
            .expect("import");
        bed
    })
    .await
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let prepared_state = tempfile::tempdir().unwrap();
    let (agent, mut client) = start_agent(&bed, state.path(), "bench-agent", 0).await;
    let (prepared_agent, mut prepared_client) =
        start_agent(&bed, prepared_state.path(), "bench-prepared", PREPARED).await;
    let ctrd = Containerd::connect(bed.containerd_socket(), NS, Duration::from_secs(10))
        .await
        .unwrap();
    // The raw floor runs exactly the agent's spec and runtime options.
    let (template, chain_id) = template(&agent, &mut client, &ctrd).await;
    let prepared = prepared_agent.sandboxes().prepared().clone();
    let mut s = Samples::default();
    for i in 0..=iterations {
        let (d, c, _) = agent_create(&mut client, &ctrd, &format!("a{i}")).await;
        // A refill follows each take; it yields to creates in flight only.
        for _ in 0..100 {
            if prepared.ready_for(&chain_id) >= PREPARED {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (pd, pc, hit) = agent_create(&mut prepared_client, &ctrd, &format!("p{i}")).await;
        let r = raw_create(&ctrd, &template, &chain_id, state.path(), &format!("r{i}")).await;
        let c_us = ctr_create(&bed, &format!("c{i}"));
        if i > 0 {
            s.cold.push(d);
            s.cold_container.push(c);
            s.prepared.push(pd);
            s.prepared_container.push(pc);
            s.prepared_hits += usize::from(hit);
            s.raw.push(r);
            s.ctr.push(c_us);
        }
    }
    report(iterations, &mut s);
    agent.shutdown().await;
    prepared_agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
