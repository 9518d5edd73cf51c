//! create→running latency: the agent's gRPC API against `ctr run -d` and
//! against the raw containerd floor (the same five calls the agent makes,
//! with the agent's own OCI spec), interleaved in one run on the test bed.
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
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::agent::v1::{CreateSandboxRequest, DeleteSandboxRequest, SandboxSpec};
use sandbolt_proto::auth::BearerToken;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};

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
    let cfg = AgentConfig::new(
        "bench-agent",
        bed.containerd_socket(),
        execd_binary().expect("execd"),
        state.path(),
        "bench-token",
    );
    let agent = Agent::start(cfg).await.expect("agent");
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", agent.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client =
        AgentServiceClient::with_interceptor(channel, BearerToken::new("bench-token").unwrap());
    let ctrd = Containerd::connect(bed.containerd_socket(), NS, Duration::from_secs(10))
        .await
        .unwrap();

    // The raw floor runs exactly the agent's spec and runtime options.
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

    let mut agent_us = Vec::new();
    let mut raw_us = Vec::new();
    let mut ctr_us = Vec::new();
    for i in 0..=iterations {
        // Agent, through its gRPC API.
        let id = format!("a{i}");
        let t = Instant::now();
        client
            .create_sandbox(CreateSandboxRequest {
                spec: Some(spec(&id)),
            })
            .await
            .expect("agent create");
        let d = t.elapsed();
        client
            .delete_sandbox(DeleteSandboxRequest {
                sandbox_id: id,
                grace_period_ms: 1,
            })
            .await
            .unwrap();
        if i > 0 {
            agent_us.push(d.as_micros() as f64);
        }

        // Raw containerd calls.
        let id = format!("r{i}");
        let t = Instant::now();
        ctrd.images()
            .get(ctrd.req(GetImageRequest { name: IMAGE.into() }))
            .await
            .unwrap();
        ctrd.containers()
            .create(ctrd.req(CreateContainerRequest {
                container: Some(Container {
                    id: id.clone(),
                    labels: Default::default(),
                    snapshot_key: id.clone(),
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
                key: id.clone(),
                parent: chain_id.clone(),
                labels: Default::default(),
            }))
            .await
            .unwrap()
            .into_inner()
            .mounts;
        let log = format!("file://{}/raw-{id}.log", state.path().display());
        ctrd.tasks()
            .create(ctrd.req(CreateTaskRequest {
                container_id: id.clone(),
                rootfs: mounts,
                stdout: log.clone(),
                stderr: log,
                ..Default::default()
            }))
            .await
            .unwrap();
        ctrd.tasks()
            .start(ctrd.req(StartRequest {
                container_id: id.clone(),
                exec_id: String::new(),
            }))
            .await
            .unwrap();
        let d = t.elapsed();
        let mut tasks = ctrd.tasks();
        let wait = tokio::spawn({
            let req = ctrd.req(WaitRequest {
                container_id: id.clone(),
                exec_id: String::new(),
            });
            async move { tasks.wait(req).await }
        });
        ctrd.tasks()
            .kill(ctrd.req(KillRequest {
                container_id: id.clone(),
                exec_id: String::new(),
                signal: 9,
                all: true,
            }))
            .await
            .unwrap();
        let _ = wait.await;
        ctrd.tasks()
            .delete(ctrd.req(DeleteTaskRequest {
                container_id: id.clone(),
            }))
            .await
            .unwrap();
        ctrd.containers()
            .delete(ctrd.req(DeleteContainerRequest { id: id.clone() }))
            .await
            .unwrap();
        // containerd's GC may have taken the snapshot with the container.
        let _ = ctrd
            .snapshots()
            .remove(ctrd.req(RemoveSnapshotRequest {
                snapshotter: "overlayfs".into(),
                key: id,
            }))
            .await;
        if i > 0 {
            raw_us.push(d.as_micros() as f64);
        }

        // ctr run -d (whole process, as a user would run it).
        let id = format!("c{i}");
        let t = Instant::now();
        let out = bed
            .ctr(NS)
            .args(["run", "-d", IMAGE, &id, "sleep", "1000"])
            .output()
            .unwrap();
        let d = t.elapsed();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = bed.ctr(NS).args(["task", "rm", "-f", &id]).output();
        let _ = bed.ctr(NS).args(["containers", "rm", &id]).output();
        if i > 0 {
            ctr_us.push(d.as_micros() as f64);
        }
    }

    println!("create→running, {iterations} sequential creates each (runc), µs:");
    println!("| system | p50 | p95 | p99 |");
    println!("|---|---|---|---|");
    let mut p50 = Vec::new();
    for (name, v) in [
        ("agent gRPC", &mut agent_us),
        ("ctr run -d", &mut ctr_us),
        ("raw containerd floor", &mut raw_us),
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
        p50[0] / p50[1],
        p50[0] / p50[2]
    );
    agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
