//! Property tests of every parser execd runs on what a client sends: request
//! paths, query strings, `Range` headers, API modes, replace patterns and
//! multipart uploads. Here rather than in tests/ because
//! execd's modules are private (it is a binary first).

use std::path::{Component, Path, PathBuf};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::routing::post;
use proptest::prelude::*;
use tower::ServiceExt;

use crate::extract::Query;
use crate::files::{self, parse_range, replace_all};
use crate::util::{MAX_PATH_LEN, mode_from_api, mode_to_api, normalize, resolve_path};

/// `.` and `..` resolved lexically, never above `/`: the reference.
fn lexical(p: &str) -> PathBuf {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    PathBuf::from(format!("/{}", out.join("/")))
}

fn is_normal_absolute(p: &Path) -> bool {
    let mut c = p.components();
    c.next() == Some(Component::RootDir) && c.all(|c| matches!(c, Component::Normal(_)))
}

/// Paths as clients write them: `.`, `..`, `~`, empty components.
fn path_text() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just(String::new()),
        Just(".".to_string()),
        Just("..".to_string()),
        Just("~".to_string()),
        "[a-z0-9 ._-]{1,6}",
        "\\PC{1,4}",
    ];
    (
        prop_oneof![Just(""), Just("/"), Just("~"), Just("~/"), Just("./")],
        proptest::collection::vec(part, 0..6),
    )
        .prop_map(|(head, parts)| format!("{head}{}", parts.join("/")))
}

/// One file name a filesystem takes: 1..=255 bytes, no `/` or NUL, not
/// `.` or `..`; often long and multi-byte.
fn file_name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9._-]{1,40}",
        "[^/\u{0}]{1,90}",
        "[\u{4e00}-\u{4e80}]{60,85}",
        "[a-z]{200,255}",
    ]
    .prop_map(|mut n| {
        while n.len() > 255 {
            n.pop();
        }
        n
    })
    .prop_filter("a real name", |n| n != "." && n != "..")
}

fn form_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            b' ' => out.push('+'),
            b => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn resolved_paths_are_absolute_and_normal(raw in prop_oneof![path_text(), any::<String>()]) {
        match resolve_path(&raw) {
            Ok(p) => {
                prop_assert!(is_normal_absolute(&p), "{:?} -> {:?}", raw, p);
                prop_assert_eq!(normalize(&p), p.clone());
                if raw.starts_with('/') {
                    // An absolute request means exactly its lexical form.
                    prop_assert_eq!(p, lexical(&raw));
                }
            }
            Err(e) => prop_assert_eq!(e.status, StatusCode::BAD_REQUEST),
        }
    }

    /// `~/rest` is below the home directory whatever `rest` is (as in a
    /// shell, `~//etc` is `$HOME/etc`, not `/etc`), unless `rest` climbs.
    #[test]
    fn home_paths_stay_below_home(rest in path_text()) {
        prop_assume!(!rest.split('/').any(|c| c == ".."));
        let home = lexical(&std::env::var("HOME").unwrap_or_else(|_| "/".into()));
        let p = resolve_path(&format!("~/{rest}")).unwrap();
        prop_assert!(p.starts_with(&home), "~/{} -> {:?} (home {:?})", rest, p, home);
    }

    #[test]
    fn overlong_paths_are_refused(extra in 1usize..64) {
        let raw = format!("/{}", "a".repeat(MAX_PATH_LEN + extra - 1));
        prop_assert!(resolve_path(&raw).is_err());
    }

    #[test]
    fn queries_decode_what_was_encoded(pairs in proptest::collection::vec((any::<String>(), any::<String>()), 0..5)) {
        let q = pairs
            .iter()
            .map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let parsed = Query::parse(Some(&q)).unwrap();
        prop_assert_eq!(parsed.0, pairs);
    }

    #[test]
    fn bad_escapes_are_refused_never_guessed(s in "[a-z=&%+0-9A-Fa-f]{0,20}") {
        // The reference: `%` and two hex digits is a byte, any other `%`
        // is refused, and the bytes must be UTF-8.
        let decode = |t: &str| -> Option<String> {
            let b = t.as_bytes();
            let mut out = Vec::new();
            let mut i = 0;
            while i < b.len() {
                match b[i] {
                    b'%' => {
                        let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                        if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
                            return None;
                        }
                        out.push(u8::from_str_radix(hex, 16).ok()?);
                        i += 3;
                    }
                    b'+' => {
                        out.push(b' ');
                        i += 1;
                    }
                    c => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            String::from_utf8(out).ok()
        };
        let want: Option<Vec<(String, String)>> = s
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                Some((decode(k)?, decode(v)?))
            })
            .collect();
        match Query::parse(Some(&s)) {
            Ok(q) => prop_assert_eq!(Some(q.0), want, "{:?}", s),
            Err(e) => {
                prop_assert_eq!(want, None, "{:?}", s);
                prop_assert_eq!(e.status, StatusCode::BAD_REQUEST);
            }
        }
    }

    #[test]
    fn ranges_stay_inside_the_file(h in prop_oneof![
        "bytes=[0-9]{0,4}-[0-9]{0,4}",
        " ?bytes= ?-?[0-9]{0,21} ?- ?[0-9+-]{0,21}",
        any::<String>(),
    ], size in prop_oneof![Just(0u64), 1u64..10_000, Just(u64::MAX)]) {
        if let Ok(Some((start, len))) = parse_range(&h, size) {
            prop_assert!(len >= 1, "{:?} size {}: empty window", h, size);
            prop_assert!(start.checked_add(len).is_some_and(|end| end <= size), "{:?} size {}: {}+{}", h, size, start, len);
        }
    }

    #[test]
    fn api_modes_round_trip(mode in 0u32..=0o7777, api in any::<i64>()) {
        prop_assert_eq!(mode_from_api(i64::from(mode_to_api(mode))).unwrap(), mode);
        if let Ok(m) = mode_from_api(api) {
            prop_assert!(m <= 0o7777);
            prop_assert_eq!(i64::from(mode_to_api(m)), api);
        }
    }

    #[test]
    fn replacing_matches_the_standard_library(hay in "[ab]{0,30}", old in "[ab]{0,3}", new in "[abc]{0,3}") {
        let (out, count) = replace_all(hay.as_bytes(), old.as_bytes(), new.as_bytes());
        if old.is_empty() {
            // Nothing to look for: nothing replaced (and no endless loop).
            prop_assert_eq!((out, count), (hay.clone().into_bytes(), 0));
        } else {
            prop_assert_eq!(String::from_utf8(out).unwrap(), hay.replace(&old, &new));
            prop_assert_eq!(count, hay.matches(&old).count());
        }
    }

}

