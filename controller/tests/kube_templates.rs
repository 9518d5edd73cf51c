//! SandboxTemplates on the Kubernetes store, against the in-process API
//! double (`sandbolt-kube-double`, serving the CRD from `deploy/crds/`):
//! the leader marks each template `Succeeded` or `Failed` as the
//! OpenSandbox server waits for, and a FastPath create whose image is a
//! template's name (what the server sends) runs the template's image with
//! its env, limits and entrypoint — as recorded in the Sandbox resource and
//! as the agent (a stand-in) was asked to create it.
//!
//! The store blocks its caller for API round trips: multi-threaded runtime.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{CustomResourceExt, Resource};
use sandbolt_controller::ha::{StatusApis, run_elected};
use sandbolt_controller::leader::{LeaderElector, LeaseConfig};
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_deploy::template::TemplatePhase;
use sandbolt_deploy::{Sandbox, SandboxTemplate};
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::fastpath::v2;
use serde_json::json;
use support::standin::{StandInAgent, create_request};
use support::{HB, standin_config};
use tonic::Code;
use tonic::transport::Channel;

/// The controller's namespace (its Leases).
const NS: &str = "sandbolt-system";
/// The OpenSandbox server's namespace: its templates and sandboxes.
const TENANT: &str = "opensandbox";
const GOOD: &str = "tpl-0b4b7c1e-3c1f-4a57-9d7e-2f1d1b0b9c11";
const BAD: &str = "tpl-5a0d2f9e-8d4c-4c1b-9f3e-7b6a5c4d3e21";
/// A template made with kubectl, named for people; creates use its
/// `spec.indexKey`.
const KEYED: &str = "python-tools";
const KEYED_INDEX: &str = "tpl-9c8b7a6f-5e4d-4c3b-8a29-1f0e0d0c0b0a";

type V2 = v2::fast_path_service_client::FastPathServiceClient<Channel>;

/// A SandboxTemplate as the OpenSandbox server 1.1.1 writes it
/// (`template_service.py::_build_crd`).
fn server_template(name: &str, image: &str) -> serde_json::Value {
    json!({
        "apiVersion": "sandbox.fast.io/v1alpha2",
        "kind": "SandboxTemplate",
        "metadata": {"name": name, "namespace": TENANT, "labels": {"team": "a"}},
        "spec": {
            "image": image,
            "indexKey": name,
            "entrypoint": ["tail", "-f", "/dev/null"],
            "execd": "opensandbox/execd:v1",
            "kernel": "vmlinux.bin",
            "machine": {"vcpu": "1", "memory": "512Mi"},
            "output": {
                "rootfsSize": "2Gi",
                "format": "overlaybd",
                "publish": "s3://unused/x",
                "publishSecretRef": {"name": "sandbox-oss-credentials"}
            },
            "envs": [{"name": "FROM_TEMPLATE", "value": "yes"}, {"name": "SHARED", "value": "template"}],
            "readiness": {}
        }
    })
}

fn templates_raw(api: &ApiDouble) -> Api<DynamicObject> {
    Api::namespaced_with(
        api.client(),
        TENANT,
        &ApiResource::erase::<SandboxTemplate>(&()),
    )
}

async fn create_template(api: &ApiDouble, body: serde_json::Value) {
    let obj: DynamicObject = serde_json::from_value(body).unwrap();
    templates_raw(api)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
}

/// Waits until `name`'s status describes generation `generation`.
async fn status_of(api: &ApiDouble, name: &str, generation: i64) -> SandboxTemplate {
    let typed: Api<SandboxTemplate> = Api::namespaced(api.client(), TENANT);
    let name = name.to_string();
    sandbolt_test_support::eventually_async(
        &format!("the leader writes {name}'s status for generation {generation}"),
        Duration::from_secs(30),
        || {
            let (typed, name) = (typed.clone(), name.clone());
            async move {
                let t = typed.get(&name).await.ok()?;
                let s = t.status.as_ref()?;
                (s.observed_generation == Some(generation) && s.phase.is_some()).then_some(t)
            }
        },
    )
    .await
}

