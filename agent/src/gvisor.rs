//! gVisor (`runsc`): a second kernel between a sandbox's code and the node.
//!
//! There is no `containerd-shim-runsc-v1` on this kind of node (Debian ships
//! `runsc` alone), so containerd's runc shim drives runsc as its runtime
//! binary: runsc speaks runc's command line (`create`, `start`, `kill`,
//! `pause`, `delete`, `state`, `ps`). The agent owns runsc's own flags by
//! writing a wrapper, `<state>/runtimes/runsc`, that the shim runs as
//! `binary_name` (see [`crate::runtime::RuntimeInfo::container_runtime`]):
//! `exec runsc --platform=<p> --network=sandbox [--overlay2=root:memory] "$@"`
//! (inside a private mount namespace: see [`wrapper_script`]).
//! The shim adds `--root`, `--log` and the subcommand itself.
//!
//! `--network=sandbox` makes gVisor's netstack take over the sandbox's veth
//! (the address is moved from the host kernel into the sentry). The
//! sandbox's loopback is then the sentry's, not the namespace's, so the
//! agent cannot reach execd by entering the namespace and dialling
//! `127.0.0.1` (see [`crate::netns`]): it dials the sandbox's own address
//! from the node instead ([`crate::proxy::Upstream::Address`]). That needs
//! sandbox networking: runsc is unavailable on an agent with
//! `--network none` (runsc would otherwise refuse the node's own namespace,
//! or need `--network=host`, which is no isolation at all).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The runtime name on the wire (SandboxSpec.runtime, pool runtimes).
pub const RUNSC: &str = "runsc";

/// How long `runsc --version` may take at start before runsc is reported
/// unavailable.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether sandboxes of `runtime` are reached at their own address rather
/// than through their network namespace's loopback.
pub fn dials_by_address(runtime: &str) -> bool {
    runtime == RUNSC
}

/// How gVisor's sentry intercepts the sandbox's system calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunscPlatform {
    /// `PTRACE_SYSEMU`: works everywhere, also inside a VM.
    #[default]
    Ptrace,
    /// Hardware virtualisation through `/dev/kvm`: faster system calls on
    /// bare metal; hangs under nested virtualisation.
    Kvm,
}

impl RunscPlatform {
    pub fn as_str(self) -> &'static str {
        match self {
            RunscPlatform::Ptrace => "ptrace",
            RunscPlatform::Kvm => "kvm",
        }
    }
}

impl std::str::FromStr for RunscPlatform {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ptrace" => Ok(RunscPlatform::Ptrace),
            "kvm" => Ok(RunscPlatform::Kvm),
            other => Err(format!(
                "--runsc-platform {other:?}: expected ptrace or kvm"
            )),
        }
    }
}

/// Where a gVisor sandbox's root filesystem writes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunscOverlay {
    /// Through the gofer into the sandbox's writable containerd snapshot,
    /// as with runc: `resources.ephemeral_storage` is measured there.
    #[default]
    None,
    /// Into an overlay held in the sentry's memory (`--overlay2=root:memory`):
    /// fewer gofer round trips, writes count against the memory limit, and
    /// the snapshot on the node stays empty (so `ephemeral_storage` is
    /// refused for runsc sandboxes).
    Memory,
}

impl std::str::FromStr for RunscOverlay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(RunscOverlay::None),
            "memory" => Ok(RunscOverlay::Memory),
            other => Err(format!(
                "--runsc-overlay {other:?}: expected none or memory"
            )),
        }
    }
}

/// The agent's runsc flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunscConfig {
    pub platform: RunscPlatform,
    pub overlay: RunscOverlay,
}

#[derive(Debug, thiserror::Error)]
pub enum GvisorError {
    #[error("running {binary} --version: {source}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{binary} --version did not answer within {VERSION_TIMEOUT:?}")]
    Timeout { binary: String },
    #[error("{binary} --version failed ({status}): {stderr}")]
    Failed {
        binary: String,
        status: String,
        stderr: String,
    },
    #[error("writing the runsc wrapper {path}: {source}")]
    Wrapper {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "this runsc has no --overlay2 flag, which --runsc-overlay memory needs (use --runsc-overlay none)"
    )]
    NoOverlay,
    #[error("{0} is missing (package util-linux): the runsc wrapper needs it")]
    MissingTool(&'static str),
}

/// runsc's state root (the shim's `--root`, plus the containerd namespace):
/// the agent's own, not the shim's node-wide default. runsc finds a
/// container by any unambiguous prefix of its id, so in a root shared with
/// other agents (or other containerds) one sandbox id that is a prefix of
/// another's made `runsc start` refuse as "ambiguous" (seen on the test bed).
pub fn state_root(state_dir: &Path) -> PathBuf {
    state_dir.join("runtimes").join("runsc-root")
}

