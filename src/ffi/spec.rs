//! C ABI of the model-spec registry: register user specs next to the built-in ones.

use std::ffi::c_char;

use super::error::FfiError;
use super::handle::{arg_str, arg_strs, write_string};
use super::panic::boundary;
use crate::spec::ModelSpec;
use crate::state;

/// Registers (or replaces, as the seed does) the spec of `model_type` in the process-wide
/// registry: `ep_modules` (n_ep patterns, at least one) and `ep_fsdp_modules` (n_fsdp
/// patterns; pass NULL and 0 to derive them by dropping a `.experts` suffix). Every pattern
/// is compiled first; an invalid one gives FSDPTURBO_ERR_INVALID_ARGUMENT and registers nothing.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_spec_register(
    model_type: *const c_char,
    ep_modules: *const *const c_char,
    n_ep: usize,
    ep_fsdp_modules: *const *const c_char,
    n_fsdp: usize,
) -> i32 {
    boundary(|| {
        let model_type = arg_str(model_type, "model_type")?;
        let ep = arg_strs(ep_modules, n_ep, "ep_modules")?;
        let fsdp = if ep_fsdp_modules.is_null() && n_fsdp == 0 {
            None
        } else {
            Some(arg_strs(ep_fsdp_modules, n_fsdp, "ep_fsdp_modules")?)
        };
        let spec = ModelSpec::new(model_type, &ep, fsdp.as_deref());
        state::register_spec(spec).map_err(FfiError::from)
    })
}

/// The registered spec of `model_type` as JSON (`{"model_type", "ep_modules",
/// "ep_fsdp_modules"}`), copied into `buf` with its NUL; `*out_len` receives the bytes needed.
/// An unregistered type gives FSDPTURBO_ERR_PLAN with the seed's message.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_spec_to_json(
    model_type: *const c_char,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let model_type = arg_str(model_type, "model_type")?;
        let spec = state::spec(model_type)?;
        let text = serde_json::to_string(&spec).expect("plain data serialises");
        write_string(buf, cap, out_len, &text, "buf")
    })
}
