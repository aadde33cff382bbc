//! C ABI of the gradient norm: placement-aware clipping with the collectives supplied by the
//! embedder as a callback (for C++ trainers) or as communicators (`fsdpturbo_comm_t`), and the
//! fused host p-power sum of a buffer list.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;

use super::comm::fsdpturbo_comm_t;
use super::dtype::float_dtype_arg;
use super::error::{FfiError, last_error_message};
use super::handle::{
    Region, arg_ref, arg_slice, check_data, check_disjoint_outputs, check_struct_size, host_buf,
    host_buf_mut, invalid, null_but, struct_size_of, write_array, write_out, write_slice,
};
use super::panic::boundary;
use super::status::FSDPTURBO_ERR_BUFFER_TOO_SMALL;
use crate::comm::ReduceOp;
use crate::dtype::Dtype;
use crate::host::HostBufMut;
use crate::norm::{self, ClipOptions, DimRole, GradLayout, NormType, clip_grad_norm_with, norm_plan};

/// Reduction ops passed to fsdpturbo_reduce_fn: sum the values of the group.
pub const FSDPTURBO_REDUCE_SUM: i32 = 0;
/// Reduction ops passed to fsdpturbo_reduce_fn: the max of the values of the group (p = inf).
pub const FSDPTURBO_REDUCE_MAX: i32 = 1;

/// Placement of a gradient on one dim of its mesh: Shard (also _StridedShard).
pub const FSDPTURBO_DIM_SHARD: i32 = 0;
/// Placement of a gradient on one dim of its mesh: Replicate.
pub const FSDPTURBO_DIM_REPLICATE: i32 = 1;
/// Placement of a gradient on one dim of its mesh: Partial (rejected: reduce it first).
pub const FSDPTURBO_DIM_PARTIAL: i32 = 2;

/// The embedder's collective: reduce `*value` with `op` (FSDPTURBO_REDUCE_SUM or
/// FSDPTURBO_REDUCE_MAX) over the process group spanned by the `n_dims` mesh-dim ids `dims`
/// (sorted; the ids are the caller's own) that contains this rank, and store the result in
/// `*value`. `set_index` numbers the distinct reduction sets in first-seen order over the
/// gradient list. Return 0 on success; any other value aborts the call with that status.
pub type fsdpturbo_reduce_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        set_index: usize,
        dims: *const u32,
        n_dims: usize,
        op: i32,
        value: *mut f64,
    ) -> i32,
>;

/// One gradient of the parameter list shared by all ranks, with its local elements on this
/// rank (`numel` may be 0, e.g. an empty shard or a parameter this rank has no gradient for:
/// the entry must still be passed so that every rank issues the same collectives).
/// `dims`/`roles` give, for each of the `n_dims` dims of its DTensor mesh, a mesh-dim id of the
/// caller's choosing and its FSDPTURBO_DIM_* placement; a plain tensor has `n_dims` 0.
/// fsdpturbo_clip_grad_norm reads and scales `mut_data` in place (`data` must be NULL or equal
/// to it); fsdpturbo_local_power_sum reads `data`, or `mut_data` when `data` is NULL. Data must
/// be aligned for its element type; NULL is accepted only when `numel` is 0.
#[repr(C)]
pub struct fsdpturbo_grad_t {
    pub data: *const c_void,
    pub mut_data: *mut c_void,
    pub numel: usize,
    /// FSDPTURBO_DTYPE_*.
    pub dtype: i32,
    pub dims: *const u32,
    /// FSDPTURBO_DIM_*, one per entry of `dims`.
    pub roles: *const i32,
    pub n_dims: usize,
}

/// Options of fsdpturbo_clip_grad_norm; initialise with FSDPTURBO_CLIP_OPTIONS_INIT.
#[repr(C)]
pub struct fsdpturbo_clip_options_t {
    pub struct_size: usize,
    /// The largest total norm left unscaled (>= 0; inf never scales). Default 1.0.
    pub max_norm: f64,
    /// p: finite > 0, or INFINITY for the max norm. Default 2.0.
    pub norm_type: f64,
    /// Fail with FSDPTURBO_ERR_INVALID_ARGUMENT (gradients untouched, the total still written)
    /// when the total norm is nan or inf, instead of returning it. Default false.
    pub error_if_nonfinite: bool,
    /// Accumulate p-power sums of f32/f16/bf16 data in double (default true) or float.
    pub accumulate_f64: bool,
}

const CLIP_OPTIONS_V1_SIZE: usize = std::mem::size_of::<fsdpturbo_clip_options_t>();

