//! The daemon's main loop: runtime, PID 1 duties, entrypoint, signals.

use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;

use crate::process::{self, Reaper, SpawnSpec};
use crate::{AppState, Config, ExecdError, Server};

/// Signals forwarded to the entrypoint.
const FORWARDED: &[i32] = &[
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
];

fn log(msg: &str) {
    eprintln!("execd: {msg}");
}

/// Runs the daemon until it should exit and returns the process exit code.
///
/// Without an entrypoint (or without `exit_with_entrypoint`) it serves until SIGTERM or
/// SIGINT. With an entrypoint, SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2/SIGWINCH go
/// to the entrypoint; execd exits when the entrypoint exits if `exit_with_entrypoint` is
/// set or a SIGTERM/SIGINT was received, with the entrypoint's status (128 + signal when
/// it was killed).
pub fn run(config: Config) -> Result<i32, ExecdError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(64)
        .thread_keep_alive(Duration::from_secs(5))
        .enable_all()
        .build()
        .map_err(ExecdError::Runtime)?;
    let code = rt.block_on(run_async(config));
    rt.shutdown_timeout(Duration::from_millis(200));
    code
}

async fn run_async(config: Config) -> Result<i32, ExecdError> {
    // SAFETY: plain syscalls.
    let pid1 = unsafe { libc::getpid() } == 1;
    if config.init && !pid1 {
        // Orphans of our children come to us instead of the real init.
        // SAFETY: plain prctl.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    let reaper: Arc<Reaper> = Reaper::start(config.init || pid1);
    let state = AppState::with_reaper(config.state_config(), reaper.clone());
    let server = Server::bind_with_state(config.listen, state.clone()).await?;
    match server.local_addr() {
        Ok(a) => log(&format!("listening on {a}")),
        Err(e) => log(&format!("listening (address unknown: {e})")),
    }

    // Handlers first: as PID 1 an unhandled SIGTERM would simply be ignored.
    let mut sigs = Vec::new();
    for &s in FORWARDED {
        match signal(SignalKind::from_raw(s)) {
            Ok(stream) => sigs.push((s, stream)),
            Err(e) => log(&format!("cannot handle signal {s}: {e}")),
        }
    }

    let mut entry: Option<(i32, oneshot::Receiver<ExitStatus>)> = None;
    if let Some((program, args)) = config.entrypoint.split_first() {
        let path_var = config
            .state_config()
            .base_env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.clone());
        let resolved = program
            .to_str()
            .and_then(|p| process::find_in_path(p, path_var.as_deref()))
            .map(|p| p.into_os_string())
            .unwrap_or_else(|| program.clone());
        let mut spec = SpawnSpec::new(resolved);
        spec.args = args.to_vec();
        spec.env = state.base_env().to_vec();
        spec.pipe_output = false;
        spec.null_stdin = false;
        spec.take_tty = true;
        match process::spawn(&reaper, spec) {
            Ok(sp) => entry = Some((sp.pid, sp.exit)),
            Err(e) => {
                log(&format!(
                    "cannot start entrypoint {}: {e}",
                    program.to_string_lossy()
                ));
                if config.exit_with_entrypoint {
                    return Ok(if e.kind() == std::io::ErrorKind::NotFound {
                        127
                    } else {
                        126
                    });
                }
            }
        }
    }

    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve(async {
        let _ = stop_rx.await;
    }));

    let mut stopping = false;
    let code = loop {
        let signals = next_signal(&mut sigs);
        let entry_exit = async {
            match entry.as_mut() {
                Some((_, rx)) => rx.await.ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            sig = signals => {
                let term = sig == libc::SIGTERM || sig == libc::SIGINT;
                match &entry {
                    Some((pid, _)) => {
                        process::kill_pid(*pid, sig);
                        if term {
                            stopping = true;
                        }
                    }
                    None if term => break 0,
                    None => {}
                }
            }
            status = entry_exit => {
                let code = status.as_ref().map(process::exit_code).unwrap_or(255);
                entry = None;
                if config.exit_with_entrypoint || stopping {
                    break code;
                }
                log(&format!("entrypoint exited with code {code}; still serving"));
            }
        }
    };
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_millis(100), serving).await;
    Ok(code)
}

/// The next of the handled signals (never resolves when none could be handled).
async fn next_signal(sigs: &mut [(i32, tokio::signal::unix::Signal)]) -> i32 {
    if sigs.is_empty() {
        return std::future::pending().await;
    }
    let (n, _, _) = futures::future::select_all(sigs.iter_mut().map(|(n, s)| {
        let n = *n;
        Box::pin(async move {
            s.recv().await;
            n
        })
    }))
    .await;
    n
}
