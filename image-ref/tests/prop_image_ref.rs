//! Property tests of the image reference parser: every reference a client
//! sends goes through it (lifecycle, controller placement, agent pulls), so
//! it must never panic, and what it accepts must be in a stable normal form
//! that the controller and the agent derive identically.

use proptest::prelude::*;
use sandbolt_image_ref::{ImageRef, match_key, normalize};

/// Characters references are made of, plus a few that never belong, so
/// that generated strings are near misses more often than pure noise.
const REF_CHARS: &str = "[a-zA-Z0-9._:/@+-]{0,80}";

fn component() -> impl Strategy<Value = String> {
    // `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`, kept short.
    proptest::string::string_regex("[a-z0-9]{1,6}(([._]|__|-{1,3})[a-z0-9]{1,6}){0,2}").unwrap()
}

fn tag() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}").unwrap()
}

fn digest() -> impl Strategy<Value = String> {
    prop_oneof![
        "[0-9a-f]{64}".prop_map(|h| format!("sha256:{h}")),
        "[0-9a-f]{96}".prop_map(|h| format!("sha384:{h}")),
        "[0-9a-f]{128}".prop_map(|h| format!("sha512:{h}")),
    ]
}

fn domain() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        Just(Some("docker.io".to_string())),
        Just(Some("index.docker.io".to_string())),
        Just(Some("localhost".to_string())),
        Just(Some("localhost:5000".to_string())),
        Just(Some("[::1]:5000".to_string())),
        "[a-z][a-z0-9-]{0,8}[a-z0-9]\\.[a-z]{2,5}(:[0-9]{1,5})?".prop_map(Some),
    ]
}

/// A reference built from the grammar, with what it is made of.
#[derive(Debug, Clone)]
struct Parts {
    domain: Option<String>,
    path: Vec<String>,
    tag: Option<String>,
    digest: Option<String>,
}

impl Parts {
    fn text(&self) -> String {
        let mut s = String::new();
        if let Some(d) = &self.domain {
            s.push_str(d);
            s.push('/');
        }
        s.push_str(&self.path.join("/"));
        if let Some(t) = &self.tag {
            s.push(':');
            s.push_str(t);
        }
        if let Some(d) = &self.digest {
            s.push('@');
            s.push_str(d);
        }
        s
    }
}

fn valid_parts() -> impl Strategy<Value = Parts> {
    (
        domain(),
        proptest::collection::vec(component(), 1..4),
        proptest::option::of(tag()),
        proptest::option::of(digest()),
    )
        .prop_map(|(domain, mut path, tag, digest)| {
            // Without a host, a first component with a '.' would itself be
            // read as the host (Docker's rule); keep it a path component.
            if domain.is_none() && path.len() > 1 {
                path[0] = path[0].replace('.', "-");
            }
            Parts {
                domain,
                path,
                tag,
                digest,
            }
        })
}

/// Accepted ⇒ the display form parses back to the same value, and
/// normalizing is idempotent.
fn assert_stable(input: &str) -> Result<(), TestCaseError> {
    if let Ok(r) = ImageRef::parse(input) {
        let shown = r.to_string();
        let again = ImageRef::parse(&shown);
        prop_assert_eq!(
            again.as_ref(),
            Ok(&r),
            "{:?} displays as {:?}",
            input,
            shown
        );
        prop_assert_eq!(normalize(&shown), shown.clone());
        prop_assert_eq!(normalize(input), shown);
        prop_assert_eq!(match_key(input), r.match_key());
        prop_assert_eq!(match_key(&r.to_string()), r.match_key());
    } else {
        // Refused input is left alone by the lenient helpers.
        prop_assert_eq!(normalize(input), input);
        prop_assert_eq!(match_key(input), input.trim());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn never_panics_on_arbitrary_text(s in any::<String>()) {
        assert_stable(&s)?;
    }

    #[test]
    fn near_misses_are_refused_or_stable(s in REF_CHARS) {
        assert_stable(&s)?;
    }

    #[test]
    fn grammar_references_are_accepted_and_keep_their_parts(p in valid_parts()) {
        let text = p.text();
        // Docker's 255-character bound on the name.
        let name_len = p.domain.as_deref().unwrap_or("docker.io").len() + 1 + p.path.join("/").len() + 8;
        prop_assume!(name_len < 255);
        let r = ImageRef::parse(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        let domain = match p.domain.as_deref() {
            None | Some("index.docker.io") => "docker.io",
            Some(d) => d,
        };
        prop_assert_eq!(r.domain(), Some(domain));
        let mut path = p.path.join("/");
        if domain == "docker.io" && p.path.len() == 1 {
            path = format!("library/{path}");
        }
        prop_assert_eq!(r.repository(), Some(format!("{domain}/{path}")));
        let want_tag = match (&p.tag, &p.digest) {
            (None, None) => Some("latest"),
            (t, _) => t.as_deref(),
        };
        prop_assert_eq!(r.tag(), want_tag);
        prop_assert_eq!(r.digest(), p.digest.as_deref());
        // A digest is the content identity placement matches on.
        if let Some(d) = &p.digest {
            prop_assert_eq!(r.match_key(), d.clone());
        }
        assert_stable(&text)?;
        // Surrounding whitespace is ignored.
        prop_assert_eq!(ImageRef::parse(&format!("  {text}\t")), Ok(r));
    }

    #[test]
    fn upper_case_repositories_are_refused(p in valid_parts(), at in any::<prop::sample::Index>()) {
        // Upper case anywhere after the registry host is never a valid
        // repository path (Docker: "repository name must be lowercase").
        let mut path = p.path.clone();
        let i = at.index(path.len());
        path[i] = path[i].to_ascii_uppercase();
        prop_assume!(path[i] != p.path[i]);
        prop_assume!(p.domain.is_some() || i > 0);
        let text = Parts { path, ..p }.text();
        prop_assert!(ImageRef::parse(&text).is_err(), "{} accepted", text);
    }

    #[test]
    fn bare_digests_are_content_references(d in digest()) {
        let r = ImageRef::parse(&d).unwrap();
        prop_assert_eq!(&r, &ImageRef::Digest(d.clone()));
        prop_assert_eq!(r.match_key(), d.clone());
        prop_assert_eq!(r.repository(), None);
        // One hex digit short is a mistyped digest, not an image name.
        prop_assert!(ImageRef::parse(&d[..d.len() - 1]).is_err());
    }
}
