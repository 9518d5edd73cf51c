//! Image references, normalized the way Docker and containerd normalize them
//! (`github.com/distribution/reference`, `ParseNormalizedNamed` /
//! `ParseAnyReference`): `busybox` and `docker.io/library/busybox:latest`
//! name the same image.
//!
//! This is the one implementation of those rules in sandbolt. The agent names
//! and looks up images in containerd with [`ImageRef`]'s display form and
//! reports them (already normalized) in its inventory; the controller keys
//! image affinity on [`match_key`]. Because both go through this crate, the
//! key the controller derives from a client's reference equals the key it
//! derives from what the agent reports for the same image.
//!
//! Rules:
//! - a first path component is a registry host only if it contains `.` or
//!   `:`, is `localhost`, or has an upper-case letter; otherwise the registry
//!   is `docker.io` (`index.docker.io` is rewritten to `docker.io`);
//! - on `docker.io`, a single-component path gains `library/`;
//! - `:latest` is added only when there is neither a tag nor a digest;
//! - repository path components are `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`,
//!   tags are `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`, the name is at most 255
//!   characters;
//! - digests are `sha256`/`sha384`/`sha512` with the exact number of
//!   lower-case hex digits (go-digest's validation); a bare digest is a
//!   reference to content, with no repository.
//!
//! One deliberate difference from Docker: a digest-shaped reference with no
//! `/` that is not a valid digest (`sha256:abc`) is rejected as a mistyped
//! digest, where Docker would read it as the image `library/sha256:abc`.

use std::fmt;
use std::str::FromStr;

const DEFAULT_DOMAIN: &str = "docker.io";
const LEGACY_DOMAIN: &str = "index.docker.io";
const OFFICIAL_PREFIX: &str = "library/";
const DEFAULT_TAG: &str = "latest";
const NAME_TOTAL_LENGTH_MAX: usize = 255;
const TAG_LENGTH_MAX: usize = 128;
/// go-digest's algorithms and their hex lengths.
const DIGEST_ALGORITHMS: [(&str, usize); 3] = [("sha256", 64), ("sha384", 96), ("sha512", 128)];

/// A parsed, normalized image reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ImageRef {
    /// `domain/path[:tag][@digest]`, normalized: `domain` is never empty,
    /// `tag` is `latest` when neither tag nor digest was given.
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
pub enum ImageRefError {
    #[error("image reference is empty")]
    Empty,
    #[error("invalid image reference {reference:?}: {reason}")]
    Malformed {
        reference: String,
        reason: &'static str,
    },
}