/// The wrapper's path under the agent's state dir.
pub fn wrapper_path(state_dir: &Path) -> PathBuf {
    state_dir.join("runtimes").join(RUNSC)
}

/// The wrapper's text: runsc with the agent's flags, then whatever the shim
/// passes. Debug logging stays off (runsc's debug logs hold the sandbox's
/// system calls and grow without bound).
///
/// runsc runs in a private mount namespace with an empty, read-only
/// `/proc/sys/net`: this runsc decides that it was given the node's own
/// network namespace when `/proc/sys/net/core/rmem_default` exists there,
/// which was true only of the root namespace until Linux made that sysctl
/// per namespace (6.x); since then it refuses every namespace. Hiding the
/// directory turns that misfiring check off; the agent itself guarantees
/// that a runsc sandbox always gets its own prepared namespace (runsc is
/// unavailable without sandbox networking). The gofer and sandbox
/// processes inherit the namespace; they read nothing under
/// `/proc/sys/net` (gVisor's netstack has its own settings).
pub fn wrapper_script(runsc: &Path, cfg: &RunscConfig) -> String {
    let mut flags = vec![
        format!("--platform={}", cfg.platform.as_str()),
        "--network=sandbox".to_string(),
    ];
    if cfg.overlay == RunscOverlay::Memory {
        flags.push("--overlay2=root:memory".into());
    }
    format!(
        "#!/bin/sh\n\
         # Written by the sandbolt agent at start; containerd's runc shim runs it.\n\
         exec {UNSHARE} -m {SH} -c '{MOUNT} -t tmpfs -o ro,size=4k sandbolt-runsc /proc/sys/net && exec \"$0\" \"$@\"' {} {} \"$@\"\n",
        shell_quote(&runsc.to_string_lossy()),
        flags.join(" ")
    )
}

/// The tools the wrapper runs (util-linux and a POSIX shell).
const UNSHARE: &str = "/usr/bin/unshare";
const MOUNT: &str = "/usr/bin/mount";
const SH: &str = "/bin/sh";

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Writes the wrapper (atomically: a shim starting meanwhile runs the old
/// or the new one, never half of one) and returns its path.
pub fn write_wrapper(
    state_dir: &Path,
    runsc: &Path,
    cfg: &RunscConfig,
) -> Result<PathBuf, GvisorError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = wrapper_path(state_dir);
    let err = |source| GvisorError::Wrapper {
        path: path.display().to_string(),
        source,
    };
    let dir = path.parent().expect("the wrapper path has a parent");
    std::fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{RUNSC}.{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o755)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(wrapper_script(runsc, cfg).as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(err)?;
    drop(file);
    std::fs::rename(&tmp, &path).map_err(err)?;
    Ok(path)
}

/// Runs `runsc --version` (the binary really starts here) and returns its
/// first line, e.g. `runsc version 0.0~20221219.0`.
pub fn version(runsc: &Path) -> Result<String, GvisorError> {
    let binary = runsc.display().to_string();
    let out = run_bounded(Command::new(runsc).arg("--version"), &binary)?;
    if !out.status.success() {
        return Err(GvisorError::Failed {
            binary,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string())
}

/// Whether this runsc knows `--overlay2` (older ones only `--overlay`).
pub fn supports_overlay2(runsc: &Path) -> Result<bool, GvisorError> {
    let binary = runsc.display().to_string();
    let out = run_bounded(Command::new(runsc).arg("flags"), &binary)?;
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    Ok(text.contains("-overlay2"))
}

/// Runs `cmd` to completion, killed after [`VERSION_TIMEOUT`].
fn run_bounded(cmd: &mut Command, binary: &str) -> Result<std::process::Output, GvisorError> {
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|source| GvisorError::Spawn {
            binary: binary.to_string(),
            source,
        })?;
    let deadline = std::time::Instant::now() + VERSION_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(GvisorError::Timeout {
                    binary: binary.to_string(),
                });
            }
        }
    }
    child
        .wait_with_output()
        .map_err(|source| GvisorError::Spawn {
            binary: binary.to_string(),
            source,
        })
}

/// What makes runsc usable on this agent: the wrapper written and the
/// version read. `Err` is the reason it is not, for the inventory.
pub fn prepare(
    state_dir: &Path,
    runsc: &Path,
    cfg: &RunscConfig,
) -> Result<(PathBuf, String), GvisorError> {
    for tool in [UNSHARE, MOUNT, SH] {
        if !Path::new(tool).is_file() {
            return Err(GvisorError::MissingTool(tool));
        }
    }
    let version = version(runsc)?;
    if cfg.overlay == RunscOverlay::Memory && !supports_overlay2(runsc)? {
        return Err(GvisorError::NoOverlay);
    }
    let wrapper = write_wrapper(state_dir, runsc, cfg)?;
    Ok((wrapper, version))
}

