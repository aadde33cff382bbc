//! The gradient norm's host kernels: p-power sums and in-place scaling over lists of buffers.
//!
//! Chunked loops with 16 independent accumulators; p = 1, p = 2 and p = inf have their own
//! loops (explicit AVX2 + F16C code on the AVX2 and AVX-512 paths of [`super::isa`], `x86.rs`;
//! portable loops the compiler vectorises elsewhere), other p go through `powf`. bf16 is widened by a bit shift,
//! binary16 by F16C or an exact branch-free conversion. Inputs of at least
//! [`PARALLEL_MIN_ELEMS`](super::PARALLEL_MIN_ELEMS) elements are split over the available cores with
//! the host workers (`super::threads`). Results are bit-for-bit independent of the thread count and of the
//! instruction set (NaN payloads aside): each buffer is cut into fixed blocks of
//! [`BLOCK_ELEMS`] elements, element i of a block always goes to accumulator i mod 16, and the
//! block results are combined sequentially in buffer and block order.

use super::buf::{HostBuf, HostBufMut};
use super::isa::{self, Isa};
use super::threads::{default_threads, for_each_part};
use crate::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::error::Result;

/// Elements per block: the unit of work of a thread and of the deterministic combine.
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

/// One block on `isa`: the explicit AVX2 + F16C kernels on the SIMD paths, the portable ones
/// otherwise. The results are identical (NaN payloads aside): the lane structure is explicit,
/// so vector width never reorders a sum.
fn block(isa: Isa, buf: HostBuf<'_>, kernel: Kernel, acc_f64: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: the CPU has AVX2 and F16C (`isa` comes from `isa::current`; AVX-512 CPUs
        // have them too).
        return unsafe { x86::block(buf, kernel, acc_f64) };
    }
    let _ = isa;
    block_kernel(buf, kernel, acc_f64)
}

/// Scales one buffer on `isa`, as [`block`] chooses its kernels.
fn scale(isa: Isa, buf: &mut HostBufMut<'_>, coef: f64) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: as in `block`.
        return unsafe { x86::scale(buf, coef) };
    }
    let _ = isa;
    scale_kernel(buf, coef)
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
/// cores from [`PARALLEL_MIN_ELEMS`](super::PARALLEL_MIN_ELEMS) elements. The result is
/// bit-for-bit the same for every thread count and instruction set. Fails only on a bad
/// `FSDPTURBO_HOST_ISA` ([`super::isa`]).
pub fn power_sum(bufs: &[HostBuf], p: f64, accumulate_f64: bool, threads: Option<usize>) -> Result<f64> {
    Ok(power_sum_on(isa::current()?, bufs, p, accumulate_f64, threads))
}

/// [`power_sum`] on `isa`.
fn power_sum_on(isa: Isa, bufs: &[HostBuf], p: f64, accumulate_f64: bool, threads: Option<usize>) -> f64 {
    let kernel = Kernel::of(p);
    let is_max = matches!(kernel, Kernel::Max);
    let fold = |acc: f64, v: f64| if is_max { nan_max(acc, v) } else { acc + v };
    let blocks = bufs.iter().flat_map(|buf| {
        let len = buf.len();
        (0..len.div_ceil(BLOCK_ELEMS))
            .map(move |b| buf.slice(b * BLOCK_ELEMS, ((b + 1) * BLOCK_ELEMS).min(len)))
    });
    let total: usize = bufs.iter().map(HostBuf::len).sum();
    let threads = threads.unwrap_or_else(|| default_threads(total)).min(total.div_ceil(BLOCK_ELEMS));
    if threads <= 1 {
        return blocks.map(|b| block(isa, b, kernel, accumulate_f64)).fold(0.0, fold);
    }
    let blocks: Vec<HostBuf> = blocks.collect();
    let mut partials = vec![0.0f64; blocks.len()];
    let per_thread = blocks.len().div_ceil(threads);
    let parts = blocks.chunks(per_thread).zip(partials.chunks_mut(per_thread)).collect();
    for_each_part(parts, |(chunk, out): (&[HostBuf], &mut [f64])| {
        for (b, o) in chunk.iter().zip(out) {
            *o = block(isa, *b, kernel, accumulate_f64);
        }
    });
    partials.into_iter().fold(0.0, fold)
}

/// Multiplies every element by `coef` in place (fused over all buffers): f64 buffers in f64,
/// the others in f32 arithmetic rounded once to the storage type (to nearest, ties to even).
/// Large inputs (≥ [`PARALLEL_MIN_ELEMS`](super::PARALLEL_MIN_ELEMS) elements) use all available
/// cores. The results are the same bits on every instruction set (NaN payloads aside). Fails
/// only on a bad `FSDPTURBO_HOST_ISA` ([`super::isa`]).
pub fn scale_in_place(bufs: &mut [HostBufMut], coef: f64) -> Result<()> {
    let total = bufs.iter().map(HostBufMut::len).sum();
    scale_in_place_threads(bufs, coef, default_threads(total))
}

/// [`scale_in_place`] on at most `threads` threads.
pub fn scale_in_place_threads(bufs: &mut [HostBufMut], coef: f64, threads: usize) -> Result<()> {
    scale_on(isa::current()?, bufs, coef, threads);
    Ok(())
}

