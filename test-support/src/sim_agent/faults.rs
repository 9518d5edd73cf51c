//! What a simulated agent does besides answering: how long it waits before
//! an answer, how often it fails on purpose, and how often agents of a
//! fleet die and come back (churn). Parsed from flags; sampled with a small
//! lock-free generator (the fleet needs spread, not cryptographic quality).

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::SimError;

/// How long a simulated agent waits before answering a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Latency {
    /// Answer at once.
    #[default]
    None,
    /// Always this long.
    Fixed(Duration),
    /// Uniformly between the two bounds.
    Uniform(Duration, Duration),
    /// Exponentially distributed with this mean (capped at 20 means, so
    /// one unlucky draw cannot stall a whole run).
    Exponential(Duration),
}

impl Latency {
    /// One draw.
    pub fn sample(&self, rng: &Rng) -> Duration {
        match *self {
            Latency::None => Duration::ZERO,
            Latency::Fixed(d) => d,
            Latency::Uniform(lo, hi) => lo + (hi.saturating_sub(lo)).mul_f64(rng.unit()),
            Latency::Exponential(mean) => {
                // 1 - u is in (0, 1]: ln never sees 0.
                let draw = -(1.0 - rng.unit()).ln();
                mean.mul_f64(draw.min(20.0))
            }
        }
    }
}

impl FromStr for Latency {
    type Err = SimError;

    /// `0` or `none`; `5ms` (fixed); `uniform:1ms-5ms`; `exp:2ms` (mean).
    fn from_str(s: &str) -> Result<Self, SimError> {
        let bad = |reason: &str| SimError::Parse {
            what: "latency",
            value: s.to_string(),
            reason: format!(
                "{reason}; expected 0, none, <duration>, uniform:<min>-<max> or exp:<mean>"
            ),
        };
        let dur = |v: &str| humantime::parse_duration(v.trim()).map_err(|e| bad(&e.to_string()));
        let s = s.trim();
        if s == "0" || s.eq_ignore_ascii_case("none") {
            return Ok(Latency::None);
        }
        if let Some(range) = s.strip_prefix("uniform:") {
            let (lo, hi) = range
                .split_once('-')
                .ok_or_else(|| bad("uniform needs <min>-<max>"))?;
            let (lo, hi) = (dur(lo)?, dur(hi)?);
            if hi < lo {
                return Err(bad("uniform's max is below its min"));
            }
            return Ok(Latency::Uniform(lo, hi));
        }
        if let Some(mean) = s.strip_prefix("exp:") {
            return Ok(Latency::Exponential(dur(mean)?));
        }
        Ok(Latency::Fixed(dur(s)?))
    }
}

/// A fraction written as `10%` or `0.1`, within 0..=1; `what` names the
/// flag in the error.
pub fn parse_fraction(what: &'static str, s: &str) -> Result<f64, SimError> {
    let t = s.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|v| v / 100.0),
        None => t.parse::<f64>(),
    };
    match v {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(_) => Err(SimError::Parse {
            what,
            value: s.to_string(),
            reason: "must be between 0 and 1 (0% and 100%)".into(),
        }),
        Err(e) => Err(SimError::Parse {
            what,
            value: s.to_string(),
            reason: format!("{e}; write 10% or 0.1"),
        }),
    }
}

/// Agents lost and back during a run: every `every`, `fraction` of the
/// fleet (at least one agent when the fraction is above zero) stops — its
/// listener closes, its heartbeats stop — and comes back `down_for` later
/// with its sandboxes, as a restarted agent finds its containers again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChurnSpec {
    pub fraction: f64,
    pub every: Duration,
    pub down_for: Duration,
}

/// splitmix64 over an atomic counter: shared by every task of a fleet
/// without a lock, reproducible from its seed.
#[derive(Debug)]
pub struct Rng(AtomicU64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(AtomicU64::new(seed))
    }

    pub fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_forms_parse_and_sample_within_bounds() {
        let rng = Rng::new(7);
        assert_eq!("0".parse::<Latency>().unwrap(), Latency::None);
        assert_eq!(
            "5ms".parse::<Latency>().unwrap(),
            Latency::Fixed(Duration::from_millis(5))
        );
        let u: Latency = "uniform:1ms-3ms".parse().unwrap();
        for _ in 0..1000 {
            let d = u.sample(&rng);
            assert!(d >= Duration::from_millis(1) && d <= Duration::from_millis(3));
        }
        let e: Latency = "exp:1ms".parse().unwrap();
        assert!((0..1000).all(|_| e.sample(&rng) <= Duration::from_millis(20)));
        let err = "uniform:3ms-1ms".parse::<Latency>().unwrap_err();
        assert!(err.to_string().contains("latency"), "{err}");
        assert!("soon".parse::<Latency>().is_err());
    }

    #[test]
    fn fractions_take_percent_or_ratio_and_refuse_out_of_range() {
        assert_eq!(parse_fraction("churn", "10%").unwrap(), 0.1);
        assert_eq!(parse_fraction("churn", "0.25").unwrap(), 0.25);
        let err = parse_fraction("churn", "150%").unwrap_err();
        assert!(err.to_string().contains("churn"), "{err}");
        assert!(parse_fraction("failure-rate", "x").is_err());
    }

    #[test]
    fn chance_follows_its_probability() {
        let rng = Rng::new(1);
        let hits = (0..10_000).filter(|_| rng.chance(0.1)).count();
        assert!((800..1200).contains(&hits), "{hits}");
        assert!(!(0..1000).any(|_| rng.chance(0.0)));
    }
}
