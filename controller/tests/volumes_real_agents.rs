//! The controller's named volumes against **real agents** on the test bed
//! (private containerd, runc, the agent's btrfs volume root on a loop
//! device): what the controller forwards, where it places volumes and the
//! sandboxes that mount them, and that the real agent's refusals reach the
//! client with the codes the lifecycle maps (FAILED_PRECONDITION for a
//! second read-write mount of a ReadWriteOnce volume, for a delete or a
//! restore while mounted; ALREADY_EXISTS; NOT_FOUND). The data path inside
//! sandboxes (bytes written, read back, restored, forked) is covered end to
//! end in `tests/tests/volumes_end_to_end.rs`.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbolt_agent::volume_store::{BackendChoice, VolumeStoreConfig};
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::agent::v1 as apb;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as native;
use sandbolt_test_support::eventually_async;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use support::{code, pvc, sandbox_request, sref, with_spec};
use tonic::Code;
use tonic::transport::Channel;

type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;
type Vols = native::volume_service_client::VolumeServiceClient<Channel>;

const TOKEN: &str = "volumes-real-agents-token";
const NS: &str = "k8s.io";
const HB: Duration = Duration::from_millis(200);
const WAIT: Duration = Duration::from_secs(60);

fn controller_config(dir: &Path) -> ControllerConfig {
    let mut c = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, TOKEN);
    c.heartbeat_interval = HB;
    c.lost_agent_timeout = Duration::from_secs(5);
    c
}

/// A real agent on `bed` named `id` on node `node-<id>`; with a btrfs
/// volume root (loop image in the bed's directory) when `root` is set.
fn agent_config(
    bed: &Testbed,
    id: &str,
    state: &Path,
    ctl: &ControllerHandle,
    root: bool,
) -> AgentConfig {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(id, bed.containerd_socket(), execd, state, TOKEN);
    cfg.node_name = format!("node-{id}");
    cfg.controller_endpoint = Some(format!("http://{}", ctl.local_addr()));
    cfg.controller_token = Some(TOKEN.into());
    cfg.heartbeat_interval = HB;
    cfg.max_sandboxes = 8;
    cfg.stop_grace_period = Duration::from_secs(1);
    if root {
        cfg.volumes = Some(VolumeStoreConfig {
            root: volume_root(bed, id),
            backend: BackendChoice::Btrfs,
            loop_image: bed.root().join(format!("{id}-volumes.btrfs.img")),
            loop_size_bytes: 1 << 30,
        });
    }
    cfg
}

fn volume_root(bed: &Testbed, id: &str) -> PathBuf {
    bed.root().join(format!("{id}-volume-root"))
}

async fn clients(ctl: &ControllerHandle) -> (Native, Vols) {
    let url = format!("http://{}", ctl.local_addr());
    (
        Native::connect(url.clone()).await.unwrap(),
        Vols::connect(url).await.unwrap(),
    )
}

