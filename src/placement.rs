//! DTensor placements: which part of a global tensor a rank holds, exactly as torch 2.15's
//! DTensor defines it, and plans that move the elements.
//!
//! * [`local_shape_and_offset`] is torch's
//!   `torch.distributed.tensor._utils._compute_local_shape_and_global_offset`: placements are
//!   applied in mesh-dim order, each level chunking the *current* local size of its tensor dim
//!   with `torch.chunk` semantics (ceil-sized chunks, trailing chunks shortened or empty).
//!   An empty shard reports the **global** size of its dim as its offset. `_StridedShard(d, f)`
//!   first splits the current dim into `f` pieces, splits each piece over the mesh dim, and
//!   gives coordinate `i` the concatenation of every piece's chunk `i`: its local tensor is not
//!   one block of the global tensor, and the offset torch reports is that of its first row.
//! * [`seed_copy_slices`] is the slicing of the seed's `_copy_weights` (a named mode,
//!   docs/design.md §4.3): plain nested ceil-chunking in mesh-dim order, split factors ignored, and nothing
//!   copied (None) when any level is empty.
//! * [`copy_plan`] lists, as maximal contiguous runs, which elements of the full row-major
//!   tensor form one rank's local tensor; [`gather_plan`] does so for every rank of the mesh
//!   and assembles the full tensor from the ranks' locals.
//!
//! Internally every tensor dim carries the exact list of global indices its local rows come
//! from (torch's `shard_dim_to_global_offsets`), kept as sorted segments so that plain shards
//! of huge dims cost nothing.

use std::fmt;
use std::ops::Range;

use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};

/// The placement of a tensor on one mesh dim (torch `Shard`, `_StridedShard`, `Replicate`,
/// `Partial`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Placement {
    /// `Shard(dim)`: the dim is chunked over the mesh dim (`torch.chunk` semantics).
    Shard(usize),
    /// `_StridedShard(dim, split_factor)`: the right-to-left sharding FSDP2 uses over an
    /// already sharded dim; `split_factor` is the number of shards that exist "before" it.
    StridedShard { dim: usize, split_factor: u64 },
    /// Every rank of the mesh dim holds the whole (current) tensor.
    Replicate,
    /// Every rank holds a partial value; the tensor is the reduction over the mesh dim.
    Partial,
}

impl Placement {
    /// The tensor dim of a `Shard` or `_StridedShard`; None for `Replicate` and `Partial`.
    pub fn shard_dim(&self) -> Option<usize> {
        match *self {
            Placement::Shard(dim) | Placement::StridedShard { dim, .. } => Some(dim),
            Placement::Replicate | Placement::Partial => None,
        }
    }
}

impl fmt::Display for Placement {
    /// torch's `repr`: `Shard(dim=0)`, `_StridedShard(dim=0, sf=2)`, `Replicate()`, `Partial()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Placement::Shard(dim) => write!(f, "Shard(dim={dim})"),
            Placement::StridedShard { dim, split_factor } => {
                write!(f, "_StridedShard(dim={dim}, sf={split_factor})")
            }
            Placement::Replicate => f.write_str("Replicate()"),
            Placement::Partial => f.write_str("Partial()"),
        }
    }
}

// --- argument checks ----------------------------------------------------------------------

