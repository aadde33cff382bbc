//! C ABI of shard-on-read loading: a safetensors header parsed from the bytes a trainer read
//! from the start of a file, and the byte ranges of one rank's local slice of a tensor (one
//! checkpoint tensor, or a stack of per-expert tensors), so that each rank reads only its share.
//!
//! A trainer reads the first 8 bytes of a file, asks fsdpturbo_safetensors_header_size how much
//! to read, reads that and calls fsdpturbo_safetensors_parse; then per parameter
//! fsdpturbo_safetensors_read_plan_new and fsdpturbo_read_plan_ranges, and `pread`s each range
//! into its local tensor at `dst_offset`.

use std::ffi::c_char;

use super::error::FfiError;
use super::handle::{
    arg_ref, arg_slice, arg_strs, free_handle, into_handle, invalid, write_out, write_slice, write_string,
};
use super::panic::boundary;
use super::placement::{fsdpturbo_placement_t, placement_from_c};
use super::status::FSDPTURBO_ERR_NOT_FOUND;
use crate::error::Escaped;
use crate::safetensors::{self, Header, Layout, ReadPlan, Source};

/// A parsed, validated safetensors header.
pub struct fsdpturbo_safetensors_t {
    header: Header,
}

/// The reads that fill one rank's local tensor.
pub struct fsdpturbo_read_plan_t {
    plan: ReadPlan,
}

/// One read of a read plan: `length` bytes at byte `offset` of file `file` (an index into the
/// `files` array given to fsdpturbo_safetensors_read_plan_new) go to byte `dst_offset` of the
/// local tensor (row-major, contiguous, in the checkpoint's dtype).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct fsdpturbo_byte_range_t {
    pub file: u64,
    pub offset: u64,
    pub length: u64,
    pub dst_offset: u64,
}

/// The number of bytes before a safetensors file's data section (8 + the JSON header length),
/// from its first `len` (>= 8) bytes at `prefix`: how many bytes to read from the start of the
/// file for fsdpturbo_safetensors_parse. A header length over the format's limit (100 MB) is
/// FSDPTURBO_ERR_INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_safetensors_header_size(prefix: *const u8, len: usize, out: *mut u64) -> i32 {
    boundary(|| write_out(out, "out", safetensors::header_size(arg_slice(prefix, len, "prefix")?)?))
}

/// Parses and validates the header at the start of a safetensors file: `len` bytes at `bytes`
/// (at least fsdpturbo_safetensors_header_size of them; more are ignored). `file_size` is the
/// file's size in bytes, or 0 when unknown (nothing is checked against it). With a size, the
/// data section must end exactly at the end of the file: a shorter file is an error naming the
/// first tensor that runs past it (truncated), a longer one an error naming the extra bytes.
/// Offsets must tile the data section without holes or overlaps, each tensor's bytes must be
/// its shape times its dtype's size, keys must be unique and entries hold only dtype, shape
/// and data_offsets; every error names the tensor. On success `*out` receives a handle to free
/// with fsdpturbo_safetensors_free.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_safetensors_parse(
    bytes: *const u8,
    len: usize,
    file_size: u64,
    out: *mut *mut fsdpturbo_safetensors_t,
) -> i32 {
    boundary(|| {
        let bytes = arg_slice(bytes, len, "bytes")?;
        super::handle::arg_mut(out, "out")?;
        let header = safetensors::parse_header(bytes, (file_size > 0).then_some(file_size))?;
        write_out(out, "out", into_handle(fsdpturbo_safetensors_t { header }))
    })
}

/// Frees a parsed header; NULL is a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_safetensors_free(file: *mut fsdpturbo_safetensors_t) {
    free_handle(file)
}

/// The header as JSON (NUL-terminated, `cap` bytes at `buf`; `*out_len` receives the bytes
/// needed with the NUL, a short buffer gives FSDPTURBO_ERR_BUFFER_TOO_SMALL): `{"data_start",
/// "data_bytes", "tensors": [{"name", "dtype", "shape", "data_offsets": [begin, end]}, …] in
/// file order, "metadata": {…}}`; offsets are relative to `data_start`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_safetensors_to_json(
    file: *const fsdpturbo_safetensors_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let text = arg_ref(file, "file")?.header.to_json().to_string();
        write_string(buf, cap, out_len, &text, "buf")
    })
}

