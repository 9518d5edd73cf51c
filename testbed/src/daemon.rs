//! The private containerd and dockerd of one test bed.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::image::OciImage;
use crate::packages::{ensure_packages, is_root};
use crate::teardown;
use crate::{TESTBED_DIR_PREFIX, TestbedError};

/// containerd namespace dockerd keeps its containers in.
pub const DOCKER_NAMESPACE: &str = "moby";

const CONTAINERD_START: Duration = Duration::from_secs(30);
const DOCKERD_START: Duration = Duration::from_secs(60);

/// A private containerd (and optionally dockerd) in a temporary directory.
///
/// Everything lives below [`Testbed::root`]; dropping the value (also while
/// unwinding from a panic) kills every task, shim and daemon it started,
/// unmounts whatever is mounted below the root, and removes it.
pub struct Testbed {
    root: PathBuf,
    containerd: Option<Child>,
    containerd_socket: PathBuf,
    docker: Option<Dockerd>,
}

struct Dockerd {
    child: Child,
    socket: PathBuf,
    bridge: String,
}

impl Testbed {
    /// Starts a private containerd (runc) and waits until it answers.
    pub fn start() -> Result<Testbed, TestbedError> {
        Self::start_inner(false)
    }

    /// Starts a private containerd and a private dockerd on top of it.
    pub fn start_with_docker() -> Result<Testbed, TestbedError> {
        Self::start_inner(true)
    }

    fn start_inner(docker: bool) -> Result<Testbed, TestbedError> {
        if !is_root() {
            return Err(TestbedError::NotRoot);
        }
        ensure_packages(docker)?;
        // Beds whose test process died (kill -9, CI timeout) are cleaned up by
        // the next one, so a crash never accumulates daemons.
        teardown::sweep_stale();

        let dir = tempfile::Builder::new()
            .prefix(TESTBED_DIR_PREFIX)
            .tempdir_in("/tmp")
            .map_err(TestbedError::io("/tmp"))?;
        // From here on, Drop owns the cleanup of the directory.
        let root = dir.keep();
        fs::write(root.join("owner.pid"), std::process::id().to_string())
            .map_err(TestbedError::io(root.join("owner.pid")))?;
        let mut bed = Testbed {
            containerd_socket: root.join("containerd.sock"),
            root,
            containerd: None,
            docker: None,
        };
        bed.start_containerd()?;
        if docker {
            bed.start_dockerd()?;
        }
        Ok(bed)
    }

