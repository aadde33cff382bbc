//! Element type codes of the C ABI: one code space for every `int32_t dtype` argument
//! (gradients, tokens, expert weights, collectives, host callbacks), the codes of
//! [`crate::dtype::Dtype`].

use super::error::FfiError;
use super::handle::invalid;
use crate::dtype::Dtype;

/// Element type codes (`int32_t dtype` arguments): float.
pub const FSDPTURBO_DTYPE_F32: i32 = 0;
/// Element type code: double.
pub const FSDPTURBO_DTYPE_F64: i32 = 1;
/// Element type code: IEEE binary16, as uint16_t bit patterns.
pub const FSDPTURBO_DTYPE_F16: i32 = 2;
/// Element type code: bfloat16, as uint16_t bit patterns.
pub const FSDPTURBO_DTYPE_BF16: i32 = 3;
/// Element type code: uint8_t (collectives only).
pub const FSDPTURBO_DTYPE_U8: i32 = 4;
/// Element type code: int32_t (collectives only).
pub const FSDPTURBO_DTYPE_I32: i32 = 5;
/// Element type code: int64_t (collectives only).
pub const FSDPTURBO_DTYPE_I64: i32 = 6;

// Literals for the header, pinned to the one enum.
const _: () = {
    assert!(FSDPTURBO_DTYPE_F32 == Dtype::F32.code());
    assert!(FSDPTURBO_DTYPE_F64 == Dtype::F64.code());
    assert!(FSDPTURBO_DTYPE_F16 == Dtype::F16.code());
    assert!(FSDPTURBO_DTYPE_BF16 == Dtype::Bf16.code());
    assert!(FSDPTURBO_DTYPE_U8 == Dtype::U8.code());
    assert!(FSDPTURBO_DTYPE_I32 == Dtype::I32.code());
    assert!(FSDPTURBO_DTYPE_I64 == Dtype::I64.code());
};

/// The accepted codes, for error messages: "F32=0, F64=1, …".
fn listing(accepted: impl Iterator<Item = Dtype>) -> String {
    accepted.map(|d| format!("{}={}", d.abi_name(), d.code())).collect::<Vec<_>>().join(", ")
}

/// The element type of argument `name` (any FSDPTURBO_DTYPE_* code), or an error naming it and
/// what is accepted. `name` is formatted only when `code` is refused.
pub(crate) fn dtype_arg(code: i32, name: impl std::fmt::Display) -> Result<Dtype, FfiError> {
    Dtype::from_code(code).ok_or_else(|| {
        invalid(format!(
            "`{name}` is {code}, not an FSDPTURBO_DTYPE_* value ({})",
            listing(Dtype::ALL.into_iter())
        ))
    })
}

/// [`dtype_arg`] for the entry points that compute on the elements: the floating-point codes only.
pub(crate) fn float_dtype_arg(code: i32, name: impl std::fmt::Display) -> Result<Dtype, FfiError> {
    match Dtype::from_code(code) {
        Some(d) if d.is_float() => Ok(d),
        other => Err(invalid(format!(
            "`{name}` is {code}, not a floating-point FSDPTURBO_DTYPE_* value ({}){}",
            listing(Dtype::ALL.into_iter().filter(|d| d.is_float())),
            other.map_or(String::new(), |d| format!("; FSDPTURBO_DTYPE_{} is for collectives", d.abi_name()))
        ))),
    }
}
