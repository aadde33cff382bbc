//! The module-name pattern language: the worked examples and error texts of the seed
//! (where we differ: docs/seed.md), Python `int()` edge cases, the quirks, the C ABI, and a
//! differential test against a transcription of the seed's matcher run by `python3`.

use std::ffi::CString;
use std::io::Write;
use std::process::{Command, Stdio};
use std::ptr;

use fsdpturbo::error::{ErrorKind, escaped};
use fsdpturbo::ffi::pattern::{
    fsdpturbo_module_name_match, fsdpturbo_pattern_compile, fsdpturbo_pattern_free, fsdpturbo_pattern_match,
    fsdpturbo_pattern_t,
};
use fsdpturbo::ffi::status::{
    FSDPTURBO_ERR_INVALID_ARGUMENT, FSDPTURBO_ERR_NULL_ARGUMENT, FSDPTURBO_ERR_UTF8, FSDPTURBO_OK,
};
use fsdpturbo::pattern::{Pattern, PatternSet, module_name_match};

mod common;
use common::{Rng, last_error};

fn m(pattern: &str, name: &str) -> bool {
    module_name_match(pattern, name).unwrap_or_else(|e| panic!("{pattern:?} failed to compile: {e}"))
}

fn compile_error(pattern: &str) -> String {
    let err = Pattern::compile(pattern).expect_err(pattern);
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{pattern:?}");
    err.message
}

// ---- The seed's worked examples (the language: src/pattern.rs), one assertion per row and name ----

#[test]
fn worked_examples_of_the_reference() {
    let experts = "model.layers.{*}.mlp.experts";
    assert!(m(experts, "model.layers.0.mlp.experts"));
    assert!(m(experts, "model.layers.12.mlp.experts"));
    assert!(!m(experts, "model.layers.x.mlp.experts"), "not digits");
    assert!(!m(experts, "model.layers.0.mlp.experts.gate_up"), "anchored at the end");
    assert!(!m("model.layers.{*}.mlp", "model.layers.0.mlp.experts"));
    assert!(m("model.layers.{0-3}.mlp", "model.layers.3.mlp"));
    assert!(!m("model.layers.{0-3}.mlp", "model.layers.4.mlp"));
    assert!(m("model.layers.{0-3}.mlp", "model.layers.03.mlp"), "leading zeros allowed");
    assert!(m("*.mlp.experts", "model.layers.0.mlp.experts"));
    assert!(m("*mlp.experts*", "model.layers.0.mlp.experts.0.w1"));
    assert!(!m("*.experts", "experts"), "needs the dot");
    assert!(m("*experts", "experts"));
    assert!(m("model.layers.*", "model.layers."), "`*` may be empty");
    assert!(m("model.layers.?", "model.layers.7"));
    assert!(!m("model.layers.?", "model.layers.10"));
    assert!(!m("model.layers.{*}", "model.layers.1.2"));
    assert!(m("*{0-3}", "layer12"), "greedy `.*` leaves `2` for the group");
    assert!(!m("*{0-3}", "layer45"));
    assert!(m("model.layers.{ 1 - 3 }", "model.layers.2"), "int() strips spaces");
    assert!(m("a+b", "a+b"), "escaped");
    assert!(m("a[0]", "a[0]"), "escaped");
}

#[test]
fn the_seed_model_specs_match_their_modules() {
    let qwen3 = PatternSet::compile(&["model.layers.{*}.mlp.experts"]).unwrap();
    assert!(qwen3.is_match("model.layers.47.mlp.experts"));
    assert!(!qwen3.is_match("model.layers.47.mlp.experts.0"));
    assert!(!qwen3.is_match("model.language_model.layers.47.mlp.experts"));
    let qwen35 = Pattern::compile("model.language_model.layers.{*}.mlp").unwrap();
    assert!(qwen35.is_match("model.language_model.layers.0.mlp"));
    assert!(!qwen35.is_match("model.visual.blocks.0.mlp"));
}

// ---- The seed's error texts, word for word (trainers match on them: docs/design.md, "Conventions") ----

