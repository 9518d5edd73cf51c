//! Request/response semantics through the real kube client.

use crate::common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use sandbolt_kube_double::ApiDouble;
use serde_json::json;

#[tokio::test]
async fn create_get_list_set_server_fields() {
    let (double, client) = start().await;
    let api = leases(&client);
    let before = double.resource_version();
    let created = create(&api, &lease("a", "me")).await;
    let meta = &created.metadata;
    assert_eq!(meta.namespace.as_deref(), Some(NS));
    assert_eq!(meta.uid.as_ref().map(String::len), Some(36));
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    assert_eq!(rv_of(meta), before + 1);

    let got = api.get("a").await.unwrap();
    assert_eq!(got.metadata.uid, meta.uid);
    assert_eq!(got.spec.unwrap().holder_identity.as_deref(), Some("me"));

    create(&api, &lease("b", "you")).await;
    let list = api.list(&ListParams::default()).await.unwrap();
    let names: Vec<String> = list.items.iter().map(|l| l.name_any()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(
        list.metadata.resource_version,
        Some(double.resource_version().to_string())
    );

    // Cluster-wide list sees every namespace.
    let other: Api<Lease> = Api::namespaced(client.clone(), "other");
    create(&other, &lease("c", "x")).await;
    let all: Api<Lease> = Api::all(client.clone());
    assert_eq!(
        all.list(&ListParams::default()).await.unwrap().items.len(),
        3
    );
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
}

#[tokio::test]
async fn create_errors_are_api_statuses() {
    let (_double, client) = start().await;
    let api = leases(&client);
    create(&api, &lease("a", "me")).await;

    let dup = status_of(api.create(&PostParams::default(), &lease("a", "me")).await);
    assert_eq!((dup.code, dup.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(
        dup.message,
        "leases.coordination.k8s.io \"a\" already exists"
    );
    let details = dup.details.unwrap();
    assert_eq!(details.name, "a");
    assert_eq!(details.group, "coordination.k8s.io");
    assert_eq!(details.kind, "leases");

    let bad = status_of(
        api.create(&PostParams::default(), &lease("Bad_Name", "me"))
            .await,
    );
    assert_eq!((bad.code, bad.reason.as_str()), (422, "Invalid"));

    let mut elsewhere = lease("x", "me");
    elsewhere.metadata.namespace = Some("other".into());
    let wrong_ns = status_of(api.create(&PostParams::default(), &elsewhere).await);
    assert_eq!(
        (wrong_ns.code, wrong_ns.reason.as_str()),
        (400, "BadRequest")
    );

    let mut generated = lease("", "me");
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("gen-".into());
    let made = create(&api, &generated).await;
    let name = made.name_any();
    assert!(name.starts_with("gen-") && name.len() == 9, "{name}");

    let missing = status_of(api.get("nope").await);
    assert_eq!((missing.code, missing.reason.as_str()), (404, "NotFound"));
    assert_eq!(missing.details.unwrap().name, "nope");
    assert!(api.get_opt("nope").await.unwrap().is_none());

    let unknown = unknown_api(&client);
    let status = status_of(unknown.list(&ListParams::default()).await);
    assert_eq!(status.code, 404);
}

fn unknown_api(client: &Client) -> Api<kube::api::DynamicObject> {
    let mut ar = sandbox_resource();
    ar.plural = "gadgets".into();
    Api::namespaced_with(client.clone(), NS, &ar)
}

#[tokio::test]
async fn replace_checks_resource_version() {
    let (_double, client) = start().await;
    let api = leases(&client);
    let v1 = create(&api, &lease("a", "one")).await;

    let mut v2 = v1.clone();
    v2.spec.as_mut().unwrap().holder_identity = Some("two".into());
    let v2 = api.replace("a", &PostParams::default(), &v2).await.unwrap();
    assert!(rv_of(&v2.metadata) > rv_of(&v1.metadata));
    assert_eq!(v2.metadata.generation, Some(2));

    let mut stale = v1.clone();
    stale.spec.as_mut().unwrap().holder_identity = Some("three".into());
    let conflict = status_of(api.replace("a", &PostParams::default(), &stale).await);
    assert_eq!((conflict.code, conflict.reason.as_str()), (409, "Conflict"));
    assert!(
        conflict
            .message
            .contains("the object has been modified; please apply your changes to the latest version and try again"),
        "{}",
        conflict.message
    );

    // Built-in kinds allow an unconditional update.
    stale.metadata.resource_version = None;
    let forced = api
        .replace("a", &PostParams::default(), &stale)
        .await
        .unwrap();
    assert_eq!(
        forced.spec.unwrap().holder_identity.as_deref(),
        Some("three")
    );
    // Server-owned fields cannot be rewritten.
    assert_eq!(forced.metadata.uid, v1.metadata.uid);
    assert_eq!(
        forced.metadata.creation_timestamp,
        v1.metadata.creation_timestamp
    );

    let mut wrong_uid = api.get("a").await.unwrap();
    wrong_uid.metadata.uid = Some("00000000-0000-0000-0000-000000000000".into());
    let uid_conflict = status_of(api.replace("a", &PostParams::default(), &wrong_uid).await);
    assert_eq!(uid_conflict.code, 409);

    // Custom resources must name the version they replace.
    let sb = sandboxes(&client);
    let mut obj = create(&sb, &sandbox("s", json!({}))).await;
    obj.metadata.resource_version = None;
    let required = status_of(sb.replace("s", &PostParams::default(), &obj).await);
    assert_eq!((required.code, required.reason.as_str()), (422, "Invalid"));
}

#[tokio::test]
async fn generation_moves_with_spec_only() {
    let (double, client) = start().await;
    let api = sandboxes(&client);
    let pp = PatchParams::default();
    let created = create(&api, &sandbox("s", json!({}))).await;
    assert_eq!(created.metadata.generation, Some(1));

    let labelled = api
        .patch(
            "s",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(labelled.metadata.generation, Some(1));
    assert!(rv_of(&labelled.metadata) > rv_of(&created.metadata));

    let respecced = api
        .patch(
            "s",
            &pp,
            &Patch::Merge(json!({"spec": {"image": "alpine"}})),
        )
        .await
        .unwrap();
    assert_eq!(respecced.metadata.generation, Some(2));

    let status = api
        .patch_status(
            "s",
            &pp,
            &Patch::Merge(json!({"status": {"phase": "Ready"}})),
        )
        .await
        .unwrap();
    assert_eq!(status.metadata.generation, Some(2));

    // A write that changes nothing does not bump the resourceVersion.
    let rv = double.resource_version();
    let same = api
        .replace("s", &PostParams::default(), &status)
        .await
        .unwrap();
    assert_eq!(
        same.metadata.resource_version,
        status.metadata.resource_version
    );
    assert_eq!(double.resource_version(), rv);
}

#[tokio::test]
async fn status_subresource_is_isolated_both_ways() {
    let (_double, client) = start().await;
    let api = sandboxes(&client);
    let pp = PatchParams::default();
    let created = create(&api, &sandbox("s", json!({"status": {"phase": "Bogus"}}))).await;
    assert!(
        created.data.get("status").is_none(),
        "status dropped on create"
    );

    // Main resource: status changes are ignored.
    let mut with_status = created.clone();
    with_status.data["status"] = json!({"phase": "Sneaky"});
    with_status.data["spec"]["image"] = json!("alpine");
    let replaced = api
        .replace("s", &PostParams::default(), &with_status)
        .await
        .unwrap();
    assert!(replaced.data.get("status").is_none());
    assert_eq!(replaced.data["spec"]["image"], "alpine");
    let patched = api
        .patch(
            "s",
            &pp,
            &Patch::Merge(json!({"status": {"phase": "Sneaky"}})),
        )
        .await
        .unwrap();
    assert!(patched.data.get("status").is_none());

    // Status subresource: only status changes.
    let mut status_update = patched.clone();
    status_update.data["status"] = json!({"phase": "Running"});
    status_update.data["spec"]["image"] = json!("ignored");
    status_update
        .labels_mut()
        .insert("ignored".into(), "yes".into());
    let after = api
        .replace_status("s", &PostParams::default(), &status_update)
        .await
        .unwrap();
    assert_eq!(after.data["status"]["phase"], "Running");
    assert_eq!(after.data["spec"]["image"], "alpine");
    assert!(after.labels().get("ignored").is_none());

    let mut stale = patched.clone();
    stale.data["status"] = json!({"phase": "Old"});
    let conflict = status_of(
        api.replace_status("s", &PostParams::default(), &stale)
            .await,
    );
    assert_eq!(conflict.code, 409);

    let after = api
        .patch_status(
            "s",
            &pp,
            &Patch::Merge(json!({"spec": {"image": "nope"}, "status": {"ready": true}})),
        )
        .await
        .unwrap();
    assert_eq!(after.data["spec"]["image"], "alpine");
    assert_eq!(
        after.data["status"],
        json!({"phase": "Running", "ready": true})
    );

    // Pods: the same split; new pods start Pending.
    let pods = pods(&client);
    let p = create(&pods, &pod("p", json!({}), None)).await;
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Pending"));
    let p = pods
        .patch_status(
            "p",
            &pp,
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await
        .unwrap();
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Running"));
    let p = pods
        .patch(
            "p",
            &pp,
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await
        .unwrap();
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Running"));
}

#[tokio::test]
async fn patch_types() {
    let (_double, client) = start().await;
    let api = sandboxes(&client);
    let pp = PatchParams::default();
    create(
        &api,
        &sandbox("s", json!({"metadata": {"labels": {"a": "1", "b": "2"}}})),
    )
    .await;

    let merged = api
        .patch(
            "s",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"a": null}}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.labels().len(), 1);
    assert_eq!(merged.labels()["b"], "2");

    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/image", "value": "busybox"},
        {"op": "add", "path": "/spec/replicas", "value": 3},
    ]))
    .unwrap();
    let jp = api.patch("s", &pp, &Patch::<()>::Json(ops)).await.unwrap();
    assert_eq!(jp.data["spec"]["replicas"], 3);
    assert_eq!(jp.metadata.generation, Some(2));

    let failing: json_patch::Patch =
        serde_json::from_value(json!([{"op": "test", "path": "/spec/image", "value": "other"}]))
            .unwrap();
    let failed = status_of(api.patch("s", &pp, &Patch::<()>::Json(failing)).await);
    assert_eq!((failed.code, failed.reason.as_str()), (422, "Invalid"));

    // A patch that names a stale resourceVersion is a conflict.
    let stale = status_of(
        api.patch(
            "s",
            &pp,
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1"}, "spec": {"x": 1}})),
        )
        .await,
    );
    assert_eq!(stale.code, 409);

    // Custom resources have no strategic merge patch; built-ins do.
    let smp = status_of(
        api.patch("s", &pp, &Patch::Strategic(json!({"spec": {}})))
            .await,
    );
    assert_eq!(
        (smp.code, smp.reason.as_str()),
        (415, "UnsupportedMediaType")
    );
    let leases = leases(&client);
    create(&leases, &lease("l", "a")).await;
    let l = leases
        .patch(
            "l",
            &pp,
            &Patch::Strategic(json!({"spec": {"holderIdentity": "b"}})),
        )
        .await
        .unwrap();
    assert_eq!(l.spec.unwrap().holder_identity.as_deref(), Some("b"));

    let apply = PatchParams::apply("test");
    let ssa = status_of(
        api.patch("s", &apply, &Patch::Apply(json!({"spec": {}})))
            .await,
    );
    assert_eq!(ssa.code, 415);
    let missing = status_of(api.patch("nope", &pp, &Patch::Merge(json!({}))).await);
    assert_eq!(missing.code, 404);
}

#[tokio::test]
async fn finalizers_hold_deletion_until_removed() {
    let (_double, client) = start().await;
    let api = sandboxes(&client);
    let pp = PatchParams::default();
    create(
        &api,
        &sandbox(
            "s",
            json!({"metadata": {"finalizers": ["sandbolt.io/cleanup"]}}),
        ),
    )
    .await;

    let deleted = api.delete("s", &DeleteParams::default()).await.unwrap();
    let obj = deleted.left().expect("the terminating object");
    assert!(obj.metadata.deletion_timestamp.is_some());
    assert_eq!(obj.metadata.deletion_grace_period_seconds, Some(0));
    let still = api.get("s").await.unwrap();
    assert_eq!(
        still.metadata.deletion_timestamp,
        obj.metadata.deletion_timestamp
    );

    // Deleting again changes nothing.
    let again = api
        .delete("s", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert_eq!(
        again.metadata.resource_version,
        still.metadata.resource_version
    );

    // The name stays taken, and no finalizer may be added.
    let taken = status_of(
        api.create(&PostParams::default(), &sandbox("s", json!({})))
            .await,
    );
    assert_eq!((taken.code, taken.reason.as_str()), (409, "AlreadyExists"));
    let added = status_of(
        api.patch(
            "s",
            &pp,
            &Patch::Merge(json!({"metadata": {"finalizers": ["sandbolt.io/cleanup", "x.io/y"]}})),
        )
        .await,
    );
    assert_eq!(added.code, 422);

    let last = api
        .patch(
            "s",
            &pp,
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    assert!(last.finalizers().is_empty());
    assert_eq!(status_of(api.get("s").await).code, 404);
    // The name is free again.
    create(&api, &sandbox("s", json!({}))).await;
}

#[tokio::test]
async fn delete_without_finalizers_and_preconditions() {
    let (_double, client) = start().await;
    let leases = leases(&client);
    let l = create(&leases, &lease("l", "a")).await;

    let wrong = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-the-uid".into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    assert_eq!(status_of(leases.delete("l", &wrong).await).code, 409);
    let stale = DeleteParams {
        preconditions: Some(Preconditions {
            uid: l.metadata.uid.clone(),
            resource_version: Some("1".into()),
        }),
        ..Default::default()
    };
    assert_eq!(status_of(leases.delete("l", &stale).await).code, 409);

    // Leases answer with a Success Status, pods with the object.
    let right = DeleteParams {
        preconditions: Some(Preconditions {
            uid: l.metadata.uid.clone(),
            resource_version: l.metadata.resource_version.clone(),
        }),
        ..Default::default()
    };
    let status = leases
        .delete("l", &right)
        .await
        .unwrap()
        .right()
        .expect("a Status");
    assert_eq!(status.details.unwrap().name, "l");
    assert_eq!(status_of(leases.get("l").await).code, 404);
    assert_eq!(
        status_of(leases.delete("l", &DeleteParams::default()).await).code,
        404
    );

    let pods = pods(&client);
    create(&pods, &pod("p", json!({}), None)).await;
    let gone = pods.delete("p", &DeleteParams::foreground()).await.unwrap();
    assert_eq!(
        gone.left().expect("the pod").metadata.name.as_deref(),
        Some("p")
    );

    for n in ["a", "b", "c"] {
        let labels = json!({"del": if n == "c" { "no" } else { "yes" }});
        create(&pods, &pod(n, labels, None)).await;
    }
    let removed = pods
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("del=yes"),
        )
        .await
        .unwrap()
        .left()
        .unwrap();
    assert_eq!(removed.items.len(), 2);
    let left: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(left, ["c"]);

    // Collections of kinds that answer a single delete with a Status still
    // list what they deleted.
    create(&leases, &lease("m", "a")).await;
    let removed = leases
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert_eq!(removed.items.len(), 1);
    assert_eq!(removed.items[0].name_any(), "m");
}

#[tokio::test]
async fn label_and_field_selectors() {
    let (_double, client) = start().await;
    let api = pods(&client);
    let pp = PostParams::default();
    api.create(
        &pp,
        &pod("a", json!({"app": "web", "tier": "front"}), Some("n1")),
    )
    .await
    .unwrap();
    api.create(
        &pp,
        &pod("b", json!({"app": "web", "tier": "back"}), Some("n2")),
    )
    .await
    .unwrap();
    api.create(&pp, &pod("c", json!({"app": "db"}), Some("n1")))
        .await
        .unwrap();

    let names = |list: kube::api::ObjectList<k8s_openapi::api::core::v1::Pod>| -> Vec<String> {
        list.items.iter().map(|p| p.name_any()).collect()
    };
    let q = |sel: &'static str| {
        let api = api.clone();
        async move { names(api.list(&ListParams::default().labels(sel)).await.unwrap()) }
    };
    assert_eq!(q("app=web").await, ["a", "b"]);
    assert_eq!(q("app==web,tier!=front").await, ["b"]);
    assert_eq!(q("tier").await, ["a", "b"]);
    assert_eq!(q("!tier").await, ["c"]);
    assert_eq!(q("app in (db,cache)").await, ["c"]);
    assert_eq!(q("tier notin (front)").await, ["b", "c"]);

    let f = |sel: &'static str| {
        let api = api.clone();
        async move { names(api.list(&ListParams::default().fields(sel)).await.unwrap()) }
    };
    assert_eq!(f("spec.nodeName=n1").await, ["a", "c"]);
    assert_eq!(f("spec.nodeName!=n1").await, ["b"]);
    assert_eq!(f("metadata.name==b").await, ["b"]);
    assert_eq!(
        f("metadata.namespace=default,spec.nodeName=n2").await,
        ["b"]
    );
    let both = api
        .list(
            &ListParams::default()
                .labels("app=web")
                .fields("spec.nodeName=n1"),
        )
        .await
        .unwrap();
    assert_eq!(names(both), ["a"]);

    let bad_field = status_of(
        api.list(&ListParams::default().fields("spec.bogus=1"))
            .await,
    );
    assert_eq!(
        (bad_field.code, bad_field.reason.as_str()),
        (400, "BadRequest")
    );
    let bad_label = status_of(api.list(&ListParams::default().labels("a b")).await);
    assert_eq!(bad_label.code, 400);
    // Leases have no spec.nodeName field label.
    let lease_field = status_of(
        leases(&client)
            .list(&ListParams::default().fields("spec.nodeName=n1"))
            .await,
    );
    assert_eq!(lease_field.code, 400);
}

