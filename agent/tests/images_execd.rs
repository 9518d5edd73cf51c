//! The real execd as PID 1 answering `/ping` (through the agent's setns dial
//! and through the data-plane proxy), and image import over containerd's
//! content + images API.

use crate::common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;
use sandbolt_proto::agent::v1::{GetInventoryRequest, SandboxPhase};
use sandbolt_testbed::OciImage;

/// A plain HTTP/1.1 GET; returns (status, body).
fn http_get(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, out)
}

#[tokio::test(flavor = "multi_thread")]
async fn real_execd_is_pid1_and_answers_ping_directly_and_through_the_proxy() {
    let mut env = Env::start().await;
    let mut s = sh_spec(
        "sb-execd",
        "echo pid1=$(tr '\\0' ' ' < /proc/1/cmdline); exec sleep 1000",
    );
    s.wait_for_execd = true;
    let resp = env.create(s).await.expect("create with wait_for_execd");
    let t = resp.timings.unwrap();
    assert!(
        t.execd_ready_us >= t.task_started_us && t.execd_ready_us > 0,
        "answered only after execd's /ping: {t:?}"
    );
    assert_eq!(resp.status.unwrap().phase(), SandboxPhase::Running);

    let log = eventually("PID 1's command line", WAIT, || {
        std::fs::read_to_string(env.log_path("sb-execd"))
            .ok()
            .filter(|l| l.contains("pid1="))
    })
    .await;
    assert!(
        log.contains("pid1=/opt/sandbolt/execd --init --exit-with-entrypoint -- sh -c"),
        "{log}"
    );

    // Through the data-plane proxy, with the sandbox's token.
    let proxy = env.agent().proxy_addr();
    let (code, body) = tokio::task::spawn_blocking(move || {
        http_get(
            proxy,
            "/sb-execd/44772/ping",
            &[("X-Sandbolt-Access-Token", "token-sb-execd")],
        )
    })
    .await
    .unwrap();
    assert_eq!(code, 200, "{body}");
    // Without the token: refused by the proxy.
    let (code, body) =
        tokio::task::spawn_blocking(move || http_get(proxy, "/sb-execd/44772/ping", &[]))
            .await
            .unwrap();
    assert!(code == 401 || code == 403, "{code}: {body}");
    // execd itself is not reachable from the host's network namespace.
    assert!(
        std::net::TcpStream::connect_timeout(
            &"127.0.0.1:44772".parse().unwrap(),
            Duration::from_millis(500)
        )
        .is_err(),
        "execd must live only inside the sandbox's namespace"
    );

    env.delete_leaving_nothing("sb-execd", 2000).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn oci_tarball_import_over_the_api_then_run() {
    let mut env = Env::start().await;
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("img.tar");
    let busybox = std::path::Path::new("/bin/busybox");
    let image = OciImage::builder("docker.io/sandbolt/imported:v1")
        .file(busybox, "/bin/busybox", 0o755)
        .symlink("/bin/sh", "/bin/busybox")
        .symlink("/bin/cat", "/bin/busybox")
        .symlink("/bin/sleep", "/bin/busybox")
        .bytes("/etc/motd", "imported-image-content\n", 0o644)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .dir("/tmp")
        .entrypoint(["/bin/sh", "-c"])
        .cmd(["cat /etc/motd; exec sleep 1000"])
        .build()
        .unwrap();
    image.write_oci_archive(&archive).unwrap();

    let names = env
        .agent()
        .sandboxes()
        .images
        .import_oci_tar(&archive, None)
        .await
        .expect("import over the content + images API");
    assert_eq!(names, vec!["docker.io/sandbolt/imported:v1".to_string()]);
    // Importing again is harmless.
    env.agent()
        .sandboxes()
        .images
        .import_oci_tar(&archive, None)
        .await
        .expect("re-import");

    let inv = env
        .client
        .get_inventory(GetInventoryRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        inv.images.iter().any(|i| i
            .references
            .contains(&"docker.io/sandbolt/imported:v1".to_string())),
        "{:?}",
        inv.images
    );

    // The image's own entrypoint + cmd run (no command in the request), the
    // short name resolves through normalization.
    let mut s = spec("sb-imported", &[]);
    s.image = "sandbolt/imported:v1".into();
    env.client
        .create_sandbox(create_req(s))
        .await
        .expect("create from imported image");
    eventually("imported file printed", WAIT, || {
        std::fs::read_to_string(env.log_path("sb-imported"))
            .ok()
            .filter(|l| l.contains("imported-image-content"))
    })
    .await;
    // The unpacked layer is a committed snapshot named by the chain id
    // (single layer: the diff id).
    let snaps = env.ctr(&["snapshots", "--snapshotter", "overlayfs", "list"]);
    assert!(snaps.contains(&image.diff_id()), "{snaps}");

    env.delete_leaving_nothing("sb-imported", 0).await;
    env.shutdown().await;
}