#[test]
fn error_texts_are_the_seeds() {
    assert_eq!(compile_error("{1-2-3}"), "Invalid brace pattern: 1-2-3");
    assert_eq!(compile_error("{-1-3}"), "Invalid brace pattern: -1-3");
    assert_eq!(compile_error("{a-3}"), "Non-integer in range: a-3");
    assert_eq!(compile_error("{5-3}"), "Invalid range: 5-3 (low > high)");
    assert_eq!(compile_error("{}"), "Unrecognized brace pattern: ");
    assert_eq!(compile_error("{1,2}"), "Unrecognized brace pattern: 1,2");
    assert_eq!(compile_error("{abc}"), "Unrecognized brace pattern: abc");
    assert_eq!(compile_error("{ * }"), "Unrecognized brace pattern:  * ");
    assert_eq!(compile_error("{3}"), "Unrecognized brace pattern: 3");
    assert_eq!(compile_error("{-3}"), "Non-integer in range: -3");
    assert_eq!(compile_error("{3-}"), "Non-integer in range: 3-");
    assert_eq!(compile_error("{-}"), "Non-integer in range: -");
}

#[test]
fn the_first_bad_group_from_the_left_is_reported() {
    assert_eq!(compile_error("a.{*}.{5-3}.{1,2}"), "Invalid range: 5-3 (low > high)");
    assert_eq!(compile_error("a.{x}.{5-3}"), "Unrecognized brace pattern: x");
    assert_eq!(module_name_match("{1,2}", "1").unwrap_err().message, "Unrecognized brace pattern: 1,2");
}

#[test]
fn range_bounds_follow_python_int() {
    assert!(m("{ 1 - 3 }", "3"));
    assert!(!m("{ 1 - 3 }", "4"));
    assert!(m("{+1-3}", "1"));
    assert!(!m("{+1-3}", "0"));
    assert!(m("{1_0-20}", "15"));
    assert!(!m("{1_0-20}", "9"));
    assert!(m("{0_0-1_000}", "999"));
    assert!(m("{\t+2\n-\u{3000}4 }", "4"), "Unicode whitespace is stripped");
    assert!(m("{\u{663}-\u{665}}", "4"), "Unicode decimal digits in bounds (Arabic-Indic 3-5)");
    assert!(!m("{\u{663}-\u{665}}", "6"));
    assert!(m("{\u{ff11}_\u{ff10}-20}", "10"), "fullwidth 1_0");
    assert_eq!(compile_error("{1__0-3}"), "Non-integer in range: 1__0-3");
    assert_eq!(compile_error("{_1-3}"), "Non-integer in range: _1-3");
    assert_eq!(compile_error("{1_-3}"), "Non-integer in range: 1_-3");
    assert_eq!(compile_error("{+_1-3}"), "Non-integer in range: +_1-3");
    assert_eq!(compile_error("{+ 1-3}"), "Non-integer in range: + 1-3");
    assert_eq!(compile_error("{++1-3}"), "Non-integer in range: ++1-3");
    assert_eq!(compile_error("{1 0-30}"), "Non-integer in range: 1 0-30");
    assert_eq!(compile_error("{1.5-3}"), "Non-integer in range: 1.5-3");
    assert_eq!(compile_error("{ -3}"), "Non-integer in range:  -3");
    assert_eq!(
        compile_error("{\u{1c}1-3}"),
        "Non-integer in range: \\u{1c}1-3",
        "int() does not strip U+001C (echoed escaped)"
    );
    assert_eq!(compile_error("{\u{bd}-3}"), "Non-integer in range: \u{bd}-3", "½ is numeric, not decimal");
    assert_eq!(compile_error("{0x1-3}"), "Non-integer in range: 0x1-3");
    assert_eq!(compile_error("{1_0-9}"), "Invalid range: 1_0-9 (low > high)");
}

// ---- Literal text, quirks, anchoring ----