    /// The private directory that holds everything of this bed.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn containerd_socket(&self) -> &Path {
        &self.containerd_socket
    }

    /// The private dockerd's socket, when the bed was started with Docker.
    pub fn docker_socket(&self) -> Option<&Path> {
        self.docker.as_ref().map(|d| d.socket.as_path())
    }

    /// The private dockerd's bridge interface, when started with Docker.
    pub fn docker_bridge(&self) -> Option<&str> {
        self.docker.as_ref().map(|d| d.bridge.as_str())
    }

    /// `ctr --address <this bed's socket> -n <namespace>`, ready for args.
    pub fn ctr(&self, namespace: &str) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.containerd_socket)
            .arg("-n")
            .arg(namespace);
        cmd
    }

    /// What `ctr -n <namespace> <args>` prints on stdout; an error names the
    /// command and its stderr when it fails.
    pub fn ctr_output(&self, namespace: &str, args: &[&str]) -> Result<String, TestbedError> {
        run(self.ctr(namespace).args(args))
    }

    /// Imports a locally built image into this bed's containerd and unpacks
    /// it on the default (overlayfs) snapshotter.
    pub fn import_image(&self, image: &OciImage, namespace: &str) -> Result<(), TestbedError> {
        let archive = self.root.join(format!("image-{}.tar", image.file_stem()));
        image.write_oci_archive(&archive)?;
        let mut cmd = self.ctr(namespace);
        cmd.args(["images", "import"]).arg(&archive);
        run(&mut cmd)?;
        let _ = fs::remove_file(&archive);
        Ok(())
    }

    /// Starts a private containerd with the test busybox image imported
    /// into `namespace`: what most tests of a sandbox need first.
    pub fn start_with_busybox(namespace: &str) -> Result<Testbed, TestbedError> {
        let bed = Self::start()?;
        bed.import_image(&crate::busybox_image()?, namespace)?;
        Ok(bed)
    }

    /// Container ids in `namespace`, sorted (`ctr containers ls -q`).
    pub fn containers(&self, namespace: &str) -> Result<Vec<String>, TestbedError> {
        let listing = run(self.ctr(namespace).args(["containers", "ls", "-q"]))?;
        let mut ids: Vec<String> = listing
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Every task in `namespace` as `ctr tasks ls` shows it:
    /// container id → (pid, status such as `RUNNING`).
    pub fn tasks(&self, namespace: &str) -> Result<BTreeMap<String, (u32, String)>, TestbedError> {
        let listing = run(self.ctr(namespace).args(["tasks", "ls"]))?;
        Ok(listing
            .lines()
            .skip(1)
            .filter_map(|line| {
                let cols: Vec<&str> = line.split_whitespace().collect();
                let [id, pid, status, ..] = cols.as_slice() else {
                    return None;
                };
                Some((
                    id.to_string(),
                    (pid.parse().unwrap_or(0), status.to_string()),
                ))
            })
            .collect())
    }

    /// Imports a locally built image into this bed's dockerd.
    pub fn docker_load(&self, image: &OciImage) -> Result<(), TestbedError> {
        let socket = self.docker_socket().ok_or_else(|| {
            TestbedError::Setup("this test bed was started without Docker".into())
        })?;
        let (repo, tag) = image.repo_and_tag();
        let mut query = format!(
            "/images/create?fromSrc=-&repo={}&tag={}",
            url_encode(&repo),
            url_encode(&tag)
        );
        for change in image.docker_changes() {
            query.push_str("&changes=");
            query.push_str(&url_encode(&change));
        }
        let body = image.rootfs_tar();
        let (status, text) = docker_request(socket, "POST", &query, Some(body))?;
        if status != 200 || text.contains("\"error\"") {
            return Err(TestbedError::Command {
                command: format!("docker image import {}", image.reference()),
                status: status.to_string(),
                stderr: text,
            });
        }
        Ok(())
    }

    fn start_containerd(&mut self) -> Result<(), TestbedError> {
        let dir = self.root.join("containerd");
        fs::create_dir_all(&dir).map_err(TestbedError::io(&dir))?;
        let config = dir.join("config.toml");
        // The CRI plugin is of no use here and slows start-up; everything
        // else keeps containerd's defaults so tests see what nodes run.
        let text = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"
"#,
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            sock = self.containerd_socket.display(),
        );
        fs::write(&config, text).map_err(TestbedError::io(&config))?;
        let log = dir.join("containerd.log");
        let child = spawn_logged(
            Command::new("containerd").arg("--config").arg(&config),
            &log,
        )?;
        let mut child = child;
        let socket = self.containerd_socket.clone();
        let probe = || {
            self.ctr("default")
                .arg("version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        };
        let ready = wait_ready("containerd", &mut child, &log, CONTAINERD_START, || {
            socket.exists() && probe()
        });
        // Stored even on failure so that Drop stops it.
        self.containerd = Some(child);
        ready
    }

    fn start_dockerd(&mut self) -> Result<(), TestbedError> {
        let dir = self.root.join("docker");
        fs::create_dir_all(&dir).map_err(TestbedError::io(&dir))?;
        let bridge = create_bridge()?;
        // Recorded so that a sweep after a crash can delete it too.
        let _ = fs::write(self.root.join("bridge"), &bridge);
        // An empty config file keeps the host's /etc/docker/daemon.json out.
        let config = dir.join("daemon.json");
        fs::write(&config, "{}").map_err(TestbedError::io(&config))?;
        let socket = self.root.join("docker.sock");
        let log = dir.join("dockerd.log");
        let spawned = spawn_logged(
            Command::new("dockerd")
                .arg("--config-file")
                .arg(&config)
                .arg("--data-root")
                .arg(dir.join("data"))
                .arg("--exec-root")
                .arg(dir.join("exec"))
                .arg("--pidfile")
                .arg(dir.join("dockerd.pid"))
                .arg("-H")
                .arg(format!("unix://{}", socket.display()))
                .arg("--containerd")
                .arg(&self.containerd_socket)
                .arg(format!("--bridge={bridge}"))
                .args([
                    "--iptables=false",
                    "--ip-masq=false",
                    "--ip-forward=false",
                    "--userland-proxy=true",
                    "--storage-driver=overlay2",
                    "--log-level=warn",
                ]),
            &log,
        );
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                delete_bridge(&bridge);
                return Err(e);
            }
        };
        self.docker = Some(Dockerd {
            child,
            socket: socket.clone(),
            bridge,
        });
        let docker = self.docker.as_mut().expect("just set");
        wait_ready("dockerd", &mut docker.child, &log, DOCKERD_START, || {
            matches!(docker_request(&socket, "GET", "/_ping", None), Ok((200, _)))
        })
    }

    fn stop(&mut self) {
        if let Some(mut docker) = self.docker.take() {
            // Networks a test made on this dockerd (the Docker fallback's
            // `sandbolt` network) have bridges that outlive the daemon, and
            // the lifecycle's isolation tables for them outlive both.
            let bridges = teardown::docker_network_bridges(&docker.socket, &docker.bridge);
            teardown::stop_child(&mut docker.child, Duration::from_secs(10));
            delete_bridge(&docker.bridge);
            for bridge in bridges {
                delete_bridge(&bridge);
                teardown::delete_isolation_tables(&bridge);
            }
        }
        if self.containerd.is_some() {
            teardown::remove_all_tasks(self);
        }
        if let Some(mut child) = self.containerd.take() {
            teardown::stop_child(&mut child, Duration::from_secs(10));
        }
        teardown::clean_dir(&self.root);
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs a command and turns a non-zero exit into an error with its stderr.
pub(crate) fn run(cmd: &mut Command) -> Result<String, TestbedError> {
    let out = cmd.output().map_err(|e| TestbedError::Spawn {
        what: format!("{cmd:?}"),
        source: e,
    })?;
    if !out.status.success() {
        return Err(TestbedError::Command {
            command: format!("{cmd:?}"),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child, TestbedError> {
    let out = fs::File::create(log).map_err(TestbedError::io(log))?;
    let err = out.try_clone().map_err(TestbedError::io(log))?;
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| TestbedError::Spawn {
            what: format!("{cmd:?}"),
            source: e,
        })
}

fn wait_ready(
    daemon: &'static str,
    child: &mut Child,
    log: &Path,
    limit: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<(), TestbedError> {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(TestbedError::DaemonExited {
                daemon,
                status: status.to_string(),
                log: log.to_path_buf(),
                tail: log_tail(log),
            });
        }
        if ready() {
            tracing::debug!(daemon, elapsed = ?started.elapsed(), "test bed daemon ready");
            return Ok(());
        }
        if started.elapsed() > limit {
            return Err(TestbedError::DaemonNotReady {
                daemon,
                waited: limit,
                log: log.to_path_buf(),
                tail: log_tail(log),
            });
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn log_tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// A bridge of the bed's own, so that two dockerds never share `docker0`.
fn create_bridge() -> Result<String, TestbedError> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    for _ in 0..64 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let seed = std::process::id().wrapping_mul(31).wrapping_add(n);
        let name = format!("sbtb{:x}", seed & 0xff_ffff);
        // 10.213.0.0/16 is carved into /24s, one per bed.
        let subnet = (seed.wrapping_mul(2654435761) >> 24) & 0xff;
        let cidr = format!("10.213.{subnet}.1/24");
        let taken = Command::new("ip")
            .args(["-4", "-o", "addr", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("10.213.{subnet}.")))
            .unwrap_or(false);
        if taken || Path::new("/sys/class/net").join(&name).exists() {
            continue;
        }
        run(Command::new("ip").args(["link", "add", &name, "type", "bridge"]))?;
        let setup = run(Command::new("ip").args(["addr", "add", &cidr, "dev", &name]))
            .and_then(|_| run(Command::new("ip").args(["link", "set", &name, "up"])));
        if let Err(e) = setup {
            delete_bridge(&name);
            return Err(e);
        }
        return Ok(name);
    }
    Err(TestbedError::Setup(
        "no free bridge name/subnet for dockerd".into(),
    ))
}

pub(crate) fn delete_bridge(name: &str) {
    let _ = Command::new("ip")
        .args(["link", "del", name])
        .stderr(Stdio::null())
        .status();
}

/// One HTTP/1.0 request to dockerd over its unix socket. Returns the status
/// code and the body (as text).
pub(crate) fn docker_request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> Result<(u16, String), TestbedError> {
    let io = TestbedError::io(socket);
    let mut stream = UnixStream::connect(socket).map_err(TestbedError::io(socket))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(TestbedError::io(socket))?;
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: docker\r\nContent-Type: application/x-tar\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut response = Vec::new();
    let result = stream
        .write_all(head.as_bytes())
        .and_then(|_| stream.write_all(body))
        .and_then(|_| stream.read_to_end(&mut response));
    result.map_err(io)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
