//! The text of configuration errors: the error types, and how values are quoted in messages
//! (Python's spelling where a message keeps the seed's text, which trainers match on).

use std::fmt;

use serde_yaml::Value;

use crate::error::{Error, ErrorKind, Escaped, must_escape};

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// One problem in the configuration: where (YAML path, 1-based line) and what.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError {
    /// e.g. `dist_config.ep_size` or `dist_config.hook_modules[1]`; empty for the document.
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    /// Path and message escaped (`Escaped`): the input they echo stays on one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (path, message) = (Escaped(&self.path), Escaped(&self.message));
        match (self.path.is_empty(), self.line) {
            (false, Some(line)) => write!(f, "{path} (line {line}): {message}"),
            (false, None) => write!(f, "{path}: {message}"),
            (true, Some(line)) => write!(f, "line {line}: {message}"),
            (true, None) => write!(f, "{message}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one configuration, in document order.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, err) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{err}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl From<ConfigErrors> for Error {
    fn from(errors: ConfigErrors) -> Self {
        Error::new(ErrorKind::Config, errors.to_string())
    }
}

// ---------------------------------------------------------------------------------------------
// Describing values (messages use Python's spelling where they quote the seed)
// ---------------------------------------------------------------------------------------------

/// "integer 3", "string 'abc'", "a list", …
pub(super) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) if n.is_f64() => format!("float {}", py_repr(value)),
        Value::Number(n) => format!("integer {n}"),
        Value::String(s) => format!("string {}", py_str(s)),
        Value::Sequence(_) => "a list".to_string(),
        Value::Mapping(_) => "a mapping".to_string(),
        Value::Tagged(t) => format!("a value with the unsupported YAML tag {}", t.tag),
    }
}

/// Python's `type(v).__name__` of the value LlamaFactory would hold.
pub(super) fn py_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "NoneType",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Sequence(_) => "list",
        Value::Mapping(_) => "dict",
        Value::Tagged(t) => py_type(&t.value),
    }
}

/// Python's `repr(v)`.
pub(super) fn py_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".to_string(),
        Value::Bool(true) => "True".to_string(),
        Value::Bool(false) => "False".to_string(),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u.to_string(),
            (None, Some(i), _) => i.to_string(),
            (_, _, f) => py_float(f.unwrap_or(f64::NAN)),
        },
        Value::String(s) => py_str(s),
        Value::Sequence(items) => format!("[{}]", items.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Mapping(map) => format!(
            "{{{}}}",
            map.iter().map(|(k, v)| format!("{}: {}", py_repr(k), py_repr(v))).collect::<Vec<_>>().join(", ")
        ),
        Value::Tagged(t) => py_repr(&t.value),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
pub(super) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    let sci = format!("{f:e}"); // "-1.5e-7", "4.8e1"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        if plain.contains('.') { plain } else { format!("{plain}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Python's `repr(str)`.
pub(super) fn py_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if must_escape(c) => out.push_str(&match c as u32 {
                n @ ..0x100 => format!("\\x{n:02x}"),
                n @ ..0x10000 => format!("\\u{n:04x}"),
                n => format!("\\U{n:08x}"),
            }),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `repr(list_of_str)`: the form the seed's error texts print name lists in.
pub(crate) fn py_list<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> String {
    format!("[{}]", items.into_iter().map(|s| py_str(s.as_ref())).collect::<Vec<_>>().join(", "))
}

/// Python's `sorted(set(...))` of strings (code-point order = UTF-8 byte order).
pub(super) fn sorted<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut items: Vec<&str> = items.into_iter().collect();
    items.sort_unstable();
    items.dedup();
    items
}

/// The text a key has in a path.
pub(super) fn key_text(key: &Value) -> String {
    match key {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".to_string(),
        other => py_repr(other),
    }
}
