//! The row kernels of token routing: the gather of the dispatch permute and the weighted sum
//! of the combine unpermute. Their arguments are checked by `route.rs` before they run.

use super::buf::{Acc, HostBuf, HostBufMut, ident};
use super::threads::{KernelOptions, PARALLEL_MIN_ELEMS, available_threads, for_chunks};
use crate::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// `dst[i, :] = src[rows[i] / divisor, :]` for rows of `hidden` elements; every row index is in
/// range (checked by the caller). Large outputs use all available cores.
pub(crate) fn gather_rows<T: Copy + Send + Sync>(
    src: &[T],
    hidden: usize,
    rows: &[u64],
    divisor: usize,
    dst: &mut [T],
) {
    let div = divisor as u64;
    let threads = if dst.len() >= PARALLEL_MIN_ELEMS { available_threads() } else { 1 };
    let per_chunk = (PARALLEL_MIN_ELEMS / 4 / hidden).max(1);
    for_chunks(dst, per_chunk * hidden, threads, |c, out| {
        let first = c * per_chunk;
        for (i, row) in out.chunks_exact_mut(hidden).enumerate() {
            let r = (rows[first + i] / div) as usize;
            row.copy_from_slice(&src[r * hidden..(r + 1) * hidden]);
        }
    });
}

/// `out[t, :] = Σ_k w[t, k] · y[inv[t·K + k], :]` in the accumulator type, rounded once; `y`,
/// `probs` and `out` share one element type and have the shapes `route::unpermute` checked
/// (`want` = T·K·hidden, the work that sets the thread count).
#[allow(clippy::too_many_arguments)]
pub(crate) fn unpermute_rows_into(
    permuted: HostBuf,
    hidden: usize,
    inv: &[u64],
    top_k: usize,
    probs: Option<HostBuf>,
    out: HostBufMut,
    want: usize,
    options: KernelOptions,
) {
    let threads = options.threads_for(want, PARALLEL_MIN_ELEMS);
    let simd = options.simd();
    macro_rules! go {
        ($y:expr, $p:expr, $out:expr, $dec:expr, $enc:expr, $acc:ty) => {
            unpermute_kernel::<_, $acc>($y, hidden, &inv, top_k, $p, $out, $dec, $enc, threads, simd)
        };
    }
    match (permuted, probs, out) {
        (HostBuf::F32(y), p, HostBufMut::F32(o)) => {
            go!(y, p.map(|p| if let HostBuf::F32(p) = p { p } else { unreachable!() }), o, ident, ident, f32)
        }
        (HostBuf::F64(y), p, HostBufMut::F64(o)) => {
            go!(y, p.map(|p| if let HostBuf::F64(p) = p { p } else { unreachable!() }), o, ident, ident, f64)
        }
        (HostBuf::Bf16(y), p, HostBufMut::Bf16(o)) => go!(
            y,
            p.map(|p| if let HostBuf::Bf16(p) = p { p } else { unreachable!() }),
            o,
            bf16_to_f32,
            f32_to_bf16,
            f32
        ),
        (HostBuf::F16(y), p, HostBufMut::F16(o)) => go!(
            y,
            p.map(|p| if let HostBuf::F16(p) = p { p } else { unreachable!() }),
            o,
            f16_to_f32,
            f32_to_f16,
            f32
        ),
        _ => unreachable!("dtypes checked above"),
    }
}

#[allow(clippy::too_many_arguments)]
fn unpermute_kernel<T: Copy + Send + Sync, A: Acc>(
    y: &[T],
    hidden: usize,
    inv: &[u64],
    k: usize,
    probs: Option<&[T]>,
    out: &mut [T],
    dec: impl Fn(T) -> A + Sync,
    enc: impl Fn(A) -> T + Sync,
    threads: usize,
    simd: bool,
) {
    let per_chunk = (PARALLEL_MIN_ELEMS / 4 / (hidden * k)).max(1);
    for_chunks(out, per_chunk * hidden, threads, |c, out| {
        let rows = Rows { y, hidden, inv, k, probs, first: c * per_chunk };
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time).
            return unsafe { unpermute_rows_avx2(&rows, out, &dec, &enc) };
        }
        let _ = simd;
        unpermute_rows(&rows, out, &dec, &enc)
    });
}

/// The inputs of one chunk of unpermuted tokens, starting at token `first`.
struct Rows<'a, T> {
    y: &'a [T],
    hidden: usize,
    inv: &'a [u64],
    k: usize,
    probs: Option<&'a [T]>,
    first: usize,
}

/// [`unpermute_rows`] compiled for AVX2 (element-wise operations only, so the results are
/// those of the portable build).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn unpermute_rows_avx2<T: Copy, A: Acc>(
    rows: &Rows<T>,
    out: &mut [T],
    dec: &impl Fn(T) -> A,
    enc: &impl Fn(A) -> T,
) {
    unpermute_rows(rows, out, dec, enc)
}

#[inline(always)]
fn unpermute_rows<T: Copy, A: Acc>(
    rows: &Rows<T>,
    out: &mut [T],
    dec: &impl Fn(T) -> A,
    enc: &impl Fn(A) -> T,
) {
    let (hidden, k) = (rows.hidden, rows.k);
    let mut acc = vec![A::default(); hidden];
    for (i, dst) in out.chunks_exact_mut(hidden).enumerate() {
        let t = rows.first + i;
        for kk in 0..k {
            let slot = t * k + kk;
            let r = rows.inv[slot] as usize;
            let row = &rows.y[r * hidden..(r + 1) * hidden];
            match (rows.probs, kk) {
                (None, 0) => acc.iter_mut().zip(row).for_each(|(a, &v)| *a = dec(v)),
                (None, _) => acc.iter_mut().zip(row).for_each(|(a, &v)| *a = *a + dec(v)),
                (Some(p), 0) => {
                    let w = dec(p[slot]);
                    acc.iter_mut().zip(row).for_each(|(a, &v)| *a = w * dec(v));
                }
                (Some(p), _) => {
                    let w = dec(p[slot]);
                    acc.iter_mut().zip(row).for_each(|(a, &v)| *a = *a + w * dec(v));
                }
            }
        }
        dst.iter_mut().zip(&acc).for_each(|(d, &a)| *d = enc(a));
    }
}
