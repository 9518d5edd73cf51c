//! The controller + agent fixture: a private containerd (the test bed) with
//! busybox imported into [`NS`], real agents (`sandbolt_agent::Agent`)
//! bind-mounting the static execd and heartbeating to a real controller,
//! and the FastPath v2 calls the cross-component tests share. Containers
//! are counted through containerd itself, never through the controller or
//! the agent.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use sandbolt_agent::volume_store::{BackendChoice, VolumeStoreConfig};
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2;
use sandbolt_proto::wire::EXECD_PORT;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};

/// containerd namespace of the agents (and of the imported busybox).
pub const NS: &str = "k8s.io";

/// How long a fixture waits for agents to register.
const AGENTS_READY_WITHIN: Duration = Duration::from_secs(30);

pub type V2 = v2::fast_path_service_client::FastPathServiceClient<tonic::transport::Channel>;
pub type Native = native::sandbox_service_client::SandboxServiceClient<tonic::transport::Channel>;

pub fn init_tracing() {
    sandbolt_test_support::init_tracing("info");
}

/// A FastPath v2 client of the controller at `addr`.
pub async fn connect(addr: SocketAddr) -> V2 {
    V2::connect(format!("http://{addr}"))
        .await
        .unwrap_or_else(|e| panic!("connecting to the controller at {addr}: {e}"))
}

/// A v2 create of a long-sleeping busybox, named by its request id.
pub fn busybox_create(request_id: &str, expires_at: i64) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: request_id.into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "3600".into()],
        expires_at_unix_seconds: expires_at,
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    }
}

/// [`busybox_create`] (no expiry) with what happens when its agent is lost.
pub fn busybox_create_with_policy(
    request_id: &str,
    policy: v2::FailurePolicy,
    recovery_timeout_seconds: i32,
) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        failure_policy: policy as i32,
        recovery_timeout_seconds,
        ..busybox_create(request_id, 0)
    }
}

/// Native limits; an empty string or zero leaves that limit unset.
pub fn native_limits(cpu: &str, memory: &str, pids: i64) -> Option<native::Resources> {
    Some(native::Resources {
        limits: Some(native::ResourceList {
            cpu: cpu.into(),
            memory: memory.into(),
            pids,
            ..Default::default()
        }),
        requests: None,
    })
}

/// A native create of a long-sleeping busybox in `default` that waits for
/// ready, named by its request id; callers fill in the rest of the spec.
pub fn native_busybox_create(
    request_id: &str,
    spec: native::SandboxSpec,
) -> native::CreateSandboxRequest {
    native::CreateSandboxRequest {
        request_id: request_id.into(),
        namespace: "default".into(),
        wait_ready: true,
        spec: Some(native::SandboxSpec {
            image: "busybox".into(),
            command: vec!["sleep".into(), "3600".into()],
            ..spec
        }),
        ..Default::default()
    }
}

/// `default/<name>` for native calls, whatever its uid.
pub fn native_ref(name: &str) -> Option<native::SandboxRef> {
    Some(native::SandboxRef {
        namespace: "default".into(),
        name: name.into(),
        expected_uid: String::new(),
    })
}

/// The stored record of `default/<name>`; panics if there is none.
pub fn stored_record(
    ctl: &sandbolt_controller::ControllerHandle,
    name: &str,
) -> sandbolt_controller::store::SandboxRecord {
    ctl.core()
        .store()
        .get(&sandbolt_controller::SandboxKey::new("default", name))
        .expect("store read")
        .unwrap_or_else(|| panic!("record {name} exists"))
}

/// A private containerd with busybox in [`NS`].
pub async fn start_bed() -> Testbed {
    init_tracing();
    tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed (private containerd) must start");
        bed.import_image(&busybox_image().expect("busybox image"), NS)
            .expect("import busybox");
        bed
    })
    .await
    .expect("the test bed start does not panic")
}

