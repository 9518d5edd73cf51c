//! Just enough of the Prometheus text format to read the controller's
//! histograms and gauges between the harness's steps.

/// One histogram's cumulative buckets (upper bound in seconds, count),
/// summed over every series that matched.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(pub Vec<(f64, f64)>);

/// The labels of a sample line, e.g. `{a="b",c="d"}` → [(a, b), (c, d)].
fn labels(s: &str) -> Vec<(&str, &str)> {
    s.split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.trim(), v.trim().trim_matches('"')))
        })
        .collect()
}

/// A sample line's name, labels and value.
type Sample<'a> = (&'a str, Vec<(&'a str, &'a str)>, f64);

/// Splits `name{labels} value` into its parts.
fn sample(line: &str) -> Option<Sample<'_>> {
    if line.starts_with('#') {
        return None;
    }
    let (head, value) = line.rsplit_once(' ')?;
    let value = value.parse().ok()?;
    match head.split_once('{') {
        Some((name, rest)) => Some((name, labels(rest.trim_end_matches('}')), value)),
        None => Some((head, Vec::new(), value)),
    }
}

fn matches(have: &[(&str, &str)], want: &[(&str, &str)]) -> bool {
    want.iter().all(|w| have.contains(w))
}

/// The histogram `name` (without `_bucket`) over series matching `want`.
pub fn histogram(text: &str, name: &str, want: &[(&str, &str)]) -> Buckets {
    let bucket = format!("{name}_bucket");
    let mut by_le: Vec<(f64, f64)> = Vec::new();
    for (n, ls, v) in text.lines().filter_map(sample) {
        if n != bucket || !matches(&ls, want) {
            continue;
        }
        let Some(le) = ls.iter().find(|(k, _)| *k == "le").map(|(_, v)| *v) else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse() {
                Ok(x) => x,
                Err(_) => continue,
            }
        };
        match by_le.iter_mut().find(|(l, _)| *l == le) {
            Some((_, c)) => *c += v,
            None => by_le.push((le, v)),
        }
    }
    by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
    Buckets(by_le)
}

/// Sum of the gauge or counter `name` over series matching `want`.
pub fn value(text: &str, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for (n, ls, v) in text.lines().filter_map(sample) {
        if n == name && matches(&ls, want) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

impl Buckets {
    /// What was observed between `earlier` and `self`.
    pub fn since(&self, earlier: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|(le, c)| {
                    let before = earlier
                        .0
                        .iter()
                        .find(|(l, _)| l == le)
                        .map_or(0.0, |(_, c)| *c);
                    (*le, c - before)
                })
                .collect(),
        )
    }

    pub fn count(&self) -> f64 {
        self.0.last().map_or(0.0, |(_, c)| *c)
    }

    /// The upper bound of the bucket holding quantile `q` (seconds): the
    /// true value is at most this. None without observations.
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        self.0
            .iter()
            .find(|(_, c)| *c >= q * total)
            .map(|(le, _)| *le)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE h histogram\n\
        h_bucket{stage=\"place\",le=\"0.0005\"} 90\n\
        h_bucket{stage=\"place\",le=\"0.001\"} 99\n\
        h_bucket{stage=\"place\",le=\"+Inf\"} 100\n\
        h_bucket{stage=\"record\",le=\"0.0005\"} 1\n\
        h_bucket{stage=\"record\",le=\"+Inf\"} 1\n\
        g{phase=\"running\"} 7\n\
        g{phase=\"failed\"} 2\n";

    #[test]
    fn reads_quantiles_and_gauges() {
        let h = histogram(TEXT, "h", &[("stage", "place")]);
        assert_eq!(h.count(), 100.0);
        assert_eq!(h.quantile_bound(0.5), Some(0.0005));
        assert_eq!(h.quantile_bound(0.99), Some(0.001));
        assert_eq!(value(TEXT, "g", &[("phase", "running")]), Some(7.0));
        assert_eq!(value(TEXT, "g", &[]), Some(9.0));
        let later = histogram(&TEXT.replace("} 100", "} 110"), "h", &[("stage", "place")]);
        assert_eq!(later.since(&h).count(), 10.0);
    }
}
