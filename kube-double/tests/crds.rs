//! Kinds registered at run time (CRD files, `register_kind`), the
//! kubeconfig, and the API server's boolean query parameters.

use crate::common;

use common::*;
use http::Request;
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use sandbolt_kube_double::{ApiDouble, CrdError, CustomKind, KindError};
use serde_json::{Value, json};

#[tokio::test]
async fn crd_kind_is_served_with_its_status_subresource() {
    let (double, client) = start().await;
    let widgets_api = widgets(&client);
    // Not served before its CRD is registered.
    assert_eq!(
        status_of(widgets_api.list(&ListParams::default()).await).code,
        404
    );
    let kinds = double.register_crd(WIDGET_CRD).unwrap();
    assert_eq!(
        kinds,
        vec![CustomKind::new("example.io", "v1", "Widget", "widgets").with_status()]
    );
    let mut w = widget("w1");
    w.data["status"] = json!({"phase": "ignored on create"});
    let created = create(&widgets_api, &w).await;
    assert!(created.metadata.uid.is_some());
    assert_eq!(created.metadata.generation, Some(1));
    assert_eq!(
        created.data.get("status"),
        None,
        "status subresource drops status"
    );
    let mut st = created.clone();
    st.data["status"] = json!({"phase": "Ready"});
    let after = widgets_api
        .replace_status("w1", &PostParams::default(), &st)
        .await
        .unwrap();
    assert_eq!(after.data["status"]["phase"], "Ready");
    assert_eq!(after.metadata.generation, Some(1));
    // A custom resource: strategic merge patch is 415, as for CRDs.
    let smp = widgets_api
        .patch(
            "w1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(json!({"spec": {"size": 2}})),
        )
        .await;
    assert_eq!(status_of(smp).code, 415);
    // The served-false version is not served.
    let old = ApiResource {
        version: "v1beta1".into(),
        api_version: "example.io/v1beta1".into(),
        ..widget_resource()
    };
    let old_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &old);
    assert_eq!(
        status_of(old_api.list(&ListParams::default()).await).code,
        404
    );
}

#[tokio::test]
async fn every_crd_under_deploy_is_served() {
    let (double, client) = start().await;
    let dir = workspace_root().join("deploy/crds");
    let files = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "yaml")
        })
        .count();
    let kinds = double.register_crds(&dir).unwrap();
    assert_eq!(kinds.len(), files, "one kind per CRD file: {kinds:?}");
    for kind in &kinds {
        let resource = ApiResource {
            group: kind.group.clone(),
            version: kind.version.clone(),
            api_version: format!("{}/{}", kind.group, kind.version),
            kind: kind.kind.clone(),
            plural: kind.plural.clone(),
        };
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &resource);
        let list = api.list(&ListParams::default()).await;
        assert!(list.is_ok(), "{kind:?}: {list:?}");
    }
    // sandboxes was built in: registering its CRD keeps it one kind.
    let sandboxes_api = sandboxes(&client);
    create(&sandboxes_api, &sandbox("s1", json!({}))).await;
    double.register_crds(&dir).unwrap();
    let names: Vec<String> = sandboxes_api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|o| o.metadata.name)
        .collect();
    assert_eq!(names, ["s1"]);
}

#[tokio::test]
async fn crds_dir_errors() {
    let double = ApiDouble::start().await;
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("README.md"), "not a CRD").unwrap();
    let err = double.register_crds(empty.path()).unwrap_err();
    assert!(matches!(err, CrdError::NoCrds { .. }), "{err}");
    let err = double
        .register_crds(&empty.path().join("missing"))
        .unwrap_err();
    assert!(matches!(err, CrdError::Read { .. }), "{err}");
    let bad = empty.path().join("bad.yaml");
    std::fs::write(
        &bad,
        WIDGET_CRD.replace("scope: Namespaced", "scope: Cluster"),
    )
    .unwrap();
    let err = double.register_crds(empty.path()).unwrap_err();
    assert!(matches!(err, CrdError::NotNamespaced { .. }), "{err}");
}

/// Kinds the OpenSandbox server lists although no one here writes them.
#[tokio::test]
async fn foreign_kinds_by_register_kind() {
    let (double, client) = start().await;
    let batch = CustomKind::new(
        "sandbox.opensandbox.io",
        "v1alpha1",
        "BatchSandbox",
        "batchsandboxes",
    );
    double.register_kind(&batch).unwrap();
    let snapshots = CustomKind::new(
        "sandbox.fast.io",
        "v1alpha2",
        "SandboxSnapshot",
        "sandboxsnapshots",
    );
    double.register_kind(&snapshots).unwrap();
    let list = raw(
        &client,
        "/apis/sandbox.opensandbox.io/v1alpha1/namespaces/default/batchsandboxes?labelSelector=",
    )
    .await;
    assert_eq!(list["kind"], "BatchSandboxList");
    assert_eq!(list["items"], json!([]));
    let list = raw(
        &client,
        "/apis/sandbox.fast.io/v1alpha2/namespaces/default/sandboxsnapshots",
    )
    .await;
    assert_eq!(list["kind"], "SandboxSnapshotList");
    // sandbolt's own sandboxsnapshots (another group) are still served.
    let list = raw(
        &client,
        "/apis/sandbolt.io/v1alpha1/namespaces/default/sandboxsnapshots",
    )
    .await;
    assert_eq!(list["kind"], "SandboxSnapshotList");
    // Discovery lists each group once, with its kinds.
    let groups = raw(&client, "/apis").await;
    let fast: Vec<&Value> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["name"] == "sandbox.fast.io")
        .collect();
    assert_eq!(fast.len(), 1, "{groups}");
    let resources = raw(&client, "/apis/sandbox.fast.io/v1alpha2").await;
    let names: Vec<&str> = resources["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"sandboxes") && names.contains(&"sandboxsnapshots"),
        "{names:?}"
    );
}

