//! `labelSelector` and `fieldSelector` parsing and matching, following the
//! grammar of apimachinery's `labels.Parse` and `fields.ParseSelector`.

use serde_json::Value;

use crate::kinds::Kind;
use crate::status::ApiError;
use crate::validation::{is_label_key, is_label_value};

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Eq(String),
    NotEq(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
    Gt(i64),
    Lt(i64),
}

/// A parsed label selector: requirements that must all hold (comma = AND).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LabelSelector {
    reqs: Vec<(String, Op)>,
}

fn parse_error(part: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!(
        "unable to parse requirement: {why}: found '{part}'"
    ))
}

/// Splits on commas that are not inside `( )`, since set values use commas.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn checked_key<'a>(key: &'a str, part: &str) -> Result<&'a str, ApiError> {
    let key = key.trim();
    if is_label_key(key) {
        Ok(key)
    } else {
        Err(parse_error(part, "invalid label key"))
    }
}

fn checked_value(value: &str, part: &str) -> Result<String, ApiError> {
    let value = value.trim();
    if is_label_value(value) {
        Ok(value.to_string())
    } else {
        Err(parse_error(part, "invalid label value"))
    }
}

fn parse_requirement(part: &str) -> Result<(String, Op), ApiError> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok((checked_key(key, part)?.to_string(), Op::DoesNotExist));
    }
    if let Some(open) = part.find('(') {
        let Some(inner) = part[open + 1..].strip_suffix(')') else {
            return Err(parse_error(part, "expected ')'"));
        };
        let head: Vec<&str> = part[..open].split_whitespace().collect();
        let [key, op] = head.as_slice() else {
            return Err(parse_error(
                part,
                "expected 'key in (..)' or 'key notin (..)'",
            ));
        };
        let key = checked_key(key, part)?.to_string();
        let values = inner
            .split(',')
            .map(|v| checked_value(v, part))
            .collect::<Result<Vec<_>, _>>()?;
        return match *op {
            "in" => Ok((key, Op::In(values))),
            "notin" => Ok((key, Op::NotIn(values))),
            _ => Err(parse_error(part, "unknown set operator")),
        };
    }
    // Longest operators first: "!=" and "==" contain "=".
    for (token, build) in [
        ("!=", (|v| Op::NotEq(v)) as fn(String) -> Op),
        ("==", Op::Eq),
        ("=", Op::Eq),
    ] {
        if let Some((key, value)) = part.split_once(token) {
            let key = checked_key(key, part)?.to_string();
            return Ok((key, build(checked_value(value, part)?)));
        }
    }
    for (token, gt) in [(">", true), ("<", false)] {
        if let Some((key, value)) = part.split_once(token) {
            let key = checked_key(key, part)?.to_string();
            let n: i64 = value.trim().parse().map_err(|_| {
                parse_error(
                    part,
                    "for 'Gt', 'Lt' operators, the value must be an integer",
                )
            })?;
            return Ok((key, if gt { Op::Gt(n) } else { Op::Lt(n) }));
        }
    }
    Ok((checked_key(part, part)?.to_string(), Op::Exists))
}

impl LabelSelector {
    pub fn parse(selector: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if selector.trim().is_empty() {
            return Ok(LabelSelector { reqs });
        }
        for part in split_top_level(selector) {
            let part = part.trim();
            if part.is_empty() {
                return Err(parse_error(part, "empty requirement"));
            }
            reqs.push(parse_requirement(part)?);
        }
        Ok(LabelSelector { reqs })
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        let get = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.reqs.iter().all(|(key, op)| {
            let value = get(key);
            match op {
                Op::Eq(v) => value == Some(v.as_str()),
                // As in apimachinery, `!=` and `notin` also match objects
                // that lack the label altogether.
                Op::NotEq(v) => value != Some(v.as_str()),
                Op::In(vs) => value.is_some_and(|x| vs.iter().any(|v| v == x)),
                Op::NotIn(vs) => value.is_none_or(|x| vs.iter().all(|v| v != x)),
                Op::Exists => value.is_some(),
                Op::DoesNotExist => value.is_none(),
                Op::Gt(n) => value
                    .and_then(|x| x.parse::<i64>().ok())
                    .is_some_and(|x| x > *n),
                Op::Lt(n) => value
                    .and_then(|x| x.parse::<i64>().ok())
                    .is_some_and(|x| x < *n),
            }
        })
    }
}

/// A parsed field selector over the field labels a kind supports.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FieldSelector {
    reqs: Vec<(String, bool, String)>,
}

impl FieldSelector {
    pub fn parse(selector: &str, kind: &Kind) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if selector.trim().is_empty() {
            return Ok(FieldSelector { reqs });
        }
        for part in selector.split(',') {
            let (field, equal, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{selector}'; can't understand '{part}'"
                )));
            };
            let field = field.trim();
            if !matches!(field, "metadata.name" | "metadata.namespace")
                && !kind.extra_fields.contains(&field)
            {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {field}"
                )));
            }
            reqs.push((field.to_string(), equal, value.trim().to_string()));
        }
        Ok(FieldSelector { reqs })
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.reqs.iter().all(|(field, equal, value)| {
            let pointer = format!("/{}", field.replace('.', "/"));
            let actual = match object.pointer(&pointer) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(Value::Number(n)) => n.to_string(),
                _ => String::new(),
            };
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn label_operators() {
        let o = obj(json!({"app": "web", "tier": "front", "n": "5"}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m("app=web"));
        assert!(m("app==web,tier=front"));
        assert!(!m("app=web,tier=back"));
        assert!(m("app!=db"));
        assert!(m("missing!=x"));
        assert!(m("app"));
        assert!(!m("!app"));
        assert!(m("!missing"));
        assert!(m("app in (db, web)"));
        assert!(!m("app notin (db,web)"));
        assert!(m("missing notin (db,web)"));
        assert!(!m("missing in (db,web)"));
        assert!(m("n>4,n<6"));
        assert!(m(""));
    }

    #[test]
    fn label_parse_errors() {
        assert_eq!(LabelSelector::parse("app=").unwrap().reqs.len(), 1);
        assert!(LabelSelector::parse("a b=c").is_err());
        assert!(LabelSelector::parse("app in (a").is_err());
        assert!(LabelSelector::parse("app,,x").is_err());
        assert!(LabelSelector::parse("x>y").is_err());
    }

    #[test]
    fn fields() {
        let kinds = crate::kinds::builtin();
        let pod = &kinds[0];
        let lease = &kinds[1];
        let o = json!({"metadata": {"name": "a", "namespace": "ns"}, "spec": {"nodeName": "n1"}});
        let m = |s: &str| FieldSelector::parse(s, pod).unwrap().matches(&o);
        assert!(m("metadata.name=a"));
        assert!(m("metadata.namespace==ns,spec.nodeName=n1"));
        assert!(!m("spec.nodeName!=n1"));
        assert!(m("status.phase="));
        let err = FieldSelector::parse("spec.nodeName=n1", lease).unwrap_err();
        assert_eq!(err.code, 400);
        assert!(FieldSelector::parse("garbage", pod).is_err());
    }
}
