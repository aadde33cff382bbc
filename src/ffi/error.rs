//! The thread-local text of the last failure, and the error type the ABI plumbing carries.

use std::cell::RefCell;
use std::ffi::c_char;

use super::status::{self, FSDPTURBO_STATUS_CLASS_FAILURE, Status};
use crate::error::Error;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// A failure on its way out of the ABI: the status to return and the message to record.
#[derive(Debug)]
pub struct FfiError {
    pub status: i32,
    pub message: String,
}

impl FfiError {
    /// `status` is a `Status`, or a caller's own code passed through (e.g. a callback's).
    pub fn new(status: impl Into<i32>, message: impl Into<String>) -> Self {
        FfiError { status: status.into(), message: message.into() }
    }
}

impl From<Error> for FfiError {
    fn from(err: Error) -> Self {
        FfiError { status: status::status_of(err.kind).into(), message: err.message }
    }
}

pub(crate) fn set_last_error(message: &str) {
    LAST_ERROR.with(|slot| {
        let mut slot = slot.borrow_mut();
        slot.clear();
        slot.push_str(message);
    });
}

/// The message of the last failure on this thread.
pub(crate) fn last_error_message() -> String {
    LAST_ERROR.with(|slot| slot.borrow().clone())
}

pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|slot| slot.borrow_mut().clear());
}

/// Copies the message of the last failure on this thread into `buf` (NUL-terminated,
/// truncated to `len - 1` bytes) and returns the full message length in bytes, without the
/// NUL. Returns 0 when the last call on this thread succeeded. `buf` may be NULL when
/// `len` is 0, to ask for the length alone.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_last_error(buf: *mut c_char, len: usize) -> usize {
    let copied = std::panic::catch_unwind(|| {
        LAST_ERROR.with(|slot| {
            let message = slot.borrow();
            if !buf.is_null() && len > 0 {
                let n = message.len().min(len - 1);
                // SAFETY: the caller guarantees `buf` holds `len` bytes; we write n + 1 <= len.
                unsafe {
                    std::ptr::copy_nonoverlapping(message.as_ptr(), buf.cast::<u8>(), n);
                    *buf.add(n) = 0;
                }
            }
            message.len()
        })
    });
    copied.unwrap_or(0)
}

/// The name of a status code, e.g. "FSDPTURBO_ERR_CONFIG"; "FSDPTURBO_UNKNOWN_STATUS" for
/// integers that are not a status. The string is static.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_status_name(status: i32) -> *const c_char {
    let unknown = c"FSDPTURBO_UNKNOWN_STATUS".as_ptr();
    std::panic::catch_unwind(|| Status::from_code(status).map_or(unknown, |s| s.name().as_ptr()))
        .unwrap_or(unknown)
}

/// The class of a status code (FSDPTURBO_STATUS_CLASS_*): what a binding raises for it. Python
/// raises a ValueError for BAD_INPUT and a KeyError for NOT_FOUND; the op library (torch) a
/// ValueError for BAD_INPUT and a RuntimeError otherwise. An integer that is not a status (an
/// embedder callback's own) is FSDPTURBO_STATUS_CLASS_FAILURE.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_status_class(status: i32) -> i32 {
    Status::from_code(status).map_or(FSDPTURBO_STATUS_CLASS_FAILURE, Status::class)
}
