//! Collectives the library issues itself (the grad norm's reductions, the all-to-all of C++
//! trainers), behind one trait so that the algorithms are written once for every transport:
//! one rank, host callbacks (how torch_ext lends a c10d process group to Rust), NCCL, HCCL.
//!
//! Buffers are raw pointers into the memory the collective works on (host memory for
//! [`SingleRank`] and host callbacks, device memory on the given stream for NCCL and HCCL).
//! Counts and displacements are in elements.

use std::ffi::c_void;

pub use crate::backend::Stream;
pub use crate::dtype::Dtype;
use crate::error::{Error, Result};

pub mod hccl;
pub mod host;
pub mod nccl;

/// Reductions every transport offers (HCCL has no average: divide after a sum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
}

/// The collectives that move one block of `count` elements per rank between a send and a
/// receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveOp {
    /// `recv[i] = op over ranks of send[i]`; `send` may equal `recv`.
    AllReduce(ReduceOp),
    /// `recv` (`count * world_size` elements) holds every rank's `count` elements, in rank order.
    AllGather,
    /// Rank r receives the reduction of every rank's r-th block of `count` elements (`send` has
    /// `count * world_size` elements).
    ReduceScatter(ReduceOp),
}

/// The memory one [`CollectiveOp`] works on: `count` elements of `dtype` per rank, in this
/// collective's memory (host memory, or device memory ordered on `stream`).
#[derive(Clone, Copy, Debug)]
pub struct Buffers {
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub count: usize,
    pub dtype: Dtype,
    pub stream: Stream,
}

/// One process group's collectives. Every rank of the group must make the same calls in the
/// same order (that is how the grad norm never deadlocks, even on ranks without gradients).
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Runs `op` over `buffers`.
    ///
    /// # Safety
    /// `send` and `recv` hold the elements `op` reads and writes (see [`CollectiveOp`]).
    unsafe fn run(&self, op: CollectiveOp, buffers: Buffers) -> Result<()>;

    /// Sends `send_counts[p]` elements at `send_displs[p]` to rank p and receives
    /// `recv_counts[p]` elements at `recv_displs[p]` from rank p. Counts must agree pairwise.
    ///
    /// # Safety
    /// Every (displacement, count) range lies inside its buffer.
    unsafe fn all_to_all_v(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        layout: &AllToAllV,
        dtype: Dtype,
        stream: Stream,
    ) -> Result<()>;

    /// Reduces one f64 that lives in host memory (the grad norm's per-set value) and returns the
    /// result. Host transports reduce it in place; device transports override this (NCCL stages
    /// it through device memory and waits; HCCL refuses).
    fn all_reduce_host_f64(&self, value: f64, op: ReduceOp) -> Result<f64> {
        let mut out = value;
        let buffers = Buffers {
            send: (&value as *const f64).cast(),
            recv: (&mut out as *mut f64).cast(),
            count: 1,
            dtype: Dtype::F64,
            stream: Stream::HOST,
        };
        // SAFETY: one f64 of host memory each; this default is for host-memory transports.
        unsafe { self.run(CollectiveOp::AllReduce(op), buffers)? };
        Ok(out)
    }
}

/// Split sizes of one all-to-all-v, checked once for every transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllToAllV {
    pub send_counts: Vec<usize>,
    pub send_displs: Vec<usize>,
    pub recv_counts: Vec<usize>,
    pub recv_displs: Vec<usize>,
}

impl AllToAllV {
    /// Packed layout: displacements are the running sums of the counts.
    pub fn packed(send_counts: Vec<usize>, recv_counts: Vec<usize>) -> AllToAllV {
        let prefix = |counts: &[usize]| {
            counts
                .iter()
                .scan(0, |acc, &c| {
                    let at = *acc;
                    *acc += c;
                    Some(at)
                })
                .collect()
        };
        AllToAllV {
            send_displs: prefix(&send_counts),
            recv_displs: prefix(&recv_counts),
            send_counts,
            recv_counts,
        }
    }

    /// Checks that there is one count and displacement per rank.
    pub fn check(&self, world_size: usize) -> Result<()> {
        let lists = [
            ("send_counts", self.send_counts.len()),
            ("send_displs", self.send_displs.len()),
            ("recv_counts", self.recv_counts.len()),
            ("recv_displs", self.recv_displs.len()),
        ];
        for (name, len) in lists {
            if len != world_size {
                return Err(Error::invalid(format!(
                    "all-to-all-v: `{name}` has {len} entries; the group has {world_size} ranks and needs one per rank"
                )));
            }
        }
        Ok(())
    }
}

/// The group of one process: every collective is a copy (host memory).
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    /// Every collective of one rank is a copy (none when `send` is `recv`).
    unsafe fn run(&self, _op: CollectiveOp, b: Buffers) -> Result<()> {
        unsafe { copy(b.send, b.recv, b.count, b.dtype) };
        Ok(())
    }
    unsafe fn all_to_all_v(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        layout: &AllToAllV,
        dtype: Dtype,
        _stream: Stream,
    ) -> Result<()> {
        layout.check(1)?;
        if layout.send_counts[0] != layout.recv_counts[0] {
            return Err(Error::invalid(format!(
                "all-to-all-v on one rank: sends {} elements to itself but expects to receive {}",
                layout.send_counts[0], layout.recv_counts[0]
            )));
        }
        let width = dtype.size();
        // SAFETY: the caller guarantees the ranges.
        unsafe {
            copy(
                send.cast::<u8>().add(layout.send_displs[0] * width).cast(),
                recv.cast::<u8>().add(layout.recv_displs[0] * width).cast(),
                layout.send_counts[0],
                dtype,
            )
        };
        Ok(())
    }
}

/// Copies `count` elements of `dtype` unless `send` is `recv`.
///
/// # Safety
/// Both ranges are valid; they are distinct buffers or identical.
unsafe fn copy(send: *const c_void, recv: *mut c_void, count: usize, dtype: Dtype) {
    if send != recv.cast_const() {
        // SAFETY: the caller guarantees both ranges.
        unsafe { std::ptr::copy(send.cast::<u8>(), recv.cast::<u8>(), count * dtype.size()) };
    }
}
