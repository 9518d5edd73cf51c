//! What sandbox networking costs, each figure against its baseline in the
//! same run (issue 15):
//!
//! 1. create → running through the agent's gRPC API with networking (a
//!    prepared namespace, its address, a policy with rules, or allow-all)
//!    against an agent on the same test bed without it, interleaved;
//! 2. `UpdateNetworkPolicy` on a running sandbox: the call returns once the
//!    rules are in the kernel, so its latency is the time to apply;
//! 3. TCP throughput of one sandbox's egress through the agent's NAT to a
//!    test host (a network namespace behind a veth) against the host's own
//!    connection to the same test host.
//!
//! `cargo bench -p sandbolt-agent --bench network [-- ITERATIONS]`
//! (default 60 creates per system, 60 policy updates, 3 × 512 MiB transfers).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use sandbolt_agent::config::NetworkConfig;
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::agent::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, SandboxSpec, UpdateNetworkPolicyRequest,
};
use sandbolt_proto::auth::BearerToken;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

type Client = AgentServiceClient<InterceptedService<Channel, BearerToken>>;

const NS: &str = "k8s.io";
const TOKEN: &str = "bench-token";
/// The test host: a namespace behind a veth, on a documentation range.
const HOST_NS: &str = "sbbench-th";
const HOST_SIDE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 253);
const TEST_HOST: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 254);
const SINK_PORT: u16 = 5201;
const TRANSFER: usize = 512 << 20;

fn spec(id: &str, policy: &str) -> SandboxSpec {
    SandboxSpec {
        sandbox_id: id.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "1000".into()],
        access_token: "bench".into(),
        network_policy_json: policy.into(),
        ..Default::default()
    }
}

/// A policy with rules, so that creates pay for a rendered chain.
fn rules_policy(allow: Ipv4Addr) -> String {
    format!(
        r#"{{"defaultAction":"deny","egress":[{{"action":"allow","target":"{allow}"}},{{"action":"allow","target":"*.example.test"}}]}}"#
    )
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn summary(name: &str, mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    let (p50, p90) = (pct(&xs, 0.5), pct(&xs, 0.9));
    println!(
        "{name:<44} n={:<4} p50 {p50:>8.2} ms  p90 {p90:>8.2} ms",
        xs.len()
    );
    (p50, p90)
}

async fn client(agent: &sandbolt_agent::AgentHandle) -> Client {
    let channel = Channel::from_shared(format!("http://{}", agent.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    AgentServiceClient::with_interceptor(channel, BearerToken::new(TOKEN).unwrap())
}

/// Per-stage times the agent reports (ms since it took the request):
/// image resolved, container created, task started, execd ready.
type Stages = [f64; 4];

async fn timed_create(c: &mut Client, spec: SandboxSpec) -> f64 {
    timed_create_staged(c, spec, &mut Vec::new()).await
}

async fn timed_create_staged(c: &mut Client, spec: SandboxSpec, stages: &mut Vec<Stages>) -> f64 {
    let id = spec.sandbox_id.clone();
    let t = Instant::now();
    let reply = c
        .create_sandbox(CreateSandboxRequest { spec: Some(spec) })
        .await
        .expect("create")
        .into_inner();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let tm = reply.timings.unwrap_or_default();
    stages.push(
        [
            tm.image_resolved_us,
            tm.container_created_us,
            tm.task_started_us,
            tm.execd_ready_us,
        ]
        .map(|us| us as f64 / 1e3),
    );
    c.delete_sandbox(DeleteSandboxRequest {
        sandbox_id: id,
        grace_period_ms: 1,
    })
    .await
    .expect("delete");
    ms
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test host's namespace and veth; removed again by [`remove_test_host`].
fn make_test_host() {
    remove_test_host();
    sh(&["ip", "netns", "add", HOST_NS]);
    sh(&[
        "ip", "link", "add", "sbbench0", "type", "veth", "peer", "name", "sbbench1",
    ]);
    sh(&["ip", "link", "set", "sbbench1", "netns", HOST_NS]);
    sh(&[
        "ip",
        "addr",
        "add",
        &format!("{HOST_SIDE}/30"),
        "dev",
        "sbbench0",
    ]);
    sh(&["ip", "link", "set", "sbbench0", "up"]);
    let inside = |args: &[&str]| {
        let mut all = vec!["ip", "netns", "exec", HOST_NS];
        all.extend_from_slice(args);
        sh(&all);
    };
    inside(&[
        "ip",
        "addr",
        "add",
        &format!("{TEST_HOST}/30"),
        "dev",
        "sbbench1",
    ]);
    inside(&["ip", "link", "set", "sbbench1", "up"]);
    inside(&["ip", "link", "set", "lo", "up"]);
    inside(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        &HOST_SIDE.to_string(),
    ]);
}

fn remove_test_host() {
    let _ = Command::new("ip").args(["netns", "del", HOST_NS]).output();
    let _ = Command::new("ip")
        .args(["link", "del", "sbbench0"])
        .output();
}

/// Runs `f` on a thread inside the network namespace at `ns_path`.
fn in_netns<T: Send + 'static>(ns_path: String, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&ns_path).expect("open netns");
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
    .join()
    .unwrap()
}

/// A sink in the test host: reads every connection to its end.
fn start_sink() {
    let listener = in_netns(format!("/run/netns/{HOST_NS}"), || {
        TcpListener::bind((TEST_HOST, SINK_PORT)).expect("bind sink")
    });
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 20];
                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
            });
        }
    });
}

