//! OCI runtimes side by side (issue 24): runc against runsc (gVisor) in one
//! run, each behind a controller and an agent of its own (one pool per
//! runtime, the pool's default runtime; sandbox networking on, which runsc
//! needs), round by round in alternating order. Per round and runtime:
//! create → READY (native API, `wait_ready`), execd command round trips and
//! a 1 MiB file upload + download through the agent's proxy, and the idle
//! memory of the sandbox: RSS and PSS of the containerd shim and every
//! process under it (runc: execd and the entrypoint; runsc: the sentry and
//! the gofer as well).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::control::v1 as control;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_proto::wire::EXECD_PORT;
use tonic::transport::Channel;

use crate::systems::{Bench, TOKEN, native_create, wait_for_ready_agent};
use crate::{Sample, Skipped};

pub const SCENARIO_CREATE: &str = "runtimes: create → READY";
pub const SCENARIO_EXEC: &str = "runtimes: exec round trip";
pub const SCENARIO_FILE: &str = "runtimes: 1 MiB file round trip";
/// The runtimes compared, in the table's order.
pub const RUNTIMES: [&str; 2] = ["runc", "runsc"];
/// Command round trips per sandbox.
const EXECS: u32 = 5;
/// Bytes of the file written and read back.
const FILE_BYTES: usize = 1 << 20;
/// How long a sandbox sits idle before its memory is read.
const IDLE: Duration = Duration::from_secs(2);

/// The name of `runtime`'s system in the tables.
pub fn system(runtime: &str) -> String {
    format!("sandbolt native API, {runtime}")
}

#[derive(Debug, Default)]
pub struct RuntimesOutput {
    pub samples: Vec<Sample>,
    pub skipped: Vec<Skipped>,
    pub notes: Vec<String>,
}

/// Memory of one idle sandbox: the shim and everything under it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    pub rss_kib: u64,
    pub pss_kib: u64,
    pub processes: u32,
}

/// One runtime's pool: a fast-mode controller and its agent.
struct Pool {
    runtime: &'static str,
    controller: ControllerHandle,
    agent: AgentHandle,
    native: SandboxServiceClient<Channel>,
    fastpath: FastPathServiceClient<Channel>,
    http: reqwest::Client,
    state_dir: PathBuf,
    memory: Vec<Memory>,
    _dir: tempfile::TempDir,
}

/// `rounds` rounds (after one warm-up round) on every runtime of
/// [`RUNTIMES`] that starts; one that cannot run is reported, not hidden.
pub async fn run(bench: &Bench, rounds: u32) -> RuntimesOutput {
    let mut out = RuntimesOutput::default();
    let mut pools = Vec::new();
    for runtime in RUNTIMES {
        match Pool::start(bench, runtime).await {
            Ok(pool) => pools.push(pool),
            Err(e) => out.skipped.push(Skipped {
                system: system(runtime),
                reason: e,
            }),
        }
    }
    for round in 0..=rounds {
        // Alternating order: neither runtime always follows the other's
        // teardown.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..pools.len()).collect()
        } else {
            (0..pools.len()).rev().collect()
        };
        for i in order {
            let pool = &mut pools[i];
            match pool.round(round).await {
                // Round 0 is a warm-up (first shim and runsc binary loads).
                Ok(samples) if round > 0 => out.samples.extend(samples),
                Ok(_) => pool.memory.clear(),
                Err(e) => {
                    tracing::warn!(runtime = pool.runtime, error = %e, "runtime round failed");
                    out.skipped.push(Skipped {
                        system: format!("{} (round {round})", system(pool.runtime)),
                        reason: e,
                    });
                }
            }
        }
    }
    for pool in pools {
        out.notes.push(memory_note(pool.runtime, &pool.memory));
        pool.stop().await;
    }
    out
}

