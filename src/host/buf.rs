//! The element buffers of the host kernels: borrowed host memory of one floating-point
//! [`Dtype`] (16-bit types as their bit patterns), and the argument checks every kernel shares.

use std::ops::{Add, Mul};

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// A read-only host buffer. `F16` and `Bf16` hold the raw IEEE binary16 / bfloat16 bit patterns.
#[derive(Clone, Copy, Debug)]
pub enum HostBuf<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

/// A mutable host buffer, with the element types of [`HostBuf`].
#[derive(Debug)]
pub enum HostBufMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    F16(&'a mut [u16]),
    Bf16(&'a mut [u16]),
}

impl<'a> HostBuf<'a> {
    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            HostBuf::F32(_) => Dtype::F32,
            HostBuf::F64(_) => Dtype::F64,
            HostBuf::F16(_) => Dtype::F16,
            HostBuf::Bf16(_) => Dtype::Bf16,
        }
    }

    /// `len` elements of `dtype` at `ptr` (no elements: `ptr` is not read and may be NULL);
    /// `None` when `dtype` is not a floating-point type.
    ///
    /// # Safety
    /// When `len > 0`, `ptr` is aligned for `dtype` and `len` elements there are readable and
    /// not written for `'a`.
    pub unsafe fn from_raw(ptr: *const u8, len: usize, dtype: Dtype) -> Option<HostBuf<'a>> {
        /// SAFETY: the caller's contract above.
        unsafe fn part<'a, T>(ptr: *const u8, len: usize) -> &'a [T] {
            if len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(ptr.cast(), len) } }
        }
        // SAFETY: forwarded from the caller.
        unsafe {
            Some(match dtype {
                Dtype::F32 => HostBuf::F32(part(ptr, len)),
                Dtype::F64 => HostBuf::F64(part(ptr, len)),
                Dtype::F16 => HostBuf::F16(part(ptr, len)),
                Dtype::Bf16 => HostBuf::Bf16(part(ptr, len)),
                Dtype::U8 | Dtype::I32 | Dtype::I64 => return None,
            })
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostBuf::F32(x) => x.len(),
            HostBuf::F64(x) => x.len(),
            HostBuf::F16(x) | HostBuf::Bf16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn slice(self, start: usize, end: usize) -> HostBuf<'a> {
        match self {
            HostBuf::F32(x) => HostBuf::F32(&x[start..end]),
            HostBuf::F64(x) => HostBuf::F64(&x[start..end]),
            HostBuf::F16(x) => HostBuf::F16(&x[start..end]),
            HostBuf::Bf16(x) => HostBuf::Bf16(&x[start..end]),
        }
    }
}

impl<'a> HostBufMut<'a> {
    /// [`HostBuf::from_raw`] for writing.
    ///
    /// # Safety
    /// When `len > 0`, `ptr` is aligned for `dtype` and nothing else accesses the `len`
    /// elements there for `'a`.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, dtype: Dtype) -> Option<HostBufMut<'a>> {
        /// SAFETY: the caller's contract above.
        unsafe fn part<'a, T>(ptr: *mut u8, len: usize) -> &'a mut [T] {
            if len == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(ptr.cast(), len) } }
        }
        // SAFETY: forwarded from the caller.
        unsafe {
            Some(match dtype {
                Dtype::F32 => HostBufMut::F32(part(ptr, len)),
                Dtype::F64 => HostBufMut::F64(part(ptr, len)),
                Dtype::F16 => HostBufMut::F16(part(ptr, len)),
                Dtype::Bf16 => HostBufMut::Bf16(part(ptr, len)),
                Dtype::U8 | Dtype::I32 | Dtype::I64 => return None,
            })
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.as_buf().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A read-only view of the same elements.
    pub fn as_buf(&self) -> HostBuf<'_> {
        match self {
            HostBufMut::F32(x) => HostBuf::F32(x),
            HostBufMut::F64(x) => HostBuf::F64(x),
            HostBufMut::F16(x) => HostBuf::F16(x),
            HostBufMut::Bf16(x) => HostBuf::Bf16(x),
        }
    }

    /// A shorter-lived mutable view of the same elements.
    pub fn reborrow(&mut self) -> HostBufMut<'_> {
        match self {
            HostBufMut::F32(x) => HostBufMut::F32(x),
            HostBufMut::F64(x) => HostBufMut::F64(x),
            HostBufMut::F16(x) => HostBufMut::F16(x),
            HostBufMut::Bf16(x) => HostBufMut::Bf16(x),
        }
    }

    /// Splits into pieces of at most `block` elements (in order), borrowing `self`.
    pub(crate) fn blocks_mut<'s>(&'s mut self, block: usize, out: &mut Vec<HostBufMut<'s>>) {
        match self {
            HostBufMut::F32(x) => out.extend(x.chunks_mut(block).map(HostBufMut::F32)),
            HostBufMut::F64(x) => out.extend(x.chunks_mut(block).map(HostBufMut::F64)),
            HostBufMut::F16(x) => out.extend(x.chunks_mut(block).map(HostBufMut::F16)),
            HostBufMut::Bf16(x) => out.extend(x.chunks_mut(block).map(HostBufMut::Bf16)),
        }
    }
}

/// Checks that the named buffers share one element type.
pub(crate) fn same_dtype(bufs: &[(&str, HostBuf)]) -> Result<()> {
    let (first, b0) = bufs[0];
    for &(name, b) in &bufs[1..] {
        if b.dtype() != b0.dtype() {
            return Err(Error::invalid(format!(
                "`{first}` is {} but `{name}` is {}: all buffers must have one element type",
                b0.dtype(),
                b.dtype()
            )));
        }
    }
    Ok(())
}

/// Checks that buffer `what` has `want` elements (`shape` says why).
pub(crate) fn check_len(what: &str, got: usize, want: usize, shape: &str) -> Result<()> {
    if got != want {
        return Err(Error::invalid(format!("`{what}` has {got} elements but must have {want} ({shape})")));
    }
    Ok(())
}

/// Accumulator types of the routing and GEMM kernels: f32 (for f32, bf16, f16 data) and f64.
pub(crate) trait Acc:
    Copy + Default + Send + Sync + Add<Output = Self> + Mul<Output = Self> + 'static
{
}
impl Acc for f32 {}
impl Acc for f64 {}

/// The identity, as the decode / encode of f32 and f64 data.
pub(crate) fn ident<T>(x: T) -> T {
    x
}
