//! Sandbox networking on real kernel networking: namespaces, veths (CNI
//! ptp), nftables, and test hosts in namespaces the test creates
//! (documentation ranges only, 169.254.169.254 as the metadata stand-in).
//! Connections are made from inside a sandbox's network namespace
//! (`/proc/<pid>/ns/net`), so what is checked is exactly what the
//! sandbox's processes get.

use crate::common;

use std::collections::HashSet;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use sandbolt_agent::config::NetworkConfig;
use sandbolt_agent::network::{self, state::Member};
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_proto::agent::v1::{SandboxSpec, SandboxStatus, UpdateNetworkPolicyRequest};
use sandbolt_test_support::nethost::{
    DocRange, LineServer, PORT, TestHost, connects_in_netns, fetch_in_netns,
};
use tonic::Code;

/// Nothing answers here: the tests resolve no names, and the proxy must
/// never forward to an outside resolver.
const NO_UPSTREAM: &str = "127.0.0.1:9";

fn network_config(pool_size: usize) -> NetworkConfig {
    let mut net = NetworkConfig::new(vec![NO_UPSTREAM.parse().unwrap()]);
    net.pool_size = pool_size;
    net
}

/// An agent config with networking, its gRPC port open on every address
/// (so that "the sandbox cannot reach the node's ports" is tested against
/// a port that is really there).
fn net_agent_config(env_bed: &sandbolt_testbed::Testbed, state: &Path) -> AgentConfig {
    let mut cfg = config(env_bed, state, "agent-net");
    cfg.grpc_listen = "0.0.0.0:0".parse().unwrap();
    cfg.network = Some(network_config(2));
    cfg
}

fn netns_of(status: &SandboxStatus) -> PathBuf {
    PathBuf::from(format!("/proc/{}/ns/net", status.pid))
}

fn at(ip: Ipv4Addr) -> SocketAddr {
    SocketAddr::from((ip, PORT))
}

/// What `status`'s sandbox reads when it connects to `addr` (None: it
/// cannot connect).
async fn fetch(status: &SandboxStatus, addr: SocketAddr) -> Option<String> {
    let ns = netns_of(status);
    tokio::task::spawn_blocking(move || fetch_in_netns(&ns, addr))
        .await
        .unwrap()
}

async fn connects(status: &SandboxStatus, addr: SocketAddr) -> bool {
    let ns = netns_of(status);
    tokio::task::spawn_blocking(move || connects_in_netns(&ns, addr))
        .await
        .unwrap()
}

fn policy_spec(id: &str, policy: &str) -> SandboxSpec {
    let mut s = spec(id, &["sleep", "1000"]);
    s.network_policy_json = policy.to_string();
    s
}

