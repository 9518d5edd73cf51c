//! Sandbox isolation flags of `sandbolt agent` and `sandbolt up`: user
//! namespaces, the OCI runtime version check and gVisor's flags.

use std::path::PathBuf;

use sandbolt_agent::AgentConfig;
use sandbolt_agent::gvisor::{RunscConfig, RunscOverlay, RunscPlatform};
use sandbolt_agent::runtime_check::RuntimeCheckMode;
use sandbolt_agent::userns::UserNamespaceMode;

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SecurityArgs {
    /// `node`: every sandbox runs in a user namespace mapping its ids
    /// 0..65535 to host ids from --userns-base (root inside is an
    /// unprivileged uid on the host; each image is shifted once). `off`:
    /// root in a sandbox is root on the host.
    #[arg(
        long,
        env = "SANDBOLT_USER_NAMESPACE",
        default_value = "off",
        value_parser = parse_user_namespace
    )]
    pub user_namespace: UserNamespaceMode,
    /// First host uid/gid of the node's sandbox range (65536 ids; at least 65536).
    #[arg(long, env = "SANDBOLT_USERNS_BASE", default_value_t = sandbolt_agent::userns::DEFAULT_BASE)]
    pub userns_base: u32,
    /// `enforce`: a runc with an unmitigated known container escape is
    /// refused (the agent does not start when it is the default runtime);
    /// `warn`: logged and used anyway. See the README's runtime version check.
    #[arg(
        long,
        env = "SANDBOLT_RUNTIME_CHECK",
        default_value = "enforce",
        value_parser = parse_runtime_check
    )]
    pub runtime_check: RuntimeCheckMode,
    /// An OCI runtime's binary instead of the PATH lookup, `NAME=PATH`
    /// (repeatable), e.g. `runc=/opt/runc-1.2.8/runc`.
    #[arg(
        long = "runtime-binary",
        env = "SANDBOLT_RUNTIME_BINARIES",
        value_delimiter = ',',
        value_parser = parse_runtime_binary
    )]
    pub runtime_binary: Vec<(String, PathBuf)>,
    /// How gVisor (runsc) sandboxes intercept system calls: `ptrace` works
    /// everywhere, also inside a VM; `kvm` is faster on bare metal but hangs
    /// under nested virtualisation (a VM inside a VM). Default: ptrace.
    #[arg(
        long,
        env = "SANDBOLT_RUNSC_PLATFORM",
        default_value = "ptrace",
        value_parser = parse_runsc_platform
    )]
    pub runsc_platform: RunscPlatform,
    /// Where a gVisor (runsc) sandbox's root filesystem writes go: `none`
    /// (default) writes through to the sandbox's snapshot on the node, as
    /// with runc; `memory` keeps them in an overlay in gVisor's memory
    /// (counted against the memory limit; `ephemeral_storage` is then
    /// refused for runsc sandboxes).
    #[arg(
        long,
        env = "SANDBOLT_RUNSC_OVERLAY",
        default_value = "none",
        value_parser = parse_runsc_overlay
    )]
    pub runsc_overlay: RunscOverlay,
}

fn parse_runsc_platform(s: &str) -> Result<RunscPlatform, String> {
    s.parse()
}

fn parse_runsc_overlay(s: &str) -> Result<RunscOverlay, String> {
    s.parse()
}

fn parse_user_namespace(s: &str) -> Result<UserNamespaceMode, String> {
    s.parse()
}

fn parse_runtime_check(s: &str) -> Result<RuntimeCheckMode, String> {
    s.parse()
}

fn parse_runtime_binary(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name @ ("runc" | "crun" | "runsc"), path)) if path.starts_with('/') => {
            Ok((name.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!(
            "--runtime-binary {s:?}: expected NAME=/absolute/path, NAME one of runc, crun, runsc"
        )),
    }
}

impl SecurityArgs {
    pub(crate) fn apply(&self, config: &mut AgentConfig) {
        config.user_namespace = self.user_namespace;
        config.userns_base = self.userns_base;
        config.runtime_check = self.runtime_check;
        config.runtime_binaries = self.runtime_binary.clone();
        config.runsc = RunscConfig {
            platform: self.runsc_platform,
            overlay: self.runsc_overlay,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        security: SecurityArgs,
    }

    fn parse(args: &[&str]) -> Result<SecurityArgs, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from([&["x"], args].concat()).map(|c| c.security)
    }

    #[test]
    fn defaults_and_values() {
        let d = parse(&[]).unwrap();
        assert_eq!(d.user_namespace, UserNamespaceMode::Off);
        assert_eq!(d.userns_base, 100_000);
        assert_eq!(d.runtime_check, RuntimeCheckMode::Enforce);
        let s = parse(&[
            "--user-namespace=node",
            "--userns-base=300000",
            "--runtime-check=warn",
            "--runtime-binary=runc=/opt/runc",
        ])
        .unwrap();
        assert_eq!(s.user_namespace, UserNamespaceMode::Node);
        assert_eq!(s.userns_base, 300_000);
        assert_eq!(s.runtime_check, RuntimeCheckMode::Warn);
        assert_eq!(
            s.runtime_binary,
            [("runc".into(), PathBuf::from("/opt/runc"))]
        );
        assert!(parse(&["--user-namespace=pod"]).is_err());
        assert!(parse(&["--runtime-check=off"]).is_err());
        assert!(parse(&["--runtime-binary=docker=/x"]).is_err());
        assert!(parse(&["--runtime-binary=runc=relative"]).is_err());
    }

    #[test]
    fn runsc_flags() {
        let d = parse(&[]).unwrap();
        assert_eq!(d.runsc_platform, RunscPlatform::Ptrace);
        assert_eq!(d.runsc_overlay, RunscOverlay::None);
        let s = parse(&["--runsc-platform=kvm", "--runsc-overlay=memory"]).unwrap();
        assert_eq!(s.runsc_platform, RunscPlatform::Kvm);
        assert_eq!(s.runsc_overlay, RunscOverlay::Memory);
        let e = parse(&["--runsc-platform=xen"]).unwrap_err().to_string();
        assert!(e.contains("--runsc-platform"), "{e}");
        assert!(parse(&["--runsc-overlay=disk"]).is_err());
    }
}
