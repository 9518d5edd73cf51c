//! Warm pools through the controller against **real agents** on the test
//! bed (private containerd, runc, the static execd): the controller's
//! targets fill the agents' buffers, creates are served by claims (the
//! control API says `claimed_warm`), a plain create of the pool's image
//! claims too, `poolMax` refuses with RESOURCE_EXHAUSTED, buffers refill
//! after claims, and 200 creates against a buffer of 10 never fail and
//! never hand one sandbox to two creates (each sandbox sees only its own
//! marker file). Also WarmPoolService CRUD and validation, and FastPath
//! v2's GetPool/ListPools counts.

use crate::support;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_test_support::{eventually_async, http};
use sandbolt_testbed::{Testbed, execd_binary};
use support::{code, sref};
use tonic::Code;
use tonic::transport::Channel;

type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;
type Pools = native::warm_pool_service_client::WarmPoolServiceClient<Channel>;
type FastPath = fp::fast_path_service_client::FastPathServiceClient<Channel>;

const TOKEN: &str = "warm-pools-token";
const NS: &str = "k8s.io";
const HB: Duration = Duration::from_millis(200);
const WAIT: Duration = Duration::from_secs(90);
const EXECD_PORT: u32 = 44772;

fn controller_config(dir: &Path) -> ControllerConfig {
    let mut c = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, TOKEN);
    c.heartbeat_interval = HB;
    c.lost_agent_timeout = Duration::from_secs(5);
    c.create_deadline = Duration::from_secs(60);
    c
}

fn agent_config(bed: &Testbed, id: &str, state: &Path, ctl: &ControllerHandle) -> AgentConfig {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(id, bed.containerd_socket(), execd, state, TOKEN);
    cfg.node_name = format!("node-{id}");
    cfg.controller_endpoint = Some(format!("http://{}", ctl.local_addr()));
    cfg.controller_token = Some(TOKEN.into());
    cfg.heartbeat_interval = HB;
    cfg.max_sandboxes = 24;
    cfg.stop_grace_period = Duration::from_secs(1);
    cfg.warm_pool_interval = Duration::from_millis(300);
    cfg.warm_refill_pause = Duration::from_millis(10);
    cfg
}

struct World {
    ctl: ControllerHandle,
    agents: Vec<AgentHandle>,
    _states: Vec<tempfile::TempDir>,
    _ctl_dir: tempfile::TempDir,
    bed: Testbed,
}

impl World {
    async fn start() -> World {
        sandbolt_test_support::init_tracing("sandbolt_controller=info,sandbolt_agent=info");
        let bed = tokio::task::spawn_blocking(|| {
            Testbed::start_with_busybox(NS).expect("test bed (private containerd) with busybox")
        })
        .await
        .unwrap();
        let ctl_dir = tempfile::tempdir().unwrap();
        let ctl = Controller::start(controller_config(ctl_dir.path()))
            .await
            .unwrap();
        let mut agents = Vec::new();
        let mut states = Vec::new();
        for id in ["x", "y"] {
            let state = tempfile::tempdir().unwrap();
            let cfg = agent_config(&bed, id, state.path(), &ctl);
            agents.push(Agent::start(cfg).await.expect("agent starts"));
            states.push(state);
        }
        let core = ctl.core().clone();
        eventually_async("both agents registered", WAIT, || {
            let core = core.clone();
            async move { (core.registry().volume_nodes().len() == 2).then_some(()) }
        })
        .await;
        World {
            ctl,
            agents,
            _states: states,
            _ctl_dir: ctl_dir,
            bed,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.ctl.local_addr())
    }

    async fn clients(&self) -> (Native, Pools, FastPath) {
        (
            Native::connect(self.url()).await.unwrap(),
            Pools::connect(self.url()).await.unwrap(),
            FastPath::connect(self.url()).await.unwrap(),
        )
    }

    /// Waits until the pool reports `available` warm sandboxes.
    async fn available(&self, pools: &Pools, name: &str, available: i32) -> native::WarmPoolStatus {
        eventually_async(
            &format!("warm pool {name} available = {available}"),
            WAIT,
            || {
                let mut pools = pools.clone();
                let name = name.to_string();
                async move {
                    let p = pools
                        .get_warm_pool(native::WarmPoolRef { name })
                        .await
                        .ok()?
                        .into_inner();
                    p.status.filter(|s| s.available == available)
                }
            },
        )
        .await
    }

