//! C ABI of the collectives: communicator handles (one rank, host callbacks, NCCL) and their
//! operations. NCCL's own entry points (version, unique id) are in `nccl.rs`; the grad norm
//! over communicators is `fsdpturbo_clip_grad_norm_comm` in `norm.rs`.

use std::ffi::c_void;
use std::time::Duration;

use super::dtype::dtype_arg;
use super::error::FfiError;
use super::handle::{
    arg_fn, arg_ref, arg_slice, check_data, check_disjoint, check_struct_size, free_handle, into_handle,
    invalid, struct_size_of, write_out,
};
use super::panic::boundary;
use crate::comm::host::HostCallbacks;
use crate::comm::nccl::{DEFAULT_TIMEOUT, NCCL_UNIQUE_ID_BYTES, NcclCollective};
use crate::comm::{AllToAllV, Buffers, Collective, CollectiveOp, Dtype, ReduceOp, SingleRank, Stream};

/// Reduce op codes beyond FSDPTURBO_REDUCE_SUM (0) and FSDPTURBO_REDUCE_MAX (1).
pub const FSDPTURBO_REDUCE_PROD: i32 = 2;
pub const FSDPTURBO_REDUCE_MIN: i32 = 3;

/// A communicator: one process group's collectives (opaque).
pub struct fsdpturbo_comm_t {
    pub(super) inner: Box<dyn Collective + Send + Sync>,
}

/// Host all-reduce: `recv = op over ranks of send`, `count` elements of FSDPTURBO_DTYPE_* `dtype`,
/// `op` FSDPTURBO_REDUCE_*; `send` may equal `recv`. Return 0 on success.
pub type fsdpturbo_host_all_reduce_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
        op: i32,
    ) -> i32,
>;
/// Host all-gather: `recv` holds every rank's `count` elements in rank order. Return 0 on success.
pub type fsdpturbo_host_all_gather_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
    ) -> i32,
>;
/// Host all-to-all-v: per rank p, `send_counts[p]` elements at `send_displs[p]` go to p and
/// `recv_counts[p]` elements from p land at `recv_displs[p]` (elements, world_size entries
/// each). Return 0 on success.
pub type fsdpturbo_host_all_to_all_v_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        send: *const c_void,
        recv: *mut c_void,
        send_counts: *const usize,
        send_displs: *const usize,
        recv_counts: *const usize,
        recv_displs: *const usize,
        dtype: i32,
    ) -> i32,
>;

/// A process group lent through callbacks over host memory (fsdpturbo_comm_host_new).
/// `all_reduce` is required; `all_gather`, `reduce_scatter` (same signature as all_reduce: rank r
/// receives the reduction of every rank's r-th block of `count`) and `all_to_all_v` may be NULL:
/// fsdpturbo_comm_all_gather, fsdpturbo_comm_reduce_scatter and fsdpturbo_comm_all_to_all_v then
/// fail with FSDPTURBO_ERR_UNAVAILABLE naming the missing callback. `user` is passed to every
/// callback.
#[repr(C)]
pub struct fsdpturbo_host_collective_t {
    pub struct_size: usize,
    pub rank: usize,
    pub world_size: usize,
    pub user: *mut c_void,
    pub all_reduce: fsdpturbo_host_all_reduce_fn,
    pub all_gather: fsdpturbo_host_all_gather_fn,
    pub reduce_scatter: fsdpturbo_host_all_reduce_fn,
    pub all_to_all_v: fsdpturbo_host_all_to_all_v_fn,
}

const HOST_COLLECTIVE_V1_SIZE: usize = std::mem::size_of::<fsdpturbo_host_collective_t>();

fn reduce_op(code: i32) -> Result<ReduceOp, FfiError> {
    ReduceOp::from_code(code).ok_or_else(|| {
        invalid(format!("`op` is {code}, not an FSDPTURBO_REDUCE_* value (SUM=0, MAX=1, PROD=2, MIN=3)"))
    })
}

fn comm_out(
    out: *mut *mut fsdpturbo_comm_t,
    inner: Box<dyn Collective + Send + Sync>,
) -> Result<(), FfiError> {
    write_out(out, "out_comm", into_handle(fsdpturbo_comm_t { inner }))
}

/// A communicator of one rank (every collective is a copy).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_single_new(out_comm: *mut *mut fsdpturbo_comm_t) -> i32 {
    boundary(|| comm_out(out_comm, Box::new(SingleRank)))
}