/// Refuses what a gVisor sandbox cannot have, naming the field:
/// - `host_mounts` and `volume_mounts`: the agent mounts volumes by moving
///   an open directory into the task's mount namespace, which under gVisor
///   is the sentry's, not the sandbox's (gVisor's file system is served by
///   its gofer from the OCI spec's mounts only);
/// - `resources.ephemeral_storage` with `--runsc-overlay memory`: the
///   writes never reach the snapshot it is measured on.
pub fn check_spec(
    spec: &sandbolt_proto::agent::v1::SandboxSpec,
    cfg: &RunscConfig,
) -> Result<(), crate::AgentError> {
    let refuse = |field: &str, why: &str| {
        Err(crate::AgentError::InvalidArgument(format!(
            "{field}: not supported for runtime runsc (gVisor): {why}"
        )))
    };
    if !spec.host_mounts.is_empty() {
        return refuse(
            "host_mounts",
            "volumes cannot be mounted into a gVisor sandbox on this agent; use runtime runc",
        );
    }
    if !spec.volume_mounts.is_empty() {
        return refuse(
            "volume_mounts",
            "named volumes cannot be mounted into a gVisor sandbox on this agent; use runtime runc",
        );
    }
    let ephemeral = spec
        .resources
        .as_ref()
        .is_some_and(|r| !r.ephemeral_storage.trim().is_empty());
    if ephemeral && cfg.overlay == RunscOverlay::Memory {
        return refuse(
            "resources.ephemeral_storage",
            "this agent keeps gVisor's root file system writes in memory (--runsc-overlay memory), \
             where they count against resources.memory instead",
        );
    }
    Ok(())
}

/// Host tasks a gVisor sandbox needs per process inside it: under the
/// ptrace platform each guest process has a stub process and sentry
/// threads tracing it (measured here: 400 sleeping processes took 3,170
/// host tasks, about 8 each, on top of ~55 for an idle sandbox).
pub const HOST_TASKS_PER_PROCESS: i64 = 8;
/// Host tasks of an idle gVisor sandbox (sentry, gofer, execd's stub).
const IDLE_HOST_TASKS: i64 = 64;

/// The host cgroup's `pids.max` for a gVisor sandbox whose request allows
/// `pids_limit` processes. gVisor's processes are not host processes: the
/// host limit counts the sandbox's host tasks, so it is scaled to let
/// about `pids_limit` processes run inside. Going over it kills the whole
/// sandbox (gVisor cannot start a host thread) instead of failing one
/// `fork` with `EAGAIN` as under runc: the node stays protected either way.
pub fn host_pids_limit(pids_limit: i64) -> i64 {
    pids_limit
        .saturating_mul(HOST_TASKS_PER_PROCESS)
        .saturating_add(IDLE_HOST_TASKS)
}

/// The refusal of an operation a gVisor sandbox does not support.
pub fn unsupported(id: &str, action: &str, why: &str) -> crate::AgentError {
    crate::AgentError::InvalidArgument(format!(
        "sandbox {id} runs under runsc (gVisor): cannot {action}: {why}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapper_passes_the_agents_flags_then_the_shims() {
        let s = wrapper_script(Path::new("/usr/bin/runsc"), &RunscConfig::default());
        assert!(
            s.ends_with(
                "/proc/sys/net && exec \"$0\" \"$@\"' '/usr/bin/runsc' --platform=ptrace --network=sandbox \"$@\"\n"
            ),
            "{s}"
        );
        let s = wrapper_script(
            Path::new("/opt/it's/runsc"),
            &RunscConfig {
                platform: RunscPlatform::Kvm,
                overlay: RunscOverlay::Memory,
            },
        );
        assert!(
            s.contains("'/opt/it'\\''s/runsc' --platform=kvm --network=sandbox --overlay2=root:memory \"$@\""),
            "{s}"
        );
    }

    #[test]
    fn host_pids_limit_leaves_room_for_the_sentry() {
        assert_eq!(host_pids_limit(64), 64 * 8 + 64);
        assert_eq!(host_pids_limit(i64::MAX), i64::MAX);
    }

    #[test]
    fn flags_parse_or_name_themselves() {
        assert_eq!("kvm".parse::<RunscPlatform>(), Ok(RunscPlatform::Kvm));
        assert!(
            "xen"
                .parse::<RunscPlatform>()
                .unwrap_err()
                .contains("--runsc-platform")
        );
        assert_eq!("memory".parse::<RunscOverlay>(), Ok(RunscOverlay::Memory));
        assert!(
            "disk"
                .parse::<RunscOverlay>()
                .unwrap_err()
                .contains("--runsc-overlay")
        );
    }
}