    async fn shutdown(self) {
        for a in self.agents {
            a.shutdown().await;
        }
        self.ctl.shutdown().await;
        let bed = self.bed;
        tokio::task::spawn_blocking(move || drop(bed))
            .await
            .unwrap();
    }
}

fn warm_pool(name: &str, cap: (i32, i32, i32, i32)) -> native::CreateWarmPoolRequest {
    native::CreateWarmPoolRequest {
        pool: Some(native::WarmPool {
            name: name.into(),
            template: Some(native::WarmTemplate {
                image: "busybox".into(),
                env: [("FROM_TEMPLATE".to_string(), "yes".to_string())].into(),
                ..Default::default()
            }),
            capacity: Some(native::WarmCapacity {
                buffer_min: cap.0,
                buffer_max: cap.1,
                pool_min: cap.2,
                pool_max: cap.3,
            }),
            ..Default::default()
        }),
    }
}

/// A create of `pool` (a warm pool's name: the image comes from it).
fn create(name: &str, pool: &str, image: &str) -> native::CreateSandboxRequest {
    native::CreateSandboxRequest {
        name: name.into(),
        wait_ready: true,
        spec: Some(native::SandboxSpec {
            pool: pool.into(),
            image: image.into(),
            command: vec!["sleep".into(), "600".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn status(s: &native::Sandbox) -> &native::SandboxStatus {
    s.status.as_ref().unwrap()
}

/// One call to the sandbox's execd through the agent's proxy.
async fn execd(c: &mut Native, name: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let ep = c
        .resolve_endpoint(native::ResolveEndpointRequest {
            sandbox: sref(name),
            port: EXECD_PORT,
        })
        .await
        .unwrap_or_else(|e| panic!("resolve execd of {name}: {e:?}"))
        .into_inner();
    let headers: Vec<(String, String)> = ep.headers.into_iter().collect();
    http::request(&ep.endpoint, method, path, &headers, body).await
}

async fn delete(c: &mut Native, name: &str) {
    c.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: sref(name),
    })
    .await
    .unwrap_or_else(|e| panic!("delete {name}: {e:?}"));
}

/// The record's events (FastPath v2 diagnostics), as one string.
async fn events(fastpath: &mut FastPath, name: &str) -> String {
    let d = fastpath
        .get_sandbox_diagnostics(fp::SandboxDiagnosticsRequest {
            namespace: "default".into(),
            sandbox_name: name.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    format!("{:?}", d.events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warm_pool_service_validates_and_fastpath_counts_on_real_agents() {
    let w = World::start().await;
    let (_, mut pools, mut fastpath) = w.clients().await;

    // Validation names the field; nothing is stored.
    let cases = [
        (warm_pool("Bad_Name", (1, 2, 0, 4)), "name "),
        (
            warm_pool("bb", (3, 2, 0, 4)),
            "capacity.bufferMin 3 is above",
        ),
        (
            warm_pool("bb", (0, 5, 0, 4)),
            "capacity.bufferMax 5 is above",
        ),
        (warm_pool("bb", (0, 2, 5, 4)), "capacity.poolMin 5 is above"),
        (warm_pool("bb", (-1, 2, 0, 4)), "capacity.bufferMin -1"),
    ];
    for (req, want) in cases {
        let (cd, msg) = code(pools.create_warm_pool(req).await);
        assert_eq!(cd, Code::InvalidArgument, "{msg}");
        assert!(msg.starts_with(want), "{msg:?} should start with {want:?}");
    }
    let mut no_image = warm_pool("bb", (1, 2, 0, 4));
    no_image
        .pool
        .as_mut()
        .unwrap()
        .template
        .as_mut()
        .unwrap()
        .image
        .clear();
    let (cd, msg) = code(pools.create_warm_pool(no_image).await);
    assert_eq!(
        (cd, msg.as_str()),
        (Code::InvalidArgument, "template.image is required")
    );
    assert!(
        pools
            .list_warm_pools(native::ListWarmPoolsRequest {})
            .await
            .unwrap()
            .into_inner()
            .items
            .is_empty()
    );

    // Create, duplicate, get, list, resize, delete.
    let made = pools
        .create_warm_pool(warm_pool("bb", (2, 2, 0, 6)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        made.template.as_ref().unwrap().image,
        "docker.io/library/busybox:latest"
    );
    assert_eq!(made.agent_pool, "default");
    assert!(made.created_at_unix_ms > 0);
    let (cd, _) = code(pools.create_warm_pool(warm_pool("bb", (2, 2, 0, 6))).await);
    assert_eq!(cd, Code::AlreadyExists);
    let (cd, _) = code(
        pools
            .get_warm_pool(native::WarmPoolRef {
                name: "nope".into(),
            })
            .await,
    );
    assert_eq!(cd, Code::NotFound);
    let bad = native::UpdateWarmPoolRequest {
        name: "bb".into(),
        capacity: Some(native::WarmCapacity {
            buffer_min: 0,
            buffer_max: 9,
            pool_min: 0,
            pool_max: 6,
        }),
    };
    let (cd, msg) = code(pools.update_warm_pool(bad).await);
    assert_eq!(cd, Code::InvalidArgument);
    assert!(msg.starts_with("capacity.bufferMax 9"), "{msg}");

    // The agents fill the buffer: 2 over 2 agents, one each.
    let st = w.available(&pools, "bb", 2).await;
    assert_eq!((st.total, st.allocated, st.agents), (2, 0, 2));
    assert!(!st.revision.is_empty());
    let info = fastpath
        .get_pool(fp::GetPoolRequest {
            pool_name: "bb".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.prepared_fastlets, 2, "{info:?}");
    assert_eq!(info.warm_images.len(), 1);
    assert_eq!(
        info.warm_images[0].image,
        "docker.io/library/busybox:latest"
    );
    assert_eq!(info.warm_images[0].desired_fastlets, 2);
    assert_eq!(info.total_fastlets, 2);
    let list = fastpath
        .list_pools(fp::ListPoolsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let names: Vec<(&str, i32)> = list
        .items
        .iter()
        .map(|p| (p.name.as_str(), p.prepared_fastlets))
        .collect();
    assert_eq!(
        names,
        [("default", 2), ("bb", 2)],
        "agent pool: warm sandboxes on its agents"
    );

    // Resize up: the buffer follows.
    let up = native::UpdateWarmPoolRequest {
        name: "bb".into(),
        capacity: Some(native::WarmCapacity {
            buffer_min: 4,
            buffer_max: 4,
            pool_min: 0,
            pool_max: 6,
        }),
    };
    let resized = pools.update_warm_pool(up).await.unwrap().into_inner();
    assert_ne!(resized.status.unwrap().revision, st.revision);
    w.available(&pools, "bb", 4).await;

    // Delete: the agents drain it.
    pools
        .delete_warm_pool(native::WarmPoolRef { name: "bb".into() })
        .await
        .unwrap();
    let (cd, _) = code(
        pools
            .get_warm_pool(native::WarmPoolRef { name: "bb".into() })
            .await,
    );
    assert_eq!(cd, Code::NotFound);
    let core = w.ctl.core().clone();
    eventually_async("buffers drained", WAIT, || {
        let core = core.clone();
        async move {
            let key = core.registry().pool_key("", "default");
            (core.registry().warm_available_in(&key) == 0).then_some(())
        }
    })
    .await;
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn creates_claim_warm_sandboxes_within_pool_max_on_real_agents() {
    let w = World::start().await;
    let (mut c, mut pools, mut fastpath) = w.clients().await;
    pools
        .create_warm_pool(warm_pool("bb", (2, 2, 0, 4)))
        .await
        .unwrap();
    w.available(&pools, "bb", 2).await;
    let before: HashSet<String> = w.bed.containers(NS).unwrap().into_iter().collect();

    // spec.pool names the warm pool, no image: served by a claim.
    let a = c
        .create_sandbox(create("a", "bb", ""))
        .await
        .unwrap()
        .into_inner();
    assert!(status(&a).claimed_warm, "{a:?}");
    assert!(
        before.contains(&status(&a).container_id),
        "a warm container was claimed"
    );
    let spec = a.spec.as_ref().unwrap();
    assert_eq!(
        (spec.warm_pool.as_str(), spec.pool.as_str()),
        ("bb", "default")
    );
    assert_eq!(spec.env["FROM_TEMPLATE"], "yes");
    let ev = events(&mut fastpath, "a").await;
    assert!(ev.contains("claimed warm sandbox"), "{ev}");
    // The claimed sandbox runs the request's command with the template env.
    let (st, body) = execd(
        &mut c,
        "a",
        "POST",
        "/command",
        r#"{"argv":["sh","-c","echo $FROM_TEMPLATE > /env-out"]}"#,
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let (st, body) = execd(&mut c, "a", "GET", "/files/download?path=/env-out", "").await;
    assert_eq!((st, body.as_str()), (200, "yes\n"));

    // A plain create of the pool's image claims too, and joins the pool.
    let b = c
        .create_sandbox(create("b", "", "busybox"))
        .await
        .unwrap()
        .into_inner();
    assert!(status(&b).claimed_warm, "{b:?}");
    assert_eq!(b.spec.as_ref().unwrap().warm_pool, "bb");
    assert_ne!(status(&a).container_id, status(&b).container_id);

    // Refill after the claims: 2 allocated, 2 available (poolMax 4).
    let st = w.available(&pools, "bb", 2).await;
    assert_eq!((st.allocated, st.total), (2, 4));
    let s = c
        .create_sandbox(create("c", "bb", ""))
        .await
        .unwrap()
        .into_inner();
    // The events say whether the controller chose no warm sandbox or the
    // agent fell back to a cold create under the warm id.
    let ev = events(&mut fastpath, "c").await;
    assert!(status(&s).claimed_warm, "{s:?}\nevents: {ev}");
    // FastPath v2's pool_ref resolves like spec.pool (no image either).
    fastpath
        .create_sandbox(fp::CreateSandboxRequest {
            request_id: "d".into(),
            namespace: "default".into(),
            pool_ref: "bb".into(),
            command: vec!["sleep".into(), "600".into()],
            completion: fp::CreateCompletion::Ready as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    let d = c
        .get_sandbox(native::GetSandboxRequest { sandbox: sref("d") })
        .await
        .unwrap()
        .into_inner();
    assert!(status(&d).claimed_warm, "{d:?}");
    assert_eq!(d.spec.as_ref().unwrap().warm_pool, "bb");
    // poolMax reached: no refill, and the next create is refused.
    w.available(&pools, "bb", 0).await;
    let (cd, msg) = code(c.create_sandbox(create("e", "bb", "")).await);
    assert_eq!(cd, Code::ResourceExhausted, "{msg}");
    assert!(
        msg.contains("warm pool bb is full: 4 of poolMax 4"),
        "{msg}"
    );
    // A plain create outside the pool is not refused by it: cold.
    let f = c
        .create_sandbox(create("f", "", "busybox"))
        .await
        .unwrap()
        .into_inner();
    assert!(!status(&f).claimed_warm);
    assert!(f.spec.as_ref().unwrap().warm_pool.is_empty());
    // Room again after a delete: the buffer refills one.
    delete(&mut c, "a").await;
    let st = w.available(&pools, "bb", 1).await;
    assert_eq!((st.allocated, st.total), (3, 4));
    for n in ["b", "c", "d", "f"] {
        delete(&mut c, n).await;
    }
    w.shutdown().await;
}

/// One of the 200: create, check the sandbox is fresh (no marker), write
/// its own marker, read it back, delete. Returns its container id and
/// whether a claim served it.
async fn one_life(mut c: Native, i: usize) -> (String, bool) {
    let name = format!("many-{i}");
    let s = c
        .create_sandbox(create(&name, "bb", ""))
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e:?}"))
        .into_inner();
    let (st, body) = execd(&mut c, &name, "GET", "/files/download?path=/marker", "").await;
    assert_ne!(st, 200, "{name} sees another sandbox's marker: {body}");
    let cmd = format!(r#"{{"argv":["sh","-c","echo {name} > /marker"]}}"#);
    let (st, body) = execd(&mut c, &name, "POST", "/command", &cmd).await;
    assert_eq!(st, 200, "{name}: {body}");
    let (st, body) = execd(&mut c, &name, "GET", "/files/download?path=/marker", "").await;
    assert_eq!(
        (st, body),
        (200, format!("{name}\n")),
        "{name} reads its own marker"
    );
    delete(&mut c, &name).await;
    let st = status(&s);
    (st.container_id.clone(), st.claimed_warm)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn two_hundred_creates_against_a_buffer_of_ten_never_fail_nor_share() {
    let w = World::start().await;
    let (c, mut pools, _) = w.clients().await;
    pools
        .create_warm_pool(warm_pool("bb", (10, 10, 0, 40)))
        .await
        .unwrap();
    w.available(&pools, "bb", 10).await;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..16 {
        let (c, next) = (c.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= 200 {
                    return out;
                }
                out.push(one_life(c.clone(), i).await);
            }
        }));
    }
    let mut ids = HashSet::new();
    let mut claims = 0;
    for wk in workers {
        for (id, claimed) in wk.await.expect("a worker failed") {
            assert!(ids.insert(id.clone()), "container {id} served two creates");
            claims += usize::from(claimed);
        }
    }
    assert_eq!(ids.len(), 200);
    assert!(
        claims >= 10,
        "at least the first buffer was claimed: {claims}"
    );
    eprintln!("200 creates: {claims} served by claims");
    let st = w.available(&pools, "bb", 10).await;
    assert_eq!(st.allocated, 0, "every sandbox deleted: {st:?}");
    w.shutdown().await;
}

/// A direct agent client (to make a sandbox the controller has no record of).
async fn agent_client(
    a: &AgentHandle,
) -> sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient<
    tonic::service::interceptor::InterceptedService<Channel, sandbolt_proto::auth::BearerToken>,
> {
    let ch = Channel::from_shared(format!("http://{}", a.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient::with_interceptor(
        ch,
        // An enrolled agent takes only its own credential.
        sandbolt_proto::auth::BearerToken::new(
            &a.credential_within(Duration::from_secs(10))
                .await
                .expect("the agent enrolled"),
        )
        .unwrap(),
    )
}

/// The registry hands out an id the agent knows as another sandbox (a stale
/// or foreign report): the agent refuses the claim with ALREADY_EXISTS and
/// the create goes on cold under a fresh id, in both consistencies, and the
/// other sandbox is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_claim_becomes_a_cold_create_and_spares_the_other_sandbox() {
    use sandbolt_proto::agent::v1 as apb;
    let w = World::start().await;
    let (mut c, mut pools, mut fastpath) = w.clients().await;
    pools
        .create_warm_pool(warm_pool("bb", (0, 0, 0, 10)))
        .await
        .unwrap();
    // Sandboxes with no record and no name (the orphan check skips them),
    // one per consistency: an id handed to a create is never handed again.
    let mut ac = agent_client(&w.agents[0]).await;
    for foreign in ["sb-foreign-0", "sb-foreign-1"] {
        ac.create_sandbox(apb::CreateSandboxRequest {
            spec: Some(apb::SandboxSpec {
                sandbox_id: foreign.into(),
                image: "busybox".into(),
                command: vec!["sleep".into(), "600".into()],
                access_token: "foreign-token".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("foreign sandbox");
    }
    let core = w.ctl.core().clone();
    for (i, consistency) in [native::Consistency::Fast, native::Consistency::Strong]
        .into_iter()
        .enumerate()
    {
        let foreign = format!("sb-foreign-{i}");
        let mut refused = false;
        for attempt in 0..5 {
            // Report the foreign sandbox as warm (a real heartbeat replaces
            // this within one period: retry until a create saw it).
            let mut inv = w.agents[0].inventory().await.unwrap();
            inv.warm = vec![apb::WarmSandbox {
                sandbox_id: foreign.clone(),
                class: Some(apb::WarmClass {
                    warm_pool: "bb".into(),
                    image: "docker.io/library/busybox:latest".into(),
                    ..Default::default()
                }),
                created_at_unix_ms: 1,
            }];
            core.registry().heartbeat(&inv);
            let name = format!("r{i}-{attempt}");
            let mut req = create(&name, "bb", "");
            req.consistency = consistency as i32;
            let s = c
                .create_sandbox(req)
                .await
                .unwrap_or_else(|e| panic!("{name} ({consistency:?}): {e:?}"))
                .into_inner();
            assert!(!status(&s).claimed_warm, "{s:?}");
            assert_ne!(status(&s).container_id, foreign);
            let ev = events(&mut fastpath, &name).await;
            let (st, body) = execd(&mut c, &name, "GET", "/ping", "").await;
            assert_eq!(st, 200, "{name} runs: {body}");
            delete(&mut c, &name).await;
            if ev.contains("refused the") {
                refused = true;
                break;
            }
        }
        assert!(
            refused,
            "{consistency:?}: no create ever tried the foreign id"
        );
        let still = ac
            .get_sandbox(apb::SandboxRef {
                sandbox_id: foreign.clone(),
            })
            .await
            .expect("the foreign sandbox is still there")
            .into_inner();
        assert_eq!(still.phase, apb::SandboxPhase::Running as i32);
    }
    w.shutdown().await;
}