async fn update_policy(
    client: &mut Client,
    id: &str,
    policy: &str,
) -> Result<SandboxStatus, tonic::Status> {
    client
        .update_network_policy(UpdateNetworkPolicyRequest {
            sandbox_id: id.into(),
            network_policy_json: policy.into(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The member file of sandbox `id` under `state`.
fn member_of(state: &Path, id: &str) -> Option<Member> {
    members(state)
        .into_iter()
        .find(|m| m.sandbox_id.as_deref() == Some(id))
}

fn members(state: &Path) -> Vec<Member> {
    network::state::Dirs::new(state).load_all()
}

fn nft_table(table: &str) -> Option<String> {
    let out = Command::new("nft")
        .args(["list", "table", "inet", table])
        .output()
        .unwrap();
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn host_links() -> String {
    let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What of `member` is still on the host: its veth, namespace file, nft
/// chain and sets, IPAM reservation, member file.
fn member_leftovers(state: &Path, table: &str, member: &Member) -> Vec<String> {
    let mut left = Vec::new();
    let m = &member.member_id;
    if let Some(veth) = &member.host_veth
        && host_links().contains(&format!(" {veth}@"))
    {
        left.push(format!("veth {veth}"));
    }
    if member.netns_path.exists() {
        left.push(format!("netns {}", member.netns_path.display()));
    }
    if let Some(rules) = nft_table(table) {
        for name in [format!("sb_{m}"), format!("a_{m}"), format!("d_{m}")] {
            if rules.contains(&format!(" {name} ")) {
                left.push(format!("nft {name}"));
            }
        }
        if let Some(veth) = &member.host_veth
            && rules.contains(veth.as_str())
        {
            left.push(format!("nft element {veth}"));
        }
    }
    if let Some(ip) = member.ip {
        let ipam = state.join("network/ipam/sandbolt").join(ip.to_string());
        if ipam.exists() {
            left.push(format!("IPAM {}", ipam.display()));
        }
    }
    if state.join(format!("network/members/{m}.json")).exists() {
        left.push(format!("member file {m}"));
    }
    left
}

/// What of a whole agent's networking is still on the host.
fn agent_leftovers(state: &Path, table: &str, subnet_lock: &Path) -> Vec<String> {
    let mut left = Vec::new();
    if nft_table(table).is_some() {
        left.push(format!("nft table {table}"));
    }
    for dir in ["network/netns", "network/members"] {
        if let Ok(entries) = std::fs::read_dir(state.join(dir)) {
            for e in entries.flatten() {
                left.push(format!("{dir}/{}", e.file_name().to_string_lossy()));
            }
        }
    }
    if subnet_lock.exists() {
        left.push(format!("subnet lock {}", subnet_lock.display()));
    }
    left
}

fn subnet_lock(net: network::subnet::Ipv4Net) -> PathBuf {
    Path::new(network::subnet::CLAIMS_DIR).join(format!("{}.lock", net.slug()))
}

/// Runs `body` with the agent state dir it is given; when it panics, the
/// runtime (and with it every agent task holding the subnet) is stopped
/// and the state is purged, so a failed run leaves nothing on the host.
fn cleaning_up<F: Future<Output = ()>>(body: impl FnOnce(PathBuf) -> F) {
    let state = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let path = state.path().to_path_buf();
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(body(path))));
    rt.shutdown_timeout(std::time::Duration::from_secs(10));
    if let Err(panic) = outcome {
        if let Err(e) = network::purge(state.path(), Path::new(CNI_BIN_DIR)) {
            eprintln!("purge after the failed test: {e}");
        }
        std::panic::resume_unwind(panic);
    }
}

const CNI_BIN_DIR: &str = "/usr/lib/cni";

#[test]
fn egress_isolation_policy_restart_and_delete() {
    cleaning_up(egress_isolation_policy_restart_and_delete_in);
}

async fn egress_isolation_policy_restart_and_delete_in(state: PathBuf) {
    let allowed = TestHost::start(DocRange::TestNet2);
    let other = TestHost::start(DocRange::TestNet2);
    let metadata = TestHost::with_address(Ipv4Addr::new(169, 254, 169, 254));
    let private = TestHost::with_address(Ipv4Addr::new(10, 123, 45, 67));
    // Controls: each host answers the node itself.
    for (h, a) in [
        (&allowed, allowed.addr()),
        (&other, other.addr()),
        (&metadata, metadata.extra().unwrap()),
        (&private, private.extra().unwrap()),
    ] {
        assert_eq!(TestHost::fetch_from_root(a), Some(h.line()), "control {a}");
    }

    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let cfg = net_agent_config(&bed, &state);
    let agent = Agent::start(cfg.clone()).await.expect("agent starts");
    let mut client = client(agent.grpc_addr(), TOKEN).await;
    let net = agent.sandboxes().network().unwrap().clone();
    let (table, subnet, gateway) = (net.table_name().to_string(), net.subnet(), net.gateway());
    let grpc_port = agent.grpc_addr().port();

    // Allow-all: an address, a resolv.conf naming the proxy, egress.
    let open = env_create(&mut client, policy_spec("sb-open", "")).await;
    let ip: Ipv4Addr = open.ip_address.parse().expect("an address in the status");
    assert!(subnet.contains(ip), "{ip} in {subnet}");
    let resolv =
        std::fs::read_to_string(format!("/proc/{}/root/etc/resolv.conf", open.pid)).unwrap();
    assert_eq!(resolv.trim(), format!("nameserver {gateway}"));
    assert_eq!(fetch(&open, at(allowed.addr())).await, Some(allowed.line()));
    assert_eq!(fetch(&open, at(other.addr())).await, Some(other.line()));

    // Isolation, whatever the policy.
    assert_eq!(
        fetch(&open, at(metadata.extra().unwrap())).await,
        None,
        "metadata"
    );
    assert_eq!(
        fetch(&open, at(private.extra().unwrap())).await,
        None,
        "10.x host"
    );
    let node_ports = [
        SocketAddr::from((gateway, grpc_port)),
        SocketAddr::from((allowed.peer(), grpc_port)),
    ];
    for a in node_ports {
        assert!(
            tokio::task::spawn_blocking(move || std::net::TcpStream::connect(a).is_ok())
                .await
                .unwrap(),
            "control: the agent's port answers on {a} from the node"
        );
        assert!(
            !connects(&open, a).await,
            "the sandbox reached the node at {a}"
        );
    }
    // The DNS proxy is the one node port a sandbox reaches.
    assert!(
        connects(&open, SocketAddr::from((gateway, 53))).await,
        "DNS proxy over TCP"
    );

    // Sandbox to sandbox: closed both ways.
    let peer = env_create(&mut client, policy_spec("sb-peer", "")).await;
    let _server = LineServer::start(&netns_of(&open), 8000, "sb-open\n".into());
    let open_ip: Ipv4Addr = open.ip_address.parse().unwrap();
    assert_eq!(
        fetch(&open, SocketAddr::from((open_ip, 8000)))
            .await
            .as_deref(),
        Some("sb-open\n"),
        "control: the server answers inside its sandbox"
    );
    assert_eq!(fetch(&peer, SocketAddr::from((open_ip, 8000))).await, None);

    // An address policy: the allowed host only.
    let allow_one = format!(
        r#"{{"defaultAction":"deny","egress":[{{"action":"allow","target":"{}"}}]}}"#,
        allowed.addr()
    );
    let ruled = env_create(&mut client, policy_spec("sb-ruled", &allow_one)).await;
    assert_eq!(
        fetch(&ruled, at(allowed.addr())).await,
        Some(allowed.line())
    );
    assert_eq!(fetch(&ruled, at(other.addr())).await, None);

    // A policy change on the running sandbox.
    let allow_other = format!(
        r#"{{"defaultAction":"deny","egress":[{{"action":"allow","target":"{}/32"}}]}}"#,
        other.addr()
    );
    update_policy(&mut client, "sb-ruled", &allow_other)
        .await
        .expect("update");
    assert_eq!(fetch(&ruled, at(other.addr())).await, Some(other.line()));
    assert_eq!(fetch(&ruled, at(allowed.addr())).await, None);
    let bad = update_policy(
        &mut client,
        "sb-ruled",
        r#"{"egress":[{"action":"maybe","target":"x.com"}]}"#,
    )
    .await
    .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(
        bad.message().contains("networkPolicy.egress[0].action"),
        "{bad:?}"
    );
    let missing = update_policy(&mut client, "sb-nope", "").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    let bad_create = env_try_create(
        &mut client,
        policy_spec("sb-bad", r#"{"defaultAction":"sometimes"}"#),
    )
    .await
    .unwrap_err();
    assert_eq!(bad_create.code(), Code::InvalidArgument, "{bad_create:?}");
    assert!(
        bad_create.message().contains("defaultAction"),
        "{bad_create:?}"
    );

    // An agent restart keeps addresses, connectivity and rules.
    agent.shutdown().await;
    assert_eq!(
        fetch(&ruled, at(other.addr())).await,
        Some(other.line()),
        "while the agent is down"
    );
    let agent = Agent::start(cfg.clone()).await.expect("agent restarts");
    let mut client = client_for(&agent).await;
    let net = agent.sandboxes().network().unwrap().clone();
    assert_eq!(net.subnet(), subnet, "the same subnet comes back");
    let again = get(&mut client, "sb-ruled").await.unwrap();
    assert_eq!(again.ip_address, ruled.ip_address);
    assert_eq!(fetch(&ruled, at(other.addr())).await, Some(other.line()));
    assert_eq!(fetch(&ruled, at(allowed.addr())).await, None);
    assert_eq!(fetch(&open, at(allowed.addr())).await, Some(allowed.line()));
    assert_eq!(fetch(&peer, SocketAddr::from((open_ip, 8000))).await, None);
    assert_eq!(fetch(&open, at(metadata.extra().unwrap())).await, None);

    // Delete leaves nothing of the sandbox's network.
    let mut gone = Vec::new();
    for id in ["sb-open", "sb-peer", "sb-ruled"] {
        let member = member_of(&state, id).expect("a member file per sandbox");
        assert!(delete(&mut client, id, 0).await);
        gone.push((id, member));
    }
    for (id, member) in &gone {
        assert_eq!(
            member_leftovers(&state, &table, member),
            Vec::<String>::new(),
            "{id}"
        );
    }
    // A graceful stop with no sandbox left removes everything.
    agent.shutdown().await;
    assert_eq!(
        agent_leftovers(&state, &table, &subnet_lock(subnet)),
        Vec::<String>::new()
    );
    // host-local keeps one file per reserved address.
    let reserved: Vec<String> = std::fs::read_dir(state.join("network/ipam/sandbolt"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|f| f.parse::<Ipv4Addr>().is_ok())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(reserved, Vec::<String>::new(), "IPAM reservations left");
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

async fn client_for(agent: &sandbolt_agent::AgentHandle) -> Client {
    client(agent.grpc_addr(), TOKEN).await
}

async fn env_try_create(
    client: &mut Client,
    spec: SandboxSpec,
) -> Result<SandboxStatus, tonic::Status> {
    let resp = client.create_sandbox(create_req(spec)).await?;
    Ok(resp.into_inner().status.unwrap())
}

async fn env_create(client: &mut Client, spec: SandboxSpec) -> SandboxStatus {
    let id = spec.sandbox_id.clone();
    env_try_create(client, spec)
        .await
        .unwrap_or_else(|e| panic!("create {id}: {e:?}"))
}

#[test]
fn purge_removes_everything_an_agent_left() {
    cleaning_up(purge_removes_everything_an_agent_left_in);
}

async fn purge_removes_everything_an_agent_left_in(state: PathBuf) {
    let host = TestHost::start(DocRange::TestNet3);
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let cfg = net_agent_config(&bed, &state);
    let agent = Agent::start(cfg).await.expect("agent starts");
    let mut client = client_for(&agent).await;
    let net = agent.sandboxes().network().unwrap().clone();
    let (table, subnet) = (net.table_name().to_string(), net.subnet());
    let sb = env_create(&mut client, policy_spec("sb-kept", "")).await;
    assert_eq!(fetch(&sb, at(host.addr())).await, Some(host.line()));
    let member = member_of(&state, "sb-kept").unwrap();
    // A purge while the agent holds the subnet is refused.
    let err = network::purge(&state, Path::new(CNI_BIN_DIR)).unwrap_err();
    assert!(err.to_string().contains("held by a running agent"), "{err}");
    // The agent stops; its sandbox keeps its network (a restart would take
    // it back) until the purge.
    agent.shutdown().await;
    assert_eq!(fetch(&sb, at(host.addr())).await, Some(host.line()));
    // As when a test's temporary directory was half removed: the subnet is
    // found through the members' gateway.
    std::fs::remove_file(state.join("network/subnet")).unwrap();
    let purged = network::purge(&state, Path::new(CNI_BIN_DIR)).expect("purge");
    assert_eq!(purged.table.as_deref(), Some(table.as_str()));
    assert!(purged.namespaces >= 1, "{purged:?}");
    assert_eq!(
        member_leftovers(&state, &table, &member),
        Vec::<String>::new()
    );
    assert_eq!(
        agent_leftovers(&state, &table, &subnet_lock(subnet)),
        Vec::<String>::new()
    );
    assert!(!&state.join("network").exists());
    assert_eq!(fetch(&sb, at(host.addr())).await, None, "the veth is gone");
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn without_networking_a_policy_is_refused_never_ignored() {
    let mut env = Env::start().await;
    let deny = r#"{"defaultAction":"deny"}"#;
    let err = env
        .create(policy_spec("sb-policy", deny))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("network_policy_json"), "{err:?}");
    assert_eq!(leftovers(&env, "sb-policy"), Vec::<String>::new());
    // Allow-all is what a sandbox without networking has: accepted.
    let s = env
        .create(policy_spec("sb-plain", ""))
        .await
        .expect("create");
    assert_eq!(s.status.unwrap().ip_address, "");
    let err = update_policy(&mut env.client, "sb-plain", deny)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    update_policy(&mut env.client, "sb-plain", "{}")
        .await
        .expect("allow-all is accepted");
    assert!(env.delete_leaving_nothing("sb-plain", 0).await);
    env.shutdown().await;
}

/// Asks `server` for the A records of `name` over UDP from inside
/// `status`'s sandbox: the addresses, or the response code.
async fn resolve(
    status: &SandboxStatus,
    server: Ipv4Addr,
    name: &str,
) -> Result<Vec<Ipv4Addr>, String> {
    use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
    use hickory_proto::rr::{Name, RData, RecordType};
    let mut query = Message::new();
    query
        .set_id(4242)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(
            Name::from_ascii(format!("{name}.")).unwrap(),
            RecordType::A,
        ));
    let bytes = query.to_vec().unwrap();
    let netns = std::fs::File::open(netns_of(status)).unwrap();
    // A thread of its own: setns(2) changes the calling thread for good, and
    // a runtime thread would carry the sandbox's namespace into the agent's
    // later work (its nft and CNI commands among them).
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(query_in_netns(&netns, server, &bytes));
    });
    let answer = rx.await.unwrap()?;
    let reply = Message::from_vec(&answer).unwrap();
    if reply.response_code() != ResponseCode::NoError {
        return Err(reply.response_code().to_string());
    }
    Ok(reply
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect())
}

/// One UDP DNS exchange from inside `netns` (call on a thread of its own).
fn query_in_netns(
    netns: &std::fs::File,
    server: Ipv4Addr,
    bytes: &[u8],
) -> Result<Vec<u8>, String> {
    use std::os::fd::AsFd;
    nix::sched::setns(netns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(3)))
        .unwrap();
    sock.send_to(bytes, (server, 53))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).map_err(|e| format!("no answer: {e}"))?;
    Ok(buf[..n].to_vec())
}

#[test]
fn fqdn_policy_through_the_dns_proxy() {
    cleaning_up(fqdn_policy_through_the_dns_proxy_in);
}

async fn fqdn_policy_through_the_dns_proxy_in(state: PathBuf) {
    use sandbolt_test_support::dns::StaticDns;
    let allowed = TestHost::start(DocRange::TestNet3);
    let denied = TestHost::start(DocRange::TestNet3);
    let dns = StaticDns::start(
        [
            ("allowed.example", vec![allowed.addr()]),
            ("denied.example", vec![denied.addr()]),
        ],
        std::time::Duration::from_secs(300),
    );
    // A resolver other than the node's, for the "no other resolver" check.
    let _rogue = LineServer::start(denied.netns(), 53, "rogue resolver\n".into());
    assert!(
        TestHost::fetch_from_root(denied.addr()).is_some()
            && std::net::TcpStream::connect((denied.addr(), 53)).is_ok(),
        "control: the hosts and the rogue resolver answer the node"
    );

    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let mut cfg = net_agent_config(&bed, &state);
    cfg.network.as_mut().unwrap().dns_upstreams = vec![dns.addr()];
    let agent = Agent::start(cfg).await.expect("agent starts");
    let mut client = client_for(&agent).await;
    let gateway = agent.sandboxes().network().unwrap().gateway();

    // Default deny, one name allowed.
    let policy =
        r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"allowed.example"}]}"#;
    let sb = env_create(&mut client, policy_spec("sb-fqdn", policy)).await;
    assert_eq!(
        fetch(&sb, at(allowed.addr())).await,
        None,
        "closed until the name is resolved"
    );
    assert_eq!(
        resolve(&sb, gateway, "allowed.example").await,
        Ok(vec![allowed.addr()])
    );
    assert_eq!(fetch(&sb, at(allowed.addr())).await, Some(allowed.line()));
    assert_eq!(
        resolve(&sb, gateway, "denied.example").await,
        Err("Non-Existent Domain".to_string())
    );
    assert_eq!(
        dns.queries_for("denied.example"),
        0,
        "a denied name is answered locally"
    );
    assert_eq!(fetch(&sb, at(denied.addr())).await, None);
    // No resolver but the node's.
    assert!(!connects(&sb, SocketAddr::from((denied.addr(), 53))).await);

    // Default allow with an exact deny: the denied name's address is closed
    // even to a sandbox that never asks the proxy.
    let policy =
        r#"{"defaultAction":"allow","egress":[{"action":"deny","target":"denied.example"}]}"#;
    update_policy(&mut client, "sb-fqdn", policy)
        .await
        .expect("update");
    eventually_async("the denied name's address to close", WAIT, || async {
        fetch(&sb, at(denied.addr())).await.is_none().then_some(())
    })
    .await;
    assert_eq!(fetch(&sb, at(allowed.addr())).await, Some(allowed.line()));
    assert!(
        dns.queries_for("denied.example") >= 1,
        "the agent resolved it itself"
    );

    let member = member_of(&state, "sb-fqdn").unwrap();
    let table = agent
        .sandboxes()
        .network()
        .unwrap()
        .table_name()
        .to_string();
    assert!(delete(&mut client, "sb-fqdn", 0).await);
    assert_eq!(
        member_leftovers(&state, &table, &member),
        Vec::<String>::new()
    );
    agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

