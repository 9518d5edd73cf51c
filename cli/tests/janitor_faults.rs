//! Janitor fault injection on the real test-bed containerd, with real
//! `sandbolt controller`, `sandbolt agent` and `sandbolt janitor` processes
//! killed with SIGKILL. Leftovers are counted through containerd's API
//! (containers, tasks, snapshots) and the filesystem (log files, bundle
//! mounts and dirs, processes in the sandboxes' cgroups).
//!
//! Where a test kills the agent as well as the controller, that is on
//! purpose: a live agent's heartbeat lets the restarted controller's own
//! orphan check remove the container through the agent, and the test must
//! show that the janitor alone finds and removes it.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common;

use common::{AgentFlags, JanitorFlags, NodeFlags, execd_via_proxy, reference};
use containerd_client::services::v1::snapshots::{Kind, ListSnapshotsRequest};
use containerd_client::services::v1::{ListContainersRequest, ListTasksRequest};
use futures::StreamExt;
use sandbolt_agent::containerd::Containerd;
use sandbolt_agent::labels;
use sandbolt_controller::Store;
use sandbolt_janitor::{
    ControllerOwnership, Janitor, JanitorConfig, KeepReason, OwnershipSource, ReapReason,
    ScanReport,
};
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_proto::wire::{EXECD_PORT, EXECD_TOKEN_HEADER};
use sandbolt_test_support::{Proc, eventually_async, free_port, http, init_tracing};
use sandbolt_testbed::Testbed;
use tonic::transport::Channel;

const NS: &str = "k8s.io";
const TOKEN: &str = "janitor-test-agent-token";
const NODE: &str = "node-j";

/// The fault tests share two cores: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn sandbolt() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    c.env("SANDBOLT_LOG", "info,sandbolt_controller=debug")
        .env_remove("SANDBOLT_CONTROLLER_FAILPOINT")
        .env_remove(sandbolt_janitor::FAILPOINT_ENV);
    c
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Leftovers {
    containers: Vec<String>,
    tasks: Vec<String>,
    snapshots: Vec<String>,
    logs: Vec<String>,
    mounts: Vec<String>,
    bundles: Vec<String>,
    processes: Vec<String>,
}

impl Leftovers {
    /// Everything but what belongs to the sandboxes `ids`.
    fn without(&self, ids: &BTreeSet<String>) -> Leftovers {
        let keep = |v: &[String]| -> Vec<String> {
            v.iter()
                .filter(|e| !ids.iter().any(|id| e.contains(id.as_str())))
                .cloned()
                .collect()
        };
        Leftovers {
            containers: keep(&self.containers),
            tasks: keep(&self.tasks),
            snapshots: keep(&self.snapshots),
            logs: keep(&self.logs),
            mounts: keep(&self.mounts),
            bundles: keep(&self.bundles),
            processes: keep(&self.processes),
        }
    }

    fn total(&self) -> usize {
        self.containers.len()
            + self.tasks.len()
            + self.snapshots.len()
            + self.logs.len()
            + self.mounts.len()
            + self.bundles.len()
            + self.processes.len()
    }
}

struct Env {
    // Field order: processes die before the bed goes.
    agents: Vec<Proc>,
    /// Data-plane proxy address of each agent, by index.
    proxies: Vec<String>,
    controller: Option<Proc>,
    controller_port: u16,
    dir: tempfile::TempDir,
    ctrd: Containerd,
    /// Every sandbox id this test saw in containerd.
    seen: BTreeSet<String>,
    bed: Testbed,
}

impl Env {
    async fn start() -> Env {
        let bed =
            Testbed::start_with_busybox(NS).expect("test bed (private containerd) with busybox");
        let ctrd = Containerd::connect(bed.containerd_socket(), NS, Duration::from_secs(30))
            .await
            .expect("containerd answers");
        Env {
            agents: vec![],
            proxies: vec![],
            controller: None,
            controller_port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            ctrd,
            seen: BTreeSet::new(),
            bed,
        }
    }

    fn agent_state(&self) -> PathBuf {
        self.dir.path().join("agent")
    }