async fn agent_client(
    a: &AgentHandle,
) -> AgentServiceClient<tonic::service::interceptor::InterceptedService<Channel, BearerToken>> {
    let ch = Channel::from_shared(format!("http://{}", a.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // An enrolled agent takes only its own credential.
    let credential = a
        .credential_within(Duration::from_secs(10))
        .await
        .expect("the agent enrolled");
    AgentServiceClient::with_interceptor(ch, BearerToken::new(&credential).unwrap())
}

/// A busybox sandbox that stays up (sleeps) mounting `volumes`.
fn sandbox(name: &str, volumes: Vec<native::Volume>) -> native::CreateSandboxRequest {
    with_spec(sandbox_request(name, volumes), |s| {
        s.command = vec!["sleep".into(), "600".into()];
    })
}

fn vref(name: &str) -> native::VolumeRef {
    native::VolumeRef { name: name.into() }
}

fn agent_of(s: &native::Sandbox) -> String {
    s.status.as_ref().unwrap().agent_id.clone()
}

struct World {
    ctl: ControllerHandle,
    agents: Vec<AgentHandle>,
    roots: Vec<PathBuf>,
    _states: Vec<tempfile::TempDir>,
    _ctl_dir: tempfile::TempDir,
    bed: Testbed,
}

impl World {
    /// Agent "x" has a volume root, agent "y" has none; both have busybox.
    async fn start() -> World {
        sandbolt_test_support::init_tracing("sandbolt_controller=info,sandbolt_agent=info");
        let bed = tokio::task::spawn_blocking(|| {
            let bed = Testbed::start().expect("test bed (private containerd) must start");
            bed.import_image(&busybox_image().expect("busybox image"), NS)
                .expect("import busybox");
            bed
        })
        .await
        .unwrap();
        let ctl_dir = tempfile::tempdir().unwrap();
        let ctl = Controller::start(controller_config(ctl_dir.path()))
            .await
            .unwrap();
        let mut agents = Vec::new();
        let mut states = Vec::new();
        for (id, root) in [("x", true), ("y", false)] {
            let state = tempfile::tempdir().unwrap();
            let cfg = agent_config(&bed, id, state.path(), &ctl, root);
            agents.push(Agent::start(cfg).await.expect("agent starts"));
            states.push(state);
        }
        let w = World {
            roots: vec![volume_root(&bed, "x")],
            ctl,
            agents,
            _states: states,
            _ctl_dir: ctl_dir,
            bed,
        };
        let core = w.ctl.core().clone();
        eventually_async("both agents registered", WAIT, || {
            let core = core.clone();
            async move { (core.registry().volume_nodes().len() == 2).then_some(()) }
        })
        .await;
        w
    }

    async fn shutdown(self) {
        for a in self.agents {
            a.shutdown().await;
        }
        self.ctl.shutdown().await;
        let roots = self.roots;
        let bed = self.bed;
        tokio::task::spawn_blocking(move || {
            for root in roots {
                sandbolt_agent::volume_store::unmount_root(&root)
                    .unwrap_or_else(|e| panic!("unmounting the volume root {root:?}: {e}"));
            }
            drop(bed);
        })
        .await
        .unwrap();
    }
}

/// One volume's whole life through the controller, with sandboxes on real
/// agents: placement on the node with the volume root, the agent's own
/// refusals passing through with their codes, create-if-missing and
/// removal with the sandbox, attach and detach into a running sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_volumes_through_the_controller_on_real_agents() {
    let w = World::start().await;
    let (mut c, mut v) = clients(&w.ctl).await;

    // Only x has a volume root.
    let data = v
        .create_volume(native::CreateVolumeRequest {
            name: "data".into(),
            size: "64Mi".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (data.agent_id.as_str(), data.node_name.as_str()),
        ("x", "node-x")
    );
    assert_eq!(data.size_bytes, 64 << 20);
    assert_eq!(data.capabilities.as_ref().unwrap().backend, "btrfs");
    let on_y = native::CreateVolumeRequest {
        name: "other".into(),
        node_name: "node-y".into(),
        ..Default::default()
    };
    assert_eq!(
        code(v.create_volume(on_y).await).0,
        Code::FailedPrecondition
    );
    let again = native::CreateVolumeRequest {
        name: "data".into(),
        ..Default::default()
    };
    assert_eq!(code(v.create_volume(again).await).0, Code::AlreadyExists);

    // A sandbox mounting it lands on x; a second read-write mount of the
    // ReadWriteOnce volume is the agent's FAILED_PRECONDITION.
    let a = c
        .create_sandbox(sandbox("a", vec![pvc("data", "/data", |_| {})]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(agent_of(&a), "x");
    let got = v.get_volume(vref("data")).await.unwrap().into_inner();
    assert_eq!(got.mounts.len(), 1, "{got:?}");
    assert_eq!(
        (
            got.mounts[0].namespace.as_str(),
            got.mounts[0].sandbox_name.as_str()
        ),
        ("default", "a")
    );
    let (cd, msg) = code(
        c.create_sandbox(sandbox("b", vec![pvc("data", "/data", |_| {})]))
            .await,
    );
    assert_eq!(cd, Code::FailedPrecondition, "{msg}");
    let (cd, msg) = code(v.delete_volume(vref("data")).await);
    assert_eq!(cd, Code::FailedPrecondition, "delete while mounted: {msg}");

    // Snapshot and fork while mounted; restore is refused while mounted.
    let snap = native::CreateVolumeSnapshotRequest {
        volume: "data".into(),
        name: "s1".into(),
    };
    v.create_volume_snapshot(snap.clone()).await.unwrap();
    assert_eq!(
        code(v.create_volume_snapshot(snap).await).0,
        Code::AlreadyExists
    );
    let fork = v
        .fork_volume(native::ForkVolumeRequest {
            source: "data".into(),
            snapshot: "s1".into(),
            name: "data-fork".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (fork.node_name.as_str(), fork.forked_from.as_str()),
        ("node-x", "data@s1")
    );
    let restore = native::RestoreVolumeRequest {
        volume: "data".into(),
        snapshot: "s1".into(),
    };
    assert_eq!(
        code(v.restore_volume(restore.clone()).await).0,
        Code::FailedPrecondition
    );

    // Attach a volume made on the spot into the running sandbox, detach it.
    let attached = c
        .attach_volume(native::AttachVolumeRequest {
            sandbox: sref("a"),
            volume: Some(pvc("extra", "/extra", |p| p.create_if_missing = true)),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(attached.generation, a.generation + 1);
    let extra = v.get_volume(vref("extra")).await.unwrap().into_inner();
    assert_eq!(
        (extra.node_name.as_str(), extra.mounts.len()),
        ("node-x", 1)
    );
    let detached = c
        .detach_volume(native::DetachVolumeRequest {
            sandbox: sref("a"),
            volume: "extra".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(detached.generation, attached.generation + 1);
    let extra = v.get_volume(vref("extra")).await.unwrap().into_inner();
    assert!(extra.mounts.is_empty(), "{extra:?}");

    // Created with the sandbox, removed with it, after its container.
    let s = c
        .create_sandbox(sandbox(
            "scratchy",
            vec![pvc("scratch", "/scratch", |p| {
                p.create_if_missing = true;
                p.delete_on_sandbox_delete = true;
            })],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(agent_of(&s), "x", "the node with a volume root");
    v.get_volume(vref("scratch")).await.unwrap();
    c.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: sref("scratchy"),
    })
    .await
    .unwrap();
    assert_eq!(code(v.get_volume(vref("scratch")).await).0, Code::NotFound);

    // Once a is gone the volume can be restored and deleted; the fork stays.
    c.delete_sandbox(native::DeleteSandboxRequest { sandbox: sref("a") })
        .await
        .unwrap();
    let missing = native::RestoreVolumeRequest {
        snapshot: "nope".into(),
        ..restore.clone()
    };
    assert_eq!(code(v.restore_volume(missing).await).0, Code::NotFound);
    v.restore_volume(restore).await.unwrap();
    v.delete_volume(vref("data")).await.unwrap();
    v.get_volume(vref("data-fork")).await.unwrap();
    let names: Vec<String> = v
        .list_volumes(native::ListVolumesRequest {})
        .await
        .unwrap()
        .into_inner()
        .items
        .into_iter()
        .map(|x| x.name)
        .collect();
    assert_eq!(names, ["data-fork", "extra"]);
    for n in names {
        v.delete_volume(vref(&n)).await.unwrap();
    }

    // The index is the agents' heartbeats: a volume made on x behind the
    // controller's back is listed (and its name taken) once x reports it.
    let mut x = agent_client(&w.agents[0]).await;
    x.create_volume(apb::CreateVolumeRequest {
        spec: Some(apb::VolumeSpec {
            name: "direct".into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    let listed = |v: Vols| async move {
        let mut v = v;
        let items = v
            .list_volumes(native::ListVolumesRequest {})
            .await
            .ok()?
            .into_inner()
            .items;
        items
            .into_iter()
            .find(|i| i.name == "direct")
            .map(|i| i.node_name)
    };
    let node = eventually_async("the heartbeat reports it", WAIT, || listed(v.clone())).await;
    assert_eq!(node, "node-x");
    let taken = native::CreateVolumeRequest {
        name: "direct".into(),
        ..Default::default()
    };
    assert_eq!(code(v.create_volume(taken).await).0, Code::AlreadyExists);
    v.delete_volume(vref("direct")).await.unwrap();
    w.shutdown().await;
}