fn validate(
    global_shape: &[u64],
    mesh_shape: &[u64],
    coordinate: Option<&[u64]>,
    placements: &[Placement],
) -> Result<()> {
    if placements.len() != mesh_shape.len() {
        return Err(Error::invalid(format!(
            "`placements` has {} entries but `mesh_shape` has {} dims; give one placement per mesh dim",
            placements.len(),
            mesh_shape.len()
        )));
    }
    if let Some(coordinate) = coordinate.filter(|c| c.len() != mesh_shape.len()) {
        return Err(Error::invalid(format!(
            "`coordinate` has {} entries but `mesh_shape` has {} dims; give one index per mesh dim",
            coordinate.len(),
            mesh_shape.len()
        )));
    }
    for (k, &size) in mesh_shape.iter().enumerate() {
        if size == 0 {
            return Err(Error::invalid(format!(
                "`mesh_shape[{k}]` is 0; every mesh dim must hold at least 1 rank (mesh_shape = {mesh_shape:?})"
            )));
        }
        if let Some(coordinate) = coordinate.filter(|c| c[k] >= size) {
            return Err(Error::invalid(format!(
                "`coordinate[{k}]` is {} but mesh dim {k} has {size} ranks; accepted: 0..{size} \
                 (coordinate = {coordinate:?}, mesh_shape = {mesh_shape:?})",
                coordinate[k]
            )));
        }
    }
    let ndim = global_shape.len();
    for (k, p) in placements.iter().enumerate() {
        if p.shard_dim().is_some_and(|dim| dim >= ndim) {
            return Err(Error::invalid(format!(
                "`placements[{k}]` is {p} but the tensor has {ndim} dims (global_shape = {global_shape:?}); \
                 accepted shard dims: 0..{ndim}"
            )));
        }
        if let Placement::StridedShard { split_factor: 0, .. } = p {
            return Err(Error::invalid(format!(
                "`placements[{k}]` is {p}: a _StridedShard split factor must be at least 1"
            )));
        }
    }
    Ok(())
}

fn numel(shape: &[u64], name: &str) -> Result<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::invalid(format!("`{name}` = {shape:?} has more than {} elements", u64::MAX)))
}

// --- per-dim index maps -------------------------------------------------------------------

/// A run of consecutive global indices along one tensor dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seg {
    start: u64,
    len: u64,
}

/// The global indices (along one tensor dim) of the local rows, in local order: sorted
/// segments, adjacent ones merged, no empty ones. Empty when the local size is 0.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DimMap {
    segs: Vec<Seg>,
}

impl DimMap {
    fn full(size: u64) -> DimMap {
        DimMap { segs: if size == 0 { Vec::new() } else { vec![Seg { start: 0, len: size }] } }
    }

    fn size(&self) -> u64 {
        self.segs.iter().map(|s| s.len).sum()
    }

    fn is_full(&self, size: u64) -> bool {
        *self == DimMap::full(size)
    }

    /// The local rows at positions `ranges` (increasing, non-overlapping) of this map.
    fn select(&self, ranges: &[(u64, u64)]) -> DimMap {
        let mut out: Vec<Seg> = Vec::new();
        let mut push = |seg: Seg| {
            if seg.len == 0 {
                return;
            }
            match out.last_mut() {
                Some(last) if last.start + last.len == seg.start => last.len += seg.len,
                _ => out.push(seg),
            }
        };
        for &(from, len) in ranges {
            // Walk the segments that overlap positions [from, from + len).
            let (mut pos, end) = (0u64, from + len);
            for seg in &self.segs {
                let (lo, hi) = (pos.max(from), (pos + seg.len).min(end));
                if lo < hi {
                    push(Seg { start: seg.start + (lo - pos), len: hi - lo });
                }
                pos += seg.len;
                if pos >= end {
                    break;
                }
            }
        }
        DimMap { segs: out }
    }

    fn indices(&self) -> impl Iterator<Item = u64> + '_ {
        self.segs.iter().flat_map(|s| s.start..s.start + s.len)
    }
}

/// Chunk `i` of `size` split into `n` chunks with `torch.chunk` semantics (`Shard`):
/// `(start, len)`, the trailing chunks shortened or empty.
fn chunk(size: u64, n: u64, i: u64) -> (u64, u64) {
    let c = size.div_ceil(n);
    let start = c.saturating_mul(i).min(size);
    let end = c.saturating_mul(i.saturating_add(1)).min(size);
    (start, end - start)
}

/// The positions (within the current local size `size`) that coordinate `i` of a mesh dim of
/// `n` ranks keeps under `placement` (a `Shard` or `_StridedShard`).
fn level_positions(size: u64, n: u64, i: u64, placement: &Placement) -> Vec<(u64, u64)> {
    match *placement {
        Placement::StridedShard { split_factor, .. } => (0..split_factor)
            .map(|j| {
                let (piece_start, piece_len) = chunk(size, split_factor, j);
                let (start, len) = chunk(piece_len, n, i);
                (piece_start + start, len)
            })
            .collect(),
        _ => vec![chunk(size, n, i)],
    }
}