impl ImageRef {
    /// Parses and normalizes `input` (surrounding whitespace is ignored).
    pub fn parse(input: &str) -> Result<Self, ImageRefError> {
        let s = input.trim();
        if s.is_empty() {
            return Err(ImageRefError::Empty);
        }
        let err = |reason| ImageRefError::Malformed {
            reference: s.to_string(),
            reason,
        };
        // A string that is a valid digest is a digest reference (Docker's
        // ParseAnyReference); anything else must be a name.
        if check_digest(s).is_ok() {
            return Ok(ImageRef::Digest(s.to_string()));
        }
        // Deliberately stricter than Docker, which would read "sha256:abc" as
        // the image "sha256" with the tag "abc": something shaped like a
        // digest is a mistyped digest, not an official image named after a
        // hash algorithm.
        if let Some((alg, _)) = s.split_once(':')
            && DIGEST_ALGORITHMS.iter().any(|(a, _)| *a == alg)
            && !s.contains('/')
        {
            check_digest(s).map_err(err)?;
        }
        if s.len() == 64 && s.bytes().all(is_lower_hex) {
            return Err(err("cannot specify 64-byte hexadecimal strings"));
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
                if !valid_tag(t) {
                    return Err(err("bad tag"));
                }
                (&rest[..last_slash + i], Some(t.to_string()))
            }
            None => (rest, None),
        };
        let (domain, path) = match name.split_once('/') {
            Some((first, remainder))
                if first.contains(['.', ':'])
                    || first == "localhost"
                    || first.bytes().any(|b| b.is_ascii_uppercase()) =>
            {
                // Docker's grammar lets the first component be a host or a
                // path component; either way it is then used as the host.
                if !valid_domain(first) && !valid_path_component(first) {
                    return Err(err("bad registry host"));
                }
                (first, remainder)
            }
            _ => (DEFAULT_DOMAIN, name),
        };
        let domain = if domain == LEGACY_DOMAIN {
            DEFAULT_DOMAIN
        } else {
            domain
        };
        if path.is_empty() {
            return Err(err("empty repository path"));
        }
        if path.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(err("repository name must be lowercase"));
        }
        if !path.split('/').all(valid_path_component) {
            return Err(err("bad repository path"));
        }
        let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
            format!("{OFFICIAL_PREFIX}{path}")
        } else {
            path.to_string()
        };
        if domain.len() + 1 + path.len() > NAME_TOTAL_LENGTH_MAX {
            return Err(err("repository name must not be more than 255 characters"));
        }
        // Docker adds ":latest" only when there is neither tag nor digest.
        let tag = match (tag, &digest) {
            (None, None) => Some(DEFAULT_TAG.to_string()),
            (t, _) => t,
        };
        Ok(ImageRef::Named {
            domain: domain.to_string(),
            path,
            tag,
            digest,
        })
    }

    /// The registry host (`docker.io`, `localhost:5000`); `None` for a bare
    /// digest.
    pub fn domain(&self) -> Option<&str> {
        match self {
            ImageRef::Named { domain, .. } => Some(domain),
            ImageRef::Digest(_) => None,
        }
    }

    /// `domain/path` (`docker.io/library/busybox`); `None` for a bare digest.
    pub fn repository(&self) -> Option<String> {
        match self {
            ImageRef::Named { domain, path, .. } => Some(format!("{domain}/{path}")),
            ImageRef::Digest(_) => None,
        }
    }

    /// The tag, if any (`latest` when neither tag nor digest was given).
    pub fn tag(&self) -> Option<&str> {
        match self {
            ImageRef::Named { tag, .. } => tag.as_deref(),
            ImageRef::Digest(_) => None,
        }
    }

    /// The digest the reference pins, if any.
    pub fn digest(&self) -> Option<&str> {
        match self {
            ImageRef::Named { digest, .. } => digest.as_deref(),
            ImageRef::Digest(d) => Some(d),
        }
    }

    /// The key placement matches on: the digest when one was given (content
    /// identity beats names), else `repository:tag`.
    pub fn match_key(&self) -> String {
        match self {
            ImageRef::Named {
                digest: Some(d), ..
            }
            | ImageRef::Digest(d) => d.clone(),
            ImageRef::Named {
                domain, path, tag, ..
            } => format!("{domain}/{path}:{}", tag.as_deref().unwrap_or(DEFAULT_TAG)),
        }
    }
}

