//! nftables rules of sandboxes, rendered as `nft -f -` scripts, one
//! transaction each (all or nothing). The agent's table is [`Table`]; the
//! lifecycle's Docker backend declares its own base chains (dispatching by
//! source address rather than by veth) and shares the per-sandbox part:
//! [`Table::sandbox_chain`], [`Table::allow_resolved`], [`Table::set_denied`].
//!
//! Layout (one table per agent, named after its subnet so it is unique on
//! the host): `sandbox_ifaces` holds every host-side veth of the agent;
//! traffic into them is only ever a reply; traffic from an attached one is
//! dispatched (`dispatch` map) to the sandbox's chain `sb_<member>`, a
//! pool member's is dropped; traffic from any of them to the node itself
//! reaches only the DNS proxy. `blocked` (private, link-local/metadata,
//! multicast ranges, the agent's subnet) is closed to every sandbox unless
//! `pool_allowed` opens part of it; then the policy's address rules, the
//! addresses of denied names (`d_<member>`), of allowed names resolved by
//! the DNS proxy (`a_<member>`), and the default.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::Duration;

use sandbolt_proto::egress::{Action, ISOLATED_RANGES, NetworkPolicy};

use super::Ipv4Net;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("cannot run nft: {0} (apt-get install nftables)")]
    Spawn(std::io::Error),
    #[error("nft refused the ruleset: {stderr}")]
    Refused { stderr: String },
}