#[test]
fn unbalanced_braces_are_literal() {
    assert!(m("a{b", "a{b"));
    assert!(m("a}b", "a}b"));
    assert!(m("}{", "}{"));
    assert!(m("x.{*}.y{", "x.5.y{"));
    assert!(!m("x.{*}.y{", "x.5.y"));
    assert!(m("{*}}", "7}"), "the first closing brace ends the group");
    assert!(m("a{", "a{"));
    assert!(!m("a{", "a"));
    // `[^}]*` may contain `{`, so `{{*}` is a group with inner `{*`.
    assert_eq!(compile_error("{{*}"), "Unrecognized brace pattern: {*");
}

#[test]
fn literal_num_placeholder_is_an_unconstrained_capture_that_shifts_the_specs() {
    // A user's `__NUM__` captures digits without a spec.
    assert!(m("layer__NUM__", "layer123"));
    assert!(!m("layer__NUM__", "layer__NUM__"));
    // It is the first capture, so the group's range is checked against it.
    assert!(m("__NUM__.{0-3}", "2.9"), "2 is checked against 0-3, 9 is unchecked");
    assert!(!m("__NUM__.{0-3}", "5.2"), "5 is checked against 0-3");
    // `__NUM` before a group: the placeholder scan takes the user's text first.
    assert!(m("__NUM{*}", "12NUM__"));
    assert!(!m("__NUM{*}", "__NUM12"));
}

#[test]
fn dollar_matches_before_one_trailing_newline() {
    assert!(m("a.b", "a.b\n"));
    assert!(!m("a.b", "a.b\n\n"));
    assert!(!m("a.b", "a.b\nx"));
    assert!(m("model.layers.{*}", "model.layers.3\n"));
    assert!(m("*", "\n"));
    assert!(m("*", "abc\n"));
    assert!(m("", "\n"));
    assert!(!m("", "\n\n"));
    assert!(m("a\n", "a\n"));
    assert!(m("a\n", "a\n\n"), "literal newline, then `$` before the trailing one");
}

#[test]
fn wildcards_do_not_match_newline() {
    assert!(!m("a*b", "a\nb"));
    assert!(!m("a?b", "a\nb"));
    assert!(m("a?b", "a.b"));
    assert!(m("a*\n*b", "ax\nyb"));
    assert!(!m("?", "\n"));
    assert!(!m("{*}", "1\n2"));
}

#[test]
fn numbers_of_any_length_compare_exactly() {
    let big = "{0-99999999999999999999999999999999999999999999}";
    assert!(m(big, "99999999999999999999999999999999999999999999"));
    assert!(!m(big, "100000000000000000000000000000000000000000000"));
    assert!(m(big, "000000000000000000000000000000000000000000000000000000007"));
    let window = "{18446744073709551616-18446744073709551617}"; // 2^64 and 2^64 + 1
    assert!(!m(window, "18446744073709551615"));
    assert!(m(window, "18446744073709551616"));
    assert!(m(window, "18446744073709551617"));
    assert!(!m(window, "18446744073709551618"));
    let thousand = "9".repeat(1000);
    assert!(m("n{*}", &format!("n{thousand}")));
    assert!(m(&format!("{{{thousand}-{thousand}}}"), &thousand));
    assert!(!m(&format!("{{0-{thousand}}}"), &format!("1{thousand}")));
    assert_eq!(
        compile_error(&format!("{{1{thousand}-{thousand}}}")),
        format!("Invalid range: 1{thousand}-{thousand} (low > high)")
    );
}

#[test]
fn leading_zeros_are_allowed_in_names_and_bounds() {
    assert!(m("{0-3}", "03"));
    assert!(m("{0-3}", "0000"));
    assert!(!m("{0-3}", "0004"));
    assert!(m("{007-010}", "8"));
    assert!(m("{007-010}", "0010"));
    assert!(!m("{007-010}", "0011"));
    assert!(!m("{007-010}", "6"));
    assert!(m("{00-0}", "0"));
}

