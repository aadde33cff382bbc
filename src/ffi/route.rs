//! C ABI of token routing and the host permute kernels: plain arrays in, caller-owned buffers
//! out, no handles. Element types are the FSDPTURBO_DTYPE_* codes of the gradient-norm ABI
//! (F32 = 0, F64 = 1, F16 = 2, BF16 = 3; f16 and bf16 as uint16_t bit patterns). Every array must
//! be aligned for its element type and may be NULL only when it holds no element; output
//! buffers must not overlap each other or any input. On any error nothing is written, except
//! where a function says otherwise.

use std::ffi::c_void;

use super::dtype::float_dtype_arg;
use super::error::FfiError;
use super::handle::{
    check_disjoint, data_region, host_buf, host_buf_mut, in_array, invalid, out_array, out_slice,
};
use super::panic::boundary;
use crate::dtype::Dtype;
use crate::route;

/// `bytes` must be exactly `want` elements of `dtype`.
fn expect_bytes(
    bytes: usize,
    want: Option<usize>,
    dtype: Dtype,
    name: &str,
    shape: &str,
) -> Result<(), FfiError> {
    let need = want.and_then(|n| n.checked_mul(dtype.size()));
    match need {
        Some(need) if need == bytes => Ok(()),
        Some(need) => Err(invalid(format!(
            "`{name}` is {bytes} but {shape} of {}-byte elements is {need} bytes",
            dtype.size()
        ))),
        None => Err(invalid(format!("the size of {shape} overflows"))),
    }
}

/// Routes this rank's tokens (docs/design.md §4.4; the seed's `dispatch_preprocess` and first sort).
/// `expert_ids` holds the top-k expert ids `[tokens, top_k]` row-major (int64, as `torch.topk`
/// gives), `num_experts` = E global experts, `ep_size` = P (E must be divisible by P). Writes:
/// - `tokens_per_expert[E]`: how many (token, k) slots chose each expert;
/// - `permutation[tokens * top_k]`: the flat slot indices `t * top_k + k` sorted by expert,
///   ties in flat order (a stable sort: the seed's `sorted`); permuted row i is token
///   `permutation[i] / top_k`;
/// - `input_splits[P]`: the rows this rank sends to each ep rank.
///
/// Ids outside [0, E) are rejected (the message names the id and its token and k), as are a
/// zero `top_k`, `num_experts` or `ep_size`. Zero tokens are fine (NULL arrays then allowed for
/// `expert_ids` and `permutation`).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_route(
    expert_ids: *const i64,
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    ep_size: usize,
    tokens_per_expert: *mut u64,
    permutation: *mut u64,
    input_splits: *mut u64,
) -> i32 {
    boundary(|| {
        let slots = route::route_slots(tokens, top_k, num_experts, ep_size)?;
        let (ids, ids_region) = in_array(expert_ids, slots, "expert_ids")?;
        let outs = [
            out_array(tokens_per_expert, num_experts, "tokens_per_expert")?,
            out_array(permutation, slots, "permutation")?,
            out_array(input_splits, ep_size, "input_splits")?,
        ];
        check_disjoint(&outs, &[ids_region])?;
        // SAFETY: checked by out_array and check_disjoint.
        let (cnt, perm, splits) = unsafe {
            (
                out_slice(tokens_per_expert, num_experts),
                out_slice(permutation, slots),
                out_slice(input_splits, ep_size),
            )
        };
        Ok(route::route_into(ids, tokens, top_k, num_experts, ep_size, cnt, perm, splits)?)
    })
}

