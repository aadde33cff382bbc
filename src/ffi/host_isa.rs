//! The instruction set of the host kernels (`host::isa`).

use std::ffi::c_char;

use super::handle::write_out;
use super::panic::boundary;
use crate::host::isa;

/// Writes the name of the instruction set the host kernels use in this process, "portable",
/// "avx2" or "avx512" (a static string), to `*out_name`. It is the best this CPU and this build
/// have (avx512: AVX-512F and a build by rustc >= 1.89; avx2: AVX2, FMA and F16C; portable:
/// every CPU, the only choice off x86-64), capped by the environment variable
/// FSDPTURBO_HOST_ISA (portable, avx2 or avx512; unset or empty: the best), which is read once
/// per process. Every path gives the same bits; the variable changes speed only.
///
/// A value of FSDPTURBO_HOST_ISA that is none of those is FSDPTURBO_ERR_INVALID_ARGUMENT, one
/// that names an instruction set this CPU or build lacks FSDPTURBO_ERR_UNAVAILABLE, here and from
/// every host kernel (fsdpturbo_grouped_mm and its gradients, fsdpturbo_unpermute,
/// fsdpturbo_local_power_sum, fsdpturbo_scale_in_place, fsdpturbo_clip_grad_norm*), with a
/// message naming the variable, the value, what is accepted and what this host supports.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_host_isa(out_name: *mut *const c_char) -> i32 {
    boundary(|| write_out(out_name, "out_name", isa::current()?.c_name().as_ptr()))
}