/// Reads a `bool` field byte by byte: C can store any byte there, which Rust must not read as
/// a `bool`.
fn read_bool(field: *const bool, name: &str) -> Result<bool, FfiError> {
    // SAFETY: `field` points into a struct the caller guarantees is readable.
    match unsafe { field.cast::<u8>().read() } {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(invalid(format!("`{name}` holds the byte {other}, not a bool (0 or 1)"))),
    }
}

fn clip_options(ptr: *const fsdpturbo_clip_options_t) -> Result<ClipOptions, FfiError> {
    check_struct_size(
        struct_size_of(ptr, "options")?,
        CLIP_OPTIONS_V1_SIZE,
        "options",
        "fsdpturbo_clip_options_t",
        Some("FSDPTURBO_CLIP_OPTIONS_INIT"),
    )?;
    // SAFETY: non-NULL, and the caller guarantees a readable struct of at least the
    // `struct_size` it declares, which is at least the v1 size (checked).
    let (max_norm, norm_type) =
        unsafe { (std::ptr::addr_of!((*ptr).max_norm).read(), std::ptr::addr_of!((*ptr).norm_type).read()) };
    // SAFETY: as above.
    let error_if_nonfinite =
        read_bool(unsafe { std::ptr::addr_of!((*ptr).error_if_nonfinite) }, "options.error_if_nonfinite")?;
    // SAFETY: as above.
    let accumulate_f64 =
        read_bool(unsafe { std::ptr::addr_of!((*ptr).accumulate_f64) }, "options.accumulate_f64")?;
    let norm = NormType::new(norm_type).map_err(|e| invalid(format!("options.norm_type: {}", e.message)))?;
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(invalid(format!(
            "options.max_norm must be >= 0 (inf disables clipping), got {max_norm:?}"
        )));
    }
    Ok(ClipOptions { norm, max_norm, error_if_nonfinite, accumulate_f64 })
}

/// A gradient's data: `numel` elements of `dtype` at `ptr`, checked by the marshalling layer
/// (with the gradient's own words for a NULL pointer).
fn grad_data<'n>(
    ptr: *const c_void,
    numel: usize,
    dtype: Dtype,
    name: &'n str,
) -> Result<Region<'n>, FfiError> {
    if ptr.is_null() && numel > 0 {
        return Err(null_but(name, format_args!("numel is {numel}; NULL is accepted only when numel is 0")));
    }
    check_data(ptr, numel, dtype, name)
}

fn layout_of(grad: &fsdpturbo_grad_t, i: usize) -> Result<GradLayout, FfiError> {
    let dims = arg_slice(grad.dims, grad.n_dims, format_args!("grads[{i}].dims"))?;
    let roles = arg_slice(grad.roles, grad.n_dims, format_args!("grads[{i}].roles"))?;
    let mut layout = Vec::with_capacity(dims.len());
    for (j, (&dim, &role)) in dims.iter().zip(roles).enumerate() {
        let role = match role {
            FSDPTURBO_DIM_SHARD => DimRole::Shard,
            FSDPTURBO_DIM_REPLICATE => DimRole::Replicate,
            FSDPTURBO_DIM_PARTIAL => DimRole::Partial,
            other => {
                return Err(invalid(format!(
                    "`grads[{i}].roles[{j}]` is {other}, not an FSDPTURBO_DIM_* value \
                     (SHARD=0, REPLICATE=1, PARTIAL=2)"
                )));
            }
        };
        layout.push((dim, role));
    }
    Ok(GradLayout { dims: layout })
}

