//! Egress policy on the Docker backend, on the test bed's real dockerd and
//! kernel: test hosts in network namespaces this test creates
//! (documentation ranges only), a test DNS server as the proxy's upstream.
//! Every "unreachable" has a control showing the target answers from the
//! root namespace; every name check also shows what the upstream saw.

use crate::common;

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use common::call;
use reqwest::Method;
use sandbolt_lifecycle::docker_egress::member_id;
use sandbolt_lifecycle::{BackendConfig, Lifecycle, LifecycleConfig};
use sandbolt_test_support::dns::StaticDns;
use sandbolt_test_support::nethost::{DocRange, PORT, TestHost};
use serde_json::{Value, json};

/// Runs busybox `args` inside the sandbox whose init is `pid` (its network
/// and mount namespaces: its own /etc/resolv.conf) and returns stdout.
fn in_sandbox(pid: i64, args: &[&str]) -> String {
    let out = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-n", "-m", "--", "/bin/busybox"])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .expect("nsenter runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What a connection from the sandbox to `target` (a name or an address)
/// on the test hosts' port reads; empty when nothing connected.
fn fetch(pid: i64, target: &str) -> String {
    in_sandbox(pid, &["nc", "-w", "2", target, &PORT.to_string()])
}

/// Does `name` resolve inside the sandbox (busybox nslookup through the
/// sandbox's resolv.conf) to `addr`?
fn resolves_to(pid: i64, name: &str, addr: Ipv4Addr) -> bool {
    in_sandbox(pid, &["nslookup", name]).contains(&addr.to_string())
}

fn nft_table(table: &str) -> String {
    let out = Command::new("nft")
        .args(["list", "table", "inet", table])
        .output()
        .expect("nft runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Hosts {
    /// Allowed by name.
    by_name: TestHost,
    /// Allowed by address.
    by_ip: TestHost,
    /// Denied by name; its address is listed nowhere.
    denied: TestHost,
    dns: StaticDns,
}

fn hosts() -> Hosts {
    let by_name = TestHost::start(DocRange::TestNet2);
    let by_ip = TestHost::start(DocRange::TestNet2);
    let denied = TestHost::start(DocRange::TestNet3);
    let dns = StaticDns::builder()
        .a("allowed.test", [by_name.addr()])
        .a("denied.test", [denied.addr()])
        .start();
    for h in [&by_name, &by_ip, &denied] {
        assert_eq!(
            TestHost::fetch_from_root(h.addr()),
            Some(h.line()),
            "control: {} answers from the root namespace",
            h.name()
        );
    }
    Hosts {
        by_name,
        by_ip,
        denied,
        dns,
    }
}

fn config(env: &common::DockerEnv, dns: &StaticDns) -> LifecycleConfig {
    let mut config = env.config();
    if let BackendConfig::Docker(d) = &mut config.backend {
        d.dns_upstreams = vec![dns.addr()];
    }
    config
}

async fn create(base: &str, image: &str, policy: Value) -> String {
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "infinity"],
            "resourceLimits": {},
            "networkPolicy": policy,
        })),
    )
    .await;
    assert!(s.is_success(), "create: {s} {v}");
    v["id"].as_str().expect("sandbox id").to_string()
}

async fn policy_call(base: &str, method: Method, id: &str, body: Option<Value>) -> Value {
    let (s, v) = call(
        method.clone(),
        format!("{base}/v1/sandboxes/{id}/networkpolicy"),
        body,
    )
    .await;
    assert!(s.is_success(), "{method} networkpolicy: {s} {v}");
    v
}

fn pid_and_ip(env: &common::DockerEnv, id: &str) -> (i64, Ipv4Addr) {
    let c = env.inspect(id);
    let pid = c["State"]["Pid"].as_i64().expect("the sandbox runs");
    let net = &c["NetworkSettings"]["Networks"]["sandbolt"];
    let ip: Ipv4Addr = net["IPAddress"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        net["IPAMConfig"]["IPv4Address"].as_str(),
        Some(ip.to_string().as_str()),
        "the address is the lifecycle's choice: {net}"
    );
    (pid, ip)
}

