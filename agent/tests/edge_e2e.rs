//! Host-path bindings, hardening and network isolation, end to end: through
//! the agent's gRPC API on the test bed's real containerd/runc, observed from
//! inside the sandbox (its log) and on the host.

use crate::common;

use std::path::Path;

use common::*;
use sandbolt_proto::agent::v1::{HostPathMount, SandboxPhase, SandboxSpec};

fn mount(host: &Path, sub: &str, at: &str, read_only: bool) -> HostPathMount {
    HostPathMount {
        host_path: host.display().to_string(),
        sub_path: sub.into(),
        mount_path: at.into(),
        read_only,
    }
}

/// Waits until the sandbox's log contains `marker`, then returns the log.
async fn log_until(env: &Env, id: &str, marker: &str) -> String {
    let path = env.log_path(id);
    eventually(&format!("{marker:?} in the log of {id}"), WAIT, || {
        std::fs::read_to_string(&path)
            .ok()
            .filter(|t| t.contains(marker))
    })
    .await
}

async fn create(env: &mut Env, spec: SandboxSpec) -> Result<u32, tonic::Status> {
    let resp = env
        .client
        .create_sandbox(create_req(spec))
        .await?
        .into_inner();
    let status = resp.status.expect("create answers a status");
    assert_eq!(status.phase(), SandboxPhase::Running, "{status:?}");
    Ok(status.pid)
}

/// An allowlisted root with `ro/` (holding a file) and `rw/task-1/`.
fn volume_root() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join("ro")).unwrap();
    std::fs::write(root.join("ro/seed.txt"), "seeded-by-host\n").unwrap();
    std::fs::create_dir_all(root.join("rw/task-1")).unwrap();
    (tmp, root)
}

#[tokio::test(flavor = "multi_thread")]
async fn edge_e2e_ro_and_rw_bindings() {
    let (_tmp, root) = volume_root();
    // A filesystem mounted below a read-only binding is read-only inside
    // too: the agent makes the whole tree read-only (mount_setattr with
    // AT_RECURSIVE), not only its top, as runc 1.1's rbind remount did.
    std::fs::create_dir_all(root.join("ro/sub")).unwrap();
    let _submount = TmpfsMount::new(&root.join("ro/sub"));
    let allow = root.clone();
    let mut env = Env::start_with(move |cfg| cfg.allowed_host_paths = vec![allow]).await;

    let script = r#"
        cat /data/ro/seed.txt
        if echo x > /data/ro/new.txt 2>/tmp/ro-err; then echo RO=writable; else echo "RO=denied: $(cat /tmp/ro-err)"; fi
        if rm /data/ro/seed.txt 2>/dev/null; then echo RO-RM=allowed; else echo RO-RM=denied; fi
        if echo x > /data/ro/sub/new.txt 2>/dev/null; then echo RO-SUB=writable; else echo RO-SUB=denied; fi
        echo from-the-sandbox > /data/rw/written.txt && echo RW=ok
        ln -s /etc /data/rw/evil-abs
        ln -s ../../.. /data/rw/evil-up
        echo BINDINGS-DONE
        exec sleep 100000
    "#;
    let mut s = spec("sb-bind", &["sh", "-c", script]);
    s.host_mounts = vec![
        mount(&root.join("ro"), "", "/data/ro", true),
        mount(&root.join("rw"), "task-1", "/data/rw", false),
    ];
    create(&mut env, s)
        .await
        .expect("create with valid bindings");
    let log = log_until(&env, "sb-bind", "BINDINGS-DONE").await;

    // RO: readable, not writable, nothing changed on the host.
    assert!(log.contains("seeded-by-host"), "{log}");
    assert!(
        log.contains("RO=denied"),
        "a write to a read-only binding must fail:\n{log}"
    );
    assert!(log.contains("Read-only file system"), "{log}");
    assert!(log.contains("RO-RM=denied"), "{log}");
    assert!(
        log.contains("RO-SUB=denied"),
        "a filesystem below a read-only binding must be read-only too:\n{log}"
    );
    assert!(!root.join("ro/sub/new.txt").exists());
    assert!(!root.join("ro/new.txt").exists());
    assert_eq!(
        std::fs::read_to_string(root.join("ro/seed.txt")).unwrap(),
        "seeded-by-host\n"
    );

    // RW: the sandbox's data lands in the sub-path directory on the host.
    assert!(log.contains("RW=ok"), "{log}");
    assert_eq!(
        std::fs::read_to_string(root.join("rw/task-1/written.txt")).unwrap(),
        "from-the-sandbox\n"
    );

    // Symlinks planted by that sandbox cannot carry the next binding out of
    // the allowlisted root.
    for planted in ["task-1/evil-abs", "task-1/evil-up"] {
        let mut s2 = spec("sb-bind-evil", &["sleep", "100000"]);
        s2.host_mounts = vec![mount(&root.join("rw"), planted, "/data", false)];
        let err = create(&mut env, s2)
            .await
            .expect_err("a planted symlink must not escape");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(
            err.message().contains("outside its allowlisted root"),
            "{planted}: {}",
            err.message()
        );
    }

    // Delete removes the sandbox, never the host data.
    delete(&mut env.client, "sb-bind", 200).await;
    assert_eq!(leftovers(&env, "sb-bind"), Vec::<String>::new());
    assert!(root.join("rw/task-1/written.txt").exists());
    assert!(root.join("ro/seed.txt").exists());
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn edge_e2e_rejected_bindings_are_clear_errors() {
    let (_tmp, root) = volume_root();
    std::fs::write(root.join("file.txt"), "not a dir").unwrap();
    std::os::unix::fs::symlink("/etc", root.join("to-etc")).unwrap();
    std::os::unix::fs::symlink("..", root.join("to-parent")).unwrap();
    let allow = root.clone();
    let mut env = Env::start_with(move |cfg| cfg.allowed_host_paths = vec![allow]).await;

    let r = root.display().to_string();
    let cases: Vec<(&str, HostPathMount, &str)> = vec![
        (
            "relative host path",
            HostPathMount {
                host_path: "data/x".into(),
                sub_path: "".into(),
                mount_path: "/d".into(),
                read_only: true,
            },
            "must be absolute",
        ),
        (
            "dot-dot host path",
            HostPathMount {
                host_path: format!("{r}/rw/../ro"),
                sub_path: "".into(),
                mount_path: "/d".into(),
                read_only: true,
            },
            "\"..\"",
        ),
        (
            "absolute subPath",
            mount(&root.join("rw"), "/etc", "/d", true),
            "must be relative",
        ),
        (
            "dot-dot subPath",
            mount(&root.join("rw"), "task-1/../..", "/d", true),
            "must not contain \"..\"",
        ),
        (
            "outside the allowlist",
            mount(Path::new("/etc"), "", "/d", true),
            "not inside any allowlisted root",
        ),
        (
            "missing directory",
            mount(&root.join("rw"), "task-2", "/d", true),
            "does not exist",
        ),
        (
            "file, not a directory",
            mount(&root.join("file.txt"), "", "/d", true),
            "is not a directory",
        ),
        (
            "symlink to /etc",
            mount(&root.join("to-etc"), "", "/d", true),
            "outside its allowlisted root",
        ),
        (
            "symlink to ..",
            mount(&root, "to-parent", "/d", true),
            "outside its allowlisted root",
        ),
        (
            "mount over /proc",
            mount(&root.join("rw"), "", "/proc/x", true),
            "/proc",
        ),
        (
            "mount over execd",
            mount(&root.join("rw"), "", "/opt/sandbolt", true),
            "/opt/sandbolt",
        ),
    ];
    for (i, (what, m, needle)) in cases.into_iter().enumerate() {
        let id = format!("sb-reject-{i}");
        let mut s = spec(&id, &["sleep", "100000"]);
        s.host_mounts = vec![m];
        let err = create(&mut env, s).await.expect_err(what);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{what}: {:?} lacks {needle:?}",
            err.message()
        );
        assert_eq!(
            leftovers(&env, &id),
            Vec::<String>::new(),
            "{what}: a rejected create leaves nothing"
        );
    }
    // Nothing was created on the host by any of them.
    assert!(!root.join("rw/task-2").exists());
    env.shutdown().await;
}