/// The reduction plan of a gradient list without computing anything (docs/design.md §4.2):
/// which mesh dims each gradient's local p-power sum must be reduced over, grouped into
/// distinct sets in first-seen order, so a caller that does its own collectives (the Python
/// package) issues one reduction per set, the same on every rank. Only `dims`, `roles` and
/// `n_dims` of each gradient are read (give the placements of the *parameter*, shared by all
/// ranks); the data fields are ignored.
///
/// Outputs: `grad_set[i]` (an array of `n_grads` entries) receives the set of gradient i. The
/// sets go to `set_dims`, concatenated, each sorted ascending, with `set_ends[s]` the end of set
/// s in `set_dims` (its start is `set_ends[s - 1]`, or 0); the empty set (plain and fully
/// replicated gradients) needs no collective. `*out_n_sets` and `*out_n_set_dims` always
/// receive the lengths; `n_grads` and the total of `n_dims` are upper bounds, and a short
/// buffer gives FSDPTURBO_ERR_BUFFER_TOO_SMALL with nothing written but the lengths. A Partial
/// role, or a mesh-dim id twice in one gradient, is FSDPTURBO_ERR_INVALID_ARGUMENT naming it.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_norm_plan(
    grads: *const fsdpturbo_grad_t,
    n_grads: usize,
    grad_set: *mut usize,
    set_ends: *mut usize,
    set_ends_cap: usize,
    out_n_sets: *mut usize,
    set_dims: *mut u32,
    set_dims_cap: usize,
    out_n_set_dims: *mut usize,
) -> i32 {
    boundary(|| {
        let grads = arg_slice(grads, n_grads, "grads")?;
        let layouts =
            grads.iter().enumerate().map(|(i, grad)| layout_of(grad, i)).collect::<Result<Vec<_>, _>>()?;
        let plan = norm_plan(&layouts)?;
        let mut ends = Vec::with_capacity(plan.sets.len());
        let mut dims = Vec::new();
        for set in &plan.sets {
            dims.extend_from_slice(set);
            ends.push(dims.len());
        }
        write_out(out_n_sets, "out_n_sets", ends.len())?;
        write_out(out_n_set_dims, "out_n_set_dims", dims.len())?;
        if set_ends_cap < ends.len() || set_dims_cap < dims.len() {
            return Err(FfiError::new(
                FSDPTURBO_ERR_BUFFER_TOO_SMALL,
                format!(
                    "the plan has {} sets with {} dims in all, but `set_ends` holds {set_ends_cap} and \
                     `set_dims` {set_dims_cap} (n_grads and the total of n_dims are always enough)",
                    ends.len(),
                    dims.len()
                ),
            ));
        }
        write_array(grad_set, "grad_set", &plan.grad_set)?;
        write_slice(set_ends, set_ends_cap, out_n_sets, &ends, "set_ends")?;
        write_slice(set_dims, set_dims_cap, out_n_set_dims, &dims, "set_dims")
    })
}

/// Calls the embedder's callback (non-NULL whenever a set needs a collective: checked before).
fn call_reduce(
    reduce: fsdpturbo_reduce_fn,
    user: *mut c_void,
    set_index: usize,
    dims: &[u32],
    op: i32,
    value: &mut f64,
) -> i32 {
    let f = reduce.expect("checked before the first call: reduce is non-NULL when a set needs a collective");
    // SAFETY: the embedder's callback, called as its contract says; `dims` and `value` outlive
    // the call.
    unsafe { f(user, set_index, dims.as_ptr(), dims.len(), op, value) }
}

/// Computes the placement-aware total norm of the gradients `grads[0..n_grads]` and clips them
/// in place (docs/design.md §4.2): each gradient's local p-power sum is reduced over the mesh dims on
/// which it is Shard (Replicate dims are counted once; Partial is rejected: reduce it first),
/// with one `reduce` call per distinct set of dims, in first-seen order over `grads`, on every
/// rank, also when this rank holds no elements (the value is then 0). Gradients of plain
/// tensors need no collective. The total norm is written to `*out_total_norm`; when it is
/// finite and above `max_norm`, every gradient is multiplied by `max_norm / (total + 1e-6)`.
/// A nan/inf total leaves the gradients untouched and is returned (FSDPTURBO_OK), or, with
/// `error_if_nonfinite`, written and reported as FSDPTURBO_ERR_INVALID_ARGUMENT.
///
/// Pass the same gradient list (the parameters known to all ranks, with numel 0 where this
/// rank holds nothing) on every rank. `reduce` may be NULL only when no set needs a collective.
/// A non-zero return from `reduce` aborts with that status and a message naming the set;
/// nothing is modified then, nor on any argument error.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_clip_grad_norm(
    options: *const fsdpturbo_clip_options_t,
    grads: *const fsdpturbo_grad_t,
    n_grads: usize,
    reduce: fsdpturbo_reduce_fn,
    user: *mut c_void,
    out_total_norm: *mut f64,
) -> i32 {
    boundary(|| {
        let options = clip_options(options)?;
        arg_ref(out_total_norm.cast_const(), "out_total_norm")?;
        let grads = arg_slice(grads, n_grads, "grads")?;

        let layouts =
            grads.iter().enumerate().map(|(i, grad)| layout_of(grad, i)).collect::<Result<Vec<_>, _>>()?;
        let mut bufs = mutable_buffers(grads)?;
        let plan = norm_plan(&layouts)?;
        if reduce.is_none() {
            if let Some((s, set)) = plan.sets.iter().enumerate().find(|(_, set)| !set.is_empty()) {
                return Err(null_but(
                    "reduce",
                    format_args!("set {s} (mesh dims {set:?}) needs a collective"),
                ));
            }
        }

        let failed = Cell::new(0i32);
        let mut call = |set_index: usize, value: f64, is_max: bool| -> crate::error::Result<f64> {
            let dims = &plan.sets[set_index];
            let op = if is_max { FSDPTURBO_REDUCE_MAX } else { FSDPTURBO_REDUCE_SUM };
            let mut value = value;
            let status = call_reduce(reduce, user, set_index, dims, op, &mut value);
            if status != 0 {
                failed.set(status);
                return Err(crate::error::Error::invalid(format!(
                    "the reduce callback returned status {status} for set {set_index} (mesh dims {dims:?}, \
                     op {}); no gradient was modified",
                    if is_max { "MAX" } else { "SUM" }
                )));
            }
            Ok(value)
        };
        let core = ClipOptions { error_if_nonfinite: false, ..options };
        let total = match clip_grad_norm_with(&plan, &mut bufs, &core, &mut call) {
            Ok(total) => total,
            Err(err) if failed.get() != 0 => return Err(FfiError::new(failed.get(), err.message)),
            Err(err) => return Err(err.into()),
        };
        write_out(out_total_norm, "out_total_norm", total)?;
        if options.error_if_nonfinite && !total.is_finite() {
            return Err(norm::nonfinite_error(options.norm, total).into());
        }
        Ok(())
    })
}

