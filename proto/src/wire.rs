//! Names and numbers on the wire that more than one component must agree on.
//!
//! execd defines the same values for itself (it is a small static binary and
//! does not link this crate); `tests/tests/wire_constants.rs` holds the two
//! to each other.

/// The port execd listens on inside every sandbox (OpenSandbox's execd port).
pub const EXECD_PORT: u16 = 44772;

/// The header carrying a sandbox's access token to execd (OpenSandbox's name
/// for it). The agent's proxy takes its own header ([`PROXY_TOKEN_HEADER`]).
pub const EXECD_TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";

/// The header carrying a sandbox's access token to the agent's proxy. The
/// proxy checks it and strips it before forwarding into the sandbox.
pub const PROXY_TOKEN_HEADER: &str = "X-Sandbolt-Access-Token";