/// A communicator over the embedder's process group, through callbacks (host memory).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_host_new(
    callbacks: *const fsdpturbo_host_collective_t,
    out_comm: *mut *mut fsdpturbo_comm_t,
) -> i32 {
    boundary(|| {
        check_struct_size(
            struct_size_of(callbacks, "callbacks")?,
            HOST_COLLECTIVE_V1_SIZE,
            "callbacks",
            "fsdpturbo_host_collective_t",
            None,
        )?;
        let c = arg_ref(callbacks, "callbacks")?;
        if c.world_size == 0 || c.rank >= c.world_size {
            return Err(invalid(format!(
                "callbacks: rank {} is outside a group of {} ranks",
                c.rank, c.world_size
            )));
        }
        let all_reduce = arg_fn(c.all_reduce, "callbacks.all_reduce")?;
        // The user pointer travels as an address so that the closures are Send + Sync: the
        // embedder vouches for using its group from the threads that call the library.
        let user = c.user as usize;
        let inner = HostCallbacks {
            rank: c.rank,
            world_size: c.world_size,
            // SAFETY (all four): the embedder's callbacks, called as their contract says.
            all_reduce: Box::new(move |s, r, n, d, o| unsafe {
                all_reduce(user as *mut c_void, s, r, n, d.code(), o.code())
            }),
            all_gather: c.all_gather.map(|f| {
                Box::new(move |s: *const c_void, r: *mut c_void, n: usize, d: Dtype| unsafe {
                    f(user as *mut c_void, s, r, n, d.code())
                }) as _
            }),
            reduce_scatter: c.reduce_scatter.map(|f| {
                Box::new(move |s: *const c_void, r: *mut c_void, n: usize, d: Dtype, o: ReduceOp| unsafe {
                    f(user as *mut c_void, s, r, n, d.code(), o.code())
                }) as _
            }),
            all_to_all_v: c.all_to_all_v.map(|f| {
                Box::new(move |s: *const c_void, r: *mut c_void, l: &AllToAllV, d: Dtype| unsafe {
                    f(
                        user as *mut c_void,
                        s,
                        r,
                        l.send_counts.as_ptr(),
                        l.send_displs.as_ptr(),
                        l.recv_counts.as_ptr(),
                        l.recv_displs.as_ptr(),
                        d.code(),
                    )
                }) as _
            }),
        };
        comm_out(out_comm, Box::new(inner))
    })
}

/// Joins an NCCL communicator of `world_size` ranks as `rank` on CUDA device `device`, from the
/// unique id (FSDPTURBO_NCCL_UNIQUE_ID_BYTES bytes) rank 0 made; waits until all ranks joined,
/// at most 600 s, as every later call (fsdpturbo_comm_nccl_new_with_timeout sets the limit).
/// Free it with fsdpturbo_comm_free on every rank. Buffers of its collectives are device memory.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_nccl_new(
    id: *const u8,
    world_size: usize,
    rank: usize,
    device: i32,
    out_comm: *mut *mut fsdpturbo_comm_t,
) -> i32 {
    let timeout_ms = DEFAULT_TIMEOUT.as_millis() as u64;
    fsdpturbo_comm_nccl_new_with_timeout(id, world_size, rank, device, timeout_ms, out_comm)
}

/// fsdpturbo_comm_nccl_new with the deadline of joining and of every call on the communicator:
/// a call NCCL has not finished within `timeout_ms` milliseconds (a peer that never makes it, or
/// died) aborts the communicator and fails with FSDPTURBO_ERR_UNAVAILABLE; later calls fail with
/// FSDPTURBO_ERR_STATE. NCCL before 2.14 has no nonblocking communicators: there calls block
/// without a deadline.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_nccl_new_with_timeout(
    id: *const u8,
    world_size: usize,
    rank: usize,
    device: i32,
    timeout_ms: u64,
    out_comm: *mut *mut fsdpturbo_comm_t,
) -> i32 {
    boundary(|| {
        let id = arg_slice(id, NCCL_UNIQUE_ID_BYTES, "id")?;
        let id: [u8; NCCL_UNIQUE_ID_BYTES] = id.try_into().expect("the slice has the id's length");
        let timeout = Duration::from_millis(timeout_ms);
        comm_out(out_comm, Box::new(NcclCollective::new(&id, world_size, rank, device, timeout)?))
    })
}

/// Frees a communicator; NULL is a no-op. For NCCL this destroys the communicator: call it on
/// every rank.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_free(comm: *mut fsdpturbo_comm_t) {
    free_handle(comm);
}

/// This rank and the group size.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_rank(
    comm: *const fsdpturbo_comm_t,
    out_rank: *mut usize,
    out_world_size: *mut usize,
) -> i32 {
    boundary(|| {
        let comm = arg_ref(comm, "comm")?;
        write_out(out_rank, "out_rank", comm.inner.rank())?;
        write_out(out_world_size, "out_world_size", comm.inner.world_size())
    })
}

/// The `send` and `recv` buffers of a collective (`n_send` and `n_recv` elements of `dtype`),
/// checked by the marshalling layer: NULL only when empty, aligned for the element type, in
/// range, and not overlapping, except that `in_place` accepts `send == recv`.
fn check_buffers(
    send: *const c_void,
    n_send: usize,
    recv: *mut c_void,
    n_recv: usize,
    dtype: Dtype,
    in_place: bool,
) -> Result<(), FfiError> {
    let send_region = check_data(send, n_send, dtype, "send")?;
    let recv_region = check_data(recv.cast_const(), n_recv, dtype, "recv")?;
    if in_place && send == recv.cast_const() {
        return Ok(());
    }
    check_disjoint(&[recv_region], &[send_region])
}