/// The gradients' data as mutable host buffers, tagged with their index (empty ones left out):
/// checked for dtype, alignment, NULL and overlap (scaling writes through them).
fn mutable_buffers<'a>(grads: &[fsdpturbo_grad_t]) -> Result<Vec<(usize, HostBufMut<'a>)>, FfiError> {
    let names: Vec<String> = (0..grads.len()).map(|i| format!("grads[{i}].mut_data")).collect();
    let mut regions = Vec::with_capacity(grads.len());
    let mut dtypes = Vec::with_capacity(grads.len());
    for (i, grad) in grads.iter().enumerate() {
        let dtype = float_dtype_arg(grad.dtype, format_args!("grads[{i}].dtype"))?;
        regions.push(grad_data(grad.mut_data.cast_const(), grad.numel, dtype, &names[i])?);
        if !grad.data.is_null() && grad.data != grad.mut_data.cast_const() {
            return Err(invalid(format!(
                "`grads[{i}].data` must be NULL or equal to `mut_data` here: gradients are read and \
                 scaled in place through `mut_data`"
            )));
        }
        dtypes.push(dtype);
    }
    check_disjoint_outputs(&mut regions)?;
    let held = grads.iter().zip(dtypes).enumerate().filter(|(_, (grad, _))| grad.numel > 0);
    // SAFETY: every buffer passed grad_data and the overlap check; the caller guarantees
    // `numel` writable elements that nothing else accesses during the call.
    held.map(|(i, (grad, dtype))| Ok((i, unsafe { host_buf_mut(grad.mut_data, grad.numel, dtype)? })))
        .collect()
}

/// Multiplies every element of `grads[0..n_grads]` (through `mut_data`) by `coef` in place with
/// the fused host kernel: f64 arithmetic for f64 data, f32 for the others, rounded to nearest
/// even for f16/bf16 (as torch's `mul_` by a Python float). The layout fields are not used.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_scale_in_place(grads: *const fsdpturbo_grad_t, n_grads: usize, coef: f64) -> i32 {
    boundary(|| {
        let grads = arg_slice(grads, n_grads, "grads")?;
        let mut bufs: Vec<HostBufMut> = mutable_buffers(grads)?.into_iter().map(|(_, buf)| buf).collect();
        Ok(crate::host::pnorm::scale_in_place(&mut bufs, coef)?)
    })
}

