use std::arch::x86_64::*;

use super::{GEMM_KC, Operand, pack, round_up};

/// The columns of an 8 × 8 block given as 8 rows.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    // Columns j (low 128 bits) and j + 4 (high) of rows 0..4, then of rows 4..8.
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xee>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xee>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xee>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xee>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// Rows `row0..row0 + R` of `op` at depths `k0..k0 + klen`, decoded into `tmp` one row at a
/// time (one long sequential read per row; reading the rows side by side, often a multiple of
/// 4 KiB apart, would make the cache sets thrash and defeat the prefetchers). The rows of `tmp`
/// are one cache line longer than needed, so they do not share cache sets either.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn decode_rows<'t, T: Copy, const R: usize>(
    src: &[T],
    op: Operand,
    row0: usize,
    k0: usize,
    klen: usize,
    dec: &impl Fn(T) -> f32,
    tmp: &'t mut Vec<f32>,
) -> [&'t [f32]; R] {
    let stride = klen + 16;
    tmp.resize(R * stride, 0.0);
    let first = op.off + row0 * op.s_mn + k0;
    for (l, out) in tmp.chunks_exact_mut(stride).take(R).enumerate() {
        for (o, &v) in out[..klen].iter_mut().zip(&src[first + l * op.s_mn..][..klen]) {
            *o = dec(v);
        }
    }
    let tmp: &'t [f32] = tmp;
    std::array::from_fn(|l| &tmp[l * stride..l * stride + klen])
}

/// `pack_blocks::<T, f32, 32>` for an operand whose depth is contiguous (`s_k == 1`): each
/// whole panel's 32 rows are decoded into `tmp` over the full depth range ([`decode_rows`]),
/// then transposed 8 × 8 in registers into each K block. Writes the same values as the
/// portable pack.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_b_t32<T: Copy>(
    src: &[T],
    op: Operand,
    mn0: usize,
    len: usize,
    k0: usize,
    klen: usize,
    dst: &mut [f32],
    dec: &impl Fn(T) -> f32,
    tmp: &mut Vec<f32>,
) {
    const R: usize = 32;
    let full = len / R;
    let np = round_up(len, R);
    for q in 0..full {
        let rows = decode_rows::<T, R>(src, op, mn0 + q * R, k0, klen, dec, tmp);
        for kb in (k0..k0 + klen).step_by(GEMM_KC) {
            let kc = GEMM_KC.min(k0 + klen - kb);
            let d = kb - k0;
            let panel = &mut dst[np * d + q * kc * R..np * d + (q + 1) * kc * R];
            let whole = kc / 8 * 8;
            for b in (0..whole).step_by(8) {
                for eighth in 0..R / 8 {
                    // SAFETY: `d + b + 8 <= klen`: each row holds the 8 floats read.
                    let v: [__m256; 8] = std::array::from_fn(|i| unsafe {
                        _mm256_loadu_ps(rows[eighth * 8 + i][d + b..d + b + 8].as_ptr())
                    });
                    for (p, col) in transpose8(v).into_iter().enumerate() {
                        let at = &mut panel[(b + p) * R + eighth * 8..][..8];
                        // SAFETY: `at` holds 8 floats.
                        unsafe { _mm256_storeu_ps(at.as_mut_ptr(), col) };
                    }
                }
            }
            for p in whole..kc {
                for l in 0..R {
                    panel[p * R + l] = rows[l][d + p];
                }
            }
        }
    }
    if full * R < len {
        // The last, partial panel of each block.
        for kb in (k0..k0 + klen).step_by(GEMM_KC) {
            let kc = GEMM_KC.min(k0 + klen - kb);
            let at = np * (kb - k0) + full * kc * R;
            pack::<T, f32, R>(
                src,
                op,
                mn0 + full * R,
                len - full * R,
                kb,
                kc,
                &mut dst[at..at + R * kc],
                dec,
            );
        }
    }
}

/// `pack::<T, f32, 12>` (the A panels) for an operand whose depth is contiguous (`s_k == 1`):
/// each whole panel's 12 rows are decoded into `tmp` ([`decode_rows`]), then transposed 8 × 8
/// in registers (rows 0–7, and rows 8–11 beside four zero rows). Writes the same values as the
/// portable pack.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_a_t12<T: Copy>(
    src: &[T],
    op: Operand,
    mn0: usize,
    len: usize,
    k0: usize,
    kc: usize,
    dst: &mut [f32],
    dec: &impl Fn(T) -> f32,
    tmp: &mut Vec<f32>,
) {
    const R: usize = 12;
    let full = len / R;
    let whole = kc / 8 * 8;
    for q in 0..full {
        let rows = decode_rows::<T, R>(src, op, mn0 + q * R, k0, kc, dec, tmp);
        let panel = &mut dst[q * kc * R..(q + 1) * kc * R];
        for b in (0..whole).step_by(8) {
            // SAFETY (loads): `b + 8 <= kc`: each row holds the 8 floats read.
            let low: [__m256; 8] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(rows[i][b..b + 8].as_ptr()) });
            let high: [__m256; 8] = std::array::from_fn(|i| {
                if i < 4 {
                    unsafe { _mm256_loadu_ps(rows[8 + i][b..b + 8].as_ptr()) }
                } else {
                    _mm256_setzero_ps()
                }
            });
            for (p, (lo, hi)) in transpose8(low).into_iter().zip(transpose8(high)).enumerate() {
                let at = &mut panel[(b + p) * R..(b + p + 1) * R];
                // SAFETY: `at` holds 12 floats: 8 from rows 0–7, then 4 from rows 8–11.
                unsafe {
                    _mm256_storeu_ps(at.as_mut_ptr(), lo);
                    _mm_storeu_ps(at[8..].as_mut_ptr(), _mm256_castps256_ps128(hi));
                }
            }
        }
        for p in whole..kc {
            for l in 0..R {
                panel[p * R + l] = rows[l][p];
            }
        }
    }
    if full * R < len {
        let at = full * kc * R;
        pack::<T, f32, R>(src, op, mn0 + full * R, len - full * R, k0, kc, &mut dst[at..at + R * kc], dec);
    }
}

