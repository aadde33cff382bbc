//! The module-name pattern language of the seed (`module_name_match`; where we differ:
//! docs/seed.md), compiled once and matched many times.
//!
//! A pattern is a module name with three kinds of wildcard:
//! - `{*}` matches one or more decimal digits; `{a-b}` matches one or more digits whose value
//!   lies in `a..=b` (leading zeros allowed, e.g. `03`);
//! - `*` matches any run of characters (including dots and the empty run);
//! - `?` matches exactly one character.
//!
//! Everything else is literal, and the whole name must match. The exact behaviour is that of
//! the seed, which rewrites the pattern into a Python regular expression and applies it with
//! `re.match`; this module reproduces it without a regex engine:
//!
//! 1. Every brace group `\{([^}]*)\}` (leftmost first, not nested; an unbalanced `{` or a
//!    lone `}` is literal) is replaced *textually* by the placeholder `__NUM__` and records a
//!    spec: `*` is any number, `low-high` an inclusive range whose bounds follow Python
//!    `int()`; anything else is an error (comma lists such as `{1,2}` are not supported).
//! 2. The substituted text is scanned left to right: `__NUM__` becomes a digit capture
//!    `(\d+)`, `*` becomes `.*`, `?` becomes `.`, every other character is literal. Because the
//!    substitution is textual, a `__NUM__` typed by the user is a capture too, without a spec
//!    (the seed's quirk; it shifts the pairing of captures with specs).
//! 3. The expression is anchored `^…$` with Python semantics: `.` does not match `\n`, and `$`
//!    also matches just before a single trailing `\n`.
//! 4. After the first match found by Python's backtracking engine (leftmost-first, greedy),
//!    the captures are checked against the specs in order, pairwise (`zip`: the shorter list
//!    wins). There is no search for another split of the name that would satisfy the ranges:
//!    `*{0-3}` matches `layer12` (the greedy `*` leaves `2` to the group) but not `layer45`.
//!
//! Deliberate differences from the seed, both outside what module names contain:
//! - `\d` is ASCII `0-9` here; Python's `\d` (str patterns) also matches every Unicode decimal
//!   digit such as `٣`. Range bounds, which the seed parses with `int()`, do accept Unicode
//!   decimal digits and whitespace exactly as CPython 3.11's `int()` (Unicode 14.0).
//! - Numbers of any length are compared exactly (as digit strings). CPython refuses to convert
//!   strings of more than 4300 digits by default (`sys.set_int_max_str_digits`), which makes the
//!   seed report such a bound as "Non-integer in range" and raise on such a captured number.
//!
//! The matcher is a backtracking search over tokens that tries alternatives in exactly the
//! order Python's engine does, so the first success it finds is Python's first match and the
//! captures are the same. Whether the rest of the pattern can match from a given (token,
//! position) does not depend on earlier captures, so failures are remembered and the worst
//! case is O(tokens × characters) time; there is no recursion, so long inputs cannot overflow
//! the stack.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::fmt;

use crate::error::{Error, Escaped, Result};

/// The text that stands for a brace group between the two compilation steps.
const PLACEHOLDER: &str = "__NUM__";

/// One element of the translated expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token {
    /// A character matched as itself.
    Literal(char),
    /// `.`: any one character except `\n`.
    AnyChar,
    /// `.*`: greedy, any run of characters other than `\n`, longest first.
    AnyRun,
    /// `(\d+)`: greedy, one or more ASCII digits, longest first; the capture's group index.
    Digits(usize),
}

/// What a brace group accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Spec {
    /// `{*}`: any non-negative integer.
    Any,
    /// `{low-high}`, inclusive; both bounds as canonical decimal strings (see `canonical`).
    Range { low: String, high: String },
}

/// A compiled module-name pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    source: String,
    tokens: Vec<Token>,
    /// One per brace group, in order.
    specs: Vec<Spec>,
    /// The number of `Token::Digits` (brace groups plus literal `__NUM__`s, see the quirk).
    groups: usize,
    has_any_run: bool,
    /// The literal characters before the first non-literal token and after the last one: a
    /// name must start and end with them (modulo `$`'s trailing newline) to match, which
    /// rejects almost every name without running the search.
    literal_prefix: String,
    literal_suffix: String,
}