/// The local p-power sum, the sum of |x|^p over all elements of `grads[0..n_grads]` (max |x| when
/// `norm_type` is INFINITY; any NaN gives NaN; no elements give 0), computed by the fused host
/// kernels with double (`accumulate_f64`) or float accumulation; the layout fields (`dims`,
/// `roles`, `n_dims`) are not used. Written to `*out_value`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_local_power_sum(
    grads: *const fsdpturbo_grad_t,
    n_grads: usize,
    norm_type: f64,
    accumulate_f64: bool,
    out_value: *mut f64,
) -> i32 {
    boundary(|| {
        let norm = NormType::new(norm_type).map_err(|e| invalid(format!("norm_type: {}", e.message)))?;
        arg_ref(out_value.cast_const(), "out_value")?;
        let grads = arg_slice(grads, n_grads, "grads")?;
        let mut bufs = Vec::with_capacity(grads.len());
        for (i, grad) in grads.iter().enumerate() {
            let dtype = float_dtype_arg(grad.dtype, format_args!("grads[{i}].dtype"))?;
            let (ptr, field) = if grad.data.is_null() && !grad.mut_data.is_null() {
                (grad.mut_data.cast_const(), "mut_data")
            } else {
                (grad.data, "data")
            };
            grad_data(ptr, grad.numel, dtype, &format!("grads[{i}].{field}"))?;
            // SAFETY: checked by grad_data; readable by the caller's contract.
            bufs.push(unsafe { host_buf(ptr, grad.numel, dtype)? });
        }
        write_out(out_value, "out_value", norm::local_power_sum(&bufs, norm, accumulate_f64)?)
    })
}

/// Which communicator reduces the grad norm's values over one set of mesh dims.
#[repr(C)]
pub struct fsdpturbo_comm_group_t {
    /// The mesh-dim ids (as in fsdpturbo_grad_t.dims), in any order.
    pub dims: *const u32,
    pub n_dims: usize,
    pub comm: *const fsdpturbo_comm_t,
}

struct Groups<'a> {
    entries: Vec<(Vec<u32>, &'a fsdpturbo_comm_t)>,
    /// Why the last reduction failed, for the caller's error message.
    failure: RefCell<Option<FfiError>>,
}

impl Groups<'_> {
    fn reduce(&self, dims: &[u32], op: i32, value: f64) -> Result<f64, FfiError> {
        let (_, comm) = self.entries.iter().find(|(d, _)| d.as_slice() == dims).ok_or_else(|| {
            invalid(format!(
                "no entry of `groups` has the mesh dims {dims:?}, over which gradients are sharded"
            ))
        })?;
        let op = if op == FSDPTURBO_REDUCE_MAX { ReduceOp::Max } else { ReduceOp::Sum };
        Ok(comm.inner.all_reduce_host_f64(value, op)?)
    }
}

/// The reduce callback of fsdpturbo_clip_grad_norm, served by the communicator whose dims are
/// the set's (the library passes sets sorted).
unsafe extern "C" fn reduce_with_groups(
    user: *mut c_void,
    _set_index: usize,
    dims: *const u32,
    n_dims: usize,
    op: i32,
    value: *mut f64,
) -> i32 {
    // SAFETY: `user` is the Groups of the enclosing call; dims/value are the library's own.
    let (groups, dims, value) =
        unsafe { (&*(user as *const Groups), std::slice::from_raw_parts(dims, n_dims), &mut *value) };
    match groups.reduce(dims, op, *value) {
        Ok(v) => {
            *value = v;
            0
        }
        Err(err) => {
            let status = err.status;
            *groups.failure.borrow_mut() = Some(err);
            status
        }
    }
}

/// fsdpturbo_clip_grad_norm with communicators instead of a callback: the values of each set
/// of mesh dims over which gradients are sharded are reduced by the communicator of the
/// `groups` entry with exactly those dims (host gradients; an NCCL communicator stages the one
/// value through device memory). A set without an entry is an error on every rank alike.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_clip_grad_norm_comm(
    options: *const fsdpturbo_clip_options_t,
    grads: *const fsdpturbo_grad_t,
    n_grads: usize,
    groups: *const fsdpturbo_comm_group_t,
    n_groups: usize,
    out_total_norm: *mut f64,
) -> i32 {
    boundary(|| {
        let mut entries = Vec::new();
        for (i, g) in arg_slice(groups, n_groups, "groups")?.iter().enumerate() {
            let mut dims = arg_slice(g.dims, g.n_dims, format_args!("groups[{i}].dims"))?.to_vec();
            dims.sort_unstable();
            dims.dedup();
            entries.push((dims, arg_ref(g.comm, &format!("groups[{i}].comm"))?));
        }
        let groups = Groups { entries, failure: RefCell::new(None) };
        let reduce: fsdpturbo_reduce_fn = Some(reduce_with_groups);
        let user = (&groups as *const Groups).cast_mut().cast();
        let status = fsdpturbo_clip_grad_norm(options, grads, n_grads, reduce, user, out_total_norm);
        match groups.failure.into_inner() {
            Some(err) => Err(FfiError::new(
                err.status,
                format!("grad norm: {}; no gradient was modified", err.message),
            )),
            None if status != 0 => Err(FfiError::new(status, last_error_message())),
            None => Ok(()),
        }
    })
}
