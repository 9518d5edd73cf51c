//! Name and label syntax checks (apimachinery's `validation` package), so
//! that objects the real server would refuse are refused here too.

fn is_alnum_lower(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// RFC 1123 label: at most 63 of `[a-z0-9-]`, alphanumeric at both ends.
pub(crate) fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| is_alnum_lower(c) || c == '-')
        && s.starts_with(is_alnum_lower)
        && s.ends_with(is_alnum_lower)
}

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters. This
/// is what most kinds, custom resources included, require of names.
pub(crate) fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// The "name" part of a qualified name / label value: at most 63 of
/// `[A-Za-z0-9_.-]`, alphanumeric at both ends.
fn is_qualified_part(s: &str) -> bool {
    let edge = |c: char| c.is_ascii_alphanumeric();
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && s.starts_with(edge)
        && s.ends_with(edge)
}

/// Label (and annotation) keys: `[prefix/]name`, prefix a DNS subdomain.
pub(crate) fn is_label_key(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => is_dns1123_subdomain(prefix) && is_qualified_part(name),
        None => is_qualified_part(s),
    }
}

/// Label values may be empty; otherwise like a qualified name part.
pub(crate) fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_qualified_part(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_dns1123_subdomain("a"));
        assert!(is_dns1123_subdomain("sandbox-1.pool"));
        assert!(!is_dns1123_subdomain("Upper"));
        assert!(!is_dns1123_subdomain("-lead"));
        assert!(!is_dns1123_subdomain("trail-"));
        assert!(!is_dns1123_subdomain("a..b"));
        assert!(!is_dns1123_subdomain("under_score"));
        assert!(!is_dns1123_subdomain(&"a".repeat(254)));
    }

    #[test]
    fn labels() {
        assert!(is_label_key("app"));
        assert!(is_label_key("sandbolt.io/pool"));
        assert!(!is_label_key("Bad Prefix/x"));
        assert!(!is_label_key("a/b/c"));
        assert!(is_label_value(""));
        assert!(is_label_value("Web_1.x"));
        assert!(!is_label_value("-x"));
        assert!(!is_label_value(&"v".repeat(64)));
    }
}
