//! FastPath v2 names snapshots by the request id its client chose and
//! restores them by image, as the OpenSandbox server 1.1.1 does with
//! fast-sandbox: `CreateSandboxSnapshot{request_id = template_name =
//! "osb-snap-…"}`, then `GetSandboxSnapshot` / `DeleteSandboxSnapshot` by
//! that name, and a restore is a `CreateSandbox` whose image is
//! `GetSandboxSnapshot`'s `template_name`. The controller runs for real on
//! its gRPC port; agents are stand-ins (see `support/standin.rs`), since
//! this is about what the controller makes of the calls. The rig
//! (`tests/tests/opensandbox_server_rig.rs`) runs the same through the real
//! server on a real agent.

use crate::support;

use std::sync::atomic::Ordering::SeqCst;

use sandbolt_controller::Controller;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2;
use support::standin::StandInAgent;
use support::{HB, assert_code, eventually, sandbox_request, standin_config};
use tonic::Code;
use tonic::transport::Channel;

type V2 = v2::fast_path_service_client::FastPathServiceClient<Channel>;
type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;

const NS: &str = "default";

fn named(name: &str) -> v2::NamespacedName {
    v2::NamespacedName {
        namespace: NS.into(),
        name: name.into(),
    }
}

/// A snapshot of `source` as the server asks for it: its request id is
/// also its template name.
fn snapshot_request(source: &str, name: &str) -> v2::CreateSandboxSnapshotRequest {
    v2::CreateSandboxSnapshotRequest {
        request_id: name.into(),
        sandbox: Some(v2::SandboxReference {
            namespaced_name: Some(named(source)),
            expected_uid: String::new(),
        }),
        template_name: name.into(),
        metadata: [("opensandbox-snapshot-id".to_string(), "0f3c".to_string())].into(),
    }
}

/// A create as the server's image mode sends it (a restore: `image` is the
/// snapshot's template name).
fn create_request(id: &str, image: &str) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: id.into(),
        namespace: NS.into(),
        image: image.into(),
        command: vec!["tail".into(), "-f".into(), "/dev/null".into()],
        pool_ref: "default".into(),
        completion: v2::CreateCompletion::RuntimeReady as i32,
        ..Default::default()
    }
}

async fn get_snapshot(v: &mut V2, name: &str) -> Result<v2::SandboxSnapshotInfo, tonic::Status> {
    v.get_sandbox_snapshot(v2::GetSandboxSnapshotRequest {
        snapshot: Some(named(name)),
        expected_uid: String::new(),
    })
    .await
    .map(|r| r.into_inner().snapshot.unwrap())
}

async fn settled(v: &mut V2, name: &str) -> v2::SandboxSnapshotInfo {
    let mut last = None;
    eventually("the capture settles", async || {
        let s = get_snapshot(v, name).await.unwrap();
        let done = s.phase != v2::SnapshotPhase::Creating as i32;
        last = Some(s);
        done
    })
    .await;
    last.unwrap()
}

/// The spec the create of sandbox `name` carried to stand-in `a` (None:
/// it went elsewhere).
async fn sent_spec(
    a: &StandInAgent,
    n: &mut Native,
    name: &str,
) -> Option<sandbolt_proto::agent::v1::SandboxSpec> {
    let s = n
        .get_sandbox(native::GetSandboxRequest {
            sandbox: support::sref(name),
        })
        .await
        .unwrap()
        .into_inner();
    let container = s.status.unwrap().container_id;
    a.state.specs.lock().get(&container).cloned()
}

async fn delete(v: &mut V2, name: &str) {
    v.delete_sandbox(v2::DeleteRequest {
        sandbox: Some(v2::SandboxReference {
            namespaced_name: Some(named(name)),
            expected_uid: String::new(),
        }),
    })
    .await
    .unwrap_or_else(|e| panic!("delete {name}: {e}"));
}

