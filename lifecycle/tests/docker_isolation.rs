//! Isolation of the Docker backend on a real dockerd: sandboxes reach the
//! outside (a test host) but not each other, not cloud metadata
//! (169.254.169.254) and not the node's own addresses. Every negative check
//! has a control that shows the target answers from the root namespace.

use crate::common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::call;
use sandbolt_proto::wire::EXECD_PORT;
use sandbolt_test_support::nethost::{DocRange, PORT, TestHost};
use serde_json::{Value, json};

/// Connects from inside the sandbox whose init is `pid` to `addr`, sends
/// `send`, and returns what came back (empty when nothing connected).
fn nc_from_sandbox(pid: i64, addr: SocketAddr, send: &str) -> String {
    let mut child = Command::new("nsenter")
        .args([
            "-t",
            &pid.to_string(),
            "-n",
            "-m",
            "--",
            "/bin/busybox",
            "nc",
        ])
        .args(["-w", "2", &addr.ip().to_string(), &addr.port().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("nsenter runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(send.as_bytes())
        .unwrap();
    let out = child.wait_with_output().expect("nc finishes");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The same exchange from the root namespace: the control.
fn exchange_from_root(addr: SocketAddr, send: &str) -> String {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return String::new();
    };
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.write_all(send.as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

async fn create_sandbox(base: &str, image: &str) -> String {
    let (s, v) = call(
        reqwest::Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "infinity"],
            "resourceLimits": {},
        })),
    )
    .await;
    assert!(s.is_success(), "create: {s} {v}");
    v["id"].as_str().expect("sandbox id").to_string()
}

fn network_of(c: &Value) -> &Value {
    &c["NetworkSettings"]["Networks"]["sandbolt"]
}

/// A root-namespace server on every address that writes one line.
fn host_server() -> (u16, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            if s.write_all(b"node-port\n").is_err() {
                continue;
            }
            // The test's last connection tells the server to stop.
            if s.peer_addr().is_ok_and(|p| p.ip().is_loopback()) {
                break;
            }
        }
    });
    (port, t)
}

const HTTP_PING: &str = "GET /ping HTTP/1.0\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_sandboxes_are_isolated() {
    common::init_tracing();
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    let bridge = env.sandbox_bridge();
    let subnet = env.sandbox_subnet();

    let tables = String::from_utf8(
        Command::new("nft")
            .args(["list", "tables"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let table = sandbolt_lifecycle::docker_network::table_name(&bridge);
    assert!(
        tables.contains(&format!("table inet {table}"))
            && tables.contains(&format!("table bridge {table}")),
        "isolation tables installed at start: {tables}"
    );

    let a = create_sandbox(&base, &env.image).await;
    let b = create_sandbox(&base, &env.image).await;
    let (ca, cb) = (env.inspect(&a), env.inspect(&b));
    assert_eq!(ca["HostConfig"]["NetworkMode"], "sandbolt", "{ca}");
    let pid_a = ca["State"]["Pid"].as_i64().expect("sandbox A runs");
    let ip_b: Ipv4Addr = network_of(&cb)["IPAddress"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let gateway: Ipv4Addr = network_of(&ca)["Gateway"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let prefix = subnet.trim_end_matches("0/24");
    assert!(ip_b.to_string().starts_with(prefix), "{ip_b} in {subnet}");

    // Egress works: the negative checks below are not vacuous.
    let outside = TestHost::start(DocRange::TestNet2);
    let got = nc_from_sandbox(pid_a, (outside.addr(), PORT).into(), "");
    assert_eq!(got, outside.line(), "sandbox A reaches a test host");

    // Sandbox B's execd answers the node, not sandbox A.
    let execd_b = SocketAddr::from((ip_b, EXECD_PORT));
    assert!(
        exchange_from_root(execd_b, HTTP_PING).starts_with("HTTP/1."),
        "control: B's execd answers from the root namespace"
    );
    let got = nc_from_sandbox(pid_a, execd_b, HTTP_PING);
    assert!(
        got.is_empty(),
        "sandbox A reached sandbox B's execd: {got:?}"
    );

    // Cloud metadata stand-in.
    let metadata = Ipv4Addr::new(169, 254, 169, 254);
    let meta_host = TestHost::with_address(metadata);
    assert_eq!(
        TestHost::fetch_from_root(metadata),
        Some(meta_host.line()),
        "control: the metadata stand-in answers from the root namespace"
    );
    let got = nc_from_sandbox(pid_a, (metadata, PORT).into(), "");
    assert!(got.is_empty(), "sandbox A reached {metadata}: {got:?}");

    // The node itself, on its address on the sandbox network.
    let (port, server) = host_server();
    let node = SocketAddr::from((gateway, port));
    assert_eq!(
        exchange_from_root(node, ""),
        "node-port\n",
        "control: node port answers"
    );
    let got = nc_from_sandbox(pid_a, node, "");
    assert!(
        got.is_empty(),
        "sandbox A reached the node at {node}: {got:?}"
    );
    exchange_from_root(SocketAddr::from((Ipv4Addr::LOCALHOST, port)), "");
    server.join().unwrap();

    for id in [&a, &b] {
        let (s, v) = call(
            reqwest::Method::DELETE,
            format!("{base}/v1/sandboxes/{id}"),
            None,
        )
        .await;
        assert!(s.is_success(), "delete {id}: {s} {v}");
    }
    h.shutdown().await.unwrap();
    drop(env);
    let tables = String::from_utf8(
        Command::new("nft")
            .args(["list", "tables"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(
        !tables.contains(&table),
        "isolation tables removed: {tables}"
    );
    assert!(
        !std::path::Path::new("/sys/class/net")
            .join(&bridge)
            .exists(),
        "sandbox bridge {bridge} removed"
    );
}

/// A sandbox network that exists with another subnet is refused by name
/// rather than silently used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_subnet_is_refused() {
    let env = common::docker_env();
    let h = env.start().await;
    h.shutdown().await.unwrap();
    let mut config = env.config();
    if let sandbolt_lifecycle::BackendConfig::Docker(d) = &mut config.backend {
        d.network_subnet = Some("10.215.0.0/24".into());
    }
    let e = sandbolt_lifecycle::Lifecycle::start(config)
        .await
        .err()
        .expect("a different subnet is refused");
    assert!(
        e.to_string().contains("network_subnet 10.215.0.0/24"),
        "{e}"
    );
}
