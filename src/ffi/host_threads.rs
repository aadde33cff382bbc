//! Where the host kernels run their workers (`host::threads`).

use std::ffi::c_void;

use super::panic::boundary;
use crate::host::threads;

/// One worker of a `fsdpturbo_host_pool_fn` call: `work(arg, worker)`.
pub type fsdpturbo_host_work_fn = unsafe extern "C" fn(arg: *mut c_void, worker: usize);

/// A thread pool of the embedder: `run(ctx, workers, work, arg)` calls `work(arg, i)` exactly
/// once for each i in [0, workers), concurrently where it has the threads (one after another is
/// correct, only slower), and returns after every call has returned.
pub type fsdpturbo_host_pool_fn = Option<
    unsafe extern "C" fn(ctx: *mut c_void, workers: usize, work: fsdpturbo_host_work_fn, arg: *mut c_void),
>;

/// Makes the host kernels (fsdpturbo_grouped_mm and its gradients, fsdpturbo_unpermute,
/// fsdpturbo_local_power_sum, fsdpturbo_scale_in_place, fsdpturbo_clip_grad_norm*) run their
/// workers on the embedder's thread pool `run` (called with `ctx` from any thread that calls a
/// host kernel) instead of on threads of their own; `run` NULL: on threads of their own again
/// (the default). For a runtime whose worker threads stay busy between its own parallel
/// regions (OpenMP spins after each one): threads of the kernels' own would compete with them
/// for the cores. The torch op library passes torch's intra-op pool when it loads. Results do
/// not depend on it; calls under way when it changes finish on the pool they started with.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_set_host_thread_pool(run: fsdpturbo_host_pool_fn, ctx: *mut c_void) -> i32 {
    boundary(|| {
        threads::set_thread_pool(run.map(|run| (run, ctx)));
        Ok(())
    })
}
