//! Wall-clock helpers. Expiry and events are in wall time (they are persisted
//! and compared across restarts); liveness uses `Instant`.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn now_unix_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

pub fn now_unix_ms() -> i64 {
    now_unix_nanos() / 1_000_000
}

pub fn now_unix_secs() -> i64 {
    now_unix_nanos() / 1_000_000_000
}
