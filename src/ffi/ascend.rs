//! C ABI of the Ascend backends, for the op library's NPU kernels and for C++ trainers: an HCCL
//! communicator made from a root info, its all-to-all-v, and aclnn grouped matmul on strided
//! device views. Streams are `aclrtStream` values (torch_npu's current stream). Device memory is
//! never read on the host.

use std::ffi::c_void;

use super::dtype::Dtype;
use super::error::FfiError;
use super::handle::{arg_mut, arg_ref, arg_slice, free_handle, into_handle, write_out};
use super::panic::boundary;
use super::status::{FSDPTURBO_ERR_INVALID_ARGUMENT, FSDPTURBO_ERR_UNAVAILABLE};
use crate::backend::acl::{self, ACL_BF16, ACL_DOUBLE, ACL_FLOAT, ACL_FLOAT16, ACL_INT64, Acl};
use crate::backend::aclnn::{Aclnn, View};
use crate::backend::hccl::{HCCL_ROOT_INFO_BYTES, Hccl};
use crate::comm::hccl::{HcclCollective, root_info};
use crate::comm::{AllToAllV, Collective, DataType, Stream};
use crate::error::Error;

/// Bytes of an HCCL root info (`HcclRootInfo`).
pub const FSDPTURBO_HCCL_ROOT_INFO_BYTES: usize = HCCL_ROOT_INFO_BYTES;

/// An HCCL communicator (opaque).
pub struct fsdpturbo_hccl_comm_t(HcclCollective);

/// A strided view of device memory: `dims`/`strides` (elements) of `ndim` entries, starting
/// `offset` elements into `storage`, an allocation of `storage_len` elements.
#[repr(C)]
pub struct fsdpturbo_npu_view_t {
    pub storage: *mut c_void,
    pub storage_len: i64,
    pub offset: i64,
    pub ndim: usize,
    pub dims: *const i64,
    pub strides: *const i64,
}

/// Allocates `bytes` of device memory valid for work queued on the launch stream; NULL on
/// failure. Called at most once per launch, between the two aclnn phases.
pub type fsdpturbo_npu_alloc_fn = Option<unsafe extern "C" fn(ctx: *mut c_void, bytes: u64) -> *mut c_void>;

fn comm_dtype(code: i32) -> Result<DataType, FfiError> {
    Ok(match Dtype::of(code, "dtype")? {
        Dtype::F32 => DataType::F32,
        Dtype::F64 => DataType::F64,
        Dtype::F16 => DataType::F16,
        Dtype::Bf16 => DataType::Bf16,
    })
}

fn acl_dtype(code: i32) -> Result<i32, FfiError> {
    Ok(match Dtype::of(code, "dtype")? {
        Dtype::F32 => ACL_FLOAT,
        Dtype::F64 => ACL_DOUBLE,
        Dtype::F16 => ACL_FLOAT16,
        Dtype::Bf16 => ACL_BF16,
    })
}

fn view<'a>(v: *const fsdpturbo_npu_view_t, dtype: i32, name: &str) -> Result<View<'a>, FfiError> {
    let v = arg_ref(v, name)?;
    Ok(View {
        dtype,
        dims: arg_slice(v.dims, v.ndim, &format!("{name}.dims"))?,
        strides: arg_slice(v.strides, v.ndim, &format!("{name}.strides"))?,
        offset: v.offset,
        storage_len: v.storage_len,
        storage: v.storage,
    })
}

/// Writes a fresh HCCL root info (`FSDPTURBO_HCCL_ROOT_INFO_BYTES` bytes) to `out`; call on one
/// rank and send the bytes to every rank of the group.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_hccl_root_info(out: *mut u8, len: usize) -> i32 {
    boundary(|| {
        if len != HCCL_ROOT_INFO_BYTES {
            return Err(FfiError::new(
                FSDPTURBO_ERR_INVALID_ARGUMENT,
                format!("`len` is {len}; an HCCL root info is {HCCL_ROOT_INFO_BYTES} bytes"),
            ));
        }
        let info = root_info()?;
        arg_mut(out, "out")?;
        // SAFETY: `out` holds `len` writable bytes (caller's contract), non-NULL (checked).
        unsafe { std::ptr::copy_nonoverlapping(info.as_ptr(), out, len) };
        Ok(())
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
        unsafe { comm.all_to_all_v(send, recv, &layout, comm_dtype(dtype)?, Stream(stream)) }?;
        Ok(())
    })
}

