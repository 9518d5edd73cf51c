//! Kubernetes quantities ("500m", "2", "512Mi", "1G", "1e9"), as OpenSandbox
//! and FastPath carry CPU and memory. One parser for every component: the
//! lifecycle validates with it, the controller compares against pool maxima
//! with it, the agent turns the result into cgroup values. Two parsers that
//! disagree on `1Ei` or `500n` would let a request pass one check and fail
//! (or worse, pass) the next.

/// Errors from parsing OpenSandbox/Kubernetes quantities.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantityError {
    #[error("{what} quantity is empty")]
    Empty { what: &'static str },
    #[error("{what} quantity {input:?} is not a Kubernetes quantity: {reason}")]
    Invalid {
        what: &'static str,
        input: String,
        reason: &'static str,
    },
    #[error("{what} quantity {input:?} is negative")]
    Negative { what: &'static str, input: String },
    #[error("{what} quantity {input:?} is zero; a zero limit would stop the sandbox from running")]
    Zero { what: &'static str, input: String },
    #[error("{what} quantity {input:?} is too large")]
    Overflow { what: &'static str, input: String },
}

/// A Kubernetes quantity, exactly: `mantissa × 10^exp10 × 2^exp2`.
#[derive(Debug, PartialEq, Eq)]
struct Quantity {
    mantissa: u128,
    exp10: i32,
    exp2: u32,
}

impl Quantity {
    /// Grammar (Kubernetes `resource.Quantity`): optional `+`, digits with
    /// at most one `.` (at least one digit), then one suffix: binary SI
    /// (`Ki Mi Gi Ti Pi Ei`), decimal SI (`n u m k M G T P E`), or a decimal
    /// exponent (`e`/`E` followed by an optionally signed integer).
    fn parse(what: &'static str, input: &str) -> Result<Quantity, QuantityError> {
        let invalid = |reason| QuantityError::Invalid {
            what,
            input: input.to_string(),
            reason,
        };
        if input.is_empty() {
            return Err(QuantityError::Empty { what });
        }
        let (negative, body) = match input.as_bytes()[0] {
            b'-' => (true, &input[1..]),
            b'+' => (false, &input[1..]),
            _ => (false, input),
        };
        let num_len = body
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(body.len());
        let (number, suffix) = body.split_at(num_len);
        let (int_part, frac_part) = match number.split_once('.') {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if frac_part.contains('.') {
            return Err(invalid("more than one decimal point"));
        }
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(invalid("no digits"));
        }
        let digits = format!("{int_part}{frac_part}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > 38 {
            return Err(QuantityError::Overflow {
                what,
                input: input.to_string(),
            });
        }
        let mantissa: u128 = if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| invalid("bad digits"))?
        };
        let frac_len = i32::try_from(frac_part.len()).map_err(|_| invalid("too many digits"))?;
        let (suffix_exp10, exp2) = match suffix {
            "" => (0, 0),
            "Ki" => (0, 10),
            "Mi" => (0, 20),
            "Gi" => (0, 30),
            "Ti" => (0, 40),
            "Pi" => (0, 50),
            "Ei" => (0, 60),
            "n" => (-9, 0),
            "u" => (-6, 0),
            "m" => (-3, 0),
            "k" => (3, 0),
            "M" => (6, 0),
            "G" => (9, 0),
            "T" => (12, 0),
            "P" => (15, 0),
            "E" => (18, 0),
            s if s.starts_with(['e', 'E']) => {
                let exp = &s[1..];
                let unsigned = exp.strip_prefix(['+', '-']).unwrap_or(exp);
                if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(invalid("bad exponent"));
                }
                // Larger exponents can only over- or underflow anyway.
                let e: i32 = exp.parse().map_err(|_| QuantityError::Overflow {
                    what,
                    input: input.to_string(),
                })?;
                if e.abs() > 1000 {
                    return Err(QuantityError::Overflow {
                        what,
                        input: input.to_string(),
                    });
                }
                (e, 0)
            }
            _ => {
                return Err(invalid(
                    "unknown suffix (expected one of n u m k M G T P E Ki Mi Gi Ti Pi Ei or an exponent)",
                ));
            }
        };
        if negative && mantissa != 0 {
            return Err(QuantityError::Negative {
                what,
                input: input.to_string(),
            });
        }
        Ok(Quantity {
            mantissa,
            exp10: suffix_exp10 - frac_len,
            exp2,
        })
    }

    /// `ceil(self × unit)` as an integer, or Overflow.
    fn scaled_ceil(
        &self,
        what: &'static str,
        input: &str,
        unit: u128,
    ) -> Result<u128, QuantityError> {
        let overflow = || QuantityError::Overflow {
            what,
            input: input.to_string(),
        };
        if self.mantissa == 0 {
            return Ok(0);
        }
        let mut num = self
            .mantissa
            .checked_mul(unit)
            .and_then(|n| n.checked_mul(1u128.checked_shl(self.exp2)?))
            .ok_or_else(overflow)?;
        if self.exp10 >= 0 {
            let scale = 10u128.checked_pow(self.exp10 as u32).ok_or_else(overflow)?;
            num = num.checked_mul(scale).ok_or_else(overflow)?;
            Ok(num)
        } else {
            match 10u128.checked_pow(self.exp10.unsigned_abs()) {
                Some(den) => Ok(num.div_ceil(den)),
                // The divisor exceeds any u128 numerator: a positive value
                // below one unit, which rounds up to one.
                None => Ok(1),
            }
        }
    }
}

