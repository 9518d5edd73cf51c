//! The OpenSandbox server's signed fsb route scopes, checked against its key
//! ring. The server hands every client of an fsb sandbox a scope
//! `f1.<ns>.<id>.<port>.<kid>.<mac>` (header `OpenSandbox-Ingress-To`, or the
//! first path segment in uri mode); namespace and id are unpadded base64url,
//! `kid` names the key it was signed with and `mac` is the first 16 bytes of
//! HMAC-SHA256 over `opensandbox-fsb-route-v1\n{ns}\n{id}\n{port}\n`,
//! unpadded base64url. Whoever holds a scope may reach exactly that port of
//! exactly that sandbox: nothing else in it is trusted before the MAC is.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine as _;
use base64::alphabet;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header that carries a scope in header mode.
pub const INGRESS_HEADER: &str = "OpenSandbox-Ingress-To";

/// The server's environment variable holding its key ring; the gateway reads
/// the same variable so one Secret feeds both.
pub const SECURE_ACCESS_KEYS_ENV: &str = "OPENSANDBOX_SECURE_ACCESS_KEYS";

const SCOPE_VERSION: &str = "f1";
const CANONICAL_PREFIX: &str = "opensandbox-fsb-route-v1";
/// The server truncates the MAC to 128 bits.
const MAC_LEN: usize = 16;

/// The server decodes keys as standard base64 with or without padding, and
/// does not insist on zero trailing bits: a key it accepts must decode to
/// the same bytes here.
const KEY_BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

/// Why a key ring was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyRingError {
    #[error("the key ring is empty; expected key_id=base64[,key_id=base64...]")]
    Empty,
    #[error("key ring entry {0:?} is not in key_id=base64 form")]
    NotAPair(String),
    #[error("key id {0:?} is not exactly one character of [0-9a-z]")]
    BadKeyId(String),
    #[error("key {0} is not valid base64")]
    BadKey(char),
    #[error("key {0} decodes to no bytes")]
    EmptyKey(char),
    #[error("key id {0} appears more than once")]
    DuplicateKeyId(char),
}

/// Why a scope was refused. Malformed scopes are the client's mistake (400);
/// the other two are refusals (403).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeError {
    #[error("route scope is malformed: {0}")]
    Malformed(&'static str),
    #[error("route scope is signed with key {0:?}, which this gateway does not hold")]
    UnknownKey(String),
    #[error("route scope signature does not match")]
    BadSignature,
}

/// What a verified scope grants: one port of one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteScope {
    pub namespace: String,
    pub sandbox_id: String,
    pub port: u16,
    /// The key that signed it (rotation: any key of the ring verifies).
    pub key_id: char,
}

/// The signing keys by id, in the server's `OPENSANDBOX_SECURE_ACCESS_KEYS`
/// form: `kid=base64,kid2=base64`, each id one character of `[0-9a-z]`.
/// Every key verifies; which one signs is the server's
/// `OPENSANDBOX_SECURE_ACCESS_ACTIVE_KEY`, not the gateway's business.
#[derive(Clone)]
pub struct KeyRing {
    keys: BTreeMap<char, Vec<u8>>,
}

