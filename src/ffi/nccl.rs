//! C ABI of NCCL itself: its version, and the unique id that its communicators
//! (`fsdpturbo_comm_nccl_new`, in `comm.rs`) are joined from.

use super::handle::{out_array, write_array, write_out};
use super::panic::boundary;
use crate::backend::cuda::nccl as nccl_lib;
use crate::comm::nccl::{NCCL_UNIQUE_ID_BYTES, unique_id};

/// Bytes of an NCCL unique id.
pub const FSDPTURBO_NCCL_UNIQUE_ID_BYTES: usize = 128;
// A literal for the header (the vendor constant stays private to the crate), pinned to it here.
const _: () = assert!(FSDPTURBO_NCCL_UNIQUE_ID_BYTES == NCCL_UNIQUE_ID_BYTES);

/// Loads NCCL and writes its version code (X*10000 + Y*100 + Z, e.g. 23007 for 2.30.7).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_nccl_version(out_version: *mut i32) -> i32 {
    boundary(|| write_out(out_version, "out_version", nccl_lib::nccl()?.version()?))
}

/// Writes a fresh NCCL unique id (FSDPTURBO_NCCL_UNIQUE_ID_BYTES bytes) to `out_id`. Rank 0
/// makes it and the embedder broadcasts it to the other ranks. Needs no GPU.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_nccl_unique_id(out_id: *mut u8) -> i32 {
    boundary(|| {
        out_array(out_id, NCCL_UNIQUE_ID_BYTES, "out_id")?;
        write_array(out_id, "out_id", &unique_id()?)
    })
}
