//! Expiry over the Kubernetes store: the container goes, the Sandbox
//! resource stays as a tombstone (runtime Stopped, Ready False for reason
//! Expired, no controller state, no finalizer), which the OpenSandbox server
//! 1.1.1 shows as Terminated, as with fast-sandbox. No read of the controller
//! sees it; a create of the name replaces it; FastPath v2 DeleteSandbox
//! removes it (the server deletes a Terminated sandbox that way); the
//! leader removes it after the retention. The resource lives on the
//! Kubernetes API double; the agent is a stand-in (`support/standin.rs`).

use crate::support;

use std::time::Duration;

use kube::ResourceExt;
use sandbolt_controller::SandboxKey;
use sandbolt_controller::store::ListRange;
use sandbolt_controller::store::kube::{EXPIRED_ANNOTATION, STATE_ANNOTATION};
use sandbolt_deploy::Sandbox;
use sandbolt_deploy::sandbox::{FINALIZER, READY_CONDITION, RuntimeState};
use sandbolt_proto::fastpath::v2;
use support::eventually;
use support::kube_bed::{self, KubeBed as Bed};
use tonic::Code;

const NS: &str = "opensandbox";

/// A controller over the Kubernetes store on the double (expiry swept and
/// status published every 100 ms, tombstones kept for `retention`), one
/// stand-in agent, a FastPath v2 client.
async fn bed(retention: Duration) -> Bed {
    kube_bed::start(NS, |store, controller| {
        store.expired_sandbox_retention = retention;
        controller.expiry_sweep_interval = Duration::from_millis(100);
    })
    .await
}

fn reference(name: &str, uid: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: NS.into(),
            name: name.into(),
        }),
        expected_uid: uid.into(),
    })
}

/// Creates `name` (ready); `expires_in` 0 = no expiry. Returns the
/// container id.
async fn create(bed: &mut Bed, name: &str, expires_in: i64) -> String {
    let expires_at = match expires_in {
        0 => 0,
        s => sandbolt_controller::clock::now_unix_secs() + s,
    };
    bed.v2
        .create_sandbox(v2::CreateSandboxRequest {
            // The server's request id is the sandbox's name.
            request_id: name.into(),
            namespace: NS.into(),
            image: "busybox".into(),
            expires_at_unix_seconds: expires_at,
            completion: v2::CreateCompletion::Ready as i32,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    let key = SandboxKey::new(NS, name);
    let record = bed.controller.core().store().get(&key).unwrap().unwrap();
    record.sandbox_id.to_string()
}

/// Waits until `name`'s resource is a tombstone whose status was written;
/// returns it.
async fn tombstone(bed: &Bed, name: &str) -> Sandbox {
    let sandboxes = bed.sandboxes.clone();
    let mut found = None;
    eventually("the expired sandbox's tombstone", async || {
        found = sandboxes.get_opt(name).await.unwrap().filter(|o| {
            o.annotations().contains_key(EXPIRED_ANNOTATION)
                && o.status
                    .as_ref()
                    .and_then(|s| s.runtime.as_ref())
                    .is_some_and(|r| r.state == RuntimeState::Stopped)
        });
        found.is_some()
    })
    .await;
    found.unwrap()
}

async fn get_code(bed: &mut Bed, name: &str) -> Code {
    match bed
        .v2
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference(name, ""),
            expected_generation: 0,
        })
        .await
    {
        Ok(_) => Code::Ok,
        Err(e) => e.code(),
    }
}

