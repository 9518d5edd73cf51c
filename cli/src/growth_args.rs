//! The agent's limits on growth (`sandbolt agent` and `sandbolt up`): the
//! per-sandbox log cap, how often logs and writable layers are checked, and
//! the parent of sandboxes' cgroups.

use std::time::Duration;

use sandbolt_agent::AgentConfig;

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct GrowthArgs {
    /// A sandbox's log file (stdout and stderr) is rotated once over this
    /// size: its newest part goes to `<id>.log.1` (one kept), the file is
    /// truncated; `0` keeps logs unbounded.
    #[arg(
        long,
        env = "SANDBOLT_LOG_MAX_BYTES",
        value_name = "SIZE",
        default_value = "10Mi",
        value_parser = parse_bytes
    )]
    log_max_bytes: u64,
    /// How often log sizes and writable layers with an ephemeral-storage
    /// limit are checked (the overshoot is what a sandbox writes in one).
    #[arg(
        long,
        env = "SANDBOLT_LOG_CHECK_INTERVAL",
        value_name = "DURATION",
        default_value = "1s",
        value_parser = parse_interval
    )]
    log_check_interval: Duration,
    /// Parent of every sandbox's cgroup (`<parent>/<sandbox id>`), e.g. a
    /// cgroup the kubelet accounts such as `/kubepods/burstable` (see the
    /// README's "Limits on growth").
    #[arg(
        long,
        env = "SANDBOLT_CGROUP_PARENT",
        value_name = "PATH",
        default_value = sandbolt_agent::config::DEFAULT_CGROUP_PARENT
    )]
    cgroup_parent: String,
}

impl GrowthArgs {
    pub(crate) fn apply(&self, config: &mut AgentConfig) {
        config.log_max_bytes = self.log_max_bytes;
        config.log_check_interval = self.log_check_interval;
        config.cgroup_parent = self.cgroup_parent.clone();
    }
}

/// A byte quantity (`10Mi`, `0`).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(0);
    }
    sandbolt_proto::quantity::bytes(s).map_err(|e| e.to_string())
}

/// A positive duration (`1s`, `250ms`).
fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim()).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        growth: GrowthArgs,
    }

    #[test]
    fn defaults_and_values_parse_and_bad_ones_are_refused() {
        let a = Args::try_parse_from(["x"]).unwrap().growth;
        assert_eq!(a.log_max_bytes, 10 << 20);
        assert_eq!(a.log_check_interval, Duration::from_secs(1));
        assert_eq!(a.cgroup_parent, "/sandbolt");
        let a = Args::try_parse_from([
            "x",
            "--log-max-bytes",
            "0",
            "--log-check-interval",
            "250ms",
            "--cgroup-parent",
            "/kubepods/burstable",
        ])
        .unwrap()
        .growth;
        let mut cfg = AgentConfig::new("a", "/s", "/e", "/st", "t");
        a.apply(&mut cfg);
        assert_eq!(cfg.log_max_bytes, 0);
        assert_eq!(cfg.log_check_interval, Duration::from_millis(250));
        assert_eq!(cfg.cgroup_parent, "/kubepods/burstable");
        assert!(Args::try_parse_from(["x", "--log-max-bytes", "lots"]).is_err());
        assert!(Args::try_parse_from(["x", "--log-check-interval", "0s"]).is_err());
    }
}
