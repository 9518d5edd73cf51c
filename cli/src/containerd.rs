//! Finding a containerd to talk to, or running one.
//!
//! Machines without an init system (containers, CI VMs) have containerd
//! installed but not running. `sandbolt up` then supervises one itself:
//! starts it, restarts it if it dies, stops it on shutdown.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const DEFAULT_SOCKET: &str = "/run/containerd/containerd.sock";

/// Which containerd, and which of its namespaces: the same two flags on every
/// command that talks to containerd (`up`, `agent`, `janitor`, `image`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ContainerdArgs {
    /// containerd's socket.
    #[arg(
        long = "containerd-socket",
        env = "SANDBOLT_CONTAINERD_SOCKET",
        default_value = DEFAULT_SOCKET
    )]
    pub(crate) socket: PathBuf,
    /// containerd namespace (`k8s.io` shares the kubelet's image cache, as
    /// `sandbolt up` and the chart use).
    #[arg(
        long = "containerd-namespace",
        env = "SANDBOLT_CONTAINERD_NAMESPACE",
        default_value = "k8s.io"
    )]
    pub(crate) namespace: String,
}
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// True when a containerd answers a version request on `socket`.
pub(crate) async fn answers(socket: &Path) -> bool {
    let probe = async {
        let channel = containerd_client::connect(socket).await.ok()?;
        let mut client =
            containerd_client::services::v1::version_client::VersionClient::new(channel);
        client.version(()).await.ok()
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(3), probe).await,
        Ok(Some(_))
    )
}

/// The path of the containerd binary, if installed.
pub(crate) fn binary() -> Option<PathBuf> {
    ["/usr/bin/containerd", "/usr/local/bin/containerd"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// A containerd that this process started and keeps running.
pub(crate) struct Supervised {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Supervised {
    /// Starts containerd on `socket` and waits until it answers.
    ///
    /// On the default socket it uses containerd's default root and state
    /// (and `/etc/containerd/config.toml` when present), as a system service
    /// would; on any other socket, private directories under `data_dir`, so
    /// that it never shares state with a system containerd.
    pub(crate) async fn start(socket: &Path, data_dir: &Path) -> anyhow::Result<Supervised> {
        let bin = binary().context(
            "containerd is not installed (apt-get install -y containerd runc), and no containerd answers",
        )?;
        let log_path = data_dir.join("containerd.log");
        std::fs::create_dir_all(data_dir)
            .with_context(|| format!("creating {}", data_dir.display()))?;
        let mut args: Vec<String> = vec!["--address".into(), socket.display().to_string()];
        if socket != Path::new(DEFAULT_SOCKET) {
            let own = data_dir.join("containerd");
            args.extend([
                "--root".into(),
                own.join("root").display().to_string(),
                "--state".into(),
                own.join("state").display().to_string(),
            ]);
        }
        if let Some(parent) = socket.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        tracing::info!(binary = %bin.display(), socket = %socket.display(), log = %log_path.display(),
            "no containerd answers; starting and supervising one");

        let (stop, stop_rx) = watch::channel(false);
        let (ready_tx, mut ready_rx) = watch::channel(None::<Result<(), String>>);
        let socket_owned = socket.to_path_buf();
        let task = tokio::spawn(supervise(
            bin,
            args,
            log_path.clone(),
            socket_owned,
            stop_rx,
            ready_tx,
        ));
        let outcome = tokio::time::timeout(READY_TIMEOUT, async {
            loop {
                if let Some(r) = ready_rx.borrow().clone() {
                    return r;
                }
                if ready_rx.changed().await.is_err() {
                    return Err("supervisor ended".to_string());
                }
            }
        })
        .await;
        let supervised = Supervised { stop, task };
        match outcome {
            Ok(Ok(())) => Ok(supervised),
            Ok(Err(e)) => {
                supervised.shutdown().await;
                bail!("containerd did not start: {e} (see {})", log_path.display())
            }
            Err(_) => {
                supervised.shutdown().await;
                bail!(
                    "containerd did not answer on {} within {READY_TIMEOUT:?} (see {})",
                    socket.display(),
                    log_path.display()
                )
            }
        }
    }

    /// Stops containerd (SIGTERM, then SIGKILL after 10 s). Sandboxes keep
    /// running under their shims; the agent finds them again on the next
    /// start.
    pub(crate) async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn supervise(
    bin: PathBuf,
    args: Vec<String>,
    log_path: PathBuf,
    socket: PathBuf,
    mut stop: watch::Receiver<bool>,
    ready: watch::Sender<Option<Result<(), String>>>,
) {
    let mut restarts = 0u32;
    loop {
        let log = match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
        {
            Ok(f) => f,
            Err(e) => {
                let _ = ready.send(Some(Err(format!("opening {}: {e}", log_path.display()))));
                return;
            }
        };
        let stderr = match log.try_clone() {
            Ok(f) => f,
            Err(e) => {
                let _ = ready.send(Some(Err(format!("opening {}: {e}", log_path.display()))));
                return;
            }
        };
        let spawned = tokio::process::Command::new(&bin)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = ready.send(Some(Err(format!("spawning {}: {e}", bin.display()))));
                return;
            }
        };
        // Ready once it answers; the first start reports back to `start`.
        let wait_ready = async {
            loop {
                if answers(&socket).await {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::select! {
            _ = wait_ready => {
                if ready.borrow().is_none() {
                    let _ = ready.send(Some(Ok(())));
                } else {
                    tracing::info!(restarts, "supervised containerd is back");
                }
            }
            status = child.wait() => {
                tracing::warn!(?status, "containerd exited during start-up");
            }
            _ = stop.changed() => {
                terminate(&mut child).await;
                return;
            }
        }
        tokio::select! {
            status = child.wait() => {
                tracing::error!(?status, log = %log_path.display(), "supervised containerd exited; restarting in 1 s");
            }
            _ = stop.changed() => {
                terminate(&mut child).await;
                return;
            }
        }
        restarts += 1;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on our own child's pid only sends a signal.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}
