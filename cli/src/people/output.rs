//! What the people commands print: aligned tables and `key: value` lists
//! for a person, the API's own JSON for a script, and a spinner on stderr
//! while something slow happens (only when stderr is a terminal).

use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

/// Columns padded to their widest cell, three spaces apart.
pub(crate) struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Self {
        Self {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        let mut out = String::new();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
                if i > 0 {
                    line.push_str("   ");
                }
                line.push_str(cell);
                if i + 1 < row.len() {
                    line.extend(std::iter::repeat_n(' ', w - cell.chars().count()));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    pub fn print(&self) {
        print!("{}", self.render());
    }
}

/// `key: value` lines, the keys aligned; empty values (and `-`, what
/// [`field`] says for none) are left out.
pub(crate) fn print_fields(fields: &[(&str, String)]) {
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in fields.iter().filter(|(_, v)| !v.is_empty() && v != "-") {
        println!("{:width$}  {v}", format!("{k}:"), width = width + 1);
    }
}

/// `v` as indented JSON on stdout.
pub(crate) fn print_json(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("a JSON value serializes")
    );
}

/// What a command that changed `name` prints: the name (one a line, for
/// scripts to read back), or `answer` with --json.
pub(crate) fn print_done(json: bool, name: &str, answer: &Value) {
    if json {
        print_json(answer);
    } else {
        println!("{name}");
    }
}

/// The string at JSON pointer `ptr` of `v`, or `-`; numbers and booleans
/// as written.
pub(crate) fn field(v: &Value, ptr: &str) -> String {
    match v.pointer(ptr) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "-".to_string(),
        Some(other) => other.to_string(),
    }
}

/// `k=v,k2=v2` of the JSON object at `ptr`, or `-`.
pub(crate) fn pairs(v: &Value, ptr: &str) -> String {
    match v.pointer(ptr).and_then(Value::as_object) {
        Some(m) if !m.is_empty() => m
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or(&v.to_string())))
            .collect::<Vec<_>>()
            .join(","),
        _ => "-".to_string(),
    }
}

/// How long ago the RFC 3339 time at `ptr` was (`12s`, `3m`, `2h`, `4d`),
/// or `-`.
pub(crate) fn age(v: &Value, ptr: &str) -> String {
    match rfc3339_at(v, ptr) {
        Some(t) => short(SystemTime::now().duration_since(t).unwrap_or_default()),
        None => "-".to_string(),
    }
}

/// How long until the RFC 3339 time at `ptr` (`in 9m`, `due`), or `never`
/// when there is none (a sandbox without automatic expiry).
pub(crate) fn until(v: &Value, ptr: &str) -> String {
    match rfc3339_at(v, ptr) {
        Some(t) => match t.duration_since(SystemTime::now()) {
            Ok(d) => format!("in {}", short(d)),
            Err(_) => "due".to_string(),
        },
        None => "never".to_string(),
    }
}

fn rfc3339_at(v: &Value, ptr: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(v.pointer(ptr)?.as_str()?.trim_end_matches('Z')).ok()
}

fn short(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// A spinner saying `message` on stderr, when stderr is a terminal (a
/// script's stderr gets no animation); `finish_and_clear` it when done.
pub(crate) fn spinner(message: impl Into<String>) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("static template"),
    );
    bar.set_message(message.into());
    bar.enable_steady_tick(Duration::from_millis(120));
    Some(bar)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns_and_keep_no_trailing_spaces() {
        let mut t = Table::new(&["ID", "STATE", "IMAGE"]);
        t.row(vec!["a".into(), "Running".into(), "busybox".into()]);
        t.row(vec!["long-id".into(), "-".into(), "x".into()]);
        assert_eq!(
            t.render(),
            "ID        STATE     IMAGE\na         Running   busybox\nlong-id   -         x\n"
        );
    }

    #[test]
    fn times_read_as_ages_and_deadlines() {
        let v = serde_json::json!({"t": "2000-01-01T00:00:00.000000Z", "none": null});
        assert!(age(&v, "/t").ends_with('d'), "{}", age(&v, "/t"));
        assert_eq!(until(&v, "/t"), "due");
        assert_eq!(until(&v, "/none"), "never");
        assert_eq!(age(&v, "/missing"), "-");
    }
}
