//! Controller HA on Kubernetes: two `sandbolt-controller` processes over
//! the Kubernetes store, a Lease between them, a real agent on the test bed.
//! The API server is the in-process double (no real one can be installed
//! here); the controllers reach it over HTTP through a kubeconfig, as they
//! would a cluster.
//!
//! Both replicas are configured with the same listen address, the way a
//! Service fronts them: only the leader binds it, so the agent's heartbeats
//! follow the leadership without knowing about it.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use sandbolt_deploy::pool::CapacityBounds;
use sandbolt_deploy::{Sandbox, SandboxPool, SandboxPoolSpec};
use sandbolt_e2e::bed::{
    Native, V2, busybox_create, connect, containers, eventually, free_port, native_busybox_create,
    native_limits, native_ref, reference, running_tasks, sandbox_id, start_agent, start_bed,
    wait_agents,
};
use sandbolt_e2e::controller_process::ControllerProcess;
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2;

const TOKEN: &str = "ha-agent-token";
const NAMESPACE: &str = "sandbolt-system";
const LEASE: &str = "sandbolt-controller";

/// A controller replica (`sandbolt controller` over the Kubernetes store,
/// identity `identity`) as a child process; killed on drop. Not waited for:
/// only the leader ever says it serves.
fn spawn_replica(identity: &str, listen: SocketAddr, kubeconfig: &Path) -> ControllerProcess {
    // One token key for both replicas, as the chart's Secret gives them:
    // the standby derives the tokens the leader handed out.
    let token_key = kubeconfig.with_file_name("token.key");
    if !token_key.exists() {
        std::fs::write(&token_key, "0123456789abcdef0123456789abcdef").unwrap();
    }
    // Likewise one identity key: agents' credentials hold on both.
    let identity_key = kubeconfig.with_file_name("identity.key");
    if !identity_key.exists() {
        std::fs::write(&identity_key, "fedcba9876543210fedcba9876543210").unwrap();
    }
    let env = [
        ("SANDBOLT_TOKEN_KEY_FILE", token_key.display().to_string()),
        (
            "SANDBOLT_IDENTITY_KEY_FILE",
            identity_key.display().to_string(),
        ),
        ("SANDBOLT_STORE", "kubernetes".to_string()),
        ("SANDBOLT_POD_NAMESPACE", NAMESPACE.to_string()),
        ("SANDBOLT_POD_NAME", identity.to_string()),
        ("SANDBOLT_LEASE_DURATION", "3s".to_string()),
        ("SANDBOLT_RENEW_DEADLINE", "2s".to_string()),
        ("SANDBOLT_LEASE_RETRY", "600ms".to_string()),
        ("KUBECONFIG", kubeconfig.display().to_string()),
        (
            "SANDBOLT_DATA_DIR",
            "/nonexistent-kube-store-needs-none".to_string(),
        ),
        ("SANDBOLT_FASTPATH_LISTEN", listen.to_string()),
        ("SANDBOLT_AGENT_TOKEN", TOKEN.to_string()),
        ("SANDBOLT_CONSISTENCY", "strong".to_string()),
        ("SANDBOLT_HEARTBEAT_INTERVAL", "100ms".to_string()),
        ("SANDBOLT_AGENT_LOST_TIMEOUT", "3s".to_string()),
        ("SANDBOLT_STARTUP_GRACE", "3s".to_string()),
        ("SANDBOLT_EXPIRY_SWEEP_INTERVAL", "100ms".to_string()),
        ("SANDBOLT_LOG", "sandbolt_controller=info".to_string()),
    ];
    let binary = Path::new(env!("CARGO_BIN_EXE_e2e-sandbolt"));
    ControllerProcess::spawn(
        identity,
        &mut ControllerProcess::command(binary, &env),
        kubeconfig.with_file_name(format!("{identity}.log")),
    )
}

fn kubeconfig(api: &ApiDouble, dir: &Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {}\n\
             contexts:\n- name: double\n  context:\n    cluster: double\n    user: double\n    namespace: {NAMESPACE}\n\
             current-context: double\nusers:\n- name: double\n  user:\n    token: {}\n",
            api.url(),
            api.token()
        ),
    )
    .unwrap();
    path
}

