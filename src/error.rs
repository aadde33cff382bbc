//! The one error type of the core: a kind (mapped to a C status) and a message that says
//! what was wrong, where, and what is accepted.

use std::fmt::{self, Write as _};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// An argument is outside what the function accepts.
    InvalidArgument,
    /// The training configuration (YAML) is malformed or inconsistent.
    Config,
    /// The parallel topology cannot be built from the given sizes.
    Topology,
    /// Plan resolution failed (no matching modules, indivisible experts, unknown model type).
    Plan,
    /// The process-global state was used inconsistently (e.g. re-initialised differently).
    State,
    /// A caller-provided buffer is too small; the message names the size needed.
    BufferTooSmall,
    /// A run-time library or device capability is not available on this host.
    Unavailable,
    /// A registry has no entry for the name asked for (an operator, or an operator on a device).
    NotFound,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Whether `c` is escaped where input text is echoed into a message: every character Rust's
/// `{:?}` escapes (control characters, line and paragraph separators, bidi and other format
/// characters, NUL) but quotes and backslashes, which cannot break or disguise a line.
pub fn must_escape(c: char) -> bool {
    !matches!(c, '\\' | '"' | '\'') && c.escape_debug().nth(1).is_some()
}

/// Input text (a tensor name, a key, a `model_type`, a pattern) as it is echoed into a message:
/// the one place its hazardous characters are escaped, as `\n`, `\u{2028}`, `\u{202e}`, so that
/// an error stays one line, shows what it quotes, and cannot forge a log line.
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if must_escape(c) {
                write!(f, "{}", c.escape_debug())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// Displayed input (a JSON value of a file) as `Escaped` echoes it.
pub fn escaped(input: impl fmt::Display) -> String {
    Escaped(&input.to_string()).to_string()
}
