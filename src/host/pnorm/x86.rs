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
            _ => {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
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
            let packed = _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256::<1>(out));
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