/// Sends [`TRANSFER`] bytes to the sink; Gbit/s.
fn blast() -> f64 {
    let mut s = TcpStream::connect_timeout(
        &SocketAddr::from((TEST_HOST, SINK_PORT)),
        Duration::from_secs(5),
    )
    .expect("connect to the sink");
    let buf = vec![7u8; 1 << 20];
    let t = Instant::now();
    for _ in 0..TRANSFER / buf.len() {
        s.write_all(&buf).unwrap();
    }
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let _ = s.read(&mut [0u8; 1]);
    (TRANSFER as f64 * 8.0) / t.elapsed().as_secs_f64() / 1e9
}

async fn start_agent(
    bed: &Testbed,
    id: &str,
    state: &std::path::Path,
    net: bool,
) -> sandbolt_agent::AgentHandle {
    let mut cfg = AgentConfig::new(
        id,
        bed.containerd_socket(),
        execd_binary().expect("execd"),
        state,
        TOKEN,
    );
    if net {
        // No names are resolved here; an upstream that never answers is enough.
        cfg.network = Some(NetworkConfig::new(vec!["127.0.0.1:9".parse().unwrap()]));
    }
    Agent::start(cfg).await.expect("agent")
}

#[tokio::main]
async fn main() {
    let iterations: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(60);
    let bed = tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed");
        bed.import_image(&busybox_image().expect("busybox"), NS)
            .expect("import");
        bed
    })
    .await
    .unwrap();
    let (plain_state, net_state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plain = start_agent(&bed, "bench-plain", plain_state.path(), false).await;
    let net = start_agent(&bed, "bench-net", net_state.path(), true).await;
    let (mut pc, mut nc) = (client(&plain).await, client(&net).await);
    let policy = rules_policy(TEST_HOST);

    // 1. create without networking, with networking and a policy with rules,
    // and with networking allow-all, one of each per round, after one
    // warm-up each. The order within a round runs through all six
    // permutations, so each system follows each other one equally often
    // (a create pays for whatever ran just before it on the node).
    timed_create(&mut pc, spec("warm-p", "")).await;
    timed_create(&mut nc, spec("warm-n", &policy)).await;
    const ORDERS: [[usize; 3]; 6] = [
        [0, 1, 2],
        [1, 2, 0],
        [2, 0, 1],
        [0, 2, 1],
        [2, 1, 0],
        [1, 0, 2],
    ];
    let mut samples: [Vec<f64>; 3] = Default::default();
    let mut stages: [Vec<Stages>; 3] = Default::default();
    for i in 0..iterations {
        for system in ORDERS[i % ORDERS.len()] {
            let (c, s) = match system {
                0 => (&mut pc, spec(&format!("p{i}"), "")),
                1 => (&mut nc, spec(&format!("n{i}"), &policy)),
                _ => (&mut nc, spec(&format!("o{i}"), "")),
            };
            let ms = timed_create_staged(c, s, &mut stages[system]).await;
            samples[system].push(ms);
        }
    }
    println!(
        "agent-reported stages, p50 ms (image resolved / container created / task started / execd ready):"
    );
    for (name, st) in ["without", "with rules", "allow-all"].iter().zip(&stages) {
        let p50 = |k: usize| {
            let mut xs: Vec<f64> = st.iter().map(|s| s[k]).collect();
            xs.sort_by(f64::total_cmp);
            pct(&xs, 0.5)
        };
        println!(
            "  {name:<11} {:>6.2} / {:>6.2} / {:>6.2} / {:>6.2}",
            p50(0),
            p50(1),
            p50(2),
            p50(3)
        );
    }
    let [without, with_net, with_allow_all] = samples;
    println!("create → running, same run, {iterations} each:");
    let (b50, b90) = summary("without networking", without);
    let (n50, n90) = summary("with networking + a policy with rules", with_net);
    let (a50, a90) = summary("with networking, allow-all", with_allow_all);
    println!(
        "ratio with rules / without: p50 {:.3}×  p90 {:.3}×",
        n50 / b50,
        n90 / b90
    );
    println!(
        "ratio allow-all / without:  p50 {:.3}×  p90 {:.3}×",
        a50 / b50,
        a90 / b90
    );

    // 2. policy updates on a running sandbox.
    nc.create_sandbox(CreateSandboxRequest {
        spec: Some(spec("upd", &policy)),
    })
    .await
    .expect("create upd");
    let other = rules_policy(Ipv4Addr::new(198, 51, 100, 7));
    let mut updates = Vec::new();
    for i in 0..iterations {
        let json = if i % 2 == 0 { &other } else { &policy };
        let t = Instant::now();
        nc.update_network_policy(UpdateNetworkPolicyRequest {
            sandbox_id: "upd".into(),
            network_policy_json: json.clone(),
        })
        .await
        .expect("update");
        updates.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!("policy update (returns once applied):");
    summary("UpdateNetworkPolicy", updates);
    let pid = nc
        .get_sandbox(sandbolt_proto::agent::v1::SandboxRef {
            sandbox_id: "upd".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .pid;
    nc.update_network_policy(UpdateNetworkPolicyRequest {
        sandbox_id: "upd".into(),
        network_policy_json: policy.clone(),
    })
    .await
    .unwrap();

    // 3. egress throughput through the NAT against the host's own.
    tokio::task::spawn_blocking(move || {
        make_test_host();
        start_sink();
        let (mut host, mut sandbox) = (vec![], vec![]);
        for _ in 0..3 {
            host.push(blast());
            sandbox.push(in_netns(format!("/proc/{pid}/ns/net"), blast));
        }
        remove_test_host();
        let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        println!(
            "TCP to a test host, {} MiB × 3, best: host {:.2} Gbit/s, sandbox through NAT {:.2} Gbit/s, ratio {:.3}×",
            TRANSFER >> 20,
            best(&host),
            best(&sandbox),
            best(&sandbox) / best(&host)
        );
        println!("  all runs: host {host:.2?}  sandbox {sandbox:.2?}");
    })
    .await
    .unwrap();

    nc.delete_sandbox(DeleteSandboxRequest {
        sandbox_id: "upd".into(),
        grace_period_ms: 1,
    })
    .await
    .unwrap();
    net.shutdown().await;
    plain.shutdown().await;
}