/// `count` × the group size: the elements of the gathered (or scattered) side.
fn group_elems(comm: &fsdpturbo_comm_t, count: usize) -> Result<usize, FfiError> {
    let world = comm.inner.world_size();
    count
        .checked_mul(world)
        .ok_or_else(|| invalid(format!("`count` ({count}) × the group's {world} ranks overflows")))
}

/// Checks `send` and `recv` for `op` (the elements each holds; only an all-reduce may
/// work in place) and runs it on `comm`.
fn run_collective(
    comm: *const fsdpturbo_comm_t,
    op: CollectiveOp,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: Dtype,
    stream: *mut c_void,
) -> Result<(), FfiError> {
    let comm = arg_ref(comm, "comm")?;
    let (send_elems, recv_elems) = match op {
        CollectiveOp::AllReduce(_) => (count, count),
        CollectiveOp::AllGather => (count, group_elems(comm, count)?),
        CollectiveOp::ReduceScatter(_) => (group_elems(comm, count)?, count),
    };
    check_buffers(send, send_elems, recv, recv_elems, dtype, matches!(op, CollectiveOp::AllReduce(_)))?;
    let buffers = Buffers { send, recv, count, dtype, stream: Stream(stream) };
    // SAFETY: the caller's buffers, of the sizes just checked.
    unsafe { comm.inner.run(op, buffers) }?;
    Ok(())
}

/// All-reduce of `count` elements (FSDPTURBO_DTYPE_* `dtype`, FSDPTURBO_REDUCE_* `op`) from
/// `send` into `recv` (may be equal, must not overlap otherwise), in the communicator's memory
/// (device memory ordered on `stream` for NCCL; host memory otherwise, where `stream` is ignored).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_all_reduce(
    comm: *const fsdpturbo_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: i32,
    op: i32,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let (dtype, op) = (dtype_arg(dtype, "dtype")?, reduce_op(op)?);
        run_collective(comm, CollectiveOp::AllReduce(op), send, recv, count, dtype, stream)
    })
}

/// All-gather: `recv` (`count` × world_size elements) receives every rank's `count` elements of
/// `send`, in rank order (FSDPTURBO_DTYPE_* `dtype`; buffers in the communicator's memory and on
/// `stream` as for fsdpturbo_comm_all_reduce; `send` and `recv` must not overlap). A host
/// communicator made without the `all_gather` callback fails with FSDPTURBO_ERR_UNAVAILABLE.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_all_gather(
    comm: *const fsdpturbo_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: i32,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        run_collective(comm, CollectiveOp::AllGather, send, recv, count, dtype_arg(dtype, "dtype")?, stream)
    })
}

/// Reduce-scatter: rank r's `recv` (`count` elements) receives the reduction (FSDPTURBO_REDUCE_*
/// `op`) over ranks of block r of `send` (`count` × world_size elements; FSDPTURBO_DTYPE_*
/// `dtype`; buffers in the communicator's memory and on `stream` as for
/// fsdpturbo_comm_all_reduce; `send` and `recv` must not overlap). A host communicator made
/// without the `reduce_scatter` callback fails with FSDPTURBO_ERR_UNAVAILABLE.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_reduce_scatter(
    comm: *const fsdpturbo_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: i32,
    op: i32,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let (dtype, op) = (dtype_arg(dtype, "dtype")?, reduce_op(op)?);
        run_collective(comm, CollectiveOp::ReduceScatter(op), send, recv, count, dtype, stream)
    })
}

/// All-to-all-v: rank p gets `send_counts[p]` elements from `send + send_displs[p]` and this
/// rank receives `recv_counts[p]` elements at `recv + recv_displs[p]` (elements; world_size
/// entries each; counts must agree pairwise). NCCL skips empty pairs.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_comm_all_to_all_v(
    comm: *const fsdpturbo_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    send_counts: *const usize,
    send_displs: *const usize,
    recv_counts: *const usize,
    recv_displs: *const usize,
    dtype: i32,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let comm = arg_ref(comm, "comm")?;
        let dtype = dtype_arg(dtype, "dtype")?;
        let n = comm.inner.world_size();
        let layout = AllToAllV {
            send_counts: arg_slice(send_counts, n, "send_counts")?.to_vec(),
            send_displs: arg_slice(send_displs, n, "send_displs")?.to_vec(),
            recv_counts: arg_slice(recv_counts, n, "recv_counts")?.to_vec(),
            recv_displs: arg_slice(recv_displs, n, "recv_displs")?.to_vec(),
        };
        // SAFETY: the caller guarantees the ranges, as documented.
        unsafe { comm.inner.all_to_all_v(send, recv, &layout, dtype, Stream(stream)) }?;
        Ok(())
    })
}
