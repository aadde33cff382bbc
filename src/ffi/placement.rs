//! C ABI of DTensor placements: torch's local shape and global offset of a shard, and copy
//! plans that move a rank's elements between the full tensor and its local tensor.

use std::ffi::c_void;

use super::error::FfiError;
use super::handle::{
    arg_mut, arg_ref, arg_slice, check_disjoint, free_handle, in_array, into_handle, invalid, out_array,
    out_slice, write_array, write_out, write_slice,
};
use super::panic::boundary;
use super::status::FSDPTURBO_ERR_BUFFER_TOO_SMALL;
use crate::placement::{self, CopyPlan, Placement};

/// Placement kind (fsdpturbo_placement_t.kind): torch `Shard(dim)`.
pub const FSDPTURBO_PLACEMENT_SHARD: i32 = 0;
/// Placement kind: torch `_StridedShard(dim, split_factor)` (FSDP2 over an already sharded dim).
pub const FSDPTURBO_PLACEMENT_STRIDED_SHARD: i32 = 1;
/// Placement kind: torch `Replicate()`.
pub const FSDPTURBO_PLACEMENT_REPLICATE: i32 = 2;
/// Placement kind: torch `Partial()`.
pub const FSDPTURBO_PLACEMENT_PARTIAL: i32 = 3;

/// The placement of a tensor on one mesh dim. `dim` is the tensor dim of SHARD and
/// STRIDED_SHARD (>= 0; normalise negative dims first); `split_factor` (>= 1) is that of
/// STRIDED_SHARD. Fields a kind does not use must be 0, so `{FSDPTURBO_PLACEMENT_REPLICATE}`
/// and `{FSDPTURBO_PLACEMENT_SHARD, 1}` are complete initialisers.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct fsdpturbo_placement_t {
    pub kind: i32,
    pub dim: i64,
    pub split_factor: i64,
}

/// A copy plan: the elements of the full row-major tensor that form one rank's local tensor.
pub struct fsdpturbo_copy_plan_t {
    plan: CopyPlan,
}

pub(crate) fn placement_from_c(p: &fsdpturbo_placement_t, k: usize) -> Result<Placement, FfiError> {
    let dim = || -> Result<usize, FfiError> {
        usize::try_from(p.dim).map_err(|_| {
            invalid(format!(
                "`placements[{k}].dim` is {}; tensor dims must be >= 0 (normalise negative dims first)",
                p.dim
            ))
        })
    };
    let unused = |field: &str, value: i64| -> Result<(), FfiError> {
        if value != 0 {
            return Err(invalid(format!(
                "`placements[{k}].{field}` is {value} but kind {} does not use it; set it to 0",
                kind_name(p.kind)
            )));
        }
        Ok(())
    };
    match p.kind {
        FSDPTURBO_PLACEMENT_SHARD => {
            unused("split_factor", p.split_factor)?;
            Ok(Placement::Shard(dim()?))
        }
        FSDPTURBO_PLACEMENT_STRIDED_SHARD => {
            let dim = dim()?;
            if p.split_factor < 1 {
                return Err(invalid(format!(
                    "`placements[{k}].split_factor` is {}; a _StridedShard split factor must be >= 1",
                    p.split_factor
                )));
            }
            Ok(Placement::StridedShard { dim, split_factor: p.split_factor as u64 })
        }
        FSDPTURBO_PLACEMENT_REPLICATE | FSDPTURBO_PLACEMENT_PARTIAL => {
            unused("dim", p.dim)?;
            unused("split_factor", p.split_factor)?;
            Ok(if p.kind == FSDPTURBO_PLACEMENT_REPLICATE {
                Placement::Replicate
            } else {
                Placement::Partial
            })
        }
        other => Err(invalid(format!(
            "`placements[{k}].kind` is {other}; accepted: FSDPTURBO_PLACEMENT_SHARD (0), \
             FSDPTURBO_PLACEMENT_STRIDED_SHARD (1), FSDPTURBO_PLACEMENT_REPLICATE (2), FSDPTURBO_PLACEMENT_PARTIAL (3)"
        ))),
    }
}

fn kind_name(kind: i32) -> &'static str {
    match kind {
        FSDPTURBO_PLACEMENT_SHARD => "FSDPTURBO_PLACEMENT_SHARD",
        FSDPTURBO_PLACEMENT_STRIDED_SHARD => "FSDPTURBO_PLACEMENT_STRIDED_SHARD",
        FSDPTURBO_PLACEMENT_REPLICATE => "FSDPTURBO_PLACEMENT_REPLICATE",
        _ => "FSDPTURBO_PLACEMENT_PARTIAL",
    }
}

