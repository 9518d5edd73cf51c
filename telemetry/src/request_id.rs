//! The id of the request a task serves, from the edge (lifecycle REST call,
//! or the first gRPC hop) to the last agent call it causes.
//!
//! It lives in a tokio task-local: [`scope`] sets it around a request's
//! future, [`current`] reads it anywhere below, and [`inject`] (called by
//! every sandbolt gRPC client's interceptor) puts it on outgoing calls.

use std::future::Future;

use tonic::metadata::{MetadataMap, MetadataValue};

/// The HTTP header and gRPC metadata key the id travels in.
pub const HEADER: &str = "x-request-id";

/// Longest incoming id kept; longer ones are replaced (they end up in every
/// log line of the request).
pub const MAX_LEN: usize = 128;

tokio::task_local! {
    static REQUEST_ID: String;
}

/// The id of the request this task serves, if it runs inside [`scope`].
pub fn current() -> Option<String> {
    REQUEST_ID.try_with(Clone::clone).ok()
}

/// Runs `f` with `id` as the [`current`] request id.
pub async fn scope<F: Future>(id: String, f: F) -> F::Output {
    REQUEST_ID.scope(id, f).await
}

/// The incoming id when it is 1..=[`MAX_LEN`] printable ASCII characters
/// (so it is safe in a header and a log line), else a new uuid v4 (simple).
pub fn accept_or_new(incoming: Option<&str>) -> String {
    match incoming {
        Some(id) if is_acceptable(id) => id.to_owned(),
        _ => new_id(),
    }
}

/// A fresh id: uuid v4 in its 32-hex-digit simple form.
pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn is_acceptable(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// Adds `x-request-id` (the [`current`] id; an id already on the call is
/// kept) and, when the current span has an OpenTelemetry context, the W3C
/// `traceparent` of that span.
pub fn inject(md: &mut MetadataMap) {
    if !md.contains_key(HEADER)
        && let Some(id) = current()
        && let Ok(value) = MetadataValue::try_from(id.as_str())
    {
        md.insert(HEADER, value);
    }
    crate::propagation::inject_current_span(md.as_mut());
}

/// The id of a request arriving with `headers` (accepted or new), written
/// back into them so a handler reading the header sees the id in force.
pub(crate) fn accept_in(headers: &mut http::HeaderMap) -> String {
    let incoming = headers.get(HEADER).and_then(|v| v.to_str().ok());
    let id = accept_or_new(incoming);
    set_header(headers, &id);
    id
}

/// Sets `x-request-id: id` (ids from [`accept_or_new`] are always valid).
pub(crate) fn set_header(headers: &mut http::HeaderMap, id: &str) {
    if let Ok(value) = http::HeaderValue::from_str(id) {
        headers.insert(HEADER, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_or_new_keeps_only_printable_ascii_up_to_the_limit() {
        assert_eq!(accept_or_new(Some("abc-123_X.y")), "abc-123_X.y");
        let longest = "a".repeat(MAX_LEN);
        assert_eq!(accept_or_new(Some(&longest)), longest);
        for bad in [
            None,
            Some(""),
            Some("has space"),
            Some("tab\there"),
            Some("é"),
            Some(&*"a".repeat(MAX_LEN + 1)),
        ] {
            let id = accept_or_new(bad);
            assert_eq!(id.len(), 32, "{bad:?} -> {id}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
            assert_ne!(Some(id.as_str()), bad);
        }
    }

    #[tokio::test]
    async fn scope_sets_current_and_inject_copies_it() {
        assert_eq!(current(), None);
        let mut md = MetadataMap::new();
        inject(&mut md);
        assert!(md.get(HEADER).is_none());
        scope("rid-1".into(), async {
            assert_eq!(current().as_deref(), Some("rid-1"));
            let mut md = MetadataMap::new();
            inject(&mut md);
            assert_eq!(md.get(HEADER).unwrap(), "rid-1");
            let mut md = MetadataMap::new();
            md.insert(HEADER, "kept".parse().unwrap());
            inject(&mut md);
            assert_eq!(md.get(HEADER).unwrap(), "kept");
        })
        .await;
        assert_eq!(current(), None);
    }
}
