//! Isolation of Docker sandboxes: every sandbox joins one sandbolt-owned
//! bridge network, and nftables rules owned by the lifecycle keep sandboxes
//! from each other (no L2 between bridge ports), from the node's own
//! addresses and ports, and from link-local (cloud metadata) and private
//! ranges, while leaving public egress open. The same guarantees the
//! containerd fast path gives, without depending on the agent crate.

use std::collections::HashMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};

use bollard::Docker;
use bollard::models::{Ipam, IpamConfig, NetworkCreateRequest, NetworkInspect};
use sandbolt_node::network::Ipv4Net;
use sha2::{Digest, Sha256};

use crate::error::StartError;

/// The Docker network every sandbox joins.
pub const NETWORK_NAME: &str = "sandbolt";

/// What isolation failed on, and the way out.
const ISOLATION_OFF_HINT: &str = "set `isolation: false` in the Docker config \
     (CLI: --docker-isolation off) to run sandboxes without isolation";

/// The network as the engine made it: what the rules need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxNetwork {
    /// Linux bridge of the network (`sbd` + 8 hex).
    pub bridge: String,
    /// IPv4 subnet in CIDR form.
    pub subnet: String,
    /// The bridge's own address (the sandboxes' gateway).
    pub gateway: Option<String>,
}

/// The bridge name of the engine with ID `engine_id` and data root
/// `root_dir`, within IFNAMSIZ. Both go in: daemons sharing a config dir
/// share their ID (dockerd 20.10 derives it from `/etc/docker/key.json`),
/// while no two daemons on a host share a data root.
pub fn bridge_name(engine_id: &str, root_dir: &str) -> String {
    let digest = Sha256::digest(format!("{engine_id}\n{root_dir}").as_bytes());
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("sbd{hex}")
}

/// The name of both nftables tables (bridge and inet family) of `bridge`.
pub fn table_name(bridge: &str) -> String {
    format!("sandbolt_docker_{bridge}")
}

/// Creates the sandbox network if missing (or checks the existing one),
/// then installs the isolation rules, before any sandbox can start.
pub async fn ensure_isolated(
    docker: &Docker,
    subnet: Option<&str>,
) -> Result<SandboxNetwork, StartError> {
    let network = ensure_network(docker, subnet).await?;
    if !Path::new("/sys/class/net").join(&network.bridge).exists() {
        return Err(StartError::Backend(format!(
            "sandbox isolation: the Docker network's bridge {} is not in this network namespace \
             (is sandbolt running inside a container?); the rules must be installed in the \
             engine's namespace; {ISOLATION_OFF_HINT}",
            network.bridge
        )));
    }
    let script = ruleset(&network, &host_resolvers());
    apply_nft(&script)?;
    enable_forwarding()?;
    tracing::info!(bridge = %network.bridge, subnet = %network.subnet, "docker sandbox isolation installed");
    Ok(network)
}

/// Deletes the isolation tables of `bridge` (the purge path; absence is fine).
pub fn remove_isolation(bridge: &str) -> Result<(), StartError> {
    let table = table_name(bridge);
    let script = format!(
        "table bridge {table}\ndelete table bridge {table}\n\
         table inet {table}\ndelete table inet {table}\n"
    );
    apply_nft(&script)
}

async fn engine_bridge(docker: &Docker) -> Result<String, StartError> {
    let info = docker
        .info()
        .await
        .map_err(|e| StartError::Backend(format!("docker info: {e}")))?;
    let id = info
        .id
        .filter(|id| !id.is_empty())
        .ok_or_else(|| StartError::Backend("docker info reports no engine ID".into()))?;
    Ok(bridge_name(
        &id,
        info.docker_root_dir.as_deref().unwrap_or(""),
    ))
}

async fn ensure_network(
    docker: &Docker,
    subnet: Option<&str>,
) -> Result<SandboxNetwork, StartError> {
    let bridge = engine_bridge(docker).await?;
    let existing = match docker.inspect_network(NETWORK_NAME, None).await {
        Ok(n) => Some(n),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => None,
        Err(e) => {
            return Err(StartError::Backend(format!(
                "inspecting Docker network {NETWORK_NAME}: {e}"
            )));
        }
    };
    let inspect = match existing {
        Some(n) => n,
        None => {
            create_network(docker, &bridge, subnet).await?;
            docker
                .inspect_network(NETWORK_NAME, None)
                .await
                .map_err(|e| {
                    StartError::Backend(format!("inspecting Docker network {NETWORK_NAME}: {e}"))
                })?
        }
    };
    network_facts(&inspect, &bridge, subnet)
}

