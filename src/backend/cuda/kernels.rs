//! The CUDA kernels of `src/backend/cuda/kernels`: their sources (compiled by NVRTC at first use for the
//! device's compute capability, through the on-disk cache), the modules loaded per device, and
//! the launch sequences with their argument checks. Semantics are those of `route.rs` and
//! `norm.rs` (computed on the host by `host/`); an error found on the device (an out-of-range
//! id, a bad row, a permutation that is not one) is reported with the host's own message,
//! recomputed from a host copy of the offending input.
//!
//! Every pointer here is device memory of the caller (torch tensors), every launch is ordered on
//! the caller's stream, and nothing is allocated: scratch space comes in as a workspace whose
//! size the `*_workspace` functions give.

use std::collections::HashMap;
use std::ffi::c_void;

use parking_lot::Mutex;

use super::driver::{CUfunction, Driver, driver};
use super::nvrtc::{Output, nvrtc};
use crate::backend::Stream;
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::norm::NormType;

const COMMON: &str = include_str!("kernels/common.cuh");

/// One kernel source file and the functions it defines.
pub struct KernelSource {
    pub name: &'static str,
    pub body: &'static str,
    pub functions: &'static [&'static str],
}

pub const ROUTE: usize = 0;
pub const PERMUTE: usize = 1;
pub const NORM: usize = 2;

pub static SOURCES: [KernelSource; 3] = [
    KernelSource {
        name: "route",
        body: include_str!("kernels/route.cu"),
        functions: &["route_tile_counts", "route_scan_tiles", "route_starts", "route_scatter"],
    },
    KernelSource {
        name: "permute",
        body: include_str!("kernels/permute.cu"),
        functions: &[
            "permute_rows_v16",
            "permute_rows_u16",
            "invert_permutation",
            "unpermute_f32_v16",
            "unpermute_f64_v16",
            "unpermute_f16_v16",
            "unpermute_bf16_v16",
            "unpermute_f32_v1",
            "unpermute_f64_v1",
            "unpermute_f16_v1",
            "unpermute_bf16_v1",
        ],
    },
    KernelSource {
        name: "norm",
        body: include_str!("kernels/norm.cu"),
        functions: &[
            "power_sum_partials_f64",
            "power_sum_partials_f32",
            "power_sum_finalize",
            "scale_in_place",
        ],
    },
];

impl KernelSource {
    /// The text NVRTC compiles: the shared prelude, then the file.
    pub fn source(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.body)
    }
}

/// Compiles every kernel source for `arch` (e.g. 80, 90); returns (name, bytes) per source.
/// Needs NVRTC only, no GPU.
pub fn compile_all(arch: u32, output: Output) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let nvrtc = nvrtc()?;
    SOURCES.iter().map(|k| Ok((k.name, nvrtc.compile(&k.source(), k.name, arch, output)?))).collect()
}

/// Loaded functions per (device ordinal, source index), as addresses.
type FunctionTable = HashMap<(i32, usize), Vec<usize>>;
static MODULES: Mutex<Option<FunctionTable>> = Mutex::new(None);

/// The functions of source `which` on `device`, making the device's context current.
fn functions(device: i32, which: usize) -> Result<(&'static Driver, Vec<CUfunction>)> {
    let drv = driver()?;
    drv.use_device(device)?;
    let mut modules = MODULES.lock();
    let map = modules.get_or_insert_with(HashMap::new);
    if let Some(fns) = map.get(&(device, which)) {
        return Ok((drv, fns.iter().map(|&f| f as CUfunction).collect()));
    }
    let k = &SOURCES[which];
    let arch = drv.compute_capability(device)?;
    let image = nvrtc()?.compile_cached(&k.source(), k.name, arch, Output::Cubin)?;
    let fns = drv.load_module(&image, k.functions)?;
    map.insert((device, which), fns.iter().map(|&f| f as usize).collect());
    Ok((drv, fns))
}

