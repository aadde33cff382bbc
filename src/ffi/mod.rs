//! Every `extern "C"` item of the library: one file per prefix of the exported names (mostly
//! one per core module it exposes: `comm_*` in comm.rs, `nccl_*` in nccl.rs, `nvrtc_*` and
//! `cuda_*` in cuda.rs), plus the plumbing (status codes, last error, panic boundary,
//! marshalling). Type names follow C
//! conventions (`fsdpturbo_*_t`), and every function takes raw pointers from C whose validity
//! is the caller's contract (documented per function), hence the two lint allowances.
#![allow(non_camel_case_types)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod dtype;
pub mod error;
pub mod handle;
pub mod panic;
pub mod status;
pub mod version;

// The internal header (include/fsdpturbo_internal.h): the op library's CUDA kernels, test hooks.
pub mod internal;

pub mod backend;
pub mod comm;
pub mod config;
pub mod cuda;
pub mod gemm;
pub mod hccl;
pub mod host_isa;
pub mod host_threads;
pub mod nccl;
pub mod norm;
pub mod npu;
pub mod ops;
pub mod pattern;
pub mod placement;
pub mod plan;
pub mod route;
pub mod safetensors;
pub mod spec;
pub mod state;
pub mod topology;
