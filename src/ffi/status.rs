//! Status codes returned by every fallible function of the C ABI.
//!
//! `Status` is the one list: cbindgen writes its variants into the header (the C enum
//! `fsdpturbo_status_t`), `fsdpturbo_status_name` spells a code by its variant's name,
//! `fsdpturbo_status_class` says which exception both bindings raise for it, and the Python
//! table (`fsdpturbo/_abi.py`) is generated from the header. Functions still return a
//! plain `int32_t`: a callback's own non-zero status is passed through unchanged.

use std::ffi::{CStr, CString};
use std::sync::LazyLock;

use crate::error::ErrorKind;

/// Status codes (`int32_t` results; 0 is success). Variants are spelled as in C.
/// cbindgen:prefix-with-name=false
/// cbindgen:rename-all=None
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum Status {
    /// Success.
    FSDPTURBO_OK = 0,
    /// A required pointer argument was NULL.
    FSDPTURBO_ERR_NULL_ARGUMENT = 1,
    /// An argument is outside the accepted range (including an invalid enum integer).
    FSDPTURBO_ERR_INVALID_ARGUMENT = 2,
    /// The training configuration is malformed or inconsistent.
    FSDPTURBO_ERR_CONFIG = 3,
    /// The topology cannot be built from the given sizes.
    FSDPTURBO_ERR_TOPOLOGY = 4,
    /// Plan resolution failed.
    FSDPTURBO_ERR_PLAN = 5,
    /// The parallel state was used inconsistently.
    FSDPTURBO_ERR_STATE = 6,
    /// An output buffer is too small; the needed size is reported through the out-length.
    FSDPTURBO_ERR_BUFFER_TOO_SMALL = 7,
    /// A run-time library or device capability is not available on this host.
    FSDPTURBO_ERR_UNAVAILABLE = 8,
    /// A struct's `struct_size` is smaller than any version this library knows.
    FSDPTURBO_ERR_STRUCT_SIZE = 9,
    /// A string argument is not valid UTF-8.
    FSDPTURBO_ERR_UTF8 = 10,
    /// A registry has no entry for the name asked for (e.g. an operator that is not registered).
    FSDPTURBO_ERR_NOT_FOUND = 11,
    /// The library panicked; the message is in fsdpturbo_last_error(). A bug: please report it.
    FSDPTURBO_ERR_PANIC = 99,
}

pub use Status::*;

/// The class of FSDPTURBO_OK (fsdpturbo_status_class).
pub const FSDPTURBO_STATUS_CLASS_OK: i32 = 0;
/// The caller's input is wrong (arguments, configuration, topology sizes, struct sizes, UTF-8).
pub const FSDPTURBO_STATUS_CLASS_BAD_INPUT: i32 = 1;
/// A registry has no entry for the name asked for.
pub const FSDPTURBO_STATUS_CLASS_NOT_FOUND: i32 = 2;
/// Any other failure, including codes that are not a status (an embedder callback's own).
pub const FSDPTURBO_STATUS_CLASS_FAILURE: i32 = 3;

impl Status {
    /// Every status, in code order (the Python suite checks against the header's enum that none is
    /// missing).
    pub const ALL: [Status; 13] = [
        FSDPTURBO_OK,
        FSDPTURBO_ERR_NULL_ARGUMENT,
        FSDPTURBO_ERR_INVALID_ARGUMENT,
        FSDPTURBO_ERR_CONFIG,
        FSDPTURBO_ERR_TOPOLOGY,
        FSDPTURBO_ERR_PLAN,
        FSDPTURBO_ERR_STATE,
        FSDPTURBO_ERR_BUFFER_TOO_SMALL,
        FSDPTURBO_ERR_UNAVAILABLE,
        FSDPTURBO_ERR_STRUCT_SIZE,
        FSDPTURBO_ERR_UTF8,
        FSDPTURBO_ERR_NOT_FOUND,
        FSDPTURBO_ERR_PANIC,
    ];

