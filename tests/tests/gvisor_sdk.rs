//! gVisor end to end (issue 24): the official OpenSandbox Python SDK suite
//! (`tests/python/lifecycle_sdk_test.py`, the one the lifecycle runs on
//! runc) against a pool whose runtime is runsc — a real controller, a real
//! agent with sandbox networking on the test bed's private containerd
//! (runsc driven through the runc shim), and a lifecycle on the controller
//! backend — then `tests/python/gvisor_sdk_test.py`: the kernel inside is
//! gVisor's, not the host's, and no host process is visible. The same rig
//! on a runc pool sees the host's kernel, so those checks can tell the two
//! apart. `sandbolt up --oci-runtime runsc` is driven as a user runs it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::warm::{self, drop_bed_checked, run_pytest, start_lifecycle};
use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_e2e::bed::{
    CNI_BIN_DIR, Native, V2, agent_config, connect, start_bed, test_network, wait_agents,
    with_network_state,
};
use sandbolt_lifecycle::LifecycleHandle;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2;
use sandbolt_test_support::{Proc, free_port};
use sandbolt_testbed::{BUSYBOX_REF, Testbed, execd_binary};

const TOKEN: &str = "gvisor-sdk-token";

/// A controller, one agent whose pool runtime is `runtime`, and a
/// lifecycle in front of them, on one test bed.
struct PoolRig {
    bed: Testbed,
    controller: ControllerHandle,
    agent: AgentHandle,
    lifecycle: LifecycleHandle,
    fastpath: V2,
    native: Native,
    _dir: tempfile::TempDir,
}

impl PoolRig {
    /// Starts it all; returns once the agent is a ready member of the
    /// `default` pool. The agent networks its sandboxes (runsc needs it:
    /// gVisor's netstack runs on the sandbox's veth).
    async fn start(runtime: &str, state: &Path) -> PoolRig {
        let bed = start_bed().await;
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), TOKEN);
        cfg.heartbeat_interval = Duration::from_millis(200);
        cfg.expiry_sweep_interval = Duration::from_millis(200);
        let controller = Controller::start(cfg).await.expect("controller starts");
        let addr = controller.local_addr();
        let mut acfg = agent_config(&bed, "agent-gvisor", state, addr, TOKEN);
        acfg.heartbeat_interval = Duration::from_millis(200);
        acfg.max_sandboxes = 16;
        acfg.default_runtime = runtime.to_string();
        // No names are resolved by these tests.
        acfg.network = Some(test_network("127.0.0.1:9".parse().unwrap()));
        let agent = Agent::start(acfg).await.expect("agent starts");
        let fastpath = connect(addr).await;
        wait_agents(&fastpath, 1).await;
        let lifecycle = start_lifecycle(addr, dir.path()).await;
        let native = Native::connect(format!("http://{addr}"))
            .await
            .expect("native API");
        PoolRig {
            bed,
            controller,
            agent,
            lifecycle,
            fastpath,
            native,
            _dir: dir,
        }
    }

    /// Runs the pytest file `file` of tests/python against the lifecycle;
    /// the suite's panic comes back so the rig can be stopped first.
    async fn pytest(
        &self,
        file: &'static str,
        env: Vec<(&'static str, String)>,
    ) -> Result<(), tokio::task::JoinError> {
        let addr = self.lifecycle.addr();
        let mut env = env;
        env.push(("SANDBOLT_IMAGE", BUSYBOX_REF.to_string()));
        env.push(("SANDBOLT_BACKEND", "controller".to_string()));
        tokio::task::spawn_blocking(move || {
            let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (*k, v.clone())).collect();
            run_pytest(file, addr, &env)
        })
        .await
    }

    /// Stops the lifecycle, agent and controller, then checks the bed is
    /// left with no container, snapshot or process (runsc's sentry and
    /// gofer included) and tears it down.
    async fn stop(self) {
        self.lifecycle.shutdown().await.expect("lifecycle stops");
        self.agent.shutdown().await;
        self.controller.shutdown().await;
        drop_bed_checked(self.bed).await;
    }
}