/// The configuration of a real agent on `bed` that heartbeats to the
/// controller at `controller`, for a test to adjust before
/// [`Agent::start`]. `token` is both its API token and the one it presents
/// to the controller.
pub fn agent_config(
    bed: &Testbed,
    id: &str,
    state: &Path,
    controller: SocketAddr,
    token: &str,
) -> AgentConfig {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(id, bed.containerd_socket(), execd, state, token);
    cfg.controller_endpoint = Some(format!("http://{controller}"));
    cfg.controller_token = Some(token.into());
    cfg.stop_grace_period = Duration::from_secs(1);
    cfg
}

/// A volume pool for an agent `id` on `bed`: a sparse loop-backed btrfs
/// image of `size` bytes that the agent makes and mounts itself, image and
/// mount point both in the bed's private directory. The bed's teardown
/// (also of a bed whose test panicked, or of a crashed run's bed, swept by
/// the next) unmounts it and detaches its loop device; `testbed-leftovers`
/// reports any loop device or mount of it that survives.
pub fn loop_btrfs_volumes(bed: &Testbed, id: &str, size: u64) -> VolumeStoreConfig {
    VolumeStoreConfig {
        root: bed.root().join(format!("{id}-volumes")),
        backend: BackendChoice::Btrfs,
        loop_image: bed.root().join(format!("{id}-volumes.btrfs.img")),
        loop_size_bytes: size,
    }
}

/// A real agent ([`agent_config`]) with `capacity` slots, heartbeating
/// every `heartbeat`.
pub async fn start_agent(
    bed: &Testbed,
    id: &str,
    state: &Path,
    controller: SocketAddr,
    token: &str,
    capacity: u32,
    heartbeat: Duration,
) -> AgentHandle {
    let mut cfg = agent_config(bed, id, state, controller, token);
    cfg.heartbeat_interval = heartbeat;
    cfg.max_sandboxes = capacity;
    Agent::start(cfg).await.expect("agent starts")
}

/// An agent pod of `pool` on `node` as the chart's DaemonSet makes it;
/// returns its UID (set by the API server).
pub async fn create_agent_pod(pods: &Api<Pod>, name: &str, node: &str, pool: &str) -> String {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/component": "agent",
                "sandbolt.io/pool": pool,
            },
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "agent", "image": "sandbolt:test"}],
        },
    }))
    .expect("a valid pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod")
        .metadata
        .uid
        .expect("the API sets a uid")
}

/// Container ids in [`NS`], sorted, as containerd lists them.
pub async fn containers(bed: &Testbed) -> Vec<String> {
    on_bed(bed, |bed| bed.containers(NS)).await
}

/// Every task in [`NS`] as containerd lists it: id → (pid, status).
pub async fn tasks(bed: &Testbed) -> BTreeMap<String, (u32, String)> {
    on_bed(bed, |bed| bed.tasks(NS)).await
}

/// Tasks containerd reports as RUNNING in [`NS`]: id → pid.
pub async fn running_tasks(bed: &Testbed) -> BTreeMap<String, u32> {
    tasks(bed)
        .await
        .into_iter()
        .filter(|(_, (_, status))| status == "RUNNING")
        .map(|(id, (pid, _))| (id, pid))
        .collect()
}

/// Runs a blocking `ctr` query without stalling the runtime's other tasks
/// (the agents and the controller run on the same runtime).
async fn on_bed<T: Send>(
    bed: &Testbed,
    query: impl FnOnce(&Testbed) -> Result<T, sandbolt_testbed::TestbedError> + Send,
) -> T {
    tokio::task::block_in_place(|| query(bed)).expect("ctr answers")
}

/// Waits until the controller's `default` pool counts `n` ready agents.
pub async fn wait_agents(c: &V2, n: i32) {
    eventually(&format!("{n} agent(s) ready"), AGENTS_READY_WITHIN, || {
        let mut c = c.clone();
        async move {
            c.get_pool(v2::GetPoolRequest::default())
                .await
                .is_ok_and(|p| p.into_inner().ready_fastlets == n)
        }
    })
    .await;
}