/// The checked inputs every function here takes.
struct Inputs<'a> {
    global_shape: &'a [u64],
    mesh_shape: &'a [u64],
    coordinate: &'a [u64],
    placements: Vec<Placement>,
}

fn inputs<'a>(
    global_shape: *const u64,
    ndim: usize,
    mesh_shape: *const u64,
    coordinate: *const u64,
    mesh_ndim: usize,
    placements: *const fsdpturbo_placement_t,
) -> Result<Inputs<'a>, FfiError> {
    let global_shape = arg_slice(global_shape, ndim, "global_shape")?;
    let mesh_shape = arg_slice(mesh_shape, mesh_ndim, "mesh_shape")?;
    let coordinate = arg_slice(coordinate, mesh_ndim, "coordinate")?;
    let placements = arg_slice(placements, mesh_ndim, "placements")?
        .iter()
        .enumerate()
        .map(|(k, p)| placement_from_c(p, k))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Inputs { global_shape, mesh_shape, coordinate, placements })
}

/// torch 2.15's `_compute_local_shape_and_global_offset`: the local shape and the global
/// offset of the shard at `coordinate` of a tensor of `global_shape` (`ndim` dims) placed by
/// `placements` on a mesh of `mesh_shape` (`mesh_ndim` dims; `coordinate` and `placements`
/// have `mesh_ndim` entries). Uneven and empty shards (offset = the dim's global size),
/// several placements on one dim (nested, in mesh-dim order) and _StridedShard (offset of the
/// first local row) follow torch. `local_shape` and `global_offset` receive `ndim` elements
/// each, and are written only on success. Arrays may be NULL when their length is 0.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_local_shape_and_offset(
    global_shape: *const u64,
    ndim: usize,
    mesh_shape: *const u64,
    coordinate: *const u64,
    mesh_ndim: usize,
    placements: *const fsdpturbo_placement_t,
    local_shape: *mut u64,
    global_offset: *mut u64,
) -> i32 {
    boundary(|| {
        let i = inputs(global_shape, ndim, mesh_shape, coordinate, mesh_ndim, placements)?;
        out_array(local_shape, ndim, "local_shape")?;
        out_array(global_offset, ndim, "global_offset")?;
        let (shape, offset) =
            placement::local_shape_and_offset(i.global_shape, i.mesh_shape, i.coordinate, &i.placements)?;
        write_array(local_shape, "local_shape", &shape)?;
        write_array(global_offset, "global_offset", &offset)
    })
}

/// Makes the copy plan of the shard at `coordinate` (arguments as for
/// fsdpturbo_local_shape_and_offset): the elements of the full row-major tensor that form
/// its local tensor, as maximal contiguous runs in local order. _StridedShard is supported;
/// a PARTIAL placement is rejected (a partial local tensor is not a selection of elements).
/// On success `*out` receives a plan to free with fsdpturbo_copy_plan_free.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_plan_new(
    global_shape: *const u64,
    ndim: usize,
    mesh_shape: *const u64,
    coordinate: *const u64,
    mesh_ndim: usize,
    placements: *const fsdpturbo_placement_t,
    out: *mut *mut fsdpturbo_copy_plan_t,
) -> i32 {
    boundary(|| {
        let i = inputs(global_shape, ndim, mesh_shape, coordinate, mesh_ndim, placements)?;
        arg_mut(out, "out")?;
        let plan = placement::copy_plan(i.global_shape, i.mesh_shape, i.coordinate, &i.placements)?;
        write_out(out, "out", into_handle(fsdpturbo_copy_plan_t { plan }))
    })
}

/// Frees a copy plan; NULL is a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_plan_free(plan: *mut fsdpturbo_copy_plan_t) {
    free_handle(plan)
}

/// The runs of the plan as `(src, dst, len)` triples of element offsets (src in the full
/// tensor, dst in the local tensor), 3 * `cap_runs` integers at `triples`. `*out_runs` always
/// receives the number of runs; when it exceeds `cap_runs` the status is
/// FSDPTURBO_ERR_BUFFER_TOO_SMALL and nothing is written (pass 0 and NULL to ask for it).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_plan_runs(
    plan: *const fsdpturbo_copy_plan_t,
    triples: *mut u64,
    cap_runs: usize,
    out_runs: *mut usize,
) -> i32 {
    boundary(|| {
        let runs = &arg_ref(plan, "plan")?.plan.runs;
        write_out(out_runs, "out_runs", runs.len())?;
        if cap_runs < runs.len() {
            return Err(FfiError::new(
                FSDPTURBO_ERR_BUFFER_TOO_SMALL,
                format!("buffer `triples` holds {cap_runs} runs, {} are needed", runs.len()),
            ));
        }
        let flat: Vec<u64> = runs.iter().flat_map(|r| [r.src, r.dst, r.len]).collect();
        write_array(triples, "triples", &flat)
    })
}

