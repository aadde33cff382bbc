//! C ABI of the aclnn operators, for the op library's NPU kernels and for C++ trainers: grouped
//! matmul, MoE token permute/unpermute and the MC2 operators, on strided device views, each
//! with a workspace from the caller's allocator and launched on the caller's `aclrtStream`.

use std::ffi::{c_char, c_void};

use super::dtype::float_dtype_arg;
use super::error::FfiError;
use super::handle::{arg_cstr, arg_fn, arg_ref, arg_slice, invalid, write_out};
use super::panic::boundary;
use crate::backend::ascend::acl::{ACL_BF16, ACL_FLOAT16, ACL_INT32, ACL_INT64, acl_dtype};
use crate::backend::ascend::aclnn::mc2::Exchange;
use crate::backend::ascend::aclnn::{Aclnn, View};
use crate::error::{Error, ErrorKind};

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

/// Where MC2 operators send rows: the HCCL communicator's name (NUL-terminated, e.g. from
/// `fsdpturbo_hccl_comm_name` or torch_npu's `get_hccl_comm_name`), its size, and
/// `counts_len` = e · ep_world_size counts per direction: `send_counts[r·e + j]` rows go to
/// local expert j of rank r, `recv_counts[r·e + j]` rows come from rank r for local expert j.
/// With `trans_weight` the weight is [e, N, K] (rows times its transpose), otherwise [e, K, N].
#[repr(C)]
pub struct fsdpturbo_npu_exchange_t {
    pub group: *const c_char,
    pub ep_world_size: i64,
    pub counts_len: usize,
    pub send_counts: *const i64,
    pub recv_counts: *const i64,
    pub trans_weight: bool,
}

/// The `aclDataType` of a floating-point FSDPTURBO_DTYPE_* code.
fn acl_float_dtype(code: i32) -> Result<i32, FfiError> {
    Ok(acl_dtype(float_dtype_arg(code, "dtype")?))
}

fn view<'a>(v: *const fsdpturbo_npu_view_t, dtype: i32, name: &str) -> Result<View<'a>, FfiError> {
    let v = arg_ref(v, name)?;
    Ok(View {
        dtype,
        dims: arg_slice(v.dims, v.ndim, format_args!("{name}.dims"))?,
        strides: arg_slice(v.strides, v.ndim, format_args!("{name}.strides"))?,
        offset: v.offset,
        storage_len: v.storage_len,
        storage: v.storage,
    })
}

fn optional_view<'a>(
    v: *const fsdpturbo_npu_view_t,
    dtype: i32,
    name: &str,
) -> Result<Option<View<'a>>, FfiError> {
    if v.is_null() { Ok(None) } else { view(v, dtype, name).map(Some) }
}

/// The caller's allocator as the operators' workspace source.
fn workspace(
    alloc: fsdpturbo_npu_alloc_fn,
    ctx: *mut c_void,
) -> Result<impl FnMut(u64) -> crate::error::Result<*mut c_void>, FfiError> {
    let alloc = arg_fn(alloc, "alloc")?;
    Ok(move |bytes: u64| {
        // SAFETY: the caller's allocator and context.
        let p = unsafe { alloc(ctx, bytes) };
        if p.is_null() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("the workspace allocator returned NULL for {bytes} bytes"),
            ));
        }
        Ok(p)
    })
}

fn exchange<'a>(e: *const fsdpturbo_npu_exchange_t) -> Result<Exchange<'a>, FfiError> {
    let e = arg_ref(e, "exchange")?;
    Ok(Exchange {
        group: arg_cstr(e.group, "exchange.group")?,
        ep_world_size: e.ep_world_size,
        send_counts: arg_slice(e.send_counts, e.counts_len, "exchange.send_counts")?,
        recv_counts: arg_slice(e.recv_counts, e.counts_len, "exchange.recv_counts")?,
        trans_weight: e.trans_weight,
    })
}

fn mc2_dtype(code: i32) -> Result<i32, FfiError> {
    match acl_float_dtype(code)? {
        t @ (ACL_BF16 | ACL_FLOAT16) => Ok(t),
        _ => Err(invalid(
            "the MC2 operators take bfloat16 or float16 (FSDPTURBO_DTYPE_BF16 or _F16) only".into(),
        )),
    }
}

/// Grouped matmul through aclnn (V5, or V4 where V5 is absent) with per-group counts
/// (`group_list`: int64, one entry per group) on `stream`. `group_type` 0: x [M,K], weight
/// [G,K,N], out [M,N], `split_item` 2; `group_type` 2 (split along K): x [M,K], weight [K,N],
/// out [G,M,N], `split_item` 3. x, weight and out have `dtype` (FSDPTURBO_DTYPE_*).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_npu_grouped_mm(
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
            return Err(invalid(format!(
                "split_item {split_item} with group_type {group_type}: accepted are 2 with 0, 3 with 2"
            )));
        }
        let t = acl_float_dtype(dtype)?;
        let (x, weight, out) = (view(x, t, "x")?, view(weight, t, "weight")?, view(out, t, "out")?);
        let group_list = view(group_list, ACL_INT64, "group_list")?;
        let mut workspace = workspace(alloc, alloc_ctx)?;
        let api = Aclnn::get()?;
        // SAFETY: the views describe live device memory (caller's contract).
        unsafe {
            api.grouped_mm(&x, &weight, &group_list, &out, split_item, group_type, &mut workspace, stream)
        }?;
        Ok(())
    })
}

