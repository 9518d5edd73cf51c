//! The double driven by the Python `kubernetes` client (37, the OpenSandbox
//! server's) from `target/opensandbox-server-venv`, through a kubeconfig
//! from `write_kubeconfig`, on a kind registered from a CRD.

use crate::common;

use std::path::PathBuf;

use common::*;
use sandbolt_kube_double::ApiDouble;
use serde_json::{Value, json};

/// The venv's python, made (or checked) by the project's own script.
fn server_venv_python() -> PathBuf {
    sandbolt_testbed::opensandbox_server()
        .expect("the OpenSandbox server's venv (benches/python/server-env.sh)")
        .with_file_name("python")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_kubernetes_client_on_a_crd_kind() {
    let double = ApiDouble::start().await;
    double.register_crd(WIDGET_CRD).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    double.write_kubeconfig(&kubeconfig).unwrap();

    // "older" exists before the client lists; the watch history up to a
    // later write is compacted, so a watch from `stale` must get 410.
    let client = double.client();
    create(&widgets(&client), &widget("older")).await;
    let stale = double.resource_version();
    create(&widgets(&client), &widget("newer")).await;
    double.compact();

    let python = server_venv_python();
    let script = workspace_root().join("kube-double/tests/python/kube_client.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(&kubeconfig)
        .args(["example.io", "v1", "widgets", &stale.to_string()])
        .output()
        .await
        .expect("run the python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");

    assert_eq!(seen["client_version"], "37.0.2");
    assert_eq!(seen["list_kind"], "WidgetList");
    assert_eq!(seen["list_names"], json!(["newer", "older"]));
    let meta = &seen["created_meta"];
    assert!(
        meta["uid"].as_str().is_some_and(|u| !u.is_empty()),
        "{meta}"
    );
    assert!(meta["creationTimestamp"].is_string(), "{meta}");
    assert_eq!(meta["generation"], 1);
    assert_eq!(meta["namespace"], "default");
    assert_eq!(seen["created_status"], Value::Null, "status subresource");
    assert_eq!(seen["get_uid_matches"], true);
    assert_eq!(seen["selected"], json!(["from-python"]));
    assert_eq!(
        seen["selected_empty"],
        json!(["from-python", "newer", "older"])
    );
    assert_eq!(seen["get_after_delete"], 404);
    assert_eq!(
        seen["watch_events"],
        json!([["ADDED", "from-python"], ["DELETED", "from-python"]])
    );
    assert_eq!(seen["stale_watch"], 410);
    assert_eq!(seen["unknown_plural"], 404);
    assert_eq!(seen["discovery"], json!(["widgets", "widgets/status"]));
    // What the client sent: one create and one delete, a watch per stream.
    assert_eq!(double.requests("create", "widgets"), 3);
    assert_eq!(double.requests("delete", "widgets"), 1);
    assert_eq!(double.requests("watch", "widgets"), 2);
}
