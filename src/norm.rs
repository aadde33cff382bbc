//! Placement-aware gradient-norm math and the host p-norm kernels (DESIGN §4.2).
//!
//! The algorithm, with the collectives abstracted away:
//!
//! 1. Every gradient is described by its [`GradLayout`]: the (global mesh-dim id, role) of each
//!    dim of its DTensor mesh. Its **reduction set** ([`reduction_set`]) is the sorted set of the
//!    dims on which it is `Shard`ed: its local p-power sum is summed over those dims and counted
//!    once across `Replicate` dims (and across dims that are not in its mesh at all). A `Partial`
//!    gradient holds a partial *sum* of the true gradient, whose p-power sum is not additive,
//!    so it must be reduced (torch: `.redistribute(Replicate)`) before it reaches this module.
//! 2. [`norm_plan`] groups the gradients by distinct reduction set, in first-seen order, over the
//!    parameter list that every rank shares, so every rank issues the same collectives in the
//!    same order whether or not it holds any gradient (the seed returns early and can deadlock).
//! 3. [`local_power_sum`] computes Σ|x|^p (or max |x| for p = inf) of each set's local
//!    gradients; the caller reduces each set's scalar (SUM, or MAX for p = inf) over the set's
//!    mesh dims; [`combine`] sums (or maxes) the per-set values and takes the p-th root.
//! 4. One coefficient, [`clip_coefficient`] = `min(max_norm / (norm + 1e-6), 1)`, scales every
//!    local gradient in place ([`scale_in_place`]) when it is below 1.
//!
//! Deliberate differences from the seed (`reference/seed-semantics.md` §7):
//! - replicas are counted once (the seed reduces every set over every group, so a gradient that
//!   is replicated over cp, or over ep for router/shared-expert weights, is over-counted);
//! - p = inf is the max of |x| (the seed returns 1.0 for every input); p = 0, negative and NaN
//!   are errors (the seed raises ZeroDivisionError for 0);
//! - a non-finite total norm (nan or inf) leaves the gradients untouched and is returned (or is
//!   an error with `error_if_nonfinite`); the seed multiplies by 0 for an inf norm, which turns
//!   inf entries into nan. (For nan it does not scale, and neither do we.)
//!
//! Kernels: chunked loops with 16 independent accumulators; p = 1, p = 2 and p = inf have their
//! own loops (explicit AVX2 + F16C code chosen at run time on x86-64, portable loops the
//! compiler vectorises elsewhere), other p go through `powf`. bf16 is widened by a bit shift,
//! binary16 by F16C or an exact branch-free conversion. Inputs of at least
//! [`PARALLEL_MIN_ELEMS`] elements are split over the available cores with
//! `std::thread::scope`. Results are bit-for-bit independent of the thread count and of the
//! instruction set (NaN payloads aside): each buffer is cut into fixed blocks of
//! [`BLOCK_ELEMS`] elements, element i of a block always goes to accumulator i mod 16, and the
//! block results are combined sequentially in buffer and block order.

use crate::dtype::{Dtype, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::error::{Error, Result};

/// The order of the norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormType {
    /// A p-norm with a finite p > 0 (construct it with [`NormType::new`], which checks).
    P(f64),
    /// The max norm, max |x|.
    Inf,
}

impl NormType {
    /// `p` as a norm order: finite p > 0 is a p-norm, +inf the max norm; 0, negative values,
    /// -inf and NaN are errors.
    pub fn new(p: f64) -> Result<NormType> {
        if p == f64::INFINITY {
            return Ok(NormType::Inf);
        }
        if p.is_finite() && p > 0.0 {
            return Ok(NormType::P(p));
        }
        let why = if p == 0.0 {
            " (p = 0 counts non-zero entries, which is not a norm that can be clipped)"
        } else {
            ""
        };
        Err(Error::invalid(format!(
            "norm_type must be a finite p > 0 (a p-norm, e.g. 2.0) or +inf (the max norm), got {p:?}{why}"
        )))
    }

    /// The order as a number (+inf for the max norm).
    pub fn p(self) -> f64 {
        match self {
            NormType::P(p) => p,
            NormType::Inf => f64::INFINITY,
        }
    }

    /// Whether the per-set values are reduced with MAX (p = inf) rather than SUM.
    pub fn is_max(self) -> bool {
        matches!(self, NormType::Inf)
    }

    /// Re-checks a value that may have been built as `NormType::P(..)` directly.
    fn checked(self) -> Result<NormType> {
        NormType::new(self.p())
    }
}

/// The placement of a gradient on one dim of its DTensor mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DimRole {
    /// `Shard(k)` (including `_StridedShard`): every rank of the dim holds a disjoint piece.
    Shard,
    /// `Replicate()`: every rank of the dim holds the same values.
    Replicate,
    /// `Partial()`: every rank holds a partial sum of the values.
    Partial,
}

/// How one gradient is laid out: (global mesh-dim id, role) for each dim of its DTensor mesh.
/// Mesh-dim ids are small integers chosen by the caller (the Python/C++ layer maps them to
/// process groups); the dims of one layout must name orthogonal groups, as the dims of one
/// DTensor mesh do. A plain tensor has no dims: it is replicated everywhere, and its local sum
/// is already the full sum.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GradLayout {
    pub dims: Vec<(u32, DimRole)>,
}