/// Allowed by name and by address reachable, a denied name NXDOMAIN (never
/// asked upstream), an unlisted address closed; a change applies to the
/// running sandbox; a lifecycle restart keeps rules and resolved addresses
/// and releases a container removed meanwhile; delete leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_egress_policy_is_enforced() {
    common::init_tracing();
    let env = common::docker_env();
    let h = hosts();
    let lifecycle = Lifecycle::start(config(&env, &h.dns)).await.unwrap();
    let base = format!("http://{}", lifecycle.addr());
    let table = sandbolt_lifecycle::docker_network::table_name(&env.sandbox_bridge());

    let policy = json!({"defaultAction": "deny", "egress": [
        {"action": "allow", "target": "allowed.test"},
        {"action": "allow", "target": h.by_ip.addr().to_string()},
        {"action": "deny", "target": "denied.test"},
    ]});
    let id = create(&base, &env.image, policy).await;
    let (pid, ip) = pid_and_ip(&env, &id);
    let got = policy_call(&base, Method::GET, &id, None).await;
    assert_eq!(
        (got["mode"].as_str(), got["enforcementMode"].as_str()),
        (Some("rules"), Some("dns+nft")),
        "{got}"
    );

    // DNS-aware: the allowed name's address opens once resolved, not before.
    assert_eq!(
        fetch(pid, &h.by_name.addr().to_string()),
        "",
        "open before resolving"
    );
    assert_eq!(
        fetch(pid, "allowed.test"),
        h.by_name.line(),
        "allowed by name"
    );
    assert_eq!(fetch(pid, &h.by_name.addr().to_string()), h.by_name.line());
    assert_eq!(
        fetch(pid, &h.by_ip.addr().to_string()),
        h.by_ip.line(),
        "allowed by address"
    );
    assert!(
        !resolves_to(pid, "denied.test", h.denied.addr()),
        "denied name resolved"
    );
    assert_eq!(h.dns.queries_for("denied.test"), 0, "{:?}", h.dns.seen());
    assert_eq!(
        fetch(pid, &h.denied.addr().to_string()),
        "",
        "an unlisted address"
    );

    // A change applies to the running sandbox.
    policy_call(
        &base,
        Method::PUT,
        &id,
        Some(json!({"defaultAction": "deny", "egress": [{"action": "allow", "target": "denied.test"}]})),
    )
    .await;
    assert_eq!(
        fetch(pid, "denied.test"),
        h.denied.line(),
        "newly allowed name"
    );
    assert!(
        !resolves_to(pid, "allowed.test", h.by_name.addr()),
        "no longer allowed"
    );
    assert_eq!(
        fetch(pid, &h.by_name.addr().to_string()),
        "",
        "its address closed again"
    );
    assert_eq!(
        fetch(pid, &h.by_ip.addr().to_string()),
        "",
        "the address rule is gone"
    );

    // A second sandbox, removed behind the lifecycle's back while it is down.
    let other = create(&base, &env.image, json!({"defaultAction": "deny"})).await;
    let (_, other_ip) = pid_and_ip(&env, &other);
    assert!(nft_table(&table).contains(&format!("sb_{}", member_id(&other))));

    lifecycle.shutdown().await.unwrap();
    // The rules hold while the lifecycle is down.
    assert_eq!(
        fetch(pid, &h.by_ip.addr().to_string()),
        "",
        "down: still closed"
    );
    assert_eq!(
        fetch(pid, &h.denied.addr().to_string()),
        h.denied.line(),
        "down: resolved address open"
    );
    let rm = Command::new("docker")
        .args([
            "-H",
            &format!("unix://{}", env.socket().display()),
            "rm",
            "-f",
            &format!("sandbox-{other}"),
        ])
        .output()
        .unwrap();
    assert!(rm.status.success(), "{rm:?}");

    let lifecycle = Lifecycle::start(config(&env, &h.dns)).await.unwrap();
    let base = format!("http://{}", lifecycle.addr());
    let got = policy_call(&base, Method::GET, &id, None).await;
    assert_eq!(got["policy"]["egress"][0]["target"], "denied.test", "{got}");
    assert_eq!(got["enforcementMode"], "dns+nft", "{got}");
    // Resolved addresses survive the restart (no new lookup needed)...
    let asked = h.dns.queries_for("denied.test");
    assert_eq!(
        fetch(pid, &h.denied.addr().to_string()),
        h.denied.line(),
        "after restart"
    );
    assert_eq!(h.dns.queries_for("denied.test"), asked);
    // ...and the proxy answers again.
    assert_eq!(
        fetch(pid, "denied.test"),
        h.denied.line(),
        "by name after restart"
    );
    assert!(!resolves_to(pid, "allowed.test", h.by_name.addr()));
    assert_eq!(fetch(pid, &h.by_ip.addr().to_string()), "");
    let rules = nft_table(&table);
    assert!(
        !rules.contains(&format!("sb_{}", member_id(&other)))
            && !rules.contains(&format!("{other_ip} : jump")),
        "the removed container's rules were released: {rules}"
    );

    // PATCH through the same route the SDK's sidecar calls use.
    let got = policy_call(
        &base,
        Method::PATCH,
        &id,
        Some(json!([{"action": "allow", "target": h.by_ip.addr().to_string()}])),
    )
    .await;
    assert_eq!(
        got["policy"]["egress"].as_array().map(Vec::len),
        Some(2),
        "{got}"
    );
    assert_eq!(
        fetch(pid, &h.by_ip.addr().to_string()),
        h.by_ip.line(),
        "patched rule holds"
    );

    // Delete leaves no chain, set, dispatch entry or record.
    let m = member_id(&id);
    let (s, v) = call(Method::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert!(s.is_success(), "delete: {s} {v}");
    let rules = nft_table(&table);
    for leftover in [
        format!("sb_{m}"),
        format!("a_{m}"),
        format!("d_{m}"),
        format!("{ip} : jump"),
    ] {
        assert!(
            !rules.contains(&leftover),
            "{leftover} left after delete: {rules}"
        );
    }
    assert!(
        rules.contains("map dispatch"),
        "the table itself stays: {rules}"
    );
    assert!(
        !env.data
            .path()
            .join("egress")
            .join(format!("{id}.json"))
            .exists()
    );
    lifecycle.shutdown().await.unwrap();
}

