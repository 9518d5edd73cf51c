//! Helpers shared by the test binaries.

#![allow(dead_code)]

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, ObjectMeta};
use kube::core::Status;
use kube::{Api, Client};
use sandbolt_kube_double::ApiDouble;
use serde_json::{Value, json};

pub const NS: &str = "default";

pub async fn start() -> (ApiDouble, Client) {
    let double = ApiDouble::start().await;
    let client = double.client();
    (double, client)
}

pub fn sandbox_resource() -> ApiResource {
    ApiResource {
        group: "sandbox.fast.io".into(),
        version: "v1alpha2".into(),
        api_version: "sandbox.fast.io/v1alpha2".into(),
        kind: "Sandbox".into(),
        plural: "sandboxes".into(),
    }
}

pub fn sandboxes(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, &sandbox_resource())
}

pub fn leases(client: &Client) -> Api<Lease> {
    Api::namespaced(client.clone(), NS)
}

pub fn pods(client: &Client) -> Api<Pod> {
    Api::namespaced(client.clone(), NS)
}

pub fn lease(name: &str, holder: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            ..Default::default()
        }),
    }
}

pub fn sandbox(name: &str, extra: Value) -> DynamicObject {
    let mut obj = json!({
        "apiVersion": "sandbox.fast.io/v1alpha2",
        "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"image": "busybox"},
    });
    json_patch::merge(&mut obj, &extra);
    serde_json::from_value(obj).expect("a DynamicObject")
}

pub fn pod(name: &str, labels: Value, node: Option<&str>) -> Pod {
    let mut obj = json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    });
    if let Some(node) = node {
        obj["spec"]["nodeName"] = json!(node);
    }
    serde_json::from_value(obj).expect("a Pod")
}

/// The Status of an API error, panicking on any other outcome.
pub fn status_of<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> Box<Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

pub fn rv_of(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .expect("resourceVersion set")
        .parse()
        .expect("numeric resourceVersion")
}

/// Creates `obj` through `api` (default parameters), which must succeed:
/// what most tests do before the step they check.
pub async fn create<K>(api: &Api<K>, obj: &K) -> K
where
    K: Clone + std::fmt::Debug + serde::de::DeserializeOwned + serde::Serialize,
{
    api.create(&kube::api::PostParams::default(), obj)
        .await
        .unwrap_or_else(|e| panic!("creating {obj:?}: {e}"))
}

/// A CRD none of the double's built-in kinds matches: a namespaced
/// `example.io/v1` `Widget` with the status subresource (and a served-false
/// old version, which must not be served).
pub const WIDGET_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.io
spec:
  group: example.io
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1beta1
    served: false
    storage: false
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
    subresources: {status: {}}
"#;

pub fn widget_resource() -> ApiResource {
    ApiResource {
        group: "example.io".into(),
        version: "v1".into(),
        api_version: "example.io/v1".into(),
        kind: "Widget".into(),
        plural: "widgets".into(),
    }
}

pub fn widgets(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, &widget_resource())
}

pub fn widget(name: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "example.io/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": 1},
    }))
    .expect("a DynamicObject")
}

/// The workspace root (kube-double's parent).
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("kube-double sits in the workspace")
        .to_path_buf()
}
