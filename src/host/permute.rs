//! The row kernels of token routing: the gather of the dispatch permute and the weighted sum
//! of the combine unpermute. Their arguments are checked by `route.rs` before they run.

use super::buf::{Acc, HostBuf, HostBufMut, ident};
use super::isa::Isa;
use super::threads::{KernelOptions, PARALLEL_MIN_ELEMS, available_threads, for_chunks};
use crate::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::error::Result;

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
/// (`want` = T·K·hidden, the work that sets the thread count). Fails only on a bad
/// `FSDPTURBO_HOST_ISA` ([`super::isa`]).
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
) -> Result<()> {
    let threads = options.threads_for(want, PARALLEL_MIN_ELEMS);
    let isa = options.isa()?;
    macro_rules! go {
        ($y:expr, $p:expr, $out:expr, $dec:expr, $enc:expr, $acc:ty) => {
            unpermute_kernel::<_, $acc>($y, hidden, &inv, top_k, $p, $out, $dec, $enc, threads, isa)
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
    Ok(())
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
    isa: Isa,
) {
    let per_chunk = (PARALLEL_MIN_ELEMS / 4 / (hidden * k)).max(1);
    for_chunks(out, per_chunk * hidden, threads, |c, out| {
        let rows = Rows { y, hidden, inv, k, probs, first: c * per_chunk };
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable {
            // SAFETY: the CPU has AVX2 and FMA (`isa` comes from `isa::current`; AVX-512 CPUs
            // have them too).
            return unsafe { unpermute_rows_avx2(&rows, out, &dec, &enc) };
        }
        let _ = isa;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::isa::Capabilities;

    /// Values in [-2, 2) with every mantissa bit in play, seeded.
    fn values(seed: u64, len: usize) -> Vec<f64> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 11) as f64 / (1u64 << 51) as f64 - 2.0
            })
            .collect()
    }

    /// [`unpermute_kernel`] on every instruction set this host runs gives the portable bits,
    /// with and without weights, for K = 1 and 3.
    fn check<T: Copy + Default + Send + Sync, A: Acc>(
        name: &str,
        encode_input: impl Fn(f64) -> T,
        dec: fn(T) -> A,
        enc: fn(A) -> T,
        bits: fn(T) -> u64,
    ) {
        // A hidden size that is no multiple of any vector width, so every loop has a tail.
        let (tokens, hidden) = (50, 37);
        let supported = Capabilities::detect().supported();
        for k in [1, 3] {
            let slots = tokens * k;
            let y: Vec<T> = values(1, slots * hidden).into_iter().map(&encode_input).collect();
            let probs: Vec<T> = values(2, slots).into_iter().map(&encode_input).collect();
            // A permutation of the slots (7 is coprime to their number, 50 or 150).
            let inv: Vec<u64> = (0..slots).map(|s| (s * 7 % slots) as u64).collect();
            for probs in [None, Some(&probs[..])] {
                let run = |isa| {
                    let mut out = vec![T::default(); tokens * hidden];
                    unpermute_kernel(&y, hidden, &inv, k, probs, &mut out, dec, enc, 1, isa);
                    out.into_iter().map(bits).collect::<Vec<u64>>()
                };
                let portable = run(Isa::Portable);
                for &isa in &supported[1..] {
                    let what = format!("{name} K={k} weights={}", probs.is_some());
                    assert!(run(isa) == portable, "{what}: {isa:?} differs from the portable loop");
                }
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_the_portable_bits_for_every_type() {
        check("f32", |v| v as f32, ident, ident, |v: f32| v.to_bits().into());
        check("f64", |v| v, ident, ident, f64::to_bits);
        check("bf16", |v| f32_to_bf16(v as f32), bf16_to_f32, f32_to_bf16, u64::from);
        check("f16", |v| f32_to_f16(v as f32), f16_to_f32, f32_to_f16, u64::from);
    }
}
