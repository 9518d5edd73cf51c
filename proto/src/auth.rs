//! Bearer tokens on sandbolt's gRPC ports, both ends, in one place.
//!
//! Every sandbolt gRPC port (the controller's FastPath, native and registry
//! services; the agent's AgentService) takes `authorization: Bearer <token>`.
//! The server side compares SHA-256 digests with [`subtle`], so neither the
//! length nor a matching prefix of the token shows in the reply time.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Status};

/// The metadata key (HTTP/2 header) a bearer token travels in.
pub const AUTHORIZATION: &str = "authorization";

/// SHA-256 of a token: the form in which a server keeps the token it expects.
pub fn token_digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

/// Does `presented` hash to `expected` (a [`token_digest`])? Compared in
/// constant time, so neither a matching prefix nor the length shows.
pub fn digest_matches(presented: &[u8], expected: &[u8; 32]) -> bool {
    token_digest(presented).ct_eq(expected).into()
}

/// `a == b` without an early exit: digests are compared, so the time taken
/// does not depend on where the inputs differ nor on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    digest_matches(a, &token_digest(b))
}

/// The token is not valid header text (control characters, non-ASCII).
#[derive(Debug, thiserror::Error)]
#[error("token is not valid header text")]
pub struct InvalidToken;

/// Client side: adds `authorization: Bearer <token>` to every call. An empty
/// token adds nothing (a server that requires none).
#[derive(Clone, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl BearerToken {
    pub fn new(token: &str) -> Result<Self, InvalidToken> {
        if token.is_empty() {
            return Ok(Self(None));
        }
        format!("Bearer {token}")
            .parse()
            .map(|v| Self(Some(v)))
            .map_err(|_| InvalidToken)
    }

    /// No token: calls go out without `authorization`.
    pub fn none() -> Self {
        Self(None)
    }

    /// Sets the header on one request (for callers that build requests by
    /// hand rather than through an intercepted client).
    pub fn apply<T>(&self, req: &mut Request<T>) {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert(AUTHORIZATION, v.clone());
        }
    }
}

/// Every sandbolt gRPC client goes through this interceptor, so it is also
/// where a call picks up the request id (and W3C `traceparent`) of the task
/// making it: lifecycle -> controller -> agent calls carry one id.
impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        self.apply(&mut req);
        sandbolt_telemetry::request_id::inject(req.metadata_mut());
        Ok(req)
    }
}

/// Server side: the call must carry `authorization: Bearer <token>`. Built
/// with no token, it lets every call through (a port configured open).
#[derive(Clone)]
pub struct RequireBearer {
    expected: Option<[u8; 32]>,
    /// What is being protected, for the error message ("FastPath", "agent").
    what: &'static str,
}

impl RequireBearer {
    pub fn new(token: Option<&str>, what: &'static str) -> Self {
        Self {
            expected: token
                .filter(|t| !t.is_empty())
                .map(|t| token_digest(t.as_bytes())),
            what,
        }
    }

    /// Is this request allowed? Generic over the body, so a service can call
    /// it from inside a handler as well as from an interceptor.
    pub fn check<T>(&self, req: Request<T>) -> Result<Request<T>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(req);
        };
        let presented = req
            .metadata()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let Some(presented) = presented else {
            return Err(Status::unauthenticated(format!(
                "{}: authorization: Bearer <token> required",
                self.what
            )));
        };
        if digest_matches(presented.as_bytes(), expected) {
            Ok(req)
        } else {
            Err(Status::unauthenticated(format!(
                "{}: wrong token",
                self.what
            )))
        }
    }
}

impl tonic::service::Interceptor for RequireBearer {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        self.check(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    fn with(header: Option<&str>) -> Request<()> {
        let mut req = Request::new(());
        if let Some(h) = header {
            req.metadata_mut().insert(AUTHORIZATION, h.parse().unwrap());
        }
        req
    }

    #[test]
    fn require_bearer_accepts_only_the_token() {
        let auth = RequireBearer::new(Some("s3cret"), "test");
        assert!(auth.check(with(Some("Bearer s3cret"))).is_ok());
        for bad in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("Bearer "),
            Some("bearer s3cret"),
            Some("s3cret"),
        ] {
            let err = auth.check(with(bad)).unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unauthenticated, "{bad:?}");
            assert!(err.message().starts_with("test: "), "{}", err.message());
        }
    }

    #[test]
    fn require_bearer_without_a_token_is_open() {
        for token in [None, Some("")] {
            let auth = RequireBearer::new(token, "open");
            assert!(auth.check(with(None)).is_ok());
        }
    }

    #[test]
    fn bearer_token_round_trips_through_require_bearer() {
        let mut client = BearerToken::new("tok-1").unwrap();
        let req = client.call(Request::new(())).unwrap();
        assert!(RequireBearer::new(Some("tok-1"), "t").check(req).is_ok());
        let req = BearerToken::none().call(Request::new(())).unwrap();
        assert!(req.metadata().get(AUTHORIZATION).is_none());
        let req = BearerToken::new("")
            .unwrap()
            .call(Request::new(()))
            .unwrap();
        assert!(req.metadata().get(AUTHORIZATION).is_none());
        assert!(BearerToken::new("bad\ntoken").is_err());
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(constant_time_eq(b"", b""));
    }
}
