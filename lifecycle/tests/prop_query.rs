//! Property tests of the lifecycle's query-string parsing: the form
//! decoder every route uses, the list query (state, metadata filter,
//! pagination), the snapshot list query and the pager. Never a panic; a
//! refusal is a 400; what a client encodes is what the server reads.

use std::collections::BTreeMap;

use proptest::prelude::*;
use sandbolt_lifecycle::api::{form_decode, paginate, parse_list_query};
use sandbolt_lifecycle::snapshots::parse_query;

/// `application/x-www-form-urlencoded` as a browser or the SDK writes it.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'*' => {
                out.push(b as char)
            }
            b' ' => out.push('+'),
            b => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The WHATWG form decoder, as the reference: `+` is a space, `%` and two
/// hex digits is a byte, any other `%` stays as it is.
fn reference_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit) =>
            {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Query text near the grammar: pairs, escapes (good and bad), `+`.
const QUERY_LIKE: &str = "([a-zA-Z]{0,8}(=[a-zA-Z0-9%+=&.-]{0,16})?&?){0,6}";

fn refusal_is_a_client_error(e: &sandbolt_lifecycle::ApiError) -> Result<(), TestCaseError> {
    prop_assert_eq!(e.status.as_u16(), 400, "{}: {}", e.code, e.message);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn decoding_inverts_encoding(pairs in proptest::collection::vec((any::<String>(), any::<String>()), 0..5)) {
        let q = pairs
            .iter()
            .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        // Every pair is written with its `=`, so none is an empty segment.
        prop_assert_eq!(form_decode(&q), pairs);
    }

    #[test]
    fn decoding_agrees_with_the_reference(s in "[a-zA-Z0-9%+=&. \u{e9}-]{0,24}") {
        let got = form_decode(&s);
        let want: Vec<(String, String)> = s
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (reference_decode(k), reference_decode(v))
            })
            .collect();
        prop_assert_eq!(got, want, "{:?}", s);
    }

    #[test]
    fn list_queries_never_panic_and_stay_in_bounds(s in prop_oneof![any::<String>(), QUERY_LIKE.prop_map(|s| s)]) {
        match parse_list_query(&s) {
            Ok(q) => {
                prop_assert!(q.page >= 1);
                prop_assert!((1..=200).contains(&q.page_size));
            }
            Err(e) => refusal_is_a_client_error(&e)?,
        }
        match parse_query(&s) {
            Ok(q) => {
                prop_assert!(q.page >= 1);
                prop_assert!((1..=200).contains(&q.page_size));
            }
            Err(e) => refusal_is_a_client_error(&e)?,
        }
    }

    /// The SDK sends `metadata=<urlencoded "k=v&k2=v2">`: the filter read
    /// back is the map it encoded, states and pages alongside.
    #[test]
    fn metadata_filters_round_trip(
        meta in proptest::collection::btree_map("[^=&]{1,8}", "[^&]{0,8}", 0..4),
        states in proptest::collection::vec("[A-Za-z]{1,8}", 0..3),
        page in 1u32..1000,
        size in 1u32..=200,
    ) {
        let inner = meta
            .iter()
            .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let mut q = format!("metadata={}&page={page}&pageSize={size}", encode(&inner));
        for s in &states {
            q.push_str(&format!("&state={}", encode(s)));
        }
        let got = parse_list_query(&q).map_err(|e| TestCaseError::fail(e.message))?;
        prop_assert_eq!(got.metadata, meta.into_iter().collect::<BTreeMap<_, _>>());
        prop_assert_eq!(got.states, states);
        prop_assert_eq!((got.page, got.page_size), (page, size));
    }

    #[test]
    fn out_of_range_pages_are_refused(page in prop_oneof![Just("0".to_string()), "-[0-9]{1,5}", "[1-9][0-9]{10,13}", "[a-z]{1,3}"], size in prop_oneof![Just("0".to_string()), "20[1-9]", "[1-9][0-9]{3,8}", "x"]) {
        let e = parse_list_query(&format!("page={page}")).unwrap_err();
        refusal_is_a_client_error(&e)?;
        let e = parse_list_query(&format!("pageSize={size}")).unwrap_err();
        refusal_is_a_client_error(&e)?;
        let e = parse_query(&format!("pageSize={size}")).unwrap_err();
        refusal_is_a_client_error(&e)?;
    }

    /// Walking the pages yields every item once, in order.
    #[test]
    fn pages_partition_the_list(n in 0usize..300, size in 1u32..=200) {
        let all: Vec<usize> = (0..n).collect();
        let mut seen = Vec::new();
        let mut page = 1;
        loop {
            let (items, info) = paginate(all.clone(), page, size);
            prop_assert!(items.len() <= size as usize);
            prop_assert_eq!(info.total_items, n as u64);
            prop_assert_eq!(info.total_pages, (n as u64).div_ceil(u64::from(size)));
            seen.extend(items);
            if !info.has_next_page {
                break;
            }
            page += 1;
        }
        prop_assert_eq!(seen, all);
        // A page past the end is empty, not an error.
        let (items, _) = paginate((0..n).collect::<Vec<_>>(), u32::MAX, size);
        prop_assert!(items.is_empty());
    }
}