impl GradLayout {
    /// A plain (non-DTensor) gradient.
    pub fn plain() -> GradLayout {
        GradLayout { dims: Vec::new() }
    }

    pub fn new(dims: &[(u32, DimRole)]) -> GradLayout {
        GradLayout { dims: dims.to_vec() }
    }
}

/// Whether the gradient has a `Partial` dim and must be reduced (torch:
/// `grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in ...])`) before
/// its norm can be taken.
pub fn needs_partial_reduction(layout: &GradLayout) -> bool {
    layout.dims.iter().any(|&(_, role)| role == DimRole::Partial)
}

/// The reduction set of a gradient: the sorted mesh-dim ids its local p-power sum must be
/// reduced over (its `Shard` dims; `Replicate` dims are counted once, i.e. not reduced).
/// A `Partial` dim is an error (see [`needs_partial_reduction`]), and so is a mesh-dim id that
/// appears twice in one layout.
pub fn reduction_set(layout: &GradLayout) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = layout.dims.iter().map(|&(id, _)| id).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(format!(
            "mesh dim {} appears twice in the gradient layout {:?}; each dim of a DTensor mesh \
             must map to a distinct mesh-dim id",
            w[0], layout.dims
        )));
    }
    if let Some(&(id, _)) = layout.dims.iter().find(|&&(_, role)| role == DimRole::Partial) {
        return Err(Error::invalid(format!(
            "the gradient is Partial on mesh dim {id}: its local tensor is a partial sum of the \
             true gradient, so its p-power sum cannot be reduced; reduce it first (torch: \
             grad.redistribute(placements with Replicate() for Partial())); accepted roles here \
             are Shard and Replicate"
        )));
    }
    let mut set: Vec<u32> =
        layout.dims.iter().filter(|&&(_, role)| role == DimRole::Shard).map(|&(id, _)| id).collect();
    set.sort_unstable();
    Ok(set)
}

/// The gradients grouped by distinct reduction set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormPlan {
    /// The distinct reduction sets, in first-seen order. The empty set (plain and fully
    /// replicated gradients) needs no collective.
    pub sets: Vec<Vec<u32>>,
    /// Per gradient: its index into `sets`.
    pub grad_set: Vec<usize>,
}

