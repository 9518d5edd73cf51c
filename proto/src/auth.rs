//! Bearer tokens on sandbolt's gRPC ports, both ends, in one place.
//!
//! Every sandbolt gRPC port (the controller's FastPath, native and registry
//! services; the agent's AgentService) takes `authorization: Bearer <token>`.
//! The server side compares SHA-256 digests with [`subtle`], so neither the
//! length nor a matching prefix of the token shows in the reply time.
//!
//! Agents hold two tokens: the shared *bootstrap* token, good only for
//! `RegistryService.Enroll` (and the janitors' ownership queries), and their
//! own credential, which the controller mints per agent id and which every
//! heartbeat, reap report and controller -> agent call carries.

use std::sync::{Arc, RwLock};

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

/// The token a request presents (`authorization: Bearer <token>`), if any.
pub fn presented_bearer(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    metadata
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// A token that is known only later and may change: an agent's own
/// credential, which arrives when it enrolls with the controller (or is read
/// back from its state dir). Until it is set, [`RequireBearer::cell`]
/// refuses every call.
#[derive(Clone, Default)]
pub struct TokenCell(Arc<RwLock<Option<[u8; 32]>>>);

impl TokenCell {
    /// Expects `token` from now on (an empty one unsets it).
    pub fn set(&self, token: &str) {
        let digest = (!token.is_empty()).then(|| token_digest(token.as_bytes()));
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = digest;
    }

    pub fn is_set(&self) -> bool {
        self.0.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn get(&self) -> Option<[u8; 32]> {
        *self.0.read().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Clone)]
enum Expected {
    Open,
    Fixed([u8; 32]),
    Cell(TokenCell),
}

/// Server side: the call must carry `authorization: Bearer <token>`. Built
/// with no token, it lets every call through (a port configured open).
#[derive(Clone)]
pub struct RequireBearer {
    expected: Expected,
    /// What is being protected, for the error message ("FastPath", "agent").
    what: &'static str,
}

impl RequireBearer {
    pub fn new(token: Option<&str>, what: &'static str) -> Self {
        Self {
            expected: match token.filter(|t| !t.is_empty()) {
                Some(t) => Expected::Fixed(token_digest(t.as_bytes())),
                None => Expected::Open,
            },
            what,
        }
    }

    /// Expects whatever `cell` holds at the time of each call; refuses
    /// every call (UNAVAILABLE) while it holds nothing.
    pub fn cell(cell: TokenCell, what: &'static str) -> Self {
        Self {
            expected: Expected::Cell(cell),
            what,
        }
    }

    /// Is this request allowed? Generic over the body, so a service can call
    /// it from inside a handler as well as from an interceptor.
    pub fn check<T>(&self, req: Request<T>) -> Result<Request<T>, Status> {
        let expected = match &self.expected {
            Expected::Open => return Ok(req),
            Expected::Fixed(d) => *d,
            Expected::Cell(cell) => cell.get().ok_or_else(|| {
                Status::unavailable(format!(
                    "{}: not enrolled with the controller yet: no credential to check calls against",
                    self.what
                ))
            })?,
        };
        let expected = &expected;
        let presented = presented_bearer(req.metadata());
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

/// Where an agent keeps its credential, under its state dir: the janitor
/// of the same node reads it there to report reaps for that agent.
pub const CREDENTIAL_FILE: &str = "identity/credential";

/// An agent id's credential as the agent stored it (file
/// [`CREDENTIAL_FILE`]: the id on the first line, the credential on the
/// second).
#[derive(Clone, PartialEq, Eq)]
pub struct StoredCredential {
    pub agent_id: String,
    pub credential: String,
}

impl std::fmt::Debug for StoredCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoredCredential({}, ..)", self.agent_id)
    }
}

impl StoredCredential {
    /// The credential stored under `state_dir`; `None` when there is none
    /// or it cannot be read (the caller enrolls again).
    pub fn read(state_dir: &std::path::Path) -> Option<Self> {
        let text = std::fs::read_to_string(state_dir.join(CREDENTIAL_FILE)).ok()?;
        let mut lines = text.lines();
        let agent_id = lines.next()?.trim().to_string();
        let credential = lines.next()?.trim().to_string();
        (!agent_id.is_empty() && !credential.is_empty()).then_some(Self {
            agent_id,
            credential,
        })
    }

    /// Writes it under `state_dir`, mode 0600, replacing any older one
    /// atomically (a crash leaves the old or the new, never half).
    pub fn write(&self, state_dir: &std::path::Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = state_dir.join(CREDENTIAL_FILE);
        let dir = path.parent().expect("CREDENTIAL_FILE has a directory");
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(".credential.tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        writeln!(f, "{}\n{}", self.agent_id, self.credential)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
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
    fn a_token_cell_refuses_until_set_then_follows_it() {
        let cell = TokenCell::default();
        let auth = RequireBearer::cell(cell.clone(), "agent");
        let err = auth.check(with(Some("Bearer x"))).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        cell.set("cred-1");
        assert!(cell.is_set());
        assert!(auth.check(with(Some("Bearer cred-1"))).is_ok());
        let err = auth.check(with(Some("Bearer x"))).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        cell.set("cred-2");
        assert!(auth.check(with(Some("Bearer cred-1"))).is_err());
        assert!(auth.check(with(Some("Bearer cred-2"))).is_ok());
    }

    #[test]
    fn a_stored_credential_round_trips_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        // No tempfile dependency here: a fresh directory of our own.
        let dir = std::env::temp_dir().join(format!("sandbolt-cred-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(StoredCredential::read(&dir), None);
        let c = StoredCredential {
            agent_id: "agent-1".into(),
            credential: "abc".into(),
        };
        c.write(&dir).unwrap();
        c.write(&dir).unwrap();
        assert_eq!(StoredCredential::read(&dir), Some(c));
        let mode = std::fs::metadata(dir.join(CREDENTIAL_FILE))
            .unwrap()
            .permissions()
            .mode();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(constant_time_eq(b"", b""));
    }
}
