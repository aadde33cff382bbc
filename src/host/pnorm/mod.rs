//! The gradient norm's host kernels: p-power sums and in-place scaling over lists of buffers.
//!
//! Chunked loops with 16 independent accumulators; p = 1, p = 2 and p = inf have their own
//! loops (explicit AVX2 + F16C code chosen at run time on x86-64, `x86.rs`; portable loops the
//! compiler vectorises elsewhere), other p go through `powf`. bf16 is widened by a bit shift,
//! binary16 by F16C or an exact branch-free conversion. Inputs of at least
//! [`PARALLEL_MIN_ELEMS`](super::PARALLEL_MIN_ELEMS) elements are split over the available cores with
//! `std::thread::scope`. Results are bit-for-bit independent of the thread count and of the
//! instruction set (NaN payloads aside): each buffer is cut into fixed blocks of
//! [`BLOCK_ELEMS`] elements, element i of a block always goes to accumulator i mod 16, and the
//! block results are combined sequentially in buffer and block order.

use super::buf::{HostBuf, HostBufMut};
use super::threads::default_threads;
use crate::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Elements per block: the unit of work of a thread and of the deterministic combine.
/// cbindgen:ignore
pub const BLOCK_ELEMS: usize = 1 << 16;
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
    /// The kernel of the norm of order `p` (+inf: the max).
    fn of(p: f64) -> Kernel {
        if p == f64::INFINITY {
            Kernel::Max
        } else if p == 1.0 {
            Kernel::Abs
        } else if p == 2.0 {
            Kernel::Square
        } else {
            Kernel::Pow(p)
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
mod x86;

/// max that propagates NaN (f64::max ignores it).
pub(crate) fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

/// Σ|x|^p over all elements of all buffers, or max |x| for p = inf (any NaN gives NaN; no
/// elements give 0), for a checked p > 0. `accumulate_f64` chooses f64 accumulators (f64
/// buffers always use f64); with f32 accumulators the per-block sums are still combined in f64.
/// `threads`: at most that many (0 and 1: the calling thread alone); `None`: all available
/// cores from [`PARALLEL_MIN_ELEMS`](super::PARALLEL_MIN_ELEMS) elements. The result is bit-for-bit the same for every
/// thread count.
pub fn power_sum(bufs: &[HostBuf], p: f64, accumulate_f64: bool, threads: Option<usize>) -> f64 {
    let kernel = Kernel::of(p);
    let is_max = matches!(kernel, Kernel::Max);
    let isa = Isa::detect();
    let fold = |acc: f64, v: f64| if is_max { nan_max(acc, v) } else { acc + v };
    let blocks = bufs.iter().flat_map(|buf| {
        let len = buf.len();
        (0..len.div_ceil(BLOCK_ELEMS))
            .map(move |b| buf.slice(b * BLOCK_ELEMS, ((b + 1) * BLOCK_ELEMS).min(len)))
    });
    let total: usize = bufs.iter().map(HostBuf::len).sum();
    let threads = threads.unwrap_or_else(|| default_threads(total)).min(total.div_ceil(BLOCK_ELEMS));
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

/// Multiplies every element by `coef` in place (fused over all buffers): f64 buffers in f64,
/// the others in f32 arithmetic rounded once to the storage type (to nearest, ties to even).
/// Large inputs (≥ [`PARALLEL_MIN_ELEMS`](super::PARALLEL_MIN_ELEMS) elements) use all available cores.
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
