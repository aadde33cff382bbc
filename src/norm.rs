//! Placement-aware gradient-norm math and the host p-norm kernels (docs/design.md §4.2).
//!
//! The algorithm, with the collectives abstracted away:
//!
//! 1. Every gradient is described by its [`GradLayout`]: the (global mesh-dim id, role) of each
//!    dim of its DTensor mesh. Its **reduction set** ([`reduction_set`]) is the sorted set of the
//!    dims on which it is `Shard`ed: its local p-power sum is summed over those dims and counted
//!    once across `Replicate` dims (and across dims that are not in its mesh at all). A `Partial`
//!    gradient holds a partial *sum* of the true gradient, whose p-power sum is not additive,
//!    so it must be reduced (torch: `.redistribute(Replicate)`) before it reaches this module.
//! 2. [`norm_plan`] groups the gradients by distinct reduction set, in first-seen order, over the
//!    parameter list that every rank shares, so every rank issues the same collectives in the
//!    same order whether or not it holds any gradient (the seed returns early and can deadlock).
//! 3. [`local_power_sum`] computes Σ|x|^p (or max |x| for p = inf) of each set's local
//!    gradients; the caller reduces each set's scalar (SUM, or MAX for p = inf) over the set's
//!    mesh dims; [`combine`] sums (or maxes) the per-set values and takes the p-th root.
//! 4. One coefficient, [`clip_coefficient`] = `min(max_norm / (norm + 1e-6), 1)`, scales every
//!    local gradient in place ([`scale_in_place`]) when it is below 1.
//!
//! Deliberate differences from the seed's grad norm (docs/seed.md):
//! - replicas are counted once (the seed reduces every set over every group, so a gradient that
//!   is replicated over cp, or over ep for router/shared-expert weights, is over-counted);
//! - p = inf is the max of |x| (the seed returns 1.0 for every input); p = 0, negative and NaN
//!   are errors (the seed raises ZeroDivisionError for 0);
//! - a non-finite total norm (nan or inf) leaves the gradients untouched and is returned (or is
//!   an error with `error_if_nonfinite`); the seed multiplies by 0 for an inf norm, which turns
//!   inf entries into nan. (For nan it does not scale, and neither do we.)
//!
//! The kernels (p-power sums, scaling) are in [`crate::host::pnorm`].

use crate::error::{Error, Result};
use crate::host::pnorm::{nan_max, power_sum, scale_in_place};
use crate::host::{HostBuf, HostBufMut};

/// The order of the norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormType {
    /// A p-norm with a finite p > 0 (construct it with [`NormType::new`], which checks).
    P(f64),
    /// The max norm, max |x|.
    Inf,
}

impl NormType {
    /// `p` as a norm order: finite p > 0 is a p-norm, +inf the max norm; 0, negative values,
    /// -inf and NaN are errors.
    pub fn new(p: f64) -> Result<NormType> {
        if p == f64::INFINITY {
            return Ok(NormType::Inf);
        }
        if p.is_finite() && p > 0.0 {
            return Ok(NormType::P(p));
        }
        let why = if p == 0.0 {
            " (p = 0 counts non-zero entries, which is not a norm that can be clipped)"
        } else {
            ""
        };
        Err(Error::invalid(format!(
            "norm_type must be a finite p > 0 (a p-norm, e.g. 2.0) or +inf (the max norm), got {p:?}{why}"
        )))
    }

    /// The order as a number (+inf for the max norm).
    pub fn p(self) -> f64 {
        match self {
            NormType::P(p) => p,
            NormType::Inf => f64::INFINITY,
        }
    }

    /// Whether the per-set values are reduced with MAX (p = inf) rather than SUM.
    pub fn is_max(self) -> bool {
        matches!(self, NormType::Inf)
    }

    /// Re-checks a value that may have been built as `NormType::P(..)` directly.
    fn checked(self) -> Result<NormType> {
        NormType::new(self.p())
    }
}