/// Groups gradients by distinct reduction set, in first-seen order, so the caller issues one
/// scalar collective per set. Pass the layouts of every parameter known globally (all ranks
/// have the same parameter list), including those this rank holds no gradient for, so that
/// every rank builds the same plan and issues the same collectives in the same order.
pub fn norm_plan(layouts: &[GradLayout]) -> Result<NormPlan> {
    let mut sets: Vec<Vec<u32>> = Vec::new();
    let mut grad_set = Vec::with_capacity(layouts.len());
    for (i, layout) in layouts.iter().enumerate() {
        let set =
            reduction_set(layout).map_err(|e| Error::new(e.kind, format!("gradient {i}: {}", e.message)))?;
        let index = match sets.iter().position(|s| *s == set) {
            Some(index) => index,
            None => {
                sets.push(set);
                sets.len() - 1
            }
        };
        grad_set.push(index);
    }
    Ok(NormPlan { sets, grad_set })
}

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

    fn slice(self, start: usize, end: usize) -> HostBuf<'a> {
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
    fn blocks_mut<'s>(&'s mut self, block: usize, out: &mut Vec<HostBufMut<'s>>) {
        match self {
            HostBufMut::F32(x) => out.extend(x.chunks_mut(block).map(HostBufMut::F32)),
            HostBufMut::F64(x) => out.extend(x.chunks_mut(block).map(HostBufMut::F64)),
            HostBufMut::F16(x) => out.extend(x.chunks_mut(block).map(HostBufMut::F16)),
            HostBufMut::Bf16(x) => out.extend(x.chunks_mut(block).map(HostBufMut::Bf16)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels.

/// Elements per block: the unit of work of a thread and of the deterministic combine.
/// cbindgen:ignore
pub const BLOCK_ELEMS: usize = 1 << 16;
/// Inputs with at least this many elements (over all buffers) are split across threads.
/// cbindgen:ignore
pub const PARALLEL_MIN_ELEMS: usize = 1 << 20;
/// Independent accumulators per loop.
const LANES: usize = 16;

trait Acc: Copy + std::ops::Add<Output = Self> {
    const ZERO: Self;
    fn to_f64(self) -> f64;
}

impl Acc for f32 {
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Acc for f64 {
    const ZERO: f64 = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
}

/// Σ term(x) with LANES independent accumulators (element i → lane i mod LANES) and a fixed
/// pairwise combine of the lanes.
#[inline(always)]
fn lane_sum<T: Copy, A: Acc>(xs: &[T], term: impl Fn(T) -> A) -> f64 {
    let mut acc = [A::ZERO; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for j in 0..LANES {
            acc[j] = acc[j] + term(chunk[j]);
        }
    }
    lane_tail(&mut acc, chunks.remainder(), term);
    lane_finish(acc)
}

/// The last (fewer than LANES) elements: element j goes to lane j.
#[inline(always)]
fn lane_tail<T: Copy, A: Acc>(acc: &mut [A; LANES], rest: &[T], term: impl Fn(T) -> A) {
    for (j, &x) in rest.iter().enumerate() {
        acc[j] = acc[j] + term(x);
    }
}

/// The fixed pairwise combine of the lanes.
#[inline(always)]
fn lane_finish<A: Acc>(mut acc: [A; LANES]) -> f64 {
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            acc[j] = acc[j] + acc[j + width];
        }
        width /= 2;
    }
    acc[0].to_f64()
}

/// The max of key(x) with LANES independent accumulators.
#[inline(always)]
fn lane_max<T: Copy, K: Copy + Ord + Default>(xs: &[T], key: impl Fn(T) -> K) -> K {
    let mut acc = [K::default(); LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for j in 0..LANES {
            acc[j] = acc[j].max(key(chunk[j]));
        }
    }
    for (j, &x) in chunks.remainder().iter().enumerate() {
        acc[j] = acc[j].max(key(x));
    }
    acc.into_iter().fold(K::default(), K::max)
}

#[derive(Clone, Copy, Debug)]
enum Kernel {
    Abs,
    Square,
    Pow(f64),
    /// max |x|. On the sign-cleared bit patterns, integer order is float order and every NaN
    /// is above +inf, so an integer max finds max |x| and propagates NaN.
    Max,
}

impl Kernel {
    fn of(norm: NormType) -> Kernel {
        match norm {
            NormType::Inf => Kernel::Max,
            NormType::P(1.0) => Kernel::Abs,
            NormType::P(2.0) => Kernel::Square,
            NormType::P(p) => Kernel::Pow(p),
        }
    }
}

/// Σ|x|^p of elements that decode to f32, accumulated in f64 or f32.
#[inline(always)]
fn sum_f32_family<T: Copy>(xs: &[T], decode: impl Fn(T) -> f32 + Copy, kernel: Kernel, acc_f64: bool) -> f64 {
    match (kernel, acc_f64) {
        (Kernel::Abs, true) => lane_sum(xs, |x| (decode(x) as f64).abs()),
        (Kernel::Abs, false) => lane_sum(xs, |x| decode(x).abs()),
        (Kernel::Square, true) => lane_sum(xs, |x| {
            let v = decode(x) as f64;
            v * v
        }),
        (Kernel::Square, false) => lane_sum(xs, |x| {
            let v = decode(x);
            v * v
        }),
        (Kernel::Pow(p), true) => lane_sum(xs, |x| (decode(x) as f64).abs().powf(p)),
        (Kernel::Pow(p), false) => {
            let p = p as f32;
            lane_sum(xs, |x| decode(x).abs().powf(p))
        }
        (Kernel::Max, _) => unreachable!("max is computed on bit patterns"),
    }
}

#[inline(always)]
fn block_kernel(buf: HostBuf<'_>, kernel: Kernel, acc_f64: bool) -> f64 {
    match (buf, kernel) {
        (HostBuf::F64(xs), Kernel::Max) => f64::from_bits(lane_max(xs, |x: f64| x.to_bits() & !(1u64 << 63))),
        (HostBuf::F32(xs), Kernel::Max) => {
            f32::from_bits(lane_max(xs, |x: f32| (x.to_bits() & 0x7fff_ffff) as i32) as u32) as f64
        }
        (HostBuf::F16(xs), Kernel::Max) => {
            f16_to_f32(lane_max(xs, |x: u16| (x & 0x7fff) as i16) as u16) as f64
        }
        (HostBuf::Bf16(xs), Kernel::Max) => {
            bf16_to_f32(lane_max(xs, |x: u16| (x & 0x7fff) as i16) as u16) as f64
        }
        // f64 input is always accumulated in f64.
        (HostBuf::F64(xs), Kernel::Abs) => lane_sum(xs, |x: f64| x.abs()),
        (HostBuf::F64(xs), Kernel::Square) => lane_sum(xs, |x: f64| x * x),
        (HostBuf::F64(xs), Kernel::Pow(p)) => lane_sum(xs, |x: f64| x.abs().powf(p)),
        (HostBuf::F32(xs), _) => sum_f32_family(xs, |x: f32| x, kernel, acc_f64),
        (HostBuf::F16(xs), _) => sum_f32_family(xs, f16_to_f32, kernel, acc_f64),
        (HostBuf::Bf16(xs), _) => sum_f32_family(xs, bf16_to_f32, kernel, acc_f64),
    }
}

#[inline(always)]
fn scale_kernel(buf: &mut HostBufMut<'_>, coef: f64) {
    // Like torch's `mul_` by a Python float: f64 for f64 tensors, f32 arithmetic ("opmath")
    // for f32, f16 and bf16, then one rounding (to nearest even) to the storage type.
    let c32 = coef as f32;
    match buf {
        HostBufMut::F64(xs) => xs.iter_mut().for_each(|x| *x *= coef),
        HostBufMut::F32(xs) => xs.iter_mut().for_each(|x| *x *= c32),
        HostBufMut::F16(xs) => xs.iter_mut().for_each(|x| *x = f32_to_f16(f16_to_f32(*x) * c32)),
        HostBufMut::Bf16(xs) => xs.iter_mut().for_each(|x| *x = f32_to_bf16(bf16_to_f32(*x) * c32)),
    }
}

/// The instruction set chosen at run time. The kernels give identical results on every path
/// (NaN payloads aside): the lane structure is explicit, so vector width never reorders a sum.
#[derive(Clone, Copy)]
struct Isa {
    /// AVX2 and F16C (every AVX2 CPU has F16C).
    #[cfg(target_arch = "x86_64")]
    avx2: bool,
}

impl Isa {
    fn detect() -> Isa {
        Isa {
            #[cfg(target_arch = "x86_64")]
            avx2: std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c"),
        }
    }

    fn block(self, buf: HostBuf<'_>, kernel: Kernel, acc_f64: bool) -> f64 {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: the CPU supports AVX2 and F16C (checked at run time above).
            return unsafe { x86::block(buf, kernel, acc_f64) };
        }
        block_kernel(buf, kernel, acc_f64)
    }

    fn scale(self, buf: &mut HostBufMut<'_>, coef: f64) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: as above.
            return unsafe { x86::scale(buf, coef) };
        }
        scale_kernel(buf, coef)
    }
}

