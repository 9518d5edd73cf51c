//! FastPath v2 over the Kubernetes store, driven the way the OpenSandbox
//! server 1.1.1 drives it (`services/fast_sandbox/service.py`): every
//! precondition it sends comes from the Sandbox resource it reads —
//! `expected_uid` = `metadata.uid`, `expected_generation` =
//! `metadata.generation` — except renew, which takes both from GetSandbox.
//! The resource lives on the Kubernetes API double (`sandbolt-kube-double`,
//! which assigns uids and counts generations as an API server does); the
//! agent is a stand-in (see `support/standin.rs`): these tests are about the
//! records and the resource, not containers.

use crate::support;

use kube::ResourceExt;
use sandbolt_controller::SandboxKey;
use sandbolt_deploy::Sandbox;
use sandbolt_deploy::sandbox::{ActionState, RuntimeState};
use sandbolt_proto::agent::v1 as agentpb;
use sandbolt_proto::fastpath::v2;
use support::eventually;
use support::kube_bed::{self, KubeBed as Bed};
use tonic::Code;

const NS: &str = "opensandbox";
const NAME: &str = "fsb-ident-1";
const DENY_ALL_BUT_PYPI: &str =
    r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"pypi.org"}]}"#;

/// A controller over the Kubernetes store on the double (status published
/// every 100 ms), one stand-in agent, a FastPath v2 client.
async fn bed() -> Bed {
    kube_bed::start(NS, |_, _| {}).await
}

/// What the server sends: the name, and the uid it expects.
fn reference(uid: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: NS.into(),
            name: NAME.into(),
        }),
        expected_uid: uid.into(),
    })
}

fn egress(policy: &str) -> Vec<v2::ActionBinding> {
    vec![v2::ActionBinding {
        handler: "egress".into(),
        input: policy.into(),
    }]
}

/// The resource as the server reads it (a live GET, as after its
/// mutations): uid and generation.
async fn resource(bed: &Bed) -> (Sandbox, String, i64) {
    let obj = bed.sandboxes.get(NAME).await.expect("the Sandbox exists");
    let uid = obj.metadata.uid.clone().expect("the API server sets a uid");
    let generation = obj.metadata.generation.expect("and a generation");
    (obj, uid, generation)
}

/// The server's metadata PATCH: preconditions from the resource.
async fn patch_metadata(bed: &mut Bed, key: &str, value: &str) -> Result<i64, tonic::Status> {
    let (_, uid, generation) = resource(bed).await;
    bed.v2
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference(&uid),
            expected_generation: generation,
            metadata_upsert: [(key.to_string(), value.to_string())].into(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().committed_generation)
}

