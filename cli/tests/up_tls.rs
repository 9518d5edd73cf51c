//! `sandbolt up --tls on` (issue 21): the controller's port serves TLS only
//! with a certificate from a CA `up` makes once in `<data-dir>/tls/`; its
//! agent, lifecycle and janitor reach it over https:// trusting that CA;
//! the agent serves its own API over TLS with its own certificate, which
//! the controller pins. Proven from outside: plaintext FastPath fails, TLS
//! FastPath trusting `ca.crt` answers and lists the agent (it heartbeats
//! over TLS), the OpenSandbox SDK runs a sandbox through the lifecycle (the
//! lifecycle → controller → agent chain, all TLS), plaintext to the agent's
//! port fails, and a restart keeps the same CA. Before, `up` had no --tls
//! and every hop was plaintext.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sandbolt_proto::fastpath::v2 as fastpath;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_test_support::{Proc, free_port};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary, python, workspace_root};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

struct Ports {
    fastpath: u16,
    lifecycle: u16,
    agent: u16,
}

fn start_up(bed: &Testbed, state: &Path, ports: &Ports, log: &Path) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    cmd.arg("up")
        .arg("--data-dir")
        .arg(state)
        .args(["--runtime", "containerd", "--tls", "on"])
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
        .args(["--proxy-listen", &format!("127.0.0.1:{}", free_port())])
        .args([
            "--api-key",
            "up-tls-key",
            "--fastpath-token",
            "up-tls-token",
        ])
        .args(["--janitor-interval", "2s"]);
    let mut up = Proc::spawn("sandbolt up --tls on", &mut cmd, log);
    up.wait_for_line_blocking("sandbolt is up", Duration::from_secs(60));
    up
}

async fn list_pools(ch: Channel) -> Result<fastpath::ListPoolsResponse, tonic::Status> {
    let mut req = tonic::Request::new(fastpath::ListPoolsRequest::default());
    req.metadata_mut()
        .insert("authorization", "Bearer up-tls-token".parse().unwrap());
    FastPathServiceClient::new(ch)
        .list_pools(req)
        .await
        .map(tonic::Response::into_inner)
}

fn tls_channel(port: u16, ca: &Path) -> Channel {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap()))
        .domain_name("localhost");
    Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_lazy()
}

#[test]
fn up_with_tls_serves_every_hop_over_tls() {
    let bed = Testbed::start().expect("test bed");
    bed.import_image(&busybox_image().expect("busybox image"), "k8s.io")
        .expect("import busybox");
    let state = tempfile::tempdir().unwrap();
    let ports = Ports {
        fastpath: free_port(),
        lifecycle: free_port(),
        agent: free_port(),
    };
    let log = state.path().join("up.log");
    let data = state.path().join("data");
    let mut up = start_up(&bed, &data, &ports, &log);
    let ca = data.join("tls").join("ca.crt");
    let ca_pem = std::fs::read(&ca).expect("up made <data-dir>/tls/ca.crt");
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Lazy channels are made outside `block_on`.
    let _rt = rt.enter();

    // Plaintext to the controller's port fails; TLS trusting the CA answers,
    // and the agent (heartbeating over TLS) is there.
    let plain = Channel::from_shared(format!("http://127.0.0.1:{}", ports.fastpath))
        .unwrap()
        .connect_lazy();
    assert!(
        rt.block_on(list_pools(plain)).is_err(),
        "plaintext FastPath must fail"
    );
    let agents = rt.block_on(async {
        for _ in 0..100 {
            if let Ok(r) = list_pools(tls_channel(ports.fastpath, &ca)).await {
                let live: i32 = r.items.iter().map(|p| p.ready_fastlets).sum();
                if live > 0 {
                    return live;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        0
    });
    assert_eq!(
        agents,
        1,
        "the agent heartbeats over TLS:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // The agent's own port: TLS only, its certificate in its state dir.
    assert!(data.join("agent/identity/tls.crt").is_file());
    let agent_plain = Channel::from_shared(format!("http://127.0.0.1:{}", ports.agent))
        .unwrap()
        .connect_lazy();
    let e = rt
        .block_on(
            sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient::new(agent_plain)
                .get_inventory(sandbolt_proto::agent::v1::GetInventoryRequest::default()),
        )
        .expect_err("plaintext to the agent's TLS port fails");
    assert_ne!(e.code(), tonic::Code::Unauthenticated, "{e:?}");

    // The SDK through the lifecycle: lifecycle → controller → agent, TLS.
    let py = python().expect("python venv");
    let out = Command::new(py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(workspace_root().join("tests/python/up_smoke_test.py"))
        .env("LIFECYCLE_DOMAIN", format!("127.0.0.1:{}", ports.lifecycle))
        .env("LIFECYCLE_API_KEY", "up-tls-key")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "SDK through a TLS up failed:\n{stdout}\n{}\n--- log ---\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // A restart keeps the CA clients trust.
    assert!(up.terminate(Duration::from_secs(30)).success());
    let mut up = start_up(&bed, &data, &ports, &state.path().join("up2.log"));
    assert_eq!(std::fs::read(&ca).unwrap(), ca_pem);
    rt.block_on(list_pools(tls_channel(ports.fastpath, &ca)))
        .expect("the same CA after a restart");
    assert!(up.terminate(Duration::from_secs(30)).success());
}
