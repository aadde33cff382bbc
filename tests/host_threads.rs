//! The host kernels on an embedder's thread pool (`fsdpturbo_set_host_thread_pool`), through the
//! C API: the workers run on it, the bits are those of the kernels' own threads, and a pool that
//! breaks its contract is an error, not a hang or a wrong result.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use fsdpturbo::ffi::dtype::FSDPTURBO_DTYPE_F32;
use fsdpturbo::ffi::gemm::fsdpturbo_grouped_mm;
use fsdpturbo::ffi::host_threads::{fsdpturbo_host_work_fn, fsdpturbo_set_host_thread_pool};
use fsdpturbo::ffi::status::Status;

mod common;
use common::{Rng, last_error};

const GROUPS: usize = 4;
const ROWS: usize = 600; // per group: 2·ROWS·IN·OUT·GROUPS flops, above the threads' threshold
const IN: usize = 96;
const OUT: usize = 80;

/// A grouped matmul large enough to use every core, on whatever pool is registered.
fn grouped_mm(x: &[f32], w: &[f32]) -> (i32, Vec<f32>) {
    let rows = [ROWS as u64; GROUPS];
    let mut y = vec![0f32; GROUPS * ROWS * OUT];
    let status = fsdpturbo_grouped_mm(
        FSDPTURBO_DTYPE_F32,
        x.as_ptr().cast(),
        size_of_val(x),
        rows.as_ptr(),
        GROUPS,
        IN,
        OUT,
        w.as_ptr().cast(),
        size_of_val(w),
        y.as_mut_ptr().cast(),
        size_of_val(y.as_slice()),
    );
    (status, y)
}

type PoolFn = unsafe extern "C" fn(*mut c_void, usize, fsdpturbo_host_work_fn, *mut c_void);

static WORKERS_RUN: AtomicUsize = AtomicUsize::new(0);

/// A pool that runs the workers one after another on the calling thread, counting them.
unsafe extern "C" fn serial_pool(
    _ctx: *mut c_void,
    workers: usize,
    work: fsdpturbo_host_work_fn,
    arg: *mut c_void,
) {
    for i in 0..workers {
        WORKERS_RUN.fetch_add(1, Ordering::SeqCst);
        // SAFETY: the kernel's own worker and argument.
        unsafe { work(arg, i) };
    }
}

/// A pool that runs the workers on threads of its own, concurrently.
unsafe extern "C" fn threaded_pool(
    _ctx: *mut c_void,
    workers: usize,
    work: fsdpturbo_host_work_fn,
    arg: *mut c_void,
) {
    let arg = arg as usize;
    std::thread::scope(|scope| {
        for i in 0..workers {
            // SAFETY: as above; `arg` outlives the scope.
            scope.spawn(move || unsafe { work(arg as *mut c_void, i) });
        }
    });
}

/// A pool that breaks its contract: it runs no worker.
unsafe extern "C" fn idle_pool(
    _ctx: *mut c_void,
    _workers: usize,
    _work: fsdpturbo_host_work_fn,
    _arg: *mut c_void,
) {
}

#[test]
fn the_kernels_run_on_the_registered_pool_with_the_same_bits() {
    let mut rng = Rng(7);
    let x: Vec<f32> = (0..GROUPS * ROWS * IN).map(|_| rng.unit() as f32).collect();
    let w: Vec<f32> = (0..GROUPS * OUT * IN).map(|_| rng.unit() as f32).collect();
    let (status, own_threads) = grouped_mm(&x, &w);
    assert_eq!(status, Status::FSDPTURBO_OK, "{}", last_error());

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pools: [(PoolFn, bool); 2] = [(serial_pool, true), (threaded_pool, false)];
    for (pool, counts) in pools {
        assert_eq!(fsdpturbo_set_host_thread_pool(Some(pool), std::ptr::null_mut()), Status::FSDPTURBO_OK);
        let before = WORKERS_RUN.load(Ordering::SeqCst);
        let (status, on_pool) = grouped_mm(&x, &w);
        assert_eq!(status, Status::FSDPTURBO_OK, "{}", last_error());
        assert!(
            on_pool.iter().zip(&own_threads).all(|(a, b)| a.to_bits() == b.to_bits()),
            "the pool changed bits"
        );
        if counts && cores > 1 {
            assert!(WORKERS_RUN.load(Ordering::SeqCst) >= before + 2, "the workers did not run on the pool");
        }
    }

    assert_eq!(fsdpturbo_set_host_thread_pool(Some(idle_pool), std::ptr::null_mut()), Status::FSDPTURBO_OK);
    let (status, _) = grouped_mm(&x, &w);
    let message = last_error();
    assert_ne!(status, Status::FSDPTURBO_OK);
    assert!(message.contains("the host thread pool ran 0 of"), "{message}");

    assert_eq!(fsdpturbo_set_host_thread_pool(None, std::ptr::null_mut()), Status::FSDPTURBO_OK);
    let (status, again) = grouped_mm(&x, &w);
    assert_eq!(status, Status::FSDPTURBO_OK, "{}", last_error());
    assert_eq!(again, own_threads);
}
