//! gVisor (runsc) sandboxes on the test bed's containerd with the real
//! runsc (`--platform=ptrace`, `--network=sandbox` on the sandbox's veth):
//! the kernel inside is gVisor's, the node's processes and kernel version
//! are hidden, execd answers through the proxy at the sandbox's address,
//! limits, pause/resume, delete, agent restart, and the refusals.

use crate::common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use sandbolt_agent::config::NetworkConfig;
use sandbolt_agent::network::state::{Dirs, Member};
use sandbolt_agent::{AgentConfig, AgentHandle};
use sandbolt_proto::agent::v1::{
    CreateSnapshotRequest, GetInventoryRequest, HostPathMount, NamedVolumeMount, Resources,
    SandboxPhase, SandboxRef, SandboxSpec,
};
use tonic::Code;

const EXECD_PORT: u16 = 44772;

/// An agent with sandbox networking (runsc needs it), its gRPC port open on
/// every address so that "the sandbox cannot reach the node" is tested
/// against a port that is really there.
fn gvisor_agent(cfg: &mut AgentConfig) {
    let mut net = NetworkConfig::new(vec!["127.0.0.1:9".parse().unwrap()]);
    net.pool_size = 1;
    cfg.network = Some(net);
    cfg.grpc_listen = "0.0.0.0:0".parse().unwrap();
}

async fn gvisor_env() -> Env {
    Env::start_with(gvisor_agent).await
}

/// Stops the agent and removes its sandbox networking (namespaces, veths,
/// nftables table), which an agent keeps across restarts, then the bed.
async fn finish(mut env: Env) {
    if let Some(a) = env.agent.take() {
        a.shutdown().await;
    }
    let state = env.state.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        sandbolt_agent::network::purge(&state, Path::new("/usr/lib/cni"))
            .unwrap_or_else(|e| panic!("purging the agent's network: {e}"));
    })
    .await
    .unwrap();
    env.shutdown().await;
}

/// A runsc sandbox running `sleep`, created with execd awaited.
fn runsc_spec(id: &str) -> SandboxSpec {
    let mut s = spec(id, &["sleep", "100000"]);
    s.runtime = "runsc".into();
    s.wait_for_execd = true;
    s
}

/// One HTTP/1.1 request over a fresh connection; (status, body bytes).
fn http(addr: SocketAddr, head: &str, headers: &[(&str, String)], body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!(
        "{head} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {:?}", String::from_utf8_lossy(&out)));
    let head = String::from_utf8_lossy(&out[..end]).into_owned();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut body = out[end + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (code, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

/// Both tokens: the proxy's and execd's (the same in these tests).
fn tokens(id: &str) -> Vec<(&'static str, String)> {
    vec![
        ("X-Sandbolt-Access-Token", format!("token-{id}")),
        ("X-EXECD-ACCESS-TOKEN", format!("token-{id}")),
    ]
}

/// Runs `command` in sandbox `id` through the agent's proxy and execd;
/// returns (status, the whole streamed answer).
async fn exec(agent: &AgentHandle, id: &str, command: &str) -> (u16, String) {
    let proxy = agent.proxy_addr();
    let body = serde_json::json!({ "command": command }).to_string();
    let id = id.to_string();
    tokio::task::spawn_blocking(move || {
        let mut h = tokens(&id);
        h.push(("Content-Type", "application/json".into()));
        let (code, out) = http(
            proxy,
            &format!("POST /{id}/{EXECD_PORT}/command"),
            &h,
            body.as_bytes(),
        );
        (code, String::from_utf8_lossy(&out).into_owned())
    })
    .await
    .unwrap()
}

/// [`exec`] that must succeed; returns the answer.
async fn exec_ok(agent: &AgentHandle, id: &str, command: &str) -> String {
    let (code, out) = exec(agent, id, command).await;
    assert_eq!(code, 200, "{command}: {out}");
    out
}

fn host_kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap()
        .trim()
        .to_string()
}

/// Host processes whose command line names sandbox `id` (runsc's sandbox,
/// gofer and shim processes carry the container id).
fn host_processes_of(id: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("runsc") && cmd.contains(id) {
            found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
        }
    }
    found
}

fn member_of(state: &Path, id: &str) -> Member {
    Dirs::new(state)
        .load_all()
        .into_iter()
        .find(|m| m.sandbox_id.as_deref() == Some(id))
        .unwrap_or_else(|| panic!("no network member for {id}"))
}