/// The local shape of the plan, `cap` elements at `shape`; `*out_ndim` always receives the
/// number of dims, and a short buffer gives FSDPTURBO_ERR_BUFFER_TOO_SMALL.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_plan_local_shape(
    plan: *const fsdpturbo_copy_plan_t,
    shape: *mut u64,
    cap: usize,
    out_ndim: *mut usize,
) -> i32 {
    boundary(|| write_slice(shape, cap, out_ndim, &arg_ref(plan, "plan")?.plan.local_shape, "shape"))
}

/// The number of elements of the plan's local tensor.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_plan_local_numel(plan: *const fsdpturbo_copy_plan_t, out: *mut u64) -> i32 {
    boundary(|| write_out(out, "out", arg_ref(plan, "plan")?.plan.local_numel()))
}

/// Copies this rank's elements of the full tensor into its local tensor: `elem_size` bytes
/// per element, one memcpy per run of the plan (a contiguous block is one run). `full_bytes`
/// must be exactly the full tensor's numel times `elem_size` and `local_bytes` the local
/// tensor's; the buffers must not overlap. A buffer may be NULL when its length is 0.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_bytes(
    plan: *const fsdpturbo_copy_plan_t,
    elem_size: usize,
    full: *const c_void,
    full_bytes: usize,
    local: *mut c_void,
    local_bytes: usize,
) -> i32 {
    boundary(|| {
        let plan = &arg_ref(plan, "plan")?.plan;
        check_bytes(plan, elem_size, full_bytes, local_bytes)?;
        let (full, local) = byte_buffers((full, full_bytes, "full"), (local, local_bytes, "local"))?;
        Ok(placement::copy_runs_bytes(plan, elem_size, full, local)?)
    })
}

/// The inverse of fsdpturbo_copy_bytes: writes the local tensor back to its place in the full
/// tensor (the gather step for one rank); other bytes of `full` are left untouched. Lengths
/// are checked as for fsdpturbo_copy_bytes.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_copy_bytes_back(
    plan: *const fsdpturbo_copy_plan_t,
    elem_size: usize,
    local: *const c_void,
    local_bytes: usize,
    full: *mut c_void,
    full_bytes: usize,
) -> i32 {
    boundary(|| {
        let plan = &arg_ref(plan, "plan")?.plan;
        check_bytes(plan, elem_size, full_bytes, local_bytes)?;
        let (local, full) = byte_buffers((local, local_bytes, "local"), (full, full_bytes, "full"))?;
        Ok(placement::scatter_runs_bytes(plan, elem_size, local, full)?)
    })
}

/// Checks the claimed byte lengths against the plan before any slice is made of them.
fn check_bytes(
    plan: &CopyPlan,
    elem_size: usize,
    full_bytes: usize,
    local_bytes: usize,
) -> Result<(), FfiError> {
    if elem_size == 0 {
        return Err(invalid(
            "`elem_size` is 0; give the size of one element in bytes (e.g. 2 for bf16)".into(),
        ));
    }
    let e = elem_size as u128;
    let (need_full, need_local) = (plan.global_numel() as u128 * e, plan.local_numel() as u128 * e);
    if full_bytes as u128 != need_full {
        return Err(invalid(format!(
            "`full_bytes` is {full_bytes} but the full tensor {:?} of {elem_size}-byte elements is {need_full} bytes",
            plan.global_shape
        )));
    }
    if local_bytes as u128 != need_local {
        return Err(invalid(format!(
            "`local_bytes` is {local_bytes} but the local tensor {:?} of {elem_size}-byte elements is {need_local} bytes",
            plan.local_shape
        )));
    }
    Ok(())
}

/// The source and destination byte buffers of a copy, checked by the marshalling layer (NULL
/// only when empty, no overlap).
fn byte_buffers<'a>(
    src: (*const c_void, usize, &str),
    dst: (*mut c_void, usize, &str),
) -> Result<(&'a [u8], &'a mut [u8]), FfiError> {
    let (src_bytes, src_region) = in_array(src.0.cast::<u8>(), src.1, src.2)?;
    let dst_region = out_array(dst.0.cast::<u8>(), dst.1, dst.2)?;
    check_disjoint(&[dst_region], &[src_region])?;
    // SAFETY: checked by out_array and check_disjoint; writable by the caller's contract.
    Ok((src_bytes, unsafe { out_slice(dst.0.cast::<u8>(), dst.1) }))
}
