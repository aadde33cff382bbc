//! The host-callback transport: the embedder lends its own process group (torch: a c10d group;
//! a C++ trainer: MPI, gloo, anything) as callbacks over host memory. The C ABI
//! (`ffi/comm.rs`) wraps C function pointers into these closures; data types and reduce ops
//! cross it as the codes of [`Dtype::code`] (FSDPTURBO_DTYPE_*) and [`ReduceOp::code`].

use std::ffi::c_void;

use super::{AllToAllV, Buffers, Collective, CollectiveOp, Dtype, ReduceOp, Stream};
use crate::error::{Error, ErrorKind, Result};

/// `(send, recv, count, dtype, op)`: an all-reduce or a reduce-scatter (see [`CollectiveOp`]).
/// Returns 0 on success, else the embedder's status.
pub type ReduceFn = Box<dyn Fn(*const c_void, *mut c_void, usize, Dtype, ReduceOp) -> i32 + Send + Sync>;
/// `(send, recv, count, dtype)`: an all-gather.
pub type AllGatherFn = Box<dyn Fn(*const c_void, *mut c_void, usize, Dtype) -> i32 + Send + Sync>;
/// All-to-all-v over a checked layout.
pub type AllToAllVFn = Box<dyn Fn(*const c_void, *mut c_void, &AllToAllV, Dtype) -> i32 + Send + Sync>;

impl ReduceOp {
    /// The FSDPTURBO_REDUCE_* code (SUM 0 and MAX 1 as the grad-norm callback has them).
    pub fn code(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
        }
    }

    /// The op of an FSDPTURBO_REDUCE_* code.
    pub fn from_code(code: i32) -> Option<ReduceOp> {
        [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod, ReduceOp::Min].into_iter().find(|o| o.code() == code)
    }
}

/// A process group lent through callbacks; `all_reduce` is required, the others are optional
/// (calling a missing one is an error naming it).
pub struct HostCallbacks {
    pub rank: usize,
    pub world_size: usize,
    pub all_reduce: ReduceFn,
    pub all_gather: Option<AllGatherFn>,
    pub reduce_scatter: Option<ReduceFn>,
    pub all_to_all_v: Option<AllToAllVFn>,
}

impl HostCallbacks {
    fn status(&self, status: i32, what: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("the embedder's {what} callback failed with status {status} on rank {}", self.rank),
        ))
    }

    fn missing(&self, what: &str) -> Error {
        Error::new(
            ErrorKind::Unavailable,
            format!(
                "this host communicator has no `{what}` callback (`fsdpturbo_host_collective_t.{what}` \
                 was NULL when it was made); pass one to fsdpturbo_comm_host_new to use {what}"
            ),
        )
    }
}

impl Collective for HostCallbacks {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn run(&self, op: CollectiveOp, b: Buffers) -> Result<()> {
        let (status, what) = match op {
            CollectiveOp::AllReduce(reduce) => {
                ((self.all_reduce)(b.send, b.recv, b.count, b.dtype, reduce), "all_reduce")
            }
            CollectiveOp::AllGather => {
                let f = self.all_gather.as_ref().ok_or_else(|| self.missing("all_gather"))?;
                (f(b.send, b.recv, b.count, b.dtype), "all_gather")
            }
            CollectiveOp::ReduceScatter(reduce) => {
                let f = self.reduce_scatter.as_ref().ok_or_else(|| self.missing("reduce_scatter"))?;
                (f(b.send, b.recv, b.count, b.dtype, reduce), "reduce_scatter")
            }
        };
        self.status(status, what)
    }

    unsafe fn all_to_all_v(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        layout: &AllToAllV,
        dtype: Dtype,
        _stream: Stream,
    ) -> Result<()> {
        layout.check(self.world_size)?;
        let f = self.all_to_all_v.as_ref().ok_or_else(|| self.missing("all_to_all_v"))?;
        let s = f(send, recv, layout, dtype);
        self.status(s, "all_to_all_v")
    }
}
