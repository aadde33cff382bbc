//! C ABI of the experts' grouped GEMM on the host (forward and both gradients): plain arrays
//! in, caller-owned buffers out, no handles; element types are FSDPTURBO_DTYPE_* codes. Every
//! array must be aligned for its element type and may be NULL only when it holds no element;
//! the output must not overlap any input. On any error nothing is written.

use std::ffi::c_void;

use super::dtype::float_dtype_arg;
use super::error::FfiError;
use super::handle::{check_disjoint, data_region, host_buf, host_buf_mut, in_array};
use super::panic::boundary;
use crate::host::gemm;

/// Which grouped GEMM an extern function is.
#[derive(Clone, Copy)]
enum Gemm {
    Forward,
    GradInput,
    GradWeight,
}

/// The shared body of the grouped-matmul functions: `a`, `b` inputs, `c` output.
#[allow(clippy::too_many_arguments)]
fn grouped(
    which: Gemm,
    dtype: i32,
    a: (*const c_void, usize, &str),
    b: (*const c_void, usize, &str),
    group_rows: *const u64,
    groups: usize,
    in_features: usize,
    out_features: usize,
    c: (*mut c_void, usize, &str),
) -> Result<(), FfiError> {
    let dtype = float_dtype_arg(dtype, "dtype")?;
    let (counts, counts_region) = in_array(group_rows, groups, "group_rows")?;
    let ra = data_region(a.0, a.1, dtype, a.2)?;
    let rb = data_region(b.0, b.1, dtype, b.2)?;
    let rc = data_region(c.0.cast_const(), c.1, dtype, c.2)?;
    check_disjoint(&[rc], &[ra, rb, counts_region])?;
    // SAFETY: every region passed data_region, and the output check_disjoint.
    let n = |bytes: usize| bytes / dtype.size();
    let (a, b, c) = unsafe {
        (host_buf(a.0, n(a.1), dtype)?, host_buf(b.0, n(b.1), dtype)?, host_buf_mut(c.0, n(c.1), dtype)?)
    };
    let (i, o) = (in_features, out_features);
    Ok(match which {
        Gemm::Forward => gemm::grouped_mm(a, counts, b, i, o, c),
        Gemm::GradInput => gemm::grouped_mm_grad_input(a, counts, b, i, o, c),
        Gemm::GradWeight => gemm::grouped_mm_grad_weight(a, b, counts, i, o, c),
    }?)
}

/// Grouped matmul (the experts' GEMM): `x[N, in_features]` holds `group_rows[g]` consecutive
/// rows for each of the `groups` groups (N = sum of group_rows), `weight[groups, out_features,
/// in_features]` (the HF expert layout), and `y[rows of g] = x[rows of g] @ weight[g]^T`,
/// `y[N, out_features]`. One element type for all buffers (F32, F64, BF16, F16; bf16/f16
/// accumulate in f32); `*_bytes` must match the shapes exactly. Empty groups are fine. Large
/// problems use all cores; results do not depend on the thread count.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_grouped_mm(
    dtype: i32,
    x: *const c_void,
    x_bytes: usize,
    group_rows: *const u64,
    groups: usize,
    in_features: usize,
    out_features: usize,
    weight: *const c_void,
    weight_bytes: usize,
    y: *mut c_void,
    y_bytes: usize,
) -> i32 {
    boundary(|| {
        grouped(
            Gemm::Forward,
            dtype,
            (x, x_bytes, "x"),
            (weight, weight_bytes, "weight"),
            group_rows,
            groups,
            in_features,
            out_features,
            (y, y_bytes, "y"),
        )
    })
}

/// The input gradient of fsdpturbo_grouped_mm: `grad_x[rows of g] = grad_y[rows of g] @
/// weight[g]`, `grad_y[N, out_features]`, `grad_x[N, in_features]`; shapes and types as there.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_grouped_mm_grad_input(
    dtype: i32,
    grad_y: *const c_void,
    grad_y_bytes: usize,
    group_rows: *const u64,
    groups: usize,
    in_features: usize,
    out_features: usize,
    weight: *const c_void,
    weight_bytes: usize,
    grad_x: *mut c_void,
    grad_x_bytes: usize,
) -> i32 {
    boundary(|| {
        grouped(
            Gemm::GradInput,
            dtype,
            (grad_y, grad_y_bytes, "grad_y"),
            (weight, weight_bytes, "weight"),
            group_rows,
            groups,
            in_features,
            out_features,
            (grad_x, grad_x_bytes, "grad_x"),
        )
    })
}

/// The weight gradient of fsdpturbo_grouped_mm: `grad_weight[g] = grad_y[rows of g]^T @
/// x[rows of g]`, `grad_weight[groups, out_features, in_features]`, zero for empty groups;
/// shapes and types as there.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_grouped_mm_grad_weight(
    dtype: i32,
    grad_y: *const c_void,
    grad_y_bytes: usize,
    x: *const c_void,
    x_bytes: usize,
    group_rows: *const u64,
    groups: usize,
    in_features: usize,
    out_features: usize,
    grad_weight: *mut c_void,
    grad_weight_bytes: usize,
) -> i32 {
    boundary(|| {
        grouped(
            Gemm::GradWeight,
            dtype,
            (grad_y, grad_y_bytes, "grad_y"),
            (x, x_bytes, "x"),
            group_rows,
            groups,
            in_features,
            out_features,
            (grad_weight, grad_weight_bytes, "grad_weight"),
        )
    })
}
