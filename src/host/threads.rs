//! How the host kernels use threads: the size thresholds above which they use every core, the
//! [`KernelOptions`] a caller may set, and the chunked scoped-thread loop they share.

use super::isa::{self, Isa};
use crate::error::Result;

/// Kernels that touch at least this many elements use all available cores.
pub const PARALLEL_MIN_ELEMS: usize = 1 << 20;
/// Grouped GEMMs of at least this many flops (2·N·in·out) use all available cores.
pub const GEMM_PARALLEL_MIN_FLOPS: usize = 1 << 24;

/// The cores this process may use (1 when unknown).
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How the host kernels run. The default: all available cores for large problems, and the
/// process's instruction set ([`isa::current`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOptions {
    /// The most threads to use (`Some(0)` and `Some(1)`: the calling thread alone); `None`:
    /// all available cores for problems above [`PARALLEL_MIN_ELEMS`] elements
    /// ([`GEMM_PARALLEL_MIN_FLOPS`] for the GEMMs), one thread below. Results never depend on it.
    pub threads: Option<usize>,
    /// Use the portable loops for this call whatever the process's instruction set. The results
    /// are the same bits either way (the kernels' tests check it); a bad `FSDPTURBO_HOST_ISA`
    /// is still reported.
    pub portable: bool,
}

impl KernelOptions {
    pub(crate) fn threads_for(&self, work: usize, threshold: usize) -> usize {
        self.threads.unwrap_or(if work >= threshold { available_threads() } else { 1 })
    }

    /// The instruction set of this call: the process's, or portable when asked.
    pub(crate) fn isa(&self) -> Result<Isa> {
        let process = isa::current()?;
        Ok(if self.portable { Isa::Portable } else { process })
    }
}

/// Runs `f(i, chunk)` over consecutive chunks of `dst` of `per` elements (the last may be
/// shorter) on up to `threads` threads.
pub(crate) fn for_chunks<T: Send>(
    dst: &mut [T],
    per: usize,
    threads: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let per = per.max(1);
    let chunks = dst.len().div_ceil(per);
    if threads <= 1 || chunks <= 1 {
        dst.chunks_mut(per).enumerate().for_each(|(i, c)| f(i, c));
        return;
    }
    let threads = threads.min(chunks);
    // Hand out contiguous runs of chunks, one run per thread.
    let run = chunks.div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let mut rest = dst;
        let mut first = 0usize;
        let mut handles = Vec::new();
        while !rest.is_empty() {
            let take = (run * per).min(rest.len());
            let (head, tail) = rest.split_at_mut(take);
            rest = tail;
            let base = first;
            first += run;
            let mut work = move || head.chunks_mut(per).enumerate().for_each(|(i, c)| f(base + i, c));
            if rest.is_empty() {
                work();
            } else {
                handles.push(scope.spawn(work));
            }
        }
        for h in handles {
            if let Err(payload) = h.join() {
                std::panic::resume_unwind(payload);
            }
        }
    });
}

/// Threads for `total_elems` elements of work: all available cores at [`PARALLEL_MIN_ELEMS`] and
/// above, else one.
pub(crate) fn default_threads(total_elems: usize) -> usize {
    if total_elems < PARALLEL_MIN_ELEMS { 1 } else { available_threads() }
}