#[test]
fn ranges_are_checked_on_the_first_greedy_match_only() {
    assert!(m("*{0-3}", "layer12"));
    assert!(!m("*{0-3}", "layer45"), "no re-search for a split that would fit");
    assert!(!m("*{0-3}", "layer34"), "the greedy `*` takes `layer3`, leaving 4 to the group");
    // The greedy group takes all digits before backing off, and a later group only gets what
    // the earlier one left.
    assert!(m("{*}{0-3}", "9993"));
    assert!(!m("{*}{0-3}", "3339"));
    assert!(!m("{0-3}{*}", "39999"), "first group takes 3999, second 9: 3999 > 3");
    assert!(m("{0-3}{*}", "39"), "first group takes 3, second 9");
    assert!(!m("{0-3}{*}", "1999"), "first group takes 199");
    assert!(m("{0-9}.{*}", "5.0"));
    assert!(m("{10-20}{1-1}", "151"));
    assert!(!m("{10-20}{1-1}", "115"), "first group takes 11, second 5");
}

#[test]
fn star_and_question_mark() {
    assert!(m("*", ""));
    assert!(m("**", "a.b.c"));
    assert!(m("a.*.c", "a.x.y.c"));
    assert!(!m("a.*.c", "a.c"));
    assert!(m("???", "a.b"));
    assert!(!m("???", "ab"));
    assert!(m("?*?", "ab"));
    assert!(!m("?*?", "a"));
    assert!(m("é?ü", "éxü"), "characters, not bytes");
    assert!(m("?", "é"));
    assert!(!m("??", "é"));
    assert!(!m("A", "a"), "case-sensitive");
}

#[test]
fn pathological_patterns_finish() {
    let a = "a".repeat(10_000);
    assert!(!m(&format!("{}b", "*".repeat(30)), &a));
    assert!(m(&"*a".repeat(30), &a));
    assert!(!m(&format!("{}b", "*a".repeat(30)), &a));
    assert!(!m(&format!("{}x", "?*".repeat(30)), &a));
    let digits = "1".repeat(10_000);
    assert!(!m(&format!("{}x", "{*}".repeat(30)), &digits));
    assert!(m(&"{*}".repeat(30), &digits));
    assert!(!m(&format!("{}x", "{*}*".repeat(30)), &digits));
    let lines = "ab\n".repeat(3_000);
    assert!(!m(&format!("{}c", "*\n".repeat(30)), &lines));
}

// ---- Pattern and PatternSet API ----

#[test]
fn pattern_keeps_its_text_and_can_be_reused() {
    let p = Pattern::compile("model.layers.{0-3}.mlp").unwrap();
    assert_eq!(p.as_str(), "model.layers.{0-3}.mlp");
    let q = p.clone();
    let hits: Vec<bool> = (0..6).map(|i| q.is_match(&format!("model.layers.{i}.mlp"))).collect();
    assert_eq!(hits, [true, true, true, true, false, false]);
    assert!(format!("{p:?}").contains("model.layers.{0-3}.mlp"));
}

#[test]
fn pattern_set_finds_the_first_matching_pattern() {
    let set = PatternSet::compile(&["*.experts", "model.layers.{0-1}.mlp", "model.layers.{*}.*"]).unwrap();
    assert_eq!(set.len(), 3);
    assert!(!set.is_empty());
    assert_eq!(set.patterns()[1].as_str(), "model.layers.{0-1}.mlp");
    assert_eq!(set.first_match("model.layers.0.mlp.experts"), Some(0));
    assert_eq!(set.first_match("model.layers.1.mlp"), Some(1));
    assert_eq!(set.first_match("model.layers.2.mlp"), Some(2));
    assert_eq!(set.first_match("lm_head"), None);
    assert!(set.is_match("model.layers.9.attn"));
    assert!(!set.is_match("model.embed_tokens"));

    let owned: Vec<String> = vec!["a".into(), "b*".into()];
    let set = PatternSet::compile(&owned).unwrap();
    assert_eq!(set.first_match("bc"), Some(1));

    let empty = PatternSet::compile::<&str>(&[]).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.len(), 0);
    assert_eq!(empty.first_match("x"), None);
}

#[test]
fn pattern_set_errors_name_the_pattern_and_keep_the_seed_text() {
    let err = PatternSet::compile(&["model.{*}", "model.{1-2-3}", "{x}"]).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert_eq!(err.message, "Invalid brace pattern: 1-2-3 (in patterns[1] = \"model.{1-2-3}\")");
}

// ---- C ABI ----

