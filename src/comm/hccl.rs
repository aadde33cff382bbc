//! Collectives over an HCCL communicator made from a root info (`HcclGetRootInfo` on one rank,
//! the 4108 bytes sent to every rank by the caller, e.g. a c10d broadcast, then
//! `HcclCommInitRootInfo` everywhere). Buffers are device memory; work is queued on the stream.

use std::ffi::{CStr, c_void};

use super::{AllToAllV, Buffers, Collective, CollectiveOp, Dtype, ReduceOp, Stream};
use crate::backend::ascend::hccl::{
    HCCL_COMM_NAME_BYTES, HCCL_ROOT_INFO_BYTES, Hccl, HcclComm, HcclRootInfo, dtype, reduce,
};
use crate::error::{Error, ErrorKind, Result};

pub struct HcclCollective {
    api: &'static Hccl,
    comm: HcclComm,
    rank: usize,
    world_size: usize,
}

// SAFETY: an HCCL communicator may be used from any thread, one call at a time (the &self
// methods are called by the one thread that owns the process group's work).
unsafe impl Send for HcclCollective {}

/// A fresh root info (on the root rank only).
pub fn root_info() -> Result<Vec<u8>> {
    let api = Hccl::get()?;
    let mut info = HcclRootInfo { internal: [0; HCCL_ROOT_INFO_BYTES] };
    // SAFETY: a writable HcclRootInfo.
    api.check(unsafe { (api.get_root_info)(&mut info) }, "HcclGetRootInfo")?;
    Ok(info.internal.to_vec())
}

fn hccl_dtype(t: Dtype) -> i32 {
    match t {
        Dtype::U8 => dtype::UINT8,
        Dtype::I32 => dtype::INT32,
        Dtype::I64 => dtype::INT64,
        Dtype::F16 => dtype::FP16,
        Dtype::Bf16 => dtype::BFP16,
        Dtype::F32 => dtype::FP32,
        Dtype::F64 => dtype::FP64,
    }
}

fn hccl_op(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => reduce::SUM,
        ReduceOp::Prod => reduce::PROD,
        ReduceOp::Max => reduce::MAX,
        ReduceOp::Min => reduce::MIN,
    }
}

impl HcclCollective {
    /// Joins the communicator of `world_size` ranks described by `root` (from [`root_info`]).
    pub fn new(root: &[u8], world_size: usize, rank: usize) -> Result<HcclCollective> {
        if root.len() != HCCL_ROOT_INFO_BYTES {
            return Err(Error::invalid(format!(
                "HCCL root info has {} bytes; HcclRootInfo is exactly {HCCL_ROOT_INFO_BYTES}",
                root.len()
            )));
        }
        if world_size == 0 || rank >= world_size || u32::try_from(world_size).is_err() {
            return Err(Error::invalid(format!(
                "HCCL communicator: rank {rank} is outside a group of {world_size} ranks"
            )));
        }
        let api = Hccl::get()?;
        let mut info = HcclRootInfo { internal: [0; HCCL_ROOT_INFO_BYTES] };
        info.internal.copy_from_slice(root);
        let mut comm: HcclComm = std::ptr::null_mut();
        // SAFETY: nRanks, root info, rank, then the communicator out-pointer (last).
        let code = unsafe { (api.comm_init_root_info)(world_size as u32, &info, rank as u32, &mut comm) };
        api.check(code, "HcclCommInitRootInfo")?;
        Ok(HcclCollective { api, comm, rank, world_size })
    }

    /// The communicator's name (`HcclGetCommName`): what aclnn MC2 operators take as `group`.
    pub fn name(&self) -> Result<String> {
        let get = self.api.get_comm_name.ok_or_else(|| {
            Error::new(
                ErrorKind::Unavailable,
                format!("{} has no HcclGetCommName (CANN too old for MC2)", self.api.lib.path().display()),
            )
        })?;
        let mut buf = [0u8; HCCL_COMM_NAME_BYTES];
        // SAFETY: a live communicator and a buffer of HCCL_COMM_NAME_BYTES bytes.
        self.api.check(unsafe { get(self.comm, buf.as_mut_ptr().cast()) }, "HcclGetCommName")?;
        let name = CStr::from_bytes_until_nul(&buf)
            .map_err(|_| Error::invalid("HcclGetCommName wrote no NUL within 128 bytes"))?;
        Ok(name.to_string_lossy().into_owned())
    }
}

impl Drop for HcclCollective {
    fn drop(&mut self) {
        // SAFETY: made by HcclCommInitRootInfo, destroyed once.
        unsafe { (self.api.comm_destroy)(self.comm) };
    }
}

impl Collective for HcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn run(&self, op: CollectiveOp, b: Buffers) -> Result<()> {
        let (send, count, t, comm, stream) =
            (b.send.cast_mut(), b.count as u64, hccl_dtype(b.dtype), self.comm, b.stream.0);
        // SAFETY: the caller's buffers and stream.
        let (code, call) = unsafe {
            match op {
                CollectiveOp::AllReduce(reduce) => (
                    (self.api.all_reduce)(send, b.recv, count, t, hccl_op(reduce), comm, stream),
                    "HcclAllReduce",
                ),
                CollectiveOp::AllGather => {
                    ((self.api.all_gather)(send, b.recv, count, t, comm, stream), "HcclAllGather")
                }
                CollectiveOp::ReduceScatter(reduce) => (
                    (self.api.reduce_scatter)(send, b.recv, count, t, hccl_op(reduce), comm, stream),
                    "HcclReduceScatter",
                ),
            }
        };
        self.api.check(code, call)
    }

    unsafe fn all_to_all_v(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        layout: &AllToAllV,
        dtype: Dtype,
        stream: Stream,
    ) -> Result<()> {
        layout.check(self.world_size)?;
        let host = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<u64>>();
        let (sc, sd) = (host(&layout.send_counts), host(&layout.send_displs));
        let (rc, rd) = (host(&layout.recv_counts), host(&layout.recv_displs));
        let t = hccl_dtype(dtype);
        // SAFETY: host uint64_t arrays of one entry per rank, alive for the call.
        let code = unsafe {
            (self.api.all_to_all_v)(
                send,
                sc.as_ptr().cast(),
                sd.as_ptr().cast(),
                t,
                recv.cast_const(),
                rc.as_ptr().cast(),
                rd.as_ptr().cast(),
                t,
                self.comm,
                stream.0,
            )
        };
        self.api.check(code, "HcclAlltoAllV")
    }

    /// Refused: HCCL reduces device memory and the ACL runtime is not bound for staging a host
    /// value (the grad norm reaches HCCL through torch_npu's process group, i.e. host callbacks).
    fn all_reduce_host_f64(&self, _value: f64, _op: ReduceOp) -> Result<f64> {
        Err(Error::new(
            ErrorKind::Unavailable,
            "HcclCollective cannot reduce a host value: HCCL works on device memory; lend the process \
             group through host callbacks for the grad norm",
        ))
    }
}
