//! The NCCL transport: a communicator made from a unique id that the embedder broadcasts
//! (rank 0 calls [`unique_id`], every rank calls [`NcclCollective::new`] with it). Buffers are
//! device memory ordered on the given stream; the device must be current on the calling thread
//! (NCCL's rule), which [`NcclCollective::new`] ensures through the driver's primary context.

use std::ffi::{c_int, c_void};

use super::{AllToAllV, Buffers, Collective, CollectiveOp, Dtype, ReduceOp, Stream};
use crate::backend::cuda::driver::driver;
use crate::backend::cuda::nccl::{self, Nccl, NcclComm, NcclUniqueId, nccl};
use crate::error::{Error, Result};

pub use crate::backend::cuda::nccl::NCCL_UNIQUE_ID_BYTES;

/// A fresh unique id as bytes.
pub fn unique_id() -> Result<[u8; NCCL_UNIQUE_ID_BYTES]> {
    let id = nccl()?.unique_id()?;
    Ok(id.internal.map(|c| c as u8))
}

fn nccl_dtype(d: Dtype) -> c_int {
    match d {
        Dtype::U8 => nccl::NCCL_UINT8,
        Dtype::I32 => nccl::NCCL_INT32,
        Dtype::I64 => nccl::NCCL_INT64,
        Dtype::F16 => nccl::NCCL_FLOAT16,
        Dtype::Bf16 => nccl::NCCL_BFLOAT16,
        Dtype::F32 => nccl::NCCL_FLOAT32,
        Dtype::F64 => nccl::NCCL_FLOAT64,
    }
}

fn nccl_op(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum => nccl::NCCL_SUM,
        ReduceOp::Prod => nccl::NCCL_PROD,
        ReduceOp::Max => nccl::NCCL_MAX,
        ReduceOp::Min => nccl::NCCL_MIN,
    }
}

/// One rank's NCCL communicator. Dropping it destroys the communicator: do that on every rank.
pub struct NcclCollective {
    lib: &'static Nccl,
    comm: NcclComm,
    rank: usize,
    world_size: usize,
    device: i32,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the C ABI hands
// it out behind a handle that the embedder uses like any NCCL communicator).
unsafe impl Send for NcclCollective {}
unsafe impl Sync for NcclCollective {}

impl NcclCollective {
    /// Joins the communicator of `world_size` ranks named by `id` as `rank`, on CUDA device
    /// `device`. Blocks until every rank has joined (ncclCommInitRank's rule).
    pub fn new(
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
        world_size: usize,
        rank: usize,
        device: i32,
    ) -> Result<NcclCollective> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!(
                "NCCL communicator: rank {rank} is outside a group of {world_size} ranks"
            )));
        }
        let nranks = c_int::try_from(world_size)
            .map_err(|_| Error::invalid(format!("NCCL communicator: {world_size} ranks are too many")))?;
        let lib = nccl()?;
        driver()?.use_device(device)?;
        let unique = NcclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: the id is passed by value as NCCL declares; writes one handle.
        lib.check(
            unsafe { (lib.comm_init_rank)(&mut comm, nranks, unique, rank as c_int) },
            "ncclCommInitRank",
            std::ptr::null_mut(),
        )?;
        Ok(NcclCollective { lib, comm, rank, world_size, device })
    }

    fn check(&self, status: c_int, call: &str) -> Result<()> {
        self.lib.check(status, call, self.comm)
    }

    fn peer(&self, p: usize) -> c_int {
        p as c_int
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // SAFETY: a communicator made by ncclCommInitRank, destroyed once. A failure cannot be
        // reported from a destructor.
        unsafe { (self.lib.comm_destroy)(self.comm) };
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn run(&self, op: CollectiveOp, b: Buffers) -> Result<()> {
        let (t, comm, stream) = (nccl_dtype(b.dtype), self.comm, b.stream.0);
        // SAFETY: the caller's device buffers and stream.
        let (status, call) = unsafe {
            match op {
                CollectiveOp::AllReduce(o) => (
                    (self.lib.all_reduce)(b.send, b.recv, b.count, t, nccl_op(o), comm, stream),
                    "ncclAllReduce",
                ),
                CollectiveOp::AllGather => {
                    ((self.lib.all_gather)(b.send, b.recv, b.count, t, comm, stream), "ncclAllGather")
                }
                CollectiveOp::ReduceScatter(o) => (
                    (self.lib.reduce_scatter)(b.send, b.recv, b.count, t, nccl_op(o), comm, stream),
                    "ncclReduceScatter",
                ),
            }
        };
        self.check(status, call)
    }

    unsafe fn all_to_all_v(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        layout: &AllToAllV,
        d: Dtype,
        stream: Stream,
    ) -> Result<()> {
        layout.check(self.world_size)?;
        let width = d.size();
        // SAFETY: group calls bracket the point-to-point calls; zero-count pairs are skipped
        // (NCCL uses zero-byte messages for synchronisation); the ranges are the caller's.
        unsafe {
            self.check((self.lib.group_start)(), "ncclGroupStart")?;
            let mut result = Ok(());
            for p in 0..self.world_size {
                if layout.send_counts[p] > 0 {
                    let at = send.cast::<u8>().add(layout.send_displs[p] * width).cast();
                    let s = (self.lib.send)(
                        at,
                        layout.send_counts[p],
                        nccl_dtype(d),
                        self.peer(p),
                        self.comm,
                        stream.0,
                    );
                    result = result.and(self.check(s, "ncclSend"));
                }
                if layout.recv_counts[p] > 0 {
                    let at = recv.cast::<u8>().add(layout.recv_displs[p] * width).cast();
                    let s = (self.lib.recv)(
                        at,
                        layout.recv_counts[p],
                        nccl_dtype(d),
                        self.peer(p),
                        self.comm,
                        stream.0,
                    );
                    result = result.and(self.check(s, "ncclRecv"));
                }
            }
            let end = self.check((self.lib.group_end)(), "ncclGroupEnd");
            result.and(end)
        }
    }

    fn all_reduce_host_f64(&self, value: f64, o: ReduceOp) -> Result<f64> {
        let drv = driver()?;
        drv.use_device(self.device)?;
        let buf = drv.alloc(8)?;
        let stream = Stream(std::ptr::null_mut()); // the legacy default stream
        drv.write(buf.ptr, &value.to_ne_bytes(), stream)?;
        let at = buf.ptr as *mut c_void;
        let buffers = Buffers { send: at, recv: at, count: 1, dtype: Dtype::F64, stream };
        // SAFETY: one f64 of device memory, ordered on the legacy default stream.
        unsafe { self.run(CollectiveOp::AllReduce(o), buffers)? };
        let mut bytes = [0u8; 8];
        drv.read_back(&mut bytes, buf.ptr, stream)?;
        Ok(f64::from_ne_bytes(bytes))
    }
}
