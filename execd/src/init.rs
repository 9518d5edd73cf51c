//! The daemon's main loop: runtime, PID 1 duties, entrypoint, signals.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;

use crate::process::{self, Reaper, SpawnSpec};
use crate::state::ClaimedEntrypoint;
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
/// it was killed). With [`Config::warm`] the entrypoint arrives later, from the one
/// successful `POST /sandbolt/claim`, and is then handled exactly the same way.
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
    if config.warm && !config.entrypoint.is_empty() {
        return Err(ExecdError::Usage(
            "warm mode takes no entrypoint: the claim brings it".into(),
        ));
    }
    // SAFETY: plain syscalls.
    let pid1 = unsafe { libc::getpid() } == 1;
    if config.init && !pid1 {
        // Orphans of our children come to us instead of the real init.
        // SAFETY: plain prctl.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    let reaper: Arc<Reaper> = Reaper::start(config.init || pid1);
    let state = AppState::with_reaper(config.state_config(), reaper.clone());
    let claims = config.warm.then(|| {
        let (tx, rx) = oneshot::channel();
        state.enable_warm(tx);
        rx
    });
    let server = Server::bind_with_state(config.listen, state.clone())
        .await?
        .with_limits(config.limits);
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

    let mut main = MainLoop {
        exit_with_entrypoint: config.exit_with_entrypoint,
        reaper,
        sigs,
        entry: None,
        claims,
        stopping: false,
    };
    if !config.entrypoint.is_empty() {
        let env = state.base_env().to_vec();
        if let Err((_, code)) = main.start(&config.entrypoint, env, None)
            && config.exit_with_entrypoint
        {
            return Ok(code);
        }
    }

    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve(async {
        let _ = stop_rx.await;
    }));
    let (code, grace) = main.run().await;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(grace, serving).await;
    Ok(code)
}

/// A running entrypoint.
struct Entry {
    pid: i32,
    exit: oneshot::Receiver<ExitStatus>,
}

/// PID 1's loop: signals, the entrypoint's exit, and (warm) the claim bringing the
/// entrypoint.
struct MainLoop {
    exit_with_entrypoint: bool,
    reaper: Arc<Reaper>,
    sigs: Vec<(i32, tokio::signal::unix::Signal)>,
    entry: Option<Entry>,
    /// Warm mode before the claim: where the claim's entrypoint arrives.
    claims: Option<oneshot::Receiver<ClaimedEntrypoint>>,
    /// A SIGTERM/SIGINT went to the entrypoint: execd follows it out.
    stopping: bool,
}

/// How long open connections may finish their answers at exit.
const GRACE: Duration = Duration::from_millis(100);
/// The same after a failed claim: its 500 is how the agent learns why execd exits.
const CLAIM_FAILED_GRACE: Duration = Duration::from_secs(2);

impl MainLoop {
    /// Starts the entrypoint (the cold `-- ENTRYPOINT` and a warm claim's alike; see
    /// [`spawn_entrypoint`]) and watches it: its pid, or the logged failure with the exit
    /// code execd gives it.
    fn start(
        &mut self,
        argv: &[OsString],
        env: Vec<(OsString, OsString)>,
        cwd: Option<&Path>,
    ) -> Result<i32, (String, i32)> {
        let sp = spawn_entrypoint(&self.reaper, argv, env, cwd).inspect_err(|(m, _)| log(m))?;
        self.entry = Some(Entry {
            pid: sp.pid,
            exit: sp.exit,
        });
        Ok(sp.pid)
    }

    /// Runs until execd should exit: its exit code and how long answers may still go out.
    async fn run(&mut self) -> (i32, Duration) {
        loop {
            let signals = next_signal(&mut self.sigs);
            let entry_exit = async {
                match self.entry.as_mut() {
                    Some(e) => (&mut e.exit).await.ok(),
                    None => std::future::pending().await,
                }
            };
            let claim = async {
                match self.claims.as_mut() {
                    Some(rx) => rx.await.ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                sig = signals => {
                    if let Some(code) = self.on_signal(sig) {
                        return (code, GRACE);
                    }
                }
                status = entry_exit => {
                    let code = status.as_ref().map(process::exit_code).unwrap_or(255);
                    self.entry = None;
                    if self.exit_with_entrypoint || self.stopping {
                        return (code, GRACE);
                    }
                    log(&format!("entrypoint exited with code {code}; still serving"));
                }
                claimed = claim => {
                    self.claims = None;
                    if let Some(c) = claimed
                        && let Some(code) = self.on_claim(c)
                    {
                        return (code, CLAIM_FAILED_GRACE);
                    }
                }
            }
        }
    }

    /// Forwards `sig` to the entrypoint; without one, SIGTERM/SIGINT end execd (code 0).
    fn on_signal(&mut self, sig: i32) -> Option<i32> {
        let term = sig == libc::SIGTERM || sig == libc::SIGINT;
        match &self.entry {
            Some(e) => {
                process::kill_pid(e.pid, sig);
                if term {
                    self.stopping = true;
                }
                None
            }
            None if term => Some(0),
            None => None,
        }
    }

    /// Starts a claim's entrypoint and answers the claim; `Some(code)` when execd exits
    /// (the entrypoint could not start and execd follows it, as on a cold start).
    fn on_claim(&mut self, c: ClaimedEntrypoint) -> Option<i32> {
        match self.start(&c.argv, c.env, c.cwd.as_deref()) {
            Ok(pid) => {
                log(&format!("claimed; entrypoint started as pid {pid}"));
                let _ = c.reply.send(Ok(pid));
                None
            }
            Err((message, code)) => {
                let _ = c.reply.send(Err(message));
                self.exit_with_entrypoint.then_some(code)
            }
        }
    }
}

/// Spawns the entrypoint with `env`, its program looked up in that env's `PATH`; with a
/// `cwd`, execd moves there first (creating it, as runc does a missing working directory)
/// and the entrypoint inherits it. On failure: the message and the exit code a cold start
/// gives it (127 for a missing program, 126 otherwise).
fn spawn_entrypoint(
    reaper: &Reaper,
    argv: &[OsString],
    env: Vec<(OsString, OsString)>,
    cwd: Option<&Path>,
) -> Result<process::Spawned, (String, i32)> {
    let Some((program, args)) = argv.split_first() else {
        return Err(("cannot start an empty entrypoint".into(), 127));
    };
    if let Some(dir) = cwd {
        std::fs::create_dir_all(dir)
            .and_then(|()| std::env::set_current_dir(dir))
            .map_err(|e| {
                let msg = format!("cannot enter working directory {}: {e}", dir.display());
                (msg, 126)
            })?;
    }
    let path_var = env
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
    spec.env = env;
    spec.pipe_output = false;
    spec.null_stdin = false;
    spec.take_tty = true;
    process::spawn(reaper, spec).map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound {
            127
        } else {
            126
        };
        let msg = format!("cannot start entrypoint {}: {e}", program.to_string_lossy());
        (msg, code)
    })
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