/// Explicit AVX2 (+ F16C for binary16) kernels for the common cases; the others (p through
/// `powf`) are the portable kernels compiled for AVX2. The p-sum kernels keep the lane layout
/// of [`lane_sum`] (element i of each 16-element chunk in accumulator lane i; with f64
/// accumulators lanes 4k..4k+3 live in register k, with f32 lanes 8k..8k+7), then finish with
/// the same scalar tail and lane combine, so they return exactly what the portable kernels
/// return. Max is an integer max on sign-cleared bits, which no order changes.
#[cfg(target_arch = "x86_64")]
// Lane k of the accumulators takes part k of each chunk: indexed loops say so plainly.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        HostBuf, HostBufMut, Kernel, LANES, bf16_to_f32, block_kernel, f16_to_f32, lane_finish, lane_tail,
        scale_kernel,
    };

    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;

    /// Eight elements of kind `E` at `p` as f32 (exact conversions).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8<T, const E: u8>(p: *const T) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at p.
        unsafe {
            match E {
                F32 => _mm256_loadu_ps(p.cast()),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                    p.cast(),
                )))),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn term64<const SQUARE: bool>(v: __m256d) -> __m256d {
        if SQUARE { _mm256_mul_pd(v, v) } else { _mm256_andnot_pd(_mm256_set1_pd(-0.0), v) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn term32<const SQUARE: bool>(v: __m256) -> __m256 {
        if SQUARE { _mm256_mul_ps(v, v) } else { _mm256_andnot_ps(_mm256_set1_ps(-0.0), v) }
    }

    /// Σ x² (SQUARE) or Σ|x| of f32/f16/bf16 elements in 16 f64 lanes.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn sum_f64<T: Copy, const E: u8, const SQUARE: bool>(xs: &[T], decode: fn(T) -> f32) -> f64 {
        let chunks = xs.len() / LANES;
        let mut a = [_mm256_setzero_pd(); 4];
        let mut acc = [0.0f64; LANES];
        // SAFETY: chunk c reads elements 16c..16c+16 < len; acc has 16 lanes.
        unsafe {
            for c in 0..chunks {
                let p = xs.as_ptr().add(c * LANES);
                let (lo, hi) = (load8::<T, E>(p), load8::<T, E>(p.add(8)));
                let v = [
                    _mm256_cvtps_pd(_mm256_castps256_ps128(lo)),
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(lo)),
                    _mm256_cvtps_pd(_mm256_castps256_ps128(hi)),
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(hi)),
                ];
                for k in 0..4 {
                    a[k] = _mm256_add_pd(a[k], term64::<SQUARE>(v[k]));
                }
            }
            for k in 0..4 {
                _mm256_storeu_pd(acc.as_mut_ptr().add(4 * k), a[k]);
            }
        }
        lane_tail(&mut acc, &xs[chunks * LANES..], |x| {
            let v = decode(x) as f64;
            if SQUARE { v * v } else { v.abs() }
        });
        lane_finish(acc)
    }

    /// Σ x² (SQUARE) or Σ|x| of f32/f16/bf16 elements in 16 f32 lanes.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn sum_f32<T: Copy, const E: u8, const SQUARE: bool>(xs: &[T], decode: fn(T) -> f32) -> f64 {
        let chunks = xs.len() / LANES;
        let mut a = [_mm256_setzero_ps(); 2];
        let mut acc = [0.0f32; LANES];
        // SAFETY: as in sum_f64.
        unsafe {
            for c in 0..chunks {
                let p = xs.as_ptr().add(c * LANES);
                a[0] = _mm256_add_ps(a[0], term32::<SQUARE>(load8::<T, E>(p)));
                a[1] = _mm256_add_ps(a[1], term32::<SQUARE>(load8::<T, E>(p.add(8))));
            }
            _mm256_storeu_ps(acc.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(acc.as_mut_ptr().add(8), a[1]);
        }
        lane_tail(&mut acc, &xs[chunks * LANES..], |x| {
            let v = decode(x);
            if SQUARE { v * v } else { v.abs() }
        });
        lane_finish(acc)
    }

    /// Σ x² (SQUARE) or Σ|x| of f64 elements in 16 f64 lanes.
    #[target_feature(enable = "avx2")]
    unsafe fn sum_native_f64<const SQUARE: bool>(xs: &[f64]) -> f64 {
        let chunks = xs.len() / LANES;
        let mut a = [_mm256_setzero_pd(); 4];
        let mut acc = [0.0f64; LANES];
        // SAFETY: as in sum_f64.
        unsafe {
            for c in 0..chunks {
                let p = xs.as_ptr().add(c * LANES);
                for k in 0..4 {
                    a[k] = _mm256_add_pd(a[k], term64::<SQUARE>(_mm256_loadu_pd(p.add(4 * k))));
                }
            }
            for k in 0..4 {
                _mm256_storeu_pd(acc.as_mut_ptr().add(4 * k), a[k]);
            }
        }
        lane_tail(&mut acc, &xs[chunks * LANES..], |x: f64| if SQUARE { x * x } else { x.abs() });
        lane_finish(acc)
    }

    /// max of the sign-cleared 16-bit patterns (f16 and bf16 alike), as a pattern.
    #[target_feature(enable = "avx2")]
    unsafe fn max_bits16(xs: &[u16]) -> u16 {
        const STEP: usize = 64;
        let chunks = xs.len() / STEP;
        let mask = _mm256_set1_epi16(0x7fff);
        let mut a = [_mm256_setzero_si256(); 4];
        let mut lanes = [0i16; 16];
        // SAFETY: chunk c reads elements 64c..64c+64 < len; lanes holds 16 i16.
        unsafe {
            for c in 0..chunks {
                let p = xs.as_ptr().add(c * STEP);
                for k in 0..4 {
                    let v = _mm256_loadu_si256(p.add(16 * k).cast());
                    a[k] = _mm256_max_epi16(a[k], _mm256_and_si256(v, mask));
                }
            }
            let m = _mm256_max_epi16(_mm256_max_epi16(a[0], a[1]), _mm256_max_epi16(a[2], a[3]));
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), m);
        }
        let tail = xs[chunks * STEP..].iter().map(|&x| (x & 0x7fff) as i16);
        lanes.into_iter().chain(tail).max().unwrap_or(0) as u16
    }

    /// max of the sign-cleared f32 patterns, as a pattern.
    #[target_feature(enable = "avx2")]
    unsafe fn max_bits32(xs: &[f32]) -> u32 {
        const STEP: usize = 32;
        let chunks = xs.len() / STEP;
        let mask = _mm256_set1_epi32(0x7fff_ffff);
        let mut a = [_mm256_setzero_si256(); 4];
        let mut lanes = [0i32; 8];
        // SAFETY: chunk c reads elements 32c..32c+32 < len; lanes holds 8 i32.
        unsafe {
            for c in 0..chunks {
                let p = xs.as_ptr().add(c * STEP);
                for k in 0..4 {
                    let v = _mm256_loadu_si256(p.add(8 * k).cast());
                    a[k] = _mm256_max_epi32(a[k], _mm256_and_si256(v, mask));
                }
            }
            let m = _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]));
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), m);
        }
        let tail = xs[chunks * STEP..].iter().map(|&x| (x.to_bits() & 0x7fff_ffff) as i32);
        lanes.into_iter().chain(tail).max().unwrap_or(0) as u32
    }

    /// bf16 × c in f32, rounded to nearest even (NaN: quiet, sign kept), 8 at a time.
    #[target_feature(enable = "avx2")]
    unsafe fn scale_bf16(xs: &mut [u16], c: f32) {
        let chunks = xs.len() / 8;
        let cv = _mm256_set1_ps(c);
        let one = _mm256_set1_epi32(1);
        let round = _mm256_set1_epi32(0x7fff);
        let quiet = _mm256_set1_epi32(0x40);
        // SAFETY: chunk i reads and writes elements 8i..8i+8 < len.
        unsafe {
            for i in 0..chunks {
                let p = xs.as_mut_ptr().add(8 * i);
                let bits = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())));
                let y = _mm256_mul_ps(_mm256_castsi256_ps(bits), cv);
                let b = _mm256_castps_si256(y);
                let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), one);
                let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, _mm256_add_epi32(round, odd)));
                let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), quiet);
                let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(y, y));
                let out = _mm256_blendv_epi8(rounded, nan, is_nan);
                let packed =
                    _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256::<1>(out));
                _mm_storeu_si128(p.cast(), packed);
            }
        }
        for x in &mut xs[chunks * 8..] {
            *x = super::f32_to_bf16(bf16_to_f32(*x) * c);
        }
    }

    /// f16 × c in f32, rounded to nearest even by F16C, 8 at a time.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn scale_f16(xs: &mut [u16], c: f32) {
        let chunks = xs.len() / 8;
        let cv = _mm256_set1_ps(c);
        // SAFETY: chunk i reads and writes elements 8i..8i+8 < len.
        unsafe {
            for i in 0..chunks {
                let p = xs.as_mut_ptr().add(8 * i);
                let y = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(p.cast())), cv);
                _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y));
            }
        }
        for x in &mut xs[chunks * 8..] {
            *x = super::f32_to_f16(f16_to_f32(*x) * c);
        }
    }

    /// Scaling on AVX2 + F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn scale(buf: &mut HostBufMut<'_>, coef: f64) {
        // SAFETY: the caller checked AVX2 and F16C.
        unsafe {
            match buf {
                HostBufMut::Bf16(x) => scale_bf16(x, coef as f32),
                HostBufMut::F16(x) => scale_f16(x, coef as f32),
                _ => scale_kernel(buf, coef),
            }
        }
    }

    /// One block on AVX2 + F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn block(buf: HostBuf<'_>, kernel: Kernel, acc_f64: bool) -> f64 {
        use Kernel::{Abs, Max, Square};
        // SAFETY: the caller checked AVX2 and F16C; the kernels read within their slices.
        unsafe {
            match (buf, kernel, acc_f64) {
                (HostBuf::Bf16(x), Square, true) => sum_f64::<u16, BF16, true>(x, bf16_to_f32),
                (HostBuf::Bf16(x), Abs, true) => sum_f64::<u16, BF16, false>(x, bf16_to_f32),
                (HostBuf::Bf16(x), Square, false) => sum_f32::<u16, BF16, true>(x, bf16_to_f32),
                (HostBuf::Bf16(x), Abs, false) => sum_f32::<u16, BF16, false>(x, bf16_to_f32),
                (HostBuf::F16(x), Square, true) => sum_f64::<u16, F16, true>(x, f16_to_f32),
                (HostBuf::F16(x), Abs, true) => sum_f64::<u16, F16, false>(x, f16_to_f32),
                (HostBuf::F16(x), Square, false) => sum_f32::<u16, F16, true>(x, f16_to_f32),
                (HostBuf::F16(x), Abs, false) => sum_f32::<u16, F16, false>(x, f16_to_f32),
                (HostBuf::F32(x), Square, true) => sum_f64::<f32, F32, true>(x, |v| v),
                (HostBuf::F32(x), Abs, true) => sum_f64::<f32, F32, false>(x, |v| v),
                (HostBuf::F32(x), Square, false) => sum_f32::<f32, F32, true>(x, |v| v),
                (HostBuf::F32(x), Abs, false) => sum_f32::<f32, F32, false>(x, |v| v),
                (HostBuf::F64(x), Square, _) => sum_native_f64::<true>(x),
                (HostBuf::F64(x), Abs, _) => sum_native_f64::<false>(x),
                (HostBuf::Bf16(x), Max, _) => bf16_to_f32(max_bits16(x)) as f64,
                (HostBuf::F16(x), Max, _) => f16_to_f32(max_bits16(x)) as f64,
                (HostBuf::F32(x), Max, _) => f32::from_bits(max_bits32(x)) as f64,
                _ => block_kernel(buf, kernel, acc_f64),
            }
        }
    }
}

