//! Percentiles from raw samples (hdrhistogram, microsecond resolution).

use hdrhistogram::Histogram;

use crate::Sample;

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Summary {
    pub count: u64,
    pub p50_us: u64,
    pub p90_us: u64,
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
        p90_us: h.value_at_quantile(0.90),
        p95_us: h.value_at_quantile(0.95),
        p99_us: h.value_at_quantile(0.99),
        max_us: h.max(),
        mean_us: h.mean(),
    })
}

/// Median over iterations of `a`'s latency ÷ `b`'s in the same iteration
/// of `scenario`, and the number of such pairs; `None` without pairs.
///
/// Two systems measured back to back in each iteration see nearly the same
/// machine, so the per-iteration ratio cancels most of a busy machine's
/// drift that a ratio of two separately taken percentiles keeps.
pub fn paired_ratio(samples: &[Sample], scenario: &str, a: &str, b: &str) -> Option<(f64, usize)> {
    let of = |system: &str| {
        samples
            .iter()
            .filter(|s| s.scenario == scenario && s.system == system)
            .map(|s| (s.iteration, s.total_us))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let base = of(b);
    let mut ratios: Vec<f64> = of(a)
        .into_iter()
        .filter_map(|(i, x)| Some(x as f64 / *base.get(&i)?.max(&1) as f64))
        .collect();
    if ratios.is_empty() {
        return None;
    }
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let median = if n % 2 == 1 {
        ratios[n / 2]
    } else {
        (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0
    };
    Some((median, n))
}

/// `system` ÷ `baseline` in `scenario`, as the reports give it: p50, p90 and
/// the median of the per-round ratios, each labelled after `label`. Empty
/// when either side has no samples.
pub fn ratio_rows(
    samples: &[Sample],
    scenario: &str,
    system: &str,
    baseline: &str,
    label: &str,
) -> Vec<(String, f64)> {
    let summary = |system: &str| {
        summarize(
            samples
                .iter()
                .filter(|s| s.scenario == scenario && s.system == system)
                .map(|s| s.total_us),
        )
    };
    let (Some(a), Some(b)) = (summary(system), summary(baseline)) else {
        return Vec::new();
    };
    let mut out = vec![
        (label.to_string(), a.p50_us as f64 / b.p50_us.max(1) as f64),
        (
            format!("{label} (p90)"),
            a.p90_us as f64 / b.p90_us.max(1) as f64,
        ),
    ];
    if let Some((median, _)) = paired_ratio(samples, scenario, system, baseline) {
        out.push((format!("{label} (median of per-round ratios)"), median));
    }
    out
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

    fn sample(system: &str, iteration: u32, total_us: u64) -> Sample {
        Sample {
            scenario: "sequential".into(),
            system: system.into(),
            iteration,
            total_us,
            stages: Vec::new(),
        }
    }

    #[test]
    fn paired_ratio_pairs_by_iteration() {
        // Iteration 3 of "a" has no partner and does not count.
        let samples = [
            sample("a", 1, 110),
            sample("b", 1, 100),
            sample("a", 2, 300),
            sample("b", 2, 200),
            sample("b", 4, 100),
            sample("a", 4, 100),
            sample("a", 3, 999),
        ];
        let (median, n) = paired_ratio(&samples, "sequential", "a", "b").unwrap();
        assert_eq!(n, 3);
        assert!((median - 1.1).abs() < 1e-9, "{median}");
        let (median, n) = paired_ratio(&samples[..4], "sequential", "a", "b").unwrap();
        assert_eq!(n, 2);
        assert!((median - 1.3).abs() < 1e-9, "{median}");
        assert!(paired_ratio(&samples, "burst", "a", "b").is_none());
    }
}