impl fmt::Debug for KeyRing {
    /// Key ids only: secrets stay out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyRing")
            .field("key_ids", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl KeyRing {
    /// Parses a key ring. Surrounding whitespace of the whole ring is
    /// dropped (a file's trailing newline); inside it, entries are taken as
    /// the server takes them, split on `,` then on the first `=`.
    pub fn parse(ring: &str) -> Result<Self, KeyRingError> {
        let ring = ring.trim();
        if ring.is_empty() {
            return Err(KeyRingError::Empty);
        }
        let mut keys = BTreeMap::new();
        for entry in ring.split(',') {
            let (id, key) = parse_entry(entry)?;
            if keys.insert(id, key).is_some() {
                return Err(KeyRingError::DuplicateKeyId(id));
            }
        }
        Ok(Self { keys })
    }

    /// The ids of the keys held, in order.
    pub fn key_ids(&self) -> impl Iterator<Item = char> + '_ {
        self.keys.keys().copied()
    }

    /// Checks `scope` and answers what it grants.
    pub fn verify(&self, scope: &str) -> Result<RouteScope, ScopeError> {
        let parts = ScopeParts::split(scope)?;
        let key = self
            .keys
            .get(&parts.key_id)
            .ok_or_else(|| ScopeError::UnknownKey(parts.key_id.to_string()))?;
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
        mac.update(canonical(&parts.namespace, &parts.sandbox_id, parts.port).as_bytes());
        // Constant time, by the hmac crate.
        mac.verify_truncated_left(&parts.mac)
            .map_err(|_| ScopeError::BadSignature)?;
        Ok(RouteScope {
            namespace: parts.namespace,
            sandbox_id: parts.sandbox_id,
            port: parts.port,
            key_id: parts.key_id,
        })
    }
}

fn parse_entry(entry: &str) -> Result<(char, Vec<u8>), KeyRingError> {
    let (id, b64) = entry
        .split_once('=')
        .filter(|(id, _)| !id.is_empty())
        .ok_or_else(|| KeyRingError::NotAPair(entry.to_string()))?;
    let id = key_id(id).ok_or_else(|| KeyRingError::BadKeyId(id.to_string()))?;
    let key = KEY_BASE64
        .decode(b64)
        .map_err(|_| KeyRingError::BadKey(id))?;
    if key.is_empty() {
        return Err(KeyRingError::EmptyKey(id));
    }
    Ok((id, key))
}

/// A key id: exactly one character of `[0-9a-z]`.
fn key_id(s: &str) -> Option<char> {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) if c.is_ascii_digit() || c.is_ascii_lowercase() => Some(c),
        _ => None,
    }
}

/// The signed message.
fn canonical(namespace: &str, sandbox_id: &str, port: u16) -> String {
    format!("{CANONICAL_PREFIX}\n{namespace}\n{sandbox_id}\n{port}\n")
}

/// A scope taken apart, not yet verified.
struct ScopeParts {
    namespace: String,
    sandbox_id: String,
    port: u16,
    key_id: char,
    mac: Vec<u8>,
}

impl ScopeParts {
    fn split(scope: &str) -> Result<Self, ScopeError> {
        let fields: Vec<&str> = scope.split('.').collect();
        let [version, namespace, sandbox_id, port, key, mac] = fields[..] else {
            return Err(ScopeError::Malformed("expected six dot-separated fields"));
        };
        if version != SCOPE_VERSION {
            return Err(ScopeError::Malformed("unknown scope version (want f1)"));
        }
        let mac = URL_SAFE_NO_PAD
            .decode(mac)
            .ok()
            .filter(|m| m.len() == MAC_LEN)
            .ok_or(ScopeError::Malformed(
                "signature is not 16 bytes of base64url",
            ))?;
        Ok(Self {
            namespace: decode_name(namespace, "namespace is not base64url UTF-8 text")?,
            sandbox_id: decode_name(sandbox_id, "sandbox id is not base64url UTF-8 text")?,
            port: canonical_port(port)?,
            key_id: key_id(key).ok_or(ScopeError::Malformed("key id is not one of [0-9a-z]"))?,
            mac,
        })
    }
}

/// A namespace or sandbox id: non-empty unpadded base64url of UTF-8 text
/// without control characters (the server signs nothing else).
fn decode_name(field: &str, why: &'static str) -> Result<String, ScopeError> {
    URL_SAFE_NO_PAD
        .decode(field)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .filter(|s| !s.is_empty() && !s.chars().any(char::is_control))
        .ok_or(ScopeError::Malformed(why))
}

