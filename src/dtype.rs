//! Element types: the one list every layer uses (the host kernels, the device kernels and
//! vendor libraries, the collectives, and the `FSDPTURBO_DTYPE_*` codes of the C ABI), with the
//! bf16 / binary16 ↔ f32 conversions. Pure: the bottom of the crate, it imports nothing.
//!
//! 16-bit floats are handled as their raw bit patterns (`u16`); the conversions here are exact
//! widening and round-to-nearest-even narrowing, written without data-dependent branches so
//! the loops that call them vectorise.

/// An element type. The discriminant is its code in the C ABI (`FSDPTURBO_DTYPE_*`): the four
/// floating-point types first (the codes the gradient, routing and GEMM entry points have
/// always taken), then the integer types collectives also move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Dtype {
    F32 = 0,
    F64 = 1,
    /// IEEE binary16, as `u16` bit patterns.
    F16 = 2,
    /// bfloat16, as `u16` bit patterns.
    Bf16 = 3,
    U8 = 4,
    I32 = 5,
    I64 = 6,
}

impl Dtype {
    /// Every element type, in code order (`ALL[c].code() == c`).
    pub const ALL: [Dtype; 7] =
        [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16, Dtype::U8, Dtype::I32, Dtype::I64];

    /// The code in the C ABI (`FSDPTURBO_DTYPE_*`).
    pub const fn code(self) -> i32 {
        self as i32
    }

    /// The element type of a C ABI code, or `None` for a code that names none.
    pub fn from_code(code: i32) -> Option<Dtype> {
        usize::try_from(code).ok().and_then(|c| Dtype::ALL.get(c).copied())
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
        }
    }

    /// The short name used in errors and in the device kernels' function names ("bf16").
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::U8 => "u8",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
        }
    }

    /// The name of its `FSDPTURBO_DTYPE_*` constant without the prefix ("BF16").
    pub const fn abi_name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::U8 => "U8",
            Dtype::I32 => "I32",
            Dtype::I64 => "I64",
        }
    }

    /// Whether it is one of the floating-point types (the element types the kernels compute on).
    pub const fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::Bf16)
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// bfloat16 bits to f32 (exact: a bf16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bfloat16 bits, rounding to nearest, ties to even. Overflow gives ±inf; NaN stays a
/// (quiet) NaN with its sign.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) as u16) | 0x0040;
    if x.is_nan() { nan } else { rounded }
}

/// IEEE binary16 bits to f32 (exact, including subnormals, ±inf and NaN payloads).
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    // Rebias the exponent in the f32 position; subnormals are normalised by one float
    // subtraction (exact), inf/nan get the all-ones exponent. Written without branches that
    // depend on data so the loops that call it vectorise.
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let magic = f32::from_bits(113 << 23); // 2^-14
    let h = bits as u32;
    let sign = (h & 0x8000) << 16;
    let shifted = (h & 0x7fff) << 13;
    let exp = shifted & SHIFTED_EXP;
    let normal = shifted + ((127 - 15) << 23);
    let inf_nan = normal + ((128 - 16) << 23);
    let subnormal = (f32::from_bits(normal + (1 << 23)) - magic).to_bits();
    let magnitude = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(magnitude | sign)
}

/// f32 to IEEE binary16 bits, rounding to nearest, ties to even (subnormal results included).
/// Values that round beyond 65504 give ±inf; NaN stays a (quiet) NaN with its sign.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let a = bits & 0x7fff_ffff;
    // a >= 2^16: overflow (or inf / nan).
    let big = if a > 0x7f80_0000 { 0x7e00 | ((a >> 13) & 0x3ff) as u16 } else { 0x7c00 };
    // a < 2^-14: the result is subnormal or zero; adding 0.5 aligns the f16 mantissa with the
    // bottom of the f32 mantissa, and the float addition rounds to nearest even.
    let denorm_magic = f32::from_bits(((127 - 15) + (23 - 10) + 1) << 23);
    let small = (f32::from_bits(a) + denorm_magic).to_bits().wrapping_sub(denorm_magic.to_bits()) as u16;
    // Normal: rebias and round to nearest even by hand; a carry into the exponent is correct,
    // including the step from 65504 to inf.
    let odd = (a >> 13) & 1;
    let normal =
        (a.wrapping_add((15u32.wrapping_sub(127) << 23).wrapping_add(0xfff)).wrapping_add(odd) >> 13) as u16;
    let magnitude = if a >= 0x4780_0000 {
        big
    } else if a < 0x3880_0000 {
        small
    } else {
        normal
    };
    magnitude | sign
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_sizes_and_names() {
        for (c, d) in Dtype::ALL.into_iter().enumerate() {
            assert_eq!(d.code(), c as i32);
            assert_eq!(Dtype::from_code(c as i32), Some(d));
        }
        for bad in [-1, 7, i32::MAX, i32::MIN] {
            assert_eq!(Dtype::from_code(bad), None);
        }
        let sizes: Vec<usize> = Dtype::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [4, 8, 2, 2, 1, 4, 8]);
        assert_eq!(Dtype::Bf16.to_string(), "bf16");
        assert_eq!(Dtype::ALL.iter().filter(|d| d.is_float()).count(), 4);
    }

    /// The value of binary16 `bits` from its definition, in f64.
    fn f16_value(bits: u16) -> f64 {
        let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
        let exp = ((bits >> 10) & 0x1f) as i32;
        let mant = (bits & 0x3ff) as f64;
        match exp {
            0 => sign * mant * 2f64.powi(-24),
            31 if mant == 0.0 => sign * f64::INFINITY,
            31 => f64::NAN,
            _ => sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15),
        }
    }

    #[test]
    fn f16_to_f32_matches_the_definition_for_every_pattern() {
        for bits in 0..=u16::MAX {
            let got = f16_to_f32(bits);
            let want = f16_value(bits);
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#06x}");
                // The payload and sign survive.
                assert_eq!(got.to_bits() >> 31, (bits >> 15) as u32, "{bits:#06x}");
                assert_eq!((got.to_bits() >> 13) & 0x3ff, (bits & 0x3ff) as u32, "{bits:#06x}");
            } else {
                assert_eq!(got as f64, want, "{bits:#06x}");
                assert_eq!(got.is_sign_negative(), bits & 0x8000 != 0, "{bits:#06x}");
            }
        }
    }

    #[test]
    fn f32_to_f16_round_trips_every_pattern() {
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_nan() {
                let back = f32_to_f16(x);
                assert!(f16_value(back).is_nan(), "{bits:#06x}");
                assert_eq!(back & 0x8000, bits & 0x8000);
            } else {
                assert_eq!(f32_to_f16(x), bits, "{bits:#06x}");
            }
        }
    }

    #[test]
    fn bf16_round_trips_every_pattern() {
        for bits in 0..=u16::MAX {
            let x = bf16_to_f32(bits);
            let back = f32_to_bf16(x);
            if x.is_nan() {
                assert!(bf16_to_f32(back).is_nan(), "{bits:#06x}");
                assert_eq!(back & 0x8000, bits & 0x8000);
            } else {
                assert_eq!(back, bits, "{bits:#06x}");
            }
        }
    }
}