/// Get and delete answer to the request id (and to sandbolt's id); a
/// create whose image names a READY snapshot of its namespace restores it
/// on its node with its image; one naming a failed snapshot is refused
/// naming its phase; other images (and the name in another namespace) are
/// images.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_names_snapshots_by_request_id_and_restores_them_by_image() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = StandInAgent::start("a", "default", 4, &["busybox"], h.local_addr(), HB).await;
    let b = StandInAgent::start("b", "default", 4, &["busybox"], h.local_addr(), HB).await;
    let url = format!("http://{}", h.local_addr());
    let mut v = V2::connect(url.clone()).await.unwrap();
    let mut n = Native::connect(url).await.unwrap();
    n.create_sandbox(sandbox_request("src", vec![]))
        .await
        .unwrap();

    let made = v
        .create_sandbox_snapshot(snapshot_request("src", "osb-snap-one"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let id = made.identity.unwrap().name;
    assert_ne!(id, "osb-snap-one", "sandbolt's id is its own");
    let ready = settled(&mut v, "osb-snap-one").await;
    assert_eq!(ready.phase, v2::SnapshotPhase::Succeeded as i32);
    assert_eq!(ready.template_name, "osb-snap-one");
    assert_eq!(ready.identity.as_ref().unwrap().name, id);
    assert_eq!(get_snapshot(&mut v, &id).await.unwrap().phase, ready.phase);

    // The restore: image = the template name the server read.
    let restored = v
        .create_sandbox(create_request("fsb-restored", &ready.template_name))
        .await
        .unwrap_or_else(|e| panic!("restore: {e}"))
        .into_inner();
    assert_eq!(
        restored.sandbox.unwrap().identity.unwrap().name,
        "fsb-restored"
    );
    let sent = sent_spec(&a, &mut n, "fsb-restored").await.unwrap();
    assert_eq!(sent.snapshot_id, id, "the agent restores the snapshot");
    assert_eq!(sent.image, "docker.io/library/busybox:latest");
    assert_eq!(b.held(), 0, "the restore runs on the snapshot's node");
    // By sandbolt's id too.
    v.create_sandbox(create_request("fsb-by-id", &id))
        .await
        .unwrap();
    let by_id = sent_spec(&a, &mut n, "fsb-by-id").await.unwrap();
    assert_eq!(by_id.snapshot_id, id);

    // An image is an image; the name means nothing in another namespace.
    v.create_sandbox(create_request("fsb-plain", "busybox"))
        .await
        .unwrap();
    let plain = sent_spec(&b, &mut n, "fsb-plain").await;
    assert!(
        plain
            .as_ref()
            .is_some_and(|s| s.snapshot_id.is_empty() && s.image.contains("busybox")),
        "no restore: the emptier agent b runs busybox: {plain:?}"
    );
    let elsewhere = v2::CreateSandboxRequest {
        namespace: "other".into(),
        ..create_request("fsb-elsewhere", "osb-snap-one")
    };
    if let Err(e) = v.create_sandbox(elsewhere).await {
        assert!(!e.message().contains(&id), "{e:?}");
    } else {
        let s = n
            .get_sandbox(native::GetSandboxRequest {
                sandbox: Some(native::SandboxRef {
                    namespace: "other".into(),
                    name: "fsb-elsewhere".into(),
                    expected_uid: String::new(),
                }),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(s.spec.unwrap().snapshot_id.is_empty());
    }

    // A failed snapshot named by image is refused, naming its phase.
    a.state.fail_captures.store(true, SeqCst);
    v.create_sandbox_snapshot(snapshot_request("src", "osb-snap-broken"))
        .await
        .unwrap();
    let broken = settled(&mut v, "osb-snap-broken").await;
    assert_eq!(broken.phase, v2::SnapshotPhase::Failed as i32);
    assert_code(
        v.create_sandbox(create_request("fsb-from-broken", "osb-snap-broken"))
            .await,
        Code::FailedPrecondition,
        &["FAILED", &broken.identity.unwrap().name],
    );

    // Deleted by its request id once its restores are gone.
    for name in ["fsb-restored", "fsb-by-id"] {
        delete(&mut v, name).await;
    }
    v.delete_sandbox_snapshot(v2::DeleteSandboxSnapshotRequest {
        snapshot: Some(v2::SandboxReference {
            namespaced_name: Some(named("osb-snap-one")),
            expected_uid: String::new(),
        }),
    })
    .await
    .unwrap();
    eventually("the snapshot is gone", async || {
        get_snapshot(&mut v, "osb-snap-one")
            .await
            .is_err_and(|e| e.code() == Code::NotFound)
    })
    .await;
    assert!(
        a.state
            .snapshot_calls
            .lock()
            .contains(&format!("delete {id}")),
        "the capture is removed on its agent: {:?}",
        a.state.snapshot_calls.lock()
    );
    h.shutdown().await;
}
