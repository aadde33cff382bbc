//! The one error type of the core: a kind (mapped to a C status) and a message that says
//! what was wrong, where, and what is accepted.

use std::fmt;

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
