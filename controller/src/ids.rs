//! The identities that travel inside the controller, typed so that one
//! cannot be passed where another is meant:
//!
//! - [`SandboxKey`]: `namespace/name`, what clients call a sandbox (the REST
//!   id, the FastPath request id and the controller name are this name);
//! - [`SandboxId`]: the container on an agent (`sb-…`), new for every
//!   container a record is given (a recreate changes it, the record stays);
//! - [`AgentId`]: the node agent holding the container.
//!
//! The record's `uid` (one per record, never reused) stays a string: only
//! clients hand it back, as a precondition.
//!
//! Serialized forms are the bare strings (`#[serde(transparent)]`), so
//! stored records and the wire do not change.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::placement::or_default;

/// `namespace/name` of a sandbox record; the namespace is never empty.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SandboxKey {
    pub namespace: String,
    pub name: String,
}

impl SandboxKey {
    /// An empty namespace is the default one.
    pub fn new(namespace: &str, name: impl Into<String>) -> Self {
        Self {
            namespace: or_default(namespace.trim()).to_string(),
            name: name.into(),
        }
    }
}

impl SandboxKey {
    /// The sandbox a request names, recorded on the current span; an empty
    /// name is refused naming the request's `field`.
    pub fn named(namespace: &str, name: &str, field: &str) -> Result<Self, Error> {
        if name.is_empty() {
            return Err(Error::InvalidArgument(format!("{field} is required")));
        }
        let key = Self::new(namespace, name);
        key.record_in_span();
        Ok(key)
    }

    /// Names the sandbox on the current span (request handlers declare the
    /// `namespace` and `sandbox` fields, filled once the request is parsed).
    pub fn record_in_span(&self) {
        tracing::Span::current()
            .record("namespace", self.namespace.as_str())
            .record("sandbox", self.name.as_str());
    }
}

impl fmt::Display for SandboxKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A string identity: derefs to `str`, compares with strings, serializes as
/// the bare string.
macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_string())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                self == &other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }
    };
}

string_id!(
    /// A sandbox's container on its agent (`sb-…`).
    SandboxId
);

string_id!(
    /// A node agent, as it registers itself.
    AgentId
);

impl SandboxId {
    /// A fresh container id: never reused, so an answer about one container
    /// cannot be taken for another.
    pub fn generate() -> Self {
        Self(format!("sb-{}", uuid::Uuid::new_v4().simple()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_serialize_as_bare_strings() {
        let id = SandboxId::from("sb-1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"sb-1\"");
        let back: AgentId = serde_json::from_str("\"agent-1\"").unwrap();
        assert_eq!(back, "agent-1");
        assert!(SandboxId::generate().starts_with("sb-"));
        assert_eq!(SandboxKey::new("", "x").to_string(), "default/x");
    }
}
