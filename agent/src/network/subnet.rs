//! The agent's sandbox subnet: parsed from `--network-subnet`, or "auto"
//! (the first free /24 of 10.203.0.0/16). A subnet is claimed with a
//! host-wide `flock` held for the agent's life, so parallel agents (tests
//! run many) never share one, and remembered in the state dir so a
//! restarted agent takes the same one back (its sandboxes keep their
//! addresses).

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use nix::fcntl::{Flock, FlockArg};

use super::NetworkError;

/// Where every agent's subnet locks live (host-wide, tmpfs: gone at reboot
/// together with every netns and veth).
pub const CLAIMS_DIR: &str = "/run/sandbolt/subnets";
/// The range "auto" hands out /24s from.
const AUTO_RANGE: Ipv4Net = Ipv4Net::canonical(Ipv4Addr::new(10, 203, 0, 0), 16);

/// Moved to `sandbolt-node` (the lifecycle's Docker backend uses it too).
pub use sandbolt_node::network::Ipv4Net;

/// `--network-subnet`: "auto" or an explicit CIDR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SubnetChoice {
    #[default]
    Auto,
    Explicit(Ipv4Net),
}

impl FromStr for SubnetChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        let net: Ipv4Net = s.parse()?;
        if !(16..=28).contains(&net.prefix()) {
            return Err(format!(
                "subnet {net}: the prefix must be /16 to /28 (room for a gateway and sandboxes)"
            ));
        }
        Ok(Self::Explicit(net))
    }
}

/// A subnet this agent holds: the lock is released when this is dropped.
#[derive(Debug)]
pub struct Claim {
    pub net: Ipv4Net,
    lock_path: PathBuf,
    _lock: Flock<File>,
}

impl Claim {
    /// Releases the claim and removes its lock file (nothing left on the
    /// host). Removing while holding the lock is safe: a waiter re-checks
    /// the file it locked is still the one at the path.
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.lock_path);
    }
}

/// Claims the subnet `choice` asks for, preferring the one remembered in
/// `remembered_file` (written back on success).
pub fn claim(
    choice: SubnetChoice,
    remembered_file: &Path,
    claims_dir: &Path,
) -> Result<Claim, NetworkError> {
    std::fs::create_dir_all(claims_dir).map_err(NetworkError::io(claims_dir))?;
    // One claim at a time on this host: the overlap check and the lock
    // must not interleave with another agent's.
    let guard_path = claims_dir.join(".claiming");
    let guard = lock_file(&guard_path, FlockArg::LockExclusive)?
        .ok_or_else(|| NetworkError::Subnet(format!("cannot lock {}", guard_path.display())))?;
    let claimed = claim_locked(choice, remembered_file, claims_dir);
    // Nothing stays on the host but held claims (a waiter notices the
    // unlinked file and locks a fresh one).
    let _ = std::fs::remove_file(&guard_path);
    drop(guard);
    claimed
}

fn claim_locked(
    choice: SubnetChoice,
    remembered_file: &Path,
    claims_dir: &Path,
) -> Result<Claim, NetworkError> {
    let remembered = std::fs::read_to_string(remembered_file)
        .ok()
        .and_then(|s| s.trim().parse::<Ipv4Net>().ok());
    let claim = match (choice, remembered) {
        (SubnetChoice::Explicit(net), _) => try_claim(net, claims_dir)?.map_err(|holder| {
            NetworkError::Subnet(format!(
                "subnet {net} overlaps {holder}, held by another running sandbolt agent on this host; choose another --network-subnet"
            ))
        })?,
        (SubnetChoice::Auto, Some(net)) if AUTO_RANGE.contains(net.addr()) => {
            try_claim(net, claims_dir)?.map_err(|holder| {
                NetworkError::Subnet(format!(
                    "subnet {net} (remembered in {}) overlaps {holder}, held by another running agent: is another agent using this state dir?",
                    remembered_file.display()
                ))
            })?
        }
        (SubnetChoice::Auto, _) => auto(claims_dir)?,
    };
    crate::network::state::write_atomic(remembered_file, format!("{}\n", claim.net).as_bytes())?;
    Ok(claim)
}

/// The first free /24 of [`AUTO_RANGE`].
fn auto(claims_dir: &Path) -> Result<Claim, NetworkError> {
    for third in 0..=255u8 {
        let [a, b, ..] = AUTO_RANGE.addr().octets();
        let net = Ipv4Net::new(Ipv4Addr::new(a, b, third, 0), 24).expect("a /24");
        if routed_on_host(net) {
            continue;
        }
        if let Ok(claim) = try_claim(net, claims_dir)? {
            return Ok(claim);
        }
    }
    Err(NetworkError::Subnet(format!(
        "every /24 of {AUTO_RANGE} is taken by other agents; pass --network-subnet"
    )))
}