/// The port exactly as the server prints it (decimal, no sign, no leading
/// zero, 1..=65535), so one grant has one spelling.
fn canonical_port(field: &str) -> Result<u16, ScopeError> {
    field
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0 && p.to_string() == field)
        .ok_or(ScopeError::Malformed("port is not a decimal in 1..=65535"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scope signed the way the server signs (computed here from the
    /// definition; the integration test checks against the server itself).
    fn sign(key: &[u8], kid: char, ns: &str, id: &str, port: u16) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
        mac.update(canonical(ns, id, port).as_bytes());
        let mac = &mac.finalize().into_bytes()[..MAC_LEN];
        format!(
            "f1.{}.{}.{port}.{kid}.{}",
            URL_SAFE_NO_PAD.encode(ns),
            URL_SAFE_NO_PAD.encode(id),
            URL_SAFE_NO_PAD.encode(mac)
        )
    }

    /// `scope` with its dot-separated field `i` replaced.
    fn with_field(scope: &str, i: usize, value: &str) -> String {
        let mut fields: Vec<&str> = scope.split('.').collect();
        fields[i] = value;
        fields.join(".")
    }

    #[test]
    fn key_ring_takes_the_servers_forms() {
        // "secret-a" padded and unpadded, and a non-zero trailing bit.
        let ring = KeyRing::parse("a=c2VjcmV0LWE=,b=c2VjcmV0LWE,c=c2VjcmV0LWF\n").unwrap();
        assert_eq!(ring.key_ids().collect::<String>(), "abc");
        for id in ['a', 'b', 'c'] {
            assert_eq!(ring.keys[&id], b"secret-a");
        }
        assert!(!format!("{ring:?}").contains("c2Vj"));
    }

    #[test]
    fn key_ring_refusals() {
        for (ring, want) in [
            ("", KeyRingError::Empty),
            ("a", KeyRingError::NotAPair("a".into())),
            ("=c2Vj", KeyRingError::NotAPair("=c2Vj".into())),
            ("A=c2Vj", KeyRingError::BadKeyId("A".into())),
            ("ab=c2Vj", KeyRingError::BadKeyId("ab".into())),
            ("a=c2Vj,a=c2Vj", KeyRingError::DuplicateKeyId('a')),
            ("a=not base64!", KeyRingError::BadKey('a')),
            ("a=", KeyRingError::EmptyKey('a')),
        ] {
            assert_eq!(KeyRing::parse(ring).unwrap_err(), want, "{ring:?}");
        }
        // Inside the ring, blanks are not trimmed (the server does not).
        assert!(matches!(
            KeyRing::parse("a=c2Vj, b=c2Vj"),
            Err(KeyRingError::BadKeyId(_))
        ));
    }

    #[test]
    fn verified_scope_grants_what_was_signed() {
        let ring = KeyRing::parse("a=a2V5LWE,b=a2V5LWI").unwrap();
        let scope = sign(b"key-b", 'b', "team-ns", "fsb-1", 44772);
        let got = ring.verify(&scope).unwrap();
        assert_eq!(
            got,
            RouteScope {
                namespace: "team-ns".into(),
                sandbox_id: "fsb-1".into(),
                port: 44772,
                key_id: 'b',
            }
        );
    }

    #[test]
    fn altered_scopes_are_refused() {
        let ring = KeyRing::parse("a=a2V5LWE").unwrap();
        let good = sign(b"key-a", 'a', "ns", "fsb-1", 8080);
        let with = |i: usize, v: &str| with_field(&good, i, v);
        let other_ns = URL_SAFE_NO_PAD.encode("other");
        let other_id = URL_SAFE_NO_PAD.encode("fsb-2");
        for scope in [with(1, &other_ns), with(2, &other_id), with(3, "8081")] {
            assert_eq!(
                ring.verify(&scope),
                Err(ScopeError::BadSignature),
                "{scope}"
            );
        }
        // Signed with a key of the same id the gateway does not hold.
        let forged = sign(b"key-x", 'a', "ns", "fsb-1", 8080);
        assert_eq!(ring.verify(&forged), Err(ScopeError::BadSignature));
        assert_eq!(
            ring.verify(&with(4, "z")),
            Err(ScopeError::UnknownKey("z".into()))
        );
    }

    #[test]
    fn malformed_scopes_are_refused_before_any_key_is_used() {
        let good = sign(b"key-a", 'a', "ns", "fsb-1", 8080);
        let with = |i: usize, v: &str| with_field(&good, i, v);
        let ring = KeyRing::parse("a=a2V5LWE").unwrap();
        let control = URL_SAFE_NO_PAD.encode("a\nb");
        for scope in [
            String::new(),
            "f1.a.b".to_string(),
            format!("{good}.x"),
            with(0, "f2"),
            with(1, ""),
            with(1, "bnM="),
            with(1, &control),
            with(2, "!!"),
            with(3, "08080"),
            with(3, "0"),
            with(3, "65536"),
            with(3, "+8080"),
            with(4, "ab"),
            with(4, "A"),
            with(5, "c2hvcnQ"),
        ] {
            assert!(
                matches!(ring.verify(&scope), Err(ScopeError::Malformed(_))),
                "{scope:?}"
            );
        }
    }
}
