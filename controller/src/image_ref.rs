//! Image reference normalization, so that placement matches images the way a
//! registry would (`busybox` == `docker.io/library/busybox:latest`) rather than
//! by string.
//!
//! The agent has its own normalizer for what it reports; both follow the
//! Docker reference grammar. A shared implementation could later move to a
//! common crate — until then the two are kept honest by the end-to-end tests
//! (an image the agent reports must be found by the name a client sends).

use std::fmt;

/// A parsed, normalized image reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageRef {
    /// `docker.io/library/busybox`; empty for a bare digest.
    pub repository: String,
    /// `latest` when neither tag nor digest was given.
    pub tag: Option<String>,
    /// `sha256:<hex>`.
    pub digest: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageRefError {
    #[error("image reference is empty")]
    Empty,
    #[error("image reference {0:?} is malformed: {1}")]
    Malformed(String, &'static str),
}

const DEFAULT_DOMAIN: &str = "docker.io";
const OFFICIAL_PREFIX: &str = "library/";

impl ImageRef {
    pub fn parse(input: &str) -> Result<Self, ImageRefError> {
        let s = input.trim();
        if s.is_empty() {
            return Err(ImageRefError::Empty);
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ImageRefError::Malformed(s.into(), "contains whitespace"));
        }
        // A bare digest names content, not a repository.
        if is_digest(s) {
            return Ok(Self {
                repository: String::new(),
                tag: None,
                digest: Some(s.to_ascii_lowercase()),
            });
        }
        let (name_tag, digest) = match s.split_once('@') {
            Some((n, d)) => {
                if !is_digest(d) {
                    return Err(ImageRefError::Malformed(
                        s.into(),
                        "digest is not algorithm:hex",
                    ));
                }
                (n, Some(d.to_ascii_lowercase()))
            }
            None => (s, None),
        };
        // The tag is after the last ':' of the last path segment (a ':' before
        // the last '/' belongs to a registry port).
        let last_slash = name_tag.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match name_tag[last_slash..].rfind(':') {
            Some(i) => {
                let t = &name_tag[last_slash + i + 1..];
                if t.is_empty() {
                    return Err(ImageRefError::Malformed(s.into(), "empty tag"));
                }
                (&name_tag[..last_slash + i], Some(t.to_string()))
            }
            None => (name_tag, None),
        };
        if name.is_empty() || name.starts_with('/') || name.ends_with('/') || name.contains("//") {
            return Err(ImageRefError::Malformed(s.into(), "bad repository name"));
        }
        let (domain, path) = match name.split_once('/') {
            Some((first, rest))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_string(), rest.to_string())
            }
            _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
        };
        let domain = if domain == "index.docker.io" || domain == "registry-1.docker.io" {
            DEFAULT_DOMAIN.to_string()
        } else {
            domain
        };
        let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
            format!("{OFFICIAL_PREFIX}{path}")
        } else {
            path
        };
        let tag = match (tag, &digest) {
            (None, None) => Some("latest".to_string()),
            (t, _) => t,
        };
        Ok(Self {
            repository: format!("{domain}/{path}"),
            tag,
            digest,
        })
    }

    /// The key placement matches on: the digest when one was given (content
    /// identity beats names), else `repository:tag`.
    pub fn match_key(&self) -> String {
        match &self.digest {
            Some(d) => d.clone(),
            None => format!(
                "{}:{}",
                self.repository,
                self.tag.as_deref().unwrap_or("latest")
            ),
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.repository)?;
        if let Some(t) = &self.tag
            && !self.repository.is_empty()
        {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            if self.repository.is_empty() {
                f.write_str(d)?;
            } else {
                write!(f, "@{d}")?;
            }
        }
        Ok(())
    }
}

fn is_digest(s: &str) -> bool {
    match s.split_once(':') {
        Some((alg, hex)) => {
            !alg.is_empty()
                && alg.chars().all(|c| {
                    c.is_ascii_alphanumeric() || c == '+' || c == '.' || c == '_' || c == '-'
                })
                && hex.len() >= 32
                && hex.chars().all(|c| c.is_ascii_hexdigit())
        }
        None => false,
    }
}

/// Normalizes a reference for matching; an unparsable one matches only itself.
pub fn match_key(reference: &str) -> String {
    ImageRef::parse(reference)
        .map(|r| r.match_key())
        .unwrap_or_else(|_| reference.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> String {
        ImageRef::parse(s).unwrap().to_string()
    }

    #[test]
    fn official_images_gain_domain_library_and_latest() {
        assert_eq!(n("busybox"), "docker.io/library/busybox:latest");
        assert_eq!(n("busybox:1.36"), "docker.io/library/busybox:1.36");
        assert_eq!(n("library/busybox"), "docker.io/library/busybox:latest");
        assert_eq!(n("docker.io/busybox"), "docker.io/library/busybox:latest");
        assert_eq!(
            n("index.docker.io/library/busybox:latest"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            match_key("busybox"),
            match_key("docker.io/library/busybox:latest")
        );
    }

    #[test]
    fn user_images_and_other_registries_keep_their_path() {
        assert_eq!(n("user/app"), "docker.io/user/app:latest");
        assert_eq!(n("ghcr.io/org/app:v1"), "ghcr.io/org/app:v1");
        assert_eq!(n("localhost:5000/app"), "localhost:5000/app:latest");
        assert_eq!(n("localhost/app:1"), "localhost/app:1");
        assert_eq!(
            n("registry.local:5000/a/b/c:tag"),
            "registry.local:5000/a/b/c:tag"
        );
    }

    #[test]
    fn digests_win_over_names() {
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(match_key(&format!("busybox@{d}")), d);
        assert_eq!(match_key(&d), d);
        assert_eq!(
            match_key(&format!(
                "busybox:1@{}",
                d.to_uppercase().replace("SHA", "sha")
            )),
            d
        );
        assert_eq!(
            n(&format!("busybox@{d}")),
            format!("docker.io/library/busybox@{d}")
        );
    }

    #[test]
    fn malformed_references_are_rejected() {
        assert_eq!(ImageRef::parse(""), Err(ImageRefError::Empty));
        assert!(ImageRef::parse("busybox:").is_err());
        assert!(ImageRef::parse("busy box").is_err());
        assert!(ImageRef::parse("busybox@sha256:zz").is_err());
        assert!(ImageRef::parse("/busybox").is_err());
    }
}