/// Row gather: `dst[i, :] = src[rows[i] / row_divisor, :]` for row-major `src` of `hidden`
/// columns (`src_bytes` must be a whole number of rows) and `dst[n_rows, hidden]`
/// (`dst_bytes` must be exactly `n_rows * hidden` elements). `row_divisor` 1 is a plain gather;
/// `top_k` with the `permutation` of fsdpturbo_route gathers the permuted tokens (the seed's
/// `permute`), and with an order of the received rows and 1 it regroups them (the
/// second-level permute). The element type only sets the row size (any FSDPTURBO_DTYPE_*).
/// Rows outside `src` are rejected before anything is written.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_permute_rows(
    dtype: i32,
    src: *const c_void,
    src_bytes: usize,
    hidden: usize,
    rows: *const u64,
    n_rows: usize,
    row_divisor: usize,
    dst: *mut c_void,
    dst_bytes: usize,
) -> i32 {
    boundary(|| {
        let dtype = float_dtype_arg(dtype, "dtype")?;
        if hidden == 0 {
            return Err(invalid("`hidden` must be >= 1, got 0".into()));
        }
        if row_divisor == 0 {
            return Err(invalid("`row_divisor` must be >= 1 (1: plain gather; top_k: tokens), got 0".into()));
        }
        let row_bytes =
            hidden.checked_mul(dtype.size()).ok_or_else(|| invalid(format!("hidden {hidden} overflows")))?;
        if src_bytes % row_bytes != 0 {
            return Err(invalid(format!(
                "`src_bytes` is {src_bytes}, not a whole number of rows of hidden {hidden} × {} bytes",
                dtype.size()
            )));
        }
        expect_bytes(
            dst_bytes,
            n_rows.checked_mul(hidden),
            dtype,
            "dst_bytes",
            &format!("[n_rows {n_rows}, hidden {hidden}]"),
        )?;
        let src_region = data_region(src, src_bytes, dtype, "src")?;
        let dst_region = data_region(dst.cast_const(), dst_bytes, dtype, "dst")?;
        let (rows, rows_region) = in_array(rows, n_rows, "rows")?;
        check_disjoint(&[dst_region], &[src_region, rows_region])?;
        let (n_src, n_dst) = (src_bytes / dtype.size(), dst_bytes / dtype.size());
        fn go<T: Copy + Send + Sync>(
            src: *const c_void,
            n_src: usize,
            dst: *mut c_void,
            n_dst: usize,
            hidden: usize,
            rows: &[u64],
            divisor: usize,
        ) -> Result<(), FfiError> {
            // Typed views of the buffers data_region checked (aligned for their 2-, 4- or
            // 8-byte elements, in range, disjoint).
            let (src, _) = in_array(src.cast::<T>(), n_src, "src")?;
            // SAFETY: `dst` passed data_region and check_disjoint; the caller guarantees the memory.
            let dst = unsafe { out_slice::<T>(dst.cast(), n_dst) };
            Ok(if divisor == 1 {
                route::permute(src, hidden, rows, dst)
            } else {
                route::permute_tokens(src, hidden, rows, divisor, dst)
            }?)
        }
        match dtype.size() {
            2 => go::<u16>(src, n_src, dst, n_dst, hidden, rows, row_divisor),
            4 => go::<u32>(src, n_src, dst, n_dst, hidden, rows, row_divisor),
            _ => go::<u64>(src, n_src, dst, n_dst, hidden, rows, row_divisor),
        }
    })
}

/// The combine unpermute: `out[t, :] = sum over k of probs[t, k] * permuted[inv[t * top_k + k], :]`,
/// where `inv` inverts `permutation` (fsdpturbo_route's, a permutation of 0..tokens*top_k) and
/// `permuted[tokens * top_k, hidden]` is in permuted order; `out[tokens, hidden]`. `probs`
/// (`[tokens, top_k]`, same element type, `probs_bytes` exactly that) may be NULL with
/// `probs_bytes` 0: every weight is then 1 (with top_k 1 this inverts fsdpturbo_permute_rows).
/// Deterministic: the sum runs over k in k order in f32 (double for F64 data) and is rounded
/// once; bf16/f16 results round to nearest even. A `permutation` that is not a permutation is
/// rejected.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_unpermute(
    dtype: i32,
    permuted: *const c_void,
    permuted_bytes: usize,
    hidden: usize,
    permutation: *const u64,
    tokens: usize,
    top_k: usize,
    probs: *const c_void,
    probs_bytes: usize,
    out: *mut c_void,
    out_bytes: usize,
) -> i32 {
    boundary(|| {
        let dtype = float_dtype_arg(dtype, "dtype")?;
        if hidden == 0 {
            return Err(invalid("`hidden` must be >= 1, got 0".into()));
        }
        if top_k == 0 {
            return Err(invalid("`top_k` must be >= 1, got 0".into()));
        }
        let slots = tokens
            .checked_mul(top_k)
            .ok_or_else(|| invalid(format!("tokens ({tokens}) × top_k ({top_k}) overflows")))?;
        let shape = format!("[tokens {tokens} × top_k {top_k}, hidden {hidden}]");
        expect_bytes(permuted_bytes, slots.checked_mul(hidden), dtype, "permuted_bytes", &shape)?;
        expect_bytes(
            out_bytes,
            tokens.checked_mul(hidden),
            dtype,
            "out_bytes",
            &format!("[tokens {tokens}, hidden {hidden}]"),
        )?;
        let has_probs = !probs.is_null();
        if has_probs {
            expect_bytes(
                probs_bytes,
                Some(slots),
                dtype,
                "probs_bytes",
                &format!("[tokens {tokens}, top_k {top_k}]"),
            )?;
        } else if probs_bytes != 0 {
            return Err(invalid(format!(
                "`probs` is NULL but `probs_bytes` is {probs_bytes}; pass 0 for no weights"
            )));
        }
        let permuted_region = data_region(permuted, permuted_bytes, dtype, "permuted")?;
        let probs_region = data_region(probs, probs_bytes, dtype, "probs")?;
        let out_region = data_region(out.cast_const(), out_bytes, dtype, "out")?;
        let (perm, perm_region) = in_array(permutation, slots, "permutation")?;
        check_disjoint(&[out_region], &[permuted_region, probs_region, perm_region])?;
        let n = |bytes: usize| bytes / dtype.size();
        // SAFETY: every region passed data_region, and `out` check_disjoint.
        let (y, p, o) = unsafe {
            (
                host_buf(permuted, n(permuted_bytes), dtype)?,
                if has_probs { Some(host_buf(probs, n(probs_bytes), dtype)?) } else { None },
                host_buf_mut(out, n(out_bytes), dtype)?,
            )
        };
        Ok(route::unpermute(y, hidden, perm, top_k, p, o)?)
    })
}
