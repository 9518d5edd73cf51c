//! `sandbolt up` end to end: the real binary on the test bed's containerd,
//! driven by the official OpenSandbox SDK through its lifecycle API and by a
//! FastPath v2 gRPC client, then stopped with SIGTERM. Three starts on one
//! data dir: a generated token, the same token kept across a restart (with
//! permissions an operator loosened tightened again), and an explicit token.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_proto::control::v1 as native;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2 as fastpath;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_test_support::{Proc, free_port};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary, python, workspace_root};

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

struct Ports {
    fastpath: u16,
    lifecycle: u16,
    agent: u16,
    proxy: u16,
}

/// Starts `sandbolt up` and waits for its "sandbolt is up" log line (it
/// logs where every API listens).
fn start_up(bed: &Testbed, state: &Path, ports: &Ports, log_path: &Path, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    cmd.arg("up")
        .arg("--data-dir")
        .arg(state)
        .arg("--runtime")
        .arg("containerd")
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .arg("--execd-bin")
        .arg(execd_binary().unwrap())
        .args([
            "--fastpath-listen",
            &format!("127.0.0.1:{}", ports.fastpath),
        ])
        .args([
            "--lifecycle-listen",
            &format!("127.0.0.1:{}", ports.lifecycle),
        ])
        .args(["--agent-listen", &format!("127.0.0.1:{}", ports.agent)])
        .args(["--proxy-listen", &format!("127.0.0.1:{}", ports.proxy)])
        .args(["--api-key", "up-test-key", "--janitor-interval", "2s"])
        .args(extra)
        .env_remove("SANDBOLT_FASTPATH_TOKEN");
    let mut up = Proc::spawn("sandbolt up", &mut cmd, log_path);
    up.wait_for_line_blocking("sandbolt is up", Duration::from_secs(60));
    up
}

/// SIGTERM: a clean, zero exit.
fn stop_up(mut up: Proc) {
    let status = up.terminate(Duration::from_secs(30));
    assert!(status.success(), "exit {status}:\n{}", up.output());
}

/// The OpenSandbox SDK through the lifecycle API: create, run, files, kill.
/// The lifecycle reaches the controller over FastPath, so this also proves
/// that `up` hands its own lifecycle the token.
fn sdk_smoke(ports: &Ports, log_path: &Path) {
    sdk_test(ports, log_path, "up_smoke_test.py");
}