impl Pattern {
    /// Compiles `pattern`. Errors (ErrorKind::InvalidArgument) carry the seed's exact texts:
    /// `Invalid brace pattern: {inner}`, `Non-integer in range: {inner}`,
    /// `Invalid range: {inner} (low > high)` and `Unrecognized brace pattern: {inner}`, for the
    /// first offending brace group from the left.
    pub fn compile(pattern: &str) -> Result<Pattern> {
        // Step 1: textual substitution of brace groups, as `re.sub(r"\{([^}]*)\}", ...)`.
        let mut substituted = String::with_capacity(pattern.len());
        let mut specs = Vec::new();
        let mut rest = pattern;
        while let Some(open) = rest.find('{') {
            let Some(close) = rest[open + 1..].find('}').map(|i| open + 1 + i) else {
                // No `}` after this `{`: no further group can match; the rest is literal.
                break;
            };
            substituted.push_str(&rest[..open]);
            specs.push(parse_brace(&rest[open + 1..close])?);
            substituted.push_str(PLACEHOLDER);
            rest = &rest[close + 1..];
        }
        substituted.push_str(rest);

        // Step 2: translation of the substituted text, scanned left to right.
        let mut tokens = Vec::with_capacity(substituted.len());
        let mut groups = 0;
        let mut i = 0;
        while let Some(c) = substituted[i..].chars().next() {
            if substituted[i..].starts_with(PLACEHOLDER) {
                tokens.push(Token::Digits(groups));
                groups += 1;
                i += PLACEHOLDER.len();
                continue;
            }
            tokens.push(match c {
                '*' => Token::AnyRun,
                '?' => Token::AnyChar,
                c => Token::Literal(c),
            });
            i += c.len_utf8();
        }
        let has_any_run = tokens.contains(&Token::AnyRun);
        let literal = |t: &Token| match t {
            Token::Literal(c) => Some(*c),
            _ => None,
        };
        let literal_prefix: String = tokens.iter().map_while(literal).collect();
        let literal_suffix: String = if literal_prefix.chars().count() == tokens.len() {
            String::new() // all literal: the prefix already is the whole pattern
        } else {
            let mut tail: Vec<char> = tokens.iter().rev().map_while(literal).collect();
            tail.reverse();
            tail.into_iter().collect()
        };
        Ok(Pattern {
            source: pattern.to_string(),
            tokens,
            specs,
            groups,
            has_any_run,
            literal_prefix,
            literal_suffix,
        })
    }

    /// Whether `name` matches: the anchored expression matches and the captures of that first
    /// match satisfy the brace specs paired with them.
    pub fn is_match(&self, name: &str) -> bool {
        if !self.may_match(name) {
            return false;
        }
        let chars: Vec<char> = name.chars().collect();
        self.is_match_chars(&chars)
    }

    /// A necessary condition for a match, checked on the bytes without allocating.
    fn may_match(&self, name: &str) -> bool {
        let body = name.strip_suffix('\n');
        let ends_ok = |suffix: &str| name.ends_with(suffix) || body.is_some_and(|b| b.ends_with(suffix));
        name.starts_with(&self.literal_prefix) && ends_ok(&self.literal_suffix)
    }