/// The index maps of every tensor dim for one coordinate (arguments already validated).
fn dim_maps(
    global_shape: &[u64],
    mesh_shape: &[u64],
    coordinate: &[u64],
    placements: &[Placement],
) -> Vec<DimMap> {
    let mut maps: Vec<DimMap> = global_shape.iter().map(|&g| DimMap::full(g)).collect();
    for (k, p) in placements.iter().enumerate() {
        if let Some(d) = p.shard_dim() {
            let positions = level_positions(maps[d].size(), mesh_shape[k], coordinate[k], p);
            maps[d] = maps[d].select(&positions);
        }
    }
    maps
}

/// torch 2.15's `_compute_local_shape_and_global_offset(global_shape, mesh_shape,
/// my_coordinate, placements)`: the local shape of `coordinate`'s shard and the global index
/// of its first element. Uneven shards, empty shards (offset = the dim's global size),
/// several placements on one dim (nested, left to right) and `_StridedShard` (offset of the
/// first local row) behave as in torch. Errors (InvalidArgument) name the argument and index:
/// lengths that differ, a coordinate out of range, a shard dim >= ndim, a mesh dim of size 0,
/// a split factor of 0.
pub fn local_shape_and_offset(
    global_shape: &[u64],
    mesh_shape: &[u64],
    coordinate: &[u64],
    placements: &[Placement],
) -> Result<(Vec<u64>, Vec<u64>)> {
    validate(global_shape, mesh_shape, Some(coordinate), placements)?;
    let maps = dim_maps(global_shape, mesh_shape, coordinate, placements);
    let shape = maps.iter().map(DimMap::size).collect();
    // An empty map is an empty shard (torch reports the global size) or a dim of size 0.
    let offset =
        maps.iter().zip(global_shape).map(|(map, &g)| map.segs.first().map_or(g, |s| s.start)).collect();
    Ok((shape, offset))
}

/// The seed's `_copy_weights` slicing (docs/seed.md): for every `Shard`-like placement
/// in mesh-dim order (a `_StridedShard` counts as a plain `Shard`, its split factor ignored),
/// the current size `full` of its dim is cut into `ceil(full/n)` chunks and chunk `i` kept.
/// Returns the slice of every tensor dim, or None when some level is empty (`start >= full`),
/// where the seed copies nothing. Replicate and Partial keep the whole dim.
pub fn seed_copy_slices(
    global_shape: &[u64],
    mesh_shape: &[u64],
    coordinate: &[u64],
    placements: &[Placement],
) -> Result<Option<Vec<Range<u64>>>> {
    validate(global_shape, mesh_shape, Some(coordinate), placements)?;
    let mut slices: Vec<Range<u64>> = global_shape.iter().map(|&g| 0..g).collect();
    for (k, p) in placements.iter().enumerate() {
        if let Some(d) = p.shard_dim() {
            let full = slices[d].end - slices[d].start;
            let chunk = full.div_ceil(mesh_shape[k]);
            let start = chunk.saturating_mul(coordinate[k]);
            if start >= full {
                return Ok(None);
            }
            let end = start.saturating_add(chunk).min(full);
            let base = slices[d].start;
            slices[d] = base + start..base + end;
        }
    }
    Ok(Some(slices))
}

// --- copy plans ---------------------------------------------------------------------------

/// A contiguous run: `len` elements at `src` in the full tensor are `len` elements at `dst`
/// in the local tensor (element offsets, not bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Run {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// Which elements of the full (row-major, contiguous) tensor form one rank's local tensor:
/// maximal contiguous runs in local row-major order (`dst` increases from 0 to the local
/// numel without gaps).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CopyPlan {
    pub global_shape: Vec<u64>,
    pub local_shape: Vec<u64>,
    pub runs: Vec<Run>,
}

