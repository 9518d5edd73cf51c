//! Runs the CNI reference plugins (Debian's containernetworking-plugins):
//! `loopback`, then `ptp` with `host-local` IPAM. ptp gives every sandbox a
//! routed /32 behind its own veth: no L2 between sandboxes, so every packet
//! between two of them crosses the host's forward hook, where nftables
//! judges it.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use super::subnet::Ipv4Net;

/// The CNI network name (also host-local's directory under its dataDir).
const NETWORK_NAME: &str = "sandbolt";
const CNI_VERSION: &str = "1.0.0";
/// The plugins the agent runs; `host-local` is called by `ptp`.
pub const PLUGINS: [&str; 3] = ["loopback", "ptp", "host-local"];

/// A plugin run that failed, with what the plugin said.
#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("cannot run CNI plugin {plugin}: {source}")]
    Spawn {
        plugin: PathBuf,
        source: std::io::Error,
    },
    /// The plugin's CNI error (`{code, msg, details}`) or, without one, its
    /// stderr.
    #[error("CNI {command} with {plugin} failed (code {code}): {message}")]
    Plugin {
        plugin: String,
        command: &'static str,
        code: i64,
        message: String,
    },
    #[error("CNI {plugin} answered an unexpected result: {reason}")]
    BadResult { plugin: String, reason: String },
}

/// What ptp made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtpResult {
    pub host_veth: String,
    pub ip: Ipv4Addr,
}

/// The plugins' configuration for one agent.
#[derive(Debug, Clone)]
pub struct Cni {
    pub bin_dir: PathBuf,
    pub subnet: Ipv4Net,
    pub gateway: Ipv4Addr,
    pub ipam_dir: PathBuf,
}

impl Cni {
    fn ptp_config(&self) -> Value {
        json!({
            "cniVersion": CNI_VERSION,
            "name": NETWORK_NAME,
            "type": "ptp",
            // The agent's nftables table masquerades (one rule, not one per veth).
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "dataDir": self.ipam_dir,
                "ranges": [[{"subnet": self.subnet.to_string(), "gateway": self.gateway.to_string()}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        })
    }

    fn loopback_config() -> Value {
        json!({"cniVersion": CNI_VERSION, "name": NETWORK_NAME, "type": "loopback"})
    }

    /// Brings up `lo` and `eth0` of the namespace at `netns`.
    pub fn add(&self, member_id: &str, netns: &Path) -> Result<PtpResult, CniError> {
        self.run(
            "loopback",
            "ADD",
            member_id,
            Some(netns),
            "lo",
            &Self::loopback_config(),
        )?;
        let result = self.run(
            "ptp",
            "ADD",
            member_id,
            Some(netns),
            "eth0",
            &self.ptp_config(),
        )?;
        parse_ptp(&result).map_err(|reason| CniError::BadResult {
            plugin: "ptp".into(),
            reason,
        })
    }

    /// Removes the veth and frees the address. `netns` is None when the
    /// namespace is already gone: host-local still frees the address.
    pub fn del(&self, member_id: &str, netns: Option<&Path>) -> Result<(), CniError> {
        self.run("ptp", "DEL", member_id, netns, "eth0", &self.ptp_config())?;
        if netns.is_some() {
            self.run(
                "loopback",
                "DEL",
                member_id,
                netns,
                "lo",
                &Self::loopback_config(),
            )?;
        }
        Ok(())
    }

    fn run(
        &self,
        plugin: &str,
        command: &'static str,
        member_id: &str,
        netns: Option<&Path>,
        ifname: &str,
        config: &Value,
    ) -> Result<Value, CniError> {
        let bin = self.bin_dir.join(plugin);
        let mut child = Command::new(&bin)
            .env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", member_id)
            .env("CNI_NETNS", netns.map(Path::as_os_str).unwrap_or_default())
            .env("CNI_IFNAME", ifname)
            .env("CNI_PATH", &self.bin_dir)
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| CniError::Spawn {
                plugin: bin.clone(),
                source,
            })?;
        let input = serde_json::to_vec(config).expect("CNI config serializes");
        if let Some(mut stdin) = child.stdin.take() {
            // A plugin that exits early is reported by its status below.
            let _ = stdin.write_all(&input);
        }
        let out = child.wait_with_output().map_err(|source| CniError::Spawn {
            plugin: bin.clone(),
            source,
        })?;
        let result: Option<Value> = serde_json::from_slice(&out.stdout).ok();
        if out.status.success() {
            return Ok(result.unwrap_or(Value::Null));
        }
        let (code, message) = match result.as_ref().filter(|r| r.get("code").is_some()) {
            Some(err) => (
                err["code"].as_i64().unwrap_or(-1),
                [err["msg"].as_str(), err["details"].as_str()]
                    .into_iter()
                    .flatten()
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>()
                    .join(": "),
            ),
            None => (
                i64::from(out.status.code().unwrap_or(-1)),
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ),
        };
        Err(CniError::Plugin {
            plugin: plugin.to_string(),
            command,
            code,
            message,
        })
    }
}

/// The host-side veth (`interfaces[0]`, the one without `sandbox`) and the
/// address of a ptp result.
fn parse_ptp(result: &Value) -> Result<PtpResult, String> {
    let host_veth = result["interfaces"]
        .as_array()
        .and_then(|ifs| ifs.iter().find(|i| i.get("sandbox").is_none()))
        .and_then(|i| i["name"].as_str())
        .ok_or("no host-side interface")?
        .to_string();
    let address = result["ips"]
        .as_array()
        .and_then(|ips| ips.first())
        .and_then(|ip| ip["address"].as_str())
        .ok_or("no address")?;
    let ip = address
        .split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("bad address {address:?}"))?;
    Ok(PtpResult { host_veth, ip })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptp_results_name_the_host_veth_and_the_address() {
        let r = json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": "veth434131a8", "mac": "a6:f8:e8:c6:c1:02"},
                {"name": "eth0", "mac": "fa:33:fd:cf:bf:bc", "sandbox": "/x"}
            ],
            "ips": [{"interface": 1, "address": "10.203.250.2/24", "gateway": "10.203.250.1"}]
        });
        assert_eq!(
            parse_ptp(&r).unwrap(),
            PtpResult {
                host_veth: "veth434131a8".into(),
                ip: Ipv4Addr::new(10, 203, 250, 2)
            }
        );
        assert!(parse_ptp(&json!({"interfaces": []})).is_err());
    }

    #[test]
    fn a_failing_plugin_reports_its_cni_error() {
        let dir = tempfile::tempdir().unwrap();
        let cni = Cni {
            bin_dir: dir.path().to_path_buf(),
            subnet: "10.203.250.0/24".parse().unwrap(),
            gateway: Ipv4Addr::new(10, 203, 250, 1),
            ipam_dir: dir.path().join("ipam"),
        };
        let fake = dir.path().join("ptp");
        std::fs::write(
            &fake,
            "#!/bin/sh\ncat >/dev/null\necho '{\"code\":7,\"msg\":\"bad config\",\"details\":\"why\"}'\nexit 1\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = cni.del("m1", None).unwrap_err();
        assert!(
            matches!(&err, CniError::Plugin { code: 7, message, .. } if message == "bad config: why"),
            "{err}"
        );
        let err = cni.add("m1", dir.path()).unwrap_err();
        assert!(matches!(err, CniError::Spawn { .. }), "{err}");
    }
}