fn function(fns: &[CUfunction], which: usize, name: &str) -> CUfunction {
    let index = SOURCES[which].functions.iter().position(|f| *f == name).expect("a function of this source");
    fns[index]
}

/// A kernel parameter: the address of a value of the kernel's parameter type.
fn arg<T>(value: &T) -> *mut c_void {
    (value as *const T).cast_mut().cast()
}

fn workspace_error(what: &str, need: usize, got: usize) -> Error {
    Error::new(
        ErrorKind::BufferTooSmall,
        format!("the {what} workspace has {got} bytes; {need} are needed (query its *_workspace size)"),
    )
}

/// Sets the error flag (the first word of a workspace) to "no error".
fn clear_flag(drv: &Driver, flag: u64, stream: Stream) -> Result<()> {
    drv.memset(flag, 0xff, 8, stream)
}

/// Waits for the stream and returns the smallest reported bad index, if any.
fn read_flag(drv: &Driver, flag: u64, stream: Stream) -> Result<Option<u64>> {
    let mut bytes = [0u8; 8];
    drv.read_back(&mut bytes, flag, stream)?;
    let v = u64::from_ne_bytes(bytes);
    Ok((v != u64::MAX).then_some(v))
}

fn read_u64s(drv: &Driver, src: u64, n: usize, stream: Stream) -> Result<Vec<u64>> {
    let mut bytes = vec![0u8; n * 8];
    drv.read_back(&mut bytes, src, stream)?;
    Ok(bytes.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))).collect())
}

const ROUTE_TILE: usize = 256;
/// Experts the routing kernels take (their per-block histograms live in shared memory).
pub const ROUTE_MAX_EXPERTS: usize = 4096;

/// Workspace bytes of [`route`].
pub fn route_workspace(tokens: usize, top_k: usize, num_experts: usize) -> usize {
    let tiles = tokens.saturating_mul(top_k).div_ceil(ROUTE_TILE);
    8usize.saturating_add(tiles.saturating_add(1).saturating_mul(num_experts).saturating_mul(8))
}