/// The header's tensor names in file order, concatenated (NUL-terminated as a whole, `cap`
/// bytes at `buf`; `*out_len` receives the bytes needed with the NUL, a short buffer gives
/// FSDPTURBO_ERR_BUFFER_TOO_SMALL). fsdpturbo_safetensors_tensor_layout gives each name's
/// length: with the two, a reader learns the tensors without fsdpturbo_safetensors_to_json.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_safetensors_tensor_names(
    file: *const fsdpturbo_safetensors_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let names: String = arg_ref(file, "file")?.header.tensors.iter().map(|t| t.name.as_str()).collect();
        write_string(buf, cap, out_len, &names, "buf")
    })
}

/// Per tensor of the header in file order, `3 + ndim` values: the length of its name in
/// fsdpturbo_safetensors_tensor_names in characters (Unicode scalar values), the offset of its
/// first byte in the file, its number of dims, then its dims. `cap` values at `buf`;
/// `*out_len` receives the number needed, a short buffer gives FSDPTURBO_ERR_BUFFER_TOO_SMALL.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_safetensors_tensor_layout(
    file: *const fsdpturbo_safetensors_t,
    buf: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let header = &arg_ref(file, "file")?.header;
        let mut layout = Vec::new();
        for t in &header.tensors {
            let chars = t.name.chars().count() as u64;
            layout.extend([chars, header.data_start + t.data_offsets.0, t.shape.len() as u64]);
            layout.extend_from_slice(&t.shape);
        }
        write_slice(buf, cap, out_len, &layout, "buf")
    })
}

