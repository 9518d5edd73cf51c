//! Property tests of the one Kubernetes quantity parser (CPU and memory of
//! every request, pool maxima, volume sizes): it never panics, what it
//! accepts is positive and exact, and every spelling of one amount gives
//! the same number.

use proptest::prelude::*;
use sandbolt_proto::quantity::{QuantityError, bytes, millicores};

/// Quantity-shaped text: sign, digits and points, and a suffix or an
/// exponent, valid or not.
const QUANTITY_LIKE: &str = "[+-]?[0-9.]{0,24}([eE][+-]?[0-9]{0,6}|[numkKMGTPE]i?|[a-zA-Z ]{0,2})?";

fn check_any(s: &str) -> Result<(), TestCaseError> {
    for (what, result) in [("cpu", millicores(s)), ("memory", bytes(s))] {
        match result {
            Ok(v) => {
                prop_assert!(v > 0, "{} {:?} accepted as zero", what, s);
                if what == "memory" {
                    prop_assert!(i64::try_from(v).is_ok(), "{:?} beyond i64", s);
                }
            }
            Err(e) => {
                // Every refusal says what and names the input.
                let msg = e.to_string();
                prop_assert!(msg.starts_with(what), "{}", msg);
                if !matches!(e, QuantityError::Empty { .. }) {
                    prop_assert!(msg.contains(&format!("{s:?}")), "{}", msg);
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn never_panics_on_arbitrary_text(s in any::<String>()) {
        check_any(&s)?;
    }

    #[test]
    fn never_panics_on_quantity_like_text(s in QUANTITY_LIKE) {
        check_any(&s)?;
    }

    #[test]
    fn whole_numbers_are_exact(n in 1u64..=i64::MAX as u64) {
        prop_assert_eq!(bytes(&n.to_string()), Ok(n));
        prop_assert_eq!(bytes(&format!("+{n}")), Ok(n));
        prop_assert_eq!(millicores(&format!("{n}m")), Ok(n));
        match n.checked_mul(1000) {
            Some(m) => prop_assert_eq!(millicores(&n.to_string()), Ok(m)),
            None => {
                let overflow = matches!(millicores(&n.to_string()), Err(QuantityError::Overflow { .. }));
                prop_assert!(overflow);
            }
        }
    }

    #[test]
    fn beyond_i64_is_an_overflow_for_memory(n in (i64::MAX as u64 + 1)..=u64::MAX) {
        let overflow = matches!(bytes(&n.to_string()), Err(QuantityError::Overflow { .. }));
        prop_assert!(overflow);
    }

    #[test]
    fn every_spelling_of_an_amount_agrees(n in 1u64..1_000_000) {
        let b = |s: String| bytes(&s);
        prop_assert_eq!(b(format!("{n}k")), Ok(n * 1000));
        prop_assert_eq!(b(format!("{n}e3")), Ok(n * 1000));
        prop_assert_eq!(b(format!("{n}E+3")), Ok(n * 1000));
        prop_assert_eq!(b(format!("{n}000")), Ok(n * 1000));
        prop_assert_eq!(b(format!("{n}.000M")), Ok(n * 1_000_000));
        prop_assert_eq!(b(format!("{n}Ki")), Ok(n << 10));
        prop_assert_eq!(b(format!("{n}Mi")), Ok(n << 20));
        prop_assert_eq!(b(format!("000{n}Gi")), Ok(n << 30));
        prop_assert_eq!(millicores(&format!("{n}000u")), Ok(n));
        prop_assert_eq!(millicores(&format!("{n}e-3")), Ok(n));
        prop_assert_eq!(millicores(&format!("0.{n:06}k")), Ok(n));
    }

    #[test]
    fn fractions_round_up(whole in 0u64..1000, frac in 0u64..1_000_000) {
        // `whole.frac` (six decimals) cores is ceil(whole.frac × 1000) m.
        prop_assume!(whole > 0 || frac > 0);
        let s = format!("{whole}.{frac:06}");
        let want = whole * 1000 + frac.div_ceil(1000);
        prop_assert_eq!(millicores(&s), Ok(want));
        // And bytes: a fractional byte is one more byte.
        let want = whole + u64::from(frac > 0);
        prop_assert_eq!(bytes(&s), Ok(want));
    }

    #[test]
    fn zero_and_negative_amounts_are_refused(n in 0u64..u64::MAX, suffix in "(|m|k|Ki|Mi|e3)") {
        let zero = format!("0{suffix}");
        let refused_zero = matches!(bytes(&zero), Err(QuantityError::Zero { .. }));
        prop_assert!(refused_zero);
        let refused_zero = matches!(millicores(&format!("-0.0{suffix}")), Err(QuantityError::Zero { .. }));
        prop_assert!(refused_zero);
        prop_assume!(n > 0);
        let neg = format!("-{n}{suffix}");
        let refused = matches!(bytes(&neg), Err(QuantityError::Negative { .. }));
        prop_assert!(refused, "{}", neg);
    }
}
