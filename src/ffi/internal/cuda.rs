//! C ABI of the CUDA kernels (src/backend/cuda/kernels.rs, cublas.rs): what torch_ext's CUDA dispatch
//! keys call. Every data pointer is device memory of `device` (a CUDA ordinal), every launch is
//! ordered on `stream` (a `cudaStream_t`, e.g. torch's current stream), and scratch memory is a
//! caller-provided workspace whose size the `*_workspace` functions give. Functions that check
//! their input on the device (route, permute, unpermute) wait for the stream; the others do not.

use std::ffi::c_void;

use crate::backend::Stream;
use crate::backend::cuda::cublas::{self, GemmBuffers, GemmKind};
use crate::backend::cuda::kernels::{self, DeviceTensor, PermuteBuffers, RouteBuffers, UnpermuteBuffers};
use crate::ffi::dtype::float_dtype_arg;
use crate::ffi::handle::{arg_slice, invalid, write_out, write_slice};
use crate::ffi::norm::fsdpturbo_grad_t;
use crate::ffi::panic::boundary;
use crate::norm::NormType;

/// fsdpturbo_cuda_grouped_mm `kind`: y = x_g @ W[g]^T (a = x, b = W, c = y).
pub const FSDPTURBO_GEMM_FORWARD: i32 = 0;
/// grad_x = grad_y_g @ W[g] (a = grad_y, b = W, c = grad_x).
pub const FSDPTURBO_GEMM_GRAD_INPUT: i32 = 1;
/// grad_W[g] = grad_y_g^T @ x_g (a = grad_y, b = x, c = grad_W).
pub const FSDPTURBO_GEMM_GRAD_WEIGHT: i32 = 2;

fn addr<T>(p: *const T) -> u64 {
    p as usize as u64
}

/// Workspace bytes of fsdpturbo_cuda_route.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_route_workspace(tokens: usize, top_k: usize, num_experts: usize) -> usize {
    kernels::route_workspace(tokens, top_k, num_experts)
}

/// fsdpturbo_route on the device: int64 `expert_ids [tokens, top_k]`; int64 outputs
/// `tokens_per_expert [num_experts]`, `permutation [tokens*top_k]`, `input_splits [ep_size]`.
/// Ids outside [0, num_experts) are an error with fsdpturbo_route's message. Waits for `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_route(
    device: i32,
    stream: *mut c_void,
    expert_ids: *const i64,
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    ep_size: usize,
    tokens_per_expert: *mut i64,
    permutation: *mut i64,
    input_splits: *mut i64,
    workspace: *mut c_void,
    workspace_bytes: usize,
) -> i32 {
    boundary(|| {
        let b = RouteBuffers {
            expert_ids: addr(expert_ids),
            tokens_per_expert: addr(tokens_per_expert),
            permutation: addr(permutation),
            input_splits: addr(input_splits),
            workspace: addr(workspace),
            workspace_bytes,
        };
        Ok(kernels::route(device, Stream(stream), tokens, top_k, num_experts, ep_size, &b)?)
    })
}

/// Row gather on the device: `dst[i, :] = src[rows[i] / row_divisor, :]` for `src [src_rows,
/// hidden]` of FSDPTURBO_DTYPE_* `dtype` and int64 `rows [n_rows]`; 16-byte vector loads where
/// rows and pointers allow. A row outside `src` is an error (fsdpturbo_permute_rows' message).
/// The workspace needs 8 bytes. Waits for `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_permute_rows(
    device: i32,
    stream: *mut c_void,
    dtype: i32,
    src: *const c_void,
    src_rows: usize,
    hidden: usize,
    rows: *const i64,
    n_rows: usize,
    row_divisor: usize,
    dst: *mut c_void,
    workspace: *mut c_void,
    workspace_bytes: usize,
) -> i32 {
    boundary(|| {
        let e = float_dtype_arg(dtype, "dtype")?;
        let row_bytes = hidden
            .checked_mul(e.size())
            .ok_or_else(|| invalid(format!("hidden {hidden} overflows a row's byte size")))?;
        let b = PermuteBuffers {
            src: addr(src),
            rows: addr(rows),
            dst: addr(dst),
            workspace: addr(workspace),
            workspace_bytes,
        };
        Ok(kernels::permute(device, Stream(stream), row_bytes, src_rows, n_rows, row_divisor, &b)?)
    })
}

/// Workspace bytes of fsdpturbo_cuda_unpermute.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_unpermute_workspace(tokens: usize, top_k: usize) -> usize {
    kernels::unpermute_workspace(tokens, top_k)
}

/// fsdpturbo_unpermute on the device: `out [tokens, hidden] = Σ_k probs[t, k] ·
/// permuted[inv(permutation)[t·top_k + k]]` in k order with f32 accumulation (f64 for f64),
/// bit for bit the host kernel's result. `probs` (same dtype, `[tokens, top_k]`) may be NULL
/// (weights 1). A `permutation` that is not one is an error. Waits for `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_unpermute(
    device: i32,
    stream: *mut c_void,
    dtype: i32,
    permuted: *const c_void,
    permutation: *const i64,
    probs: *const c_void,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    out: *mut c_void,
    workspace: *mut c_void,
    workspace_bytes: usize,
) -> i32 {
    boundary(|| {
        let e = float_dtype_arg(dtype, "dtype")?;
        let b = UnpermuteBuffers {
            permuted: addr(permuted),
            permutation: addr(permutation),
            probs: addr(probs),
            out: addr(out),
            workspace: addr(workspace),
            workspace_bytes,
        };
        Ok(kernels::unpermute(device, Stream(stream), e, tokens, top_k, hidden, &b)?)
    })
}

