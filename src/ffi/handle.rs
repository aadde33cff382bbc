//! Marshalling between C and Rust: checked pointer arguments, out-pointers, caller-owned
//! output buffers, typed data buffers (FSDPTURBO_DTYPE_* elements), the overlap check, versioned
//! option structs, and boxed opaque handles. Every `ffi/` file goes through these.

use std::ffi::{CStr, c_char, c_void};

use super::error::FfiError;
use super::status::{
    FSDPTURBO_ERR_BUFFER_TOO_SMALL, FSDPTURBO_ERR_INVALID_ARGUMENT, FSDPTURBO_ERR_NULL_ARGUMENT,
    FSDPTURBO_ERR_STRUCT_SIZE, FSDPTURBO_ERR_UTF8,
};
use crate::dtype::Dtype;
use crate::host::{HostBuf, HostBufMut};

/// FSDPTURBO_ERR_INVALID_ARGUMENT with `message`: the error of every argument outside what is
/// accepted.
pub(crate) fn invalid(message: String) -> FfiError {
    FfiError::new(FSDPTURBO_ERR_INVALID_ARGUMENT, message)
}

/// FSDPTURBO_ERR_NULL_ARGUMENT: argument `name`, which must not be NULL, is.
pub(crate) fn null(name: &str) -> FfiError {
    FfiError::new(FSDPTURBO_ERR_NULL_ARGUMENT, format!("argument `{name}` must not be NULL"))
}