/// Applies `script` as one transaction.
pub fn apply(script: &str) -> Result<(), NftError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftError::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(script.as_bytes());
    }
    let out = child.wait_with_output().map_err(NftError::Spawn)?;
    if out.status.success() {
        return Ok(());
    }
    Err(NftError::Refused {
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// Whether the agent's table exists.
pub fn table_exists(name: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "inet", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// One agent's table.
#[derive(Debug, Clone)]
pub struct Table {
    pub name: String,
    subnet: Ipv4Net,
    gateway: Ipv4Addr,
    allow: Vec<Ipv4Net>,
}

/// What the chain of one attached sandbox is made of.
#[derive(Debug, Clone, Copy)]
pub struct SandboxRules<'a> {
    pub member_id: &'a str,
    pub ip: Ipv4Addr,
    pub veth: &'a str,
    pub policy: &'a NetworkPolicy,
}

/// The table's name for an agent's subnet.
pub fn table_name(subnet: Ipv4Net) -> String {
    format!("sandbolt_{}", subnet.slug())
}

impl Table {
    pub fn new(subnet: Ipv4Net, gateway: Ipv4Addr, allow: Vec<Ipv4Net>) -> Self {
        Self::named(table_name(subnet), subnet, gateway, allow)
    }

    /// A table of another name (the Docker backend's). Its base chains are
    /// its owner's; the per-sandbox chains reference the sets `blocked` and
    /// `pool_allowed`, which the owner must declare.
    pub fn named(name: String, subnet: Ipv4Net, gateway: Ipv4Addr, allow: Vec<Ipv4Net>) -> Self {
        Self {
            name,
            subnet,
            gateway,
            allow,
        }
    }

    /// Declares the table idempotently: missing pieces are added, the base
    /// chains and fixed sets are flushed and filled again in the same
    /// transaction (so a restart never opens a gap), and the sandboxes'
    /// chains and sets are left as they are.
    pub fn declare(&self) -> String {
        let t = &self.name;
        let mut s = format!("add table inet {t}\n");
        let _ = writeln!(s, "add set inet {t} sandbox_ifaces {{ type ifname; }}");
        let _ = writeln!(
            s,
            "add set inet {t} blocked {{ type ipv4_addr; flags interval; auto-merge; }}"
        );
        let _ = writeln!(s, "flush set inet {t} blocked");
        let _ = writeln!(s, "add element inet {t} blocked {{ {} }}", self.blocked());
        let _ = writeln!(
            s,
            "add set inet {t} pool_allowed {{ type ipv4_addr; flags interval; auto-merge; }}"
        );
        let _ = writeln!(s, "flush set inet {t} pool_allowed");
        if !self.allow.is_empty() {
            let allow: Vec<String> = self.allow.iter().map(Ipv4Net::to_string).collect();
            let _ = writeln!(
                s,
                "add element inet {t} pool_allowed {{ {} }}",
                allow.join(", ")
            );
        }
        let _ = writeln!(s, "add map inet {t} dispatch {{ type ifname : verdict; }}");
        self.declare_chains(&mut s);
        s
    }

    /// [`ISOLATED_RANGES`], plus the agent's subnet when it lies outside them.
    fn blocked(&self) -> String {
        let mut ranges: Vec<String> = ISOLATED_RANGES.iter().map(|r| r.to_string()).collect();
        let inside = ISOLATED_RANGES
            .iter()
            .filter_map(|r| r.parse::<Ipv4Net>().ok())
            .any(|r| r.contains(self.subnet.addr()) && r.prefix() <= self.subnet.prefix());
        if !inside {
            ranges.push(self.subnet.to_string());
        }
        ranges.join(", ")
    }

    fn declare_chains(&self, s: &mut String) {
        let t = &self.name;
        let gw = self.gateway;
        let chain = |s: &mut String, name: &str, head: &str, rules: &[String]| {
            let _ = writeln!(s, "add chain inet {t} {name} {head}");
            let _ = writeln!(s, "flush chain inet {t} {name}");
            for r in rules {
                let _ = writeln!(s, "add rule inet {t} {name} {r}");
            }
        };
        chain(
            s,
            "sandbox_input",
            "",
            &[
                "ct state established,related accept".into(),
                format!("ip daddr {gw} udp dport 53 accept"),
                format!("ip daddr {gw} tcp dport 53 accept"),
                "drop".into(),
            ],
        );
        chain(
            s,
            "forward_hook",
            "{ type filter hook forward priority filter - 10; policy accept; }",
            &[
                "oifname @sandbox_ifaces ct state established,related accept".into(),
                "oifname @sandbox_ifaces drop".into(),
                "iifname @sandbox_ifaces meta nfproto ipv6 drop".into(),
                "iifname vmap @dispatch".into(),
                "iifname @sandbox_ifaces drop".into(),
            ],
        );
        chain(
            s,
            "input_hook",
            "{ type filter hook input priority filter - 10; policy accept; }",
            &["iifname @sandbox_ifaces jump sandbox_input".into()],
        );
        let net = self.subnet;
        chain(
            s,
            "postrouting_hook",
            "{ type nat hook postrouting priority srcnat; policy accept; }",
            &[format!("ip saddr {net} ip daddr != {net} masquerade")],
        );
    }

    /// Registers a pool member's veth (its traffic is dropped until a
    /// sandbox is attached).
    pub fn add_iface(&self, veth: &str) -> String {
        format!(
            "add element inet {} sandbox_ifaces {{ \"{veth}\" }}\n",
            self.name
        )
    }

    /// Gives an attached sandbox its sets and chain and dispatches its
    /// veth to it. Existing sets keep their elements (a re-declare after a
    /// restart keeps resolved addresses); `flush_sets` empties them (a new
    /// attachment, a policy change).
    pub fn attach(&self, r: &SandboxRules<'_>, flush_sets: bool) -> String {
        let t = &self.name;
        let mut s = self.sandbox_chain(r, flush_sets);
        let _ = writeln!(
            s,
            "add element inet {t} sandbox_ifaces {{ \"{v}\" }}\nadd element inet {t} dispatch {{ \"{v}\" : jump sb_{m} }}",
            v = r.veth,
            m = r.member_id
        );
        s
    }

    /// The sets `a_<m>`, `d_<m>` and the chain `sb_<m>` of one sandbox,
    /// without anything that sends traffic to the chain. Existing sets
    /// keep their elements unless `flush_sets`.
    pub fn sandbox_chain(&self, r: &SandboxRules<'_>, flush_sets: bool) -> String {
        let t = &self.name;
        let m = r.member_id;
        let mut s = String::new();
        for set in [format!("a_{m}"), format!("d_{m}")] {
            let _ = writeln!(
                s,
                "add set inet {t} {set} {{ type ipv4_addr; flags timeout; }}"
            );
            if flush_sets {
                let _ = writeln!(s, "flush set inet {t} {set}");
            }
        }
        let _ = writeln!(s, "add chain inet {t} sb_{m}");
        let _ = writeln!(s, "flush chain inet {t} sb_{m}");
        for rule in sandbox_rules(r) {
            let _ = writeln!(s, "add rule inet {t} sb_{m} {rule}");
        }
        s
    }

    /// Removes what [`Self::sandbox_chain`] made (nothing may jump to the
    /// chain any more: remove that first, in the same script).
    pub fn remove_sandbox_chain(&self, member_id: &str) -> String {
        let t = &self.name;
        let m = member_id;
        format!(
            "flush chain inet {t} sb_{m}\ndelete chain inet {t} sb_{m}\ndelete set inet {t} a_{m}\ndelete set inet {t} d_{m}\n"
        )
    }

    /// Removes what [`Self::add_iface`] and (when `attached`)
    /// [`Self::attach`] made.
    pub fn detach(&self, member_id: &str, veth: Option<&str>, attached: bool) -> String {
        let t = &self.name;
        let m = member_id;
        let mut s = String::new();
        if let Some(v) = veth {
            if attached {
                let _ = writeln!(s, "delete element inet {t} dispatch {{ \"{v}\" }}");
            }
            let _ = writeln!(s, "delete element inet {t} sandbox_ifaces {{ \"{v}\" }}");
        }
        if attached {
            s.push_str(&self.remove_sandbox_chain(m));
        }
        s
    }

    /// Opens `addrs` for member `m` until `ttl` passes; an address already
    /// open gets the new timeout (add, delete, add: `add` alone would keep
    /// the old one, and `delete` alone fails on a missing element).
    pub fn allow_resolved(&self, member_id: &str, addrs: &[Ipv4Addr], ttl: Duration) -> String {
        let t = &self.name;
        let secs = ttl.as_secs().max(1);
        let with_timeout: Vec<String> = addrs
            .iter()
            .map(|a| format!("{a} timeout {secs}s"))
            .collect();
        let bare: Vec<String> = addrs.iter().map(Ipv4Addr::to_string).collect();
        let (with_timeout, bare) = (with_timeout.join(", "), bare.join(", "));
        format!(
            "add element inet {t} a_{member_id} {{ {with_timeout} }}\ndelete element inet {t} a_{member_id} {{ {bare} }}\nadd element inet {t} a_{member_id} {{ {with_timeout} }}\n"
        )
    }

    /// Replaces the addresses of member `m`'s denied names.
    pub fn set_denied(&self, member_id: &str, addrs: &[Ipv4Addr]) -> String {
        let t = &self.name;
        let mut s = format!("flush set inet {t} d_{member_id}\n");
        if !addrs.is_empty() {
            let list: Vec<String> = addrs.iter().map(Ipv4Addr::to_string).collect();
            let _ = writeln!(
                s,
                "add element inet {t} d_{member_id} {{ {} }}",
                list.join(", ")
            );
        }
        s
    }

    pub fn delete(&self) -> String {
        format!("delete table inet {}\n", self.name)
    }
}

/// The rules of one sandbox's chain, in order (see the module docs).
fn sandbox_rules(r: &SandboxRules<'_>) -> Vec<String> {
    let m = r.member_id;
    let verdict = |a: Action| match a {
        Action::Allow => "accept",
        Action::Deny => "drop",
    };
    let mut rules = vec![
        // Anti-spoofing: only the sandbox's own address leaves its veth.
        format!("ip saddr != {} drop", r.ip),
        "ct state established,related accept".into(),
        "ip daddr @blocked ip daddr != @pool_allowed drop".into(),
        // No resolver but the node's (which is not forwarded: input chain).
        "meta l4proto { tcp, udp } th dport { 53, 853 } drop".into(),
    ];
    for (action, addr, prefix) in r.policy.address_rules() {
        rules.push(format!("ip daddr {addr}/{prefix} {}", verdict(action)));
    }
    rules.push(format!("ip daddr @d_{m} drop"));
    rules.push(format!("ip daddr @a_{m} accept"));
    rules.push(verdict(r.policy.effective_default()).to_string());
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        Table::new(
            "10.203.4.0/24".parse().unwrap(),
            Ipv4Addr::new(10, 203, 4, 1),
            vec!["10.9.0.0/16".parse().unwrap()],
        )
    }

    #[test]
    fn declare_names_the_table_after_the_subnet_and_blocks_private_ranges() {
        let s = table().declare();
        assert!(
            s.starts_with("add table inet sandbolt_10_203_4_0_24\n"),
            "{s}"
        );
        assert!(s.contains("169.254.0.0/16"));
        assert!(s.contains("add element inet sandbolt_10_203_4_0_24 pool_allowed { 10.9.0.0/16 }"));
        assert!(s.contains("ip daddr 10.203.4.1 udp dport 53 accept"));
        assert!(s.contains("ip saddr 10.203.4.0/24 ip daddr != 10.203.4.0/24 masquerade"));
        // The subnet lies in 10/8: not added twice.
        assert!(!s.contains("10.203.4.0/24, "));
        let outside = Table::new(
            "198.18.0.0/24".parse().unwrap(),
            Ipv4Addr::new(198, 18, 0, 1),
            vec![],
        );
        assert!(outside.declare().contains(", 198.18.0.0/24 }"));
    }

    #[test]
    fn sandbox_chain_orders_isolation_address_rules_sets_and_default() {
        let policy = NetworkPolicy::parse(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"198.51.100.7"},{"action":"allow","target":"example.com"}]}"#,
        )
        .unwrap();
        let r = SandboxRules {
            member_id: "m1",
            ip: Ipv4Addr::new(10, 203, 4, 2),
            veth: "veth1",
            policy: &policy,
        };
        let rules = sandbox_rules(&r);
        assert_eq!(rules[0], "ip saddr != 10.203.4.2 drop");
        assert_eq!(rules[4], "ip daddr 198.51.100.7/32 accept");
        assert_eq!(
            rules[5..],
            ["ip daddr @d_m1 drop", "ip daddr @a_m1 accept", "drop"]
        );
        let s = table().attach(&r, true);
        assert!(s.contains("flush set inet sandbolt_10_203_4_0_24 a_m1"));
        assert!(s.contains("dispatch { \"veth1\" : jump sb_m1 }"));
        assert!(!table().attach(&r, false).contains("flush set"));
        let allow_all = NetworkPolicy::default();
        let r = SandboxRules {
            policy: &allow_all,
            ..r
        };
        assert_eq!(sandbox_rules(&r).last().unwrap(), "accept");
    }
}