/// One pytest file of `tests/python` against `up`'s lifecycle API.
fn sdk_test(ports: &Ports, log_path: &Path, file: &str) {
    let py = python().expect("python venv");
    let out = Command::new(py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(workspace_root().join("tests/python").join(file))
        .env("LIFECYCLE_DOMAIN", format!("127.0.0.1:{}", ports.lifecycle))
        .env("LIFECYCLE_API_KEY", "up-test-key")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log_text = std::fs::read_to_string(log_path).unwrap_or_default();
    assert!(
        out.status.success(),
        "SDK test failed:\n{stdout}\n{}\n--- sandbolt up log ---\n{log_text}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
}

fn with_token<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    req
}

/// One `ListSandboxes` on FastPath v2 and one on the native API, with
/// `authorization: Bearer <token>` when a token is given: their status codes.
fn list_both(
    rt: &tokio::runtime::Runtime,
    port: u16,
    token: Option<&str>,
) -> (tonic::Code, tonic::Code) {
    rt.block_on(async {
        let endpoint = format!("http://127.0.0.1:{port}");
        let mut v2 = FastPathServiceClient::connect(endpoint.clone())
            .await
            .expect("connect to FastPath");
        let v2 = match v2
            .list_sandboxes(with_token(fastpath::ListSandboxesRequest::default(), token))
            .await
        {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        let mut control = SandboxServiceClient::connect(endpoint)
            .await
            .expect("connect to the native API");
        let control = match control
            .list_sandboxes(with_token(native::ListSandboxesRequest::default(), token))
            .await
        {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        (v2, control)
    })
}

/// Only `token` opens FastPath and the native API: no token and any other
/// token are refused.
fn assert_only_token_opens_fastpath(
    rt: &tokio::runtime::Runtime,
    port: u16,
    token: &str,
    refused: &[&str],
) {
    use tonic::Code::{Ok, Unauthenticated};
    assert_eq!(
        list_both(rt, port, None),
        (Unauthenticated, Unauthenticated)
    );
    for other in refused {
        assert_eq!(
            list_both(rt, port, Some(other)),
            (Unauthenticated, Unauthenticated),
            "{other}"
        );
    }
    assert_eq!(list_both(rt, port, Some(token)), (Ok, Ok));
}

#[test]
fn sandbolt_up_serves_the_sdk_with_fastpath_closed_and_stops_cleanly() {
    let bed = Testbed::start().expect("test bed");
    bed.import_image(&busybox_image().unwrap(), "k8s.io")
        .unwrap();
    let data = tempfile::tempdir().unwrap();
    let state: PathBuf = data.path().join("state");
    let token_file = state.join("fastpath-token");
    let ports = Ports {
        fastpath: free_port(),
        lifecycle: free_port(),
        agent: free_port(),
        proxy: free_port(),
    };
    // A worker thread of its own keeps the clients' connections driven
    // between calls, so they answer the controller's GOAWAY at shutdown.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    // 1. No token given: one is generated, kept root-only, and required.
    let log1 = data.path().join("up1.log");
    let up = start_up(&bed, &state, &ports, &log1, &[]);
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&token_file), 0o600);
    let generated = std::fs::read_to_string(&token_file).unwrap();
    assert_eq!(generated.len(), 64, "{generated:?}");
    let log_text = std::fs::read_to_string(&log1).unwrap();
    assert!(
        log_text.contains(&token_file.display().to_string()),
        "the log names the token file:\n{log_text}"
    );
    assert!(!log_text.contains(&generated), "the log leaks the token");
    assert_only_token_opens_fastpath(&rt, ports.fastpath, &generated, &["not-the-token"]);
    sdk_smoke(&ports, &log1);
    // Limits that hold on the containerd fast path: the SDK's `resource`
    // reaches runc through the lifecycle, the native API and the agent.
    sdk_test(&ports, &log1, "limits_sdk_test.py");
    stop_up(up);

    // 2. A restart keeps the token (clients keep working), and tightens
    // what an operator loosened, saying so.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let log2 = data.path().join("up2.log");
    let up = start_up(&bed, &state, &ports, &log2, &[]);
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&token_file), 0o600);
    assert_eq!(std::fs::read_to_string(&token_file).unwrap(), generated);
    let log_text = std::fs::read_to_string(&log2).unwrap();
    assert!(
        log_text.contains("restricted it to its owner (0700)")
            && log_text.contains("restricted it to its owner (0600)"),
        "{log_text}"
    );
    assert_only_token_opens_fastpath(&rt, ports.fastpath, &generated, &[]);
    stop_up(up);

    // 3. An explicit token wins, replaces the kept one in the file, and the
    // SDK still works through the lifecycle.
    let explicit = "explicit-up-test-token";
    let log3 = data.path().join("up3.log");
    let up = start_up(&bed, &state, &ports, &log3, &["--fastpath-token", explicit]);
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&token_file), 0o600);
    assert_eq!(std::fs::read_to_string(&token_file).unwrap(), explicit);
    assert!(
        !std::fs::read_to_string(&log3).unwrap().contains(explicit),
        "the log leaks the token"
    );
    assert_only_token_opens_fastpath(&rt, ports.fastpath, explicit, &[&generated]);
    sdk_smoke(&ports, &log3);
    stop_up(up);
}

#[test]
fn sandbolt_up_refuses_to_run_open_without_being_told() {
    let data = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .arg("up")
        .arg("--data-dir")
        .arg(data.path())
        .env_remove("SANDBOLT_API_KEY")
        .env_remove("SANDBOLT_INSECURE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--api-key") && err.contains("--insecure"),
        "{err}"
    );
}