/// max that propagates NaN (f64::max ignores it).
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

fn default_threads(total_elems: usize) -> usize {
    if total_elems < PARALLEL_MIN_ELEMS {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// The local value of one reduction set: Σ|x|^p over all elements of all buffers, or max |x|
/// for p = inf (any NaN gives NaN; no elements give 0). `accumulate_f64` chooses f64
/// accumulators (the default for p-sums; f64 buffers always use f64); with f32 accumulators the
/// per-block sums are still combined in f64. Large inputs (≥ [`PARALLEL_MIN_ELEMS`] elements)
/// use all available cores; the result does not depend on the number of threads.
pub fn local_power_sum(bufs: &[HostBuf], norm: NormType, accumulate_f64: bool) -> f64 {
    let total = bufs.iter().map(HostBuf::len).sum();
    local_power_sum_threads(bufs, norm, accumulate_f64, default_threads(total))
}

/// [`local_power_sum`] on at most `threads` threads (0 and 1 both mean the calling thread
/// alone). The result is bit-for-bit the same for every `threads`.
pub fn local_power_sum_threads(
    bufs: &[HostBuf],
    norm: NormType,
    accumulate_f64: bool,
    threads: usize,
) -> f64 {
    let kernel = Kernel::of(norm);
    let isa = Isa::detect();
    let fold = |acc: f64, v: f64| if norm.is_max() { nan_max(acc, v) } else { acc + v };
    let blocks = bufs.iter().flat_map(|buf| {
        let len = buf.len();
        (0..len.div_ceil(BLOCK_ELEMS))
            .map(move |b| buf.slice(b * BLOCK_ELEMS, ((b + 1) * BLOCK_ELEMS).min(len)))
    });
    let total: usize = bufs.iter().map(HostBuf::len).sum();
    let threads = threads.min(total.div_ceil(BLOCK_ELEMS));
    if threads <= 1 {
        return blocks.map(|b| isa.block(b, kernel, accumulate_f64)).fold(0.0, fold);
    }
    let blocks: Vec<HostBuf> = blocks.collect();
    let mut partials = vec![0.0f64; blocks.len()];
    let per_thread = blocks.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut work = blocks.chunks(per_thread).zip(partials.chunks_mut(per_thread));
        let own = work.next();
        for (chunk, out) in work {
            scope.spawn(move || {
                for (b, o) in chunk.iter().zip(out) {
                    *o = isa.block(*b, kernel, accumulate_f64);
                }
            });
        }
        if let Some((chunk, out)) = own {
            for (b, o) in chunk.iter().zip(out) {
                *o = isa.block(*b, kernel, accumulate_f64);
            }
        }
    });
    partials.into_iter().fold(0.0, fold)
}