/// Creates the network with `subnet`, or with one the engine picks. The
/// subnet is always configured in the end: Docker accepts a container's
/// chosen address (egress enforcement) only on such a network, so a picked
/// one is made configured by creating the network again with it.
async fn create_network(
    docker: &Docker,
    bridge: &str,
    subnet: Option<&str>,
) -> Result<(), StartError> {
    if let Some(s) = subnet {
        return create_network_with(docker, bridge, Some(s)).await;
    }
    create_network_with(docker, bridge, None).await?;
    let inspect = docker
        .inspect_network(NETWORK_NAME, None)
        .await
        .map_err(|e| {
            StartError::Backend(format!("inspecting Docker network {NETWORK_NAME}: {e}"))
        })?;
    let picked = network_facts(&inspect, bridge, None)?.subnet;
    docker.remove_network(NETWORK_NAME).await.map_err(|e| {
        StartError::Backend(format!("recreating Docker network {NETWORK_NAME}: {e}"))
    })?;
    create_network_with(docker, bridge, Some(&picked)).await
}

async fn create_network_with(
    docker: &Docker,
    bridge: &str,
    subnet: Option<&str>,
) -> Result<(), StartError> {
    let options = HashMap::from([
        (
            "com.docker.network.bridge.name".to_string(),
            bridge.to_string(),
        ),
        (
            "com.docker.network.bridge.enable_icc".to_string(),
            "false".to_string(),
        ),
    ]);
    let ipam = subnet.map(|s| Ipam {
        config: Some(vec![IpamConfig {
            subnet: Some(s.to_string()),
            ..Default::default()
        }]),
        ..Default::default()
    });
    let request = NetworkCreateRequest {
        name: NETWORK_NAME.to_string(),
        driver: Some("bridge".into()),
        options: Some(options),
        ipam,
        ..Default::default()
    };
    match docker.create_network(request).await {
        Ok(_) => Ok(()),
        // Another lifecycle on the same engine made it first.
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 409, ..
        }) => Ok(()),
        Err(e) => Err(StartError::Backend(format!(
            "creating Docker network {NETWORK_NAME} (bridge {bridge}): {e}"
        ))),
    }
}

/// Checks that an existing network is the one sandbolt would create: a
/// network of the same name with another bridge or subnet would leave
/// sandboxes outside the rules.
fn network_facts(
    n: &NetworkInspect,
    bridge: &str,
    want_subnet: Option<&str>,
) -> Result<SandboxNetwork, StartError> {
    let actual_bridge = n
        .options
        .as_ref()
        .and_then(|o| o.get("com.docker.network.bridge.name"))
        .cloned()
        .unwrap_or_default();
    if actual_bridge != bridge {
        return Err(StartError::Backend(format!(
            "Docker network {NETWORK_NAME} exists with bridge '{actual_bridge}', not {bridge}: \
             remove it (`docker network rm {NETWORK_NAME}`) so sandbolt can recreate it"
        )));
    }
    let ipv4 = n
        .ipam
        .as_ref()
        .and_then(|i| i.config.as_ref())
        .and_then(|c| {
            c.iter()
                .find(|c| c.subnet.as_deref().is_some_and(|s| !s.contains(':')))
        })
        .cloned()
        .unwrap_or_default();
    let subnet = ipv4.subnet.clone().ok_or_else(|| {
        StartError::Backend(format!("Docker network {NETWORK_NAME} has no IPv4 subnet"))
    })?;
    if let Some(want) = want_subnet
        && want != subnet
    {
        return Err(StartError::Config(format!(
            "network_subnet {want}: Docker network {NETWORK_NAME} exists with subnet {subnet}; \
             remove it (`docker network rm {NETWORK_NAME}`) or configure {subnet}"
        )));
    }
    // An engine that reports no gateway for a configured subnet gave the
    // bridge the subnet's first address, its default.
    let gateway = ipv4.gateway.filter(|g| !g.is_empty()).or_else(|| {
        let net = subnet.parse::<Ipv4Net>().ok()?;
        Some(net.nth(1).to_string())
    });
    Ok(SandboxNetwork {
        bridge: bridge.to_string(),
        subnet,
        gateway,
    })
}