fn check_len(what: &str, got: usize, want: u64, unit: &str) -> Result<()> {
    if got as u64 != want {
        return Err(Error::invalid(format!("`{what}` holds {got} {unit} but the plan needs exactly {want}")));
    }
    Ok(())
}

impl CopyPlan {
    /// Elements of the local tensor.
    pub fn local_numel(&self) -> u64 {
        self.local_shape.iter().product()
    }

    /// Elements of the full tensor.
    pub fn global_numel(&self) -> u64 {
        self.global_shape.iter().product()
    }

    /// Copies this rank's elements of `full` into `local` (lengths must match the plan).
    pub fn apply<T: Copy>(&self, full: &[T], local: &mut [T]) -> Result<()> {
        check_len("full", full.len(), self.global_numel(), "elements")?;
        check_len("local", local.len(), self.local_numel(), "elements")?;
        for r in &self.runs {
            let (src, dst, len) = (r.src as usize, r.dst as usize, r.len as usize);
            local[dst..dst + len].copy_from_slice(&full[src..src + len]);
        }
        Ok(())
    }

    /// Copies `local` back to its place in `full` (the gather step for one rank); elements
    /// of `full` that this rank does not hold are left untouched.
    pub fn scatter_back<T: Copy>(&self, local: &[T], full: &mut [T]) -> Result<()> {
        check_len("local", local.len(), self.local_numel(), "elements")?;
        check_len("full", full.len(), self.global_numel(), "elements")?;
        for r in &self.runs {
            let (src, dst, len) = (r.src as usize, r.dst as usize, r.len as usize);
            full[src..src + len].copy_from_slice(&local[dst..dst + len]);
        }
        Ok(())
    }
}

fn push_run(runs: &mut Vec<Run>, src: u64, dst: u64, len: u64) {
    if let Some(last) = runs.last_mut().filter(|l| l.src + l.len == src && l.dst + l.len == dst) {
        last.len += len;
        return;
    }
    runs.push(Run { src, dst, len });
}

/// The runs of a local tensor whose dim `d` holds the global rows `maps[d]`.
fn runs_of(global_shape: &[u64], maps: &[DimMap]) -> Vec<Run> {
    let local_shape: Vec<u64> = maps.iter().map(DimMap::size).collect();
    if local_shape.contains(&0) {
        return Vec::new();
    }
    let ndim = global_shape.len();
    // The last dim that is not the whole dim: everything right of it is one contiguous block.
    let Some(p) = (0..ndim).rev().find(|&d| !maps[d].is_full(global_shape[d])) else {
        // Scalars (ndim 0) and unsharded tensors: one run (all sizes are non-zero here).
        return vec![Run { src: 0, dst: 0, len: local_shape.iter().product() }];
    };
    let inner: u64 = global_shape[p + 1..].iter().product();
    let mut strides = vec![1u64; ndim];
    for d in (0..ndim.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * global_shape[d + 1];
    }
    let outer: Vec<Vec<u64>> = maps[..p].iter().map(|m| m.indices().collect()).collect();
    let mut runs = Vec::new();
    let mut pos = vec![0usize; p];
    let mut dst = 0u64;
    loop {
        let base: u64 = (0..p).map(|d| outer[d][pos[d]] * strides[d]).sum();
        for seg in &maps[p].segs {
            let len = seg.len * inner;
            push_run(&mut runs, base + seg.start * strides[p], dst, len);
            dst += len;
        }
        // Odometer over the outer local indices, last dim fastest.
        let mut d = p;
        loop {
            if d == 0 {
                return runs;
            }
            d -= 1;
            pos[d] += 1;
            if pos[d] < outer[d].len() {
                break;
            }
            pos[d] = 0;
        }
    }
}