/// The host's kernel release (`uname -r`), which a runc sandbox shares and
/// a gVisor one must not show.
fn host_kernel() -> String {
    let out = Command::new("uname")
        .arg("-r")
        .output()
        .expect("uname runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// What both GetPool answers (FastPath v2 `PoolInfo`, native `Pool`) say
/// the `default` pool's runtime is, and the runtimes it can run.
async fn pool_runtime(fastpath: &mut V2, native: &mut Native) -> (String, String, Vec<String>) {
    let info = fastpath
        .get_pool(v2::GetPoolRequest {
            namespace: "default".into(),
            pool_name: "default".into(),
        })
        .await
        .expect("FastPath GetPool")
        .into_inner();
    let pool = native
        .get_pool(native::GetPoolRequest {
            name: "default".into(),
        })
        .await
        .expect("native GetPool")
        .into_inner();
    (info.runtime, pool.runtime, pool.runtimes)
}

/// The SDK suite and the isolation checks on a pool of `runtime`.
async fn sdk_on_pool(runtime: &'static str, state: PathBuf, full_suite: bool) {
    let mut rig = PoolRig::start(runtime, &state).await;
    let (info, pool, runtimes) = pool_runtime(&mut rig.fastpath, &mut rig.native).await;
    let mut suite = Ok(());
    if full_suite {
        suite = rig.pytest("lifecycle_sdk_test.py", Vec::new()).await;
    }
    if suite.is_ok() {
        let env = vec![
            ("SANDBOLT_OCI_RUNTIME", runtime.to_string()),
            ("SANDBOLT_HOST_KERNEL", host_kernel()),
        ];
        suite = rig.pytest("gvisor_sdk_test.py", env).await;
    }
    rig.stop().await;
    if let Err(panic) = suite {
        std::panic::resume_unwind(panic.into_panic());
    }
    assert_eq!(
        (info.as_str(), pool.as_str()),
        (runtime, runtime),
        "GetPool (FastPath, native) says the pool's runtime"
    );
    assert!(
        runtimes.iter().any(|r| r == runtime),
        "the pool can run {runtime}: {runtimes:?}"
    );
}

/// Done-when of issue 24: the SDK suite passes on a runsc pool, the kernel
/// inside is gVisor's, and the host's processes and kernel version are not
/// visible.
#[test]
fn sdk_suite_passes_on_a_runsc_pool() {
    with_network_state(|state| sdk_on_pool("runsc", state, true));
}

/// The same isolation checks on a runc pool: there the kernel is the
/// host's, so the checks above are not true of any sandbox by accident.
#[test]
fn kernel_checks_tell_runc_from_runsc() {
    with_network_state(|state| sdk_on_pool("runc", state, false));
}

/// `sandbolt up --oci-runtime runsc`, as a user runs it on one machine:
/// its pool reports runsc, and a sandbox made through the SDK runs on
/// gVisor's kernel.
#[test]
fn up_with_oci_runtime_runsc_runs_gvisor_sandboxes() {
    let bed = Testbed::start().expect("test bed");
    let image = sandbolt_testbed::busybox_image().expect("busybox");
    bed.import_image(&image, sandbolt_e2e::bed::NS)
        .expect("import busybox");
    let data = tempfile::tempdir().unwrap();
    let ports: Vec<String> = (0..4)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_e2e-sandbolt"));
    cmd.arg("up")
        .arg("--data-dir")
        .arg(data.path())
        .args(["--runtime", "containerd", "--oci-runtime", "runsc"])
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .arg("--execd-bin")
        .arg(execd_binary().unwrap())
        .args(["--fastpath-listen", &ports[0]])
        .args(["--lifecycle-listen", &ports[1]])
        .args(["--agent-listen", &ports[2]])
        .args(["--proxy-listen", &ports[3]])
        .args(["--api-key", warm::API_KEY, "--volume-backend", "none"])
        // Nothing here resolves names.
        .args(["--dns-upstream", "127.0.0.1:9"])
        .env_remove("SANDBOLT_FASTPATH_TOKEN");
    let log = data.path().join("up.log");
    let mut up = Proc::spawn("sandbolt up", &mut cmd, &log);
    up.wait_for_line_blocking("sandbolt is up", Duration::from_secs(90));
    let token = std::fs::read_to_string(data.path().join("fastpath-token"))
        .expect("up keeps its token")
        .trim()
        .to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (info, pool, _) = rt.block_on(up_pool_runtime(&ports[0], &token));
    let lifecycle: std::net::SocketAddr = ports[1].parse().unwrap();
    let suite = std::panic::catch_unwind(|| {
        run_pytest(
            "gvisor_sdk_test.py",
            lifecycle,
            &[
                ("SANDBOLT_IMAGE", BUSYBOX_REF.to_string()),
                ("SANDBOLT_OCI_RUNTIME", "runsc".to_string()),
                ("SANDBOLT_HOST_KERNEL", host_kernel()),
            ],
        )
    });
    let status = up.terminate(Duration::from_secs(60));
    // `up` leaves its sandboxes' network to the next start, as a node
    // agent does; the test takes it away.
    if let Err(e) =
        sandbolt_agent::network::purge(&data.path().join("agent"), Path::new(CNI_BIN_DIR))
    {
        eprintln!("purging up's network state: {e}");
    }
    if let Err(panic) = suite {
        eprintln!("{}", up.output());
        std::panic::resume_unwind(panic);
    }
    assert!(
        status.success(),
        "up exits cleanly: {status}\n{}",
        up.output()
    );
    assert_eq!((info.as_str(), pool.as_str()), ("runsc", "runsc"));
    rt.block_on(drop_bed_checked(bed));
}

/// GetPool on `up`'s FastPath/native port, with its token, once its agent
/// is a ready member of the pool (its first heartbeat may come after "up").
async fn up_pool_runtime(addr: &str, token: &str) -> (String, String, Vec<String>) {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("up's FastPath port answers");
    let auth = sandbolt_proto::auth::BearerToken::new(token).unwrap();
    let mut fastpath = v2::fast_path_service_client::FastPathServiceClient::with_interceptor(
        channel.clone(),
        auth.clone(),
    );
    let mut native =
        native::sandbox_service_client::SandboxServiceClient::with_interceptor(channel, auth);
    sandbolt_e2e::bed::eventually(
        "up's agent ready in its pool",
        Duration::from_secs(30),
        || {
            let mut fastpath = fastpath.clone();
            async move {
                fastpath
                    .get_pool(v2::GetPoolRequest {
                        namespace: "default".into(),
                        pool_name: "default".into(),
                    })
                    .await
                    .is_ok_and(|r| r.into_inner().ready_fastlets > 0)
            }
        },
    )
    .await;
    let info = fastpath
        .get_pool(v2::GetPoolRequest {
            namespace: "default".into(),
            pool_name: "default".into(),
        })
        .await
        .expect("FastPath GetPool")
        .into_inner();
    let pool = native
        .get_pool(native::GetPoolRequest {
            name: "default".into(),
        })
        .await
        .expect("native GetPool")
        .into_inner();
    (info.runtime, pool.runtime, pool.runtimes)
}