/// FSDPTURBO_ERR_NULL_ARGUMENT for an argument that may be NULL only in some cases: `name` is
/// NULL but `why` (the other arguments) needs it, e.g. "must hold 3 elements".
pub(crate) fn null_but(name: &str, why: impl std::fmt::Display) -> FfiError {
    FfiError::new(FSDPTURBO_ERR_NULL_ARGUMENT, format!("argument `{name}` is NULL but {why}"))
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

/// A non-NULL function-pointer argument.
pub(crate) fn arg_fn<F>(f: Option<F>, name: &str) -> Result<F, FfiError> {
    f.ok_or_else(|| null(name))
}

/// A NUL-terminated string argument taken as bytes (a name passed on to a vendor library).
pub(crate) fn arg_cstr<'a>(ptr: *const c_char, name: &str) -> Result<&'a CStr, FfiError> {
    if ptr.is_null() {
        return Err(null(name));
    }
    // SAFETY: the caller guarantees a NUL-terminated string.
    Ok(unsafe { CStr::from_ptr(ptr) })
}

/// A NUL-terminated UTF-8 string argument.
pub(crate) fn arg_str<'a>(ptr: *const c_char, name: &str) -> Result<&'a str, FfiError> {
    arg_cstr(ptr, name)?.to_str().map_err(|e| {
        FfiError::new(
            FSDPTURBO_ERR_UTF8,
            format!("argument `{name}` is not valid UTF-8 (at byte {})", e.valid_up_to()),
        )
    })
}

/// An array argument of `len` elements; NULL is accepted when `len` is 0. Aligned and within
/// the address space as [`check_array`] requires. `name` is formatted only when the argument is
/// refused (pass `format_args!` for an indexed name).
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
    if let Some(fault) = array_fault(ptr, len) {
        return Err(invalid(format!("`{name}` {fault}")));
    }
    // SAFETY: non-NULL, aligned, in range; the caller guarantees `len` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Why a non-NULL array of `len` elements at `ptr` cannot be a slice (misaligned, or more bytes
/// than the address space or `isize::MAX`), or None.
fn array_fault<T>(ptr: *const T, len: usize) -> Option<String> {
    let size = std::mem::size_of::<T>();
    if (ptr as usize) % std::mem::align_of::<T>() != 0 {
        return Some(format!("({ptr:p}) is not aligned to its {size}-byte element type"));
    }
    match len.checked_mul(size) {
        Some(bytes) if bytes <= isize::MAX as usize && (ptr as usize).checked_add(bytes).is_some() => None,
        _ => Some(format!("has {len} elements, too many for the address space")),
    }
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

/// Copies `values` into a caller array of exactly `values.len()` elements, checked as an output
/// array (NULL only when `values` is empty, aligned, in range).
pub(crate) fn write_array<T: Copy>(dst: *mut T, name: &str, values: &[T]) -> Result<(), FfiError> {
    out_array(dst, values.len(), name)?;
    // SAFETY: checked by out_array; `values` is the library's own memory, and the caller
    // guarantees `values.len()` writable elements at `dst`.
    unsafe { out_slice(dst, values.len()) }.copy_from_slice(values);
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

/// The leading `struct_size` of a non-NULL versioned option struct argument, read alone: a
/// caller built against an older, smaller struct may not have the later fields, so nothing else
/// is read (and no reference to the struct is made) before [`check_struct_size`] accepted it.
/// Every such struct starts with `size_t struct_size` (the ABI conventions).
pub(crate) fn struct_size_of<T>(ptr: *const T, name: &str) -> Result<usize, FfiError> {
    if ptr.is_null() {
        return Err(null(name));
    }
    // SAFETY: non-NULL; the caller guarantees a readable struct, whose first field is its size.
    Ok(unsafe { ptr.cast::<usize>().read_unaligned() })
}

/// Checks the `struct_size` of argument `arg`, a versioned struct of type `ty`: smaller than
/// `minimum`, the size of its first published version, is rejected with a message naming the
/// argument, the struct, the size given and the sizes accepted, and how to set it (`init`, the
/// struct's FSDPTURBO_*_INIT macro where it has one, else `sizeof`); larger (a newer header) is
/// accepted and the unknown tail ignored.
pub(crate) fn check_struct_size(
    struct_size: usize,
    minimum: usize,
    arg: &str,
    ty: &str,
    init: Option<&str>,
) -> Result<(), FfiError> {
    if struct_size < minimum {
        let fix = match init {
            Some(init) => format!("initialise it with {init}"),
            None => format!("set struct_size to sizeof({ty})"),
        };
        return Err(FfiError::new(
            FSDPTURBO_ERR_STRUCT_SIZE,
            format!(
                "argument `{arg}` ({ty}) has struct_size {struct_size}; this library accepts {minimum} \
                 (the first version's size) or more (a newer header's): {fix}"
            ),
        ));
    }
    Ok(())
}

/// A memory region of an argument, for the overlap check.
#[derive(Clone, Copy)]
pub(crate) struct Region<'n> {
    pub start: usize,
    pub bytes: usize,
    pub name: &'n str,
}

impl Region<'_> {
    fn overlaps(&self, other: &Region) -> bool {
        self.bytes > 0
            && other.bytes > 0
            && self.start < other.start.saturating_add(other.bytes)
            && other.start < self.start.saturating_add(self.bytes)
    }
}

fn overlap_error(a: &Region, b: &Region) -> FfiError {
    invalid(format!(
        "buffers `{}` and `{}` overlap; outputs must not share memory with other arguments",
        a.name, b.name
    ))
}

/// Fails when an output region overlaps another output or an input.
pub(crate) fn check_disjoint(outputs: &[Region], inputs: &[Region]) -> Result<(), FfiError> {
    for (i, a) in outputs.iter().enumerate() {
        if let Some(b) = outputs[i + 1..].iter().chain(inputs).find(|b| a.overlaps(b)) {
            return Err(overlap_error(a, b));
        }
    }
    Ok(())
}

/// [`check_disjoint`] for many outputs and no inputs (a gradient list), in O(n log n): sorts
/// `outputs` by address.
pub(crate) fn check_disjoint_outputs(outputs: &mut [Region]) -> Result<(), FfiError> {
    outputs.sort_unstable_by_key(|r| r.start);
    let mut live = outputs.iter().filter(|r| r.bytes > 0);
    let Some(mut reach) = live.next() else { return Ok(()) };
    for r in live {
        if reach.overlaps(r) {
            return Err(overlap_error(reach, r));
        }
        if r.start + r.bytes > reach.start + reach.bytes {
            reach = r;
        }
    }
    Ok(())
}

/// Checks that `len` elements of `T` at `ptr` can be viewed as a slice and returns its region.
pub(crate) fn check_array<'n, T>(ptr: *const T, len: usize, name: &'n str) -> Result<Region<'n>, FfiError> {
    let region = Region { start: ptr as usize, bytes: 0, name };
    if len == 0 {
        return Ok(region);
    }
    if ptr.is_null() {
        return Err(null_but(name, format_args!("must hold {len} elements")));
    }
    if let Some(fault) = array_fault(ptr, len) {
        return Err(invalid(format!("`{name}` {fault}")));
    }
    Ok(Region { bytes: len * std::mem::size_of::<T>(), ..region })
}

