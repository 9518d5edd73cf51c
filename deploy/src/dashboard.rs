//! The Grafana dashboard the chart ships (`helm/sandbolt/dashboards/sandbolt.json`,
//! a ConfigMap with `metrics.dashboard.enabled`): where it is, what Grafana
//! needs to load it, and which sandbolt metrics its queries read. The chart
//! test checks its shape; the end-to-end scrape test checks every metric it
//! reads against what the components really serve, so a renamed metric
//! cannot leave a panel silently empty.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

/// What every metric of the project is called first.
pub const METRIC_PREFIX: &str = "sandbolt_";

/// Grafana refuses a dashboard uid longer than this.
const MAX_UID_LEN: usize = 40;

/// Grafana's grid is 24 columns wide.
const GRID_COLUMNS: u64 = 24;

/// Where the chart keeps the dashboard.
pub fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("helm/sandbolt/dashboards/sandbolt.json")
}

/// The dashboard, parsed.
pub fn load() -> Result<Value, String> {
    let path = path();
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is no JSON: {e}", path.display()))
}

/// Every panel, those nested in collapsed rows included.
pub fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// The PromQL of every panel's targets.
pub fn queries(dashboard: &Value) -> Vec<&str> {
    panels(dashboard)
        .into_iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect()
}

/// The metric names (as Prometheus stores the samples: counters with
/// `_total`, histograms' `_bucket`, `_sum`, `_count`) the queries read.
pub fn metric_names(dashboard: &Value) -> BTreeSet<String> {
    queries(dashboard)
        .into_iter()
        .flat_map(metric_names_in)
        .collect()
}

/// The `sandbolt_…` identifiers of one PromQL expression.
pub fn metric_names_in(expr: &str) -> Vec<String> {
    let is_name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    for (at, _) in expr.match_indices(METRIC_PREFIX) {
        if expr[..at].chars().next_back().is_some_and(is_name_char) {
            continue;
        }
        let name: String = expr[at..]
            .chars()
            .take_while(|&c| is_name_char(c))
            .collect();
        if name.len() > METRIC_PREFIX.len() {
            out.push(name);
        }
    }
    out
}

/// What keeps Grafana from loading the dashboard or a panel from showing
/// anything; empty when there is nothing.
pub fn problems(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match dashboard["uid"].as_str() {
        Some(uid) if !uid.is_empty() && uid.len() <= MAX_UID_LEN => {}
        other => out.push(format!(
            "uid must be 1..={MAX_UID_LEN} characters: {other:?}"
        )),
    }
    if dashboard["title"].as_str().is_none_or(str::is_empty) {
        out.push("no title".into());
    }
    if !dashboard["schemaVersion"].is_u64() {
        out.push("no schemaVersion".into());
    }
    if !has_prometheus_datasource_variable(dashboard) {
        out.push("no `datasource` variable of type datasource (prometheus)".into());
    }
    let all = panels(dashboard);
    if all.iter().all(|p| p["type"] == "row") {
        out.push("no panels".into());
    }
    let mut ids = BTreeSet::new();
    for p in all {
        let title = p["title"].as_str().unwrap_or_default();
        if !p["id"].as_u64().is_some_and(|id| ids.insert(id)) {
            out.push(format!(
                "panel {title:?}: missing or repeated id {}",
                p["id"]
            ));
        }
        out.extend(grid_problem(p).map(|e| format!("panel {title:?}: {e}")));
        if p["type"] != "row" {
            out.extend(
                target_problems(p)
                    .into_iter()
                    .map(|e| format!("panel {title:?}: {e}")),
            );
        }
    }
    out
}

fn has_prometheus_datasource_variable(dashboard: &Value) -> bool {
    dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| {
            v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"
        })
}

fn grid_problem(panel: &Value) -> Option<String> {
    let g = &panel["gridPos"];
    let field = |k: &str| g[k].as_u64();
    match (field("x"), field("y"), field("w"), field("h")) {
        (Some(x), Some(_), Some(w), Some(h)) if w > 0 && h > 0 && x + w <= GRID_COLUMNS => None,
        _ => Some(format!(
            "gridPos {g} is not within the {GRID_COLUMNS}-column grid"
        )),
    }
}

fn target_problems(panel: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if panel["type"].as_str().is_none_or(str::is_empty) {
        out.push("no type".into());
    }
    let targets = panel["targets"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if targets.is_empty() {
        out.push("no targets".into());
    }
    let mut ref_ids = BTreeSet::new();
    for t in targets {
        if !t["refId"].as_str().is_some_and(|r| ref_ids.insert(r)) {
            out.push(format!("target without a unique refId: {t}"));
        }
        match t["expr"].as_str() {
            Some(expr) if !metric_names_in(expr).is_empty() => {}
            _ => out.push(format!("target reads no {METRIC_PREFIX} metric: {t}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_whole_identifiers_outside_label_values() {
        let expr = r#"sum by (le) (rate(sandbolt_a_bucket{job=~"x"}[5m])) / x_sandbolt_b + sandbolt_c:rate1m"#;
        assert_eq!(
            metric_names_in(expr),
            ["sandbolt_a_bucket", "sandbolt_c:rate1m"]
        );
        assert!(metric_names_in(r#"label_values({__name__=~"sandbolt_.+"}, job)"#).is_empty());
    }

    #[test]
    fn a_broken_dashboard_is_told_apart() {
        let broken = serde_json::json!({
            "uid": "",
            "panels": [
                {"id": 1, "type": "timeseries", "title": "t",
                 "gridPos": {"x": 20, "y": 0, "w": 8, "h": 8},
                 "targets": [{"refId": "A", "expr": "up"}]},
                {"id": 1, "type": "stat", "title": "s",
                 "gridPos": {"x": 0, "y": 8, "w": 8, "h": 8}}
            ]
        });
        let p = problems(&broken).join("\n");
        for want in [
            "uid must be",
            "no title",
            "no schemaVersion",
            "no `datasource` variable",
            "not within the 24-column grid",
            "reads no sandbolt_ metric",
            "repeated id 1",
            "no targets",
        ] {
            assert!(p.contains(want), "{want:?} not in:\n{p}");
        }
    }
}
