//! The host kernels: the compute loops behind routing (row gather, unpermute), the experts'
//! grouped GEMM and the gradient norm (p-power sums, scaling), with the element buffers they
//! work on and the threading they share. Semantics (what is checked, what a result means) live
//! in `route.rs` and `norm.rs`; these modules only compute, deterministically: results never
//! depend on the thread count nor on the instruction set, which [`isa`] chooses once for all of
//! them.
//!
//! - [`buf`]: [`HostBuf`] / [`HostBufMut`], the floating-point element buffers;
//! - [`isa`]: [`Isa`], the instruction set: the best the CPU has, capped by `FSDPTURBO_HOST_ISA`;
//! - [`threads`]: [`KernelOptions`], the parallel thresholds and the chunked scoped threads;
//! - [`permute`]: the row gather and the weighted unpermute sum;
//! - [`gemm`]: the blocked grouped GEMM and its two backward pieces;
//! - [`pnorm`]: the p-power sum and scale kernels of the gradient norm.

pub mod buf;
pub mod gemm;
pub mod isa;
pub mod permute;
pub mod pnorm;
pub mod threads;

pub use buf::{HostBuf, HostBufMut};
pub use isa::Isa;
pub use threads::{GEMM_PARALLEL_MIN_FLOPS, KernelOptions, PARALLEL_MIN_ELEMS};
