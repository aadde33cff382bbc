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

/// One process group's collectives. Every rank of the group must make the same calls in the
/// same order (that is how the grad norm never deadlocks, even on ranks without gradients).
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// `recv[i] = op over ranks of send[i]` for `count` elements; `send` may equal `recv`.
    ///
    /// # Safety
    /// `send` and `recv` point to `count` elements of `dtype` in this collective's memory.
    unsafe fn all_reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<()>;

    /// `recv` holds every rank's `count` elements, in rank order.
    ///
    /// # Safety
    /// `send` has `count` elements, `recv` has `count * world_size` elements.
    unsafe fn all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        stream: Stream,
    ) -> Result<()>;

    /// Rank r receives the reduction of every rank's r-th block of `count` elements.
    ///
    /// # Safety
    /// `send` has `count * world_size` elements, `recv` has `count` elements.
    unsafe fn reduce_scatter(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<()>;

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
        let send = (&value as *const f64).cast();
        // SAFETY: one f64 of host memory each; this default is for host-memory transports.
        unsafe { self.all_reduce(send, (&mut out as *mut f64).cast(), 1, Dtype::F64, op, Stream::HOST)? };
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

impl SingleRank {
    unsafe fn copy(send: *const c_void, recv: *mut c_void, count: usize, dtype: Dtype) {
        if send != recv.cast_const() {
            // SAFETY: the caller guarantees both ranges; they are distinct buffers or identical.
            unsafe { std::ptr::copy(send.cast::<u8>(), recv.cast::<u8>(), count * dtype.size()) };
        }
    }
}

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    unsafe fn all_reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        _op: ReduceOp,
        _stream: Stream,
    ) -> Result<()> {
        unsafe { Self::copy(send, recv, count, dtype) };
        Ok(())
    }
    unsafe fn all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        _stream: Stream,
    ) -> Result<()> {
        unsafe { Self::copy(send, recv, count, dtype) };
        Ok(())
    }
    unsafe fn reduce_scatter(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        _op: ReduceOp,
        _stream: Stream,
    ) -> Result<()> {
        unsafe { Self::copy(send, recv, count, dtype) };
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
            Self::copy(
                send.cast::<u8>().add(layout.send_displs[0] * width).cast(),
                recv.cast::<u8>().add(layout.recv_displs[0] * width).cast(),
                layout.send_counts[0],
                dtype,
            )
        };
        Ok(())
    }
}
