//! Element types of the buffers the C ABI takes (gradients, tokens, expert weights).

use super::error::FfiError;
use super::status::FSDPTURBO_ERR_INVALID_ARGUMENT;

/// Element type codes (`int32_t dtype` arguments): float.
pub const FSDPTURBO_DTYPE_F32: i32 = 0;
/// Element type code: double.
pub const FSDPTURBO_DTYPE_F64: i32 = 1;
/// Element type code: IEEE binary16, as uint16_t bit patterns.
pub const FSDPTURBO_DTYPE_F16: i32 = 2;
/// Element type code: bfloat16, as uint16_t bit patterns.
pub const FSDPTURBO_DTYPE_BF16: i32 = 3;

/// A validated element type code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dtype {
    F32,
    F64,
    F16,
    Bf16,
}

impl Dtype {
    /// The element type of argument `name`, or an error naming it and what is accepted.
    /// `name` is formatted only when `code` is refused.
    pub(crate) fn of(code: i32, name: impl std::fmt::Display) -> Result<Dtype, FfiError> {
        match code {
            FSDPTURBO_DTYPE_F32 => Ok(Dtype::F32),
            FSDPTURBO_DTYPE_F64 => Ok(Dtype::F64),
            FSDPTURBO_DTYPE_F16 => Ok(Dtype::F16),
            FSDPTURBO_DTYPE_BF16 => Ok(Dtype::Bf16),
            other => Err(FfiError::new(
                FSDPTURBO_ERR_INVALID_ARGUMENT,
                format!("`{name}` is {other}, not an FSDPTURBO_DTYPE_* value (F32=0, F64=1, F16=2, BF16=3)"),
            )),
        }
    }

    /// Bytes per element.
    pub(crate) fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F64 => 8,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}
