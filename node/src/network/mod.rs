//! Egress enforcement pieces shared by the agent (containerd fast path) and
//! the lifecycle's Docker backend: the DNS proxy that enforces FQDN policy
//! ([`dns`]), the nftables rules of one sandbox ([`nft`]) and IPv4 networks
//! ([`Ipv4Net`]). Both backends enforce one policy model
//! (`sandbolt_proto::egress`) with the same code.

pub mod dns;
pub mod ipv4net;
pub mod nft;

pub use ipv4net::Ipv4Net;
