//! Internal tokens and node identity.

use std::io::Read;

use anyhow::Context;

/// 32 random bytes from the kernel, hex encoded.
pub(crate) fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for a token")?;
    Ok(hex::encode(bytes))
}

/// This machine's host name: the default node name and agent id, stable
/// across restarts so that a restarted agent finds its sandboxes again.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