/// Builds, in host memory, the table the multi-tensor kernels read for `tensors` (device data
/// through `data`, or `mut_data` when `data` is NULL; `numel`, `dtype`; the layout fields are not
/// used). `*out_len` receives the table's length in uint64 words (a short `table` gives
/// FSDPTURBO_ERR_BUFFER_TOO_SMALL, so ask with capacity 0 first) and `*out_chunks` the number of
/// blocks (the length of the power sum's `partials`). Copy the table to the device unchanged.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_multi_tensor_table(
    tensors: *const fsdpturbo_grad_t,
    n_tensors: usize,
    table: *mut u64,
    capacity: usize,
    out_len: *mut usize,
    out_chunks: *mut usize,
) -> i32 {
    boundary(|| {
        let list = arg_slice(tensors, n_tensors, "tensors")?;
        let mut described = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let ptr = if t.data.is_null() { t.mut_data.cast_const() } else { t.data };
            described.push(DeviceTensor {
                ptr: addr(ptr),
                numel: t.numel,
                elem: float_dtype_arg(t.dtype, format_args!("tensors[{i}].dtype"))?,
            });
        }
        let (words, chunks) = kernels::multi_tensor_table(&described)?;
        write_out(out_chunks, "out_chunks", chunks)?;
        write_slice(table, capacity, out_len, &words, "table")
    })
}

/// Σ|x|^p (max |x| for `norm_type` = INFINITY) over the tensors of a device table (made by
/// fsdpturbo_cuda_multi_tensor_table) of `n_tensors` tensors and `chunks` blocks, written as
/// one double to device `out`; `partials` (device) holds `chunks` doubles. `accumulate_f64`
/// as for fsdpturbo_local_power_sum. Deterministic; does not wait for `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_power_sum(
    device: i32,
    stream: *mut c_void,
    table: *const u64,
    n_tensors: usize,
    chunks: usize,
    norm_type: f64,
    accumulate_f64: bool,
    partials: *mut f64,
    out: *mut f64,
) -> i32 {
    boundary(|| {
        let norm = NormType::new(norm_type).map_err(|e| invalid(format!("norm_type: {}", e.message)))?;
        Ok(kernels::power_sum(
            device,
            Stream(stream),
            addr(table),
            n_tensors,
            chunks,
            norm,
            accumulate_f64,
            addr(partials),
            addr(out),
        )?)
    })
}

/// Multiplies every tensor of a device table by `coef` in place (f64 data in f64, the others in
/// f32 rounded once, as fsdpturbo_scale_in_place). Does not wait for `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_scale(
    device: i32,
    stream: *mut c_void,
    table: *const u64,
    n_tensors: usize,
    chunks: usize,
    coef: f64,
) -> i32 {
    boundary(|| Ok(kernels::scale(device, Stream(stream), addr(table), n_tensors, chunks, coef)?))
}

/// Workspace bytes of fsdpturbo_cuda_grouped_mm.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_grouped_mm_workspace(groups: usize) -> usize {
    cublas::grouped_gemm_workspace(groups)
}

/// One GEMM of the grouped matmul on cuBLAS (FSDPTURBO_GEMM_* `kind`) over groups of
/// `counts[g]` consecutive rows (`counts` in host memory), `in_features`/`out_features` of the
/// expert weights `[groups, out, in]`, FSDPTURBO_DTYPE_* `dtype` (16-bit types compute in f32).
/// Empty groups give no rows and a zero weight gradient. `use_loop` forces one cublasGemmEx per
/// group (also the fallback where cublasGemmGroupedBatchedEx is missing). Does not wait.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_grouped_mm(
    device: i32,
    stream: *mut c_void,
    dtype: i32,
    kind: i32,
    a: *const c_void,
    b: *const c_void,
    c: *mut c_void,
    counts: *const u64,
    groups: usize,
    in_features: usize,
    out_features: usize,
    use_loop: bool,
    workspace: *mut c_void,
    workspace_bytes: usize,
) -> i32 {
    boundary(|| {
        let e = float_dtype_arg(dtype, "dtype")?;
        let kind = match kind {
            FSDPTURBO_GEMM_FORWARD => GemmKind::Forward,
            FSDPTURBO_GEMM_GRAD_INPUT => GemmKind::GradInput,
            FSDPTURBO_GEMM_GRAD_WEIGHT => GemmKind::GradWeight,
            other => {
                return Err(invalid(format!(
                    "`kind` is {other}, not an FSDPTURBO_GEMM_* value (FORWARD=0, GRAD_INPUT=1, GRAD_WEIGHT=2)"
                )));
            }
        };
        let counts = arg_slice(counts, groups, "counts")?;
        let buffers =
            GemmBuffers { a: addr(a), b: addr(b), c: addr(c), workspace: addr(workspace), workspace_bytes };
        Ok(cublas::grouped_gemm(
            device,
            Stream(stream),
            e,
            kind,
            counts,
            in_features,
            out_features,
            &buffers,
            use_loop,
        )?)
    })
}

/// The compute capability of CUDA device `device` as major*10 + minor (90 on an H100/H200).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_cuda_compute_capability(device: i32, out_cc: *mut u32) -> i32 {
    boundary(|| {
        write_out(out_cc, "out_cc", crate::backend::cuda::driver::driver()?.compute_capability(device)?)
    })
}