fn host_links() -> String {
    let out = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deletes `id` and checks that nothing of it is left: containerd's and
/// the agent's leftovers (see [`Env::delete_leaving_nothing`]), runsc's
/// processes, its namespace file and its veth.
async fn delete_leaving_nothing_of_gvisor(env: &mut Env, id: &str) {
    let member = member_of(env.state.path(), id);
    assert!(env.delete_leaving_nothing(id, 2000).await);
    let left = host_processes_of(id);
    assert!(left.is_empty(), "runsc processes left: {left:?}");
    assert!(
        !member.netns_path.exists(),
        "namespace file {} left",
        member.netns_path.display()
    );
    let veth = member.host_veth.unwrap();
    assert!(
        !host_links().contains(&format!(" {veth}@")),
        "veth {veth} left"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn runsc_sandbox_runs_gvisors_kernel_hides_the_host_and_answers_through_the_proxy() {
    let mut env = gvisor_env().await;
    let inv = env
        .client
        .get_inventory(GetInventoryRequest {})
        .await
        .unwrap()
        .into_inner();
    let runsc = inv.runtimes.iter().find(|r| r.name == "runsc").unwrap();
    assert!(runsc.available, "{runsc:?}");
    assert!(runsc.version.starts_with("runsc version"), "{runsc:?}");

    let id = "sb-gvk";
    let resp = env.create(runsc_spec(id)).await.expect("runsc create");
    let status = resp.status.unwrap();
    assert_eq!(status.phase(), SandboxPhase::Running);
    assert_eq!(status.runtime, "runsc");

    // The kernel answering system calls is gVisor's, not the node's.
    let host = host_kernel_release();
    let out = exec_ok(env.agent(), id, "uname -r; cat /proc/version").await;
    assert!(out.contains("4.4.0"), "{out}");
    assert!(
        !out.contains(&host),
        "the node's kernel {host} shows: {out}"
    );

    // Only the sandbox's own processes: execd (PID 1), sleep, the shell.
    let out = exec_ok(
        env.agent(),
        id,
        "echo procs=$(ls /proc | grep -c '^[0-9]*$'); ps -o pid,comm",
    )
    .await;
    let procs: usize = out
        .split("procs=")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(procs <= 6, "{procs} processes visible: {out}");
    for host_only in ["containerd", "runsc", "sandbolt", "systemd"] {
        assert!(!out.contains(host_only), "{host_only} is visible: {out}");
    }

    // A file round trip through the proxy: upload, read back inside,
    // download.
    let data: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    let proxy = env.agent().proxy_addr();
    let (code, body) = {
        let data = data.clone();
        tokio::task::spawn_blocking(move || upload(proxy, id, "/tmp/blob", &data))
            .await
            .unwrap()
    };
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let out = exec_ok(env.agent(), id, "wc -c < /tmp/blob").await;
    assert!(out.contains("1048576"), "{out}");
    let (code, back) = tokio::task::spawn_blocking(move || {
        http(
            proxy,
            &format!("GET /{id}/{EXECD_PORT}/files/download?path=/tmp/blob"),
            &tokens(id),
            b"",
        )
    })
    .await
    .unwrap();
    assert_eq!(code, 200);
    assert!(
        back == data,
        "downloaded {} bytes, not the upload",
        back.len()
    );

    // gVisor's sandbox and gofer run on the node as runsc processes.
    assert!(!host_processes_of(id).is_empty(), "runsc runs {id}");
    delete_leaving_nothing_of_gvisor(&mut env, id).await;
    finish(env).await;
}

/// `POST /files/upload` (multipart, as the SDK sends it) through the proxy.
fn upload(proxy: SocketAddr, id: &str, path: &str, data: &[u8]) -> (u16, Vec<u8>) {
    const B: &str = "gvisor-test-boundary";
    let meta = serde_json::json!({ "path": path, "mode": 644 });
    let mut body = format!(
        "--{B}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\
         Content-Type: application/json\r\n\r\n{meta}\r\n\
         --{B}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(data);
    body.extend_from_slice(format!("\r\n--{B}--\r\n").as_bytes());
    let mut h = tokens(id);
    h.push(("Content-Type", format!("multipart/form-data; boundary={B}")));
    http(
        proxy,
        &format!("POST /{id}/{EXECD_PORT}/files/upload"),
        &h,
        &body,
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn runsc_sandbox_is_limited_paused_resumed_and_isolated_from_the_node() {
    let mut env = gvisor_env().await;
    let id = "sb-gvl";
    let mut s = runsc_spec(id);
    s.resources = Some(Resources {
        cpu: "500m".into(),
        memory: "256Mi".into(),
        pids_limit: 16,
        ..Default::default()
    });
    env.create(s).await.expect("runsc create with limits");

    // runsc puts the sandbox (sentry, gofer) in the cgroup the spec names
    // and writes the limits there.
    let cg = |ctl: &str, file: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{ctl}/sandbolt/{id}/{file}"))
            .unwrap_or_else(|e| panic!("{ctl}/{file}: {e}"))
            .trim()
            .to_string()
    };
    assert_eq!(
        cg("memory", "memory.limit_in_bytes"),
        (256u64 << 20).to_string()
    );
    assert_eq!(cg("cpu", "cpu.cfs_quota_us"), "50000");
    // The host limit counts gVisor's host tasks (sentry, gofer, ptrace
    // stubs), scaled from the request's process count.
    assert_eq!(
        cg("pids", "pids.max"),
        sandbolt_agent::gvisor::host_pids_limit(16).to_string()
    );
    // Inside, gVisor sizes its memory by the limit.
    let out = exec_ok(env.agent(), id, "grep MemTotal /proc/meminfo").await;
    assert!(out.contains("262144 kB"), "{out}");

    // The sandbox cannot open a connection to the node (the agent's gRPC
    // port on the gateway address), while the node reaches the sandbox
    // (every exec here goes node → sandbox address).
    let member = member_of(env.state.path(), id);
    let port = env.agent().grpc_addr().port();
    let out = exec_ok(
        env.agent(),
        id,
        &format!(
            "if nc -w 3 {} {port} </dev/null; then echo REACHED; else echo REFUSED; fi",
            member.gateway
        ),
    )
    .await;
    assert!(out.contains("REFUSED") && !out.contains("REACHED"), "{out}");

    // Pause freezes it (the proxy gets no answer in time), resume thaws it.
    let paused = env
        .client
        .pause_sandbox(SandboxRef {
            sandbox_id: id.into(),
        })
        .await
        .expect("pause a runsc sandbox")
        .into_inner();
    assert_eq!(paused.phase(), SandboxPhase::Paused);
    let resumed = env
        .client
        .resume_sandbox(SandboxRef {
            sandbox_id: id.into(),
        })
        .await
        .expect("resume a runsc sandbox")
        .into_inner();
    assert_eq!(resumed.phase(), SandboxPhase::Running);
    let out = exec_ok(env.agent(), id, "echo after-resume").await;
    assert!(out.contains("after-resume"), "{out}");

    // Far more processes than the limit: the sandbox is stopped (gVisor
    // cannot get the host tasks it needs), the node is untouched.
    let _ = exec(
        env.agent(),
        id,
        "(for i in $(seq 100); do sleep 1000 & done) >/dev/null 2>&1 & echo spawned",
    )
    .await;
    let dead = wait_for_phase(&env.client, id, SandboxPhase::Failed).await;
    assert_ne!(dead.exit_code, 0, "{dead:?}");

    delete_leaving_nothing_of_gvisor(&mut env, id).await;
    finish(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_agent_reaches_its_runsc_sandboxes_again() {
    let mut env = gvisor_env().await;
    let id = "sb-gvr";
    env.create(runsc_spec(id)).await.expect("runsc create");
    exec_ok(env.agent(), id, "echo before").await;

    env.restart_agent(gvisor_agent).await;
    let status = get(&mut env.client, id).await.expect("recovered");
    assert_eq!(status.phase(), SandboxPhase::Running);
    assert_eq!(status.runtime, "runsc");
    let out = exec_ok(env.agent(), id, "echo after-restart; uname -r").await;
    assert!(
        out.contains("after-restart") && out.contains("4.4.0"),
        "{out}"
    );

    delete_leaving_nothing_of_gvisor(&mut env, id).await;
    finish(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn runsc_is_refused_clearly_where_it_cannot_work() {
    // Without sandbox networking: unavailable, and a create says why.
    let mut env = Env::start().await;
    let inv = env
        .client
        .get_inventory(GetInventoryRequest {})
        .await
        .unwrap()
        .into_inner();
    let runsc = inv.runtimes.iter().find(|r| r.name == "runsc").unwrap();
    assert!(!runsc.available);
    assert!(runsc.reason.contains("--network none"), "{runsc:?}");
    let e = env
        .create(runsc_spec("sb-gvn"))
        .await
        .expect_err("runsc without networking");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("runsc") && e.message().contains("--network none"),
        "{e:?}"
    );
    assert_eq!(leftovers(&env, "sb-gvn"), Vec::<String>::new());
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn runsc_refuses_what_gvisor_cannot_have_naming_the_field() {
    let mut env = gvisor_env().await;
    let id = "sb-gvx-a";
    env.create(runsc_spec(id)).await.expect("runsc create");

    // Volumes: the agent cannot mount into gVisor's file system.
    let mut s = runsc_spec("sb-gvx-b");
    s.host_mounts = vec![HostPathMount {
        host_path: "/tmp".into(),
        mount_path: "/mnt".into(),
        ..Default::default()
    }];
    let e = env.create(s).await.expect_err("host_mounts under runsc");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("host_mounts"), "{e:?}");
    let mut s = runsc_spec("sb-gvx-c");
    s.volume_mounts = vec![NamedVolumeMount {
        volume: "v".into(),
        mount_path: "/data".into(),
        ..Default::default()
    }];
    let e = env.create(s).await.expect_err("volume_mounts under runsc");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("volume_mounts"), "{e:?}");

    // An id that is a prefix of a runsc sandbox's id on this node.
    let e = env
        .create(runsc_spec("sb-gvx-a2"))
        .await
        .expect_err("prefix id under runsc");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("sandbox_id"), "{e:?}");

    // Snapshots of a gVisor sandbox.
    let e = env
        .client
        .create_snapshot(CreateSnapshotRequest {
            snapshot_id: "snap-gv".into(),
            sandbox_id: id.into(),
        })
        .await
        .expect_err("snapshot of a runsc sandbox");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("runsc"), "{e:?}");

    for refused in ["sb-gvx-b", "sb-gvx-c", "sb-gvx-a2"] {
        assert_eq!(leftovers(&env, refused), Vec::<String>::new());
    }
    // The refusals left the running sandbox alone.
    let out = exec_ok(env.agent(), id, "echo still-here").await;
    assert!(out.contains("still-here"), "{out}");
    delete_leaving_nothing_of_gvisor(&mut env, id).await;
    finish(env).await;
}

/// What the janitor hears from the controller in
/// [`the_janitor_reaps_a_runsc_sandbox_no_record_owns`]: no record owns any
/// container, and the agent is unknown.
struct NoRecords;

#[tonic::async_trait]
impl sandbolt_janitor::OwnershipSource for NoRecords {
    async fn ownership(
        &self,
        _node_name: &str,
        queries: &[sandbolt_janitor::rules::ContainerFacts],
    ) -> sandbolt_janitor::Result<sandbolt_janitor::rules::OwnershipReport> {
        use sandbolt_janitor::rules::{OwnershipAnswer, OwnershipReport, RecordState};
        Ok(OwnershipReport {
            ready: true,
            answers: queries
                .iter()
                .map(|q| OwnershipAnswer {
                    sandbox_id: q.sandbox_id.clone(),
                    record: RecordState::Absent,
                    ..Default::default()
                })
                .collect(),
            agents: vec![],
            fast_commit_deadline_ms: 0,
        })
    }

    async fn report_reaped(
        &self,
        _reaped: &sandbolt_janitor::ReapNotice<'_>,
    ) -> sandbolt_janitor::Result<()> {
        Ok(())
    }
}

/// The janitor reaps a runsc sandbox that no record owns, with its agent
/// stopped, as it reaps a runc one: through containerd and the runc shim,
/// which finds the agent's runsc wrapper and runsc root in the container's
/// runtime options. No container, task, snapshot or runsc process is left.
#[tokio::test(flavor = "multi_thread")]
async fn the_janitor_reaps_a_runsc_sandbox_no_record_owns() {
    let mut env = gvisor_env().await;
    let id = "sb-gvisor-orphan";
    env.create(runsc_spec(id))
        .await
        .expect("create a runsc sandbox");
    assert!(
        !host_processes_of(id).is_empty(),
        "the runsc sandbox runs on the node"
    );
    // The agent goes away; its sandbox keeps running, owned by nobody.
    if let Some(agent) = env.agent.take() {
        agent.shutdown().await;
    }
    assert!(!host_processes_of(id).is_empty(), "still running");

    let mut jcfg = sandbolt_janitor::JanitorConfig::new(
        "node-test",
        env.bed.containerd_socket(),
        "http://127.0.0.1:1",
        TOKEN,
        env.state.path().join("janitor"),
    );
    jcfg.grace_period = Duration::ZERO;
    jcfg.agent_state_dir = Some(env.state.path().to_path_buf());
    let janitor = sandbolt_janitor::Janitor::with_source(jcfg, std::sync::Arc::new(NoRecords))
        .await
        .expect("janitor");
    let report = janitor.scan_once().await.expect("scan");
    assert!(
        report
            .reaped
            .iter()
            .any(|r| r.sandbox_id == id && r.reason == sandbolt_janitor::ReapReason::NoRecord),
        "{report:?}"
    );
    assert!(report.errors.is_empty(), "{report:?}");
    assert_eq!(leftovers(&env, id), Vec::<String>::new());
    let left = host_processes_of(id);
    assert!(left.is_empty(), "runsc processes left: {left:?}");
    finish(env).await;
}

/// Egress under gVisor follows the same policy as under runc: gVisor's
/// netstack sends through the sandbox's veth, so the node's nftables chain
/// and DNS proxy see its packets. With default deny and one allowed name,
/// the allowed host is closed until the name is resolved through the
/// proxy, open after; a denied name is NXDOMAIN and its host stays closed.
#[tokio::test(flavor = "multi_thread")]
async fn runsc_sandbox_egress_follows_its_policy_through_the_dns_proxy() {
    use sandbolt_test_support::dns::StaticDns;
    use sandbolt_test_support::nethost::{DocRange, PORT, TestHost};
    let allowed = TestHost::start(DocRange::TestNet3);
    let denied = TestHost::start(DocRange::TestNet3);
    let dns = StaticDns::start(
        [
            ("allowed.example", vec![allowed.addr()]),
            ("denied.example", vec![denied.addr()]),
        ],
        Duration::from_secs(300),
    );
    assert!(
        TestHost::fetch_from_root(allowed.addr()).is_some()
            && TestHost::fetch_from_root(denied.addr()).is_some(),
        "control: both hosts answer the node"
    );
    let mut env = Env::start_with(|cfg| {
        gvisor_agent(cfg);
        cfg.network.as_mut().unwrap().dns_upstreams = vec![dns.addr()];
    })
    .await;
    let id = "sb-gvisor-egress";
    let mut s = runsc_spec(id);
    s.network_policy_json =
        r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"allowed.example"}]}"#
            .into();
    env.create(s)
        .await
        .expect("create a runsc sandbox with a policy");
    let agent = env.agent.take().unwrap();
    let reach = |ip: std::net::Ipv4Addr| {
        format!("nc -w 2 {ip} {PORT} </dev/null && echo OPEN-{ip} || echo CLOSED-{ip}")
    };

    let before = exec_ok(&agent, id, &reach(allowed.addr())).await;
    assert!(
        before.contains(&format!("CLOSED-{}", allowed.addr())),
        "closed until the name is resolved: {before}"
    );
    let lookup = exec_ok(&agent, id, "nslookup allowed.example").await;
    assert!(
        lookup.contains(&allowed.addr().to_string()),
        "the proxy answers the allowed name: {lookup}"
    );
    let after = exec_ok(&agent, id, &reach(allowed.addr())).await;
    assert!(
        after.contains(&allowed.line().trim().to_string()),
        "open once resolved: {after}"
    );
    let refused = exec_ok(
        &agent,
        id,
        "nslookup denied.example && echo RESOLVED || echo NOT-RESOLVED",
    )
    .await;
    assert!(
        refused.contains("NOT-RESOLVED") && !refused.contains(&denied.addr().to_string()),
        "a denied name is not resolved: {refused}"
    );
    assert_eq!(
        dns.queries_for("denied.example"),
        0,
        "a denied name is answered locally"
    );
    let closed = exec_ok(&agent, id, &reach(denied.addr())).await;
    assert!(
        closed.contains(&format!("CLOSED-{}", denied.addr())),
        "the denied host stays closed: {closed}"
    );
    env.agent = Some(agent);
    delete_leaving_nothing_of_gvisor(&mut env, id).await;
    finish(env).await;
}
