//! OCI runtimes: which ones can run on this host (probed once at start), and
//! how containerd is told to use them. A requested runtime that cannot run is
//! an error for that request — never silently swapped for another.

use std::path::{Path, PathBuf};

use prost::Message;

use crate::runtime_check::{self, Mitigation, RuntimeCheckMode};

/// containerd's shim for runc-compatible runtimes (runc, crun, and runsc
/// through the agent's wrapper: see [`crate::gvisor`]).
pub const RUNC_SHIM: &str = "io.containerd.runc.v2";

/// The runc shim's options message (`containerd.runc.v1.Options`); only the
/// fields the agent sets are declared, with their wire numbers.
#[derive(Clone, PartialEq, Message)]
pub struct RuncOptions {
    #[prost(string, tag = "6")]
    pub binary_name: String,
    /// The runtime's state root (the shim appends the containerd namespace).
    #[prost(string, tag = "7")]
    pub root: String,
    #[prost(bool, tag = "9")]
    pub systemd_cgroup: bool,
}

const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";

#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeInfo {
    /// "runc", "crun", "runsc".
    pub name: String,
    pub shim: &'static str,
    pub binary: Option<PathBuf>,
    /// What the shim runs instead of `binary`: runsc's wrapper carrying the
    /// agent's runsc flags (see [`crate::gvisor`]); `None` for runc and crun.
    pub wrapper: Option<PathBuf>,
    /// The runtime's own state root, when not the shim's default
    /// (`/run/containerd/runc`, shared by every containerd on the node):
    /// runsc's is the agent's (see [`crate::gvisor::state_root`]).
    pub root: Option<PathBuf>,
    /// The version line the runtime printed at start (runsc; empty when not
    /// read).
    pub version: String,
    pub available: bool,
    /// Why not, when not available.
    pub reason: String,
    /// Known escapes that apply to its version (see
    /// [`crate::runtime_check`]); empty for runsc and clean versions.
    pub findings: Vec<runtime_check::Finding>,
    /// Set when the version check (under `enforce`) made it unavailable.
    pub check_refusal: Option<String>,
}

impl RuntimeInfo {
    /// The `Container.runtime` for this runtime.
    pub fn container_runtime(&self) -> containerd_client::services::v1::container::Runtime {
        let options = match self.shim {
            RUNC_SHIM => Some(prost_types::Any {
                type_url: RUNC_OPTIONS_TYPE.to_string(),
                value: RuncOptions {
                    binary_name: self
                        .wrapper
                        .as_ref()
                        .or(self.binary.as_ref())
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or_else(|| self.name.clone()),
                    root: self
                        .root
                        .as_ref()
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    systemd_cgroup: false,
                }
                .encode_to_vec(),
            }),
            _ => None,
        };
        containerd_client::services::v1::container::Runtime {
            name: self.shim.to_string(),
            options,
        }
    }
}

/// How [`probe_with`] finds and checks the runtimes.
#[derive(Debug, Clone, Default)]
pub struct ProbeOptions {
    /// Binaries by runtime name, instead of a PATH lookup.
    pub binaries: Vec<(String, PathBuf)>,
    pub check: RuntimeCheckMode,
    /// Sandboxes run in user namespaces (a mitigation of some escapes).
    pub user_namespaces: bool,
    /// The agent has sandbox networking (runsc needs it, see
    /// [`crate::gvisor`]).
    pub network: bool,
    /// Where runsc's wrapper is written, with which flags; `None`: runsc is
    /// probed but never made available (nowhere to write the wrapper).
    pub runsc: Option<(PathBuf, crate::gvisor::RunscConfig)>,
}

/// Probes runc, crun and runsc on this host (PATH lookup, version check
/// enforced, no user namespaces).
pub fn probe() -> Vec<RuntimeInfo> {
    probe_with(&ProbeOptions::default())
}

/// Probes runc, crun and runsc: found, runnable on this host, and (runc,
/// crun) free of unmitigated known escapes (see [`crate::runtime_check`]).
pub fn probe_with(opts: &ProbeOptions) -> Vec<RuntimeInfo> {
    let hybrid = hybrid_cgroups(Path::new("/sys/fs/cgroup"));
    ["runc", "crun", "runsc"]
        .into_iter()
        .map(|name| {
            let binary = opts
                .binaries
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, p)| p.clone())
                .or_else(|| find_in_path(name));
            let (available, reason) = match (&binary, name) {
                (None, _) => (false, format!("{name} is not installed (not found in PATH)")),
                // crun (1.8) refuses a host where cgroup v1 controllers and a
                // v2 hierarchy that lists controllers coexist.
                (Some(_), "crun") if hybrid => (
                    false,
                    "crun refuses this host's hybrid cgroup layout (cgroup v1 controllers plus a \
                     cgroup v2 hierarchy with controllers): \"cgroups in hybrid mode not supported\""
                        .to_string(),
                ),
                _ => (true, String::new()),
            };
            let mut info = RuntimeInfo {
                name: name.to_string(),
                shim: RUNC_SHIM,
                binary,
                wrapper: None,
                root: None,
                version: String::new(),
                available,
                reason,
                findings: Vec::new(),
                check_refusal: None,
            };
            if info.available && name == crate::gvisor::RUNSC {
                prepare_runsc(&mut info, opts);
            } else if info.available {
                check_version(&mut info, opts);
            }
            info
        })
        .collect()
}