/// GetSandbox by name, as the server's renew calls it.
async fn get_sandbox(bed: &mut Bed) -> v2::GetSandboxResponse {
    bed.v2
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference(""),
            expected_generation: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

fn runtime_state(obj: &Sandbox) -> Option<RuntimeState> {
    obj.status.as_ref()?.runtime.as_ref().map(|r| r.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_names_sandboxes_by_the_resources_uid_and_generation() {
    let mut bed = bed().await;

    // Create (template mode: an egress binding, an expiry).
    let created = bed
        .v2
        .create_sandbox(v2::CreateSandboxRequest {
            request_id: NAME.into(),
            namespace: NS.into(),
            image: "busybox".into(),
            expires_at_unix_seconds: sandbolt_controller::clock::now_unix_secs() + 3600,
            completion: v2::CreateCompletion::Ready as i32,
            action_bindings: egress(DENY_ALL_BUT_PYPI),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (obj, cr_uid, cr_generation) = resource(&bed).await;
    let info = created.sandbox.unwrap();
    assert_eq!(
        info.identity.unwrap().uid,
        cr_uid,
        "v2 speaks the resource's uid"
    );
    assert_eq!(created.generation, cr_generation);
    let key = SandboxKey::new(NS, NAME);
    let record = bed.controller.core().store().get(&key).unwrap().unwrap();
    assert_ne!(
        record.uid, cr_uid,
        "the controller's uid stays the container's"
    );
    // The shape the server reads: bindings beside the structured policy,
    // their delivery in the status, ready at the current generation.
    assert_eq!(obj.spec.action_bindings.len(), 1);
    assert_eq!(obj.spec.action_bindings[0].handler, "egress");
    assert_eq!(obj.spec.action_bindings[0].input, DENY_ALL_BUT_PYPI);
    assert!(obj.spec.network_policy.is_some());
    assert!(obj.is_ready(), "{:?}", obj.status);
    let status = obj.status.clone().unwrap();
    assert_eq!(status.action_bindings[0].state, ActionState::Ready);
    assert_eq!(status.conditions[0].reason, "Running");

    // Metadata PATCH twice: labels only, so the resource's generation stays
    // (the record's own moves on) and each patch passes.
    for (i, value) in ["one", "two"].into_iter().enumerate() {
        let committed = patch_metadata(&mut bed, "stage", value)
            .await
            .unwrap_or_else(|e| panic!("patch {i}: {e:?}"));
        let (obj, _, generation) = resource(&bed).await;
        assert_eq!(committed, generation);
        assert_eq!(generation, cr_generation, "labels are no spec change");
        assert_eq!(obj.labels()["metadata.sandbox.fast.io/stage"], value);
    }
    let record = bed.controller.core().store().get(&key).unwrap().unwrap();
    assert!(record.generation > 1, "the record counted both patches");

    // Pause and resume with the resource's uid; a patch after the pause
    // still matches the resource's generation.
    bed.v2
        .pause_sandbox(v2::PauseSandboxRequest {
            request_id: "pause-1".into(),
            sandbox: reference(&cr_uid),
            expected_generation: 0,
        })
        .await
        .unwrap();
    let (obj, _, _) = resource(&bed).await;
    assert_eq!(runtime_state(&obj), Some(RuntimeState::Paused));
    patch_metadata(&mut bed, "paused", "yes").await.unwrap();
    bed.v2
        .resume_sandbox(v2::ResumeSandboxRequest {
            request_id: "resume-1".into(),
            sandbox: reference(&cr_uid),
            ..Default::default()
        })
        .await
        .unwrap();
    let (obj, _, _) = resource(&bed).await;
    assert!(obj.is_ready(), "{:?}", obj.status);

    // The server's network-policy PUT: the bindings replaced whole under the
    // resource's uid and generation. A spec change: the generation moves,
    // and the status has observed it by the time the call returns.
    let open = r#"{"defaultAction":"allow","egress":[{"action":"deny","target":"10.0.0.0/8"}]}"#;
    let (_, uid, generation) = resource(&bed).await;
    let replace = |generation: i64| v2::UpdateSandboxRequest {
        sandbox: reference(&uid),
        expected_generation: generation,
        update: Some(v2::update_sandbox_request::Update::ActionBindings(
            v2::ReplaceActionBindings {
                items: egress(open),
            },
        )),
        ..Default::default()
    };
    let committed = bed
        .v2
        .update_sandbox(replace(generation))
        .await
        .unwrap()
        .into_inner()
        .committed_generation;
    let (obj, _, new_generation) = resource(&bed).await;
    assert_eq!(new_generation, generation + 1);
    assert_eq!(committed, new_generation);
    assert_eq!(obj.spec.action_bindings[0].input, open);
    assert_eq!(
        obj.status.as_ref().unwrap().observed_generation,
        Some(new_generation)
    );
    assert!(obj.is_ready(), "no lag behind the spec: {:?}", obj.status);
    assert!(
        bed.agent
            .state
            .policies
            .lock()
            .values()
            .any(|p| p.contains("10.0.0.0/8")),
        "the agent got the new policy"
    );
    // The generation read before the change is stale now.
    let stale = bed.v2.update_sandbox(replace(generation)).await;
    assert_eq!(stale.unwrap_err().code(), Code::Aborted);

    // Renew as the server does: uid and generation from GetSandbox.
    let got = get_sandbox(&mut bed).await;
    assert_eq!(got.generation, new_generation);
    let identity = got.sandbox.unwrap().identity.unwrap();
    assert_eq!(identity.uid, cr_uid);
    let expires = sandbolt_controller::clock::now_unix_secs() + 7200;
    bed.v2
        .update_sandbox(v2::UpdateSandboxRequest {
            sandbox: reference(&identity.uid),
            expected_generation: got.generation,
            update: Some(v2::update_sandbox_request::Update::ExpiresAtUnixSeconds(
                expires,
            )),
            ..Default::default()
        })
        .await
        .unwrap();
    let (obj, _, generation) = resource(&bed).await;
    assert_eq!(generation, new_generation + 1);
    assert_eq!(
        obj.spec.expire_time.as_ref().unwrap().0.as_second(),
        expires
    );
    assert!(
        obj.is_ready(),
        "Running right after a renew: {:?}",
        obj.status
    );

    // Someone else's uid names no sandbox of ours.
    let wrong = bed
        .v2
        .delete_sandbox(v2::DeleteRequest {
            sandbox: reference("0b5c-not-this-one"),
        })
        .await;
    assert_eq!(wrong.unwrap_err().code(), Code::NotFound);

    // Delete with the resource's uid: the resource goes.
    bed.v2
        .delete_sandbox(v2::DeleteRequest {
            sandbox: reference(&cr_uid),
        })
        .await
        .unwrap();
    let sandboxes = bed.sandboxes.clone();
    eventually("the Sandbox is deleted", async || {
        sandboxes.get_opt(NAME).await.unwrap().is_none()
    })
    .await;
    bed.controller.shutdown().await;
    bed.api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exited_container_shows_in_the_resources_status() {
    let mut bed = bed().await;
    bed.v2
        .create_sandbox(v2::CreateSandboxRequest {
            request_id: NAME.into(),
            namespace: NS.into(),
            image: "busybox".into(),
            completion: v2::CreateCompletion::Ready as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    let (obj, _, _) = resource(&bed).await;
    assert!(obj.is_ready());
    let record = bed
        .controller
        .core()
        .store()
        .get(&SandboxKey::new(NS, NAME))
        .unwrap()
        .unwrap();
    let agent = bed.agent.state.clone();
    let set_phase = |phase: agentpb::SandboxPhase, exit_code: i32| {
        let mut table = agent.sandboxes.lock();
        let s = table.get_mut(record.sandbox_id.as_str()).unwrap();
        s.phase = phase as i32;
        s.exit_code = exit_code;
    };

    // The agent reports the entrypoint failed: no record write, yet the
    // resource says so, as GetSandbox does.
    set_phase(agentpb::SandboxPhase::Failed, 3);
    let sandboxes = bed.sandboxes.clone();
    eventually("the status says the container failed", async || {
        let obj = sandboxes.get(NAME).await.unwrap();
        runtime_state(&obj) == Some(RuntimeState::Failed)
            && obj.ready_condition().unwrap().reason == "ContainerFailed"
    })
    .await;
    let obj = bed.sandboxes.get(NAME).await.unwrap();
    assert!(
        obj.ready_condition().unwrap().message.contains('3'),
        "{:?}",
        obj.ready_condition()
    );
    let got = get_sandbox(&mut bed).await;
    assert_eq!(
        got.sandbox.unwrap().runtime.unwrap().state,
        v2::RuntimeState::Failed as i32
    );
    // A write while it is so (a metadata patch) keeps saying so.
    patch_metadata(&mut bed, "k", "v").await.unwrap();
    let obj = bed.sandboxes.get(NAME).await.unwrap();
    assert_eq!(runtime_state(&obj), Some(RuntimeState::Failed));

    // A clean exit reads Stopped (the server's Terminated); running again,
    // ready again.
    set_phase(agentpb::SandboxPhase::Stopped, 0);
    eventually("the status says the container stopped", async || {
        runtime_state(&sandboxes.get(NAME).await.unwrap()) == Some(RuntimeState::Stopped)
    })
    .await;
    set_phase(agentpb::SandboxPhase::Running, 0);
    eventually("the status is ready again", async || {
        sandboxes.get(NAME).await.unwrap().is_ready()
    })
    .await;
    bed.controller.shutdown().await;
    bed.api.shutdown().await;
}