/// Whether the host already routes into `net` (an interface address or a
/// route that is not ours), so sandboxes there would collide with it.
fn routed_on_host(net: Ipv4Net) -> bool {
    let Ok(routes) = std::fs::read_to_string("/proc/net/route") else {
        return false;
    };
    routes.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(dst), Some(m)) = (f.get(1), f.get(7)) else {
            return false;
        };
        let (Ok(dst), Ok(m)) = (u32::from_str_radix(dst, 16), u32::from_str_radix(m, 16)) else {
            return false;
        };
        // /proc/net/route prints addresses in host (little-endian) order.
        let dst = Ipv4Addr::from(u32::from_be(dst));
        let prefix = u32::from_be(m).count_ones() as u8;
        prefix > 0 && Ipv4Net::new(dst, prefix).is_ok_and(|r| r.overlaps(&net))
    })
}

/// Locks `net`'s file; `Err(holder)` when it or an overlapping subnet is
/// held by a live agent.
fn try_claim(net: Ipv4Net, claims_dir: &Path) -> Result<Result<Claim, Ipv4Net>, NetworkError> {
    for other in claimed(claims_dir) {
        if other != net && other.overlaps(&net) && is_held(&lock_path(claims_dir, other))? {
            return Ok(Err(other));
        }
    }
    let path = lock_path(claims_dir, net);
    match lock_file(&path, FlockArg::LockExclusiveNonblock)? {
        Some(lock) => Ok(Ok(Claim {
            net,
            lock_path: path,
            _lock: lock,
        })),
        None => Ok(Err(net)),
    }
}

fn lock_path(claims_dir: &Path, net: Ipv4Net) -> PathBuf {
    claims_dir.join(format!("{}.lock", net.slug()))
}

/// The subnets with a lock file (held or not).
pub(crate) fn claimed(claims_dir: &Path) -> Vec<Ipv4Net> {
    let Ok(dir) = std::fs::read_dir(claims_dir) else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let name = e.ok()?.file_name().into_string().ok()?;
        Ipv4Net::from_slug(name.strip_suffix(".lock")?)
    })
    .collect()
}

/// Whether a live process holds the lock at `path`.
pub fn is_held(path: &Path) -> Result<bool, NetworkError> {
    if !path.exists() {
        return Ok(false);
    }
    Ok(lock_file(path, FlockArg::LockExclusiveNonblock)?.is_none())
}

/// Locks `path` (created if missing); `None` when another process holds it
/// (non-blocking `how` only). Re-checks that the locked file is still the
/// one at `path`: a releasing agent unlinks it while holding the lock.
pub fn lock_file(path: &Path, how: FlockArg) -> Result<Option<Flock<File>>, NetworkError> {
    loop {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(NetworkError::io(path))?;
        let lock = match Flock::lock(file, how) {
            Ok(l) => l,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Ok(None),
            Err((_, e)) => return Err(NetworkError::io(path)(e.into())),
        };
        let same = match (lock.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
            _ => false,
        };
        if same {
            return Ok(Some(lock));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_canonical_and_slug_round_trips() {
        let n: Ipv4Net = "10.203.7.9/24".parse().unwrap();
        assert_eq!(n.to_string(), "10.203.7.0/24");
        assert_eq!(n.nth(1), Ipv4Addr::new(10, 203, 7, 1));
        assert_eq!(Ipv4Net::from_slug(&n.slug()), Some(n));
        assert!(n.contains("10.203.7.200".parse().unwrap()));
        assert!(!n.contains("10.203.8.1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Ipv4Net>().is_err());
        assert!("nope".parse::<Ipv4Net>().is_err());
        assert_eq!("auto".parse::<SubnetChoice>().unwrap(), SubnetChoice::Auto);
        assert!("10.0.0.0/8".parse::<SubnetChoice>().is_err());
        assert!("10.0.0.0/30".parse::<SubnetChoice>().is_err());
    }

    #[test]
    fn parallel_claims_get_different_subnets_and_explicit_overlap_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let claims = dir.path().join("claims");
        let a = claim(SubnetChoice::Auto, &dir.path().join("a"), &claims).unwrap();
        let b = claim(SubnetChoice::Auto, &dir.path().join("b"), &claims).unwrap();
        assert_ne!(a.net, b.net);
        // The remembered subnet comes back once free, and not while held.
        assert!(claim(SubnetChoice::Auto, &dir.path().join("a"), &claims).is_err());
        let net = a.net;
        a.release();
        let again = claim(SubnetChoice::Auto, &dir.path().join("a"), &claims).unwrap();
        assert_eq!(again.net, net);
        let wide = SubnetChoice::Explicit("10.203.0.0/16".parse().unwrap());
        let err = claim(wide, &dir.path().join("c"), &claims).unwrap_err();
        assert!(err.to_string().contains("10.203.0.0/16"), "{err}");
    }
}
