//! The panic boundary: every extern body runs inside `boundary`, so a panic becomes
//! FSDPTURBO_ERR_PANIC with its message instead of unwinding into C.

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::error::{FfiError, clear_last_error, set_last_error};
use super::status::{FSDPTURBO_ERR_PANIC, FSDPTURBO_OK};

/// Runs `body`, records its error (if any) as the thread's last error and returns the status.
pub(crate) fn boundary(body: impl FnOnce() -> Result<(), FfiError>) -> i32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            clear_last_error();
            FSDPTURBO_OK.into()
        }
        Ok(Err(err)) => {
            set_last_error(&err.message);
            err.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with a non-string payload".to_string());
            set_last_error(&format!("internal error (panic) in libfsdpturbo: {what}"));
            FSDPTURBO_ERR_PANIC.into()
        }
    }
}
