//! Request extractors whose rejections are contract error bodies (`{code, message}`),
//! so a handler states what it reads and never parses bodies or queries by hand.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON request body. Empty or malformed is a 400 `INVALID_REQUEST_BODY`.
pub struct JsonBody<T>(pub T);

/// A JSON request body that may be left out (empty or only whitespace): then
/// `T::default()`.
pub struct JsonOrDefault<T>(pub T);

/// The raw body; a framework rejection (e.g. over the body limit) keeps its status
/// and becomes a contract error body.
async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state)
        .await
        .map_err(|rejection| ApiError::from_framework(rejection.status(), &rejection.body_text()))
}

fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "error parsing request, MAYBE invalid body format: {e}"
        ))
    })
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let body = body_bytes(req, state).await?;
        if body.is_empty() {
            return Err(ApiError::bad_request("request body is required"));
        }
        parse_json(&body).map(JsonBody)
    }
}

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for JsonOrDefault<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let body = body_bytes(req, state).await?;
        if body.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(JsonOrDefault(T::default()));
        }
        parse_json(&body).map(JsonOrDefault)
    }
}

/// Decoded `application/x-www-form-urlencoded` query pairs, in order (repeated keys
/// kept). As an extractor, invalid percent-encoding or UTF-8 is a 400.
pub struct Query(pub Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for Query {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Query::parse(parts.uri.query())
    }
}

impl Query {
    /// Parses the query part of a URI.
    pub fn parse(query: Option<&str>) -> Result<Self, ApiError> {
        let mut pairs = Vec::new();
        let Some(q) = query else {
            return Ok(Self(pairs));
        };
        for part in q.split('&') {
            if part.is_empty() {
                continue;
            }
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            pairs.push((decode_component(k)?, decode_component(v)?));
        }
        Ok(Self(pairs))
    }
    /// First value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
    /// First value of `key`, which must be there.
    pub fn required(&self, key: &str) -> Result<&str, ApiError> {
        self.get(key).ok_or_else(|| ApiError::missing_query(key))
    }
    /// All values of `key`.
    pub fn all(&self, key: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }
    /// Optional integer parameter; present but unparsable is a 400.
    pub fn int<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>, ApiError> {
        match self.get(key) {
            None | Some("") => Ok(None),
            Some(v) => v.trim().parse::<T>().map(Some).map_err(|_| {
                ApiError::bad_request(format!("invalid query parameter '{key}': {v:?}"))
            }),
        }
    }
    pub fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1" | "yes"))
    }
}

fn decode_component(s: &str) -> Result<String, ApiError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b'%' => {
                out.push(percent_escape(bytes.get(i + 1..i + 3))?);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| ApiError::bad_request("query is not valid UTF-8"))
}

/// The byte of the two hex digits after a `%`.
fn percent_escape(digits: Option<&[u8]>) -> Result<u8, ApiError> {
    let hex = |b: &u8| (*b as char).to_digit(16);
    match digits {
        Some([h, l]) => match (hex(h), hex(l)) {
            (Some(h), Some(l)) => Ok((h * 16 + l) as u8),
            _ => Err(ApiError::bad_request("invalid percent-encoding in query")),
        },
        _ => Err(ApiError::bad_request("invalid percent-encoding in query")),
    }
}

/// What a handler answers: a response, or a contract error.
pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_parsing() {
        let q = Query::parse(Some("path=%2Ftmp%2Fa+b&path=/x&depth=2&&flag")).unwrap();
        assert_eq!(q.all("path"), vec!["/tmp/a b", "/x"]);
        assert_eq!(q.int::<i32>("depth").unwrap(), Some(2));
        assert_eq!(q.get("flag"), Some(""));
        assert!(Query::parse(Some("a=%zz")).is_err());
        assert!(Query::parse(Some("a=%ff")).is_err());
        assert!(Query::parse(Some("a=%4")).is_err());
        assert!(q.int::<i32>("path").is_err());
    }
}