/// A checked input array.
pub(crate) fn in_array<'a, T>(
    ptr: *const T,
    len: usize,
    name: &str,
) -> Result<(&'a [T], Region<'_>), FfiError> {
    let region = check_array(ptr, len, name)?;
    if len == 0 {
        return Ok((&[], region));
    }
    // SAFETY: non-NULL, aligned and in range (checked); the caller guarantees `len` readable
    // elements that nothing writes during the call.
    Ok((unsafe { std::slice::from_raw_parts(ptr, len) }, region))
}

/// A checked output array (made into a slice only after the overlap check: see `out_slice`).
pub(crate) fn out_array<T>(ptr: *mut T, len: usize, name: &str) -> Result<Region<'_>, FfiError> {
    check_array(ptr.cast_const(), len, name)
}

/// # Safety
/// `region` came from `out_array(ptr, len, ..)` and passed `check_disjoint`.
pub(crate) unsafe fn out_slice<'a, T>(ptr: *mut T, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: checked by out_array and check_disjoint; the caller guarantees `len` writable
    // elements that nothing else accesses during the call.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}

/// Checks a data buffer of `len` elements of `dtype` at `ptr` as [`check_array`] does (NULL only
/// when empty, aligned for the element type, in range) and returns its region.
pub(crate) fn check_data<'n>(
    ptr: *const c_void,
    len: usize,
    dtype: Dtype,
    name: &'n str,
) -> Result<Region<'n>, FfiError> {
    match dtype.size() {
        1 => check_array(ptr.cast::<u8>(), len, name),
        2 => check_array(ptr.cast::<u16>(), len, name),
        4 => check_array(ptr.cast::<u32>(), len, name),
        _ => check_array(ptr.cast::<u64>(), len, name),
    }
}

/// The element count of a `bytes`-long buffer of `dtype` (argument `name`), which must be a
/// whole number of elements.
pub(crate) fn elems_of(bytes: usize, dtype: Dtype, name: &str) -> Result<usize, FfiError> {
    if bytes % dtype.size() != 0 {
        return Err(invalid(format!(
            "`{name}` is {bytes}, not a whole number of {}-byte elements",
            dtype.size()
        )));
    }
    Ok(bytes / dtype.size())
}

fn not_float(dtype: Dtype) -> FfiError {
    invalid(format!("{dtype} data cannot be computed on here; pass a floating-point FSDPTURBO_DTYPE_*"))
}

/// A read-only host buffer over a region that passed [`check_data`].
///
/// # Safety
/// `(ptr, len, dtype)` passed `check_data`; the caller of the C function guarantees `len`
/// readable elements that nothing writes during the call.
pub(crate) unsafe fn host_buf<'a>(
    ptr: *const c_void,
    len: usize,
    dtype: Dtype,
) -> Result<HostBuf<'a>, FfiError> {
    // SAFETY: aligned and in range (check_data), readable by the caller's contract.
    unsafe { HostBuf::from_raw(ptr.cast(), len, dtype) }.ok_or_else(|| not_float(dtype))
}

/// A mutable host buffer over a region that passed [`check_data`] and the overlap check.
///
/// # Safety
/// As for [`host_buf`], and no other argument shares the memory (check_disjoint); writable.
pub(crate) unsafe fn host_buf_mut<'a>(
    ptr: *mut c_void,
    len: usize,
    dtype: Dtype,
) -> Result<HostBufMut<'a>, FfiError> {
    // SAFETY: as above.
    unsafe { HostBufMut::from_raw(ptr.cast(), len, dtype) }.ok_or_else(|| not_float(dtype))
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

/// A data buffer given as (pointer, byte length): checked by the marshalling layer.
pub(crate) fn data_region<'n>(
    ptr: *const c_void,
    bytes: usize,
    dtype: Dtype,
    name: &'n str,
) -> Result<Region<'n>, FfiError> {
    check_data(ptr, elems_of(bytes, dtype, &format!("{name}_bytes"))?, dtype, name)
}