/// The total norm from the reduced per-set values: their sum (or max for p = inf, NaN
/// propagating) in order, then the p-th root (p = 1: as is; p = 2: `sqrt`; else `powf(1/p)`).
pub fn combine(partials: &[f64], norm: NormType) -> f64 {
    match norm {
        NormType::Inf => partials.iter().copied().fold(0.0, nan_max),
        NormType::P(p) => {
            let sum = partials.iter().fold(0.0, |acc, &v| acc + v);
            if p == 1.0 {
                sum
            } else if p == 2.0 {
                sum.sqrt()
            } else {
                sum.powf(1.0 / p)
            }
        }
    }
}

/// `min(max_norm / (total_norm + 1e-6), 1.0)`, as the seed and torch compute it. A NaN ratio
/// (NaN norm, or inf / inf) gives 1.0, i.e. no scaling, like the seed's Python `min`; an
/// infinite norm with a finite `max_norm` gives 0.0.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    let coef = max_norm / (total_norm + 1e-6);
    if coef.is_nan() { 1.0 } else { coef.min(1.0) }
}

/// Multiplies every element by `coef` in place (fused over all buffers): f64 buffers in f64,
/// the others in f32 arithmetic rounded once to the storage type (to nearest, ties to even).
/// Large inputs (≥ [`PARALLEL_MIN_ELEMS`] elements) use all available cores.
pub fn scale_in_place(bufs: &mut [HostBufMut], coef: f64) {
    let total = bufs.iter().map(HostBufMut::len).sum();
    scale_in_place_threads(bufs, coef, default_threads(total));
}

