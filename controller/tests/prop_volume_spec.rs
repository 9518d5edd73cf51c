//! Property tests of the controller's volume spec checks (host and named
//! volumes of a create, from the native API, FastPath or the lifecycle):
//! what it accepts is in normal form, so that the path it checked (against
//! `/`, the reserved mounts, the other mounts) is the path the agent mounts.

use proptest::prelude::*;
use sandbolt_controller::limits::check_all_volumes;
use sandbolt_controller::store::{HostVolume, PvcVolume};

/// Paths as clients write them: `.`, `..`, empty components, reserved
/// prefixes, trailing slashes.
fn path_text() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just(String::new()),
        Just(".".to_string()),
        Just("..".to_string()),
        Just("proc".to_string()),
        Just("run".to_string()),
        Just("opt".to_string()),
        Just("sandbolt".to_string()),
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

/// `.`/`..` resolved and `//` folded, as the kernel reads the path.
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

fn host() -> impl Strategy<Value = HostVolume> {
    (
        path_text(),
        path_text(),
        prop_oneof![Just(String::new()), path_text()],
    )
        .prop_map(|(host_path, mount_path, sub_path)| HostVolume {
            name: "data".into(),
            host_path,
            sub_path,
            mount_path,
            read_only: false,
        })
}

fn named() -> impl Strategy<Value = PvcVolume> {
    (
        path_text(),
        prop_oneof![Just(String::new()), path_text()],
        "[a-z]{1,4}",
    )
        .prop_map(|(mount_path, sub_path, claim)| PvcVolume {
            name: format!("v-{claim}"),
            claim_name: claim,
            sub_path,
            mount_path,
            ..PvcVolume::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn accepted_volumes_are_in_normal_form(
        hosts in proptest::collection::vec(host(), 0..3),
        pvcs in proptest::collection::vec(named(), 0..3),
    ) {
        if let Err(e) = check_all_volumes(&hosts, &pvcs) {
            // A refusal is the caller's mistake and names the field.
            prop_assert!(e.to_string().contains("volumes["), "{}", e);
            return Ok(());
        }
        let mounts = hosts
            .iter()
            .map(|h| (&h.mount_path, &h.sub_path))
            .chain(pvcs.iter().map(|p| (&p.mount_path, &p.sub_path)));
        let mut seen = std::collections::HashSet::new();
        for (mount, sub) in mounts {
            prop_assert_eq!(&lexical(mount), mount, "mountPath not normal");
            prop_assert!(mount != "/");
            for r in ["/proc", "/sys", "/dev", "/opt/sandbolt", "/run"] {
                prop_assert!(mount != r && !mount.starts_with(&format!("{r}/")), "{} under {}", mount, r);
            }
            prop_assert!(seen.insert(mount.clone()), "{} twice", mount);
            if !sub.is_empty() {
                prop_assert!(
                    !sub.starts_with('/') && !sub.split('/').any(|c| c.is_empty() || c == "." || c == ".."),
                    "subPath {:?} not normal", sub
                );
            }
        }
        for h in &hosts {
            prop_assert_eq!(&lexical(&h.host_path), &h.host_path, "host path not normal");
        }
    }
}