/// `c[i·ldc + j] += Σ_p a[p·12 + i] · b[p·32 + j]`, i < 12, j < 16·V (V = 2: the whole tile;
/// V = 1: its first 16 columns): per element a chain of fused multiply-adds over p from zero,
/// added to c at the end (to zero when `first`: c is written, not read).
///
/// # Safety
/// AVX-512F is available; `a` holds 12·kc, `b` 32·kc floats, and `c` a 12 × 32 tile with row
/// stride `ldc`.
#[cfg(fsdpturbo_avx512)]
#[clippy::msrv = "1.89"]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn kernel_f32_avx512<const V: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    // SAFETY: the caller's contract covers every pointer offset below.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); V]; 12];
        for p in 0..kc {
            let bp = b.add(p * 32);
            let mut bv = [_mm512_setzero_ps(); V];
            for (v, bj) in bv.iter_mut().enumerate() {
                *bj = _mm512_loadu_ps(bp.add(16 * v));
            }
            let ap = a.add(p * 12);
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm512_set1_ps(*ap.add(i));
                for (r, &bj) in row.iter_mut().zip(&bv) {
                    *r = _mm512_fmadd_ps(ai, bj, *r);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (v, &r) in row.iter().enumerate() {
                let cp = c.add(i * ldc + 16 * v);
                let base = if first { _mm512_setzero_ps() } else { _mm512_loadu_ps(cp) };
                _mm512_storeu_ps(cp, _mm512_add_ps(base, r));
            }
        }
    }
}

/// What [`kernel_f32_avx512`] computes, with the same operations per element, as 6 × 16
/// quarters of 12 AVX2 accumulators each (6 × 8 halves of 6 where 8 columns are wanted), for
/// the quarters holding any of the first `cols` columns.
///
/// # Safety
/// AVX2 and FMA are available; otherwise as for [`kernel_f32_avx512`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn kernel_f32_avx2(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    first: bool,
) {
    for (i0, j0) in [(0, 0), (0, 16), (6, 0), (6, 16)] {
        // SAFETY: the caller's contract covers the quarter.
        unsafe {
            match cols.saturating_sub(j0) {
                0 => {}
                1..=8 => quarter_f32_avx2::<1>(kc, a.add(i0), b.add(j0), c.add(i0 * ldc + j0), ldc, first),
                _ => quarter_f32_avx2::<2>(kc, a.add(i0), b.add(j0), c.add(i0 * ldc + j0), ldc, first),
            }
        }
    }
}

/// 6 rows × 8·V columns of [`kernel_f32_avx2`]'s tile, at `a` (stride 12), `b` (stride 32)
/// and `c` (stride `ldc`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn quarter_f32_avx2<const V: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    // SAFETY: the caller's contract covers every pointer offset below.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); V]; 6];
        for p in 0..kc {
            let bp = b.add(p * 32);
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, bj) in bv.iter_mut().enumerate() {
                *bj = _mm256_loadu_ps(bp.add(8 * v));
            }
            let ap = a.add(p * 12);
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_broadcast_ss(&*ap.add(i));
                for (r, &bj) in row.iter_mut().zip(&bv) {
                    *r = _mm256_fmadd_ps(ai, bj, *r);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (v, &r) in row.iter().enumerate() {
                let cp = c.add(i * ldc + 8 * v);
                let base = if first { _mm256_setzero_ps() } else { _mm256_loadu_ps(cp) };
                _mm256_storeu_ps(cp, _mm256_add_ps(base, r));
            }
        }
    }
}

/// `c[i·ldc + j] += Σ_p a[p·6 + i] · b[p·8 + j]`, i < 6, j < 8 (written when `first`).
///
/// # Safety
/// As for [`kernel_f32_avx2`], with `a` holding 6·kc and `b` 8·kc doubles, and a 6 × 8 tile.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn kernel_f64(
    kc: usize,
    a: *const f64,
    b: *const f64,
    c: *mut f64,
    ldc: usize,
    first: bool,
) {
    // SAFETY: the caller's contract covers every pointer offset below.
    unsafe {
        let mut acc = [[_mm256_setzero_pd(); 2]; 6];
        for p in 0..kc {
            let bp = b.add(p * 8);
            let b0 = _mm256_loadu_pd(bp);
            let b1 = _mm256_loadu_pd(bp.add(4));
            let ap = a.add(p * 6);
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_broadcast_sd(&*ap.add(i));
                row[0] = _mm256_fmadd_pd(ai, b0, row[0]);
                row[1] = _mm256_fmadd_pd(ai, b1, row[1]);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            let cp = c.add(i * ldc);
            for (v, &r) in row.iter().enumerate() {
                let base = if first { _mm256_setzero_pd() } else { _mm256_loadu_pd(cp.add(4 * v)) };
                _mm256_storeu_pd(cp.add(4 * v), _mm256_add_pd(base, r));
            }
        }
    }
}
