//! The proxy dials a sandbox through the network namespace it held open
//! since the sandbox's task started, never through a PID.
//!
//! `pid_reuse_never_reaches_the_new_process` forces the kernel to hand a
//! dead sandbox process's PID to a new process in another namespace
//! (`/proc/sys/kernel/ns_last_pid`: we are root in the initial PID
//! namespace) and shows that `/proc/<pid>/ns/net` — what the proxy used to
//! enter — now leads to the newcomer, while the route keeps reaching only
//! the old sandbox's namespace. The end-to-end tests run the real agent on
//! the test bed's containerd: the proxy reaches a sandbox, still after an
//! agent restart (the handle is opened again on recovery), and stops
//! routing once the sandbox's process exits.

use crate::common;

use std::fs::File;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use common::*;
use http::StatusCode;
use sandbolt_agent::config::NetworkConfig;
use sandbolt_agent::proxy::{self, NetnsHandle, Route, SandboxLookup};
use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_proto::agent::v1::SandboxPhase;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SANDBOX_TOKEN: &str = "token-of-sandbox-a";

/// A fresh network namespace with loopback up and a listener on
/// `127.0.0.1:port` (0: any) in it; returns the namespace's file and the
/// listener.
fn netns_with_listener(port: u16) -> (File, std::net::TcpListener) {
    std::thread::spawn(move || {
        // This thread alone moves; it exits right after.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        // A child forked from this thread starts in its namespace.
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("run `ip link set lo up`");
        assert!(up.success());
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        let ns = File::open("/proc/thread-self/ns/net").unwrap();
        (ns, listener)
    })
    .join()
    .unwrap()
}

