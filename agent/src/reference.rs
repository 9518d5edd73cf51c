//! Image reference normalization, Docker style: `busybox` and
//! `docker.io/library/busybox:latest` name the same image, so the registry
//! index, the image store and the controller's affinity must compare the
//! normalized form, never the string a user typed.

use std::fmt;

const DEFAULT_DOMAIN: &str = "docker.io";
const LEGACY_DOMAIN: &str = "index.docker.io";
const OFFICIAL_PREFIX: &str = "library/";
const DEFAULT_TAG: &str = "latest";

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ImageRef {
    /// `[domain/]path[:tag][@digest]`, normalized.
    Named {
        domain: String,
        path: String,
        tag: Option<String>,
        digest: Option<String>,
    },
    /// A bare content digest (`sha256:<64 hex>`): matches an image whose
    /// target has this digest.
    Digest(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid image reference {reference:?}: {reason}")]
pub struct ReferenceError {
    pub reference: String,
    pub reason: &'static str,
}

impl ImageRef {
    pub fn parse(input: &str) -> Result<Self, ReferenceError> {
        let err = |reason| ReferenceError {
            reference: input.to_string(),
            reason,
        };
        let s = input.trim();
        if s.is_empty() {
            return Err(err("empty"));
        }
        if s.starts_with("sha256:") {
            check_digest(s).map_err(err)?;
            return Ok(ImageRef::Digest(s.to_string()));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                check_digest(d).map_err(err)?;
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        // A tag is a ':' after the last '/', so "localhost:5000/x" keeps its port.
        let last_slash = rest.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let t = &rest[last_slash + i + 1..];
                if t.is_empty()
                    || t.len() > 128
                    || !t
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                {
                    return Err(err("bad tag"));
                }
                (&rest[..last_slash + i], Some(t.to_string()))
            }
            None => (rest, None),
        };
        let (domain, path) = match name.split_once('/') {
            Some((first, remainder))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_string(), remainder.to_string())
            }
            _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
        };
        let domain = if domain == LEGACY_DOMAIN {
            DEFAULT_DOMAIN.to_string()
        } else {
            domain
        };
        if path.is_empty() {
            return Err(err("empty repository path"));
        }
        if path.chars().any(|c| c.is_ascii_uppercase()) {
            return Err(err("repository name must be lowercase"));
        }
        if !path.split('/').all(|c| {
            !c.is_empty()
                && c.chars()
                    .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || "._-".contains(ch))
        }) {
            return Err(err("bad repository path"));
        }
        let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
            format!("{OFFICIAL_PREFIX}{path}")
        } else {
            path
        };
        // Docker adds ":latest" only when there is neither tag nor digest.
        let tag = match (&tag, &digest) {
            (None, None) => Some(DEFAULT_TAG.to_string()),
            _ => tag,
        };
        Ok(ImageRef::Named {
            domain,
            path,
            tag,
            digest,
        })
    }

    /// The digest the reference pins, if any.
    pub fn digest(&self) -> Option<&str> {
        match self {
            ImageRef::Named { digest, .. } => digest.as_deref(),
            ImageRef::Digest(d) => Some(d),
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Named {
                domain,
                path,
                tag,
                digest,
            } => {
                write!(f, "{domain}/{path}")?;
                if let Some(t) = tag {
                    write!(f, ":{t}")?;
                }
                if let Some(d) = digest {
                    write!(f, "@{d}")?;
                }
                Ok(())
            }
            ImageRef::Digest(d) => f.write_str(d),
        }
    }
}

/// Normalizes a reference string; invalid input comes back unchanged so that
/// listing foreign image names never fails.
pub fn normalize(reference: &str) -> String {
    ImageRef::parse(reference)
        .map(|r| r.to_string())
        .unwrap_or_else(|_| reference.to_string())
}

fn check_digest(d: &str) -> Result<(), &'static str> {
    let hex = d
        .strip_prefix("sha256:")
        .ok_or("digest must be sha256:<hex>")?;
    if hex.len() != 64
        || !hex
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    {
        return Err("digest must be sha256 followed by 64 lowercase hex digits");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn official_images_get_domain_library_and_latest() {
        assert_eq!(normalize("busybox"), "docker.io/library/busybox:latest");
        assert_eq!(normalize("busybox:1.36"), "docker.io/library/busybox:1.36");
        assert_eq!(
            normalize("docker.io/library/busybox:latest"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            normalize("index.docker.io/library/busybox"),
            "docker.io/library/busybox:latest"
        );
    }

    #[test]
    fn user_images_and_other_registries_keep_their_path() {
        assert_eq!(normalize("me/app"), "docker.io/me/app:latest");
        assert_eq!(normalize("ghcr.io/o/r:v1"), "ghcr.io/o/r:v1");
        assert_eq!(
            normalize("localhost:5000/x"),
            "localhost:5000/x:latest",
            "a registry port is not a tag"
        );
        assert_eq!(normalize("localhost/x:1"), "localhost/x:1");
    }

    #[test]
    fn digests() {
        assert_eq!(ImageRef::parse(D).unwrap(), ImageRef::Digest(D.to_string()));
        assert_eq!(
            normalize(&format!("busybox@{D}")),
            format!("docker.io/library/busybox@{D}")
        );
        assert_eq!(
            normalize(&format!("busybox:1@{D}")),
            format!("docker.io/library/busybox:1@{D}")
        );
        assert!(ImageRef::parse("sha256:abc").is_err());
        assert!(ImageRef::parse("busybox@sha256:xyz").is_err());
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "Busybox", "busybox:", "a//b", "busybox:ta g", "/x"] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
