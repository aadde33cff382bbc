//! C ABI of the run-time loaded vendor libraries: where to look for them (every vendor: CUDA,
//! NCCL, HCCL, ...). Each vendor's own entry points are in its file (`cuda.rs`, `nccl.rs`,
//! `hccl.rs`, `npu.rs`).

use std::ffi::c_char;
use std::path::PathBuf;

use super::handle::arg_strs;
use super::panic::boundary;
use crate::backend;

/// Adds directories searched for every vendor library (NCCL, cuBLAS, NVRTC, the CUDA driver,
/// HCCL, ...) after its FSDPTURBO_*_PATH variable and before the system loader, in order. The
/// Python package passes the `nvidia/*/lib` folders of the installed wheels.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_add_library_dirs(dirs: *const *const c_char, n_dirs: usize) -> i32 {
    boundary(|| {
        let dirs = arg_strs(dirs, n_dirs, "dirs")?;
        backend::add_search_dirs(dirs.into_iter().map(PathBuf::from));
        Ok(())
    })
}
