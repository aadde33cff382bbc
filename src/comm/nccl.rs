//! The NCCL transport: a communicator made from a unique id that the embedder broadcasts
//! (rank 0 calls [`unique_id`], every rank calls [`NcclCollective::new`] with it). Buffers are
//! device memory ordered on the given stream; the device must be current on the calling thread
//! (NCCL's rule), which [`NcclCollective::new`] ensures through the driver's primary context.
//!
//! The communicator is nonblocking (NCCL 2.14 and later) and every call on it has a deadline:
//! joining, and each call NCCL reports as still in progress, is polled until it finishes or the
//! deadline passes; then the communicator is aborted (`ncclCommAbort`, which frees a peer's
//! kernels too) and the call fails naming what did not finish. A rank that died leaves its
//! peers an error, not a hang. Work on the caller's streams is the caller's to wait for, except
//! the host all-reduce, which waits for its stream against the deadline too.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{AllToAllV, Buffers, Collective, CollectiveOp, Dtype, ReduceOp, Stream};
use crate::backend::cuda::driver::driver;
use crate::backend::cuda::nccl::{
    self, NCCL_IN_PROGRESS, Nccl, NcclComm, NcclConfig, NcclNonblocking, NcclUniqueId, nccl,
};
use crate::error::{Error, ErrorKind, Result};

pub use crate::backend::cuda::nccl::NCCL_UNIQUE_ID_BYTES;

/// The deadline of a call when the embedder gives none: torch's default for its NCCL process
/// groups.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

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
    /// How long one call may take; `None` on an NCCL without nonblocking communicators.
    timeout: Option<Duration>,
    /// Set when the communicator was aborted (a call ran past its deadline, or NCCL reported an
    /// error for a call in progress).
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the C ABI hands
// it out behind a handle that the embedder uses like any NCCL communicator).
unsafe impl Send for NcclCollective {}
unsafe impl Sync for NcclCollective {}

impl NcclCollective {
    /// Joins the communicator of `world_size` ranks named by `id` as `rank`, on CUDA device
    /// `device`, waiting for every rank to join for up to `timeout` (each later call has the
    /// same deadline). An NCCL older than 2.14 has no nonblocking communicators: there the join
    /// and the calls block without a deadline.
    pub fn new(
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
        world_size: usize,
        rank: usize,
        device: i32,
        timeout: Duration,
    ) -> Result<NcclCollective> {
        if timeout.is_zero() {
            return Err(Error::invalid("NCCL communicator: the timeout must be positive"));
        }
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
        let made = |comm, timeout| NcclCollective {
            lib,
            comm,
            rank,
            world_size,
            device,
            timeout,
            aborted: AtomicBool::new(false),
        };
        let mut comm: NcclComm = std::ptr::null_mut();
        let Some(nonblocking) = &lib.nonblocking else {
            // SAFETY: the id is passed by value as NCCL declares; writes one handle.
            let status = unsafe { (lib.comm_init_rank)(&mut comm, nranks, unique, rank as c_int) };
            lib.check(status, "ncclCommInitRank", std::ptr::null_mut())?;
            return Ok(made(comm, None));
        };
        let mut config = NcclConfig::nonblocking();
        // SAFETY: as above, with a config NCCL reads `size` bytes of; writes one handle.
        let status = unsafe {
            (nonblocking.comm_init_rank_config)(&mut comm, nranks, unique, rank as c_int, &mut config)
        };
        if comm.is_null() {
            lib.check(status, "ncclCommInitRankConfig", comm)?;
            return Err(Error::new(
                ErrorKind::Unavailable,
                "NCCL: ncclCommInitRankConfig made no communicator",
            ));
        }
        let made = made(comm, Some(timeout));
        match made.check(status, "ncclCommInitRankConfig (joining the communicator)") {
            Ok(()) => Ok(made),
            Err(err) => {
                made.abort_once(); // a communicator that failed to join is aborted, not destroyed
                Err(err)
            }
        }
    }

    /// The deadline of a call starting now (none where NCCL blocks).
    fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|timeout| Instant::now() + timeout)
    }

    /// The outcome of a call that returned `status`: on a nonblocking communicator a call in
    /// progress is polled until it finishes or its deadline passes, which aborts the
    /// communicator; so does an error it finishes with (NCCL's asynchronous errors leave it
    /// unusable).
    fn check(&self, status: c_int, call: &str) -> Result<()> {
        let in_progress = status == NCCL_IN_PROGRESS;
        let status = match (&self.lib.nonblocking, self.deadline()) {
            (Some(nonblocking), Some(deadline)) if in_progress => self.poll(nonblocking, deadline, call)?,
            _ => status,
        };
        let outcome = self.lib.check(status, call, self.comm);
        if outcome.is_err() && in_progress {
            self.abort_once();
        }
        outcome
    }

    /// Polls `call`, in progress, until NCCL reports how it ended (returned) or `deadline`
    /// passes (an error; the communicator aborted).
    fn poll(&self, nonblocking: &NcclNonblocking, deadline: Instant, call: &str) -> Result<c_int> {
        let mut polls = 0u32;
        loop {
            let mut status = NCCL_IN_PROGRESS;
            // SAFETY: a live communicator; writes one result.
            let query = unsafe { (nonblocking.comm_get_async_error)(self.comm, &mut status) };
            self.lib.check(query, "ncclCommGetAsyncError", self.comm)?;
            if status != NCCL_IN_PROGRESS {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(self.abort(call));
            }
            // A collective's enqueue ends within microseconds: yield at first, then sleep, so
            // that a long join does not hold a core.
            if polls < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
            polls = polls.saturating_add(1);
        }
    }

    fn abort_once(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            if let Some(nonblocking) = &self.lib.nonblocking {
                // SAFETY: a live communicator, aborted once (`aborted` was false).
                unsafe { (nonblocking.comm_abort)(self.comm) };
            }
        }
    }

    /// Aborts the communicator after `what` ran past the deadline, and says so.
    fn abort(&self, what: &str) -> Error {
        self.abort_once();
        let seconds = self.timeout.unwrap_or_default().as_secs_f64();
        Error::new(
            ErrorKind::Unavailable,
            format!(
                "NCCL: {what} did not finish within {seconds} s on rank {} of {}: a peer never made the \
                 same call or died; the communicator was aborted (free it; make a new one to go on)",
                self.rank, self.world_size
            ),
        )
    }

    fn usable(&self) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Error::new(
                ErrorKind::State,
                "NCCL: the communicator was aborted after a call failed or ran past its deadline; free it",
            ));
        }
        Ok(())
    }

    fn peer(&self, p: usize) -> c_int {
        p as c_int
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return; // ncclCommAbort freed it
        }
        // SAFETY: a communicator made by ncclCommInitRank(Config), destroyed once. A failure
        // cannot be reported from a destructor.
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
        self.usable()?;
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
        self.usable()?;
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
        if let Some(deadline) = self.deadline() {
            if !drv.wait_until(stream, deadline)? {
                return Err(self.abort("the all-reduce of a host value"));
            }
        }
        let mut bytes = [0u8; 8];
        drv.read_back(&mut bytes, buf.ptr, stream)?;
        Ok(f64::from_ne_bytes(bytes))
    }
}