async fn holder(api: &ApiDouble) -> (Option<String>, i32) {
    let lease = Api::<Lease>::namespaced(api.client(), NAMESPACE)
        .get(LEASE)
        .await
        .expect("the controller lease exists");
    let spec = lease.spec.unwrap_or_default();
    (spec.holder_identity, spec.lease_transitions.unwrap_or(0))
}

async fn create(c: &mut V2, name: &str) -> v2::CreateSandboxResponse {
    c.create_sandbox(busybox_create(name, 0))
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e:?}"))
        .into_inner()
}

/// A sandbox with limits and an expiry, through the native API.
async fn create_native(c: &mut Native, name: &str, expires_at: i64) -> native::Sandbox {
    let spec = native::SandboxSpec {
        expires_at_unix_seconds: expires_at,
        resources: native_limits("250m", "48Mi", 64),
        metadata: [("team".to_string(), "ha".to_string())].into(),
        ..Default::default()
    };
    c.create_sandbox(native_busybox_create(name, spec))
        .await
        .unwrap_or_else(|e| panic!("native create {name}: {e:?}"))
        .into_inner()
}

async fn get_native(c: &mut Native, name: &str) -> Result<native::Sandbox, tonic::Status> {
    c.get_sandbox(native::GetSandboxRequest {
        sandbox: native_ref(name),
    })
    .await
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_killed_leader_with_the_records() {
    let bed = start_bed().await;
    let api = ApiDouble::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(&api, dir.path());
    let listen = free_port();

    // The chart's pool resource: the leader keeps its status counts.
    let pools: Api<SandboxPool> = Api::namespaced(api.client(), NAMESPACE);
    pools
        .create(
            &Default::default(),
            &SandboxPool::new(
                "default",
                SandboxPoolSpec {
                    limits: None,
                    node_selector: Default::default(),
                    max_sandboxes_per_agent: 8,
                    runtime: Default::default(),
                    warm_images: vec![],
                    capacity: Some(CapacityBounds {
                        min_agents: None,
                        max_sandboxes: Some(6),
                    }),
                },
            ),
        )
        .await
        .unwrap();

    let mut a = spawn_replica("replica-a", listen, &kubeconfig);
    assert!(
        a.wait_serving(Duration::from_secs(30)).is_some(),
        "replica-a leads"
    );
    let mut b = spawn_replica("replica-b", listen, &kubeconfig);
    // The standby campaigns but does not serve while the leader renews:
    // nothing must happen for 4 s, so this wait runs to its end.
    assert!(
        b.wait_serving(Duration::from_secs(4)).is_none(),
        "the standby must not serve while the leader holds the lease"
    );
    assert_eq!(holder(&api).await.0.as_deref(), Some("replica-a"));

    let state = tempfile::tempdir().unwrap();
    let _agent = start_agent(
        &bed,
        "agent-ha",
        state.path(),
        listen,
        TOKEN,
        8,
        Duration::from_millis(100),
    )
    .await;
    let mut c = connect(listen).await;
    wait_agents(&c, 1).await;
    let first = create(&mut c, "fsb-ha-1").await;
    assert!(first.sandbox.unwrap().ready);
    let first_id = sandbox_id(&mut c, "fsb-ha-1").await;
    let sandboxes: Api<Sandbox> = Api::namespaced(api.client(), "default");
    assert!(sandboxes.get("fsb-ha-1").await.unwrap().is_ready());
    eventually(
        "the pool status counts the agent and the sandbox",
        Duration::from_secs(20),
        || {
            let pools = pools.clone();
            async move {
                let status = pools.get("default").await.unwrap().status;
                status.is_some_and(|s| {
                    (s.agents, s.ready_agents, s.sandboxes, s.capacity) == (1, 1, 1, 6)
                })
            }
        },
    )
    .await;

    // The whole sandbox through the native API: limits, expiry, times. A
    // stateless lifecycle renders exactly this, so if it survives a leader
    // change unchanged, every REST answer does too.
    let mut n = Native::connect(format!("http://{listen}")).await.unwrap();
    let expires_at = sandbolt_controller::clock::now_unix_secs() + 25;
    let ttl = create_native(&mut n, "fsb-ha-ttl", expires_at).await;
    let ttl_status = ttl.status.clone().unwrap();
    assert_eq!(ttl_status.phase, native::Phase::Running as i32);
    assert!(ttl_status.created_at_unix_ms > 0);
    let before = get_native(&mut n, "fsb-ha-ttl").await.unwrap();
    let limits = before
        .spec
        .as_ref()
        .and_then(|s| s.resources.clone())
        .and_then(|r| r.limits)
        .unwrap();
    assert_eq!(
        (limits.cpu.as_str(), limits.memory.as_str(), limits.pids),
        ("250m", "48Mi", 64)
    );

    // The leader dies without a word.
    let (_, term_before) = holder(&api).await;
    a.kill9();
    assert!(
        b.wait_serving(Duration::from_secs(30)).is_some(),
        "the standby takes over once the lease expires"
    );
    let (who, term) = holder(&api).await;
    assert_eq!(who.as_deref(), Some("replica-b"));
    assert_eq!(term, term_before + 1, "one leadership transition");

    // The new leader rebuilt its registry from the Sandbox resources.
    let mut c = connect(listen).await;
    let got = c
        .get_sandbox(v2::GetSandboxRequest {
            sandbox: reference("fsb-ha-1"),
            expected_generation: 0,
        })
        .await
        .expect("the record survives the leader")
        .into_inner();
    assert_eq!(
        got.sandbox.unwrap().runtime.unwrap().state,
        v2::RuntimeState::Ready as i32
    );
    assert_eq!(sandbox_id(&mut c, "fsb-ha-1").await, first_id);
    assert!(running_tasks(&bed).await.contains_key(&first_id));

    // Once the agent heartbeats to the new leader, the native answer is the
    // one the old leader gave, field for field (spec, uid, generation,
    // creation and transition times, expiry, limits, container).
    wait_agents(&c, 1).await;
    let mut n = Native::connect(format!("http://{listen}")).await.unwrap();
    let after = get_native(&mut n, "fsb-ha-ttl").await.unwrap();
    assert_eq!(after, before, "a leader change changes no answer");
    // And the TTL still ends it on time, now on the new leader's sweep.
    eventually(
        "the TTL sandbox expires on the new leader",
        Duration::from_secs(40),
        || {
            let mut n = n.clone();
            async move {
                matches!(
                    get_native(&mut n, "fsb-ha-ttl").await,
                    Err(s) if s.code() == tonic::Code::NotFound
                )
            }
        },
    )
    .await;
    let now = sandbolt_controller::clock::now_unix_secs();
    assert!(now >= expires_at, "expired early: {now} < {expires_at}");
    assert!(
        now <= expires_at + 10,
        "expired late: {now} > {expires_at} + 10"
    );
    assert!(
        !containers(&bed).await.contains(&ttl_status.container_id),
        "the expired sandbox's container is gone"
    );

    // And it writes: a new sandbox, then a delete that empties the resource.
    wait_agents(&c, 1).await;
    let second = create(&mut c, "fsb-ha-2").await;
    assert!(second.sandbox.unwrap().ready);
    c.delete_sandbox(v2::DeleteRequest {
        sandbox: reference("fsb-ha-1"),
    })
    .await
    .expect("delete through the new leader");
    assert!(sandboxes.get_opt("fsb-ha-1").await.unwrap().is_none());
    assert!(!containers(&bed).await.contains(&first_id));

    // kubectl delete: the leader removes the container, then the resource.
    let second_id = sandbox_id(&mut c, "fsb-ha-2").await;
    sandboxes
        .delete("fsb-ha-2", &Default::default())
        .await
        .unwrap();
    eventually(
        "kubectl delete reaches the container",
        Duration::from_secs(20),
        || {
            let sandboxes = sandboxes.clone();
            let bed = &bed;
            let second_id = second_id.clone();
            async move {
                sandboxes.get_opt("fsb-ha-2").await.unwrap().is_none()
                    && !containers(bed).await.contains(&second_id)
            }
        },
    )
    .await;

    // A graceful stop hands the lease back at once.
    assert!(b.stop().success(), "a graceful stop exits 0");
    assert_eq!(holder(&api).await.0, None, "the lease was released");
}