impl Pool {
    async fn start(bench: &Bench, runtime: &'static str) -> Result<Pool, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut config = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), TOKEN);
        config.default_consistency = Consistency::Fast;
        config.heartbeat_interval = Duration::from_millis(500);
        let controller = Controller::start(config)
            .await
            .map_err(|e| format!("controller: {e}"))?;
        let addr = controller.local_addr();
        let mut agent_config = bench.agent_config(&format!("bench-agent-{runtime}"), addr);
        agent_config.default_runtime = runtime.to_string();
        agent_config.max_sandboxes = 16;
        // Sandbox networking (runsc needs it); nothing here resolves names.
        let mut network =
            sandbolt_agent::config::NetworkConfig::new(vec!["127.0.0.1:9".parse().unwrap()]);
        network.pool_size = 2;
        agent_config.network = Some(network);
        let state_dir = agent_config.state_dir.clone();
        let agent = match Agent::start(agent_config).await {
            Ok(a) => a,
            Err(e) => {
                controller.shutdown().await;
                purge(&state_dir);
                return Err(format!("agent: {e}"));
            }
        };
        let endpoint = format!("http://{addr}");
        let mut fastpath = FastPathServiceClient::connect(endpoint.clone())
            .await
            .map_err(|e| e.to_string())?;
        wait_for_ready_agent(&mut fastpath)
            .await
            .map_err(|e| e.to_string())?;
        let native = SandboxServiceClient::connect(endpoint)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Pool {
            runtime,
            controller,
            agent,
            native,
            fastpath,
            http: reqwest::Client::new(),
            state_dir,
            memory: Vec::new(),
            _dir: dir,
        })
    }

    /// One sandbox: created, used, measured idle, deleted (also after a
    /// failure half way).
    async fn round(&mut self, round: u32) -> Result<Vec<Sample>, String> {
        let id = format!("rt-{}-{round}", self.runtime);
        let result = self.measure(&id, round).await;
        let deleted = self
            .native
            .delete_sandbox(control::DeleteSandboxRequest {
                sandbox: Some(control::SandboxRef {
                    namespace: "default".into(),
                    name: id.clone(),
                    expected_uid: String::new(),
                }),
            })
            .await;
        if let Err(e) = deleted {
            tracing::debug!(%id, error = %e, "runtime round cleanup");
        }
        result
    }

    async fn measure(&mut self, id: &str, round: u32) -> Result<Vec<Sample>, String> {
        let name = system(self.runtime);
        let sample = |scenario: &str, iteration: u32, total_us: u64| Sample {
            scenario: scenario.into(),
            system: name.clone(),
            iteration,
            total_us,
            stages: Vec::new(),
        };
        let t = Instant::now();
        let sandbox = self
            .native
            .create_sandbox(native_create(id, false))
            .await
            .map_err(|e| format!("create: {e}"))?
            .into_inner();
        let mut samples = vec![sample(SCENARIO_CREATE, round, micros(t))];
        let container = sandbox.status.map(|s| s.container_id).unwrap_or_default();
        let (endpoint, headers) = self.endpoint(id).await?;
        for k in 0..EXECS {
            let t = Instant::now();
            self.command(&endpoint, &headers).await?;
            samples.push(sample(SCENARIO_EXEC, round * EXECS + k, micros(t)));
        }
        let t = Instant::now();
        self.file_round_trip(&endpoint, &headers).await?;
        samples.push(sample(SCENARIO_FILE, round, micros(t)));
        tokio::time::sleep(IDLE).await;
        let memory = tokio::task::spawn_blocking(move || sandbox_memory(&container))
            .await
            .map_err(|e| e.to_string())??;
        self.memory.push(memory);
        Ok(samples)
    }

    /// The agent proxy's address for execd and the headers it wants.
    async fn endpoint(&mut self, id: &str) -> Result<(String, Vec<(String, String)>), String> {
        let resolved = self
            .fastpath
            .resolve_endpoint(v2::ResolveEndpointRequest {
                sandbox: Some(v2::SandboxReference {
                    namespaced_name: Some(v2::NamespacedName {
                        namespace: "default".into(),
                        name: id.into(),
                    }),
                    expected_uid: String::new(),
                }),
                target: Some(v2::EndpointTarget {
                    target: Some(v2::endpoint_target::Target::Port(EXECD_PORT.into())),
                }),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("resolve endpoint: {e}"))?
            .into_inner();
        let headers = resolved.required_headers.into_iter().collect();
        Ok((resolved.proxy_endpoint, headers))
    }

    fn with_headers(
        mut req: reqwest::RequestBuilder,
        headers: &[(String, String)],
    ) -> reqwest::RequestBuilder {
        for (k, v) in headers {
            req = req.header(k, v);
        }
        req
    }

    /// `echo hi` through execd, until its completion frame.
    async fn command(&self, endpoint: &str, headers: &[(String, String)]) -> Result<(), String> {
        let req = self
            .http
            .post(format!("http://{endpoint}/command"))
            .json(&serde_json::json!({"command": "echo hi"}));
        let body = Self::with_headers(req, headers)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("command: {e}"))?
            .text()
            .await
            .map_err(|e| format!("command: {e}"))?;
        if !body.contains("execution_complete") || !body.contains("hi") {
            return Err(format!("unexpected command stream: {body}"));
        }
        Ok(())
    }

    /// 1 MiB uploaded, downloaded and compared.
    async fn file_round_trip(
        &self,
        endpoint: &str,
        headers: &[(String, String)],
    ) -> Result<(), String> {
        let data: Vec<u8> = (0..FILE_BYTES).map(|i| (i % 251) as u8).collect();
        let path = "/tmp/bench-1mib.bin";
        let metadata =
            reqwest::multipart::Part::text(serde_json::json!({ "path": path }).to_string())
                .mime_str("application/json")
                .map_err(|e| e.to_string())?;
        let form = reqwest::multipart::Form::new()
            .part("metadata", metadata)
            .part(
                "file",
                reqwest::multipart::Part::bytes(data.clone()).file_name("bench-1mib.bin"),
            );
        let req = self
            .http
            .post(format!("http://{endpoint}/files/upload"))
            .multipart(form);
        Self::with_headers(req, headers)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("upload: {e}"))?;
        let req = self
            .http
            .get(format!("http://{endpoint}/files/download"))
            .query(&[("path", path)]);
        let back = Self::with_headers(req, headers)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("download: {e}"))?
            .bytes()
            .await
            .map_err(|e| format!("download: {e}"))?;
        if back.as_ref() != data.as_slice() {
            return Err(format!(
                "download returned {} bytes, not the {FILE_BYTES} written",
                back.len()
            ));
        }
        Ok(())
    }

    async fn stop(self) {
        self.agent.shutdown().await;
        self.controller.shutdown().await;
        purge(&self.state_dir);
    }
}