/// The placement of a gradient on one dim of its DTensor mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DimRole {
    /// `Shard(k)` (including `_StridedShard`): every rank of the dim holds a disjoint piece.
    Shard,
    /// `Replicate()`: every rank of the dim holds the same values.
    Replicate,
    /// `Partial()`: every rank holds a partial sum of the values.
    Partial,
}

/// How one gradient is laid out: (global mesh-dim id, role) for each dim of its DTensor mesh.
/// Mesh-dim ids are small integers chosen by the caller (the Python/C++ layer maps them to
/// process groups); the dims of one layout must name orthogonal groups, as the dims of one
/// DTensor mesh do. A plain tensor has no dims: it is replicated everywhere, and its local sum
/// is already the full sum.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GradLayout {
    pub dims: Vec<(u32, DimRole)>,
}

impl GradLayout {
    /// A plain (non-DTensor) gradient.
    pub fn plain() -> GradLayout {
        GradLayout { dims: Vec::new() }
    }

    pub fn new(dims: &[(u32, DimRole)]) -> GradLayout {
        GradLayout { dims: dims.to_vec() }
    }
}

/// Whether the gradient has a `Partial` dim and must be reduced (torch:
/// `grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in ...])`) before
/// its norm can be taken.
pub fn needs_partial_reduction(layout: &GradLayout) -> bool {
    layout.dims.iter().any(|&(_, role)| role == DimRole::Partial)
}

/// The reduction set of a gradient: the sorted mesh-dim ids its local p-power sum must be
/// reduced over (its `Shard` dims; `Replicate` dims are counted once, i.e. not reduced).
/// A `Partial` dim is an error (see [`needs_partial_reduction`]), and so is a mesh-dim id that
/// appears twice in one layout.
pub fn reduction_set(layout: &GradLayout) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = layout.dims.iter().map(|&(id, _)| id).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(format!(
            "mesh dim {} appears twice in the gradient layout {:?}; each dim of a DTensor mesh \
             must map to a distinct mesh-dim id",
            w[0], layout.dims
        )));
    }
    if let Some(&(id, _)) = layout.dims.iter().find(|&&(_, role)| role == DimRole::Partial) {
        return Err(Error::invalid(format!(
            "the gradient is Partial on mesh dim {id}: its local tensor is a partial sum of the \
             true gradient, so its p-power sum cannot be reduced; reduce it first (torch: \
             grad.redistribute(placements with Replicate() for Partial())); accepted roles here \
             are Shard and Replicate"
        )));
    }
    let mut set: Vec<u32> =
        layout.dims.iter().filter(|&&(_, role)| role == DimRole::Shard).map(|&(id, _)| id).collect();
    set.sort_unstable();
    Ok(set)
}

/// The gradients grouped by distinct reduction set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormPlan {
    /// The distinct reduction sets, in first-seen order. The empty set (plain and fully
    /// replicated gradients) needs no collective.
    pub sets: Vec<Vec<u32>>,
    /// Per gradient: its index into `sets`.
    pub grad_set: Vec<usize>,
}

/// Groups gradients by distinct reduction set, in first-seen order, so the caller issues one
/// scalar collective per set. Pass the layouts of every parameter known globally (all ranks
/// have the same parameter list), including those this rank holds no gradient for, so that
/// every rank builds the same plan and issues the same collectives in the same order.
pub fn norm_plan(layouts: &[GradLayout]) -> Result<NormPlan> {
    let mut sets: Vec<Vec<u32>> = Vec::new();
    let mut grad_set = Vec::with_capacity(layouts.len());
    for (i, layout) in layouts.iter().enumerate() {
        let set =
            reduction_set(layout).map_err(|e| Error::new(e.kind, format!("gradient {i}: {}", e.message)))?;
        let index = match sets.iter().position(|s| *s == set) {
            Some(index) => index,
            None => {
                sets.push(set);
                sets.len() - 1
            }
        };
        grad_set.push(index);
    }
    Ok(NormPlan { sets, grad_set })
}