/// [`scale_in_place`] on at most `threads` threads.
pub fn scale_in_place_threads(bufs: &mut [HostBufMut], coef: f64, threads: usize) {
    let isa = Isa::detect();
    let total: usize = bufs.iter().map(HostBufMut::len).sum();
    let threads = threads.min(total.div_ceil(BLOCK_ELEMS));
    if threads <= 1 {
        for buf in bufs.iter_mut() {
            isa.scale(buf, coef);
        }
        return;
    }
    let mut pieces = Vec::new();
    for buf in bufs.iter_mut() {
        buf.blocks_mut(BLOCK_ELEMS, &mut pieces);
    }
    let per_thread = pieces.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut work = pieces.chunks_mut(per_thread);
        let own = work.next();
        for chunk in work {
            scope.spawn(move || chunk.iter_mut().for_each(|b| isa.scale(b, coef)));
        }
        if let Some(chunk) = own {
            chunk.iter_mut().for_each(|b| isa.scale(b, coef));
        }
    });
}

// ---------------------------------------------------------------------------------------------
// The whole algorithm.

/// Options of [`clip_grad_norm_with`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipOptions {
    pub norm: NormType,
    /// The largest total norm left unscaled; must be ≥ 0 (inf: never scale).
    pub max_norm: f64,
    /// Return an error (gradients untouched) rather than the value when the total is nan/inf.
    pub error_if_nonfinite: bool,
    /// Accumulate the p-power sums of f32/f16/bf16 gradients in f64 (default) or f32.
    pub accumulate_f64: bool,
}

impl Default for ClipOptions {
    fn default() -> ClipOptions {
        ClipOptions { norm: NormType::P(2.0), max_norm: 1.0, error_if_nonfinite: false, accumulate_f64: true }
    }
}

/// The error for a non-finite total norm; its prefix is torch's `clip_grad_norm_` text.
pub(crate) fn nonfinite_error(norm: NormType, total: f64) -> Error {
    Error::invalid(format!(
        "The total norm of order {:?} for gradients from `parameters` is non-finite ({total:?}), so it \
         cannot be clipped; the gradients were left unchanged. To get the value back instead of this \
         error, set `error_if_nonfinite=False`",
        norm.p()
    ))
}

/// [`clip_grad_norm_with`] with f64 accumulation.
pub fn clip_grad_norm(
    plan: &NormPlan,
    grads: &mut [(usize, HostBufMut)],
    norm: NormType,
    max_norm: f64,
    error_if_nonfinite: bool,
    reduce: &mut dyn FnMut(usize, f64, bool) -> Result<f64>,
) -> Result<f64> {
    let options = ClipOptions { norm, max_norm, error_if_nonfinite, accumulate_f64: true };
    clip_grad_norm_with(plan, grads, &options, reduce)
}