/// Plans the reads of one rank's local slice of a tensor of `global_shape` (`ndim` dims)
/// placed by `placements` on a mesh of `mesh_shape` (`mesh_ndim` dims and placements), exactly
/// as torch DTensor slices it (uneven and empty shards, _StridedShard; PARTIAL is refused).
/// `rank` is the rank's index in the mesh, row-major (its coordinate's position in
/// `init_device_mesh`'s numbering). The tensor is made of the checkpoint tensors `names`
/// (`n_names`), looked up in the `n_files` parsed headers `files`:
/// * `parts_per_row` = 0: one name, a checkpoint tensor of shape `global_shape`;
/// * `parts_per_row` >= 1: a stack (the per-expert layout): `global_shape` is `[E, R, …]`,
///   `n_names` = E × `parts_per_row`, and row `e` is the dim-0 concatenation of
///   `names[e * parts_per_row ..]` (e.g. `experts.{e}.gate_proj.weight`, `.up_proj.weight`), each
///   `[R_j, …]` with Σ R_j = R.
///
/// A name in no file is FSDPTURBO_ERR_NOT_FOUND, a name in two files, shapes or dtypes that do
/// not fit, or a sub-byte dtype FSDPTURBO_ERR_INVALID_ARGUMENT; messages name the tensor. On
/// success `*out` receives a plan to free with fsdpturbo_read_plan_free.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn fsdpturbo_safetensors_read_plan_new(
    files: *const *const fsdpturbo_safetensors_t,
    n_files: usize,
    names: *const *const c_char,
    n_names: usize,
    parts_per_row: usize,
    global_shape: *const u64,
    ndim: usize,
    mesh_shape: *const u64,
    mesh_ndim: usize,
    placements: *const fsdpturbo_placement_t,
    rank: u64,
    out: *mut *mut fsdpturbo_read_plan_t,
) -> i32 {
    boundary(|| {
        let headers = arg_slice(files, n_files, "files")?
            .iter()
            .enumerate()
            .map(|(i, &f)| Ok(&arg_ref(f, &format!("files[{i}]"))?.header))
            .collect::<Result<Vec<&Header>, FfiError>>()?;
        let names = arg_strs(names, n_names, "names")?;
        let global_shape = arg_slice(global_shape, ndim, "global_shape")?;
        let mesh_shape = arg_slice(mesh_shape, mesh_ndim, "mesh_shape")?;
        let placements = arg_slice(placements, mesh_ndim, "placements")?
            .iter()
            .enumerate()
            .map(|(k, p)| placement_from_c(p, k))
            .collect::<Result<Vec<_>, _>>()?;
        super::handle::arg_mut(out, "out")?;
        let layout = match parts_per_row {
            0 if n_names == 1 => Layout::Direct,
            0 => {
                return Err(invalid(format!(
                    "`parts_per_row` is 0 (one checkpoint tensor) but {n_names} names were given; give one \
                     name, or parts_per_row >= 1 for a stack"
                )));
            }
            n => Layout::Stacked { parts_per_row: n },
        };
        let sources = names
            .iter()
            .map(|name| {
                let mut found = headers.iter().enumerate().filter_map(|(i, h)| h.get(name).map(|t| (i, h, t)));
                let Some((file, header, info)) = found.next() else {
                    return Err(FfiError::new(
                        FSDPTURBO_ERR_NOT_FOUND,
                        format!("tensor `{}` is in none of the {n_files} files given", Escaped(name)),
                    ));
                };
                if let Some((other, _, _)) = found.next() {
                    return Err(invalid(format!(
                        "tensor `{}` is in files[{file}] and files[{other}]; a checkpoint holds each tensor once",
                        Escaped(name)
                    )));
                }
                Ok(Source { file, data_start: header.data_start, info })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let coordinate = safetensors::coordinate_of(mesh_shape, rank)?;
        let plan =
            safetensors::read_plan(&sources, layout, global_shape, mesh_shape, &coordinate, &placements)?;
        write_out(out, "out", into_handle(fsdpturbo_read_plan_t { plan }))
    })
}

/// Frees a read plan; NULL is a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_read_plan_free(plan: *mut fsdpturbo_read_plan_t) {
    free_handle(plan)
}

/// The reads of the plan, in local order, contiguous ones merged: `cap` entries at `ranges`.
/// `*out_len` always receives the number of reads; when it exceeds `cap` the status is
/// FSDPTURBO_ERR_BUFFER_TOO_SMALL and nothing is written (pass 0 and NULL to ask for it).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_read_plan_ranges(
    plan: *const fsdpturbo_read_plan_t,
    ranges: *mut fsdpturbo_byte_range_t,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let plan = &arg_ref(plan, "plan")?.plan;
        let out: Vec<fsdpturbo_byte_range_t> = plan
            .ranges
            .iter()
            .map(|r| fsdpturbo_byte_range_t {
                file: r.file as u64,
                offset: r.offset,
                length: r.len,
                dst_offset: r.dst,
            })
            .collect();
        write_slice(ranges, cap, out_len, &out, "ranges")
    })
}

/// The local tensor's shape, `cap` entries at `shape`; `*out_ndim` always receives the number
/// of dims, and a short buffer gives FSDPTURBO_ERR_BUFFER_TOO_SMALL.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_read_plan_local_shape(
    plan: *const fsdpturbo_read_plan_t,
    shape: *mut u64,
    cap: usize,
    out_ndim: *mut usize,
) -> i32 {
    boundary(|| write_slice(shape, cap, out_ndim, &arg_ref(plan, "plan")?.plan.local_shape, "shape"))
}

/// The local tensor's bytes (its numel times the checkpoint dtype's size): the sum of the
/// reads' lengths.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_read_plan_local_bytes(plan: *const fsdpturbo_read_plan_t, out: *mut u64) -> i32 {
    boundary(|| write_out(out, "out", arg_ref(plan, "plan")?.plan.local_bytes))
}

/// The checkpoint dtype of the plan's tensor, as the format spells it ("BF16", "F32", …):
/// NUL-terminated, `cap` bytes at `buf`, `*out_len` the bytes needed with the NUL.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_read_plan_dtype(
    plan: *const fsdpturbo_read_plan_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| write_string(buf, cap, out_len, arg_ref(plan, "plan")?.plan.dtype.name(), "buf"))
}