/// Answers every HTTP request on `listener` with `who`.
async fn answer(listener: std::net::TcpListener, who: &'static str) {
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    loop {
        let (mut s, _) = listener.accept().await.unwrap();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 512];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{who}",
                who.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

/// `sleep` in namespace `ns` (a stand-in for a sandbox's init process).
fn spawn_in(ns: &File) -> Child {
    let fd = ns.as_raw_fd();
    let mut cmd = Command::new("sleep");
    cmd.arg("100000").stdin(Stdio::null());
    // SAFETY: setns(2) is async-signal-safe; nothing else runs after fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().expect("spawn sleep")
}

/// A process in `ns` that has PID `pid`: the kernel is told the last PID
/// it gave out was `pid - 1`, then a process is forked. Other processes on
/// the node fork too and may take it first: tried until it lands.
fn spawn_with_pid(pid: u32, ns: &File) -> Child {
    for _ in 0..1000 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("write /proc/sys/kernel/ns_last_pid (needs root in the initial PID namespace)");
        let mut child = spawn_in(ns);
        if child.id() == pid {
            return child;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("could not get PID {pid} reused in 1000 tries");
}

fn inode(f: &File) -> u64 {
    f.metadata().unwrap().ino()
}

/// What the proxy did before it held namespaces: enter `/proc/<pid>/ns/net`
/// of the route's PID at dial time and connect there. Returns the body.
fn dial_by_pid_as_before(pid: u32, port: u16) -> String {
    std::thread::spawn(move || {
        let ns = File::open(format!("/proc/{pid}/ns/net")).unwrap();
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.rsplit("\r\n\r\n").next().unwrap().to_string()
    })
    .join()
    .unwrap()
}

struct Table(Vec<(String, Route)>);

impl SandboxLookup for Table {
    fn lookup(&self, sandbox_id: &str) -> Option<Route> {
        let found = self.0.iter().find(|(id, _)| id == sandbox_id);
        found.map(|(_, r)| r.clone())
    }
}

/// `GET path` through the proxy at `addr` with `token`.
async fn get(addr: SocketAddr, path: &str, token: &str) -> (StatusCode, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", addr.to_string())
        .header(proxy::TOKEN_HEADER, token)
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pid_reuse_never_reaches_the_new_process() {
    // Sandbox A: namespace NA, whose server answers "A"; B's namespace NB
    // has a server on the same port answering "B".
    let (na, listener_a) = netns_with_listener(0);
    let port = listener_a.local_addr().unwrap().port();
    let (nb, listener_b) = netns_with_listener(port);
    let serve_a = tokio::spawn(answer(listener_a, "A"));
    let serve_b = tokio::spawn(answer(listener_b, "B"));

    // A's process, and the route the agent holds for A: opened while A runs.
    let mut a = spawn_in(&na);
    let pid = a.id();
    let handle = Arc::new(NetnsHandle::of_process(pid).unwrap());
    assert_eq!(handle.inode(), inode(&na));
    let route = Route {
        upstream: proxy::Upstream::Namespace(handle.clone()),
        token_sha256: Sha256::digest(SANDBOX_TOKEN.as_bytes()).into(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let table = Arc::new(Table(vec![("sb-a".into(), route)]));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(proxy::serve(listener, table, async move {
        let _ = stopped.await;
    }));
    let url = format!("/sb-a/{port}/");
    assert_eq!(
        get(addr, &url, SANDBOX_TOKEN).await,
        (StatusCode::OK, "A".into())
    );

    // A exits (and is reaped); its PID goes to B, in NB.
    a.kill().unwrap();
    a.wait().unwrap();
    let mut b = tokio::task::spawn_blocking({
        let nb = nb.try_clone().unwrap();
        move || spawn_with_pid(pid, &nb)
    })
    .await
    .unwrap();
    assert_eq!(b.id(), pid, "B has A's old PID");
    let now = std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap();
    assert_eq!(now.ino(), inode(&nb), "A's PID now leads into NB");
    // The old proxy entered /proc/<route pid>/ns/net when it dialled: that
    // now reaches B, another sandbox.
    assert_eq!(
        tokio::task::spawn_blocking(move || dial_by_pid_as_before(pid, port))
            .await
            .unwrap(),
        "B"
    );

    // The route's handle still names NA: the proxy reaches A's server.
    assert_eq!(
        get(addr, &url, SANDBOX_TOKEN).await,
        (StatusCode::OK, "A".into())
    );
    // Once nothing listens in NA any more, the dial fails; it never falls
    // through to B (or to the host, where the proxy itself listens).
    serve_a.abort();
    let _ = serve_a.await;
    let (status, body) = get(addr, &url, SANDBOX_TOKEN).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("nothing is listening"), "{body}");
    let (status, body) = get(addr, &format!("/sb-a/{}/", addr.port()), SANDBOX_TOKEN).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");

    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
    serve_b.abort();
    b.kill().unwrap();
    b.wait().unwrap();
}

/// `GET /<id>/<execd port>/ping` through the agent's proxy.
async fn ping_through_proxy(agent: &AgentHandle, id: &str) -> StatusCode {
    let path = format!("/{id}/{}/ping", sandbolt_proto::wire::EXECD_PORT);
    get(agent.proxy_addr(), &path, &format!("token-{id}"))
        .await
        .0
}

/// The namespace the agent's table routes `id` through, as an inode.
fn routed_inode(agent: &AgentHandle, id: &str) -> Option<u64> {
    let sandboxes: &dyn SandboxLookup = agent.sandboxes().as_ref();
    sandboxes.lookup(id).map(|r| match r.upstream {
        proxy::Upstream::Namespace(netns) => netns.inode(),
        proxy::Upstream::Address(ip) => panic!("runc sandbox {id} routed by address {ip}"),
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn pid_reuse_proxy_to_a_real_sandbox_across_an_agent_restart() {
    let mut env = Env::start().await;
    let id = "sb-pidfd";
    let mut s = sh_spec(id, "exec sleep 100000");
    s.wait_for_execd = true;
    let status = env.create(s).await.unwrap().status.unwrap();
    assert_eq!(status.phase(), SandboxPhase::Running);
    let ns = std::fs::metadata(format!("/proc/{}/ns/net", status.pid)).unwrap();
    assert_eq!(routed_inode(env.agent(), id), Some(ns.ino()));
    assert_eq!(ping_through_proxy(env.agent(), id).await, StatusCode::OK);

    // A restarted agent opens the namespace again from the recovered task.
    env.restart_agent(|_| {}).await;
    assert_eq!(routed_inode(env.agent(), id), Some(ns.ino()));
    assert_eq!(ping_through_proxy(env.agent(), id).await, StatusCode::OK);

    // The sandbox's process exits: the handle is dropped, nothing routes.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(status.pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for_phase(&env.client, id, SandboxPhase::Failed).await;
    assert_eq!(routed_inode(env.agent(), id), None);
    assert_eq!(
        ping_through_proxy(env.agent(), id).await,
        StatusCode::NOT_FOUND
    );

    assert!(env.delete_leaving_nothing(id, 0).await);
    env.shutdown().await;
}

const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// With sandbox networking the handle is the namespace file the agent
/// bind-mounted (no PID involved); a restarted agent routes again.
#[test]
fn pid_reuse_proxy_through_the_bind_mounted_namespace() {
    let state = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let path = state.path().to_path_buf();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(proxy_through_the_bind_mounted_namespace(path))
    }));
    // Stops every agent task before a failed run's network is purged.
    rt.shutdown_timeout(std::time::Duration::from_secs(10));
    if let Err(panic) = outcome {
        if let Err(e) = sandbolt_agent::network::purge(state.path(), Path::new(CNI_BIN_DIR)) {
            eprintln!("purge after the failed test: {e}");
        }
        std::panic::resume_unwind(panic);
    }
}

async fn proxy_through_the_bind_mounted_namespace(state: PathBuf) {
    let bed = tokio::task::spawn_blocking(bed).await.unwrap();
    let mut cfg = config(&bed, &state, "agent-netns-handle");
    let mut net = NetworkConfig::new(vec!["127.0.0.1:9".parse().unwrap()]);
    net.pool_size = 1;
    cfg.network = Some(net);
    let agent = Agent::start(cfg.clone()).await.expect("agent starts");
    let mut grpc = client(agent.grpc_addr(), TOKEN).await;
    let id = "sb-netfile";
    let mut s = sh_spec(id, "exec sleep 100000");
    s.wait_for_execd = true;
    grpc.create_sandbox(create_req(s)).await.expect("create");
    let file = agent
        .sandboxes()
        .network()
        .unwrap()
        .attachment(id)
        .expect("a network attachment")
        .netns_path;
    let file_ino = std::fs::metadata(&file).unwrap().ino();
    assert_eq!(routed_inode(&agent, id), Some(file_ino), "{file:?}");
    assert_eq!(ping_through_proxy(&agent, id).await, StatusCode::OK);

    agent.shutdown().await;
    let agent = Agent::start(cfg).await.expect("restarted agent starts");
    let mut grpc = client(agent.grpc_addr(), TOKEN).await;
    assert_eq!(routed_inode(&agent, id), Some(file_ino));
    assert_eq!(ping_through_proxy(&agent, id).await, StatusCode::OK);

    assert!(delete(&mut grpc, id, 0).await);
    assert_eq!(routed_inode(&agent, id), None);
    agent.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
