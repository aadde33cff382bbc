//! Library and ABI versions.

use std::ffi::c_char;

/// The ABI version: bumped on every incompatible change of this header.
pub const FSDPTURBO_ABI_VERSION: u32 = 3;

/// The library version as a static NUL-terminated string, e.g. "0.1.0".
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The ABI version this library implements (FSDPTURBO_ABI_VERSION of its header).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_abi_version() -> u32 {
    FSDPTURBO_ABI_VERSION
}
