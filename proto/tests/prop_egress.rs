//! Property tests of the egress policy (`networkPolicy`) parser and its
//! PATCH/DELETE merges: the lifecycle parses what clients send, the
//! controller stores the normal form, the agent enforces it. Never a panic;
//! what is accepted is in a normal form that re-parses to the same policy;
//! the merges keep the effective default.

use proptest::prelude::*;
use sandbolt_proto::egress::{
    Action, MAX_RULES, NetworkPolicy, NetworkRule, Target, normalize_target, target,
};

fn action_word() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("allow".to_string()),
        Just("deny".to_string()),
        Just(" DENY ".to_string()),
        Just("Allow".to_string()),
        "[a-z]{0,6}",
    ]
}

/// Targets as clients write them: names, wildcards, addresses, CIDRs, in
/// any case and with trailing dots, plus near misses.
fn target_text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9_-]{1,12}(\\.[a-zA-Z0-9_-]{1,12}){0,3}\\.?",
        "\\*\\.[a-zA-Z0-9-]{1,12}(\\.[a-zA-Z0-9-]{1,8}){0,2}",
        (any::<[u8; 4]>(), proptest::option::of(0u8..40)).prop_map(|(a, p)| {
            let addr = std::net::Ipv4Addr::from(a);
            match p {
                Some(p) => format!("{addr}/{p}"),
                None => addr.to_string(),
            }
        }),
        "[ -~]{0,20}",
        any::<String>(),
    ]
}

fn rule_json() -> impl Strategy<Value = serde_json::Value> {
    (action_word(), target_text()).prop_map(|(a, t)| serde_json::json!({"action": a, "target": t}))
}

fn policy_json() -> impl Strategy<Value = String> {
    (
        proptest::option::of(action_word()),
        proptest::option::of(proptest::collection::vec(rule_json(), 0..6)),
    )
        .prop_map(|(d, rules)| {
            let mut m = serde_json::Map::new();
            if let Some(d) = d {
                m.insert("defaultAction".into(), d.into());
            }
            if let Some(r) = rules {
                m.insert("egress".into(), r.into());
            }
            serde_json::Value::Object(m).to_string()
        })
}

fn valid_rule() -> impl Strategy<Value = NetworkRule> {
    (
        prop_oneof![Just(Action::Allow), Just(Action::Deny)],
        target_text(),
    )
        .prop_filter_map("a valid target", |(action, t)| {
            normalize_target(&t, "t")
                .ok()
                .map(|_| NetworkRule { action, target: t })
        })
}

fn valid_policy() -> impl Strategy<Value = NetworkPolicy> {
    (
        proptest::option::of(prop_oneof![Just(Action::Allow), Just(Action::Deny)]),
        proptest::collection::vec(valid_rule(), 0..6),
    )
        .prop_map(|(d, rules)| NetworkPolicy::from_parts(d, rules).unwrap())
}

fn names() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec("[a-zA-Z0-9-]{1,8}(\\.[a-zA-Z0-9-]{1,8}){0,3}\\.?", 1..6)
}

/// The normal-form invariants of an accepted policy.
fn check_accepted(p: &NetworkPolicy, probes: &[String]) -> Result<(), TestCaseError> {
    prop_assert!(p.egress.len() <= MAX_RULES);
    for r in &p.egress {
        // Stored targets are already normal.
        prop_assert_eq!(normalize_target(&r.target, "t"), Ok(r.target.clone()));
        if let Target::Net(addr, prefix) = target(&r.target) {
            prop_assert!(prefix <= 32);
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - prefix)
            };
            prop_assert_eq!(u32::from(addr) & mask, u32::from(addr));
        }
    }
    // What the record keeps re-parses to the same verdicts.
    let json = p.to_json();
    let back =
        NetworkPolicy::parse(&json).map_err(|e| TestCaseError::fail(format!("{json}: {e}")))?;
    prop_assert_eq!(&back.to_json(), &json);
    prop_assert_eq!(back.effective_default(), p.effective_default());
    prop_assert_eq!(&back.egress, &p.egress);
    for name in probes {
        let v = p.verdict_for_name(name);
        prop_assert_eq!(back.verdict_for_name(name), v);
        // Names match case-insensitively, with or without the root dot.
        prop_assert_eq!(p.verdict_for_name(&name.to_ascii_uppercase()), v);
        prop_assert_eq!(
            p.verdict_for_name(&format!("{}.", name.trim_end_matches('.'))),
            v
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn never_panics_on_arbitrary_text(s in any::<String>()) {
        if let Ok(p) = NetworkPolicy::parse(&s) {
            check_accepted(&p, &[])?;
        }
    }

    #[test]
    fn policy_shaped_json_is_refused_or_normal(json in policy_json(), probes in names()) {
        match NetworkPolicy::parse(&json) {
            Ok(p) => check_accepted(&p, &probes)?,
            // Errors name the field under networkPolicy.
            Err(e) => prop_assert!(e.to_string().contains("networkPolicy"), "{}", e),
        }
    }

    #[test]
    fn normalizing_a_target_is_idempotent(t in target_text()) {
        if let Ok(n) = normalize_target(&t, "f") {
            prop_assert_eq!(normalize_target(&n, "f"), Ok(n.clone()));
            prop_assert_eq!(normalize_target(&t.to_ascii_uppercase(), "f"), Ok(n));
        }
    }

    #[test]
    fn wildcards_match_strictly_below_their_suffix(suffix in "[a-z0-9]{1,8}\\.[a-z]{2,4}", head in "[a-z0-9]{1,8}") {
        let p = NetworkPolicy::parse(&format!(
            r#"{{"defaultAction":"allow","egress":[{{"action":"deny","target":"*.{suffix}"}}]}}"#
        )).unwrap();
        prop_assert_eq!(p.verdict_for_name(&suffix), Action::Allow);
        prop_assert_eq!(p.verdict_for_name(&format!("{head}.{suffix}")), Action::Deny);
        prop_assert_eq!(p.verdict_for_name(&format!("{head}{suffix}")), Action::Allow);
    }

    #[test]
    fn patch_and_delete_keep_the_default_and_stay_normal(
        p in valid_policy(),
        incoming in proptest::collection::vec(valid_rule(), 0..6),
        probes in names(),
    ) {
        let patched = p.patch(incoming.clone()).unwrap();
        prop_assert_eq!(patched.effective_default(), p.effective_default());
        check_accepted(&patched, &probes)?;
        // The first incoming rule per target is the one in force.
        let mut seen = std::collections::HashSet::new();
        for r in &incoming {
            let t = normalize_target(&r.target, "t").unwrap();
            if seen.insert(t.clone()) {
                let kept: Vec<_> = patched.egress.iter().filter(|x| x.target == t).collect();
                prop_assert_eq!(kept.len(), 1);
                prop_assert_eq!(kept[0].action, r.action);
            }
        }
        let targets: Vec<String> = incoming.iter().map(|r| r.target.to_ascii_uppercase()).collect();
        let deleted = patched.delete(&targets);
        prop_assert_eq!(deleted.effective_default(), p.effective_default());
        for t in &seen {
            prop_assert!(deleted.egress.iter().all(|r| &r.target != t));
        }
        prop_assert_eq!(deleted.delete(&targets), deleted.clone());
        check_accepted(&deleted, &probes)?;
    }
}