/// Polls the async check `f` until it holds; panics after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    sandbolt_test_support::eventually_async(what, timeout, || {
        let check = f();
        async move { check.await.then_some(()) }
    })
    .await
}

/// Polls the synchronous check `f` until it holds; panics after `timeout`.
pub async fn eventually_true(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    sandbolt_test_support::eventually(what, timeout, || f().then_some(())).await
}

/// The v2 reference to `default/<name>`.
pub fn reference(name: &str) -> Option<v2::SandboxReference> {
    Some(v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    })
}

/// ResolveEndpoint of execd's port in `default/<name>`.
pub async fn resolve_execd(c: &mut V2, name: &str) -> v2::ResolveEndpointResponse {
    c.resolve_endpoint(v2::ResolveEndpointRequest {
        sandbox: reference(name),
        target: Some(v2::EndpointTarget {
            target: Some(v2::endpoint_target::Target::Port(u32::from(EXECD_PORT))),
        }),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("resolve endpoint of {name}: {e:?}"))
    .into_inner()
}

/// [`resolve_execd`] and `GET /ping` through the returned proxy endpoint
/// with the returned headers. Returns (proxy endpoint, status).
pub async fn ping_execd(c: &mut V2, name: &str) -> (String, u16) {
    let ep = resolve_execd(c, name).await;
    let headers: Vec<(String, String)> = ep.required_headers.into_iter().collect();
    let (status, _) = sandbolt_test_support::http::get(&ep.proxy_endpoint, "/ping", &headers).await;
    (ep.proxy_endpoint, status)
}

/// What the controller answers about `default/<name>` (GetSandboxDiagnostics).
pub async fn diagnostics(c: &mut V2, name: &str) -> v2::SandboxDiagnosticsResponse {
    c.get_sandbox_diagnostics(v2::SandboxDiagnosticsRequest {
        sandbox_name: name.into(),
        namespace: "default".into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("diagnostics of {name}: {e:?}"))
    .into_inner()
}

/// The sandbox id (= containerd container id) the controller's record of
/// `name` points at.
pub async fn sandbox_id(c: &mut V2, name: &str) -> String {
    diagnostics(c, name).await.runtime_instance_id
}

/// A free TCP port on 127.0.0.1 (bound, then released), so a controller
/// child can be restarted on the same address the agents heartbeat to.
pub fn free_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], sandbolt_test_support::free_port()))
}

/// Where the Debian CNI plugins live (the agents' default).
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// Networking for an agent of a test: its DNS proxy forwards to `upstream`
/// (a test DNS server; `127.0.0.1:9` when the test resolves no names), and
/// two namespaces are kept prepared.
pub fn test_network(upstream: SocketAddr) -> sandbolt_agent::config::NetworkConfig {
    let mut net = sandbolt_agent::config::NetworkConfig::new(vec![upstream]);
    net.pool_size = 2;
    net
}

/// Runs `body` on its own runtime with a fresh agent state directory for
/// agents with networking. When `body` panics, the runtime (and with it
/// every agent task holding the agent's subnet) is stopped and the agent's
/// network state is purged, so a failed run leaves no namespace, veth or
/// nftables table on the host. A passing `body` shuts its agents down and
/// the purge finds nothing left.
pub fn with_network_state<F: Future<Output = ()>>(body: impl FnOnce(std::path::PathBuf) -> F) {
    let state = tempfile::tempdir().expect("agent state dir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let path = state.path().to_path_buf();
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(body(path))));
    rt.shutdown_timeout(Duration::from_secs(10));
    if let Err(e) = sandbolt_agent::network::purge(state.path(), Path::new(CNI_BIN_DIR)) {
        eprintln!("purging the agent's network state: {e}");
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