    /// The pattern text as given to `compile`.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    fn is_match_chars(&self, name: &[char]) -> bool {
        let mut captures = vec![(0, 0); self.groups];
        if !self.find(name, &mut captures) {
            return false;
        }
        // `zip(m.groups(), specs)`: pairs in order, the shorter list decides how many.
        self.specs.iter().zip(&captures).all(|(spec, &(start, end))| match spec {
            Spec::Any => true,
            Spec::Range { low, high } => {
                let n = &name[start..end];
                cmp_digits(n, low) != Ordering::Less && cmp_digits(n, high) != Ordering::Greater
            }
        })
    }

    /// The backtracking search: explores every alternative in Python's order (each variable
    /// token tries its longest run first, then shorter ones) and stops at the first complete
    /// match, leaving the span of each digit capture of that match in `captures`.
    ///
    /// A frame is pushed for each variable token (`*`, a digit capture) with the candidate end
    /// positions it has yet to try; fixed tokens have a single way to proceed. When a frame
    /// runs out of candidates, everything after it failed from every end in its segment (a
    /// line for `*`, a digit run for a capture) from its start onwards; that is recorded per
    /// (token, segment) so that later entries skip those ends. Each (token, position) is thus
    /// explored at most once.
    fn find(&self, name: &[char], captures: &mut [(usize, usize)]) -> bool {
        struct Frame {
            token: usize,
            start: usize,
            /// The candidate end being tried; the next one tried is `end - 1`.
            end: usize,
            min_end: usize,
            segment_end: usize,
        }

        // segment_end for `*` at p: the first `\n` at or after p (or the end of the name);
        // for a digit capture at p: the end of the run of ASCII digits starting at p.
        let line_end = if self.has_any_run { run_ends(name, |c| c != '\n') } else { Vec::new() };
        let digit_end = if self.groups > 0 { run_ends(name, |c| c.is_ascii_digit()) } else { Vec::new() };
        // (token, segment_end) -> the lowest start from which that token has failed: every end
        // in [start, segment_end] (`*`) or [start + 1, segment_end] (digits) leads to failure.
        let mut failed_from: HashMap<(usize, usize), usize> = HashMap::new();
        let mut stack: Vec<Frame> = Vec::new();
        let (mut k, mut p) = (0usize, 0usize);
        loop {
            // Follow the first untried alternative until the pattern ends or a dead end.
            let matched = loop {
                let Some(&token) = self.tokens.get(k) else {
                    // `$`: the end, or just before a single trailing newline.
                    break p == name.len() || (p + 1 == name.len() && name[p] == '\n');
                };
                match token {
                    Token::Literal(c) => {
                        if name.get(p) != Some(&c) {
                            break false;
                        }
                        p += 1;
                    }
                    Token::AnyChar => {
                        if name.get(p).is_none_or(|&c| c == '\n') {
                            break false;
                        }
                        p += 1;
                    }
                    Token::AnyRun | Token::Digits(_) => {
                        let (segment_end, min_end) = match token {
                            Token::AnyRun => (line_end[p], p),
                            _ => (digit_end[p], p + 1),
                        };
                        if segment_end < min_end {
                            break false; // a capture needs at least one digit
                        }
                        let mut max_end = segment_end;
                        if let Some(&lowest) = failed_from.get(&(k, segment_end)) {
                            if p >= lowest {
                                break false; // every candidate is known to fail
                            }
                            // The ends from here up are known to fail; try the others.
                            max_end = if token == Token::AnyRun { lowest - 1 } else { lowest };
                        }
                        if let Token::Digits(group) = token {
                            captures[group] = (p, max_end);
                        }
                        stack.push(Frame { token: k, start: p, end: max_end, min_end, segment_end });
                        p = max_end;
                    }
                }
                k += 1;
            };
            if matched {
                return true;
            }
            // Back to the newest frame that has a shorter candidate left.
            loop {
                let Some(frame) = stack.last_mut() else {
                    return false;
                };
                if frame.end > frame.min_end {
                    frame.end -= 1;
                    if let Token::Digits(group) = self.tokens[frame.token] {
                        captures[group] = (frame.start, frame.end);
                    }
                    k = frame.token + 1;
                    p = frame.end;
                    break;
                }
                failed_from.insert((frame.token, frame.segment_end), frame.start);
                stack.pop();
            }
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// `module_name_match(pattern, name)` of the seed: compiles `pattern` and matches `name`.
/// Compile once with `Pattern::compile` to match many names.
pub fn module_name_match(pattern: &str, name: &str) -> Result<bool> {
    Ok(Pattern::compile(pattern)?.is_match(name))
}

/// Several patterns, kept in order (e.g. a plan's `apply_modules`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PatternSet {
    patterns: Vec<Pattern>,
}

impl PatternSet {
    /// Compiles every pattern. The error of the first pattern that fails keeps the seed's text
    /// as its prefix and names the pattern, e.g.
    /// `Invalid brace pattern: 1-2-3 (in patterns[1] = "model.{1-2-3}")`.
    pub fn compile<S: AsRef<str>>(patterns: &[S]) -> Result<PatternSet> {
        let patterns = patterns
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let text = text.as_ref();
                Pattern::compile(text).map_err(|err| {
                    Error::new(err.kind, format!("{} (in patterns[{i}] = {text:?})", err.message))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PatternSet { patterns })
    }

    /// The index of the first pattern that matches `name`.
    pub fn first_match(&self, name: &str) -> Option<usize> {
        let mut chars: Option<Vec<char>> = None;
        self.patterns.iter().position(|pattern| {
            pattern.may_match(name)
                && pattern.is_match_chars(chars.get_or_insert_with(|| name.chars().collect()))
        })
    }

    /// Whether any pattern matches `name`.
    pub fn is_match(&self, name: &str) -> bool {
        self.first_match(name).is_some()
    }

    pub fn len(&self) -> usize {
        self.patterns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    pub fn patterns(&self) -> &[Pattern] {
        &self.patterns
    }
}

/// The spec of one brace group, from its inner text, as the seed's `repl`.
fn parse_brace(inner: &str) -> Result<Spec> {
    if inner == "*" {
        return Ok(Spec::Any);
    }
    if !inner.contains('-') {
        return Err(Error::invalid(format!("Unrecognized brace pattern: {}", Escaped(inner))));
    }
    let mut parts = inner.split('-');
    let (Some(low), Some(high), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(Error::invalid(format!("Invalid brace pattern: {}", Escaped(inner))));
    };
    let (Some(low), Some(high)) = (python_int(low), python_int(high)) else {
        return Err(Error::invalid(format!("Non-integer in range: {}", Escaped(inner))));
    };
    if cmp_canonical(&low, &high) == Ordering::Greater {
        return Err(Error::invalid(format!("Invalid range: {} (low > high)", Escaped(inner))));
    }
    Ok(Spec::Range { low, high })
}

/// Python `int(text)` (base 10) for texts without `-` (the range separator), as a canonical
/// decimal string; None where `int()` raises ValueError. Accepted: surrounding whitespace
/// (Unicode White_Space, which is exactly CPython's set for `int()`), one leading `+`, then
/// decimal digits (ASCII or any Unicode decimal digit) with single underscores between them.
fn python_int(text: &str) -> Option<String> {
    let text = text.trim_matches(char::is_whitespace);
    let text = text.strip_prefix('+').unwrap_or(text);
    let mut digits = String::with_capacity(text.len());
    let mut after_digit = false;
    for c in text.chars() {
        if c == '_' {
            if !after_digit {
                return None; // leading or doubled underscore
            }
            after_digit = false;
        } else {
            digits.push(char::from(b'0' + decimal_value(c)?));
            after_digit = true;
        }
    }
    // Empty, or a trailing underscore.
    after_digit.then(|| canonical(&digits))
}

/// A string of ASCII digits without its leading zeros ("0" for zero).
fn canonical(digits: &str) -> String {
    let trimmed = digits.trim_start_matches('0');
    if trimmed.is_empty() { "0".to_string() } else { trimmed.to_string() }
}

/// Compares two canonical decimal strings by value.
fn cmp_canonical(a: &str, b: &str) -> Ordering {
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

/// Compares a run of ASCII digits (leading zeros allowed) with a canonical decimal string.
fn cmp_digits(digits: &[char], canonical: &str) -> Ordering {
    let first = digits.iter().position(|&c| c != '0').unwrap_or(digits.len());
    let digits = if first == digits.len() { &['0'][..] } else { &digits[first..] };
    digits.len().cmp(&canonical.len()).then_with(|| digits.iter().copied().cmp(canonical.chars()))
}

/// For every position p, the end of the run of characters satisfying `inside` that starts at
/// p (p itself when `name[p]` is outside); `name.len()` at the end.
fn run_ends(name: &[char], inside: impl Fn(char) -> bool) -> Vec<usize> {
    let mut ends = vec![name.len(); name.len() + 1];
    for p in (0..name.len()).rev() {
        ends[p] = if inside(name[p]) { ends[p + 1] } else { p };
    }
    ends
}

/// The value of a decimal digit as Python's `int()` sees it: the first code point of each
/// run of ten consecutive digits 0-9 with Unicode category Nd, as of Unicode 14.0 (CPython
/// 3.11). Checked against the local `python3` by tests/pattern.rs.
const DECIMAL_ZEROS: [u32; 66] = [
    0x30, 0x660, 0x6f0, 0x7c0, 0x966, 0x9e6, 0xa66, 0xae6, 0xb66, 0xbe6, 0xc66, 0xce6, 0xd66, 0xde6, 0xe50,
    0xed0, 0xf20, 0x1040, 0x1090, 0x17e0, 0x1810, 0x1946, 0x19d0, 0x1a80, 0x1a90, 0x1b50, 0x1bb0, 0x1c40,
    0x1c50, 0xa620, 0xa8d0, 0xa900, 0xa9d0, 0xa9f0, 0xaa50, 0xabf0, 0xff10, 0x104a0, 0x10d30, 0x11066,
    0x110f0, 0x11136, 0x111d0, 0x112f0, 0x11450, 0x114d0, 0x11650, 0x116c0, 0x11730, 0x118e0, 0x11950,
    0x11c50, 0x11d50, 0x11da0, 0x16a60, 0x16ac0, 0x16b50, 0x1d7ce, 0x1d7d8, 0x1d7e2, 0x1d7ec, 0x1d7f6,
    0x1e140, 0x1e2f0, 0x1e950, 0x1fbf0,
];

fn decimal_value(c: char) -> Option<u8> {
    let c = u32::from(c);
    let i = DECIMAL_ZEROS.partition_point(|&zero| zero <= c).checked_sub(1)?;
    let value = c - DECIMAL_ZEROS[i];
    (value < 10).then_some(value as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_int_follows_int_rules() {
        assert_eq!(python_int("7").as_deref(), Some("7"));
        assert_eq!(python_int(" \t+007 \n").as_deref(), Some("7"));
        assert_eq!(python_int("0").as_deref(), Some("0"));
        assert_eq!(python_int("000").as_deref(), Some("0"));
        assert_eq!(python_int("1_0").as_deref(), Some("10"));
        assert_eq!(python_int("0_1").as_deref(), Some("1"));
        assert_eq!(python_int("\u{663}_\u{663}").as_deref(), Some("33"));
        assert_eq!(python_int("\u{3000}1\u{a0}").as_deref(), Some("1"));
        for bad in ["", " ", "+", "++1", "+ 1", "1 1", "_1", "1_", "1__0", "+_1", "a", "1.0", "\u{1c}1", "½"]
        {
            assert_eq!(python_int(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn decimal_values_cover_each_run_of_ten() {
        for &zero in &DECIMAL_ZEROS {
            for d in 0..10u8 {
                let c = char::from_u32(zero + u32::from(d)).unwrap();
                assert_eq!(decimal_value(c), Some(d), "U+{:04X}", zero + u32::from(d));
            }
        }
        for c in ['/', ':', 'a', '\u{65f}', '\u{66a}', '\u{ff1a}', '\u{1fbfa}', char::MAX] {
            assert_eq!(decimal_value(c), None, "{c:?}");
        }
    }

    #[test]
    fn digit_strings_compare_by_value() {
        let d = |s: &str| s.chars().collect::<Vec<_>>();
        assert_eq!(cmp_digits(&d("0003"), "3"), Ordering::Equal);
        assert_eq!(cmp_digits(&d("000"), "0"), Ordering::Equal);
        assert_eq!(cmp_digits(&d("10"), "9"), Ordering::Greater);
        assert_eq!(cmp_digits(&d("09"), "10"), Ordering::Less);
        assert_eq!(cmp_digits(&d("99999999999999999999999"), "100000000000000000000000"), Ordering::Less);
        assert_eq!(cmp_canonical("12", "9"), Ordering::Greater);
        assert_eq!(cmp_canonical("12", "13"), Ordering::Less);
    }

    #[test]
    fn translation_is_textual() {
        let p = Pattern::compile("a.{*}*?_{0-3}__NUM__").unwrap();
        use Token::*;
        assert_eq!(
            p.tokens,
            [Literal('a'), Literal('.'), Digits(0), AnyRun, AnyChar, Literal('_'), Digits(1), Digits(2)]
        );
        assert_eq!(p.specs, [Spec::Any, Spec::Range { low: "0".into(), high: "3".into() }]);
        // A user's `__NUM` followed by a group: the placeholder scan finds the user's text first.
        let p = Pattern::compile("__NUM{*}").unwrap();
        assert_eq!(
            p.tokens,
            [Digits(0), Literal('N'), Literal('U'), Literal('M'), Literal('_'), Literal('_')]
        );
        // An unclosed `{` and a lone `}` stay literal; `[^}]*` may contain `{`.
        let p = Pattern::compile("}{x").unwrap();
        assert_eq!(p.tokens, [Literal('}'), Literal('{'), Literal('x')]);
        assert_eq!(Pattern::compile("{{1-2}").unwrap_err().message, "Non-integer in range: {1-2",);
    }
}