/// Makes an installed runsc usable, or says why it is not: it needs the
/// agent's sandbox networking and no node user namespace, and it must
/// really run here (`runsc --version`); then its wrapper is written.
fn prepare_runsc(info: &mut RuntimeInfo, opts: &ProbeOptions) {
    let Some(binary) = info.binary.clone() else {
        return;
    };
    let refuse = |info: &mut RuntimeInfo, reason: String| {
        info.available = false;
        info.reason = reason;
    };
    if !opts.network {
        return refuse(
            info,
            "runsc needs sandbox networking (gVisor's netstack takes the sandbox's veth, and \
             the agent reaches execd at the sandbox's address): this agent runs with \
             --network none"
                .into(),
        );
    }
    if opts.user_namespaces {
        return refuse(
            info,
            "runsc is not supported with --user-namespace node: gVisor runs the sandbox's \
             user ids in its own kernel, and the shifted image snapshots and id mapping are \
             runc's; run runsc pools with --user-namespace off"
                .into(),
        );
    }
    let Some((state_dir, cfg)) = &opts.runsc else {
        return refuse(
            info,
            "runsc: the agent has no state dir for its wrapper".into(),
        );
    };
    match crate::gvisor::prepare(state_dir, &binary, cfg) {
        Ok((wrapper, version)) => {
            tracing::info!(runtime = "runsc", %version, wrapper = %wrapper.display(), platform = cfg.platform.as_str(), "gVisor ready");
            info.wrapper = Some(wrapper);
            info.root = Some(crate::gvisor::state_root(state_dir));
            info.version = version;
        }
        Err(e) => refuse(info, format!("runsc cannot run here: {e}")),
    }
}

/// Reads the runtime's version and applies the check's rule: a refusal
/// makes it unavailable under `enforce`, a warning under `warn`.
fn check_version(info: &mut RuntimeInfo, opts: &ProbeOptions) {
    let Some(binary) = info.binary.clone() else {
        return;
    };
    let (refusal, findings) = runtime_check::verdict(&info.name, &binary, opts.user_namespaces);
    for f in &findings {
        match f.mitigation {
            Mitigation::Full => tracing::info!(runtime = %info.name, cve = f.cve, "{f}"),
            _ => tracing::warn!(runtime = %info.name, cve = f.cve, "{f}"),
        }
    }
    info.findings = findings;
    if let Some(reason) = refusal {
        match opts.check {
            RuntimeCheckMode::Enforce => {
                info.available = false;
                info.reason = reason.clone();
                info.check_refusal = Some(reason);
            }
            RuntimeCheckMode::Warn => tracing::warn!(
                runtime = %info.name,
                "--runtime-check warn: using it anyway: {reason}"
            ),
        }
    }
}

/// [`probe_with`] for the agent's configuration; refuses the start when
/// the default runtime has an unmitigated known escape (under `enforce`):
/// every create without a runtime would use it.
pub fn probe_for(cfg: &crate::AgentConfig) -> crate::Result<Vec<RuntimeInfo>> {
    let runtimes = probe_with(&ProbeOptions {
        binaries: cfg.runtime_binaries.clone(),
        check: cfg.runtime_check,
        user_namespaces: cfg.user_namespace.enabled(),
        network: cfg.network.is_some(),
        runsc: Some((cfg.state_dir.clone(), cfg.runsc)),
    });
    match runtimes.iter().find(|r| r.name == cfg.default_runtime) {
        Some(r) if r.check_refusal.is_some() => Err(crate::AgentError::RuntimeUnavailable {
            runtime: r.name.clone(),
            reason: r.reason.clone(),
        }),
        _ => Ok(runtimes),
    }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// True when `/sys/fs/cgroup` is a v1 layout (not itself cgroup2) and a v2
/// hierarchy mounted below it has controllers enabled.
pub fn hybrid_cgroups(root: &Path) -> bool {
    let is_v2_root = nix::sys::statfs::statfs(root)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false);
    if is_v2_root {
        return false;
    }
    std::fs::read_to_string(root.join("unified/cgroup.controllers"))
        .map(|s| !s.trim().is_empty())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runc_options_encode_binary_name_as_field_6() {
        let opts = RuncOptions {
            binary_name: "crun".into(),
            root: String::new(),
            systemd_cgroup: false,
        };
        // tag 6, wire type 2 → 0x32, then length and bytes.
        assert_eq!(opts.encode_to_vec(), [0x32, 4, b'c', b'r', b'u', b'n']);
    }

    #[test]
    fn probe_reports_every_runtime_with_a_reason_when_unavailable() {
        let rts = probe();
        assert_eq!(
            rts.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["runc", "crun", "runsc"]
        );
        for r in &rts {
            assert_eq!(r.available, r.reason.is_empty(), "{r:?}");
        }
    }
}