/// The aclnn grouped-matmul version in use (5 or 4), loading the libraries if needed.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_npu_grouped_mm_version(out: *mut u32) -> i32 {
    boundary(|| write_out(out, "out", Aclnn::get()?.grouped_mm.version()))
}

/// `aclnnMoeTokenPermute`: `permuted` ([T·K, H]) gets the rows of `tokens` ([T, H]) in the
/// stable order of `indices` (int32, [T, K]; K ≤ 512), and `sorted_indices` (int32, [T·K]) the
/// row of every flat (token, k) slot. `tokens` and `permuted` have `dtype`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_npu_moe_token_permute(
    dtype: i32,
    tokens: *const fsdpturbo_npu_view_t,
    indices: *const fsdpturbo_npu_view_t,
    permuted: *const fsdpturbo_npu_view_t,
    sorted_indices: *const fsdpturbo_npu_view_t,
    alloc: fsdpturbo_npu_alloc_fn,
    alloc_ctx: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let t = acl_float_dtype(dtype)?;
        let (tokens, permuted) = (view(tokens, t, "tokens")?, view(permuted, t, "permuted")?);
        let (indices, sorted) =
            (view(indices, ACL_INT32, "indices")?, view(sorted_indices, ACL_INT32, "sorted_indices")?);
        let mut workspace = workspace(alloc, alloc_ctx)?;
        // SAFETY: the views describe live device memory (caller's contract).
        unsafe {
            Aclnn::get()?.token_permute(&tokens, &indices, &permuted, &sorted, &mut workspace, stream)
        }?;
        Ok(())
    })
}

/// `aclnnMoeTokenUnpermute`: `out[t] = Σ_k permuted[sorted_indices[t·K + k]] · probs[t, k]`
/// (`probs` [T, K] of `dtype`, or NULL for K = 1). `sorted_indices` is int32.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_npu_moe_token_unpermute(
    dtype: i32,
    permuted: *const fsdpturbo_npu_view_t,
    sorted_indices: *const fsdpturbo_npu_view_t,
    probs: *const fsdpturbo_npu_view_t,
    out: *const fsdpturbo_npu_view_t,
    alloc: fsdpturbo_npu_alloc_fn,
    alloc_ctx: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let t = acl_float_dtype(dtype)?;
        let (permuted, out) = (view(permuted, t, "permuted")?, view(out, t, "out")?);
        let sorted = view(sorted_indices, ACL_INT32, "sorted_indices")?;
        let probs = optional_view(probs, t, "probs")?;
        let mut workspace = workspace(alloc, alloc_ctx)?;
        // SAFETY: the views describe live device memory (caller's contract).
        unsafe {
            Aclnn::get()?.token_unpermute(&permuted, &sorted, probs.as_ref(), &out, &mut workspace, stream)
        }?;
        Ok(())
    })
}

/// `aclnnAlltoAllvGroupedMatMul`: the rows of `x` ([Σ send_counts, K], grouped by destination
/// expert) to their experts' ranks, permuted local-expert-major (also written to `permute_out`,
/// [Σ recv_counts, K], unless NULL), times the weight of their expert: `gmm_y` [Σ recv_counts, N].
/// bfloat16 or float16 (`dtype`); every rank of the communicator calls it.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_npu_alltoallv_grouped_mm(
    dtype: i32,
    x: *const fsdpturbo_npu_view_t,
    weight: *const fsdpturbo_npu_view_t,
    exchange_spec: *const fsdpturbo_npu_exchange_t,
    gmm_y: *const fsdpturbo_npu_view_t,
    permute_out: *const fsdpturbo_npu_view_t,
    alloc: fsdpturbo_npu_alloc_fn,
    alloc_ctx: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let t = mc2_dtype(dtype)?;
        let (x, weight, y) = (view(x, t, "x")?, view(weight, t, "weight")?, view(gmm_y, t, "gmm_y")?);
        let permute_out = optional_view(permute_out, t, "permute_out")?;
        let exchange = exchange(exchange_spec)?;
        let mut workspace = workspace(alloc, alloc_ctx)?;
        // SAFETY: the views describe live device memory (caller's contract).
        unsafe {
            Aclnn::get()?.alltoallv_grouped_mm(
                &x,
                &weight,
                &exchange,
                &y,
                permute_out.as_ref(),
                &mut workspace,
                stream,
            )
        }?;
        Ok(())
    })
}

/// `aclnnGroupedMatMulAlltoAllv`: local-expert-major rows `x` ([Σ send_counts, K]) times their
/// expert's weight, put back in source order and returned to the ranks they came from: `y`
/// [Σ recv_counts, N]. bfloat16 or float16; every rank of the communicator calls it.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_npu_grouped_mm_alltoallv(
    dtype: i32,
    x: *const fsdpturbo_npu_view_t,
    weight: *const fsdpturbo_npu_view_t,
    exchange_spec: *const fsdpturbo_npu_exchange_t,
    y: *const fsdpturbo_npu_view_t,
    alloc: fsdpturbo_npu_alloc_fn,
    alloc_ctx: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    boundary(|| {
        let t = mc2_dtype(dtype)?;
        let (x, weight, y) = (view(x, t, "x")?, view(weight, t, "weight")?, view(y, t, "y")?);
        let exchange = exchange(exchange_spec)?;
        let mut workspace = workspace(alloc, alloc_ctx)?;
        // SAFETY: the views describe live device memory (caller's contract).
        unsafe { Aclnn::get()?.grouped_mm_alltoallv(&x, &weight, &exchange, &y, &mut workspace, stream) }?;
        Ok(())
    })
}
