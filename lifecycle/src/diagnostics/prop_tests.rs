//! Property tests of the diagnostics routes' query parsing (`logs`,
//! `events`, `summary`): never a panic, a refusal is a 400, and what is
//! accepted is within what the backends can use — a `since` the Docker
//! backend subtracts from the clock must fit its arithmetic.

use proptest::prelude::*;

use super::{
    MAX_EVENT_LIMIT, MAX_TAIL_LINES, parse_events_query, parse_logs_query, parse_since,
    parse_summary_query,
};

/// Query text near the routes' grammar.
fn query() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("tail"),
        Just("since"),
        Just("scope"),
        Just("container"),
        Just("limit"),
        Just("event_limit"),
        Just("x"),
    ];
    let value = prop_oneof![
        "[0-9]{0,22}[smhdx]?",
        "[+ -]?[0-9]{1,5}",
        "[a-z%+]{0,8}",
        any::<String>(),
    ];
    proptest::collection::vec((key, value), 0..4).prop_map(|pairs| {
        pairs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&")
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn diagnostics_queries_are_refused_or_in_bounds(q in prop_oneof![query(), any::<String>()]) {
        match parse_logs_query(&q) {
            Ok(l) => {
                prop_assert!(l.tail.is_none_or(|t| (1..=MAX_TAIL_LINES).contains(&t)));
                if let Some(since) = l.since {
                    prop_assert!(i64::try_from(since.as_secs()).is_ok(), "since {:?}", since);
                }
            }
            Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
        }
        match parse_events_query(&q) {
            Ok((_, limit)) => prop_assert!(limit.is_none_or(|l| (1..=MAX_EVENT_LIMIT).contains(&l))),
            Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
        }
        match parse_summary_query(&q) {
            Ok((tail, events)) => {
                prop_assert!((1..=MAX_TAIL_LINES).contains(&tail));
                prop_assert!((1..=MAX_EVENT_LIMIT).contains(&events));
            }
            Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
        }
    }

    /// A count and a unit is that many seconds; one the Docker backend
    /// cannot subtract from the clock (beyond i64 seconds) is refused, not
    /// left to overflow there.
    #[test]
    fn since_is_a_count_and_a_unit(count in any::<u64>(), unit in prop_oneof![Just(("s", 1u64)), Just(("m", 60)), Just(("h", 3600)), Just(("d", 86_400))]) {
        let got = parse_since(&format!("{count}{}", unit.0));
        match count.checked_mul(unit.1).filter(|s| i64::try_from(*s).is_ok()) {
            Some(secs) => prop_assert_eq!(got.unwrap().as_secs(), secs),
            None => prop_assert_eq!(got.unwrap_err().status.as_u16(), 400),
        }
    }
}