/// The copy plan of `coordinate`'s local tensor under torch's semantics (see
/// [`local_shape_and_offset`]), `_StridedShard` included: the global index of every local row
/// is computed level by level, then the rows are merged into maximal runs. A `Partial`
/// placement is rejected: a partial local tensor is a share of a value, not a selection of the
/// full tensor's elements.
pub fn copy_plan(
    global_shape: &[u64],
    mesh_shape: &[u64],
    coordinate: &[u64],
    placements: &[Placement],
) -> Result<CopyPlan> {
    validate(global_shape, mesh_shape, Some(coordinate), placements)?;
    reject_partial(placements, "copy_plan")?;
    numel(global_shape, "global_shape")?;
    let maps = dim_maps(global_shape, mesh_shape, coordinate, placements);
    Ok(CopyPlan {
        global_shape: global_shape.to_vec(),
        local_shape: maps.iter().map(DimMap::size).collect(),
        runs: runs_of(global_shape, &maps),
    })
}

fn reject_partial(placements: &[Placement], what: &str) -> Result<()> {
    if let Some(k) = placements.iter().position(|p| *p == Placement::Partial) {
        return Err(Error::invalid(format!(
            "`placements[{k}]` is Partial(): {what} moves elements of the full tensor, and a Partial \
             local tensor is not a selection of them; reduce it first (redistribute to Replicate)"
        )));
    }
    Ok(())
}

/// Copies the elements of `full` that `plan` selects into `local`, `elem_size` bytes per
/// element, one `memcpy` per run (a contiguous block is one run). The byte lengths must be
/// exactly the plan's numels times `elem_size`.
pub fn copy_runs_bytes(plan: &CopyPlan, elem_size: usize, full: &[u8], local: &mut [u8]) -> Result<()> {
    let (full_bytes, local_bytes) = plan_bytes(plan, elem_size)?;
    check_len("full", full.len(), full_bytes, "bytes")?;
    check_len("local", local.len(), local_bytes, "bytes")?;
    let e = elem_size as u64;
    for r in &plan.runs {
        let (src, dst, len) = ((r.src * e) as usize, (r.dst * e) as usize, (r.len * e) as usize);
        local[dst..dst + len].copy_from_slice(&full[src..src + len]);
    }
    Ok(())
}

/// The inverse of [`copy_runs_bytes`]: writes `local` back to its place in `full`.
pub fn scatter_runs_bytes(plan: &CopyPlan, elem_size: usize, local: &[u8], full: &mut [u8]) -> Result<()> {
    let (full_bytes, local_bytes) = plan_bytes(plan, elem_size)?;
    check_len("local", local.len(), local_bytes, "bytes")?;
    check_len("full", full.len(), full_bytes, "bytes")?;
    let e = elem_size as u64;
    for r in &plan.runs {
        let (src, dst, len) = ((r.src * e) as usize, (r.dst * e) as usize, (r.len * e) as usize);
        full[src..src + len].copy_from_slice(&local[dst..dst + len]);
    }
    Ok(())
}

fn plan_bytes(plan: &CopyPlan, elem_size: usize) -> Result<(u64, u64)> {
    if elem_size == 0 {
        return Err(Error::invalid(
            "`elem_size` is 0; give the size of one element in bytes (e.g. 2 for bf16)",
        ));
    }
    let e = elem_size as u64;
    let too_big =
        || Error::invalid(format!("the tensor has more than {} bytes at `elem_size` {elem_size}", u64::MAX));
    let full = plan.global_numel().checked_mul(e).ok_or_else(too_big)?;
    let local = plan.local_numel().checked_mul(e).ok_or_else(too_big)?;
    Ok((full, local))
}

// --- gather plans -------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
struct Source {
    coordinate: Vec<u64>,
    rank: usize,
    plan: CopyPlan,
}

/// How to assemble the full tensor from every rank's local tensor: the copy plan of each
/// source rank. Sources are the coordinates whose index on every `Replicate` mesh dim is 0
/// (replicas hold the same data), in row-major rank order over the mesh.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GatherPlan {
    global_shape: Vec<u64>,
    mesh_shape: Vec<u64>,
    placements: Vec<Placement>,
    world: usize,
    sources: Vec<Source>,
}

