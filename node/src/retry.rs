//! The one retry shape of node processes (node crate and agent): delays doubling up to a cap, for as
//! long as a wall-clock deadline allows (a call may itself take a while, so
//! counting only the sleeps would overrun it).

use std::time::Duration;

use backon::ExponentialBuilder;
use tokio::time::Instant;

/// Delays from `first`, doubling, at most `cap`; no limit on attempts (the
/// deadline ends them) and no jitter.
pub fn doubling(first: Duration, cap: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(first)
        .with_factor(2.0)
        .with_max_delay(cap)
        .without_max_times()
}

/// For backon's `adjust`: gives up when the next sleep would end past
/// `deadline`.
pub fn until<E>(deadline: Instant) -> impl FnMut(&E, Option<Duration>) -> Option<Duration> {
    move |_, next| next.filter(|d| Instant::now() + *d <= deadline)
}