/// The host's non-loopback IPv4 resolvers: Docker's embedded DNS forwards
/// to them from the sandbox's own namespace.
fn host_resolvers() -> Vec<Ipv4Addr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    parse_resolvers(&text)
}

fn parse_resolvers(text: &str) -> Vec<Ipv4Addr> {
    text.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next()? == "nameserver").then_some(())?;
            words.next()?.parse::<Ipv4Addr>().ok()
        })
        .filter(|a| !a.is_loopback())
        .collect()
}

/// The whole ruleset as one `nft -f` transaction, idempotent, and nothing
/// is ever half-installed. The bridge table is flushed and declared again;
/// in the inet table only the base chains and the fixed set are, so that
/// the per-sandbox egress chains and their sets (see
/// [`crate::docker_egress`]) survive a restart of the lifecycle.
///
/// Frames between sandboxes never leave the bridge, so the bridge family
/// drops them. It matches on the network's subnet rather than the bridge
/// (`meta ibrname` needs `CONFIG_NFT_BRIDGE_META`, which common kernels
/// lack); the subnet is the network's own, and sandboxes have neither
/// `NET_ADMIN` nor `NET_RAW` to use another source address.
///
/// A sandbox under egress enforcement is dispatched by its source address
/// to its own chain (`dispatch`), which decides every new connection it
/// opens (isolation included); the others get the isolation rules below it.
/// The gateway's port 53 is the egress DNS proxy.
pub fn ruleset(network: &SandboxNetwork, resolvers: &[Ipv4Addr]) -> String {
    let table = table_name(&network.bridge);
    let br = &network.bridge;
    let subnet = &network.subnet;
    let mut s = format!(
        "table bridge {table}\n\
         flush table bridge {table}\n\
         table bridge {table} {{\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority filter; policy accept;\n\
         \x20   ip saddr {subnet} drop\n\
         \x20   arp saddr ip {subnet} drop\n\
         \x20 }}\n\
         }}\n\
         add table inet {table}\n\
         add set inet {table} blocked {{ type ipv4_addr; flags interval; auto-merge; }}\n\
         flush set inet {table} blocked\n\
         add element inet {table} blocked {{ {blocked} }}\n\
         add set inet {table} pool_allowed {{ type ipv4_addr; flags interval; }}\n\
         add map inet {table} dispatch {{ type ipv4_addr : verdict; }}\n",
        blocked = blocked_ranges(subnet)
    );
    let dns = if resolvers.is_empty() {
        Vec::new()
    } else {
        let set = resolvers
            .iter()
            .map(Ipv4Addr::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        vec![format!(
            "iifname \"{br}\" ip daddr {{ {set} }} meta l4proto {{ tcp, udp }} th dport 53 accept"
        )]
    };
    let mut forward = vec![
        format!("iifname \"{br}\" ct state established,related accept"),
        format!("iifname \"{br}\" meta nfproto ipv6 drop"),
        format!("iifname \"{br}\" ip saddr vmap @dispatch"),
    ];
    forward.extend(dns.iter().cloned());
    forward.extend([
        format!("iifname \"{br}\" ip daddr @blocked drop"),
        format!("iifname \"{br}\" accept"),
        format!("oifname \"{br}\" ct state established,related accept"),
        format!("oifname \"{br}\" ct status dnat accept"),
        format!("oifname \"{br}\" drop"),
    ]);
    let mut input = vec![format!(
        "iifname \"{br}\" ct state established,related accept"
    )];
    if let Some(gw) = &network.gateway {
        input.push(format!(
            "iifname \"{br}\" ip daddr {gw} meta l4proto {{ tcp, udp }} th dport 53 accept"
        ));
    }
    input.extend(dns);
    input.push(format!("iifname \"{br}\" drop"));
    for (chain, rules) in [("forward", forward), ("input", input)] {
        s.push_str(&format!(
            "add chain inet {table} {chain} {{ type filter hook {chain} priority filter; policy accept; }}\n\
             flush chain inet {table} {chain}\n"
        ));
        for r in rules {
            s.push_str(&format!("add rule inet {table} {chain} {r}\n"));
        }
    }
    s
}

/// [`ISOLATED_RANGES`](sandbolt_proto::egress::ISOLATED_RANGES) and the
/// sandbox subnet, unless it lies inside them.
fn blocked_ranges(subnet: &str) -> String {
    let ranges = sandbolt_proto::egress::ISOLATED_RANGES;
    let mut blocked: Vec<&str> = ranges.to_vec();
    let inside = subnet.parse::<Ipv4Net>().is_ok_and(|net| {
        ranges
            .iter()
            .filter_map(|r| r.parse::<Ipv4Net>().ok())
            .any(|r| r.contains(net.addr()) && r.prefix() <= net.prefix())
    });
    if !inside {
        blocked.push(subnet);
    }
    blocked.join(", ")
}

/// Runs `script` through `nft -f -` as one transaction.
fn apply_nft(script: &str) -> Result<(), StartError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            StartError::Backend(format!(
                "sandbox isolation needs nftables: running `nft` failed ({e}); \
                 install nftables, or {ISOLATION_OFF_HINT}"
            ))
        })?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())
        .map_err(|e| StartError::Backend(format!("writing the nft ruleset: {e}")))?;
    let out = child
        .wait_with_output()
        .map_err(|e| StartError::Backend(format!("waiting for nft: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(StartError::Backend(format!(
        "sandbox isolation: nft refused the ruleset ({}; installing rules needs root / \
         CAP_NET_ADMIN in the engine's network namespace); {ISOLATION_OFF_HINT}",
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// Sandboxes reach the outside through the host's routing.
fn enable_forwarding() -> Result<(), StartError> {
    let path = "/proc/sys/net/ipv4/ip_forward";
    if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "1") {
        return Ok(());
    }
    std::fs::write(path, "1").map_err(|e| {
        StartError::Backend(format!(
            "sandbox isolation: cannot enable IPv4 forwarding ({path}: {e}); {ISOLATION_OFF_HINT}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_names_fit_ifnamsiz_and_differ_per_engine() {
        let a = bridge_name("ABCD:EFGH", "/var/lib/docker");
        assert_eq!(a.len(), 11);
        assert!(a.starts_with("sbd"));
        assert_ne!(a, bridge_name("ABCD:EFGI", "/var/lib/docker"));
        assert_ne!(a, bridge_name("ABCD:EFGH", "/srv/docker"));
        assert_eq!(a, bridge_name("ABCD:EFGH", "/var/lib/docker"));
    }

    #[test]
    fn resolvers_skip_loopback_and_v6() {
        let text = "# c\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver ::1\nsearch x\n";
        assert_eq!(parse_resolvers(text), vec![Ipv4Addr::new(10, 0, 0, 2)]);
    }

    #[test]
    fn ruleset_blocks_the_subnet_and_is_idempotent() {
        let n = SandboxNetwork {
            bridge: "sbd01234567".into(),
            subnet: "198.18.3.0/24".into(),
            gateway: Some("198.18.3.1".into()),
        };
        let r = ruleset(&n, &[Ipv4Addr::new(10, 0, 0, 2)]);
        assert!(r.contains("flush table bridge sandbolt_docker_sbd01234567"));
        // The inet table keeps the sandboxes' chains: only its own parts
        // are flushed.
        assert!(!r.contains("flush table inet"), "{r}");
        assert!(r.contains("flush chain inet sandbolt_docker_sbd01234567 forward"));
        assert!(
            r.contains("169.254.0.0/16, 172.16.0.0/12, 192.168.0.0/16, 224.0.0.0/3, 198.18.3.0/24")
        );
        assert!(r.contains("ip saddr 198.18.3.0/24 drop"));
        assert!(r.contains("ip daddr { 10.0.0.2 }"));
        assert!(r.contains("ip daddr 198.18.3.1 meta l4proto { tcp, udp } th dport 53 accept"));
        // Sandboxes under enforcement are dispatched before the host
        // resolvers' exception, which comes before the private-range drop.
        let at = |needle: &str| r.find(needle).unwrap_or_else(|| panic!("{needle}: {r}"));
        assert!(at("ip saddr vmap @dispatch") < at("dport 53 accept"));
        assert!(at("dport 53 accept") < at("ip daddr @blocked drop"));
        // A subnet inside the isolated ranges is not added twice.
        assert!(!blocked_ranges("10.214.3.0/24").contains("10.214.3.0/24"));
    }
}