/// [`scale_in_place_threads`] on `isa`.
fn scale_on(isa: Isa, bufs: &mut [HostBufMut], coef: f64, threads: usize) {
    let total: usize = bufs.iter().map(HostBufMut::len).sum();
    let threads = threads.min(total.div_ceil(BLOCK_ELEMS));
    if threads <= 1 {
        for buf in bufs.iter_mut() {
            scale(isa, buf, coef);
        }
        return;
    }
    let mut pieces = Vec::new();
    for buf in bufs.iter_mut() {
        buf.blocks_mut(BLOCK_ELEMS, &mut pieces);
    }
    let per_thread = pieces.len().div_ceil(threads);
    let parts = pieces.chunks_mut(per_thread).collect();
    for_each_part(parts, |chunk: &mut [HostBufMut]| chunk.iter_mut().for_each(|b| scale(isa, b, coef)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::isa::Capabilities;

    /// The instruction sets this host runs besides the portable loops.
    fn simd_paths() -> Vec<Isa> {
        let supported = Capabilities::detect().supported();
        if supported.len() == 1 {
            eprintln!("only the portable loops run on this host: nothing to compare them with");
        }
        supported[1..].to_vec()
    }

    /// Equal bits, or both NaN (payloads may differ).
    fn same(a: f64, b: f64) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// Magnitudes from f16 subnormals to large values, both signs, then ±0, ±inf and NaN.
    fn inputs(len: usize, specials: bool) -> Vec<f32> {
        let mut xs: Vec<f32> =
            (0..len).map(|i| (((i * 7919) % 2003) as f32 - 1001.0) * 2f32.powi(i as i32 % 40 - 30)).collect();
        if specials {
            for (k, v) in
                [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-45].into_iter().enumerate()
            {
                xs[(k * 37) % len] = v;
            }
        }
        xs
    }

    #[test]
    fn scaling_agrees_on_every_instruction_set_for_every_pattern_and_type() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let xs = inputs(10_007, true);
        let f64s: Vec<f64> = xs.iter().map(|&x| x as f64 * 1.1).collect();
        for isa in simd_paths() {
            for coef in [0.3, 1e-3, 0.999_999, 1.0 + 2f64.powi(-8), 1e-30, 0.0, 7.5] {
                for bf16 in [true, false] {
                    let (mut a, mut b) = (all.clone(), all.clone());
                    let (ha, hb) = if bf16 {
                        (HostBufMut::Bf16(&mut a), HostBufMut::Bf16(&mut b))
                    } else {
                        (HostBufMut::F16(&mut a), HostBufMut::F16(&mut b))
                    };
                    scale_on(Isa::Portable, &mut [ha], coef, 1);
                    scale_on(isa, &mut [hb], coef, 1);
                    let value = |x: u16| if bf16 { bf16_to_f32(x) } else { f16_to_f32(x) };
                    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
                        let what = format!("{isa:?} bf16={bf16} coef={coef} input {i:#06x}");
                        assert!(x == y || (value(x).is_nan() && value(y).is_nan()), "{what}");
                    }
                }
                let (mut a, mut b) = ((xs.clone(), f64s.clone()), (xs.clone(), f64s.clone()));
                scale_on(Isa::Portable, &mut [HostBufMut::F32(&mut a.0), HostBufMut::F64(&mut a.1)], coef, 1);
                scale_on(isa, &mut [HostBufMut::F32(&mut b.0), HostBufMut::F64(&mut b.1)], coef, 1);
                let f32_same = a.0.iter().zip(&b.0).all(|(&x, &y)| same(x as f64, y as f64));
                assert!(f32_same && a.1.iter().zip(&b.1).all(|(&x, &y)| same(x, y)), "{isa:?} coef={coef}");
            }
        }
    }

    #[test]
    fn power_sums_agree_on_every_instruction_set_for_every_p_and_type() {
        let simd = simd_paths();
        // Lengths around the 16 lanes and the 32/64-element max loops, and above a block.
        let long = 2 * BLOCK_ELEMS + 1001;
        for specials in [false, true] {
            let xs = inputs(long, specials);
            let bf: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
            let hf: Vec<u16> = xs.iter().map(|&x| f32_to_f16(x)).collect();
            let f64s: Vec<f64> = xs.iter().map(|&x| x as f64 * 1.1).collect();
            for p in [1.0, 2.0, 3.5, 0.5, f64::INFINITY] {
                for acc in [false, true] {
                    for len in [0, 1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 10_007, long] {
                        let bufs = [
                            HostBuf::F32(&xs[..len]),
                            HostBuf::Bf16(&bf[..len]),
                            HostBuf::F16(&hf[..len]),
                            HostBuf::F64(&f64s[..len]),
                        ];
                        for buf in bufs {
                            let want = power_sum_on(Isa::Portable, &[buf], p, acc, Some(1));
                            for &isa in &simd {
                                let got = power_sum_on(isa, &[buf], p, acc, Some(1));
                                let what = format!("{isa:?} {:?} p={p} acc_f64={acc} len={len}", buf.dtype());
                                assert!(same(got, want), "{what}: {got} against {want}");
                            }
                        }
                    }
                }
            }
        }
    }
}