impl FromStr for ImageRef {
    type Err = ImageRefError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
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

/// The placement key of a reference (see [`ImageRef::match_key`]); an
/// unparsable one matches only itself (trimmed).
pub fn match_key(reference: &str) -> String {
    ImageRef::parse(reference)
        .map(|r| r.match_key())
        .unwrap_or_else(|_| reference.trim().to_string())
}

fn is_lower_hex(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

/// go-digest's validation: a registered algorithm and exactly its number of
/// lower-case hex digits.
fn check_digest(d: &str) -> Result<(), &'static str> {
    let (alg, hex) = d.split_once(':').ok_or("digest must be algorithm:hex")?;
    let Some(&(_, want)) = DIGEST_ALGORITHMS.iter().find(|(a, _)| *a == alg) else {
        return Err("unsupported digest algorithm (want sha256, sha384 or sha512)");
    };
    if hex.len() != want || !hex.bytes().all(is_lower_hex) {
        return Err("digest must be its algorithm followed by lower-case hex of the right length");
    }
    Ok(())
}

/// `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`
fn valid_tag(t: &str) -> bool {
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= TAG_LENGTH_MAX
        && word(b[0])
        && b[1..].iter().all(|&c| word(c) || c == b'.' || c == b'-')
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn valid_path_component(c: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let b = c.as_bytes();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator run between alphanumerics: ".", "_", "__" or "-+".
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = matches!(sep, "." | "_" | "__") || sep.bytes().all(|s| s == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// `host[:port]`: host is dot-separated `[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?`
/// labels or a bracketed IPv6 address; port is digits.
fn valid_domain(d: &str) -> bool {
    let (host, port) = if let Some(rest) = d.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        if v6.is_empty() || !v6.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
            return false;
        }
        match after {
            "" => return true,
            a => match a.strip_prefix(':') {
                Some(p) => ("", Some(p)),
                None => return false,
            },
        }
    } else {
        match d.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (d, None),
        }
    };
    if let Some(p) = port
        && (p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return false;
    }
    if d.starts_with('[') {
        return true;
    }
    let label = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'-')
    };
    host.split('.').all(label)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn n(s: &str) -> String {
        ImageRef::parse(s).unwrap().to_string()
    }

    // --- from agent/src/reference.rs ---

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
    fn user_images_and_other_registries_keep_their_path_agent() {
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
        // The controller used to accept this as the image "sha256" with the
        // tag "abc" (as Docker does); a mistyped digest is rejected instead.
        assert!(ImageRef::parse("sha256:abc").is_err());
        assert!(ImageRef::parse(&D.to_uppercase().replace("SHA", "sha")).is_err());
        assert!(ImageRef::parse(&format!("sha512:{}", "a".repeat(64))).is_err());
        // With a path it is a name again (Docker's reading).
        assert_eq!(n("x/sha256:abc"), "docker.io/x/sha256:abc");
        assert!(ImageRef::parse("busybox@sha256:xyz").is_err());
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "Busybox", "busybox:", "a//b", "busybox:ta g", "/x"] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    // --- from controller/src/image_ref.rs ---

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
        // Deliberate change: the controller used to accept upper-case hex and
        // lower-case it; go-digest (and so Docker, containerd and the agent)
        // rejects it, so such a reference is malformed and matches only itself.
        let upper = format!("busybox:1@{}", d.to_uppercase().replace("SHA", "sha"));
        assert!(ImageRef::parse(&upper).is_err());
        assert_eq!(match_key(&upper), upper);
        assert_eq!(match_key(&format!("busybox:1@{d}")), d);
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

    // --- new: the rules where the two used to differ, and consistency ---

    #[test]
    fn only_index_docker_io_is_a_legacy_alias() {
        // Docker rewrites index.docker.io only; registry-1.docker.io (which the
        // controller used to rewrite too) is a distinct registry name.
        assert_eq!(
            n("index.docker.io/busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            n("registry-1.docker.io/library/busybox"),
            "registry-1.docker.io/library/busybox:latest"
        );
    }

    #[test]
    fn docker_grammar_for_paths_tags_and_hosts() {
        for bad in [
            "Busybox",    // upper case repository
            "me/App",     // upper case repository, after a path component
            "busybox:.1", // a tag starts with a word character
            "busybox:-1",
            "busybox:a+b", // the controller accepted any non-space tag
            &format!("busybox:{}", "a".repeat(129)),
            "a..b", // separators sit between alphanumerics
            "-a",
            "a-",
            "a___b",
            "a/b/",
            "bad_host:5000/x", // host labels are alphanumerics and '-'
            "host.io:port/x",  // a port is digits
            "[zz]/x",
            &"a".repeat(64), // looks like an image id
            &format!("x.io/{}", "a".repeat(255)),
        ] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} should be rejected");
        }
        assert_eq!(n("a-b--c__d/e.f_g"), "docker.io/a-b--c__d/e.f_g:latest");
        // Docker quirk: a first component with a '.' that is not a valid host
        // name but is a valid path component is still taken as the host.
        assert_eq!(n("bad_host.io/x"), "bad_host.io/x:latest");
        assert_eq!(n("busybox:_A.b-1"), "docker.io/library/busybox:_A.b-1");
        assert_eq!(n("[::1]:5000/x:1"), "[::1]:5000/x:1");
        assert_eq!(n("[fe80::1]/x"), "[fe80::1]/x:latest");
        assert_eq!(n("127.0.0.1:5000/x"), "127.0.0.1:5000/x:latest");
        // An upper-case first component is a host, like in Docker.
        assert_eq!(n("Registry/x"), "Registry/x:latest");
        assert_eq!(n("  busybox \n"), "docker.io/library/busybox:latest");
    }

    #[test]
    fn digest_algorithms_are_go_digests() {
        let s512 = format!("sha512:{}", "b".repeat(128));
        let s384 = format!("sha384:{}", "c".repeat(96));
        assert_eq!(match_key(&s512), s512);
        assert_eq!(
            ImageRef::parse(&s384).unwrap(),
            ImageRef::Digest(s384.clone())
        );
        assert_eq!(match_key(&format!("x@{s512}")), s512);
        for bad in [
            format!("x@md5:{}", "a".repeat(32)), // the controller took any algorithm
            format!("x@sha256:{}", "a".repeat(63)),
            format!("x@sha512:{}", "a".repeat(64)),
        ] {
            assert!(ImageRef::parse(&bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn accessors() {
        let r = ImageRef::parse(&format!("localhost:5000/a/b:t@{D}")).unwrap();
        assert_eq!(r.domain(), Some("localhost:5000"));
        assert_eq!(r.repository().as_deref(), Some("localhost:5000/a/b"));
        assert_eq!(r.tag(), Some("t"));
        assert_eq!(r.digest(), Some(D));
        let d = ImageRef::parse(D).unwrap();
        assert_eq!((d.domain(), d.repository(), d.tag()), (None, None, None));
        assert_eq!(d.digest(), Some(D));
        assert_eq!("busybox".parse::<ImageRef>().unwrap().tag(), Some("latest"));
    }

    #[test]
    fn error_messages() {
        assert_eq!(ImageRefError::Empty.to_string(), "image reference is empty");
        assert_eq!(
            ImageRef::parse("Busybox").unwrap_err().to_string(),
            "invalid image reference \"Busybox\": repository name must be lowercase"
        );
    }

    /// The controller keys placement on `match_key` of what a client sent and
    /// of what the agent reports (containerd names it created from
    /// `normalize`): the two must agree, and normalizing must be idempotent.
    #[test]
    fn reported_names_give_the_requested_key() {
        let s512 = format!("sha512:{}", "b".repeat(128));
        for input in [
            "busybox",
            "busybox:1.36",
            "library/busybox",
            "docker.io/busybox",
            "index.docker.io/library/busybox:latest",
            "user/app",
            "ghcr.io/org/app:v1",
            "localhost:5000/app",
            "localhost/app:1",
            "registry.local:5000/a/b/c:tag",
            "[::1]:5000/x",
            "Registry/x:1",
            &format!("busybox@{D}"),
            &format!("busybox:1@{D}"),
            D,
            &s512,
        ] {
            let reported = normalize(input);
            assert_eq!(normalize(&reported), reported, "{input:?}");
            assert_eq!(match_key(&reported), match_key(input), "{input:?}");
            assert_eq!(
                ImageRef::parse(&reported).unwrap(),
                ImageRef::parse(input).unwrap(),
                "{input:?}"
            );
        }
    }
}