/// Grouped matmul through aclnn (V5, or V4 where V5 is absent) with per-group counts
/// (`group_list`: int64, one entry per group) on `stream`. `group_type` 0: x [M,K], weight
/// [G,K,N], out [M,N], `split_item` 2; `group_type` 2 (split along K): x [M,K], weight [K,N],
/// out [G,M,N], `split_item` 3. x, weight and out have `dtype` (FSDPTURBO_DTYPE_*).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_npu_grouped_matmul(
    dtype: i32,
    x: *const fsdpturbo_npu_view_t,
    weight: *const fsdpturbo_npu_view_t,
    group_list: *const fsdpturbo_npu_view_t,
    out: *const fsdpturbo_npu_view_t,
    split_item: i64,
    group_type: i64,
    alloc: fsdpturbo_npu_alloc_fn,
    alloc_ctx: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        if !matches!((split_item, group_type), (2, 0) | (3, 2)) {
            return Err(FfiError::new(
                FSDPTURBO_ERR_INVALID_ARGUMENT,
                format!(
                    "split_item {split_item} with group_type {group_type}: accepted are 2 with 0, 3 with 2"
                ),
            ));
        }
        let t = acl_dtype(dtype)?;
        let (x, weight, out) = (view(x, t, "x")?, view(weight, t, "weight")?, view(out, t, "out")?);
        let group_list = view(group_list, ACL_INT64, "group_list")?;
        let alloc = alloc
            .ok_or_else(|| FfiError::new(super::status::FSDPTURBO_ERR_NULL_ARGUMENT, "`alloc` is NULL"))?;
        let mut workspace = |bytes: u64| {
            // SAFETY: the caller's allocator and context.
            let p = unsafe { alloc(alloc_ctx, bytes) };
            if p.is_null() {
                return Err(Error::new(
                    crate::error::ErrorKind::Unavailable,
                    format!("the workspace allocator returned NULL for {bytes} bytes"),
                ));
            }
            Ok(p)
        };
        let api = Aclnn::get()?;
        // SAFETY: the views describe live device memory (caller's contract).
        unsafe {
            api.grouped_matmul(&x, &weight, &group_list, &out, split_item, group_type, &mut workspace, stream)
        }?;
        Ok(())
    })
}

/// The aclnn grouped-matmul version in use (5 or 4), loading the libraries if needed.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_npu_grouped_matmul_version(out: *mut u32) -> i32 {
    boundary(|| write_out(out, "out", Aclnn::get()?.grouped_matmul.version()))
}

/// Test mode only: succeeds only when libascendcl, libhccl, libopapi and libnnopbase are all
/// fsdpturbo's C test doubles (csrc/testing; they export a marker no CANN library has), and
/// then makes a stream of the double's runtime. With real CANN libraries it always fails, so
/// the op library's switch onto the doubles cannot be thrown in production.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_ascend_test_double_stream(out: *mut *mut c_void) -> i32 {
    boundary(|| {
        let acl = Acl::get()?;
        let libs =
            std::iter::once(&acl.lib).chain(std::iter::once(&Hccl::get()?.lib)).chain(&Aclnn::get()?.libs);
        if let Some(real) = libs.into_iter().find(|lib| !acl::is_test_double(lib)) {
            return Err(FfiError::new(
                FSDPTURBO_ERR_UNAVAILABLE,
                format!(
                    "{} is not fsdpturbo's Ascend test double: test mode is refused",
                    real.path().display()
                ),
            ));
        }
        let mut stream = std::ptr::null_mut();
        // SAFETY: an out-pointer for the new stream.
        acl::check(unsafe { (acl.create_stream)(&mut stream) }, "aclrtCreateStream")?;
        write_out(out, "out", stream)
    })
}
