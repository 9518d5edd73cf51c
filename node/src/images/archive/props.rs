//! Property tests of the image archive's first pass (`sandbolt image
//! import` reads archives from anywhere): whatever names its entries carry
//! (`..`, absolute, long, control characters), the pass never panics, every
//! path it keeps is normal and inside the archive's root, distinct paths
//! stay distinct, and links never lead out of the archive.

use std::sync::Arc;

use proptest::prelude::*;

use super::{NoProgress, normalize_path, scan};

/// Entry names as a hostile archive could spell them.
fn entry_name() -> impl Strategy<Value = Vec<u8>> {
    let part = prop_oneof![
        Just(String::new()),
        Just(".".to_string()),
        Just("..".to_string()),
        Just("blobs".to_string()),
        Just("sha256".to_string()),
        "[a-z0-9._-]{1,8}",
        "[a-z]{90,130}",
        "[\u{1}-\u{1f}a-z]{1,4}",
    ];
    (any::<bool>(), proptest::collection::vec(part, 1..5))
        .prop_map(|(abs, parts)| {
            format!("{}{}", if abs { "/" } else { "" }, parts.join("/")).into_bytes()
        })
        .prop_filter("tar names are NUL-terminated", |n| {
            !n.is_empty() && !n.contains(&0)
        })
}

/// A GNU long-name record then a header: any bytes as the entry's name.
fn append(
    b: &mut tar::Builder<Vec<u8>>,
    name: &[u8],
    kind: tar::EntryType,
    link: &[u8],
    data: &[u8],
) {
    let mut long = tar::Header::new_gnu();
    long.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
    long.set_entry_type(tar::EntryType::GNULongName);
    long.set_mode(0o644);
    long.set_size(name.len() as u64 + 1);
    long.set_cksum();
    let mut n = name.to_vec();
    n.push(0);
    b.append(&long, &n[..]).unwrap();
    if !link.is_empty() {
        let mut ll = long.clone();
        ll.set_entry_type(tar::EntryType::GNULongLink);
        ll.set_size(link.len() as u64 + 1);
        ll.set_cksum();
        let mut l = link.to_vec();
        l.push(0);
        b.append(&ll, &l[..]).unwrap();
    }
    let mut h = tar::Header::new_gnu();
    h.as_gnu_mut().unwrap().name[..5].copy_from_slice(b"dummy");
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    h.set_cksum();
    b.append(&h, data).unwrap();
}

fn is_normal_relative(p: &str) -> bool {
    p.is_empty()
        || (!p.starts_with('/') && p.split('/').all(|c| !c.is_empty() && c != "." && c != ".."))
}

#[derive(Debug, Clone)]
enum Kind {
    File(Vec<u8>),
    Symlink(Vec<u8>),
    HardLink(Vec<u8>),
    Dir,
}

fn entry() -> impl Strategy<Value = (Vec<u8>, Kind)> {
    let kind = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..32).prop_map(Kind::File),
        Just(Kind::File(b"{\"a\":1}".to_vec())),
        entry_name().prop_map(Kind::Symlink),
        entry_name().prop_map(Kind::HardLink),
        Just(Kind::Dir),
    ];
    (entry_name(), kind)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn normalized_paths_never_leave_the_root(name in entry_name()) {
        let name = String::from_utf8_lossy(&name).into_owned();
        let n = normalize_path(&name);
        prop_assert!(is_normal_relative(&n), "{:?} -> {:?}", name, n);
        prop_assert_eq!(normalize_path(&n), n.clone());
    }

    #[test]
    fn scanning_any_names_keeps_paths_normal_and_distinct(entries in proptest::collection::vec(entry(), 1..8)) {
        let mut b = tar::Builder::new(Vec::new());
        for (name, kind) in &entries {
            match kind {
                Kind::File(data) => append(&mut b, name, tar::EntryType::Regular, b"", data),
                Kind::Symlink(t) => append(&mut b, name, tar::EntryType::Symlink, t, b""),
                Kind::HardLink(t) => append(&mut b, name, tar::EntryType::Link, t, b""),
                Kind::Dir => append(&mut b, name, tar::EntryType::Directory, b"", b""),
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        std::fs::write(&path, b.into_inner().unwrap()).unwrap();
        let s = match scan(&path, Arc::new(NoProgress)) {
            Ok(s) => s,
            // A refusal must fit on one line (it is shown to a person).
            Err(e) => {
                prop_assert!(!e.to_string().contains('\n'), "{}", e);
                return Ok(());
            }
        };
        for (key, target) in &s.links {
            prop_assert!(is_normal_relative(key), "link {:?}", key);
            prop_assert!(is_normal_relative(target), "link target {:?}", target);
        }
        // The last regular file under each normalized name is the one kept,
        // under exactly that name: names are neither merged nor cut.
        let mut want = std::collections::HashMap::new();
        for (name, kind) in &entries {
            let key = normalize_path(&String::from_utf8_lossy(name));
            match kind {
                Kind::File(data) => {
                    want.insert(key, Some(data.len() as u64));
                }
                Kind::Symlink(_) | Kind::HardLink(_) => {
                    want.insert(key, None);
                }
                Kind::Dir => {}
            }
        }
        let files: std::collections::HashMap<_, _> =
            s.files.iter().map(|(k, f)| (k.clone(), f.size)).collect();
        let want: std::collections::HashMap<_, _> =
            want.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect();
        prop_assert_eq!(files, want);
        for key in s.files.keys().chain(s.links.keys()) {
            prop_assert!(is_normal_relative(key), "{:?}", key);
            // Following links ends on a kept file or nowhere.
            if let Some(r) = s.resolve(key) {
                prop_assert!(s.files.contains_key(&r));
            }
        }
    }
}
