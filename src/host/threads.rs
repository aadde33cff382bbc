//! How the host kernels use threads: the size thresholds above which they use every core, the
//! [`KernelOptions`] a caller may set, and the workers they share: scoped threads of their own,
//! or an embedder's thread pool ([`set_thread_pool`]).

use std::any::Any;
use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};

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
    // Contiguous runs of chunks, one run per worker.
    let run = chunks.div_ceil(threads.min(chunks));
    let runs: Vec<(usize, &mut [T])> =
        dst.chunks_mut(run * per).enumerate().map(|(r, s)| (r * run, s)).collect();
    for_each_part(runs, |(first, head)| head.chunks_mut(per).enumerate().for_each(|(i, c)| f(first + i, c)));
}

/// Runs `f` on each part, one worker per part, concurrently ([`run_workers`]).
pub(crate) fn for_each_part<P: Send>(parts: Vec<P>, f: impl Fn(P) + Sync) {
    let slots: Vec<Mutex<Option<P>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
    run_workers(slots.len(), &|i| {
        let part = slots[i].lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(part) = part {
            f(part);
        }
    });
}

/// `work(arg, worker)`: one worker of a [`PoolRunFn`] call.
pub type WorkFn = unsafe extern "C" fn(arg: *mut c_void, worker: usize);
/// An embedder's thread pool: `run(ctx, workers, work, arg)` calls `work(arg, i)` once for each
/// i < `workers`, concurrently where it has the threads, and returns after every call returned.
pub type PoolRunFn = unsafe extern "C" fn(ctx: *mut c_void, workers: usize, work: WorkFn, arg: *mut c_void);

#[derive(Clone, Copy)]
struct Pool {
    run: PoolRunFn,
    ctx: *mut c_void,
}

// SAFETY: the embedder's contract (`fsdpturbo_set_host_thread_pool`): the pool may be called
// from any thread with its context.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

static POOL: RwLock<Option<Pool>> = RwLock::new(None);

/// Makes the host kernels run their workers on `run` (with `ctx`) instead of threads of their
/// own, or on their own again with `None`. An embedder whose runtime keeps worker threads busy
/// (OpenMP's spin after each parallel region) passes its pool, so the kernels use those threads
/// rather than compete with them for the cores.
pub fn set_thread_pool(pool: Option<(PoolRunFn, *mut c_void)>) {
    *POOL.write().unwrap_or_else(PoisonError::into_inner) = pool.map(|(run, ctx)| Pool { run, ctx });
}

/// Runs `worker(i)` for every i < `workers`, concurrently: on the registered pool
/// ([`set_thread_pool`]), else on scoped threads with the calling thread as worker 0. A panic in
/// a worker is resumed here after every worker has finished.
pub(crate) fn run_workers(workers: usize, worker: &(dyn Fn(usize) + Sync)) {
    if workers <= 1 {
        (0..workers).for_each(worker);
        return;
    }
    let pool = *POOL.read().unwrap_or_else(PoisonError::into_inner);
    match pool {
        Some(pool) => run_on_pool(pool, workers, worker),
        None => std::thread::scope(|scope| {
            let handles: Vec<_> = (1..workers).map(|i| scope.spawn(move || worker(i))).collect();
            worker(0);
            for h in handles {
                if let Err(payload) = h.join() {
                    std::panic::resume_unwind(payload);
                }
            }
        }),
    }
}

/// One [`run_workers`] call on the embedder's pool.
struct PoolJob<'a> {
    worker: &'a (dyn Fn(usize) + Sync),
    ran: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

fn run_on_pool(pool: Pool, workers: usize, worker: &(dyn Fn(usize) + Sync)) {
    unsafe extern "C" fn work(arg: *mut c_void, i: usize) {
        // SAFETY: `arg` is the `PoolJob` below, alive until the pool's `run` returns.
        let job = unsafe { &*(arg as *const PoolJob) };
        // A panic must not unwind into the embedder's frames.
        if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(|| (job.worker)(i))) {
            job.panic.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(payload);
        }
        job.ran.fetch_add(1, Ordering::AcqRel);
    }
    let job = PoolJob { worker, ran: AtomicUsize::new(0), panic: Mutex::new(None) };
    // SAFETY: the pool's contract: `work` runs once per worker and every call has returned when
    // `run` returns, so `job` outlives them.
    unsafe { (pool.run)(pool.ctx, workers, work, &job as *const PoolJob as *mut c_void) };
    if let Some(payload) = job.panic.into_inner().unwrap_or_else(PoisonError::into_inner) {
        std::panic::resume_unwind(payload);
    }
    let ran = job.ran.load(Ordering::Acquire);
    assert!(ran == workers, "the host thread pool ran {ran} of {workers} workers (each must run once)");
}

/// Threads for `total_elems` elements of work: all available cores at [`PARALLEL_MIN_ELEMS`] and
/// above, else one.
pub(crate) fn default_threads(total_elems: usize) -> usize {
    if total_elems < PARALLEL_MIN_ELEMS { 1 } else { available_threads() }
}