    fn controller_data(&self) -> PathBuf {
        self.dir.path().join("controller")
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.controller_port)
    }

    async fn start_controller(&mut self, failpoint: Option<&str>) {
        let mut cmd = sandbolt();
        cmd.args([
            "controller",
            "--listen",
            &format!("127.0.0.1:{}", self.controller_port),
            "--agent-token",
            TOKEN,
            "--consistency",
            "fast",
            "--data-dir",
        ])
        .arg(self.controller_data());
        if let Some(f) = failpoint {
            cmd.env("SANDBOLT_CONTROLLER_FAILPOINT", f);
        }
        let n = std::fs::read_dir(self.dir.path()).unwrap().count();
        let p = Proc::spawn(
            "controller",
            &mut cmd,
            self.dir.path().join(format!("controller-{n}.log")),
        );
        self.controller = Some(p);
        let owner = self.owner();
        eventually_async(
            "the controller to answer ownership queries",
            Duration::from_secs(30),
            || async { owner.ownership(NODE, &[]).await.ok() },
        )
        .await;
    }

    /// Waits until the controller (started with the `fast-after-create`
    /// failpoint) sits between a create and its record.
    async fn controller_at_failpoint(&mut self) {
        self.controller
            .as_mut()
            .expect("a controller")
            .wait_for_line(
                "SANDBOLT_FAILPOINT_REACHED fast-after-create",
                Duration::from_secs(60),
            )
            .await;
    }

    fn kill_controller(&mut self) {
        if let Some(mut c) = self.controller.take() {
            c.kill9();
        }
    }

    /// Starts an agent (its own pool, so placement cannot pick another one)
    /// and waits until the controller has it heartbeating.
    async fn start_agent(&mut self, id: &str) -> usize {
        let proxy = format!("127.0.0.1:{}", free_port());
        let mut cmd = sandbolt();
        AgentFlags {
            id,
            on_node: NodeFlags::new(NODE, NS, self.endpoint(), TOKEN),
            proxy_listen: &proxy,
            state_dir: &self.agent_state(),
            pool: Some(id),
        }
        .apply(&mut cmd, &self.bed);
        let p = Proc::spawn(
            &format!("agent {id}"),
            &mut cmd,
            self.dir.path().join(format!("agent-{id}.log")),
        );
        self.agents.push(p);
        self.proxies.push(proxy);
        let idx = self.agents.len() - 1;
        let owner = self.owner();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = owner.ownership(NODE, &[]).await
                && r.agents.iter().any(|a| a.agent_id == id && a.alive())
            {
                return idx;
            }
            assert!(
                Instant::now() < deadline,
                "agent {id} never heartbeated:\n{}",
                self.agents[idx].output()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn owner(&self) -> ControllerOwnership {
        common::ownership(&self.endpoint(), TOKEN)
    }

    async fn fastpath(&self) -> FastPathServiceClient<Channel> {
        common::fastpath(&self.endpoint()).await
    }

    fn janitor_config(&self, grace: Duration) -> JanitorConfig {
        let mut cfg = JanitorConfig::new(
            NODE,
            self.bed.containerd_socket(),
            self.endpoint(),
            TOKEN,
            self.dir.path().join("janitor"),
        );
        cfg.containerd_namespace = NS.into();
        cfg.grace_period = grace;
        cfg.interval = Duration::from_secs(3600);
        cfg.agent_state_dir = Some(self.agent_state());
        cfg.failpoint = None;
        cfg
    }

    async fn janitor(&self, grace: Duration) -> Janitor {
        Janitor::new(self.janitor_config(grace))
            .await
            .expect("janitor starts")
    }

    /// Managed containers now: (sandbox id, name label).
    async fn managed(&mut self) -> Vec<(String, String)> {
        let cs = self
            .ctrd
            .containers()
            .list(self.ctrd.req(ListContainersRequest {
                filters: vec![format!("labels.\"{}\"==true", labels::MANAGED)],
            }))
            .await
            .unwrap()
            .into_inner()
            .containers;
        let v: Vec<(String, String)> = cs
            .into_iter()
            .map(|c| {
                (
                    c.id.clone(),
                    c.labels.get(labels::NAME).cloned().unwrap_or_default(),
                )
            })
            .collect();
        self.seen.extend(v.iter().map(|(id, _)| id.clone()));
        v
    }

    async fn sandbox_id_of(&mut self, name: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some((id, _)) = self.managed().await.into_iter().find(|(_, n)| n == name) {
                return id;
            }
            assert!(Instant::now() < deadline, "no container for sandbox {name}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The task of sandbox `sid`, as containerd has it.
    async fn task_of(&self, sid: &str) -> containerd_client::types::v1::Process {
        self.ctrd
            .tasks()
            .get(self.ctrd.req(containerd_client::services::v1::GetRequest {
                container_id: sid.to_string(),
                exec_id: String::new(),
            }))
            .await
            .unwrap_or_else(|e| panic!("task of {sid}: {e}"))
            .into_inner()
            .process
            .expect("a task has a process")
    }

    /// Once every container is older than `grace`: a janitor with that
    /// grace period, and its first scan, which must have had no error.
    async fn scan_past_grace(&self, grace: Duration) -> (Janitor, ScanReport) {
        wait_past_grace(grace).await;
        let janitor = self.janitor(grace).await;
        let r = janitor.scan_once().await.expect("scan");
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        (janitor, r)
    }

    /// What is left of the sandboxes this test saw.
    async fn leftovers(&self) -> Leftovers {
        let mut l = Leftovers::default();
        let seen = |id: &str| self.seen.contains(id);
        let cs = self
            .ctrd
            .containers()
            .list(self.ctrd.req(ListContainersRequest { filters: vec![] }))
            .await
            .unwrap()
            .into_inner()
            .containers;
        l.containers = cs.into_iter().map(|c| c.id).filter(|id| seen(id)).collect();
        let ts = self
            .ctrd
            .tasks()
            .list(self.ctrd.req(ListTasksRequest {
                filter: String::new(),
            }))
            .await
            .unwrap()
            .into_inner()
            .tasks;
        l.tasks = ts
            .into_iter()
            .map(|t| t.container_id)
            .filter(|id| seen(id))
            .collect();
        let mut stream = self
            .ctrd
            .snapshots()
            .list(self.ctrd.req(ListSnapshotsRequest {
                snapshotter: "overlayfs".into(),
                filters: vec![],
            }))
            .await
            .unwrap()
            .into_inner();
        while let Some(chunk) = stream.next().await {
            for i in chunk.unwrap().info {
                if i.kind == Kind::Active as i32 && seen(&i.name) {
                    l.snapshots.push(i.name);
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.agent_state().join("logs")) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.strip_suffix(".log").is_some_and(seen) {
                    l.logs.push(n);
                }
            }
        }
        let root = self.bed.root().display().to_string();
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for line in info.lines() {
            let mp = line.split(' ').nth(4).unwrap_or("");
            if mp.starts_with(&root) && self.seen.iter().any(|id| mp.contains(&format!("/{id}/"))) {
                l.mounts.push(mp.to_string());
            }
        }
        for id in &self.seen {
            let bundle = self.bed.root().join(format!(
                "containerd/state/io.containerd.runtime.v2.task/{NS}/{id}"
            ));
            if bundle.exists() {
                l.bundles.push(bundle.display().to_string());
            }
        }
        // A sandbox's network namespace lives as long as a process in it:
        // count processes still in a sandbox's cgroup.
        for p in std::fs::read_dir("/proc").unwrap().flatten() {
            if !p
                .file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
            {
                continue;
            }
            let cg = std::fs::read_to_string(p.path().join("cgroup")).unwrap_or_default();
            if let Some(id) = self
                .seen
                .iter()
                .find(|id| cg.contains(&format!("/sandbolt/{id}")))
            {
                l.processes
                    .push(format!("pid {} in {id}", p.file_name().to_string_lossy()));
            }
        }
        l
    }
}

fn create_req(request_id: &str, pool: &str) -> fp::CreateSandboxRequest {
    fp::CreateSandboxRequest {
        request_id: request_id.into(),
        image: "busybox".into(),
        pool_ref: pool.into(),
        command: vec!["sleep".into(), "100000".into()],
        completion: fp::CreateCompletion::Ready as i32,
        ..Default::default()
    }
}

/// GET execd's /ping through the agent's data-plane proxy, as a client
/// would.
async fn ping_via_proxy(env: &Env, name: &str) -> u16 {
    execd_via_proxy(&mut env.fastpath().await, name, "GET", "/ping", "")
        .await
        .0
}

/// The sandbox's execd token, read from the container's OCI spec env (the
/// test has no record to ask when the record was never written).
async fn execd_token(env: &Env, id: &str) -> String {
    let c = env
        .ctrd
        .containers()
        .get(
            env.ctrd
                .req(containerd_client::services::v1::GetContainerRequest { id: id.into() }),
        )
        .await
        .unwrap()
        .into_inner()
        .container
        .unwrap();
    let spec: serde_json::Value = serde_json::from_slice(&c.spec.unwrap().value).unwrap();
    spec["process"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .find_map(|e| e.strip_prefix("EXECD_ACCESS_TOKEN="))
        .expect("execd token in the spec")
        .to_string()
}

/// Waits until every container made so far is older than `grace`, so that
/// only the rules, not the age, decide. A sleep on purpose: the condition is
/// the passing of time itself (the janitor's age comes from several clocks:
/// labels, containerd's and the snapshot's timestamps).
async fn wait_past_grace(grace: Duration) {
    tokio::time::sleep(grace + Duration::from_millis(200)).await;
}

/// A fast-mode container whose controller died before the record: the
/// controller freezes at `fast-after-create` and is SIGKILLed there; the
/// agent is SIGKILLed too (see the module comment); the controller restarts.
async fn orphan_of_dead_controller(env: &mut Env, agent: &str, name: &str) -> String {
    env.start_controller(Some("fast-after-create")).await;
    let idx = env.start_agent(agent).await;
    let mut fp = env.fastpath().await;
    let req = create_req(name, agent);
    let pending = tokio::spawn(async move { fp.create_sandbox(req).await });
    env.controller_at_failpoint().await;
    let sid = env.sandbox_id_of(name).await;
    env.kill_controller();
    env.agents[idx].kill9();
    assert!(
        pending.await.unwrap().is_err(),
        "the create must fail with its controller"
    );
    env.start_controller(None).await;
    sid
}

// ------------------------------------------------------------------ tests --

/// Done-when 6: a live, recorded sandbox survives 100 scans untouched —
/// with a zero grace period, so its age protects nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_sandbox_survives_100_scans() {
    let _s = SERIAL.lock().await;
    init_tracing("sandbolt_janitor=info");
    let mut env = Env::start().await;
    env.start_controller(None).await;
    env.start_agent("a6").await;
    env.fastpath()
        .await
        .create_sandbox(create_req("live6", "a6"))
        .await
        .expect("create");
    let sid = env.sandbox_id_of("live6").await;
    let pid_before = env.task_of(&sid).await.pid;
    assert_eq!(ping_via_proxy(&env, "live6").await, 200);

    let janitor = env.janitor(Duration::ZERO).await;
    for i in 0..100 {
        let r = janitor.scan_once().await.expect("scan");
        assert!(r.reaped.is_empty(), "scan {i} reaped {:?}", r.reaped);
        assert!(r.errors.is_empty(), "scan {i}: {:?}", r.errors);
        assert_eq!(
            r.kept_reason(&sid),
            Some(KeepReason::Owned),
            "scan {i}: {r:?}"
        );
    }
    let task = env.task_of(&sid).await;
    assert_eq!(task.pid, pid_before, "the sandbox's process was replaced");
    assert_eq!(
        task.status,
        containerd_client::types::v1::Status::Running as i32
    );
    assert_eq!(
        ping_via_proxy(&env, "live6").await,
        200,
        "execd must still answer through the proxy"
    );
    assert_eq!(
        janitor
            .metrics()
            .encode()
            .matches("sandbolt_janitor_reaped_total{")
            .count(),
        0
    );
}

/// Done-when 3: the record is deleted directly in the store (controller
/// stopped, record removed through the controller crate's store API,
/// controller restarted) → the janitor reaps the container, reason no-record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_deleted_in_store_is_reaped() {
    let _s = SERIAL.lock().await;
    init_tracing("sandbolt_janitor=info");
    let mut env = Env::start().await;
    env.start_controller(None).await;
    let a = env.start_agent("a3").await;
    env.fastpath()
        .await
        .create_sandbox(create_req("gone3", "a3"))
        .await
        .expect("create");
    let sid = env.sandbox_id_of("gone3").await;
    env.agents[a].kill9();
    env.kill_controller();
    {
        let store = sandbolt_controller::store::embedded::RedbStore::open(&env.controller_data())
            .expect("open the store");
        assert!(
            store
                .delete(&sandbolt_controller::SandboxKey::new("default", "gone3"))
                .expect("delete")
                .is_some(),
            "the record existed"
        );
    }
    // No controller, no ownership: the janitor reaps nothing (fail safe),
    // even with no grace period at all.
    let blind = env.janitor(Duration::ZERO).await;
    assert!(
        matches!(
            blind.scan_once().await,
            Err(sandbolt_janitor::JanitorError::OwnershipUnavailable(_))
        ),
        "a scan without the controller must refuse to decide"
    );
    assert_eq!(env.leftovers().await.containers, vec![sid.clone()]);
    env.start_controller(None).await;

    let grace = Duration::from_millis(500);
    let (janitor, r) = env.scan_past_grace(grace).await;
    let reaped: Vec<_> = r
        .reaped
        .iter()
        .map(|x| (x.sandbox_id.as_str(), x.reason))
        .collect();
    assert_eq!(reaped, vec![(sid.as_str(), ReapReason::NoRecord)], "{r:?}");
    let left = env.leftovers().await;
    assert_eq!(left.total(), 0, "{left:?}");
    assert_eq!(janitor.metrics().reaped_count(ReapReason::NoRecord), 1);
}

/// Done-when 2: the controller is killed after the container exists but
/// before the fast-mode record → reaped (no-record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_killed_before_fast_record_is_reaped() {
    let _s = SERIAL.lock().await;
    init_tracing("sandbolt_janitor=info");
    let mut env = Env::start().await;
    let sid = orphan_of_dead_controller(&mut env, "a2", "orphan2").await;
    let grace = Duration::from_millis(500);
    let (_janitor, r) = env.scan_past_grace(grace).await;
    let reaped: Vec<_> = r
        .reaped
        .iter()
        .map(|x| (x.sandbox_id.as_str(), x.reason, x.leftover))
        .collect();
    assert_eq!(
        reaped,
        vec![(sid.as_str(), ReapReason::NoRecord, false)],
        "{r:?}"
    );
    let left = env.leftovers().await;
    assert_eq!(left.total(), 0, "{left:?}");
}

/// Done-when 4: a fast-mode record write is delayed (the controller sits
/// between the create and the commit) → not reaped, neither inside the
/// grace period nor after it (the in-flight fence), and the sandbox keeps
/// working: RUNNING, and execd answers /ping through the agent's proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_fast_record_is_not_reaped() {
    let _s = SERIAL.lock().await;
    init_tracing("sandbolt_janitor=info");
    let mut env = Env::start().await;
    env.start_controller(Some("fast-after-create")).await;
    env.start_agent("a4").await;
    let mut fp = env.fastpath().await;
    let pending = tokio::spawn(async move { fp.create_sandbox(create_req("slow4", "a4")).await });
    env.controller_at_failpoint().await;
    let sid = env.sandbox_id_of("slow4").await;

    // Inside the grace period: young.
    let inside = env.janitor(Duration::from_secs(3600)).await;
    let r = inside.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(r.kept_reason(&sid), Some(KeepReason::Young), "{r:?}");
    // Even with no grace at all the in-flight create is fenced off.
    let no_grace = env.janitor(Duration::ZERO).await;
    for _ in 0..10 {
        let r = no_grace.scan_once().await.expect("scan");
        assert!(r.reaped.is_empty(), "{r:?}");
        assert_eq!(r.kept_reason(&sid), Some(KeepReason::InFlight), "{r:?}");
    }
    assert_eq!(env.leftovers().await.containers, vec![sid.clone()]);

    // The sandbox works: the agent's proxy routes to its execd.
    let proxy = env.proxies[0].clone();
    let token = execd_token(&env, &sid).await;
    let headers = vec![
        ("X-Sandbolt-Access-Token".to_string(), token.clone()),
        (EXECD_TOKEN_HEADER.to_string(), token),
    ];
    assert_eq!(
        http::get(&format!("{proxy}/{sid}/{EXECD_PORT}"), "/ping", &headers)
            .await
            .0,
        200
    );
    assert!(
        !pending.is_finished(),
        "the create is still waiting for its record"
    );
    pending.abort();
}