    /// The status with code `code`, if any.
    pub fn from_code(code: i32) -> Option<Status> {
        Status::ALL.into_iter().find(|s| *s as i32 == code)
    }

    /// Its FSDPTURBO_STATUS_CLASS_*.
    pub fn class(self) -> i32 {
        match self {
            FSDPTURBO_OK => FSDPTURBO_STATUS_CLASS_OK,
            FSDPTURBO_ERR_NULL_ARGUMENT
            | FSDPTURBO_ERR_INVALID_ARGUMENT
            | FSDPTURBO_ERR_CONFIG
            | FSDPTURBO_ERR_TOPOLOGY
            | FSDPTURBO_ERR_STRUCT_SIZE
            | FSDPTURBO_ERR_UTF8 => FSDPTURBO_STATUS_CLASS_BAD_INPUT,
            FSDPTURBO_ERR_NOT_FOUND => FSDPTURBO_STATUS_CLASS_NOT_FOUND,
            FSDPTURBO_ERR_PLAN
            | FSDPTURBO_ERR_STATE
            | FSDPTURBO_ERR_BUFFER_TOO_SMALL
            | FSDPTURBO_ERR_UNAVAILABLE
            | FSDPTURBO_ERR_PANIC => FSDPTURBO_STATUS_CLASS_FAILURE,
        }
    }

    /// The C name, e.g. "FSDPTURBO_ERR_CONFIG" (the variant's own name), NUL-terminated.
    pub fn name(self) -> &'static CStr {
        static NAMES: LazyLock<Vec<CString>> = LazyLock::new(|| {
            Status::ALL.iter().map(|s| CString::new(format!("{s:?}")).expect("no NUL in a name")).collect()
        });
        let index = Status::ALL.iter().position(|s| *s == self).expect("ALL lists every status");
        &NAMES[index]
    }
}

impl From<Status> for i32 {
    fn from(status: Status) -> i32 {
        status as i32
    }
}

// Results of the extern functions are `i32`: compare them with statuses directly.
impl PartialEq<Status> for i32 {
    fn eq(&self, other: &Status) -> bool {
        *self == *other as i32
    }
}

impl PartialEq<i32> for Status {
    fn eq(&self, other: &i32) -> bool {
        *self as i32 == *other
    }
}

pub(crate) fn status_of(kind: ErrorKind) -> Status {
    match kind {
        ErrorKind::InvalidArgument => FSDPTURBO_ERR_INVALID_ARGUMENT,
        ErrorKind::Config => FSDPTURBO_ERR_CONFIG,
        ErrorKind::Topology => FSDPTURBO_ERR_TOPOLOGY,
        ErrorKind::Plan => FSDPTURBO_ERR_PLAN,
        ErrorKind::State => FSDPTURBO_ERR_STATE,
        ErrorKind::BufferTooSmall => FSDPTURBO_ERR_BUFFER_TOO_SMALL,
        ErrorKind::Unavailable => FSDPTURBO_ERR_UNAVAILABLE,
        ErrorKind::NotFound => FSDPTURBO_ERR_NOT_FOUND,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each listed status round-trips and is named by its variant. (A variant missing from ALL
    /// is caught by tests/python/test_abi.py, which asks fsdpturbo_status_name for every
    /// enumerator of the header's fsdpturbo_status_t.)
    #[test]
    fn all_round_trips_in_code_order() {
        for s in Status::ALL {
            assert_eq!(Status::from_code(s as i32), Some(s));
            assert_eq!(s.name().to_str().unwrap(), format!("{s:?}"));
        }
        let mut codes: Vec<i32> = Status::ALL.iter().map(|s| *s as i32).collect();
        codes.dedup();
        assert_eq!(codes.len(), Status::ALL.len());
        assert!(codes.windows(2).all(|w| w[0] < w[1]), "ALL is in code order");
    }
}
