//! Egress policy end to end, by name: a real controller, a real agent with
//! networking (CNI ptp, nftables, its DNS proxy) whose upstream resolver is
//! a test DNS server, and test hosts in network namespaces the test creates
//! (documentation ranges only). Every connection and lookup is made by the
//! sandbox's own busybox, inside the sandbox's network and mount namespaces
//! (so it uses the sandbox's `/etc/resolv.conf`), exactly as a process of
//! the sandbox would.
//!
//! What it proves (issue 15): an allowed name is reachable by name and, once
//! resolved, by address; a denied name is answered NXDOMAIN by the node and
//! never reaches the upstream, and its address is unreachable; an address
//! no rule lists is unreachable; a policy change through the native API
//! applies to the running sandbox; an agent restart keeps connectivity and
//! rules; delete leaves no chain, set, route or veth of the sandbox.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_e2e::bed::*;
use sandbolt_proto::control::v1 as native;
use sandbolt_test_support::dns::StaticDns;
use sandbolt_test_support::nethost::{DocRange, PORT, TestHost};

const TOKEN: &str = "egress-e2e-token";

/// Runs `script` with the sandbox's busybox `sh`, in the sandbox's network
/// and mount namespaces; returns (exit success, stdout + stderr).
fn in_sandbox(pid: u32, script: &str) -> (bool, String) {
    let out = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-n", "-m", "--"])
        .args(["/bin/busybox", "sh", "-c", script])
        .output()
        .expect("nsenter");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// What the sandbox reads from `target` (a name or an address) on the test
/// hosts' port; None when it cannot connect or resolve.
async fn fetch(pid: u32, target: String) -> Option<String> {
    tokio::task::spawn_blocking(move || {
        let (ok, out) = in_sandbox(pid, &format!("busybox nc -w 2 {target} {PORT} </dev/null"));
        (ok && !out.trim().is_empty()).then(|| out.trim().to_string())
    })
    .await
    .unwrap()
}

/// What fetching from `host` reads when it connects.
fn reply(host: &TestHost) -> Option<String> {
    Some(host.line().trim().to_string())
}

async fn lookup_fails(pid: u32, name: &str) -> bool {
    let name = name.to_string();
    tokio::task::spawn_blocking(move || !in_sandbox(pid, &format!("busybox nslookup {name}")).0)
        .await
        .unwrap()
}

fn policy(rules: &[(&str, &str)]) -> String {
    let egress: Vec<String> = rules
        .iter()
        .map(|(a, t)| format!(r#"{{"action":"{a}","target":"{t}"}}"#))
        .collect();
    format!(
        r#"{{"defaultAction":"deny","egress":[{}]}}"#,
        egress.join(",")
    )
}

async fn start_agent_with_network(
    bed: &sandbolt_testbed::Testbed,
    state: &Path,
    controller: SocketAddr,
    upstream: SocketAddr,
) -> AgentHandle {
    let mut cfg = agent_config(bed, "agent-egress", state, controller, TOKEN);
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.network = Some(test_network(upstream));
    Agent::start(cfg)
        .await
        .expect("agent with networking starts")
}

async fn task_pid(agent: &AgentHandle, container_id: &str) -> u32 {
    agent
        .sandboxes()
        .get(container_id)
        .expect("agent knows it")
        .pid
}

fn nft_table() -> String {
    let out = Command::new("nft")
        .args(["list", "ruleset"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn host_routes() -> String {
    let out = Command::new("ip").args(["-4", "route"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn fqdn_policy_by_name_through_the_controller() {
    with_network_state(fqdn_policy_by_name_through_the_controller_in);
}

async fn fqdn_policy_by_name_through_the_controller_in(state: PathBuf) {
    let bed = start_bed().await;
    let hosts = tokio::task::spawn_blocking(|| {
        [
            TestHost::start(DocRange::TestNet2),
            TestHost::start(DocRange::TestNet3),
            TestHost::start(DocRange::TestNet2),
            TestHost::start(DocRange::TestNet3),
        ]
    })
    .await
    .unwrap();
    let [allowed, denied, wild, unlisted] = &hosts;
    let dns = StaticDns::start(
        [
            ("allowed.test", vec![allowed.addr()]),
            ("denied.test", vec![denied.addr()]),
            ("api.wild.test", vec![wild.addr()]),
            ("later.test", vec![unlisted.addr()]),
        ],
        Duration::from_secs(300),
    );

    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), TOKEN);
    cfg.heartbeat_interval = Duration::from_millis(200);
    let ctl = Controller::start(cfg).await.unwrap();
    let agent = start_agent_with_network(&bed, &state, ctl.local_addr(), dns.addr()).await;
    wait_agents(&connect(ctl.local_addr()).await, 1).await;
    let mut api = Native::connect(format!("http://{}", ctl.local_addr()))
        .await
        .unwrap();

    // Create with a policy: two names (one a wildcard) allowed, one denied.
    let rules = policy(&[
        ("allow", "allowed.test"),
        ("allow", "*.wild.test"),
        ("deny", "denied.test"),
    ]);
    let created = api
        .create_sandbox(native_busybox_create(
            "egress-e2e",
            native::SandboxSpec {
                network_policy_json: rules,
                ..Default::default()
            },
        ))
        .await
        .expect("create with a policy")
        .into_inner();
    let status = created.status.clone().unwrap();
    assert!(!status.ip_address.is_empty(), "the sandbox has an address");
    let container = status.container_id.clone();
    let pid = task_pid(&agent, &container).await;

    // By name, then by the address the node resolved.
    assert_eq!(fetch(pid, "allowed.test".into()).await, reply(allowed));
    assert_eq!(fetch(pid, allowed.addr().to_string()).await, reply(allowed));
    // Wildcard: the address is closed until the name is resolved.
    assert_eq!(fetch(pid, wild.addr().to_string()).await, None);
    assert_eq!(fetch(pid, "api.wild.test".into()).await, reply(wild));
    // Denied: NXDOMAIN from the node, never asked upstream, address closed.
    assert!(lookup_fails(pid, "denied.test").await);
    assert_eq!(fetch(pid, denied.addr().to_string()).await, None);
    assert_eq!(dns.queries_for("denied.test"), 0, "{:?}", dns.seen());
    // An address no rule lists.
    assert_eq!(fetch(pid, unlisted.addr().to_string()).await, None);
    // A resolver of the sandbox's own choosing is out of reach.
    let (ok, out) = tokio::task::spawn_blocking(move || {
        in_sandbox(pid, "busybox nslookup allowed.test 198.51.100.1")
    })
    .await
    .unwrap();
    assert!(!ok, "a resolver other than the node's answered: {out}");

    // A policy change through the native API applies to the running sandbox.
    api.update_sandbox(native::UpdateSandboxRequest {
        sandbox: native_ref("egress-e2e"),
        network_policy_json: Some(policy(&[("allow", "later.test")])),
        ..Default::default()
    })
    .await
    .expect("update the policy");
    assert_eq!(fetch(pid, "later.test".into()).await, reply(unlisted));
    assert_eq!(fetch(pid, allowed.addr().to_string()).await, None);
    assert!(lookup_fails(pid, "allowed.test").await);
    let record = api
        .get_sandbox(native::GetSandboxRequest {
            sandbox: native_ref("egress-e2e"),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        record
            .spec
            .unwrap()
            .network_policy_json
            .contains("later.test"),
        "the record keeps the new policy"
    );

    // An agent restart keeps connectivity and rules.
    agent.shutdown().await;
    let agent = start_agent_with_network(&bed, &state, ctl.local_addr(), dns.addr()).await;
    assert_eq!(task_pid(&agent, &container).await, pid);
    assert_eq!(
        fetch(pid, unlisted.addr().to_string()).await,
        reply(unlisted)
    );
    assert_eq!(fetch(pid, allowed.addr().to_string()).await, None);
    assert_eq!(fetch(pid, "later.test".into()).await, reply(unlisted));
    assert!(lookup_fails(pid, "denied.test").await);

    // Delete: the sandbox's chain, sets, route and veth are gone.
    let ip = status.ip_address.clone();
    assert!(
        host_routes().contains(&format!("{ip} dev")),
        "{}",
        host_routes()
    );
    api.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: native_ref("egress-e2e"),
    })
    .await
    .expect("delete");
    sandbolt_test_support::eventually(
        "the sandbox's route is gone",
        Duration::from_secs(30),
        || (!host_routes().contains(&format!("{ip} dev"))).then_some(()),
    )
    .await;
    let table = nft_table();
    assert!(
        !table.contains(&ip),
        "the ruleset still names {ip}:\n{table}"
    );
    agent.shutdown().await;
    let purged = tokio::task::spawn_blocking(move || {
        sandbolt_agent::network::purge(&state, Path::new(CNI_BIN_DIR))
    })
    .await
    .unwrap()
    .expect("purge after shutdown");
    eprintln!("purged after the test: {purged:?}");
    ctl.shutdown().await;
    drop(hosts);
}