// ---------------------------------------------------------------- multipart

const BOUNDARY: &str = "prop-boundary-7f3a";

fn upload_router() -> Router {
    Router::new().route("/files/upload", post(files::upload))
}

fn part(name: &str, filename: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut out =
        format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"").into_bytes();
    if let Some(f) = filename {
        out.extend_from_slice(format!("; filename=\"{f}\"").as_bytes());
    }
    out.extend_from_slice(b"\r\nContent-Type: application/octet-stream\r\n\r\n");
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n");
    out
}

fn post_upload(
    rt: &tokio::runtime::Runtime,
    body: Vec<u8>,
    content_type: &str,
) -> (StatusCode, String) {
    rt.block_on(async {
        let req = Request::post("/files/upload")
            .header(header::CONTENT_TYPE, content_type)
            .body(Body::from(body))
            .unwrap();
        let resp = upload_router().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// A well-formed upload of any file name and content, into a fresh
    /// directory, lands there byte for byte.
    #[test]
    fn uploads_land_byte_for_byte(
        dirs in proptest::collection::vec(file_name(), 0..3),
        name in file_name(),
        content in proptest::collection::vec(any::<u8>(), 0..4096),
        mode in proptest::option::of(prop_oneof![Just(644i64), Just(600), Just(755), Just(400)]),
    ) {
        let rt = runtime();
        let root = tempfile::tempdir().unwrap();
        let mut target = root.path().to_path_buf();
        for d in &dirs {
            target.push(d);
        }
        target.push(&name);
        let mut meta = serde_json::json!({"path": target.to_str().unwrap()});
        if let Some(m) = mode {
            meta["mode"] = m.into();
        }
        let mut body = part("metadata", Some("metadata"), meta.to_string().as_bytes());
        body.extend(part("file", Some("upload"), &content));
        body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
        let (status, text) = post_upload(&rt, body, &format!("multipart/form-data; boundary={BOUNDARY}"));
        prop_assert_eq!(status, StatusCode::OK, "{:?}: {}", target, text);
        prop_assert_eq!(std::fs::read(&target).unwrap(), content);
        if let Some(m) = mode {
            use std::os::unix::fs::PermissionsExt;
            let got = std::fs::metadata(&target).unwrap().permissions().mode() & 0o7777;
            prop_assert_eq!(got, mode_from_api(m).unwrap());
        }
        // No temporary sibling is left behind.
        let left: Vec<_> = std::fs::read_dir(target.parent().unwrap()).unwrap().collect();
        prop_assert_eq!(left.len(), 1);
    }

    /// Anything else is refused as the client's mistake: malformed bodies,
    /// unknown parts, parts out of order, bad metadata. Never a 5xx.
    #[test]
    fn malformed_uploads_are_client_errors(
        parts in proptest::collection::vec((
            prop_oneof![Just("metadata"), Just("file"), Just("other"), Just("")],
            prop_oneof![
                Just(b"{\"path\":\"REL\"}".to_vec()),
                Just(b"{\"path\":\"\"}".to_vec()),
                Just(b"{\"path\":\"REL\",\"mode\":789}".to_vec()),
                Just(b"{\"path\":\"REL\",\"owner\":\"no-such-user-x\"}".to_vec()),
                Just(b"{\"path\":\"REL/\"}".to_vec()),
                Just(b"[]".to_vec()),
                proptest::collection::vec(any::<u8>(), 0..64),
            ],
        ), 0..4),
        tail in prop_oneof![Just(b"--\r\n".to_vec()), Just(Vec::new()), proptest::collection::vec(any::<u8>(), 0..16)],
        noise in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..256)),
        content_type in prop_oneof![
            Just(format!("multipart/form-data; boundary={BOUNDARY}")),
            Just("multipart/form-data".to_string()),
            Just("application/json".to_string()),
        ],
    ) {
        let rt = runtime();
        let root = tempfile::tempdir().unwrap();
        let rel = root.path().join("f").to_str().unwrap().to_string();
        let body = match noise {
            Some(n) => n,
            None => {
                let mut body = Vec::new();
                for (name, data) in &parts {
                    let data = String::from_utf8_lossy(data).replace("REL", &rel).into_bytes();
                    body.extend(part(name, Some("x"), &data));
                }
                body.extend_from_slice(format!("--{BOUNDARY}").as_bytes());
                body.extend(tail);
                body
            }
        };
        let (status, text) = post_upload(&rt, body, &content_type);
        prop_assert!(!status.is_server_error(), "{}: {}", status, text);
        if status == StatusCode::OK {
            prop_assert!(root.path().join("f").is_file());
        } else {
            prop_assert_eq!(status.as_u16() / 100, 4, "{}: {}", status, text);
        }
    }
}