/// A tmpfs mounted for the test; unmounted on drop (also on failure).
struct TmpfsMount(std::path::PathBuf);

impl TmpfsMount {
    fn new(at: &Path) -> TmpfsMount {
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "sandbolt-edge-e2e"])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount tmpfs at {}", at.display());
        TmpfsMount(at.to_path_buf())
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// The host's first global IPv4 address (the agent listens on it too).
fn host_ipv4() -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("ip addr");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .map(str::to_string)
        .expect("this test needs a global IPv4 address on the host")
}

#[tokio::test(flavor = "multi_thread")]
async fn edge_e2e_sandbox_cannot_reach_the_agent() {
    let mut env = Env::start_with(|cfg| {
        // Listen on every interface: the strongest case for isolation.
        cfg.grpc_listen = "0.0.0.0:0".parse().unwrap();
        cfg.proxy_listen = "0.0.0.0:0".parse().unwrap();
    })
    .await;
    let grpc = env.agent().grpc_addr().port();
    let proxy = env.agent().proxy_addr().port();
    let ip = host_ipv4();
    // Control: from the host, the agent is reachable on that address.
    for port in [grpc, proxy] {
        tokio::net::TcpStream::connect((ip.as_str(), port))
            .await
            .unwrap_or_else(|e| {
                panic!("agent must be reachable from the host on {ip}:{port}: {e}")
            });
    }

    let mut targets = vec![];
    for addr in ["127.0.0.1", ip.as_str()] {
        for port in [grpc, proxy] {
            targets.push(format!("{addr}:{port}"));
        }
    }
    let script = format!(
        r#"
        # Control, same tool: nc reaches the sandbox's own execd. (busybox
        # wget segfaults in containers on this host, with or without seccomp.)
        # The entrypoint starts alongside execd: wait until it listens.
        for i in $(seq 1 50); do
            control=$(printf 'GET /ping HTTP/1.0\r\n\r\n' | timeout 10 nc -w 3 127.0.0.1 44772 | head -n 1)
            case "$control" in *200*) break ;; esac
            sleep 0.1
        done
        echo "CONTROL $control"
        for t in {}; do
            out=$(timeout 10 nc -w 3 ${{t%:*}} ${{t#*:}} </dev/null 2>&1); echo "TARGET $t rc=$? $out"
        done
        echo NET-DONE
        exec sleep 100000
    "#,
        targets.join(" ")
    );
    let mut s = spec("sb-net", &["sh", "-c", &script]);
    s.wait_for_execd = true;
    let pid = create(&mut env, s).await.expect("create");
    let log = log_until(&env, "sb-net", "NET-DONE").await;

    // The probe works: the sandbox's own execd is reachable from inside.
    assert!(log.contains("CONTROL HTTP/1.0 200"), "{log}");
    for t in &targets {
        let line = log
            .lines()
            .find(|l| l.starts_with(&format!("TARGET {t} ")))
            .unwrap_or_else(|| panic!("no probe result for {t}:\n{log}"));
        assert!(
            line.contains("rc=1"),
            "the sandbox reached the agent at {t}: {line}"
        );
        assert!(
            line.contains("Connection refused") || line.contains("Network is unreachable"),
            "{t}: {line}"
        );
    }

    // And the proxy does lead into the sandbox, with its token only.
    let url = "/sb-net/44772/ping".to_string();
    let status = |token: &'static str| {
        let addr = env.agent().proxy_addr();
        let url = url.clone();
        async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut send, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let req = http::Request::get(url)
                .header("host", addr.to_string())
                .header(sandbolt_agent::proxy::TOKEN_HEADER, token)
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            send.send_request(req).await.unwrap().status()
        }
    };
    assert_eq!(status("token-sb-net").await, http::StatusCode::OK);
    assert_eq!(status("token-other").await, http::StatusCode::UNAUTHORIZED);
    assert!(pid > 0);

    delete(&mut env.client, "sb-net", 200).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn edge_e2e_hardening_visible_inside() {
    let mut env = Env::start().await;
    let script = r#"
        grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status
        echo "TIMER_LIST=$(wc -c < /proc/timer_list) KEYS=$(wc -c < /proc/keys) FIRMWARE=$(ls -A /sys/firmware | wc -l)"
        if echo 1 > /proc/sys/vm/drop_caches 2>/dev/null; then echo PROCSYS=writable; else echo PROCSYS=readonly; fi
        if unshare -n true 2>/dev/null; then echo UNSHARE=allowed; else echo UNSHARE=denied; fi
        if mount -t tmpfs none /mnt 2>/dev/null; then echo MOUNT=allowed; else echo MOUNT=denied; fi
        if chroot / true; then echo CHROOT=allowed; else echo CHROOT=denied; fi
        echo HARDEN-DONE
        exec sleep 100000
    "#;
    create(&mut env, spec("sb-harden", &["sh", "-c", script]))
        .await
        .expect("create");
    let log = log_until(&env, "sb-harden", "HARDEN-DONE").await;
    let field = |name: &str| {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{name} missing:\n{log}"))
            .to_string()
    };
    // Docker's default set: CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID
    // SETUID SETPCAP NET_BIND_SERVICE NET_RAW SYS_CHROOT MKNOD AUDIT_WRITE SETFCAP.
    let docker_default = "00000000a80425fb";
    assert_eq!(field("CapBnd"), docker_default);
    assert_eq!(field("CapEff"), docker_default);
    assert_eq!(field("CapPrm"), docker_default);
    assert_eq!(field("CapInh"), "0000000000000000");
    assert_eq!(field("CapAmb"), "0000000000000000");
    assert_eq!(field("NoNewPrivs"), "1");
    assert_eq!(field("Seccomp"), "2", "seccomp filter mode");
    // Masked paths (those this kernel has: it lacks /proc/kcore) read as
    // empty inside, while the host's are not.
    for (host, what) in [
        ("/proc/timer_list", "timer list"),
        ("/proc/keys", "keyring list"),
    ] {
        assert!(
            !std::fs::read(host).unwrap().is_empty(),
            "host {what} is non-empty (control)"
        );
    }
    assert!(std::fs::read_dir("/sys/firmware").unwrap().next().is_some());
    assert!(
        log.contains("TIMER_LIST=0 KEYS=0 FIRMWARE=0"),
        "masked paths must be empty inside:\n{log}"
    );
    assert!(log.contains("PROCSYS=readonly"), "{log}");
    assert!(log.contains("UNSHARE=denied"), "{log}");
    assert!(log.contains("MOUNT=denied"), "{log}");
    assert!(
        log.contains("CHROOT=allowed"),
        "CAP_SYS_CHROOT is in the default set:\n{log}"
    );
    delete(&mut env.client, "sb-harden", 200).await;
    env.shutdown().await;
}
