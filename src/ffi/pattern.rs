//! C ABI of the module-name pattern language (`crate::pattern`).

use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::error::FfiError;
use super::handle::{arg_mut, arg_ref, arg_str, free_handle, into_handle, write_out};
use super::panic::boundary;
use crate::pattern::{Pattern, module_name_match};

/// A compiled module-name pattern (opaque). Made by fsdpturbo_pattern_compile, released with
/// fsdpturbo_pattern_free. Matching does not modify it, so one handle may be matched from
/// several threads at once.
pub struct fsdpturbo_pattern_t {
    pattern: Pattern,
}

/// Compiles a module-name pattern such as "model.layers.{*}.mlp.experts".
///
/// The language: `{*}` matches one or more decimal digits; `{a-b}` one or more digits whose
/// value is in a..b inclusive (leading zeros allowed; bounds as Python int(): surrounding
/// spaces, a leading '+', '_' between digits); `*` any run of characters, dots included, and
/// the empty run; `?` exactly one character; everything else is literal, and the whole name
/// must match. Brace groups are not nested; an unbalanced '{' or a lone '}' is literal. Ranges
/// are checked on the first (greedy) match only: "*{0-3}" matches "layer12" but not "layer45".
///
/// On success `*out` receives a new handle (free it with fsdpturbo_pattern_free). A malformed
/// brace group gives FSDPTURBO_ERR_INVALID_ARGUMENT with the seed's message, e.g.
/// "Invalid brace pattern: 1-2-3", "Non-integer in range: a-3",
/// "Invalid range: 5-3 (low > high)" or "Unrecognized brace pattern: 1,2"; `*out` is then NULL.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_pattern_compile(
    pattern: *const c_char,
    out: *mut *mut fsdpturbo_pattern_t,
) -> i32 {
    boundary(|| {
        let out = arg_mut(out, "out")?;
        *out = std::ptr::null_mut();
        let pattern = Pattern::compile(arg_str(pattern, "pattern")?).map_err(FfiError::from)?;
        *out = into_handle(fsdpturbo_pattern_t { pattern });
        Ok(())
    })
}

/// Matches a module name against a compiled pattern; `*out` receives the result.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_pattern_match(
    pattern: *const fsdpturbo_pattern_t,
    name: *const c_char,
    out: *mut bool,
) -> i32 {
    boundary(|| {
        let pattern = arg_ref(pattern, "pattern")?;
        let name = arg_str(name, "name")?;
        write_out(out, "out", pattern.pattern.is_match(name))
    })
}

/// Releases a pattern made by fsdpturbo_pattern_compile. NULL is accepted and does nothing.
/// Does not change the thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_pattern_free(pattern: *mut fsdpturbo_pattern_t) {
    // Not `boundary`: a free must not clear the last error a caller may be about to read.
    let _ = catch_unwind(AssertUnwindSafe(|| free_handle(pattern)));
}

/// Compiles `pattern` and matches `name` in one call (the seed's module_name_match); `*out`
/// receives the result. Errors as for fsdpturbo_pattern_compile. To match many names, compile
/// once with fsdpturbo_pattern_compile instead.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_module_name_match(
    pattern: *const c_char,
    name: *const c_char,
    out: *mut bool,
) -> i32 {
    boundary(|| {
        let pattern = arg_str(pattern, "pattern")?;
        let name = arg_str(name, "name")?;
        let matched = module_name_match(pattern, name).map_err(FfiError::from)?;
        write_out(out, "out", matched)
    })
}