/// Done-when 5: the janitor process is SIGKILLed in the middle of a cleanup
/// (container gone; snapshot, log file and report not yet) → the next scan
/// (another `sandbolt janitor` process) completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn janitor_killed_mid_cleanup_is_completed_by_next_scan() {
    let _s = SERIAL.lock().await;
    init_tracing("sandbolt_janitor=info");
    let mut env = Env::start().await;
    let sid = orphan_of_dead_controller(&mut env, "a5", "orphan5").await;
    let grace = Duration::from_millis(500);
    wait_past_grace(grace).await;

    let janitor_cmd = |env: &Env| {
        let mut c = sandbolt();
        JanitorFlags {
            on_node: NodeFlags::new(NODE, NS, env.endpoint(), TOKEN),
            agent_state_dir: &env.agent_state(),
            state_dir: &env.dir.path().join("janitor"),
        }
        .apply(&mut c, &env.bed, &["--once", "--grace-period", "500ms"]);
        c
    };
    let mut first = Proc::spawn(
        "janitor (failpoint)",
        janitor_cmd(&env).env(sandbolt_janitor::FAILPOINT_ENV, "after-container-delete"),
        env.dir.path().join("janitor-1.log"),
    );
    first
        .wait_for_line(
            "SANDBOLT_JANITOR_FAILPOINT_REACHED after-container-delete",
            Duration::from_secs(60),
        )
        .await;
    first.kill9();
    let half = env.leftovers().await;
    assert!(
        half.containers.is_empty() && half.tasks.is_empty(),
        "the container went before the kill: {half:?}"
    );
    // containerd's own GC may already have collected the snapshot once its
    // container was gone (it is no longer referenced); whether it did is a
    // matter of GC timing, so either state is a valid half-way point. The
    // log file is the janitor's alone, and proves the cleanup was cut short.
    assert!(
        half.snapshots.is_empty() || half.snapshots == vec![sid.clone()],
        "unexpected snapshots half-way: {half:?}"
    );
    assert_eq!(
        half.logs,
        vec![format!("{sid}.log")],
        "the log file is left half-way: {half:?}"
    );

    let out = janitor_cmd(&env).output().expect("second janitor runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "second janitor failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!(
            "reaped {sid} reason=no-record agent=a5 leftover=true"
        )),
        "{stdout}"
    );
    let left = env.leftovers().await;
    assert_eq!(left.total(), 0, "{left:?}");
    let journal: Vec<_> = std::fs::read_dir(env.dir.path().join("janitor/reaping"))
        .unwrap()
        .flatten()
        .collect();
    assert!(journal.is_empty(), "journal entries left: {journal:?}");
}

