//! Property tests of the volume spec parser (`volumes` / `volumeBindings` of
//! a create, both OpenSandbox shapes): never a panic, never a 5xx, and what
//! is accepted is in normal form — a mount path that the runtime would
//! read differently from the check (`/./proc` is `/proc` to Docker) is
//! exactly how a reserved path slips past it.

use std::path::{Component, Path};

use proptest::prelude::*;
use sandbolt_lifecycle::volumes::{HostPathCheck, VolumeSource, parse_volumes};
use serde_json::{Value, json};

/// Paths as clients write them: absolute or not, with `.`, `..`, empty
/// components, reserved prefixes and trailing slashes.
fn path_text() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just(String::new()),
        Just(".".to_string()),
        Just("..".to_string()),
        Just("proc".to_string()),
        Just("dev".to_string()),
        Just("opt".to_string()),
        Just("sandbolt".to_string()),
        Just("sys".to_string()),
        "[a-z0-9._-]{1,6}",
    ];
    (
        any::<bool>(),
        proptest::collection::vec(part, 0..5),
        any::<bool>(),
    )
        .prop_map(|(absolute, parts, trailing)| {
            let mut s = parts.join("/");
            if absolute {
                s.insert(0, '/');
            }
            if trailing {
                s.push('/');
            }
            s
        })
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("data".to_string()),
        Just("v2".to_string()),
        "[a-zA-Z0-9-]{0,8}"
    ]
}

/// One 1.1.1-shape entry (`{name, mountPath, host|pvc|ossfs, ...}`).
fn spec_entry() -> impl Strategy<Value = Value> {
    let backend = prop_oneof![
        path_text().prop_map(|p| json!({"host": {"path": p}})),
        name().prop_map(|n| json!({"pvc": {"claimName": n}})),
        (name(), "[0-9]{1,3}(Mi|Gi|x)?")
            .prop_map(|(n, s)| json!({"pvc": {"claimName": n, "storage": s}})),
        Just(json!({"ossfs": {"bucket": "bucket", "endpoint": "e"}})),
        Just(json!({})),
    ];
    (
        name(),
        path_text(),
        proptest::option::of(path_text()),
        any::<bool>(),
        backend,
    )
        .prop_map(|(n, mount, sub, ro, backend)| {
            let mut v = json!({"name": n, "mountPath": mount, "readOnly": ro});
            if let Some(sub) = sub {
                v["subPath"] = sub.into();
            }
            for (k, val) in backend.as_object().unwrap() {
                v[k] = val.clone();
            }
            v
        })
}

/// The seed shape: declared volumes and the bindings that mount them.
fn seed_shape() -> impl Strategy<Value = (Vec<Value>, Vec<Value>)> {
    let vol = (
        name(),
        prop_oneof![Just("local"), Just("pvc"), Just("nfs"), Just("s3")],
        prop_oneof![
            path_text(),
            name(),
            "[a-z.]{1,8}:".prop_flat_map(|s| path_text().prop_map(move |p| format!("{s}{p}")))
        ],
    )
        .prop_map(|(n, t, r)| json!({"name": n, "backendType": t, "backendRef": r}));
    let binding = (
        name(),
        path_text(),
        prop_oneof![Just("RW"), Just("RO"), Just("rw")],
        proptest::option::of(path_text()),
    )
        .prop_map(|(n, m, a, s)| {
            let mut v = json!({"volumeName": n, "mountPath": m, "accessMode": a});
            if let Some(s) = s {
                v["subPath"] = s.into();
            }
            v
        });
    (
        proptest::collection::vec(vol, 0..3),
        proptest::collection::vec(binding, 0..3),
    )
}

/// `.`/`..` resolved and `//` folded, as a runtime would read the path.
fn lexical(p: &str) -> String {
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
    format!("/{}", out.join("/"))
}