/// A crash (every agent task gone at once, nothing shut down) leaves the
/// namespaces, veths and rules; the next agent on the state dir takes the
/// sandbox's back, reuses the crashed pool, and leaves nothing once done.
#[test]
fn a_crashed_agents_network_is_taken_back() {
    cleaning_up(a_crashed_agents_network_is_taken_back_in);
}

async fn a_crashed_agents_network_is_taken_back_in(state: PathBuf) {
    let host = TestHost::start(DocRange::TestNet2);
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let cfg = net_agent_config(&bed, &state);
    let pool_size = cfg.network.as_ref().unwrap().pool_size;
    // The crash: the agent runs on a runtime of its own, which is dropped.
    let crashed_cfg = cfg.clone();
    let (sb, subnet) = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let out = rt.block_on(async {
            let agent = Agent::start(crashed_cfg).await.expect("agent starts");
            let mut client = client_for(&agent).await;
            let net = agent.sandboxes().network().unwrap().clone();
            eventually("the pool to fill", WAIT, || {
                (net.pool_members().len() == pool_size).then_some(())
            })
            .await;
            let sb = env_create(&mut client, policy_spec("sb-crash", "")).await;
            (sb, net.subnet())
        });
        drop(rt);
        out
    })
    .await
    .unwrap();
    assert_eq!(
        fetch(&sb, at(host.addr())).await,
        Some(host.line()),
        "after the crash"
    );
    let before: Vec<Member> = members(&state);

    let agent = Agent::start(cfg)
        .await
        .expect("agent restarts after the crash");
    let mut client = client_for(&agent).await;
    let net = agent.sandboxes().network().unwrap().clone();
    assert_eq!(net.subnet(), subnet);
    let status = get(&mut client, "sb-crash").await.unwrap();
    assert_eq!(status.ip_address, sb.ip_address);
    assert_eq!(fetch(&sb, at(host.addr())).await, Some(host.line()));
    // The crashed agent's prepared members are in the pool again (one
    // whose preparation the crash cut short is released instead).
    let pooled: HashSet<String> = net.pool_members().into_iter().collect();
    let crashed_pool: HashSet<String> = before
        .iter()
        .filter(|m| m.sandbox_id.is_none() && m.host_veth.is_some())
        .map(|m| m.member_id.clone())
        .collect();
    assert!(
        !crashed_pool.is_empty(),
        "the crash left a pool: {before:?}"
    );
    assert!(
        crashed_pool.is_subset(&pooled),
        "{crashed_pool:?} not all in {pooled:?}"
    );
    eventually("the pool to settle", WAIT, || {
        (members(&state).len() == pool_size + 1).then_some(())
    })
    .await;
    let table = net.table_name().to_string();
    let member = member_of(&state, "sb-crash").unwrap();
    assert!(delete(&mut client, "sb-crash", 0).await);
    agent.shutdown().await;
    assert_eq!(
        member_leftovers(&state, &table, &member),
        Vec::<String>::new()
    );
    for m in &before {
        assert_eq!(member_leftovers(&state, &table, m), Vec::<String>::new());
    }
    assert_eq!(
        agent_leftovers(&state, &table, &subnet_lock(subnet)),
        Vec::<String>::new()
    );
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