/// Under `defaultAction: allow`, a denied name is NXDOMAIN and its address
/// is closed too (the lifecycle resolves it), while the rest stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_allow_all_but_a_denied_name() {
    common::init_tracing();
    let env = common::docker_env();
    let h = hosts();
    let lifecycle = Lifecycle::start(config(&env, &h.dns)).await.unwrap();
    let base = format!("http://{}", lifecycle.addr());
    let id = create(
        &base,
        &env.image,
        json!({"defaultAction": "allow", "egress": [{"action": "deny", "target": "denied.test"}]}),
    )
    .await;
    let (pid, _) = pid_and_ip(&env, &id);
    assert_eq!(fetch(pid, "allowed.test"), h.by_name.line());
    assert_eq!(fetch(pid, &h.by_ip.addr().to_string()), h.by_ip.line());
    assert!(!resolves_to(pid, "denied.test", h.denied.addr()));
    // The address closes once the background lookup lands.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while h.dns.queries_for("denied.test") == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut got = fetch(pid, &h.denied.addr().to_string());
    while !got.is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        got = fetch(pid, &h.denied.addr().to_string());
    }
    assert_eq!(got, "", "the denied name's address stays open");
    let (s, v) = call(Method::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert!(s.is_success(), "delete: {s} {v}");
    lifecycle.shutdown().await.unwrap();
}
