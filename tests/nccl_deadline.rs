//! The deadline of the library's NCCL communicator, over the C doubles of the CUDA driver and
//! NCCL (tests/doubles: ranks are threads, a nonblocking call stays in progress until every
//! rank has made it): a rank that never joins or never makes a collective fails its peers
//! within the deadline, and one that left fails them at once (NCCL's asynchronous error), each
//! aborting the communicator, instead of leaving them waiting.

mod doubles;

use std::sync::{Barrier, MutexGuard};
use std::time::{Duration, Instant};

use fsdpturbo::comm::nccl::{NcclCollective, unique_id};
use fsdpturbo::comm::{Collective, ReduceOp};
use fsdpturbo::error::ErrorKind;

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(20);

/// Points the CUDA and NCCL loaders at the doubles (before this binary's first load) and
/// serialises the tests (they read the doubles' counters).
fn setup() -> MutexGuard<'static, ()> {
    let guard = doubles::lock();
    let dir = doubles::dir().join("cuda");
    // SAFETY: the tests of this binary hold `lock()` while touching the environment.
    unsafe {
        std::env::set_var("FSDPTURBO_CUDA_PATH", dir.join("libcuda.so"));
        std::env::set_var("FSDPTURBO_NCCL_PATH", dir.join("libnccl.so"));
    }
    guard
}

/// The double's count of communicators freed by `ncclCommAbort` or `ncclCommDestroy`.
fn freed(counter: &str) -> i32 {
    let lib = unsafe { libloading::Library::new(doubles::dir().join("cuda/libnccl.so")) }.unwrap();
    let f: libloading::Symbol<unsafe extern "C" fn() -> i32> =
        unsafe { lib.get(counter.as_bytes()) }.unwrap();
    unsafe { f() }
}

fn aborts() -> i32 {
    freed("fsdpturbo_nccl_double_aborts")
}

fn destroys() -> i32 {
    freed("fsdpturbo_nccl_double_destroys")
}

/// Runs `f(rank, communicator)` on one thread per rank of a fresh communicator of `world`.
fn on_ranks<T: Send>(world: usize, f: impl Fn(usize, NcclCollective) -> T + Sync) -> Vec<T> {
    let id = unique_id().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                s.spawn(move || f(rank, NcclCollective::new(&id, world, rank, rank as i32, LONG).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_that_all_join_reduce_and_free_their_communicators() {
    let _guard = setup();
    let (aborted, destroyed) = (aborts(), destroys());
    let sums = on_ranks(3, |rank, comm| {
        assert_eq!((comm.rank(), comm.world_size()), (rank, 3));
        comm.all_reduce_host_f64(rank as f64 + 0.5, ReduceOp::Sum).unwrap()
    });
    assert_eq!(sums, vec![4.5; 3]);
    assert_eq!((aborts() - aborted, destroys() - destroyed), (0, 3));
}

#[test]
fn an_error_nccl_returns_at_once_leaves_the_communicator_usable() {
    let _guard = setup();
    let aborted = aborts();
    let sums = on_ranks(2, |rank, comm| {
        // The double computes sums only: NCCL's synchronous invalid-usage error.
        let err = comm.all_reduce_host_f64(1.0, ReduceOp::Max).unwrap_err();
        assert!(err.message.contains("ncclAllReduce failed with 5 (invalid usage)"), "{}", err.message);
        comm.all_reduce_host_f64(rank as f64, ReduceOp::Sum).unwrap()
    });
    assert_eq!(sums, vec![1.0; 2]);
    assert_eq!(aborts() - aborted, 0);
}

#[test]
fn a_rank_that_never_joins_fails_the_others_within_the_deadline() {
    let _guard = setup();
    let aborted = aborts();
    let id = unique_id().unwrap();
    let start = Instant::now();
    let err = NcclCollective::new(&id, 2, 0, 0, SHORT).err().expect("rank 1 never joins");
    assert!(start.elapsed() < SHORT + Duration::from_secs(5), "took {:?}", start.elapsed());
    assert_eq!(err.kind, ErrorKind::Unavailable);
    assert!(
        err.message.contains(
            "ncclCommInitRankConfig (joining the communicator) did not finish within 0.3 s on rank 0 of 2"
        ),
        "{}",
        err.message
    );
    assert_eq!(aborts() - aborted, 1, "the half-made communicator is aborted");
}

/// Two ranks join; rank 0 (deadline `timeout`) calls the host all-reduce twice while rank 1
/// never does: it keeps its communicator until rank 0 is done (`peer_stays`) or frees it at
/// once. Checks that rank 0's first call fails naming `failure`, that the communicator is then
/// aborted (the second call refused, rank 0's aborted, rank 1's destroyed), and returns how long
/// the first call took.
fn rank0_fails_alone_in_the_collective(timeout: Duration, peer_stays: bool, failure: &str) -> Duration {
    let (aborted, destroyed) = (aborts(), destroys());
    let id = unique_id().unwrap();
    let rank0_done = Barrier::new(2);
    let (first, elapsed, again) = std::thread::scope(|s| {
        s.spawn(|| {
            let comm = NcclCollective::new(&id, 2, 1, 0, LONG).unwrap();
            if peer_stays {
                rank0_done.wait();
            }
            drop(comm);
        });
        let comm = NcclCollective::new(&id, 2, 0, 0, timeout).unwrap();
        let start = Instant::now();
        let first = comm.all_reduce_host_f64(1.0, ReduceOp::Sum).unwrap_err();
        let elapsed = start.elapsed();
        let again = comm.all_reduce_host_f64(1.0, ReduceOp::Sum).unwrap_err();
        if peer_stays {
            rank0_done.wait();
        }
        (first, elapsed, again)
    });
    assert_eq!(first.kind, ErrorKind::Unavailable);
    assert!(first.message.contains(failure), "{}", first.message);
    assert_eq!(again.kind, ErrorKind::State);
    assert!(again.message.contains("was aborted"), "{}", again.message);
    assert_eq!((aborts() - aborted, destroys() - destroyed), (1, 1), "rank 0 aborted, rank 1 destroyed");
    elapsed
}

#[test]
fn a_rank_that_never_makes_the_collective_aborts_it_on_the_others() {
    let _guard = setup();
    let failure = "ncclAllReduce did not finish within 0.3 s on rank 0 of 2";
    let elapsed = rank0_fails_alone_in_the_collective(SHORT, true, failure);
    assert!(elapsed >= SHORT && elapsed < SHORT + Duration::from_secs(5), "took {elapsed:?}");
}

#[test]
fn a_rank_that_left_fails_the_collective_at_once_and_aborts_it() {
    let _guard = setup();
    let failure = "ncclAllReduce failed with 6 (remote process exited";
    let elapsed = rank0_fails_alone_in_the_collective(LONG, false, failure);
    assert!(
        elapsed < Duration::from_secs(5),
        "took {elapsed:?}: NCCL's error was not seen before the deadline"
    );
}

#[test]
fn a_zero_timeout_is_refused() {
    let _guard = setup();
    let err = NcclCollective::new(&unique_id().unwrap(), 1, 0, 0, Duration::ZERO).err().unwrap();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(err.message.contains("the timeout must be positive"), "{}", err.message);
}