/// A create as the OpenSandbox server sends it in template mode: the
/// template id as the image, the template's entrypoint as the command.
fn template_create(request_id: &str, image: &str) -> v2::CreateSandboxRequest {
    let mut req = create_request(request_id, sandbolt_test_support::now_unix_secs() + 600);
    req.namespace = TENANT.into();
    req.image = image.into();
    req.pool_ref = "default".into();
    req.command = vec!["tail".into(), "-f".into(), "/dev/null".into()];
    req
}

/// A leader over the Kubernetes store on `api` with the template
/// reconciler, listening on a free port; the stop sender ends it.
fn start_leader(
    api: &ApiDouble,
    dir: &std::path::Path,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let lease = LeaseConfig::new(NS, "sandbolt-controller", "ctrl-a").with_timings(
        Duration::from_millis(1500),
        Duration::from_millis(1000),
        Duration::from_millis(200),
    );
    let elector = LeaderElector::spawn(api.client(), lease).unwrap();
    let mut cfg = standin_config(dir);
    let addr: SocketAddr = ([127, 0, 0, 1], sandbolt_test_support::free_port()).into();
    cfg.listen = addr;
    let kube_config = api.config();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(run_elected(
        cfg,
        elector,
        move || {
            let store = KubeStore::open(kube_config, KubeStoreConfig::new(NS))?;
            Ok(std::sync::Arc::new(store) as _)
        },
        Some(StatusApis::namespaced(api.client(), NS)),
        |_| {},
        async move {
            let _ = stopped.await;
        },
    ));
    (addr, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_publishes_template_phases_and_creates_run_the_template() {
    let api = ApiDouble::start().await;
    let crd = sandbolt_deploy::crd::to_yaml(&SandboxTemplate::crd()).unwrap();
    api.register_crd(&crd).unwrap();
    create_template(&api, server_template(GOOD, "busybox:1.36")).await;
    create_template(&api, server_template(BAD, "Not An Image!")).await;
    let mut keyed = server_template(KEYED, "python:3.12");
    keyed["spec"]["indexKey"] = json!(KEYED_INDEX);
    keyed["spec"]["machine"] = json!({"vcpu": 2});
    create_template(&api, keyed).await;

    let dir = tempfile::tempdir().unwrap();
    let (addr, stop) = start_leader(&api, dir.path());
    sandbolt_test_support::wait_for_port(addr, Duration::from_secs(30)).await;

    // The phases the OpenSandbox server waits for.
    let good = status_of(&api, GOOD, 1).await;
    let s = good.status.unwrap();
    assert_eq!(s.phase, Some(TemplatePhase::Succeeded));
    assert_eq!(
        s.manifest_ref.as_deref(),
        Some("docker.io/library/busybox:1.36")
    );
    let ready = &s.conditions[0];
    assert_eq!(
        (ready.type_.as_str(), ready.status.as_str()),
        ("Ready", "True")
    );
    for field in ["execd", "kernel", "output", "readiness"] {
        assert!(ready.message.contains(field), "{}", ready.message);
    }
    let bad = status_of(&api, BAD, 1).await.status.unwrap();
    assert_eq!(bad.phase, Some(TemplatePhase::Failed));
    assert_eq!(bad.manifest_ref, None);
    // The server shows the Failed condition's message.
    assert_eq!(bad.conditions[0].type_, "Failed");
    assert!(
        bad.conditions[0].message.contains("spec.image"),
        "{:?}",
        bad.conditions
    );

    let agent = StandInAgent::start("agent-1", "default", 8, &["busybox"], addr, HB).await;
    let mut fp = V2::connect(format!("http://{addr}")).await.unwrap();
    check_template_creates(&api, &agent, &mut fp).await;
    check_refused_creates(&mut fp).await;

    // An edit is a new generation, assessed again.
    templates_raw(&api)
        .patch(
            GOOD,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"image": "alpine:3.20"}})),
        )
        .await
        .unwrap();
    let edited = status_of(&api, GOOD, 2).await.status.unwrap();
    assert_eq!(
        edited.manifest_ref.as_deref(),
        Some("docker.io/library/alpine:3.20")
    );
    // The Ready condition stayed True: its transition time stays.
    assert_eq!(
        edited.conditions[0].last_transition_time,
        ready.last_transition_time
    );
    let _ = stop.send(());
}