async fn listed(bed: &mut Bed) -> Vec<String> {
    let items = bed
        .v2
        .list_sandboxes(v2::ListSandboxesRequest {
            namespace: NS.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .items;
    items
        .into_iter()
        .map(|s| s.identity.unwrap().name)
        .collect()
}

async fn v2_delete(bed: &mut Bed, name: &str, uid: &str) -> Result<(), tonic::Status> {
    bed.v2
        .delete_sandbox(v2::DeleteRequest {
            sandbox: reference(name, uid),
        })
        .await
        .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_sandbox_stays_as_a_tombstone_the_controller_does_not_see() {
    let mut bed = bed(Duration::from_secs(3600)).await;
    let name = "fsb-expiring";
    let container = create(&mut bed, name, 1).await;
    create(&mut bed, "fsb-stays", 0).await;

    let obj = tombstone(&bed, name).await;
    assert!(
        !bed.agent.state.sandboxes.lock().contains_key(&container),
        "the container is removed at expiry"
    );
    assert!(!obj.annotations().contains_key(STATE_ANNOTATION));
    assert!(obj.finalizers().iter().all(|f| f != FINALIZER));
    assert!(obj.metadata.deletion_timestamp.is_none());
    let status = obj.status.clone().unwrap();
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == READY_CONDITION)
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "Expired")
    );
    assert_eq!(status.observed_generation, obj.metadata.generation);
    // No binding left to read as Failed.
    assert!(status.action_bindings.is_empty());

    // No read of the controller sees it.
    let key = SandboxKey::new(NS, name);
    let core = bed.controller.core();
    let store = core.store();
    assert!(store.get(&key).unwrap().is_none());
    let names: Vec<String> = store
        .list(&ListRange::namespace(NS))
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, ["fsb-stays"]);
    assert!(store.deletions_requested().is_empty());
    assert_eq!(get_code(&mut bed, name).await, Code::NotFound);
    assert_eq!(listed(&mut bed).await, ["fsb-stays"]);
    // The status publisher leaves it as it is.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let again = bed.sandboxes.get(name).await.unwrap();
    assert_eq!(again.status, obj.status);

    // A create of the name replaces it: a new resource, a record again.
    create(&mut bed, name, 0).await;
    let replaced = bed.sandboxes.get(name).await.unwrap();
    assert_ne!(replaced.metadata.uid, obj.metadata.uid);
    assert!(replaced.annotations().contains_key(STATE_ANNOTATION));
    assert!(!replaced.annotations().contains_key(EXPIRED_ANNOTATION));
    assert_eq!(get_code(&mut bed, name).await, Code::Ok);

    // A delete that is no expiry removes the resource, no tombstone left.
    let uid = replaced.metadata.uid.clone().unwrap();
    v2_delete(&mut bed, name, &uid).await.unwrap();
    let sandboxes = bed.sandboxes.clone();
    eventually("the Sandbox is deleted", async || {
        sandboxes.get_opt(name).await.unwrap().is_none()
    })
    .await;
    bed.controller.shutdown().await;
    bed.api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fastpath_delete_removes_a_tombstone_as_the_server_deletes_terminated_sandboxes() {
    let mut bed = bed(Duration::from_secs(3600)).await;
    let name = "fsb-terminated";
    create(&mut bed, name, 1).await;
    let obj = tombstone(&bed, name).await;
    let uid = obj.metadata.uid.clone().unwrap();
    v2_delete(&mut bed, name, &uid).await.unwrap();
    assert!(bed.sandboxes.get_opt(name).await.unwrap().is_none());
    // Gone for good: a second delete finds nothing.
    let again = v2_delete(&mut bed, name, &uid).await.unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
    bed.controller.shutdown().await;
    bed.api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tombstone_is_removed_after_its_retention() {
    let mut bed = bed(Duration::from_secs(3)).await;
    let name = "fsb-retained";
    create(&mut bed, name, 1).await;
    let obj = tombstone(&bed, name).await;
    let expired_at: k8s_openapi::jiff::Timestamp =
        obj.annotations()[EXPIRED_ANNOTATION].parse().unwrap();
    let sandboxes = bed.sandboxes.clone();
    eventually("the tombstone is removed", async || {
        sandboxes.get_opt(name).await.unwrap().is_none()
    })
    .await;
    let kept = k8s_openapi::jiff::Timestamp::now().duration_since(expired_at);
    assert!(
        kept.as_secs_f64() >= 3.0,
        "kept {kept:?}, not the whole retention"
    );
    bed.controller.shutdown().await;
    bed.api.shutdown().await;
}
