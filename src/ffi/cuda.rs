//! C ABI of CUDA's run-time compiler: NVRTC's version, and the NVRTC compile of every CUDA
//! kernel of the library (CI checks that without a GPU).

use super::handle::{invalid, write_out};
use super::panic::boundary;
use crate::backend::cuda::{kernels, nvrtc};

/// Loads NVRTC and writes its version. FSDPTURBO_ERR_UNAVAILABLE (with everything tried) when
/// it is not found.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_nvrtc_version(out_major: *mut i32, out_minor: *mut i32) -> i32 {
    boundary(|| {
        let (major, minor) = nvrtc::nvrtc()?.version();
        write_out(out_major, "out_major", major)?;
        write_out(out_minor, "out_minor", minor)
    })
}

/// Compiles every CUDA kernel of the library with NVRTC for compute capability `arch` (e.g. 80,
/// 90): PTX when `cubin` is false, else machine code. Writes the number of kernel sources and
/// their total compiled size. Needs NVRTC only, no GPU; a compile error carries NVRTC's log.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_compile_kernels(
    arch: u32,
    cubin: bool,
    out_sources: *mut usize,
    out_bytes: *mut usize,
) -> i32 {
    boundary(|| {
        if !(50..=200).contains(&arch) {
            return Err(invalid(format!(
                "`arch` is {arch}; give a compute capability as major*10+minor, e.g. 80 or 90"
            )));
        }
        let output = if cubin { nvrtc::Output::Cubin } else { nvrtc::Output::Ptx };
        let compiled = kernels::compile_all(arch, output)?;
        write_out(out_sources, "out_sources", compiled.len())?;
        write_out(out_bytes, "out_bytes", compiled.iter().map(|(_, b)| b.len()).sum())
    })
}