/// The spec the agent was asked to create sandbox `name` with.
fn sent_spec(agent: &StandInAgent, name: &str) -> sandbolt_proto::agent::v1::SandboxSpec {
    let specs = agent.state.specs.lock();
    let spec = specs
        .values()
        .find(|s| s.name == name && s.namespace == TENANT);
    spec.cloned()
        .unwrap_or_else(|| panic!("the agent was not asked to create {name}"))
}

/// Creates naming a template by name and by index key run its image with
/// its defaults under the request's own.
async fn check_template_creates(api: &ApiDouble, agent: &StandInAgent, fp: &mut V2) {
    let mut req = template_create("fsb-by-name", GOOD);
    req.envs.insert("SHARED".into(), "request".into());
    fp.create_sandbox(req).await.unwrap();
    let sent = sent_spec(agent, "fsb-by-name");
    assert_eq!(sent.image, "busybox:1.36");
    assert_eq!(sent.command, ["tail", "-f", "/dev/null"]);
    assert_eq!(sent.envs["FROM_TEMPLATE"], "yes");
    assert_eq!(sent.envs["SHARED"], "request", "the request's env wins");
    let limits = sent.resources.unwrap();
    assert_eq!(
        (limits.cpu.as_str(), limits.memory.as_str()),
        ("1", "512Mi")
    );

    // The record holds the resolved spec: recovery needs no template.
    let sandboxes: Api<Sandbox> = Api::namespaced(api.client(), TENANT);
    let cr = sandboxes.get("fsb-by-name").await.unwrap();
    assert_eq!(cr.spec.image, "busybox:1.36");
    assert_eq!(cr.spec.env["FROM_TEMPLATE"], "yes");
    let resources = cr.spec.resources.as_ref().unwrap();
    assert_eq!(resources.limits["cpu"], "1");
    assert_eq!(resources.limits["memory"], "512Mi");
    assert_eq!(cr.meta().namespace.as_deref(), Some(TENANT));

    // By spec.indexKey; a numeric vcpu is a limit too.
    fp.create_sandbox(template_create("fsb-by-key", KEYED_INDEX))
        .await
        .unwrap();
    let sent = sent_spec(agent, "fsb-by-key");
    assert_eq!(sent.image, "python:3.12");
    assert_eq!(sent.resources.unwrap().cpu, "2");

    // Images that name no template are images.
    fp.create_sandbox(template_create("fsb-plain", "busybox"))
        .await
        .unwrap();
    let sent = sent_spec(agent, "fsb-plain");
    assert_eq!(sent.image, "busybox");
    assert!(!sent.envs.contains_key("FROM_TEMPLATE"));
}

/// A failed template, a template of another namespace and an unknown
/// template id are refused, naming what is wrong.
async fn check_refused_creates(fp: &mut V2) {
    let refused = |r: Result<tonic::Response<v2::CreateSandboxResponse>, tonic::Status>| {
        let e = r.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        e.message().to_string()
    };
    let why = refused(fp.create_sandbox(template_create("fsb-bad", BAD)).await);
    assert!(why.contains(BAD) && why.contains("spec.image"), "{why}");
    let unknown = "tpl-11111111-2222-4333-8444-555555555555";
    let why = refused(
        fp.create_sandbox(template_create("fsb-unknown", unknown))
            .await,
    );
    assert!(why.contains(unknown) && why.contains(TENANT), "{why}");
    let mut elsewhere = template_create("fsb-elsewhere", GOOD);
    elsewhere.namespace = "other-tenant".into();
    let why = refused(fp.create_sandbox(elsewhere).await);
    assert!(why.contains(GOOD) && why.contains("other-tenant"), "{why}");
}