/// Removes the networking an agent with `state_dir` left on the host.
fn purge(state_dir: &Path) {
    let cni = Path::new(sandbolt_agent::config::DEFAULT_CNI_BIN_DIR);
    if let Err(e) = sandbolt_agent::network::purge(state_dir, cni) {
        tracing::warn!(state = %state_dir.display(), error = %e, "purging a bench agent's network");
    }
}

fn micros(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// RSS and PSS of container `id`'s shim and every process under it, read
/// from /proc (`smaps_rollup`). The runc shim serves one container here
/// (sandbolt sets no grouping label), so the tree is this sandbox's alone.
pub fn sandbox_memory(id: &str) -> Result<Memory, String> {
    let procs = processes();
    let shim = procs
        .iter()
        .find(|p| {
            p.cmdline.iter().any(|a| a.contains("containerd-shim"))
                && p.cmdline.windows(2).any(|w| w[0] == "-id" && w[1] == id)
        })
        .ok_or_else(|| format!("no containerd shim with -id {id}"))?;
    let mut tree = vec![shim.pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(procs.iter().filter(|p| p.ppid == parent).map(|p| p.pid));
        i += 1;
    }
    let mut memory = Memory::default();
    for pid in tree {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else {
            continue;
        };
        memory.rss_kib += field_kib(&text, "Rss:");
        memory.pss_kib += field_kib(&text, "Pss:");
        memory.processes += 1;
    }
    Ok(memory)
}

struct Process {
    pid: i32,
    ppid: i32,
    cmdline: Vec<String>,
}

fn processes() -> Vec<Process> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name may hold spaces and parentheses: fields
            // resume after the last ')'.
            let rest = &stat[stat.rfind(')')? + 1..];
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some(Process { pid, ppid, cmdline })
        })
        .collect()
}

fn field_kib(smaps: &str, field: &str) -> u64 {
    smaps
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// "idle memory per sandbox" of one runtime: medians and ranges.
fn memory_note(runtime: &str, memory: &[Memory]) -> String {
    if memory.is_empty() {
        return format!("idle memory per sandbox, {runtime}: not measured");
    }
    let median = |f: fn(&Memory) -> u64| {
        let mut v: Vec<u64> = memory.iter().map(f).collect();
        v.sort_unstable();
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (pss, pss_min, pss_max) = median(|m| m.pss_kib);
    let (rss, _, _) = median(|m| m.rss_kib);
    let (procs, _, _) = median(|m| u64::from(m.processes));
    let mib = |k: u64| k as f64 / 1024.0;
    format!(
        "idle memory per sandbox, {runtime} (shim and every process under it, {IDLE:?} idle, n={}): PSS median {:.1} MiB ({:.1}–{:.1}), RSS median {:.1} MiB, {procs} processes",
        memory.len(),
        mib(pss),
        mib(pss_min),
        mib(pss_max),
        mib(rss),
    )
}

/// runsc ÷ runc p50 of each scenario measured on both.
pub fn ratios(samples: &[Sample]) -> Vec<(String, f64)> {
    let p50 = |scenario: &str, runtime: &str| {
        let name = system(runtime);
        crate::stats::summarize(
            samples
                .iter()
                .filter(|s| s.scenario == scenario && s.system == name)
                .map(|s| s.total_us),
        )
        .map(|s| s.p50_us)
    };
    [SCENARIO_CREATE, SCENARIO_EXEC, SCENARIO_FILE]
        .into_iter()
        .filter_map(|scenario| {
            let (a, b) = (p50(scenario, "runsc")?, p50(scenario, "runc")?);
            Some((
                format!("{scenario}: runsc ÷ runc (p50)"),
                a as f64 / b as f64,
            ))
        })
        .collect()
}
