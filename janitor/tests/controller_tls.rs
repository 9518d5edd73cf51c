//! The janitor against a controller serving TLS (`--controller-ca`, issue
//! 21): trusting the controller's CA its ownership queries and reap reports
//! go through (the report enrolls first, all over TLS); trusting another CA
//! or calling plaintext they fail, and a CA with an `http://` endpoint is
//! refused at construction. `Janitor::new` builds exactly this
//! `ControllerOwnership::with_ca` from `JanitorConfig::controller_ca`.
//! Before, no test ran a janitor against a TLS controller.

use std::time::Duration;

use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_janitor::{ControllerOwnership, OwnershipSource, ReapNotice, ReapReason};
use sandbolt_proto::tls::LocalPki;

const TOKEN: &str = "janitor-tls-token";
const WAIT: Duration = Duration::from_secs(5);

fn notice() -> ReapNotice<'static> {
    ReapNotice {
        node_name: "node-tls",
        sandbox_id: "sb-reaped",
        agent_id: "agent-gone",
        reason: ReapReason::Terminal,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn janitor_calls_reach_a_tls_controller_only_through_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["localhost".to_string(), "127.0.0.1".to_string()];
    let pki = LocalPki::load_or_create(&dir.path().join("tls"), &names).unwrap();
    let other = LocalPki::load_or_create(&dir.path().join("other"), &names).unwrap();
    let mut cfg = ControllerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().join("ctl"),
        TOKEN,
    );
    cfg.failpoint = None;
    cfg.tls = Some(sandbolt_controller::config::ServerTlsFiles {
        cert: pki.cert.clone(),
        key: pki.key.clone(),
        client_ca: None,
    });
    let ctl = Controller::start(cfg).await.unwrap();
    let port = ctl.local_addr().port();
    let https = format!("https://localhost:{port}");

    let owner = ControllerOwnership::with_ca(&https, TOKEN, WAIT, Some(&pki.ca)).unwrap();
    owner
        .ownership("node-tls", &[])
        .await
        .expect("an ownership query over TLS");
    owner
        .report_reaped(&notice())
        .await
        .expect("a reap report over TLS (enrolling first)");

    let stranger = ControllerOwnership::with_ca(&https, TOKEN, WAIT, Some(&other.ca)).unwrap();
    assert!(
        stranger.ownership("node-tls", &[]).await.is_err(),
        "another CA"
    );
    let plain =
        ControllerOwnership::with_ca(&format!("http://127.0.0.1:{port}"), TOKEN, WAIT, None)
            .unwrap();
    assert!(plain.ownership("node-tls", &[]).await.is_err(), "plaintext");
    assert!(
        ControllerOwnership::with_ca(
            &format!("http://127.0.0.1:{port}"),
            TOKEN,
            WAIT,
            Some(&pki.ca)
        )
        .is_err(),
        "a CA with http:// is refused"
    );
    ctl.shutdown().await;
}
