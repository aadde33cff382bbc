//! C ABI of the device-operator registry (`crate::registry`): one process-wide registry shared by
//! every caller (C, C++, the Python package), which maps an operator name and a device type to
//! an implementation id. Callers keep their own id → function table.

use std::ffi::c_char;

use super::error::FfiError;
use super::handle::{arg_ref, arg_str, write_out, write_string};
use super::panic::boundary;
use crate::registry::{self, Resolution};
use crate::state;

/// How fsdpturbo_op_resolve found the implementation: the device's own.
pub const FSDPTURBO_OP_EXACT: i32 = 0;
/// How fsdpturbo_op_resolve found the implementation: the `cpu` one stands in, and this
/// (operator, device) pair has fallen back before.
pub const FSDPTURBO_OP_CPU_FALLBACK: i32 = 1;
/// How fsdpturbo_op_resolve found the implementation: the `cpu` one stands in, for the first
/// time for this (operator, device) pair: show the text of fsdpturbo_op_fallback_warning once.
pub const FSDPTURBO_OP_CPU_FALLBACK_WARN: i32 = 2;

/// Registers a new implementation of `op_name` for `device_type` ("cpu", "cuda", "npu", …: a
/// torch device type, without an index) in the process-wide registry. `*out_impl` receives its
/// id (never 0); `*out_replaced` the id of the implementation it replaced for the same pair (as
/// the seed does, silently), or 0. Operator names are `[A-Za-z_][A-Za-z0-9_.]*`, device types
/// `[a-z][a-z0-9_]*`; others give FSDPTURBO_ERR_INVALID_ARGUMENT and register nothing.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_op_register(
    op_name: *const c_char,
    device_type: *const c_char,
    out_impl: *mut u64,
    out_replaced: *mut u64,
) -> i32 {
    boundary(|| {
        let op_name = arg_str(op_name, "op_name")?;
        let device_type = arg_str(device_type, "device_type")?;
        arg_ref(out_impl.cast_const(), "out_impl")?;
        arg_ref(out_replaced.cast_const(), "out_replaced")?;
        let registered = state::register_op(op_name, device_type).map_err(FfiError::from)?;
        write_out(out_impl, "out_impl", registered.impl_id)?;
        write_out(out_replaced, "out_replaced", registered.replaced.unwrap_or(0))
    })
}

/// Resolves `op_name` for `device_type` with the seed's rules: the device's own
/// implementation (`*out_how` = FSDPTURBO_OP_EXACT), else the "cpu" one
/// (FSDPTURBO_OP_CPU_FALLBACK_WARN the first time for this pair, then
/// FSDPTURBO_OP_CPU_FALLBACK); `*out_impl` receives the implementation id. An operator that is
/// not registered, or has neither the device nor "cpu", gives FSDPTURBO_ERR_NOT_FOUND with the
/// seed's message ("Operator 'x' is not registered…", "Operator 'x' not available for device
/// 'y' and no CPU fallback exists…"); malformed names FSDPTURBO_ERR_INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_op_resolve(
    op_name: *const c_char,
    device_type: *const c_char,
    out_impl: *mut u64,
    out_how: *mut i32,
) -> i32 {
    boundary(|| {
        let op_name = arg_str(op_name, "op_name")?;
        let device_type = arg_str(device_type, "device_type")?;
        arg_ref(out_impl.cast_const(), "out_impl")?;
        arg_ref(out_how.cast_const(), "out_how")?;
        let resolved = state::resolve_op(op_name, device_type).map_err(FfiError::from)?;
        let how = match resolved.resolution {
            Resolution::Exact => FSDPTURBO_OP_EXACT,
            Resolution::CpuFallback { warn: false } => FSDPTURBO_OP_CPU_FALLBACK,
            Resolution::CpuFallback { warn: true } => FSDPTURBO_OP_CPU_FALLBACK_WARN,
        };
        write_out(out_impl, "out_impl", resolved.impl_id)?;
        write_out(out_how, "out_how", how)
    })
}

/// The seed's fallback warning for (`op_name`, `device_type`), "Operator 'x' not available for
/// device 'y', falling back to CPU implementation", copied into `buf` with its NUL; `*out_len`
/// receives the bytes needed. Names are validated as for fsdpturbo_op_register.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_op_fallback_warning(
    op_name: *const c_char,
    device_type: *const c_char,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let op_name = arg_str(op_name, "op_name")?;
        let device_type = arg_str(device_type, "device_type")?;
        registry::check_op_name(op_name).map_err(FfiError::from)?;
        registry::check_device_type(device_type).map_err(FfiError::from)?;
        write_string(buf, cap, out_len, &registry::fallback_warning(op_name, device_type), "buf")
    })
}

/// The process-wide registry as JSON, `{"op": {"device": impl_id, …}, …}` (sorted by name),
/// copied into `buf` with its NUL; `*out_len` receives the bytes needed.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_op_table_json(buf: *mut c_char, cap: usize, out_len: *mut usize) -> i32 {
    boundary(|| {
        let text = serde_json::to_string(&state::op_table()).expect("plain data serialises");
        write_string(buf, cap, out_len, &text, "buf")
    })
}
