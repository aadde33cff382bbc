//! C ABI of the Ascend HCCL backend, for the op library's NPU kernels and for C++ trainers: an
//! HCCL communicator made from a root info, its name and its all-to-all-v. The aclnn operators are
//! in `ffi/npu.rs`; the switch onto the test doubles is a test hook (`ffi/internal/testing.rs`).
//! Streams are `aclrtStream` values (torch_npu's current stream). Device memory is never read on
//! the host.

use std::ffi::{c_char, c_void};

use super::dtype::float_dtype_arg;
use super::error::FfiError;
use super::handle::{arg_ref, arg_slice, free_handle, into_handle, invalid, write_array, write_out};
use super::panic::boundary;
use crate::backend::ascend::hccl::{HCCL_COMM_NAME_BYTES, HCCL_ROOT_INFO_BYTES};
use crate::comm::hccl::{HcclCollective, root_info};
use crate::comm::{AllToAllV, Collective, Stream};

/// Bytes of an HCCL root info (`HcclRootInfo`).
pub const FSDPTURBO_HCCL_ROOT_INFO_BYTES: usize = 4108;
// A literal for the header (the vendor constant stays private to the crate), pinned to it here.
const _: () = assert!(FSDPTURBO_HCCL_ROOT_INFO_BYTES == HCCL_ROOT_INFO_BYTES);
/// Bytes fsdpturbo_hccl_comm_name may write (`HcclGetCommName`), NUL included.
pub const FSDPTURBO_HCCL_COMM_NAME_BYTES: usize = 128;
const _: () = assert!(FSDPTURBO_HCCL_COMM_NAME_BYTES == HCCL_COMM_NAME_BYTES);

/// An HCCL communicator (opaque).
pub struct fsdpturbo_hccl_comm_t(HcclCollective);

/// Writes a fresh HCCL root info (`FSDPTURBO_HCCL_ROOT_INFO_BYTES` bytes) to `out`; call on one
/// rank and send the bytes to every rank of the group.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_hccl_root_info(out: *mut u8, len: usize) -> i32 {
    boundary(|| {
        if len != HCCL_ROOT_INFO_BYTES {
            return Err(invalid(format!(
                "`len` is {len}; an HCCL root info is {HCCL_ROOT_INFO_BYTES} bytes"
            )));
        }
        write_array(out, "out", &root_info()?)
    })
}

/// Joins the HCCL communicator of `world_size` ranks described by `root` (`len` bytes).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_hccl_comm_new(
    root: *const u8,
    len: usize,
    world_size: u32,
    rank: u32,
    out: *mut *mut fsdpturbo_hccl_comm_t,
) -> i32 {
    boundary(|| {
        let root = arg_slice(root, len, "root")?;
        let comm = HcclCollective::new(root, world_size as usize, rank as usize)?;
        write_out(out, "out", into_handle(fsdpturbo_hccl_comm_t(comm)))
    })
}

/// Writes the communicator's name (`HcclGetCommName`, NUL-terminated) to `out`, which holds
/// `len` bytes; `len` must be at least FSDPTURBO_HCCL_COMM_NAME_BYTES (128).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_hccl_comm_name(
    comm: *const fsdpturbo_hccl_comm_t,
    out: *mut c_char,
    len: usize,
) -> i32 {
    boundary(|| {
        let comm = &arg_ref(comm, "comm")?.0;
        if len < HCCL_COMM_NAME_BYTES {
            return Err(invalid(format!(
                "`len` is {len}; a communicator name needs {HCCL_COMM_NAME_BYTES} bytes"
            )));
        }
        let mut name = comm.name()?.into_bytes();
        name.push(0);
        // `len` >= HCCL_COMM_NAME_BYTES (checked) > the name and its NUL (127 bytes at most).
        write_array(out.cast::<u8>(), "out", &name)
    })
}

/// Destroys a communicator; NULL is a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_hccl_comm_free(comm: *mut fsdpturbo_hccl_comm_t) {
    let _ = boundary(|| {
        free_handle(comm);
        Ok(())
    });
}

/// All-to-all-v of `dtype` (FSDPTURBO_DTYPE_*) elements: `world_size` counts and displacements
/// per direction, in elements; queued on `stream`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_hccl_all_to_all_v(
    comm: *const fsdpturbo_hccl_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    send_counts: *const u64,
    send_displs: *const u64,
    recv_counts: *const u64,
    recv_displs: *const u64,
    world_size: usize,
    dtype: i32,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let comm = &arg_ref(comm, "comm")?.0;
        let list = |p: *const u64, name: &str| -> Result<Vec<usize>, FfiError> {
            Ok(arg_slice(p, world_size, name)?.iter().map(|&v| v as usize).collect())
        };
        let layout = AllToAllV {
            send_counts: list(send_counts, "send_counts")?,
            send_displs: list(send_displs, "send_displs")?,
            recv_counts: list(recv_counts, "recv_counts")?,
            recv_displs: list(recv_displs, "recv_displs")?,
        };
        // SAFETY: the caller's device buffers cover the layout (contract).
        unsafe { comm.all_to_all_v(send, recv, &layout, float_dtype_arg(dtype, "dtype")?, Stream(stream)) }?;
        Ok(())
    })
}
