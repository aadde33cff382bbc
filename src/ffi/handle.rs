//! Marshalling between C and Rust: checked pointer arguments, out-pointers, caller-owned
//! output buffers, versioned option structs, and boxed opaque handles.

use std::ffi::{CStr, c_char};

use super::error::FfiError;
use super::status::{
    FSDPTURBO_ERR_BUFFER_TOO_SMALL, FSDPTURBO_ERR_NULL_ARGUMENT, FSDPTURBO_ERR_STRUCT_SIZE,
    FSDPTURBO_ERR_UTF8,
};

fn null(name: &str) -> FfiError {
    FfiError::new(FSDPTURBO_ERR_NULL_ARGUMENT, format!("argument `{name}` must not be NULL"))
}

/// A shared reference to a non-NULL argument.
pub(crate) fn arg_ref<'a, T>(ptr: *const T, name: &str) -> Result<&'a T, FfiError> {
    // SAFETY: the caller of the C function guarantees a non-NULL pointer is valid.
    unsafe { ptr.as_ref() }.ok_or_else(|| null(name))
}

/// A mutable reference to a non-NULL argument.
pub(crate) fn arg_mut<'a, T>(ptr: *mut T, name: &str) -> Result<&'a mut T, FfiError> {
    // SAFETY: as for arg_ref.
    unsafe { ptr.as_mut() }.ok_or_else(|| null(name))
}

/// A NUL-terminated UTF-8 string argument.
pub(crate) fn arg_str<'a>(ptr: *const c_char, name: &str) -> Result<&'a str, FfiError> {
    if ptr.is_null() {
        return Err(null(name));
    }
    // SAFETY: the caller guarantees a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(ptr) };
    bytes.to_str().map_err(|e| {
        FfiError::new(
            FSDPTURBO_ERR_UTF8,
            format!("argument `{name}` is not valid UTF-8 (at byte {})", e.valid_up_to()),
        )
    })
}

/// An array argument of `len` elements; NULL is accepted when `len` is 0.
/// `name` is formatted only when the argument is refused (pass `format_args!` for an indexed name).
pub(crate) fn arg_slice<'a, T>(
    ptr: *const T,
    len: usize,
    name: impl std::fmt::Display,
) -> Result<&'a [T], FfiError> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null(&name.to_string()));
    }
    // SAFETY: the caller guarantees `len` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// An array of `len` C strings.
pub(crate) fn arg_strs<'a>(
    ptr: *const *const c_char,
    len: usize,
    name: &str,
) -> Result<Vec<&'a str>, FfiError> {
    arg_slice(ptr, len, name)?.iter().enumerate().map(|(i, &s)| arg_str(s, &format!("{name}[{i}]"))).collect()
}

/// Stores `value` through a non-NULL out-pointer.
pub(crate) fn write_out<T>(ptr: *mut T, name: &str, value: T) -> Result<(), FfiError> {
    *arg_mut(ptr, name)? = value;
    Ok(())
}

/// Copies `src` into a caller-owned buffer of `capacity` elements. `*out_len` always receives
/// `src.len()`; a buffer that is too small (NULL is fine with capacity 0) gives
/// FSDPTURBO_ERR_BUFFER_TOO_SMALL and is left untouched, so callers can ask for the size first.
pub(crate) fn write_slice<T: Copy>(
    dst: *mut T,
    capacity: usize,
    out_len: *mut usize,
    src: &[T],
    name: &str,
) -> Result<(), FfiError> {
    write_out(out_len, "out_len", src.len())?;
    if capacity < src.len() {
        return Err(FfiError::new(
            FSDPTURBO_ERR_BUFFER_TOO_SMALL,
            format!("buffer `{name}` holds {capacity} elements, {} are needed", src.len()),
        ));
    }
    if !src.is_empty() {
        let dst = arg_mut(dst, name)?;
        // SAFETY: the caller guarantees `capacity >= src.len()` writable elements at `dst`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }
    Ok(())
}

/// Copies a string into a caller-owned buffer with its NUL. `*out_len` receives the bytes
/// needed including the NUL; a short buffer gives FSDPTURBO_ERR_BUFFER_TOO_SMALL.
pub(crate) fn write_string(
    dst: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
    text: &str,
    name: &str,
) -> Result<(), FfiError> {
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(0);
    write_slice(dst.cast::<u8>(), capacity, out_len, &bytes, name)
}

/// Checks the `struct_size` of a versioned option struct: smaller than the first published
/// version is rejected; larger (a newer header) is accepted and the unknown tail ignored.
pub(crate) fn check_struct_size(struct_size: usize, minimum: usize, name: &str) -> Result<(), FfiError> {
    if struct_size < minimum {
        return Err(FfiError::new(
            FSDPTURBO_ERR_STRUCT_SIZE,
            format!(
                "`{name}.struct_size` is {struct_size} but this library needs at least {minimum}; \
                 initialise the struct with its FSDPTURBO_*_INIT macro"
            ),
        ));
    }
    Ok(())
}

/// Moves a value to the heap and hands its ownership to C.
pub(crate) fn into_handle<T>(value: T) -> *mut T {
    Box::into_raw(Box::new(value))
}

/// Takes back and drops a handle made by `into_handle`; NULL is a no-op.
pub(crate) fn free_handle<T>(ptr: *mut T) {
    if !ptr.is_null() {
        // SAFETY: `ptr` came from `into_handle` and the caller does not use it again.
        drop(unsafe { Box::from_raw(ptr) });
    }
}