/// Device pointers of one routing call.
pub struct RouteBuffers {
    pub expert_ids: u64,
    pub tokens_per_expert: u64,
    pub permutation: u64,
    pub input_splits: u64,
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// `route_into` on the device: int64 ids `[T, K]`, int64 outputs of lengths E, T·K and P.
/// Waits for the stream (the ids are checked, and the counts are needed on the host next).
pub fn route(
    device: i32,
    stream: Stream,
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    ep_size: usize,
    b: &RouteBuffers,
) -> Result<()> {
    let slots = crate::route::route_slots(tokens, top_k, num_experts, ep_size)?;
    if num_experts > ROUTE_MAX_EXPERTS {
        return Err(Error::invalid(format!(
            "num_experts {num_experts} is above the {ROUTE_MAX_EXPERTS} the CUDA routing kernels take"
        )));
    }
    let need = route_workspace(tokens, top_k, num_experts);
    if b.workspace_bytes < need {
        return Err(workspace_error("routing", need, b.workspace_bytes));
    }
    let (drv, fns) = functions(device, ROUTE)?;
    let tiles = slots.div_ceil(ROUTE_TILE) as u64;
    let (slots64, e32, p32) = (slots as u64, num_experts as i32, ep_size as i32);
    let (flag, tile_counts) = (b.workspace, b.workspace + 8);
    let starts = tile_counts + tiles * num_experts as u64 * 8;
    clear_flag(drv, flag, stream)?;
    let grid =
        u32::try_from(tiles).map_err(|_| Error::invalid(format!("{slots} routing slots are too many")))?;
    let starts_block = num_experts.next_multiple_of(32).min(1024) as u32;
    // SAFETY: each parameter list matches its kernel in route.cu; the buffers are the caller's.
    unsafe {
        drv.launch(
            function(&fns, ROUTE, "route_tile_counts"),
            grid,
            ROUTE_TILE as u32,
            (num_experts * 4) as u32,
            stream,
            &mut [arg(&b.expert_ids), arg(&slots64), arg(&e32), arg(&tile_counts), arg(&flag)],
            "route_tile_counts",
        )?;
        drv.launch(
            function(&fns, ROUTE, "route_scan_tiles"),
            e32 as u32,
            ROUTE_TILE as u32,
            0,
            stream,
            &mut [arg(&tile_counts), arg(&tiles), arg(&e32), arg(&b.tokens_per_expert)],
            "route_scan_tiles",
        )?;
        drv.launch(
            function(&fns, ROUTE, "route_starts"),
            1,
            starts_block,
            (num_experts * 8) as u32,
            stream,
            &mut [arg(&b.tokens_per_expert), arg(&e32), arg(&p32), arg(&starts), arg(&b.input_splits)],
            "route_starts",
        )?;
        drv.launch(
            function(&fns, ROUTE, "route_scatter"),
            grid,
            ROUTE_TILE as u32,
            0,
            stream,
            &mut [
                arg(&b.expert_ids),
                arg(&slots64),
                arg(&e32),
                arg(&tile_counts),
                arg(&starts),
                arg(&b.permutation),
            ],
            "route_scatter",
        )?;
    }
    if read_flag(drv, flag, stream)?.is_some() {
        let ids: Vec<i64> =
            read_u64s(drv, b.expert_ids, slots, stream)?.into_iter().map(|v| v as i64).collect();
        crate::route::route(&ids, tokens, top_k, num_experts, ep_size)?;
        return Err(Error::invalid(
            "the CUDA routing kernel reported a bad expert id the host check accepts",
        ));
    }
    Ok(())
}

/// Device pointers of one row permute.
pub struct PermuteBuffers {
    pub src: u64,
    pub rows: u64,
    pub dst: u64,
    /// At least 8 bytes (the error flag).
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// `dst[i, :] = src[rows[i] / divisor, :]` for rows of `row_bytes` bytes (a multiple of 2).
/// Waits for the stream to check the rows.
pub fn permute(
    device: i32,
    stream: Stream,
    row_bytes: usize,
    src_rows: usize,
    n_rows: usize,
    divisor: usize,
    b: &PermuteBuffers,
) -> Result<()> {
    if divisor == 0 {
        return Err(Error::invalid("`row_divisor` must be >= 1 (1: plain gather; top_k: tokens), got 0"));
    }
    if b.workspace_bytes < 8 {
        return Err(workspace_error("permute", 8, b.workspace_bytes));
    }
    if n_rows == 0 || row_bytes == 0 {
        return Ok(());
    }
    let (drv, fns) = functions(device, PERMUTE)?;
    clear_flag(drv, b.workspace, stream)?;
    let vec16 = row_bytes % 16 == 0 && b.src % 16 == 0 && b.dst % 16 == 0;
    let (name, row_len, block) = if vec16 {
        ("permute_rows_v16", row_bytes / 16, 128)
    } else {
        ("permute_rows_u16", row_bytes / 2, 256)
    };
    let grid = n_rows.min(1 << 20) as u32;
    let (src_rows64, row_len64, n_rows64, div64) =
        (src_rows as u64, row_len as u64, n_rows as u64, divisor as i64);
    // SAFETY: the parameter list of permute_rows_* in permute.cu.
    unsafe {
        drv.launch(
            function(&fns, PERMUTE, name),
            grid,
            block,
            0,
            stream,
            &mut [
                arg(&b.src),
                arg(&src_rows64),
                arg(&row_len64),
                arg(&b.rows),
                arg(&n_rows64),
                arg(&div64),
                arg(&b.dst),
                arg(&b.workspace),
            ],
            name,
        )?;
    }
    if read_flag(drv, b.workspace, stream)?.is_some() {
        let rows = read_u64s(drv, b.rows, n_rows, stream)?;
        // The host kernels' names: `permute` for a plain gather, `permute_tokens` otherwise.
        let name = if divisor == 1 { "rows" } else { "permutation" };
        crate::route::check_rows(&rows, divisor, src_rows, name)?;
        return Err(Error::invalid("the CUDA permute reported a bad row the host check accepts"));
    }
    Ok(())
}

/// The kernels compute on floating-point elements only (the C ABI refuses the others before).
fn float_only(elem: Dtype, what: &str) -> Result<()> {
    if elem.is_float() {
        Ok(())
    } else {
        Err(Error::invalid(format!("{what}: floating-point elements only, not {elem}")))
    }
}

/// Workspace bytes of [`unpermute`].
pub fn unpermute_workspace(tokens: usize, top_k: usize) -> usize {
    8usize.saturating_add(tokens.saturating_mul(top_k).saturating_mul(8))
}

/// Device pointers of one unpermute.
pub struct UnpermuteBuffers {
    pub permuted: u64,
    pub permutation: u64,
    /// 0 for no weights.
    pub probs: u64,
    pub out: u64,
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// `out[t, :] = Σ_k w[t, k] · permuted[inv[t·K + k], :]` (route.rs `unpermute`). Waits for
/// the stream to check the permutation.
pub fn unpermute(
    device: i32,
    stream: Stream,
    elem: Dtype,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    b: &UnpermuteBuffers,
) -> Result<()> {
    float_only(elem, "the unpermute kernel")?;
    if hidden == 0 {
        return Err(Error::invalid("hidden must be >= 1, got 0"));
    }
    if top_k == 0 {
        return Err(Error::invalid("top_k must be >= 1, got 0"));
    }
    let slots = tokens.checked_mul(top_k).ok_or_else(|| Error::invalid("tokens × top_k overflows"))?;
    let need = unpermute_workspace(tokens, top_k);
    if b.workspace_bytes < need {
        return Err(workspace_error("unpermute", need, b.workspace_bytes));
    }
    if slots == 0 {
        return Ok(());
    }
    let (drv, fns) = functions(device, PERMUTE)?;
    let (flag, inv) = (b.workspace, b.workspace + 8);
    clear_flag(drv, flag, stream)?;
    drv.memset(inv, 0xff, slots * 8, stream)?;
    let per_vec = 16 / elem.size();
    let vec16 = hidden % per_vec == 0 && b.permuted % 16 == 0 && b.out % 16 == 0;
    let name = format!("unpermute_{}_{}", elem.name(), if vec16 { "v16" } else { "v1" });
    let packs = (tokens * if vec16 { hidden / per_vec } else { hidden }) as u64;
    let grid = packs.div_ceil(256).min(1 << 20) as u32;
    let (n64, tokens64, k32, hidden64) = (slots as u64, tokens as u64, top_k as i32, hidden as u64);
    // SAFETY: the parameter lists of invert_permutation and unpermute_* in permute.cu.
    unsafe {
        drv.launch(
            function(&fns, PERMUTE, "invert_permutation"),
            slots.div_ceil(256) as u32,
            256,
            0,
            stream,
            &mut [arg(&b.permutation), arg(&n64), arg(&inv), arg(&flag)],
            "invert_permutation",
        )?;
        drv.launch(
            function(&fns, PERMUTE, &name),
            grid,
            256,
            0,
            stream,
            &mut [
                arg(&b.permuted),
                arg(&inv),
                arg(&b.probs),
                arg(&tokens64),
                arg(&k32),
                arg(&hidden64),
                arg(&b.out),
            ],
            &name,
        )?;
    }
    if read_flag(drv, flag, stream)?.is_some() {
        let perm = read_u64s(drv, b.permutation, slots, stream)?;
        crate::route::invert_permutation(&perm)?;
        return Err(Error::invalid("the CUDA unpermute reported a bad permutation the host check accepts"));
    }
    Ok(())
}

/// Elements per block of the multi-tensor kernels (NORM_CHUNK in norm.cu).
pub const NORM_CHUNK: usize = 65536;

/// One tensor of a multi-tensor launch: device address, elements, element type.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTensor {
    pub ptr: u64,
    pub numel: usize,
    pub elem: Dtype,
}

/// The table the multi-tensor kernels read (norm.cu): `chunk_first[n + 1]` then per tensor
/// (ptr, numel, dtype code). Returns the words and the number of chunks (blocks).
pub fn multi_tensor_table(tensors: &[DeviceTensor]) -> Result<(Vec<u64>, usize)> {
    let mut words = Vec::with_capacity(4 * tensors.len() + 1);
    let mut chunks = 0usize;
    for t in tensors {
        words.push(chunks as u64);
        chunks += t.numel.div_ceil(NORM_CHUNK);
    }
    words.push(chunks as u64);
    for (i, t) in tensors.iter().enumerate() {
        if t.numel > 0 && t.ptr % t.elem.size() as u64 != 0 {
            return Err(Error::invalid(format!(
                "tensors[{i}] at {:#x} is not aligned to its {}-byte element type",
                t.ptr,
                t.elem.size()
            )));
        }
        float_only(t.elem, "the multi-tensor kernels")?;
        words.extend([t.ptr, t.numel as u64, t.elem.code() as u64]);
    }
    if u32::try_from(chunks).is_err() {
        return Err(Error::invalid(format!(
            "{chunks} chunks of {NORM_CHUNK} elements are too many for one launch"
        )));
    }
    Ok((words, chunks))
}

/// Σ|x|^p (max |x| for p = inf) over the tensors of a device `table` of `n` tensors and `chunks`
/// chunks, written as one f64 to `out` (device); `partials` holds `chunks` f64. Asynchronous.
#[allow(clippy::too_many_arguments)]
pub fn power_sum(
    device: i32,
    stream: Stream,
    table: u64,
    n: usize,
    chunks: usize,
    norm: NormType,
    accumulate_f64: bool,
    partials: u64,
    out: u64,
) -> Result<()> {
    let (drv, fns) = functions(device, NORM)?;
    let (kind, p): (i32, f64) = match norm {
        NormType::Inf => (3, 0.0),
        NormType::P(p) if p == 1.0 => (0, p),
        NormType::P(p) if p == 2.0 => (1, p),
        NormType::P(p) => (2, p),
    };
    let name = if accumulate_f64 { "power_sum_partials_f64" } else { "power_sum_partials_f32" };
    let (n64, chunks64, is_max) = (n as u64, chunks as u64, i32::from(kind == 3));
    // SAFETY: the parameter lists of power_sum_partials_* and power_sum_finalize in norm.cu.
    unsafe {
        drv.launch(
            function(&fns, NORM, name),
            chunks as u32,
            256,
            0,
            stream,
            &mut [arg(&table), arg(&n64), arg(&kind), arg(&p), arg(&partials)],
            name,
        )?;
        drv.launch(
            function(&fns, NORM, "power_sum_finalize"),
            1,
            256,
            0,
            stream,
            &mut [arg(&partials), arg(&chunks64), arg(&is_max), arg(&out)],
            "power_sum_finalize",
        )?;
    }
    Ok(())
}

/// Multiplies every tensor of a device `table` by `coef` in place. Asynchronous.
pub fn scale(device: i32, stream: Stream, table: u64, n: usize, chunks: usize, coef: f64) -> Result<()> {
    let (drv, fns) = functions(device, NORM)?;
    let n64 = n as u64;
    // SAFETY: the parameter list of scale_in_place in norm.cu.
    unsafe {
        drv.launch(
            function(&fns, NORM, "scale_in_place"),
            chunks as u32,
            256,
            0,
            stream,
            &mut [arg(&table), arg(&n64), arg(&coef)],
            "scale_in_place",
        )
    }
}
