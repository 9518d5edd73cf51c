//! The lifecycle against a controller serving TLS (`--controller-ca`, issue
//! 21): trusting the controller's CA it starts and answers through it;
//! trusting another CA, or calling plaintext, it cannot start (it checks the
//! controller at start); a CA with an `http://` endpoint is refused. Before,
//! only the agent's `--controller-ca` path was exercised by a test.

use crate::common;

use common::call;
use reqwest::{Method, StatusCode};
use sandbolt_lifecycle::{BackendConfig, ControllerConfig, Lifecycle, LifecycleConfig};
use sandbolt_proto::tls::LocalPki;

fn lifecycle_config(controller: String, ca: Option<std::path::PathBuf>) -> LifecycleConfig {
    let mut backend = ControllerConfig::new(controller);
    backend.token = Some(common::CONTROLLER_TOKEN.into());
    backend.ca = ca;
    let mut c = LifecycleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::Controller(backend),
        std::env::temp_dir().join("sandbolt-lifecycle-never-written"),
    );
    c.api_key = Some(common::API_KEY.into());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lifecycle_reaches_a_tls_controller_only_through_its_ca() {
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let names = ["localhost".to_string(), "127.0.0.1".to_string()];
    let pki = LocalPki::load_or_create(&dir.path().join("tls"), &names).unwrap();
    let other = LocalPki::load_or_create(&dir.path().join("other"), &names).unwrap();
    let mut ccfg = sandbolt_controller::ControllerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().join("ctl"),
        common::AGENT_TOKEN,
    );
    ccfg.fastpath_token = Some(common::CONTROLLER_TOKEN.into());
    ccfg.tls = Some(sandbolt_controller::config::ServerTlsFiles {
        cert: pki.cert.clone(),
        key: pki.key.clone(),
        client_ca: None,
    });
    let controller = sandbolt_controller::Controller::start(ccfg).await.unwrap();
    let port = controller.local_addr().port();
    let https = format!("https://localhost:{port}");

    let lc = Lifecycle::start(lifecycle_config(https.clone(), Some(pki.ca.clone())))
        .await
        .expect("the lifecycle starts against the TLS controller");
    let (s, v) = call(
        Method::GET,
        format!("http://{}/v1/sandboxes", lc.addr()),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    lc.shutdown().await.unwrap();

    for (what, endpoint, ca) in [
        ("another CA", https.clone(), Some(other.ca.clone())),
        ("plaintext", format!("http://127.0.0.1:{port}"), None),
        (
            "a CA with http://",
            format!("http://127.0.0.1:{port}"),
            Some(pki.ca.clone()),
        ),
    ] {
        if let Ok(lc) = Lifecycle::start(lifecycle_config(endpoint, ca)).await {
            // Started (a controller may come later): it must not answer.
            let (s, v) = call(
                Method::GET,
                format!("http://{}/v1/sandboxes", lc.addr()),
                None,
            )
            .await;
            assert_ne!(s, StatusCode::OK, "{what}: {v}");
            lc.shutdown().await.unwrap();
        }
    }
    controller.shutdown().await;
}
