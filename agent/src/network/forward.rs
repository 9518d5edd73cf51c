//! Other firewalls on the node. Docker (and others) set the iptables
//! FORWARD policy to DROP. Every netfilter base chain on a hook sees each
//! packet, and a drop in any of them is final, so on such a node the
//! sandboxes' traffic that the agent's own table accepts would still be
//! dropped by that policy: sandboxes would have no egress, and nothing
//! would say why.
//!
//! When the FORWARD policy is DROP, the agent therefore inserts two accept
//! rules for its subnet at the top of FORWARD (traffic from the sandboxes,
//! and replies to them), marked with a comment naming its table. Isolation
//! and policy are not weakened by them: the agent's own chains judge every
//! packet of the subnet first, and their drops stand. The rules are removed
//! with the agent's table ([`crate::network::purge`]).
//!
//! Runs `iptables`, which talks to whichever backend (nft or legacy) the
//! node's firewall uses through the same command. A node without `iptables`
//! has no such policy to meet.

use std::process::Command;

use super::subnet::Ipv4Net;

/// What happened to FORWARD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarding {
    /// The policy is not DROP (or there is no iptables): nothing to do.
    Open,
    /// The policy is DROP; the accept rules are in place.
    Allowed,
}

/// The two rules for `net`, as `iptables` arguments after the chain name.
fn rules(net: Ipv4Net, tag: &str) -> [Vec<String>; 2] {
    let comment = ["-m", "comment", "--comment", tag];
    let from: Vec<String> = ["-s", &net.to_string()]
        .into_iter()
        .chain(comment)
        .chain(["-j", "ACCEPT"])
        .map(String::from)
        .collect();
    let replies: Vec<String> = ["-d", &net.to_string()]
        .into_iter()
        .chain(["-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED"])
        .chain(comment)
        .chain(["-j", "ACCEPT"])
        .map(String::from)
        .collect();
    [from, replies]
}

fn iptables(args: &[&str]) -> std::io::Result<std::process::Output> {
    Command::new("iptables").args(args).output()
}

/// The `-S FORWARD` listing, or None when there is no iptables to ask.
fn forward_listing() -> Option<String> {
    let out = iptables(&["-w", "-S", "FORWARD"]).ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Makes sure the node's FORWARD policy does not drop `net`'s traffic (see
/// the module docs); idempotent.
pub fn allow(net: Ipv4Net, tag: &str) -> Result<Forwarding, String> {
    let Some(listing) = forward_listing() else {
        return Ok(Forwarding::Open);
    };
    if !listing.lines().any(|l| l.trim() == "-P FORWARD DROP") {
        return Ok(Forwarding::Open);
    }
    for rule in rules(net, tag) {
        let spec: Vec<&str> = rule.iter().map(String::as_str).collect();
        let present = iptables(&[&["-w", "-C", "FORWARD"][..], &spec].concat())
            .is_ok_and(|o| o.status.success());
        if present {
            continue;
        }
        let out = iptables(&[&["-w", "-I", "FORWARD", "1"][..], &spec].concat())
            .map_err(|e| format!("iptables: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "iptables -I FORWARD {}: {}",
                rule.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    Ok(Forwarding::Allowed)
}

/// Removes every FORWARD rule marked with `tag`; returns how many.
pub fn remove(tag: &str) -> usize {
    let Some(listing) = forward_listing() else {
        return 0;
    };
    let marker = format!("--comment {tag} ");
    let mut removed = 0;
    for line in listing.lines().filter(|l| l.contains(&marker)) {
        let Some(spec) = line.strip_prefix("-A FORWARD ") else {
            continue;
        };
        let args: Vec<&str> = spec.split_whitespace().collect();
        if iptables(&[&["-w", "-D", "FORWARD"][..], &args].concat())
            .is_ok_and(|o| o.status.success())
        {
            removed += 1;
        } else {
            tracing::warn!(
                rule = line,
                "could not remove an iptables FORWARD rule of this agent"
            );
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread in a network namespace of its own (the
    /// commands it starts inherit it), so the node's firewall is never
    /// touched.
    fn in_private_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare netns");
            f()
        })
        .join()
        .unwrap()
    }

    fn forward() -> String {
        forward_listing().expect("iptables lists FORWARD")
    }

    #[test]
    fn a_drop_policy_gets_accept_rules_once_and_they_go_again() {
        in_private_netns(|| {
            let net: Ipv4Net = "10.203.77.0/24".parse().unwrap();
            let tag = "sandbolt_10_203_77_0_24";
            // Open policy: nothing is added.
            assert_eq!(allow(net, tag), Ok(Forwarding::Open));
            assert!(!forward().contains(tag), "{}", forward());

            let out = iptables(&["-w", "-P", "FORWARD", "DROP"]).unwrap();
            assert!(out.status.success(), "{out:?}");
            assert_eq!(allow(net, tag), Ok(Forwarding::Allowed));
            assert_eq!(allow(net, tag), Ok(Forwarding::Allowed));
            let listing = forward();
            assert_eq!(listing.matches(tag).count(), 2, "{listing}");
            assert!(listing.contains("-s 10.203.77.0/24"), "{listing}");
            assert!(listing.contains("-d 10.203.77.0/24"), "{listing}");
            // Another agent's rules are not ours to remove.
            let other: Ipv4Net = "10.203.78.0/24".parse().unwrap();
            allow(other, "sandbolt_10_203_78_0_24").unwrap();

            assert_eq!(remove(tag), 2);
            let listing = forward();
            assert!(!listing.contains(tag), "{listing}");
            assert_eq!(listing.matches("sandbolt_10_203_78_0_24").count(), 2);
            assert_eq!(remove(tag), 0);
        });
    }
}