fn cstr(s: &str) -> CString {
    CString::new(s).unwrap()
}

#[test]
fn c_abi_compiles_matches_and_frees() {
    let mut handle: *mut fsdpturbo_pattern_t = ptr::null_mut();
    let pattern = cstr("model.layers.{0-3}.mlp.experts");
    assert_eq!(fsdpturbo_pattern_compile(pattern.as_ptr(), &mut handle), FSDPTURBO_OK);
    assert!(!handle.is_null());
    for (name, expected) in [
        ("model.layers.3.mlp.experts", true),
        ("model.layers.4.mlp.experts", false),
        ("model.layers.03.mlp.experts", true),
    ] {
        let mut out = !expected;
        let name = cstr(name);
        assert_eq!(fsdpturbo_pattern_match(handle, name.as_ptr(), &mut out), FSDPTURBO_OK);
        assert_eq!(out, expected, "{name:?}");
    }
    assert_eq!(last_error(), "");
    fsdpturbo_pattern_free(handle);

    let mut out = false;
    assert_eq!(fsdpturbo_module_name_match(cstr("*experts").as_ptr(), cstr("experts").as_ptr(), &mut out), 0);
    assert!(out);
    assert_eq!(
        fsdpturbo_module_name_match(cstr("*.experts").as_ptr(), cstr("experts").as_ptr(), &mut out),
        0
    );
    assert!(!out);
}