#[tokio::test]
async fn pagination_is_consistent_and_expires() {
    let (double, client) = start().await;
    let api = leases(&client);
    for i in 0..7 {
        create(&api, &lease(&format!("l{i}"), "x")).await;
    }
    let first = api.list(&ListParams::default().limit(3)).await.unwrap();
    let names = |items: &[Lease]| items.iter().map(|l| l.name_any()).collect::<Vec<_>>();
    assert_eq!(names(&first.items), ["l0", "l1", "l2"]);
    assert_eq!(first.metadata.remaining_item_count, Some(4));
    let token = first.metadata.continue_.clone().expect("a continue token");

    // Writes after the first page do not show in the later pages.
    create(&api, &lease("l3a", "x")).await;
    api.delete("l5", &DeleteParams::default()).await.unwrap();

    let second = api
        .list(&ListParams::default().limit(3).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(names(&second.items), ["l3", "l4", "l5"]);
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );
    let third = api
        .list(
            &ListParams::default()
                .limit(3)
                .continue_token(second.metadata.continue_.as_deref().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(names(&third.items), ["l6"]);
    assert!(third.metadata.continue_.is_none());

    double.compact();
    let expired = status_of(
        api.list(&ListParams::default().limit(3).continue_token(&token))
            .await,
    );
    assert_eq!((expired.code, expired.reason.as_str()), (410, "Expired"));

    let fresh = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(fresh.items.len(), 7);
}

#[tokio::test]
async fn injected_failures() {
    let (double, client) = start().await;
    let api = leases(&client);
    let l = create(&api, &lease("a", "x")).await;

    double.fail_next("update", "leases", 409, 1);
    let conflict = status_of(api.replace("a", &PostParams::default(), &l).await);
    assert_eq!((conflict.code, conflict.reason.as_str()), (409, "Conflict"));
    let mut next = l.clone();
    next.spec.as_mut().unwrap().holder_identity = Some("y".into());
    api.replace("a", &PostParams::default(), &next)
        .await
        .unwrap();
    assert_eq!(double.requests("update", "leases"), 2);

    double.fail_next("get", "*", 500, 2);
    assert_eq!(status_of(api.get("a").await).reason, "InternalError");
    assert_eq!(status_of(sandboxes(&client).get("a").await).code, 500);
    assert_eq!(status_of(sandboxes(&client).get("a").await).code, 404);

    // kube's client retries 503s itself: one injected 503 is invisible to
    // the caller but shows in the request count.
    let gets = double.requests("get", "leases");
    double.fail_next("get", "leases", 503, 1);
    api.get("a").await.unwrap();
    assert_eq!(double.requests("get", "leases"), gets + 2);

    // Without retries the raw status shows.
    let mut config = double.config();
    config.default_retry = false;
    let raw: Api<Lease> = Api::namespaced(Client::try_from(config).unwrap(), NS);
    double.fail_next("list", "leases", 503, 1);
    let unavailable = status_of(raw.list(&ListParams::default()).await);
    assert_eq!(
        (unavailable.code, unavailable.reason.as_str()),
        (503, "ServiceUnavailable")
    );
    double.fail_next("*", "leases", 429, 1);
    let throttled = status_of(raw.get("a").await);
    assert_eq!(
        (throttled.code, throttled.reason.as_str()),
        (429, "TooManyRequests")
    );
}

#[tokio::test]
async fn outage_returns_503_until_restored() {
    let (double, client) = start().await;
    let api = leases(&client);
    create(&api, &lease("a", "x")).await;

    let mut config = double.config();
    config.default_retry = false;
    let raw: Api<Lease> = Api::namespaced(Client::try_from(config).unwrap(), NS);
    double.set_unavailable(true);
    let down = status_of(raw.get("a").await);
    assert_eq!(
        (down.code, down.reason.as_str()),
        (503, "ServiceUnavailable")
    );
    assert_eq!(
        status_of(raw.create(&PostParams::default(), &lease("b", "x")).await).code,
        503
    );
    double.set_unavailable(false);
    assert_eq!(raw.get("a").await.unwrap().name_any(), "a");

    // The retrying client rides out a short outage.
    double.set_unavailable(true);
    let before = double.requests("get", "leases");
    let restore = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        double.set_unavailable(false);
    };
    let (got, ()) = tokio::join!(api.get("a"), restore);
    assert_eq!(got.unwrap().name_any(), "a");
    assert!(double.requests("get", "leases") >= before + 2);
}

#[tokio::test]
async fn requests_need_the_bearer_token() {
    let double = ApiDouble::start().await;
    let anonymous = kube::Config::new(double.url().parse().unwrap());
    let api: Api<Lease> = Api::namespaced(Client::try_from(anonymous).unwrap(), NS);
    let denied = status_of(api.list(&ListParams::default()).await);
    assert_eq!((denied.code, denied.reason.as_str()), (401, "Unauthorized"));

    let mut wrong = double.config();
    wrong.auth_info = serde_json::from_value(json!({"token": "not-it"})).unwrap();
    let api: Api<Lease> = Api::namespaced(Client::try_from(wrong).unwrap(), NS);
    assert_eq!(status_of(api.get("a").await).code, 401);

    let version = double.client().apiserver_version().await.unwrap();
    assert_eq!(version.major, "1");
    double.shutdown().await;
}

/// `sandboxwarmpools` is served as the controller's store and `kubectl`
/// use it: a custom resource with a status subresource, in discovery.
#[tokio::test]
async fn warm_pools_are_served_as_a_custom_resource() {
    let (_double, client) = start().await;
    let ar = kube::api::ApiResource {
        group: "sandbolt.io".into(),
        version: "v1alpha1".into(),
        api_version: "sandbolt.io/v1alpha1".into(),
        kind: "SandboxWarmPool".into(),
        plural: "sandboxwarmpools".into(),
    };
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
    let obj: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "sandbolt.io/v1alpha1",
        "kind": "SandboxWarmPool",
        "metadata": {"name": "py"},
        "spec": {"template": {"image": "python:3.12"},
                 "capacity": {"bufferMin": 1, "bufferMax": 2, "poolMin": 0, "poolMax": 4}},
        "status": {"available": 9},
    }))
    .unwrap();
    let created = create(&api, &obj).await;
    assert!(created.data.get("status").is_none(), "status dropped");
    assert_eq!(created.metadata.generation, Some(1));

    // A custom resource: a PUT without resourceVersion is refused.
    let mut blind = created.clone();
    blind.metadata.resource_version = None;
    let err = status_of(api.replace("py", &PostParams::default(), &blind).await);
    assert_eq!(err.code, 422);

    let after = api
        .patch_status(
            "py",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"available": 2, "total": 2}})),
        )
        .await
        .unwrap();
    assert_eq!(after.data["status"]["available"], 2);
    assert_eq!(
        after.metadata.generation,
        Some(1),
        "status moves no generation"
    );

    let resources = client
        .list_api_group_resources("sandbolt.io/v1alpha1")
        .await
        .unwrap();
    let names: Vec<&str> = resources
        .resources
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert!(names.contains(&"sandboxwarmpools"), "{names:?}");
    assert!(names.contains(&"sandboxwarmpools/status"), "{names:?}");
}