#[tokio::test]
async fn register_kind_refusals() {
    let double = ApiDouble::start().await;
    let cases = [
        (CustomKind::new("", "v1", "Thing", "things"), "group"),
        (CustomKind::new("nodots", "v1", "Thing", "things"), "group"),
        (
            CustomKind::new("coordination.k8s.io", "v1", "Thing", "things"),
            "built-in",
        ),
        (
            CustomKind::new("example.io", "V1", "Thing", "things"),
            "version",
        ),
        (
            CustomKind::new("example.io", "v1", "Thing", "Things"),
            "plural",
        ),
        (
            CustomKind::new("example.io", "v1", "thing", "things"),
            "kind",
        ),
    ];
    for (kind, about) in cases {
        let err = double.register_kind(&kind).unwrap_err();
        let expected = match about {
            "group" => matches!(err, KindError::BadGroup { .. }),
            "built-in" => matches!(err, KindError::BuiltinGroup { .. }),
            "kind" => matches!(err, KindError::BadKindName { .. }),
            _ => matches!(err, KindError::NotDnsLabel { what, .. } if what == about),
        };
        assert!(expected, "{kind:?}: {err}");
    }
}

/// Registering a custom kind again (same group and plural) is a CRD
/// update: the objects stay and read as the new version.
#[tokio::test]
async fn reregistering_changes_the_version_and_keeps_objects() {
    let (double, client) = start().await;
    double.register_crd(WIDGET_CRD).unwrap();
    create(&widgets(&client), &widget("kept")).await;
    let v2 = WIDGET_CRD.replace("- name: v1\n", "- name: v2\n");
    double.register_crd(&v2).unwrap();
    assert_eq!(
        status_of(widgets(&client).list(&ListParams::default()).await).code,
        404
    );
    let kept = raw(
        &client,
        "/apis/example.io/v2/namespaces/default/widgets/kept",
    )
    .await;
    assert_eq!(kept["apiVersion"], "example.io/v2");
}

#[tokio::test]
async fn kubeconfig_is_read_by_kube_rs() {
    let double = ApiDouble::start().await;
    double.register_crd(WIDGET_CRD).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    double.write_kubeconfig(&path).unwrap();
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    assert_eq!(
        config.cluster_url.to_string().trim_end_matches('/'),
        double.url()
    );
    assert_eq!(config.default_namespace, "default");
    let client = Client::try_from(config).unwrap();
    create(&widgets(&client), &widget("via-kubeconfig")).await;
    // The token is what authenticates: without it, 401.
    let mut anonymous = kube::Config::new(double.url().parse().unwrap());
    anonymous.default_namespace = NS.into();
    let anonymous = Client::try_from(anonymous).unwrap();
    assert_eq!(
        status_of(widgets(&anonymous).list(&ListParams::default()).await).code,
        401
    );
}

/// `watch` and the other boolean parameters decode as the API server's
/// `Convert_Slice_string_To_bool`: only absent, "0" and "false" (any case)
/// are false.
#[tokio::test]
async fn boolean_query_parameters_decode_as_the_api_server() {
    let (double, client) = start().await;
    double.register_crd(WIDGET_CRD).unwrap();
    create(&widgets(&client), &widget("w")).await;
    let base = "/apis/example.io/v1/namespaces/default/widgets?timeoutSeconds=1";
    // Each watch lasts its timeoutSeconds: run them side by side.
    let truthy = ["1", "t", "T", "TRUE", "true", "True", "yes", ""];
    let bodies = futures::future::join_all(
        truthy.map(|value| raw_text(&client, format!("{base}&watch={value}"))),
    )
    .await;
    for (value, body) in truthy.iter().zip(bodies) {
        let first: Value = serde_json::from_str(body.lines().next().unwrap()).unwrap();
        assert_eq!(first["type"], "ADDED", "watch={value:?}: {body}");
    }
    for falsy in ["0", "false", "False", "FALSE"] {
        let body = raw_text(&client, &format!("{base}&watch={falsy}")).await;
        let list: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(list["kind"], "WidgetList", "watch={falsy:?}: {body}");
    }
    // allowWatchBookmarks=True is a bookmark request (sendInitialEvents
    // requires it, so its absence would be a 422 here).
    let initial = format!(
        "{base}&watch=True&sendInitialEvents=T&allowWatchBookmarks=True&resourceVersionMatch=NotOlderThan"
    );
    let body = raw_text(&client, &initial).await;
    assert!(body.contains("k8s.io/initial-events-end"), "{body}");
}

async fn raw_text(client: &Client, path: impl AsRef<str>) -> String {
    let path = path.as_ref();
    let req = Request::get(path).body(Vec::new()).unwrap();
    client
        .request_text(req)
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

async fn raw(client: &Client, path: &str) -> Value {
    serde_json::from_str(&raw_text(client, path).await).unwrap()
}