#[test]
fn c_abi_reports_invalid_patterns_with_the_seed_text() {
    let mut handle = ptr::NonNull::<fsdpturbo_pattern_t>::dangling().as_ptr();
    let status = fsdpturbo_pattern_compile(cstr("model.{1-2-3}").as_ptr(), &mut handle);
    assert_eq!(status, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(handle.is_null(), "a failed compile leaves *out NULL");
    assert_eq!(last_error(), "Invalid brace pattern: 1-2-3");
    fsdpturbo_pattern_free(ptr::null_mut());
    assert_eq!(last_error(), "Invalid brace pattern: 1-2-3", "free does not clear the last error");

    let mut out = true;
    let status = fsdpturbo_module_name_match(cstr("{5-3}").as_ptr(), cstr("4").as_ptr(), &mut out);
    assert_eq!(status, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(last_error(), "Invalid range: 5-3 (low > high)");
    assert!(out, "out is not written on failure");

    // A success clears the last error.
    assert_eq!(fsdpturbo_module_name_match(cstr("a").as_ptr(), cstr("a").as_ptr(), &mut out), FSDPTURBO_OK);
    assert_eq!(last_error(), "");
}

#[test]
fn c_abi_rejects_null_arguments() {
    let mut handle: *mut fsdpturbo_pattern_t = ptr::null_mut();
    let mut out = false;
    let p = cstr("a.{*}");
    let name = cstr("a.1");

    assert_eq!(fsdpturbo_pattern_compile(ptr::null(), &mut handle), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `pattern` must not be NULL");
    assert!(handle.is_null());
    assert_eq!(fsdpturbo_pattern_compile(p.as_ptr(), ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `out` must not be NULL");

    assert_eq!(fsdpturbo_pattern_compile(p.as_ptr(), &mut handle), FSDPTURBO_OK);
    assert_eq!(fsdpturbo_pattern_match(ptr::null(), name.as_ptr(), &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `pattern` must not be NULL");
    assert_eq!(fsdpturbo_pattern_match(handle, ptr::null(), &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `name` must not be NULL");
    assert_eq!(fsdpturbo_pattern_match(handle, name.as_ptr(), ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `out` must not be NULL");
    fsdpturbo_pattern_free(handle);

    assert_eq!(
        fsdpturbo_module_name_match(ptr::null(), name.as_ptr(), &mut out),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    assert_eq!(fsdpturbo_module_name_match(p.as_ptr(), ptr::null(), &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(
        fsdpturbo_module_name_match(p.as_ptr(), name.as_ptr(), ptr::null_mut()),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    assert_eq!(last_error(), "argument `out` must not be NULL");

    fsdpturbo_pattern_free(ptr::null_mut());
}

#[test]
fn c_abi_rejects_invalid_utf8() {
    let bad = CString::new(vec![b'a', 0xff]).unwrap();
    let mut out = false;
    assert_eq!(fsdpturbo_module_name_match(cstr("a*").as_ptr(), bad.as_ptr(), &mut out), FSDPTURBO_ERR_UTF8);
    assert_eq!(last_error(), "argument `name` is not valid UTF-8 (at byte 1)");
}

// ---- Differential test against the seed's algorithm in Python ----

/// A line-for-line transcription of the seed's `compile_extended_pattern` and
/// `module_name_match` (the seed's), reading `hex(pattern):hex(name)` lines and writing
/// `T`, `F`, or `E hex(message)` lines.
const PYTHON_REFERENCE: &str = r#"
import re, sys

def compile_extended_pattern(pattern):
    specs = []

    def repl(m):
        inner = m.group(1)
        if inner == "*":
            specs.append(None)
        elif "-" in inner:
            parts = inner.split("-")
            if len(parts) != 2:
                raise ValueError(f"Invalid brace pattern: {inner}")
            try:
                low, high = int(parts[0]), int(parts[1])
            except ValueError:
                raise ValueError(f"Non-integer in range: {inner}")
            if low > high:
                raise ValueError(f"Invalid range: {inner} (low > high)")
            specs.append((low, high))
        else:
            raise ValueError(f"Unrecognized brace pattern: {inner}")
        return "__NUM__"

    s = re.sub(r"\{([^}]*)\}", repl, pattern)
    regex = ""
    i = 0
    while i < len(s):
        if s.startswith("__NUM__", i):
            regex += r"(\d+)"
            i += len("__NUM__")
        elif s[i] == "*":
            regex += ".*"
            i += 1
        elif s[i] == "?":
            regex += "."
            i += 1
        elif s[i] == ".":
            regex += r"\."
            i += 1
        else:
            regex += re.escape(s[i])
            i += 1
    return re.compile("^" + regex + "$"), specs

def module_name_match(pattern, string):
    regex, specs = compile_extended_pattern(pattern)
    m = regex.match(string)
    if not m:
        return False
    for num_str, spec in zip(m.groups(), specs):
        if spec is None:
            continue
        low, high = spec
        n = int(num_str)
        if not (low <= n <= high):
            return False
    return True

out = []
for line in sys.stdin.read().splitlines():
    p, n = line.split(":")
    try:
        r = module_name_match(bytes.fromhex(p).decode(), bytes.fromhex(n).decode())
        out.append("T" if r else "F")
    except ValueError as e:
        out.append("E " + str(e).encode().hex())
    except Exception as e:
        out.append("X " + repr(e).encode().hex())
sys.stdout.write("\n".join(out) + "\n")
"#;

/// Runs `script` with `python3 -c`, feeding `input`; None (after saying why) when there is no
/// python3.
fn run_python(script: &str, input: &str) -> Option<String> {
    let child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(err) => {
            eprintln!("SKIPPED: python3 is not available ({err}); the differential check did not run");
            return None;
        }
    };
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "python3 failed: {}", String::from_utf8_lossy(&output.stderr));
    Some(String::from_utf8(output.stdout).unwrap())
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> String {
    let bytes = (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect();
    String::from_utf8(bytes).unwrap()
}

const ALPHABET: &[char] =
    &['0', '1', '2', '3', '9', '.', 'a', 'b', '*', '?', '{', '}', '-', '_', ' ', '+', '\n'];
const BRACE_INNER: &[char] = &['0', '1', '2', '3', '5', '9', '-', '-', ' ', '+', '_', '*', 'a', ','];
const NAME_CHARS: &[char] =
    &['0', '1', '2', '3', '4', '9', '.', 'a', 'b', '_', '-', ' ', '+', '\n', '{', '}'];

fn random_pattern(rng: &mut Rng) -> String {
    let mut p = String::new();
    for _ in 0..rng.below(9) {
        match rng.below(12) {
            0..=2 => {
                p.push('{');
                match rng.below(3) {
                    0 => p.push('*'),
                    1 => {
                        // A range, well-formed or nearly: digits, sometimes decorated.
                        let low = rng.below(12);
                        let high = low + rng.below(25);
                        let decorate = |rng: &mut Rng, n: usize| match rng.below(6) {
                            0 => format!(" {n} "),
                            1 => format!("+{n}"),
                            2 => format!("0{n}"),
                            3 if n >= 10 => format!("{}_{}", n / 10, n % 10),
                            _ => n.to_string(),
                        };
                        let (low, high) = if rng.below(8) == 0 { (high, low) } else { (low, high) };
                        p.push_str(&decorate(rng, low));
                        p.push('-');
                        p.push_str(&decorate(rng, high));
                    }
                    _ => {
                        for _ in 0..rng.below(6) {
                            p.push(rng.pick(BRACE_INNER));
                        }
                    }
                }
                p.push('}');
            }
            3 if rng.below(4) == 0 => p.push_str("__NUM__"),
            _ => p.push(rng.pick(ALPHABET)),
        }
    }
    p
}

/// A name built to (nearly) fit the pattern: digits for brace groups, runs for `*`, one
/// character for `?`, the rest copied; then sometimes mutated.
fn name_for(rng: &mut Rng, pattern: &str) -> String {
    let chars: Vec<char> = pattern.chars().collect();
    let mut name = String::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '{' if chars[i..].contains(&'}') => {
                for _ in 0..1 + rng.below(3) {
                    name.push(rng.pick(&['0', '1', '2', '3', '4', '5', '9']));
                }
                i += chars[i..].iter().position(|&c| c == '}').unwrap();
            }
            '*' => {
                for _ in 0..rng.below(4) {
                    name.push(rng.pick(NAME_CHARS));
                }
            }
            '?' => name.push(rng.pick(NAME_CHARS)),
            c => name.push(c),
        }
        i += 1;
    }
    if rng.below(4) == 0 && !name.is_empty() {
        let at = name.char_indices().nth(rng.below(name.chars().count())).unwrap().0;
        name.insert(at, rng.pick(NAME_CHARS));
    }
    if rng.below(8) == 0 {
        name.push('\n');
    }
    name
}

/// `FSDPTURBO_PATTERN_DIFF_CASES` and `FSDPTURBO_PATTERN_DIFF_SEED` widen the draw for a
/// longer run; the default is 2000 cases from a fixed seed.
#[test]
fn differential_against_the_seed_algorithm_in_python() {
    let env = |key: &str, default: u64| std::env::var(key).map_or(default, |v| v.parse().expect(key));
    let mut rng = Rng(env("FSDPTURBO_PATTERN_DIFF_SEED", 0x5eed_2026_0001));
    let count = env("FSDPTURBO_PATTERN_DIFF_CASES", 2_000) as usize;
    let mut cases = Vec::new();
    while cases.len() < count {
        let pattern = random_pattern(&mut rng);
        let name = if rng.below(5) < 2 {
            (0..rng.below(12)).map(|_| rng.pick(NAME_CHARS)).collect()
        } else {
            name_for(&mut rng, &pattern)
        };
        cases.push((pattern, name));
    }
    // Fixed cases that exercise the quirks regardless of the random draw.
    for (p, n) in [
        ("*{0-3}", "layer12"),
        ("*{0-3}", "layer45"),
        ("__NUM__.{0-3}", "5.2"),
        ("__NUM{*}", "12NUM__"),
        ("{{1-2}", "1"),
        ("a.b", "a.b\n"),
        ("{ +1_0 - 2_0 }", "15"),
        ("{1-2-3}", ""),
    ] {
        cases.push((p.to_string(), n.to_string()));
    }
    let input: String = cases.iter().map(|(p, n)| format!("{}:{}\n", hex(p), hex(n))).collect();
    let Some(output) = run_python(PYTHON_REFERENCE, &input) else { return };
    let expected: Vec<&str> = output.lines().collect();
    assert_eq!(expected.len(), cases.len());

    let (mut trues, mut falses, mut errors) = (0, 0, 0);
    let mut mismatches = Vec::new();
    for ((pattern, name), python) in cases.iter().zip(expected) {
        let python = match python.split_once(' ') {
            // The seed echoes the pattern raw; we escape it (fsdpturbo::error::Escaped).
            Some(("E", message)) => Err(escaped(unhex(message))),
            Some((_, message)) => panic!("python raised {} for {pattern:?} {name:?}", unhex(message)),
            None => Ok(python == "T"),
        };
        let ours = module_name_match(pattern, name).map_err(|e| e.message);
        match &python {
            Ok(true) => trues += 1,
            Ok(false) => falses += 1,
            Err(_) => errors += 1,
        }
        if ours != python {
            mismatches.push(format!("{pattern:?} vs {name:?}: python {python:?}, ours {ours:?}"));
        }
    }
    assert!(mismatches.is_empty(), "{} mismatches:\n{}", mismatches.len(), mismatches.join("\n"));
    // The draw must exercise every outcome, or the comparison proves little.
    eprintln!("{} cases agree: {trues} match, {falses} do not, {errors} errors", cases.len());
    assert!(
        trues >= count / 10 && falses >= count / 10 && errors >= count / 10,
        "T {trues} F {falses} E {errors}"
    );
}

#[test]
fn range_bounds_accept_exactly_what_python_int_accepts() {
    // Python lists, among the code points that could matter (ASCII, numeric, whitespace: int()
    // reads only decimal digits, which are numeric, and strips only whitespace), those that
    // int() reads as a digit (with its value) and those it strips around a number.
    let script = r#"
import unicodedata
print(unicodedata.unidata_version)
for c in range(0x110000):
    ch = chr(c)
    if not (c < 128 or ch.isnumeric() or ch.isspace()):
        continue
    print("c", c)
    try:
        print("d", c, int(ch))
        continue
    except ValueError:
        pass
    try:
        int(ch + "1" + ch)
        print("s", c)
    except ValueError:
        pass
"#;
    let Some(output) = run_python(script, "") else { return };
    let mut lines = output.lines();
    let version = lines.next().unwrap();
    let mut candidate = vec![false; 0x110000];
    let mut digit = vec![None; 0x110000];
    let mut space = vec![false; 0x110000];
    for line in lines {
        let fields: Vec<u32> = line[2..].split(' ').map(|f| f.parse().unwrap()).collect();
        match &line[..1] {
            "c" => candidate[fields[0] as usize] = true,
            "d" => digit[fields[0] as usize] = Some(fields[1]),
            _ => space[fields[0] as usize] = true,
        }
    }
    // Our table is CPython 3.11's (Unicode 14.0). Another Unicode version may know more
    // digits; the ones we accept must still be digits there, with the same value.
    let exact = version == "14.0.0";
    if !exact {
        eprintln!("python3 has Unicode {version}, not 14.0.0: checking that our digits are a subset");
    }
    let (mut checked, mut digits, mut spaces) = (0, 0, 0);
    for c in (0..0x110000u32).filter_map(char::from_u32) {
        // Any code point we could accept is numeric or whitespace in Rust's (newer) Unicode.
        if !(candidate[c as usize] || c.is_ascii() || c.is_numeric() || c.is_whitespace()) {
            continue;
        }
        let ours_digit = Pattern::compile(&format!("{{{c}-{c}}}")).ok().map(|p| {
            (0..10).find(|v| p.is_match(&v.to_string())).expect("a one-digit bound matches its value")
        });
        let python_digit = digit[c as usize];
        if exact || ours_digit.is_some() {
            assert_eq!(ours_digit, python_digit, "int({c:?}) U+{:04X}", c as u32);
        }
        let ours_space = python_digit.is_none() && Pattern::compile(&format!("{{{c}1{c}-9}}")).is_ok();
        if exact || python_digit.is_none() {
            assert_eq!(ours_space, space[c as usize], "int({:?}) U+{:04X}", format!("{c}1{c}"), c as u32);
        }
        checked += 1;
        digits += usize::from(ours_digit.is_some());
        spaces += usize::from(ours_space);
    }
    assert!(checked > 1_000, "{checked}");
    if exact {
        assert_eq!((digits, spaces), (660, 25), "660 decimal digits, 25 whitespace characters");
    }
}
