//! Percentiles from raw samples (hdrhistogram, microsecond resolution).

use hdrhistogram::Histogram;

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Summary {
    pub count: u64,
    pub p50_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

/// Summarizes samples given in microseconds; `None` when there are none.
pub fn summarize(samples_us: impl IntoIterator<Item = u64>) -> Option<Summary> {
    // 1 µs to 10 min, 3 significant digits.
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("static bounds");
    for s in samples_us {
        h.saturating_record(s.max(1));
    }
    if h.is_empty() {
        return None;
    }
    Some(Summary {
        count: h.len(),
        p50_us: h.value_at_quantile(0.50),
        p95_us: h.value_at_quantile(0.95),
        p99_us: h.value_at_quantile(0.99),
        max_us: h.max(),
        mean_us: h.mean(),
    })
}

pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let s = summarize((1..=1000).map(|i| i * 1000)).unwrap();
        assert_eq!(s.count, 1000);
        // 3 significant digits: within 0.1 %.
        assert!((s.p50_us as f64 - 500_000.0).abs() <= 500.0, "{s:?}");
        assert!((s.p99_us as f64 - 990_000.0).abs() <= 1000.0, "{s:?}");
        assert!((s.max_us as f64 - 1_000_000.0).abs() <= 1000.0, "{s:?}");
        assert!(summarize([]).is_none());
    }
}