// ---------------------------------------------------------------------------------------------
// Local values and the total.

/// The local value of one reduction set: Σ|x|^p over all elements of all buffers, or max |x|
/// for p = inf (any NaN gives NaN; no elements give 0). `accumulate_f64` chooses f64
/// accumulators (the default for p-sums; f64 buffers always use f64); with f32 accumulators the
/// per-block sums are still combined in f64. Large inputs use all available cores; the result
/// does not depend on the number of threads nor on the instruction set
/// ([`crate::host::pnorm::power_sum`], which is also the only source of an error: a bad
/// `FSDPTURBO_HOST_ISA`).
pub fn local_power_sum(bufs: &[HostBuf], norm: NormType, accumulate_f64: bool) -> Result<f64> {
    power_sum(bufs, norm.p(), accumulate_f64, None)
}

/// [`local_power_sum`] on at most `threads` threads (0 and 1 both mean the calling thread
/// alone). The result is bit-for-bit the same for every `threads`.
pub fn local_power_sum_threads(
    bufs: &[HostBuf],
    norm: NormType,
    accumulate_f64: bool,
    threads: usize,
) -> Result<f64> {
    power_sum(bufs, norm.p(), accumulate_f64, Some(threads))
}

/// The total norm from the reduced per-set values: their sum (or max for p = inf, NaN
/// propagating) in order, then the p-th root (p = 1: as is; p = 2: `sqrt`; else `powf(1/p)`).
pub fn combine(partials: &[f64], norm: NormType) -> f64 {
    match norm {
        NormType::Inf => partials.iter().copied().fold(0.0, nan_max),
        NormType::P(p) => {
            let sum = partials.iter().fold(0.0, |acc, &v| acc + v);
            if p == 1.0 {
                sum
            } else if p == 2.0 {
                sum.sqrt()
            } else {
                sum.powf(1.0 / p)
            }
        }
    }
}

/// `min(max_norm / (total_norm + 1e-6), 1.0)`, as the seed and torch compute it. A NaN ratio
/// (NaN norm, or inf / inf) gives 1.0, i.e. no scaling, like the seed's Python `min`; an
/// infinite norm with a finite `max_norm` gives 0.0.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    let coef = max_norm / (total_norm + 1e-6);
    if coef.is_nan() { 1.0 } else { coef.min(1.0) }
}

// ---------------------------------------------------------------------------------------------
// The whole algorithm.

/// Options of [`clip_grad_norm_with`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipOptions {
    pub norm: NormType,
    /// The largest total norm left unscaled; must be ≥ 0 (inf: never scale).
    pub max_norm: f64,
    /// Return an error (gradients untouched) rather than the value when the total is nan/inf.
    pub error_if_nonfinite: bool,
    /// Accumulate the p-power sums of f32/f16/bf16 gradients in f64 (default) or f32.
    pub accumulate_f64: bool,
}

impl Default for ClipOptions {
    fn default() -> ClipOptions {
        ClipOptions { norm: NormType::P(2.0), max_norm: 1.0, error_if_nonfinite: false, accumulate_f64: true }
    }
}

/// The error for a non-finite total norm; its prefix is torch's `clip_grad_norm_` text.
pub(crate) fn nonfinite_error(norm: NormType, total: f64) -> Error {
    Error::invalid(format!(
        "The total norm of order {:?} for gradients from `parameters` is non-finite ({total:?}), so it \
         cannot be clipped; the gradients were left unchanged. To get the value back instead of this \
         error, set `error_if_nonfinite=False`",
        norm.p()
    ))
}

