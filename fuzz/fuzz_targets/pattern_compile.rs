//! Fuzzes the module-name pattern language: the input is `pattern NUL name` (without a NUL,
//! all of it is the pattern and the name is derived from it). Compiling and matching must
//! never panic or hang, and for small inputs with at most four wildcards whose brace groups
//! are plain (`{*}` or ASCII `{low-high}`), the result must equal a naive exponential backtracker written here from
//! the seed's description.
#![no_main]

use fsdpturbo::pattern::{Pattern, PatternSet, module_name_match};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (pattern, name) = match text.split_once('\0') {
        Some((pattern, name)) => (pattern.to_string(), name.to_string()),
        None => (text.to_string(), text.replace(['{', '}', '*', '?'], "1")),
    };
    let compiled = Pattern::compile(&pattern);
    let one_shot = module_name_match(&pattern, &name);
    let set = PatternSet::compile(&[pattern.as_str(), "*"]);
    match &compiled {
        Ok(p) => {
            let matched = p.is_match(&name);
            assert_eq!(one_shot.as_ref().ok(), Some(&matched));
            assert_eq!(p.as_str(), pattern);
            let set = set.expect("the set compiles when its patterns do");
            // `*` matches any name without a newline, but for one at the very end.
            let star = !name.trim_end_matches('\n').contains('\n') && !name.ends_with("\n\n");
            let expected = if matched { Some(0) } else { star.then_some(1) };
            assert_eq!(set.first_match(&name), expected, "{pattern:?} vs {name:?}");
            if pattern.chars().count() <= 24 && name.chars().count() <= 24 {
                if let Some(expected) = naive::module_name_match(&pattern, &name) {
                    assert_eq!(matched, expected, "{pattern:?} vs {name:?}");
                }
            }
        }
        Err(err) => {
            assert_eq!(one_shot.as_ref().err(), Some(err));
            let set_err = set.expect_err("the set fails when a pattern does");
            assert!(set_err.message.starts_with(&err.message));
        }
    }
});

mod naive {
    //! An independent, exponential transcription of the seed: textual brace substitution,
    //! regex translation, then a recursive backtracking match in Python's priority order.

    enum Tok {
        Lit(char),
        Any,
        Run,
        Num,
    }

    /// None when a brace group is not plain (its spec is left to the differential test).
    pub fn module_name_match(pattern: &str, name: &str) -> Option<bool> {
        let mut specs: Vec<Option<(u128, u128)>> = Vec::new();
        let mut s = String::new();
        let mut rest = pattern;
        while let Some(open) = rest.find('{') {
            let Some(len) = rest[open + 1..].find('}') else { break };
            let inner = &rest[open + 1..open + 1 + len];
            if inner == "*" {
                specs.push(None);
            } else {
                let (a, b) = inner.split_once('-')?;
                let plain = |t: &str| -> Option<u128> {
                    let digits = !t.is_empty() && t.len() <= 20 && t.bytes().all(|b| b.is_ascii_digit());
                    if digits { t.parse().ok() } else { None }
                };
                let (a, b) = (plain(a)?, plain(b)?);
                if a > b {
                    return None;
                }
                specs.push(Some((a, b)));
            }
            s.push_str(&rest[..open]);
            s.push_str("__NUM__");
            rest = &rest[open + 1 + len + 1..];
        }
        s.push_str(rest);
        let mut toks = Vec::new();
        let mut i = 0;
        while i < s.len() {
            if s[i..].starts_with("__NUM__") {
                toks.push(Tok::Num);
                i += 7;
                continue;
            }
            let c = s[i..].chars().next().unwrap();
            toks.push(match c {
                '*' => Tok::Run,
                '?' => Tok::Any,
                c => Tok::Lit(c),
            });
            i += c.len_utf8();
        }
        if toks.iter().filter(|t| matches!(t, Tok::Run | Tok::Num)).count() > 4 {
            return None; // keep the exponential search small
        }
        let name: Vec<char> = name.chars().collect();
        let mut caps = Vec::new();
        if !search(&toks, &name, 0, &mut caps) {
            return Some(false);
        }
        Some(specs.iter().zip(&caps).all(|(spec, digits)| match spec {
            None => true,
            Some((low, high)) => {
                let digits = digits.trim_start_matches('0');
                digits.len() <= 20 && {
                    let n: u128 = if digits.is_empty() { 0 } else { digits.parse().unwrap() };
                    *low <= n && n <= *high
                }
            }
        }))
    }

    fn search(toks: &[Tok], s: &[char], p: usize, caps: &mut Vec<String>) -> bool {
        let Some(tok) = toks.first() else {
            return p == s.len() || p + 1 == s.len() && s[p] == '\n';
        };
        match tok {
            Tok::Lit(c) => s.get(p) == Some(c) && search(&toks[1..], s, p + 1, caps),
            Tok::Any => s.get(p).is_some_and(|&c| c != '\n') && search(&toks[1..], s, p + 1, caps),
            Tok::Run => {
                let end = (p..s.len()).find(|&i| s[i] == '\n').unwrap_or(s.len());
                (p..=end).rev().any(|e| search(&toks[1..], s, e, caps))
            }
            Tok::Num => {
                let end = (p..s.len()).find(|&i| !s[i].is_ascii_digit()).unwrap_or(s.len());
                (p + 1..=end).rev().any(|e| {
                    caps.push(s[p..e].iter().collect());
                    let found = search(&toks[1..], s, e, caps);
                    if !found {
                        caps.pop();
                    }
                    found
                })
            }
        }
    }
}