/// Done-when 1: `kill -9` of the agent in the middle of creates, 20 times
/// (each time a fresh agent, so no restarted agent recovers and deletes
/// what its predecessor left) → after one scan nothing is left of the
/// creates that never got a record: no container, task, snapshot, log file,
/// bundle, mount, or process (and so no network namespace). Creates that
/// did get a record are sandboxes of a silent agent: they are kept whole
/// (on one machine nothing proves an agent gone) until they are deleted;
/// then the next scan leaves nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_create_20_times_leaves_nothing_after_one_scan() {
    let _s = SERIAL.lock().await;
    init_tracing("sandbolt_janitor=info");
    let mut env = Env::start().await;
    env.start_controller(None).await;
    const ROUNDS: usize = 20;
    const PER_ROUND: usize = 3;
    let mut agent_ids = Vec::new();
    for round in 0..ROUNDS {
        let id = format!("k{round}");
        let idx = env.start_agent(&id).await;
        agent_ids.push(id.clone());
        let mut calls = Vec::new();
        for n in 0..PER_ROUND {
            let mut fp = env.fastpath().await;
            let req = create_req(&format!("r{round}-{n}"), &id);
            calls.push(tokio::spawn(async move { fp.create_sandbox(req).await }));
        }
        // Kill at a different point each round: as soon as the first
        // container exists, or a little later (task create/start, execd wait).
        let extra = Duration::from_millis((round % 5) as u64 * 25);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mine = env
                .managed()
                .await
                .iter()
                .filter(|(_, n)| n.starts_with(&format!("r{round}-")))
                .count();
            if mine > 0 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(extra).await;
        env.agents[idx].kill9();
        for c in calls {
            let _ = c.await;
        }
        env.managed().await;
    }
    let before = env.leftovers().await;
    assert!(
        before.containers.len() >= ROUNDS,
        "the kills must leave containers behind to test anything: {before:?}"
    );

    // Let containerd settle, the grace period pass and the controller mark
    // every killed agent silent (creates that finished before a kill have
    // live records; their agent is only silent).
    let grace = Duration::from_secs(1);
    wait_past_grace(grace).await;
    let owner: Arc<dyn OwnershipSource> = Arc::new(env.owner());
    eventually_async(
        "the controller to mark every killed agent lost",
        Duration::from_secs(120),
        || async {
            let r = owner
                .ownership(NODE, &[])
                .await
                .expect("controller answers");
            agent_ids
                .iter()
                .all(|id| r.agents.iter().any(|a| &a.agent_id == id && !a.alive()))
                .then_some(())
        },
    )
    .await;
    env.managed().await;

    let names: std::collections::BTreeMap<String, String> =
        env.managed().await.into_iter().collect();

    let janitor = env.janitor(grace).await;
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // Everything kept is a recorded sandbox of a silent agent, kept whole.
    let kept: BTreeSet<String> = r.kept.iter().map(|k| k.sandbox_id.clone()).collect();
    for k in &r.kept {
        assert_eq!(k.reason, KeepReason::AgentSilent, "{r:?}");
    }
    let left = env.leftovers().await;
    assert_eq!(
        left.without(&kept),
        Leftovers::default(),
        "after one scan: {left:?}\nreport: {r:?}"
    );
    for id in &kept {
        assert!(left.tasks.contains(id), "{id} kept whole: {left:?}");
    }
    assert_eq!(
        r.reaped.len() + kept.len(),
        before.containers.len(),
        "{r:?}"
    );
    assert!(
        !r.reaped.is_empty(),
        "the kills must leave orphans behind to test anything: {r:?}"
    );
    let metrics = janitor.metrics().encode();
    assert!(
        metrics.contains("sandbolt_janitor_reaped_total{reason="),
        "{metrics}"
    );

    // Their owner deletes them: the records go at once (their agent cannot
    // be asked), and the next scan removes the rest.
    let mut fp = env.fastpath().await;
    for id in &kept {
        fp.delete_sandbox(fp::DeleteRequest {
            sandbox: Some(reference(&names[id])),
        })
        .await
        .unwrap_or_else(|e| panic!("delete {}: {e:?}", names[id]));
    }
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(
        r.reaped
            .iter()
            .map(|x| x.sandbox_id.clone())
            .collect::<BTreeSet<_>>(),
        kept,
        "{r:?}"
    );
    let left = env.leftovers().await;
    assert_eq!(left, Leftovers::default(), "after the deletes: {left:?}");
}