#[test]
fn a_container_removed_behind_the_agents_back_gets_its_network_released() {
    cleaning_up(a_container_removed_behind_the_agents_back_gets_its_network_released_in);
}

/// The janitor (or an operator) may remove a sandbox's container without
/// the agent's delete: its network must not stay until the agent restarts.
async fn a_container_removed_behind_the_agents_back_gets_its_network_released_in(state: PathBuf) {
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let agent = Agent::start(net_agent_config(&bed, &state))
        .await
        .expect("agent starts");
    let mut client = client_for(&agent).await;
    let table = agent
        .sandboxes()
        .network()
        .unwrap()
        .table_name()
        .to_string();
    let gone = env_create(&mut client, policy_spec("sb-reaped", "")).await;
    let kept = env_create(&mut client, policy_spec("sb-kept", "")).await;
    let gone_member = member_of(&state, "sb-reaped").expect("sb-reaped has a namespace");

    // Nothing is released while the containers exist.
    assert_eq!(agent.sandboxes().release_orphaned_networks().await, 0);

    // Removed through containerd itself, as the janitor does.
    for args in [
        &["tasks", "kill", "-s", "SIGKILL", "sb-reaped"][..],
        &["tasks", "rm", "-f", "sb-reaped"][..],
        &["containers", "rm", "sb-reaped"][..],
    ] {
        let out = bed.ctr(NS).args(args).output().unwrap();
        // The kill may race the task's exit; the removals must succeed.
        assert!(
            out.status.success() || args[1] == "kill",
            "ctr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(agent.sandboxes().release_orphaned_networks().await, 1);
    let left = member_leftovers(&state, &table, &gone_member);
    assert!(left.is_empty(), "left of sb-reaped: {left:?}");
    // The other sandbox keeps its network.
    assert!(member_of(&state, "sb-kept").is_some());
    let host = TestHost::start(DocRange::TestNet3);
    assert_eq!(fetch(&kept, at(host.addr())).await, Some(host.line()));
    assert_eq!(agent.sandboxes().release_orphaned_networks().await, 0);
    assert!(gone.pid > 0);

    delete(&mut client, "sb-kept", 1).await;
    agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

#[test]
fn a_pool_allowed_private_range_is_reachable_and_only_that_one() {
    cleaning_up(a_pool_allowed_private_range_is_reachable_and_only_that_one_in);
}

/// `--network-allow-cidr` opens one private range (an in-cluster service)
/// and nothing else of the blocked space.
async fn a_pool_allowed_private_range_is_reachable_and_only_that_one_in(state: PathBuf) {
    let allowed = TestHost::with_address(Ipv4Addr::new(10, 123, 46, 7));
    let blocked = TestHost::with_address(Ipv4Addr::new(10, 123, 47, 7));
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let mut cfg = net_agent_config(&bed, &state);
    cfg.network.as_mut().unwrap().allow_cidrs = vec!["10.123.46.0/24".parse().unwrap()];
    let agent = Agent::start(cfg).await.expect("agent starts");
    let mut client = client_for(&agent).await;
    let sb = env_create(&mut client, policy_spec("sb-allowcidr", "")).await;
    assert_eq!(
        fetch(&sb, at(allowed.extra().unwrap())).await,
        Some(allowed.line())
    );
    assert_eq!(fetch(&sb, at(blocked.extra().unwrap())).await, None);
    delete(&mut client, "sb-allowcidr", 1).await;
    agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