/// The gather plan of a tensor of `global_shape` placed by `placements` on a mesh of
/// `mesh_shape`. `Partial` is rejected: it must be reduced first.
pub fn gather_plan(global_shape: &[u64], mesh_shape: &[u64], placements: &[Placement]) -> Result<GatherPlan> {
    validate(global_shape, mesh_shape, None, placements)?;
    reject_partial(placements, "gather_plan")?;
    numel(global_shape, "global_shape")?;
    let world = usize::try_from(numel(mesh_shape, "mesh_shape")?)
        .map_err(|_| Error::invalid(format!("`mesh_shape` = {mesh_shape:?} has too many ranks")))?;
    let mut sources = Vec::new();
    let mut coordinate = vec![0u64; mesh_shape.len()];
    for rank in 0..world {
        if rank > 0 {
            // Row-major increment of the coordinate.
            for k in (0..mesh_shape.len()).rev() {
                coordinate[k] += 1;
                if coordinate[k] < mesh_shape[k] {
                    break;
                }
                coordinate[k] = 0;
            }
        }
        let replica = placements.iter().zip(&coordinate).any(|(p, &c)| *p == Placement::Replicate && c != 0);
        if !replica {
            let maps = dim_maps(global_shape, mesh_shape, &coordinate, placements);
            let plan = CopyPlan {
                global_shape: global_shape.to_vec(),
                local_shape: maps.iter().map(DimMap::size).collect(),
                runs: runs_of(global_shape, &maps),
            };
            sources.push(Source { coordinate: coordinate.clone(), rank, plan });
        }
    }
    Ok(GatherPlan {
        global_shape: global_shape.to_vec(),
        mesh_shape: mesh_shape.to_vec(),
        placements: placements.to_vec(),
        world,
        sources,
    })
}

impl GatherPlan {
    /// The source coordinates (row-major rank order) and their copy plans.
    pub fn sources(&self) -> impl Iterator<Item = (Vec<u64>, &CopyPlan)> {
        self.sources.iter().map(|s| (s.coordinate.clone(), &s.plan))
    }

    /// The number of ranks of the mesh (the length `gather` expects of `locals`).
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The global shape the plan assembles.
    pub fn global_shape(&self) -> &[u64] {
        &self.global_shape
    }

    /// Assembles `full` from `locals`, the local tensor of every rank of the mesh in
    /// row-major rank order (`locals.len()` is the mesh size). Only the sources' locals are
    /// read (replicas along `Replicate` dims are not); their lengths must match their plans.
    pub fn gather<T: Copy>(&self, locals: &[&[T]], full: &mut [T]) -> Result<()> {
        if locals.len() != self.world {
            return Err(Error::invalid(format!(
                "`locals` has {} tensors but the mesh {:?} has {} ranks; give every rank's local tensor \
                 in row-major rank order",
                locals.len(),
                self.mesh_shape,
                self.world
            )));
        }
        check_len("full", full.len(), numel(&self.global_shape, "global_shape")?, "elements")?;
        for s in &self.sources {
            s.plan.scatter_back(locals[s.rank], full).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("`locals[{}]` (coordinate {:?}): {}", s.rank, s.coordinate, e.message),
                )
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_composes_segments() {
        let m = DimMap { segs: vec![Seg { start: 0, len: 3 }, Seg { start: 5, len: 3 }] };
        // positions 2..5 → global 2, 5, 6
        assert_eq!(m.select(&[(2, 3)]).segs, vec![Seg { start: 2, len: 1 }, Seg { start: 5, len: 2 }]);
        // adjacent selections merge
        assert_eq!(m.select(&[(0, 1), (1, 1)]).segs, vec![Seg { start: 0, len: 2 }]);
        assert_eq!(m.select(&[(6, 0)]).segs, vec![]);
    }

    #[test]
    fn chunk_is_torch_chunk() {
        // torch.chunk(arange(10), 4) -> 3,3,3,1 ; arange(6) over 4 -> 2,2,2 + one empty
        let sizes: Vec<u64> = (0..4).map(|i| chunk(10, 4, i).1).collect();
        assert_eq!(sizes, [3, 3, 3, 1]);
        assert_eq!((0..4).map(|i| chunk(6, 4, i)).collect::<Vec<_>>(), [(0, 2), (2, 2), (4, 2), (6, 0)]);
        assert_eq!(chunk(0, 3, 2), (0, 0));
    }
}
