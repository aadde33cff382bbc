//! The host kernels: the compute loops behind routing (row gather, unpermute), the experts'
//! grouped GEMM and the gradient norm (p-power sums, scaling), with the element buffers they
//! work on and the threading they share. Semantics (what is checked, what a result means) live
//! in `route.rs` and `norm.rs`; these modules only compute, deterministically: results never
//! depend on the thread count, and where an instruction-set path exists its results are
//! documented against the portable one.
//!
//! - [`buf`]: [`HostBuf`] / [`HostBufMut`], the floating-point element buffers;
//! - [`threads`]: [`KernelOptions`], the parallel thresholds and the chunked scoped threads;
//! - [`permute`]: the row gather and the weighted unpermute sum;
//! - [`gemm`]: the blocked grouped GEMM and its two backward pieces;
//! - [`pnorm`]: the p-power sum and scale kernels of the gradient norm.

pub mod buf;
pub mod gemm;
pub mod permute;
pub mod pnorm;
pub mod threads;

pub use buf::{HostBuf, HostBufMut};
pub use threads::{GEMM_PARALLEL_MIN_FLOPS, KernelOptions, PARALLEL_MIN_ELEMS};
