//! JSON numbers held to what a double holds. llguidance's lexeme for a JSON number (a
//! `"type": "number"` without bounds) has no limit on its digits, so a model that keeps writing
//! zeros runs to its token limit inside one number (`1234567890000000…`); JSON Schema has no
//! keyword that limits a number's digits. [`NumberGuard`] follows the text a JSON grammar has
//! produced and forbids the tokens that would carry the number being written past
//! [`MAX_INT_DIGITS`] integer digits, [`MAX_FRACTION_DIGITS`] fraction digits,
//! [`MAX_EXPONENT_DIGITS`] exponent digits, or past the largest finite double. Every double
//! (and every 64-bit integer) can be written within these bounds.

/// Most digits before a JSON number's point: every 64-bit integer has at most 20.
pub(crate) const MAX_INT_DIGITS: usize = 20;
/// Most digits after the point: a double's 17 significant digits, and 3 leading zeros.
pub(crate) const MAX_FRACTION_DIGITS: usize = 20;
/// Most exponent digits: a double's exponent is within ±324.
pub(crate) const MAX_EXPONENT_DIGITS: usize = 3;
/// Longest number literal kept: longer than any within the bounds (a grammar that demands more
/// digits is followed, see [`NumberGuard::restrict`], but only this much of the text is kept).
const MAX_LITERAL: usize = 64;

/// Whether `b` can be part of a JSON number.
fn is_number_byte(b: u8) -> bool {
    b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-')
}

/// Whether `b`, the last byte outside a string, lets a number start after it (a value's start:
/// after `:`, `,`, `[`, whitespace, or at the text's start). Digits after a letter (a name such
/// as `v2` around a tool call's JSON) start none.
fn starts_value(prev: Option<u8>) -> bool {
    match prev {
        None => true,
        Some(b) => matches!(b, b':' | b',' | b'[') || b.is_ascii_whitespace(),
    }
}

/// Whether `text`, a JSON number or a prefix of one, stays within the bounds: at most
/// [`MAX_INT_DIGITS`], [`MAX_FRACTION_DIGITS`] and [`MAX_EXPONENT_DIGITS`] digits, and, when it
/// is a whole number, finite as a double. Text that is no number prefix at all (`1-`) is within
/// them: refusing it is the grammar's part.
pub(crate) fn within_bounds(text: &[u8]) -> bool {
    let digits = |i: &mut usize| {
        let start = *i;
        while text.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i - start
    };
    let mut i = usize::from(text.first() == Some(&b'-'));
    if digits(&mut i) > MAX_INT_DIGITS {
        return false;
    }
    if text.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) > MAX_FRACTION_DIGITS {
            return false;
        }
    }
    if matches!(text.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(text.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) > MAX_EXPONENT_DIGITS {
            return false;
        }
    }
    if i < text.len() {
        return true;
    }
    // A prefix that does not parse yet (`-`, `1.`, `1e+`) can still end within the bounds.
    std::str::from_utf8(text)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .is_none_or(f64::is_finite)
}

/// The JSON text a grammar has produced so far, as far as numbers go: whether it is inside a
/// string, and the number being written.
#[derive(Clone, Debug, Default)]
pub(crate) struct NumberGuard {
    in_string: bool,
    escaped: bool,
    /// The last byte outside a string.
    prev: Option<u8>,
    /// The number being written (empty outside one), at most [`MAX_LITERAL`] bytes.
    literal: Vec<u8>,
    /// `literal` and a token's number bytes, for the checks (reused).
    scratch: Vec<u8>,
}

impl NumberGuard {
    /// Follows `bytes`, the text of a committed token (a special token's bytes start with
    /// 0xff: it ends any number and is no JSON).
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        if bytes.first() == Some(&0xff) {
            self.literal.clear();
            self.prev = Some(b' ');
            return;
        }
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                self.prev = Some(b);
                continue;
            }
            if is_number_byte(b) && (!self.literal.is_empty() || starts_value(self.prev)) {
                if self.literal.len() < MAX_LITERAL {
                    self.literal.push(b);
                }
            } else {
                self.literal.clear();
                self.in_string = b == b'"';
            }
            self.prev = Some(b);
        }
    }

    /// Whether a token whose text is `bytes` may come next: false only when it carries the
    /// number being written past the bounds.
    pub(crate) fn allows(&mut self, bytes: &[u8]) -> bool {
        if self.literal.is_empty() || bytes.first() == Some(&0xff) {
            return true;
        }
        let run = bytes.iter().take_while(|&&b| is_number_byte(b)).count();
        if run == 0 {
            return true;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.literal);
        self.scratch.extend_from_slice(&bytes[..run]);
        within_bounds(&self.scratch)
    }

    /// Whether a number is being written (and [`allows`](Self::allows) may refuse a token).
    pub(crate) fn in_number(&self) -> bool {
        !self.literal.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_take_every_double_and_64_bit_integer() {
        for v in [
            f64::MAX,
            f64::MIN_POSITIVE,
            -f64::MAX,
            5e-324,
            0.1,
            1.0 / 3.0,
            123456.789e10,
        ] {
            for text in [format!("{v:e}"), format!("{v:?}")] {
                assert!(within_bounds(text.as_bytes()), "{text}");
            }
        }
        for text in [i64::MIN.to_string(), u64::MAX.to_string(), "-0.0".into()] {
            assert!(within_bounds(text.as_bytes()), "{text}");
        }
        // Prefixes that are no number yet.
        for text in ["-", "1.", "1e", "1e-", "2E+"] {
            assert!(within_bounds(text.as_bytes()), "{text}");
        }
    }

    #[test]
    fn bounds_refuse_runaway_digits_and_infinities() {
        for text in [
            "1".repeat(MAX_INT_DIGITS + 1),
            format!("0.{}", "0".repeat(MAX_FRACTION_DIGITS + 1)),
            "1e0001".into(),
            "2e308".into(),
            "-1.8e308".into(),
        ] {
            assert!(!within_bounds(text.as_bytes()), "{text}");
        }
        assert!(within_bounds(b"1.7e308"));
    }

    #[test]
    fn the_guard_follows_strings_escapes_and_value_starts() {
        let mut g = NumberGuard::default();
        g.push(br#"{"id": "12345678901234567890"#);
        assert!(!g.in_number(), "digits in a string are no number");
        g.push(br#"\"123", "n": 1"#);
        assert!(g.in_number(), "an escaped quote does not end the string");
        assert!(g.allows(b"2345"));
        g.push(&b"9".repeat(MAX_INT_DIGITS - 1));
        assert!(!g.allows(b"0}"), "a 21st integer digit");
        assert!(g.allows(b"}"), "ending the number");
        assert!(g.allows(b".5"));
        g.push(b"}");
        assert!(!g.in_number());
        let mut name = NumberGuard::default();
        name.push(b"<call v");
        name.push(b"2");
        assert!(!name.in_number(), "digits after a letter start no number");
        let mut special = NumberGuard::default();
        special.push(b"[1");
        assert!(special.in_number());
        special.push(b"\xff<|im_end|>");
        assert!(!special.in_number());
    }
}