/// What every accepted mount must satisfy, whatever the shape.
fn check_accepted(
    mounts: &[sandbolt_lifecycle::volumes::VolumeMount],
) -> Result<(), TestCaseError> {
    let mut seen = std::collections::BTreeSet::new();
    for m in mounts {
        let p = m.mount_path.as_str();
        // Normal form: what is checked is what is mounted.
        prop_assert_eq!(lexical(p), p, "mountPath {:?} accepted but not normal", p);
        prop_assert!(p != "/", "mountPath / accepted");
        for reserved in ["/proc", "/sys", "/dev", "/opt/sandbolt"] {
            let hit = p == reserved || p.starts_with(&format!("{reserved}/"));
            prop_assert!(!hit, "reserved mountPath {:?} accepted", p);
        }
        prop_assert!(seen.insert(p.to_string()), "mountPath {:?} twice", p);
        if let Some(sub) = &m.sub_path {
            prop_assert!(
                !sub.is_empty() && !sub.starts_with('/'),
                "subPath {:?}",
                sub
            );
            prop_assert!(
                Path::new(sub)
                    .components()
                    .all(|c| matches!(c, Component::Normal(_))),
                "subPath {:?} climbs or is not normal",
                sub
            );
            prop_assert!(
                !sub.split('/')
                    .any(|c| c.is_empty() || c == "." || c == "..")
            );
        }
        match &m.source {
            VolumeSource::Host { path } => {
                let s = path.to_str().unwrap();
                prop_assert_eq!(lexical(s), s, "host path {:?} accepted but not normal", s);
            }
            VolumeSource::Nfs { export, .. } => {
                prop_assert_eq!(lexical(export), export.as_str(), "nfs export {:?}", export);
            }
            _ => {}
        }
    }
    Ok(())
}

fn refusal_is_a_client_error(e: &sandbolt_lifecycle::ApiError) -> Result<(), TestCaseError> {
    prop_assert_eq!(e.status.as_u16(), 400, "{}: {}", e.code, e.message);
    prop_assert!(e.code.starts_with("VOLUME::"), "{}", e.code);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn spec_shape_volumes_are_refused_or_normal(entries in proptest::collection::vec(spec_entry(), 0..4)) {
        match parse_volumes(Some(&entries), None, &HostPathCheck::OnNode) {
            Ok(mounts) => check_accepted(&mounts)?,
            Err(e) => refusal_is_a_client_error(&e)?,
        }
    }

    #[test]
    fn seed_shape_volumes_are_refused_or_normal((vols, binds) in seed_shape()) {
        match parse_volumes(Some(&vols), Some(&binds), &HostPathCheck::OnNode) {
            Ok(mounts) => check_accepted(&mounts)?,
            Err(e) => refusal_is_a_client_error(&e)?,
        }
    }

    #[test]
    fn arbitrary_json_entries_never_panic(entries in proptest::collection::vec(arbitrary_json(), 0..3)) {
        if let Ok(mounts) = parse_volumes(Some(&entries), Some(&entries), &HostPathCheck::OnNode) {
            check_accepted(&mounts)?;
        }
    }
}

proptest! {
    // Each case makes and removes a directory tree: fewer of them.
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// With the allowlist checked here (the Docker backend), an accepted
    /// host source is inside an allowed root on the real filesystem,
    /// whatever `subPath` says.
    #[test]
    fn local_host_paths_stay_inside_the_allowlist(mount in path_text(), sub in proptest::option::of(path_text()), rel in path_text()) {
        let root = tempfile::tempdir().unwrap();
        let allowed = root.path().join("allowed");
        std::fs::create_dir_all(allowed.join("a/b")).unwrap();
        std::fs::create_dir_all(root.path().join("outside")).unwrap();
        std::os::unix::fs::symlink("../outside", allowed.join("a/escape")).unwrap();
        let host = format!("{}{}", allowed.display(), rel);
        let mut v = json!({"name": "data", "mountPath": mount, "host": {"path": host}});
        if let Some(sub) = sub {
            v["subPath"] = sub.into();
        }
        let check = HostPathCheck::Local(vec![allowed.clone()]);
        match parse_volumes(Some(&[v]), None, &check) {
            Ok(mounts) => {
                check_accepted(&mounts)?;
                let VolumeSource::Host { path } = &mounts[0].source else { unreachable!() };
                let allowed = std::fs::canonicalize(&allowed).unwrap();
                prop_assert!(path.starts_with(&allowed), "{} escapes {}", path.display(), allowed.display());
                prop_assert!(path.is_dir());
            }
            Err(e) => refusal_is_a_client_error(&e)?,
        }
    }
}

/// Small arbitrary JSON values (objects with the volume keys or noise).
fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        path_text().prop_map(Value::from),
        any::<String>().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        let key = prop_oneof![
            Just("name".to_string()),
            Just("mountPath".to_string()),
            Just("subPath".to_string()),
            Just("host".to_string()),
            Just("path".to_string()),
            Just("pvc".to_string()),
            Just("claimName".to_string()),
            Just("backendType".to_string()),
            Just("backendRef".to_string()),
            Just("volumeName".to_string()),
            Just("accessMode".to_string()),
            "[a-zA-Z]{1,6}",
        ];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
            proptest::collection::btree_map(key, inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
