//! IPv4 networks in CIDR form: what the agent's subnet, the nftables tables
//! of the agent and of the lifecycle's Docker backend, and the CLI's
//! `--network-allow-cidr` all speak.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// An IPv4 network in canonical form (host bits zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Net {
    /// `addr/prefix` with the host bits cleared.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Result<Self, String> {
        if prefix > 32 {
            return Err(format!("prefix /{prefix} is longer than 32"));
        }
        Ok(Self::canonical(addr, prefix))
    }

    /// [`Ipv4Net::new`] for constants; panics on a prefix over 32.
    pub const fn canonical(addr: Ipv4Addr, prefix: u8) -> Self {
        assert!(prefix <= 32, "an IPv4 prefix is at most 32");
        Self {
            addr: Ipv4Addr::from_bits(addr.to_bits() & mask(prefix)),
            prefix,
        }
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The `n`th address of the network (`.1` is the gateway).
    pub fn nth(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) + n)
    }

    /// How many addresses the network spans.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.prefix) == u32::from(self.addr)
    }

    pub fn overlaps(&self, other: &Ipv4Net) -> bool {
        self.contains(other.addr) || other.contains(self.addr)
    }

    /// `10_203_0_0_24`: usable in file names and nft identifiers.
    pub fn slug(&self) -> String {
        let [a, b, c, d] = self.addr.octets();
        format!("{a}_{b}_{c}_{d}_{}", self.prefix)
    }

    /// The network a [`Ipv4Net::slug`] names.
    pub fn from_slug(s: &str) -> Option<Self> {
        let parts: Vec<u8> = s
            .split('_')
            .map(|p| p.parse().ok())
            .collect::<Option<_>>()?;
        let [a, b, c, d, prefix] = parts[..] else {
            return None;
        };
        Self::new(Ipv4Addr::new(a, b, c, d), prefix).ok()
    }
}

const fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Ipv4Net {
    type Err = String;

    /// `a.b.c.d/len`, or a bare address (a /32).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (
                a,
                p.parse::<u8>()
                    .map_err(|_| format!("{s:?}: bad prefix length {p:?}"))?,
            ),
            None => (s, 32),
        };
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IPv4 address or CIDR"))?;
        Self::new(addr, prefix).map_err(|e| format!("{s:?}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form_size_and_slug() {
        let n: Ipv4Net = "10.203.7.9/24".parse().unwrap();
        assert_eq!(n.to_string(), "10.203.7.0/24");
        assert_eq!(n.size(), 256);
        assert_eq!(Ipv4Net::from_slug(&n.slug()), Some(n));
        assert_eq!(
            Ipv4Net::canonical(Ipv4Addr::new(10, 1, 2, 3), 16).to_string(),
            "10.1.0.0/16"
        );
        assert_eq!("0.0.0.0/0".parse::<Ipv4Net>().unwrap().size(), 1 << 32);
    }
}
