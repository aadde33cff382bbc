//! The entry points of the internal header, `include/fsdpturbo_internal.h`: what only the torch
//! op library and the tests call. The CUDA kernels on raw device pointers (the op library's CUDA
//! dispatch keys launch them on torch's current stream) and the test hooks. That header is
//! generated from this folder alone, is not installed and promises no stability; the public
//! header is generated from the files of `src/ffi/` outside it (see build.rs).

pub mod cuda;
pub mod testing;
