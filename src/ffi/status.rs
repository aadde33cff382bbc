//! Status codes returned by every fallible function of the C ABI.

use crate::error::ErrorKind;

/// Success.
pub const FSDPTURBO_OK: i32 = 0;
/// A required pointer argument was NULL.
pub const FSDPTURBO_ERR_NULL_ARGUMENT: i32 = 1;
/// An argument is outside the accepted range (including an invalid enum integer).
pub const FSDPTURBO_ERR_INVALID_ARGUMENT: i32 = 2;
/// The training configuration is malformed or inconsistent.
pub const FSDPTURBO_ERR_CONFIG: i32 = 3;
/// The topology cannot be built from the given sizes.
pub const FSDPTURBO_ERR_TOPOLOGY: i32 = 4;
/// Plan resolution failed.
pub const FSDPTURBO_ERR_PLAN: i32 = 5;
/// The parallel state was used inconsistently.
pub const FSDPTURBO_ERR_STATE: i32 = 6;
/// An output buffer is too small; the needed size is reported through the out-length.
pub const FSDPTURBO_ERR_BUFFER_TOO_SMALL: i32 = 7;
/// A run-time library or device capability is not available on this host.
pub const FSDPTURBO_ERR_UNAVAILABLE: i32 = 8;
/// A struct's `struct_size` is smaller than any version this library knows.
pub const FSDPTURBO_ERR_STRUCT_SIZE: i32 = 9;
/// A string argument is not valid UTF-8.
pub const FSDPTURBO_ERR_UTF8: i32 = 10;
/// A registry has no entry for the name asked for (e.g. an operator that is not registered).
pub const FSDPTURBO_ERR_NOT_FOUND: i32 = 11;
/// The library panicked; the message is in fsdpturbo_last_error(). A bug: please report it.
pub const FSDPTURBO_ERR_PANIC: i32 = 99;

pub(crate) fn status_of(kind: ErrorKind) -> i32 {
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