/// A CPU quantity in millicores, rounded up (as Kubernetes does): `"500m"`
/// is 500, `"2"` is 2000, `"0.0001"` is 1. Zero is refused: a zero limit
/// would stop the sandbox from running.
pub fn millicores(s: &str) -> Result<u64, QuantityError> {
    const WHAT: &str = "cpu";
    let q = Quantity::parse(WHAT, s)?;
    let m = q.scaled_ceil(WHAT, s, 1000)?;
    if m == 0 {
        return Err(QuantityError::Zero {
            what: WHAT,
            input: s.to_string(),
        });
    }
    u64::try_from(m).map_err(|_| QuantityError::Overflow {
        what: WHAT,
        input: s.to_string(),
    })
}

/// A memory quantity in bytes, a fractional byte rounded up. Zero is refused;
/// anything beyond `i64::MAX` (what a cgroup file takes) is an overflow.
pub fn bytes(s: &str) -> Result<u64, QuantityError> {
    const WHAT: &str = "memory";
    let q = Quantity::parse(WHAT, s)?;
    let b = q.scaled_ceil(WHAT, s, 1)?;
    if b == 0 {
        return Err(QuantityError::Zero {
            what: WHAT,
            input: s.to_string(),
        });
    }
    i64::try_from(b)
        .map(|b| b as u64)
        .map_err(|_| QuantityError::Overflow {
            what: WHAT,
            input: s.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cases_two_old_parsers_disagreed_on() {
        // `1Ei` is 2^60 bytes (fits an i64); `500n` CPU rounds up to 1m;
        // `1K` is not a Kubernetes suffix (only lower-case `k` is).
        assert_eq!(bytes("1Ei").unwrap(), 1u64 << 60);
        assert_eq!(millicores("500n").unwrap(), 1);
        assert!(matches!(bytes("1K"), Err(QuantityError::Invalid { .. })));
        assert_eq!(bytes("1k").unwrap(), 1000);
        assert!(matches!(bytes("8Ei"), Err(QuantityError::Overflow { .. })));
    }

    #[test]
    fn zero_and_negative_are_refused() {
        assert!(matches!(millicores("0"), Err(QuantityError::Zero { .. })));
        assert!(matches!(bytes("-1Mi"), Err(QuantityError::Negative { .. })));
        assert!(matches!(bytes(""), Err(QuantityError::Empty { .. })));
    }
}
