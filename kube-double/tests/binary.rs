//! The `kube-double` binary: flags, the URL on stdout, the kubeconfig, and
//! a clean exit on SIGTERM / SIGINT.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use kube::Client;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};

const BIN: &str = env!("CARGO_BIN_EXE_kube-double");

/// Starts the binary with `args` and reads the URL line it prints.
fn spawn(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kube-double");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line.trim().to_string())
}

fn signal_and_wait(
    child: &mut Child,
    signal: nix::sys::signal::Signal,
) -> std::process::ExitStatus {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, signal).unwrap();
    for _ in 0..100 {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    panic!("kube-double did not exit on {signal}");
}

#[tokio::test]
async fn serves_crds_and_kinds_through_its_kubeconfig_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let crds = dir.path().join("crds");
    std::fs::create_dir(&crds).unwrap();
    std::fs::write(crds.join("widgets.example.io.yaml"), WIDGET_CRD).unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let (mut child, url) = spawn(&[
        "--listen",
        "127.0.0.1:0",
        "--crds",
        crds.to_str().unwrap(),
        "--kind",
        "sandbox.opensandbox.io/v1alpha1/BatchSandbox/batchsandboxes",
        "--kubeconfig-out",
        kubeconfig.to_str().unwrap(),
        "--token",
        "fixed-token",
    ]);
    assert!(url.starts_with("http://127.0.0.1:"), "{url:?}");
    let text = std::fs::read_to_string(&kubeconfig).unwrap();
    assert!(text.contains("token: fixed-token"), "{text}");
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(&kubeconfig).unwrap(),
        &KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(config.cluster_url.to_string().trim_end_matches('/'), url);
    let client = Client::try_from(config).unwrap();
    create(&widgets(&client), &widget("w")).await;
    let batch = kube::api::ApiResource {
        group: "sandbox.opensandbox.io".into(),
        version: "v1alpha1".into(),
        api_version: "sandbox.opensandbox.io/v1alpha1".into(),
        kind: "BatchSandbox".into(),
        plural: "batchsandboxes".into(),
    };
    let batch: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(client.clone(), NS, &batch);
    assert!(
        batch
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    // The built-in kinds are there too.
    sandboxes(&client)
        .list(&ListParams::default())
        .await
        .unwrap();
    let status = signal_and_wait(&mut child, nix::sys::signal::Signal::SIGTERM);
    assert!(status.success(), "{status}");
}

#[test]
fn exits_on_sigint_and_refuses_bad_flags() {
    let (mut child, url) = spawn(&[]);
    assert!(url.starts_with("http://127.0.0.1:"), "{url:?}");
    let status = signal_and_wait(&mut child, nix::sys::signal::Signal::SIGINT);
    assert!(status.success(), "{status}");

    let help = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for flag in [
        "--listen",
        "--crds",
        "--kind",
        "--kubeconfig-out",
        "--token",
        "SIGTERM",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}: {help}");
    }
    let cases: [&[&str]; 3] = [
        &["--kind", "example.io/v1/Widget"],
        &["--kind", "nodots/v1/Widget/widgets"],
        &["--crds", "/nonexistent/crds"],
    ];
    for args in cases {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(out.stdout.is_empty(), "{args:?} printed a URL");
        assert!(!out.stderr.is_empty(), "{args:?} said nothing");
    }
}