/// [`clip_grad_norm_with`] with f64 accumulation.
pub fn clip_grad_norm(
    plan: &NormPlan,
    grads: &mut [(usize, HostBufMut)],
    norm: NormType,
    max_norm: f64,
    error_if_nonfinite: bool,
    reduce: &mut dyn FnMut(usize, f64, bool) -> Result<f64>,
) -> Result<f64> {
    let options = ClipOptions { norm, max_norm, error_if_nonfinite, accumulate_f64: true };
    clip_grad_norm_with(plan, grads, &options, reduce)
}

/// Computes the total norm of the gradients described by `plan` and clips them in place.
///
/// `grads` holds this rank's local gradients as (index into `plan.grad_set`, buffer); a
/// gradient this rank does not hold is simply absent. `reduce(set_index, value, is_max)` must
/// reduce `value` (SUM, or MAX when `is_max`) over the mesh dims `plan.sets[set_index]` and
/// return the result; it is called once per set with a non-empty set of dims, in set order, on
/// every rank, also when the rank holds no gradient of that set (value 0). The empty set needs
/// no collective and is not passed to `reduce`.
///
/// Then the total norm is [`combine`]d, and when it is finite the gradients are multiplied by
/// [`clip_coefficient`] if that is below 1. A non-finite total (nan or inf) leaves the
/// gradients untouched (the seed multiplies by 0 for inf, turning inf entries into nan) and is
/// returned, or is an error when `error_if_nonfinite`. Bad arguments and `reduce` errors are
/// reported before any gradient is modified.
pub fn clip_grad_norm_with(
    plan: &NormPlan,
    grads: &mut [(usize, HostBufMut)],
    options: &ClipOptions,
    reduce: &mut dyn FnMut(usize, f64, bool) -> Result<f64>,
) -> Result<f64> {
    let norm = options.norm.checked()?;
    if options.max_norm.is_nan() || options.max_norm < 0.0 {
        return Err(Error::invalid(format!(
            "max_norm must be a number >= 0 (inf disables clipping), got {:?}",
            options.max_norm
        )));
    }
    if let Some((i, &s)) = plan.grad_set.iter().enumerate().find(|&(_, &s)| s >= plan.sets.len()) {
        return Err(Error::invalid(format!(
            "invalid NormPlan: gradient {i} refers to set {s}, but the plan has {} sets",
            plan.sets.len()
        )));
    }
    let mut seen = vec![false; plan.grad_set.len()];
    let mut per_set: Vec<Vec<HostBuf>> = vec![Vec::new(); plan.sets.len()];
    for (k, (index, buf)) in grads.iter().enumerate() {
        let index = *index;
        if index >= plan.grad_set.len() {
            return Err(Error::invalid(format!(
                "grads[{k}] refers to gradient {index}, but the plan describes {} gradients",
                plan.grad_set.len()
            )));
        }
        if std::mem::replace(&mut seen[index], true) {
            return Err(Error::invalid(format!(
                "grads[{k}] refers to gradient {index}, which an earlier entry already gave"
            )));
        }
        per_set[plan.grad_set[index]].push(buf.as_buf());
    }

    let mut values = Vec::with_capacity(plan.sets.len());
    for (set, bufs) in plan.sets.iter().zip(&per_set) {
        let local = local_power_sum(bufs, norm, options.accumulate_f64)?;
        values.push((set, local));
    }
    drop(per_set);
    let mut reduced = Vec::with_capacity(values.len());
    for (index, (set, local)) in values.into_iter().enumerate() {
        reduced.push(if set.is_empty() { local } else { reduce(index, local, norm.is_max())? });
    }

    let total = combine(&reduced, norm);
    if !total.is_finite() {
        return if options.error_if_nonfinite { Err(nonfinite_error(norm, total)) } else { Ok(total) };
    }
    let coef = clip_coefficient(total, options.max_norm);
    if coef < 1.0 {
        let mut bufs: Vec<HostBufMut> = grads.iter_mut().map(|(_, buf)| buf.reborrow()).collect();
        scale_in_place(&mut bufs, coef)?;
    }
    Ok(total)
}