/// Computes the total norm of the gradients described by `plan` and clips them in place.
///
/// `grads` holds this rank's local gradients as (index into `plan.grad_set`, buffer); a
/// gradient this rank does not hold is simply absent. `reduce(set_index, value, is_max)` must
/// reduce `value` (SUM, or MAX when `is_max`) over the mesh dims `plan.sets[set_index]` and
/// return the result; it is called once per set with a non-empty set of dims, in set order, on
/// every rank, also when the rank holds no gradient of that set (value 0). The empty set needs
/// no collective and is not passed to `reduce`.
///
/// Then the total norm is [`combine`]d, and when it is finite the gradients are multiplied by
/// [`clip_coefficient`] if that is below 1. A non-finite total (nan or inf) leaves the
/// gradients untouched (the seed multiplies by 0 for inf, turning inf entries into nan) and is
/// returned, or is an error when `error_if_nonfinite`. Bad arguments and `reduce` errors are
/// reported before any gradient is modified.
pub fn clip_grad_norm_with(
    plan: &NormPlan,
    grads: &mut [(usize, HostBufMut)],
    options: &ClipOptions,
    reduce: &mut dyn FnMut(usize, f64, bool) -> Result<f64>,
) -> Result<f64> {
    let norm = options.norm.checked()?;
    if options.max_norm.is_nan() || options.max_norm < 0.0 {
        return Err(Error::invalid(format!(
            "max_norm must be a number >= 0 (inf disables clipping), got {:?}",
            options.max_norm
        )));
    }
    if let Some((i, &s)) = plan.grad_set.iter().enumerate().find(|&(_, &s)| s >= plan.sets.len()) {
        return Err(Error::invalid(format!(
            "invalid NormPlan: gradient {i} refers to set {s}, but the plan has {} sets",
            plan.sets.len()
        )));
    }
    let mut seen = vec![false; plan.grad_set.len()];
    let mut per_set: Vec<Vec<HostBuf>> = vec![Vec::new(); plan.sets.len()];
    for (k, (index, buf)) in grads.iter().enumerate() {
        let index = *index;
        if index >= plan.grad_set.len() {
            return Err(Error::invalid(format!(
                "grads[{k}] refers to gradient {index}, but the plan describes {} gradients",
                plan.grad_set.len()
            )));
        }
        if std::mem::replace(&mut seen[index], true) {
            return Err(Error::invalid(format!(
                "grads[{k}] refers to gradient {index}, which an earlier entry already gave"
            )));
        }
        per_set[plan.grad_set[index]].push(buf.as_buf());
    }

    let mut values = Vec::with_capacity(plan.sets.len());
    for (set, bufs) in plan.sets.iter().zip(&per_set) {
        let local = local_power_sum(bufs, norm, options.accumulate_f64);
        values.push((set, local));
    }
    drop(per_set);
    let mut reduced = Vec::with_capacity(values.len());
    for (index, (set, local)) in values.into_iter().enumerate() {
        reduced.push(if set.is_empty() { local } else { reduce(index, local, norm.is_max())? });
    }

    let total = combine(&reduced, norm);
    if !total.is_finite() {
        return if options.error_if_nonfinite { Err(nonfinite_error(norm, total)) } else { Ok(total) };
    }
    let coef = clip_coefficient(total, options.max_norm);
    if coef < 1.0 {
        let mut bufs: Vec<HostBufMut> = grads.iter_mut().map(|(_, buf)| buf.reborrow()).collect();
        scale_in_place(&mut bufs, coef);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_agrees_with_and_without_avx2_for_every_pattern() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let portable = Isa {
            #[cfg(target_arch = "x86_64")]
            avx2: false,
        };
        let detected = Isa::detect();
        for coef in [0.3, 1e-3, 0.999_999, 1.0 + 2f64.powi(-8), 1e-30, 0.0, 7.5] {
            for bf16 in [true, false] {
                let (mut a, mut b) = (all.clone(), all.clone());
                let (mut ha, mut hb) = if bf16 {
                    (HostBufMut::Bf16(&mut a), HostBufMut::Bf16(&mut b))
                } else {
                    (HostBufMut::F16(&mut a), HostBufMut::F16(&mut b))
                };
                portable.scale(&mut ha, coef);
                detected.scale(&mut hb, coef);
                let value = |x: u16| if bf16 { bf16_to_f32(x) } else { f16_to_f32(x) };
                for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
                    if value(x).is_nan() {
                        assert!(value(y).is_nan(), "bf16={bf16} coef={coef} input {i:#06x}");
                    } else {
                        assert_eq!(x, y, "bf16={bf16} coef={coef} input {i:#06x}");
                    }
                }
            }
        }
    }

    #[test]
    fn kernels_agree_with_and_without_avx2() {
        // Magnitudes from f16 subnormals to large values, both signs.
        let xs: Vec<f32> =
            (0..10_007).map(|i| (((i * 7919) % 2003) as f32 - 1001.0) * 2f32.powi(i % 40 - 30)).collect();
        let bf: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
        let hf: Vec<u16> = xs.iter().map(|&x| f32_to_f16(x)).collect();
        let f64s: Vec<f64> = xs.iter().map(|&x| x as f64 * 1.1).collect();
        let portable = Isa {
            #[cfg(target_arch = "x86_64")]
            avx2: false,
        };
        let detected = Isa::detect();
        for kernel in [Kernel::Abs, Kernel::Square, Kernel::Pow(3.5), Kernel::Max] {
            for acc in [false, true] {
                for len in [0, 1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 10_007] {
                    let bufs = [
                        HostBuf::F32(&xs[..len]),
                        HostBuf::Bf16(&bf[..len]),
                        HostBuf::F16(&hf[..len]),
                        HostBuf::F64(&f64s[..len]),
                    ];
                    for buf in bufs {
                        let a = portable.block(buf, kernel, acc);
                        let b = detected.block(buf, kernel, acc);
                        assert_eq!(a.to_bits(), b.to_bits(), "{kernel:?} acc_f64={acc} len={len}");
                    }
                }
            }
        }
    }
}
