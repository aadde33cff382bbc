//! Gradient norm (src/norm.rs, src/ffi/norm.rs): reduction sets and plans, a simulated
//! multi-rank clip with real in-process collectives checked against the norm of the full
//! gradients, special values, element conversions and kernels, and the C ABI.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use fsdpturbo::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use fsdpturbo::error::{Error, Result};
use fsdpturbo::ffi::dtype::*;
use fsdpturbo::ffi::norm::*;
use fsdpturbo::ffi::status::*;
use fsdpturbo::host::pnorm::{scale_in_place, scale_in_place_threads};
use fsdpturbo::host::{HostBuf, HostBufMut};
use fsdpturbo::norm::*;

mod common;
use common::{Rng, last_error};

// ---------------------------------------------------------------------------------------------
// Helpers.

fn rel(a: f64, b: f64) -> f64 {
    if a == b { 0.0 } else { (a - b).abs() / a.abs().max(b.abs()) }
}

/// Σ|x|^p (or max |x|) and the root, sequentially in f64: the oracle.
fn direct_norm<'a>(values: impl IntoIterator<Item = &'a f64>, norm: NormType) -> f64 {
    match norm {
        NormType::Inf => values
            .into_iter()
            .fold(0.0, |m: f64, &x| if x.is_nan() || m.is_nan() { f64::NAN } else { m.max(x.abs()) }),
        NormType::P(p) => {
            let s: f64 = values.into_iter().map(|x| x.abs().powf(p)).sum();
            s.powf(1.0 / p)
        }
    }
}

const ALL_NORMS: [NormType; 4] = [NormType::P(1.0), NormType::P(2.0), NormType::P(3.5), NormType::Inf];

fn no_reduce() -> impl FnMut(usize, f64, bool) -> Result<f64> {
    |set, _, _| panic!("reduce called for set {set}, but no set needs a collective")
}

// ---------------------------------------------------------------------------------------------
// Reduction sets and plans.

#[test]
fn shard_dims_reduce_sorted_and_replicate_dims_do_not() {
    use DimRole::*;
    assert_eq!(reduction_set(&GradLayout::new(&[(3, Shard), (1, Shard)])).unwrap(), vec![1, 3]);
    assert_eq!(reduction_set(&GradLayout::new(&[(0, Replicate), (2, Shard)])).unwrap(), vec![2]);
    assert_eq!(
        reduction_set(&GradLayout::new(&[(0, Replicate), (1, Replicate)])).unwrap(),
        Vec::<u32>::new()
    );
    assert_eq!(reduction_set(&GradLayout::plain()).unwrap(), Vec::<u32>::new());
}

#[test]
fn partial_is_rejected_and_flagged() {
    use DimRole::*;
    let partial = GradLayout::new(&[(0, Shard), (4, Partial)]);
    assert!(needs_partial_reduction(&partial));
    assert!(!needs_partial_reduction(&GradLayout::new(&[(0, Shard), (4, Replicate)])));
    assert!(!needs_partial_reduction(&GradLayout::plain()));
    let err = reduction_set(&partial).unwrap_err();
    assert!(err.message.contains("Partial on mesh dim 4"), "{}", err.message);
    assert!(err.message.contains("redistribute"), "{}", err.message);
    let err = norm_plan(&[GradLayout::plain(), partial]).unwrap_err();
    assert!(err.message.starts_with("gradient 1: "), "{}", err.message);
}

#[test]
fn a_mesh_dim_twice_in_one_layout_is_rejected() {
    use DimRole::*;
    let err = reduction_set(&GradLayout::new(&[(2, Shard), (2, Replicate)])).unwrap_err();
    assert!(err.message.contains("mesh dim 2 appears twice"), "{}", err.message);
}

#[test]
fn plans_batch_identical_sets_in_first_seen_order() {
    use DimRole::*;
    let layouts = vec![
        GradLayout::new(&[(3, Shard)]),
        GradLayout::new(&[(0, Shard), (1, Shard)]),
        GradLayout::plain(),
        GradLayout::new(&[(1, Shard), (0, Shard)]), // same set as gradient 1
        GradLayout::new(&[(2, Replicate), (3, Shard)]), // same set as gradient 0
        GradLayout::new(&[(1, Replicate)]),         // same (empty) set as the plain one
    ];
    let plan = norm_plan(&layouts).unwrap();
    assert_eq!(plan.sets, vec![vec![3], vec![0, 1], vec![]]);
    assert_eq!(plan.grad_set, vec![0, 1, 2, 1, 0, 2]);
    // The plan depends on the layouts alone (not on what a rank holds), so every rank that
    // passes the shared parameter list gets the same collectives in the same order.
    assert_eq!(norm_plan(&layouts).unwrap(), plan);
    let reordered: Vec<GradLayout> = [2, 1, 0].iter().map(|&i| layouts[i].clone()).collect();
    assert_eq!(norm_plan(&reordered).unwrap().sets, vec![vec![], vec![0, 1], vec![3]]);
    assert_eq!(norm_plan(&[]).unwrap(), NormPlan { sets: vec![], grad_set: vec![] });
}

// ---------------------------------------------------------------------------------------------
// A simulated mesh of 8 ranks, run as threads with real in-process collectives.
//
// Axes (row-major, like torch init_device_mesh): efsdp (2) × ep (2) × cp (2). Mesh-dim ids:
// EFSDP, EP and CP are single axes; DP is the flattened (efsdp, ep) pair (size 4).

const EFSDP: u32 = 0;
const EP: u32 = 1;
const CP: u32 = 2;
const DP: u32 = 3;
const WORLD: usize = 8;

fn coords(rank: usize) -> [usize; 3] {
    [rank / 4, (rank / 2) % 2, rank % 2]
}

fn dim_axes(dim: u32) -> &'static [usize] {
    match dim {
        EFSDP => &[0],
        EP => &[1],
        CP => &[2],
        DP => &[0, 1],
        _ => panic!("unknown mesh dim {dim}"),
    }
}

/// (coordinate, size) of `rank` along mesh dim `dim`.
fn dim_coord(rank: usize, dim: u32) -> (usize, usize) {
    let c = coords(rank);
    dim_axes(dim).iter().fold((0, 1), |(i, n), &axis| (i * 2 + c[axis], n * 2))
}

/// The ranks of the group spanned by `dims` that contains `rank`, in rank order.
fn group(rank: usize, dims: &[u32]) -> Vec<usize> {
    let spanned: Vec<usize> = dims.iter().flat_map(|&d| dim_axes(d).iter().copied()).collect();
    let mine = coords(rank);
    (0..WORLD)
        .filter(|&r| (0..3).all(|axis| spanned.contains(&axis) || coords(r)[axis] == mine[axis]))
        .collect()
}

#[derive(Default)]
struct Slot {
    values: Vec<Option<f64>>,
    result: Option<f64>,
}

/// All-reduce across threads: calls are matched per group in call order, like a communicator;
/// a rank that never joins makes the others fail after a deadline instead of hanging.
#[derive(Default)]
struct Comm {
    slots: Mutex<HashMap<(Vec<usize>, u64), Slot>>,
    ready: Condvar,
}

impl Comm {
    fn all_reduce(
        &self,
        rank: usize,
        seq: &mut HashMap<Vec<usize>, u64>,
        dims: &[u32],
        value: f64,
        is_max: bool,
    ) -> Result<f64> {
        let members = group(rank, dims);
        let n = seq.entry(members.clone()).or_insert(0);
        let key = (members.clone(), *n);
        *n += 1;
        let pos = members.iter().position(|&r| r == rank).unwrap();
        let mut slots = self.slots.lock().unwrap();
        let slot = slots.entry(key.clone()).or_default();
        slot.values.resize(members.len(), None);
        slot.values[pos] = Some(value);
        if slot.values.iter().all(Option::is_some) {
            let vals = slot.values.iter().map(|v| v.unwrap());
            slot.result = Some(if is_max {
                vals.fold(0.0, |m: f64, v| if m.is_nan() || v.is_nan() { f64::NAN } else { m.max(v) })
            } else {
                vals.sum()
            });
            self.ready.notify_all();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(result) = slots[&key].result {
                return Ok(result);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::invalid(format!("rank {rank}: collective over {members:?} timed out")));
            }
            slots = self.ready.wait_timeout(slots, left).unwrap().0;
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Place {
    Shard(usize),
    Rep,
}

/// A gradient of the simulated model: its full 2-D value and its placement per mesh dim.
struct Grad {
    rows: usize,
    cols: usize,
    full: Vec<f64>,
    mesh: Vec<(u32, Place)>,
}

impl Grad {
    fn new(rng: &mut Rng, rows: usize, cols: usize, mesh: &[(u32, Place)], bf16: bool) -> Grad {
        let full = (0..rows * cols)
            .map(|_| {
                let x = rng.unit() * 3.0;
                if bf16 { bf16_to_f32(f32_to_bf16(x as f32)) as f64 } else { x }
            })
            .collect();
        Grad { rows, cols, full, mesh: mesh.to_vec() }
    }

    fn layout(&self) -> GradLayout {
        GradLayout {
            dims: self
                .mesh
                .iter()
                .map(|&(d, p)| (d, if let Place::Shard(_) = p { DimRole::Shard } else { DimRole::Replicate }))
                .collect(),
        }
    }

    /// The (row range, col range) `rank` holds: each Shard(k) splits the current local range
    /// along tensor dim k into chunks of ceil(len / n), like torch (trailing shards may be empty).
    fn region(&self, rank: usize) -> [(usize, usize); 2] {
        let mut r = [(0, self.rows), (0, self.cols)];
        for &(dim, place) in &self.mesh {
            if let Place::Shard(k) = place {
                let (i, n) = dim_coord(rank, dim);
                let (lo, hi) = r[k];
                let chunk = (hi - lo).div_ceil(n);
                r[k] = (lo + (i * chunk).min(hi - lo), lo + ((i + 1) * chunk).min(hi - lo));
            }
        }
        r
    }

    fn local(&self, rank: usize) -> Vec<f64> {
        let [(r0, r1), (c0, c1)] = self.region(rank);
        (r0..r1).flat_map(|r| (c0..c1).map(move |c| self.full[r * self.cols + c])).collect()
    }
}

/// The model: an expert weight (efsdp × ep), a router weight (efsdp, replicated over ep), a
/// dense weight sharded over dp with an empty shard, a weight explicitly replicated over cp,
/// a plain tensor, and a second efsdp-sharded weight (same set as the router).
fn model(seed: u64, bf16: bool) -> Vec<Grad> {
    let mut rng = Rng(seed);
    vec![
        Grad::new(&mut rng, 4, 6, &[(EFSDP, Place::Shard(1)), (EP, Place::Shard(0))], bf16),
        Grad::new(&mut rng, 3, 4, &[(EFSDP, Place::Shard(0)), (EP, Place::Rep)], bf16),
        Grad::new(&mut rng, 3, 3, &[(DP, Place::Shard(0))], bf16),
        Grad::new(&mut rng, 4, 2, &[(CP, Place::Rep), (DP, Place::Shard(0))], bf16),
        Grad::new(&mut rng, 2, 3, &[], bf16),
        Grad::new(&mut rng, 5, 2, &[(EP, Place::Rep), (EFSDP, Place::Shard(0))], bf16),
    ]
}

#[derive(Clone, Copy, PartialEq)]
enum Dt {
    F64,
    Bf16,
}

struct RankResult {
    total: f64,
    /// Local pieces after clipping, as f64, per gradient of the model.
    pieces: Vec<Vec<f64>>,
    /// (set index, dims, is_max) of every reduce call, in order.
    calls: Vec<(usize, Vec<u32>, bool)>,
}

/// Runs clip_grad_norm on every rank. `holds(rank, grad)` says whether a rank passes a
/// gradient at all (a rank without it passes nothing, which must still be correct when its
/// local piece is empty). Ranks are threads; the collectives really sum across them.
fn run_ranks(
    model: &[Grad],
    plan: &NormPlan,
    options: ClipOptions,
    dt: Dt,
    holds: &(dyn Fn(usize, usize) -> bool + Sync),
) -> Vec<RankResult> {
    let comm = Comm::default();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..WORLD)
            .map(|rank| {
                let comm = &comm;
                scope.spawn(move || {
                    let locals: Vec<Vec<f64>> = model.iter().map(|g| g.local(rank)).collect();
                    let mut f64s = locals.clone();
                    let mut bf16s: Vec<Vec<u16>> =
                        locals.iter().map(|l| l.iter().map(|&x| f32_to_bf16(x as f32)).collect()).collect();
                    let mut grads: Vec<(usize, HostBufMut)> = Vec::new();
                    for (i, (a, b)) in f64s.iter_mut().zip(bf16s.iter_mut()).enumerate() {
                        if holds(rank, i) {
                            grads.push((
                                i,
                                if dt == Dt::F64 { HostBufMut::F64(a) } else { HostBufMut::Bf16(b) },
                            ));
                        }
                    }
                    let mut seq = HashMap::new();
                    let mut calls = Vec::new();
                    let mut reduce = |set: usize, value: f64, is_max: bool| {
                        calls.push((set, plan.sets[set].clone(), is_max));
                        comm.all_reduce(rank, &mut seq, &plan.sets[set], value, is_max)
                    };
                    let total = clip_grad_norm_with(plan, &mut grads, &options, &mut reduce).unwrap();
                    drop(grads);
                    let pieces = match dt {
                        Dt::F64 => f64s,
                        Dt::Bf16 => {
                            bf16s.iter().map(|l| l.iter().map(|&b| bf16_to_f32(b) as f64).collect()).collect()
                        }
                    };
                    RankResult { total, pieces, calls }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn all_values(model: &[Grad]) -> impl Iterator<Item = &f64> {
    model.iter().flat_map(|g| g.full.iter())
}

#[test]
fn multi_rank_total_equals_the_norm_of_the_full_gradients_and_clips_all_ranks() {
    let model = model(7, false);
    let layouts: Vec<GradLayout> = model.iter().map(Grad::layout).collect();
    let plan = norm_plan(&layouts).unwrap();
    assert_eq!(plan.sets, vec![vec![EFSDP, EP], vec![EFSDP], vec![DP], vec![]]);
    assert_eq!(plan.grad_set, vec![0, 1, 2, 2, 3, 1]);
    // The dense weight has 3 rows over 4 dp ranks: dp coordinate 3 holds an empty shard.
    assert!(model[2].local(7).is_empty() && !model[2].local(0).is_empty());

    for norm in ALL_NORMS {
        let want = direct_norm(all_values(&model), norm);
        let max_norm = want / 2.0;
        let options = ClipOptions { norm, max_norm, ..ClipOptions::default() };
        let results = run_ranks(&model, &plan, options, Dt::F64, &|_, _| true);
        let coef = max_norm / (want + 1e-6);
        for (rank, r) in results.iter().enumerate() {
            assert!(rel(r.total, want) <= 1e-12, "{norm:?} rank {rank}: {} vs {want}", r.total);
            // Every rank computes the same total bit for bit, hence the same coefficient.
            assert_eq!(r.total.to_bits(), results[0].total.to_bits(), "{norm:?} rank {rank}");
            // One reduce per set with dims, in set order, with the right op; none for the empty set.
            let expected: Vec<(usize, Vec<u32>, bool)> =
                (0..3).map(|s| (s, plan.sets[s].clone(), norm == NormType::Inf)).collect();
            assert_eq!(r.calls, expected, "rank {rank}");
            for (g, piece) in model.iter().zip(&r.pieces) {
                for (got, orig) in piece.iter().zip(g.local(rank)) {
                    assert!(
                        rel(*got, orig * coef) <= 1e-12,
                        "{norm:?} rank {rank}: {got} vs {}",
                        orig * coef
                    );
                }
            }
        }
    }
}

#[test]
fn multi_rank_bf16_gradients_with_f32_and_f64_accumulation() {
    let model = model(11, true);
    let plan = norm_plan(&model.iter().map(Grad::layout).collect::<Vec<_>>()).unwrap();
    for norm in ALL_NORMS {
        let want = direct_norm(all_values(&model), norm);
        for accumulate_f64 in [true, false] {
            let options =
                ClipOptions { norm, max_norm: want / 3.0, accumulate_f64, ..ClipOptions::default() };
            let results = run_ranks(&model, &plan, options, Dt::Bf16, &|_, _| true);
            let tol = if accumulate_f64 { 1e-12 } else { 1e-6 };
            let coef = want / 3.0 / (want + 1e-6);
            for (rank, r) in results.iter().enumerate() {
                assert!(rel(r.total, want) <= tol, "{norm:?} f64={accumulate_f64}: {} vs {want}", r.total);
                for (g, piece) in model.iter().zip(&r.pieces) {
                    for (got, orig) in piece.iter().zip(g.local(rank)) {
                        // One bf16 rounding of the scaled value.
                        assert!(
                            (got - orig * coef).abs() <= (orig * coef).abs() * 2f64.powi(-8) * 1.01,
                            "{got} vs {orig}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_seeds_reduce_everything_over_all_dims_over_counts_replicas() {
    // The seed's grad norm: Σ of all local p-sums, all-reduced over every group, so replicas
    // count once per copy (where we differ: docs/seed.md, "Grad norm"): here one set spanning
    // the whole world, for every gradient.
    let model = model(3, false);
    let seed_plan = NormPlan { sets: vec![vec![EFSDP, EP, CP]], grad_set: vec![0; model.len()] };
    let plan = norm_plan(&model.iter().map(Grad::layout).collect::<Vec<_>>()).unwrap();
    let norm = NormType::P(2.0);
    let options = ClipOptions { max_norm: f64::INFINITY, ..ClipOptions::default() };
    let seed = run_ranks(&model, &seed_plan, options, Dt::F64, &|_, _| true)[0].total;
    let ours = run_ranks(&model, &plan, options, Dt::F64, &|_, _| true)[0].total;
    // How many ranks hold each element: world / (number of distinct shards).
    let copies = [2.0, 4.0, 2.0, 2.0, 8.0, 4.0];
    let seed_want: f64 = model
        .iter()
        .zip(copies)
        .map(|(g, c)| c * g.full.iter().map(|x| x * x).sum::<f64>())
        .sum::<f64>()
        .sqrt();
    let want = direct_norm(all_values(&model), norm);
    assert!(rel(seed, seed_want) <= 1e-12, "{seed} vs {seed_want}");
    assert!(rel(ours, want) <= 1e-12);
    assert!(seed > 1.4 * ours, "seed {seed} ours {ours}");

    // The cp-replicated gradient alone: the seed counts both cp replicas (√2 too large).
    let only_cp = vec![model.into_iter().nth(3).unwrap()];
    let seed_plan = NormPlan { sets: vec![vec![EFSDP, EP, CP]], grad_set: vec![0] };
    let plan = norm_plan(&[only_cp[0].layout()]).unwrap();
    let want = direct_norm(all_values(&only_cp), norm);
    let seed = run_ranks(&only_cp, &seed_plan, options, Dt::F64, &|_, _| true)[0].total;
    let ours = run_ranks(&only_cp, &plan, options, Dt::F64, &|_, _| true)[0].total;
    assert!(rel(seed, want * 2f64.sqrt()) <= 1e-12, "{seed} vs {}", want * 2f64.sqrt());
    assert!(rel(ours, want) <= 1e-12, "{ours} vs {want}");

    // And the seed's p = inf: (Σ max^inf)^(1/inf) is 1.0 whatever the values; ours is the max.
    let seed_inf = |m: f64| m.powf(f64::INFINITY).powf(1.0 / f64::INFINITY);
    let max = direct_norm(all_values(&only_cp), NormType::Inf);
    assert_eq!(seed_inf(max), 1.0);
    let options = ClipOptions { norm: NormType::Inf, max_norm: f64::INFINITY, ..ClipOptions::default() };
    let ours = run_ranks(&only_cp, &plan, options, Dt::F64, &|_, _| true)[0].total;
    assert_eq!(ours, max);
    assert_ne!(ours, 1.0);
}

#[test]
fn ranks_without_gradients_still_join_every_collective() {
    // Two dp-sharded weights (2 and 3 rows over 4 dp ranks, one also replicated over cp) and an
    // expert weight on (efsdp, ep) with 2 rows: dp coordinate 3 (ranks 6 and 7) holds nothing.
    let mut rng = Rng(5);
    let model = vec![
        Grad::new(&mut rng, 2, 3, &[(DP, Place::Shard(0))], false),
        Grad::new(&mut rng, 3, 2, &[(CP, Place::Rep), (DP, Place::Shard(0))], false),
        Grad::new(&mut rng, 2, 4, &[(EP, Place::Shard(0)), (EFSDP, Place::Shard(0))], false),
    ];
    for rank in [6, 7] {
        assert!(model.iter().all(|g| g.local(rank).is_empty()), "rank {rank}");
    }
    let plan = norm_plan(&model.iter().map(Grad::layout).collect::<Vec<_>>()).unwrap();
    assert_eq!(plan.sets.len(), 2);
    for norm in ALL_NORMS {
        let want = direct_norm(all_values(&model), norm);
        let options = ClipOptions { norm, max_norm: want / 2.0, ..ClipOptions::default() };
        // Ranks 6 and 7 pass no gradient at all; the others pass even their empty pieces.
        let results = run_ranks(&model, &plan, options, Dt::F64, &|rank, _| rank < 6);
        for (rank, r) in results.iter().enumerate() {
            assert!(rel(r.total, want) <= 1e-12, "{norm:?} rank {rank}: {} vs {want}", r.total);
            assert_eq!(r.calls.len(), 2, "rank {rank} must call reduce for every set");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Special values.

#[test]
fn norm_type_accepts_positive_p_and_inf_only() {
    assert_eq!(NormType::new(2.0).unwrap(), NormType::P(2.0));
    assert_eq!(NormType::new(0.5).unwrap(), NormType::P(0.5));
    assert_eq!(NormType::new(f64::INFINITY).unwrap(), NormType::Inf);
    for bad in [0.0, -0.0, -1.0, f64::NAN, f64::NEG_INFINITY] {
        let err = NormType::new(bad).unwrap_err();
        assert!(err.message.contains("norm_type must be a finite p > 0"), "{}", err.message);
        assert!(err.message.contains("+inf"), "{}", err.message);
    }
    // A NormType built directly is re-checked.
    let plan = norm_plan(&[GradLayout::plain()]).unwrap();
    let mut g = [1.0f64];
    let err = clip_grad_norm(
        &plan,
        &mut [(0, HostBufMut::F64(&mut g))],
        NormType::P(0.0),
        1.0,
        false,
        &mut no_reduce(),
    )
    .unwrap_err();
    assert!(err.message.contains("got 0.0"), "{}", err.message);
}

fn clip_plain(values: &mut [f64], norm: NormType, max_norm: f64, error_if_nonfinite: bool) -> Result<f64> {
    let plan = norm_plan(&[GradLayout::plain()]).unwrap();
    clip_grad_norm(
        &plan,
        &mut [(0, HostBufMut::F64(values))],
        norm,
        max_norm,
        error_if_nonfinite,
        &mut no_reduce(),
    )
}

#[test]
fn nonfinite_totals_are_returned_and_gradients_left_untouched() {
    for (bad, is_nan) in [(f64::NAN, true), (f64::INFINITY, false), (f64::NEG_INFINITY, false)] {
        for norm in ALL_NORMS {
            let mut g = vec![3.0, bad, -4.0];
            let before: Vec<u64> = g.iter().map(|x| x.to_bits()).collect();
            let total = clip_plain(&mut g, norm, 1.0, false).unwrap();
            assert_eq!(total.is_nan(), is_nan, "{norm:?} {bad}: {total}");
            assert!(!total.is_finite());
            assert_eq!(g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), before, "{norm:?} {bad}");

            let err = clip_plain(&mut g, norm, 1.0, true).unwrap_err();
            assert!(err.message.starts_with("The total norm of order"), "{}", err.message);
            assert!(err.message.contains("non-finite"), "{}", err.message);
            assert_eq!(g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), before);
        }
    }
    // A finite sum of finite values that overflows is non-finite too.
    let mut g = vec![1e200, 1e200];
    assert_eq!(clip_plain(&mut g, NormType::P(2.0), 1.0, false).unwrap(), f64::INFINITY);
    assert_eq!(g, vec![1e200, 1e200]);
}

#[test]
fn the_coefficient_has_the_seeds_epsilon() {
    // ‖(3, 4)‖ = 5 = max_norm: still scaled, by 5 / (5 + 1e-6).
    let mut g = vec![3.0, 4.0];
    assert_eq!(clip_plain(&mut g, NormType::P(2.0), 5.0, false).unwrap(), 5.0);
    let coef = 5.0 / (5.0 + 1e-6);
    assert!(coef < 1.0);
    assert_eq!(g, vec![3.0 * coef, 4.0 * coef]);
    // Below max_norm by more than the epsilon: untouched.
    let mut g = vec![3.0, 4.0];
    clip_plain(&mut g, NormType::P(2.0), 5.00001, false).unwrap();
    assert_eq!(g, vec![3.0, 4.0]);
    assert_eq!(clip_coefficient(5.0, 5.00001), 1.0);
    assert_eq!(clip_coefficient(0.0, 1.0), 1.0);
    assert_eq!(clip_coefficient(9.0, 1.0), 1.0 / (9.0 + 1e-6));
    assert_eq!(clip_coefficient(f64::NAN, 1.0), 1.0);
    assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
    assert_eq!(clip_coefficient(0.0, 0.0), 0.0);
}

#[test]
fn inf_norm_is_the_max_not_the_seeds_one() {
    let mut g = vec![-7.0, 3.0, 5.0];
    assert_eq!(clip_plain(&mut g, NormType::Inf, 100.0, false).unwrap(), 7.0);
    assert_eq!(g, vec![-7.0, 3.0, 5.0]);
    let total = clip_plain(&mut g, NormType::Inf, 3.5, false).unwrap();
    assert_eq!(total, 7.0);
    let coef = 3.5 / (7.0 + 1e-6);
    assert_eq!(g, vec![-7.0 * coef, 3.0 * coef, 5.0 * coef]);
    assert_eq!(combine(&[2.0, 9.0, 4.0], NormType::Inf), 9.0);
    assert!(combine(&[2.0, f64::NAN, 4.0], NormType::Inf).is_nan());
    assert_eq!(combine(&[9.0, 16.0], NormType::P(2.0)), 5.0);
    assert_eq!(combine(&[], NormType::P(2.0)), 0.0);
}

#[test]
fn bad_arguments_are_rejected_before_anything_runs() {
    let plan = norm_plan(&[GradLayout::plain(), GradLayout::new(&[(0, DimRole::Shard)])]).unwrap();
    let mut a = vec![10.0f64];
    let mut b = vec![10.0f64];
    let mut calls = 0;
    let mut counting = |_: usize, v: f64, _: bool| {
        calls += 1;
        Ok(v)
    };
    for max_norm in [-1.0, f64::NAN] {
        let mut grads = [(0, HostBufMut::F64(&mut a))];
        let err =
            clip_grad_norm(&plan, &mut grads, NormType::P(2.0), max_norm, false, &mut counting).unwrap_err();
        assert!(err.message.contains("max_norm must be a number >= 0"), "{}", err.message);
    }
    let mut grads = [(2, HostBufMut::F64(&mut a))];
    let err = clip_grad_norm(&plan, &mut grads, NormType::P(2.0), 1.0, false, &mut counting).unwrap_err();
    assert!(err.message.contains("grads[0] refers to gradient 2"), "{}", err.message);
    let mut grads = [(1, HostBufMut::F64(&mut a)), (1, HostBufMut::F64(&mut b))];
    let err = clip_grad_norm(&plan, &mut grads, NormType::P(2.0), 1.0, false, &mut counting).unwrap_err();
    assert!(err.message.contains("grads[1] refers to gradient 1, which an earlier entry"), "{}", err.message);
    let broken = NormPlan { sets: vec![vec![]], grad_set: vec![0, 1] };
    let mut grads = [(0, HostBufMut::F64(&mut a))];
    let err = clip_grad_norm(&broken, &mut grads, NormType::P(2.0), 1.0, false, &mut counting).unwrap_err();
    assert!(err.message.contains("gradient 1 refers to set 1"), "{}", err.message);
    assert_eq!(calls, 0);
    assert_eq!((a[0], b[0]), (10.0, 10.0));
}

#[test]
fn a_failing_reduce_leaves_gradients_untouched() {
    let plan = norm_plan(&[GradLayout::new(&[(0, DimRole::Shard)]), GradLayout::new(&[(1, DimRole::Shard)])])
        .unwrap();
    let mut a = vec![10.0f64; 4];
    let mut b = vec![10.0f64; 4];
    let mut seen = Vec::new();
    let mut reduce = |set: usize, v: f64, _: bool| {
        seen.push(set);
        if set == 1 { Err(Error::invalid("group 1 is gone")) } else { Ok(v) }
    };
    let mut grads = [(0, HostBufMut::F64(&mut a)), (1, HostBufMut::F64(&mut b))];
    let err = clip_grad_norm(&plan, &mut grads, NormType::P(2.0), 1.0, false, &mut reduce).unwrap_err();
    assert_eq!(err.message, "group 1 is gone");
    assert_eq!(seen, vec![0, 1]);
    assert_eq!((a, b), (vec![10.0; 4], vec![10.0; 4]));
}

// ---------------------------------------------------------------------------------------------
// Conversions and kernels.

/// The f16 bit pattern nearest to `x` (ties to even), by search over every finite f16.
fn f16_oracle(x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = (x as f64).abs();
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    let value = |b: u16| f16_to_f32(b) as f64;
    // Non-negative finite f16 patterns are ordered like their values.
    let (mut lo, mut hi) = (0u16, 0x7bffu16);
    if a >= value(hi) {
        lo = hi;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if value(mid) <= a { lo = mid } else { hi = mid }
    }
    let (dl, dh) = (a - value(lo), value(hi) - a);
    sign | if dl < dh || (dl == dh && lo % 2 == 0) || lo == 0x7bff { lo } else { hi }
}

#[test]
fn f32_to_f16_rounds_to_nearest_even_everywhere() {
    let mut rng = Rng(99);
    let mut cases: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        1e9,
        f32::MAX,
        f32::MIN_POSITIVE,
        2f32.powi(-24),
        2f32.powi(-25),
        2f32.powi(-25) * 1.0001,
        2f32.powi(-26),
        3.0 * 2f32.powi(-25),
        2f32.powi(-14),
        2f32.powi(-14) - 2f32.powi(-25),
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
    ];
    // Random bit patterns with exponents across and around the f16 range.
    for _ in 0..200_000 {
        let bits = rng.next_u64() as u32;
        let exp = 127 - 28 + (bits >> 24) % 46; // 2^-28 .. 2^17
        cases.push(f32::from_bits((bits & 0x8000_0000) | (exp << 23) | (bits & 0x7f_ffff)));
    }
    // Exact midpoints between neighbouring f16 values, and their neighbours.
    for b in (0u16..0x7bff).step_by(7) {
        let mid = ((f16_to_f32(b) as f64 + f16_to_f32(b + 1) as f64) / 2.0) as f32;
        cases.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1), -mid]);
    }
    for x in cases {
        assert_eq!(f32_to_f16(x), f16_oracle(x), "{x:e} ({:#010x})", x.to_bits());
    }
    assert_eq!(f32_to_f16(f32::INFINITY), 0x7c00);
    assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
    assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
    assert!(f16_to_f32(f32_to_f16(-f32::NAN)).is_nan());
}

#[test]
fn f16_and_bf16_special_patterns() {
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24)); // smallest subnormal
    assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24)); // largest subnormal
    assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14)); // smallest normal
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan() && f16_to_f32(0x7c01).is_nan() && f16_to_f32(0xfe00).is_nan());
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    assert_eq!(f16_to_f32(0xc000), -2.0);

    assert_eq!(bf16_to_f32(0x0001), f32::from_bits(0x0001_0000)); // subnormal
    assert_eq!(bf16_to_f32(0x3f80), 1.0);
    assert_eq!(bf16_to_f32(0x7f80), f32::INFINITY);
    assert!(bf16_to_f32(0x7fc0).is_nan() && bf16_to_f32(0x7f81).is_nan());
    // f32 → bf16: ties to even, overflow to inf, NaN stays NaN (even a payload in the low half).
    assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80); // tie → even (down)
    assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82); // tie → even (up)
    assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3f81); // above the tie
    assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
    assert_eq!(f32_to_bf16(-f32::MAX), 0xff80);
    assert_eq!(f32_to_bf16(f32::from_bits(0x0000_8000)), 0x0000); // subnormal tie → even
    assert_eq!(f32_to_bf16(f32::from_bits(0x0001_8000)), 0x0002);
    let nan = f32_to_bf16(f32::from_bits(0x7f80_0001));
    assert!(bf16_to_f32(nan).is_nan(), "{nan:#06x}");
}

fn random_f32(seed: u64, n: usize, scale: f64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n).map(|_| (rng.unit() * scale) as f32).collect()
}

#[test]
fn local_power_sum_matches_the_definition_for_every_type() {
    let xs = random_f32(1, 70_001, 4.0); // a full block, a partial block and a lane tail
    let f64s: Vec<f64> = random_f32(2, 5_003, 4.0).iter().map(|&x| x as f64 * 1.25).collect();
    let bf: Vec<u16> = random_f32(3, 9_999, 4.0).iter().map(|&x| f32_to_bf16(x)).collect();
    let hf: Vec<u16> = random_f32(4, 12_345, 4.0).iter().map(|&x| f32_to_f16(x)).collect();
    let values: Vec<f64> = xs
        .iter()
        .map(|&x| x as f64)
        .chain(f64s.iter().copied())
        .chain(bf.iter().map(|&b| bf16_to_f32(b) as f64))
        .chain(hf.iter().map(|&h| f16_to_f32(h) as f64))
        .collect();
    let bufs = [HostBuf::F32(&xs), HostBuf::F64(&f64s), HostBuf::Bf16(&bf), HostBuf::F16(&hf)];
    for norm in ALL_NORMS {
        let want = match norm {
            NormType::Inf => direct_norm(&values, norm),
            NormType::P(p) => values.iter().map(|x| x.abs().powf(p)).sum(),
        };
        let got = local_power_sum(&bufs, norm, true).unwrap();
        assert!(rel(got, want) <= 1e-12, "{norm:?}: {got} vs {want}");
        let got32 = local_power_sum(&bufs, norm, false).unwrap();
        assert!(rel(got32, want) <= 1e-5, "{norm:?} f32 accumulation: {got32} vs {want}");
        // Each type alone, too.
        for buf in bufs {
            let alone = local_power_sum(&[buf], norm, true).unwrap();
            assert!(alone > 0.0 && alone <= got, "{norm:?}");
        }
    }
    assert_eq!(local_power_sum(&[], NormType::P(2.0), true).unwrap(), 0.0);
    assert_eq!(local_power_sum(&[HostBuf::F32(&[])], NormType::Inf, true).unwrap(), 0.0);
    // f16 subnormals are exact.
    assert_eq!(
        local_power_sum(&[HostBuf::F16(&[0x0001, 0x8003])], NormType::P(1.0), true).unwrap(),
        4.0 * 2f64.powi(-24)
    );
    assert_eq!(
        local_power_sum(&[HostBuf::F16(&[0x0001, 0x8003])], NormType::Inf, true).unwrap(),
        3.0 * 2f64.powi(-24)
    );
    assert_eq!(local_power_sum(&[HostBuf::Bf16(&[0x8001])], NormType::Inf, true).unwrap(), 2f64.powi(-133));
    // p = 2 in f64 does not overflow where f32 would.
    let big = [f32::MAX, f32::MAX];
    assert_eq!(
        local_power_sum(&[HostBuf::F32(&big)], NormType::P(2.0), true).unwrap(),
        2.0 * (f32::MAX as f64).powi(2)
    );
    assert_eq!(local_power_sum(&[HostBuf::F32(&big)], NormType::P(2.0), false).unwrap(), f64::INFINITY);
}

#[test]
fn nan_and_inf_propagate_from_any_position() {
    let n = 40_037;
    for pos in [0, 15, 16, 40_000, n - 1] {
        for norm in ALL_NORMS {
            let mut xs = random_f32(5, n, 1.0);
            xs[pos] = f32::NAN;
            let mut f64s: Vec<f64> = xs.iter().map(|&x| x as f64).collect();
            let bf: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
            let hf: Vec<u16> = xs.iter().map(|&x| f32_to_f16(x)).collect();
            let clean = random_f32(6, 100, 1.0);
            for buf in [HostBuf::F32(&xs), HostBuf::F64(&f64s), HostBuf::Bf16(&bf), HostBuf::F16(&hf)] {
                // In a later buffer, after a clean one.
                assert!(
                    local_power_sum(&[HostBuf::F32(&clean), buf], norm, true).unwrap().is_nan(),
                    "{norm:?} {pos}"
                );
                assert!(local_power_sum(&[buf], norm, false).unwrap().is_nan(), "{norm:?} {pos}");
            }
            xs[pos] = f32::NEG_INFINITY;
            f64s[pos] = f64::NEG_INFINITY;
            let bf: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
            let hf: Vec<u16> = xs.iter().map(|&x| f32_to_f16(x)).collect();
            for buf in [HostBuf::F32(&xs), HostBuf::F64(&f64s), HostBuf::Bf16(&bf), HostBuf::F16(&hf)] {
                assert_eq!(local_power_sum(&[buf], norm, true).unwrap(), f64::INFINITY, "{norm:?} {pos}");
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let a = random_f32(7, 1_500_001, 2.0);
    let b: Vec<u16> = random_f32(8, 700_003, 2.0).iter().map(|&x| f32_to_bf16(x)).collect();
    let c: Vec<u16> = random_f32(9, 65_536 * 3, 2.0).iter().map(|&x| f32_to_f16(x)).collect();
    let bufs = [HostBuf::F32(&a), HostBuf::Bf16(&b), HostBuf::F16(&c), HostBuf::F32(&a[..17])];
    for norm in ALL_NORMS {
        for acc in [true, false] {
            let one = local_power_sum_threads(&bufs, norm, acc, 1).unwrap();
            for threads in [0, 2, 3, 5, 8, 64] {
                let many = local_power_sum_threads(&bufs, norm, acc, threads).unwrap();
                assert_eq!(many.to_bits(), one.to_bits(), "{norm:?} acc_f64={acc} threads={threads}");
            }
            assert_eq!(local_power_sum(&bufs, norm, acc).unwrap().to_bits(), one.to_bits());
        }
    }
}

#[test]
fn scaling_rounds_to_nearest_even_and_covers_every_element() {
    // bf16: 1.0 × (1 + 2^-8) is a tie between 1.0 (even) and 1 + 2^-7; × (1 + 3·2^-8) a tie
    // between 1 + 2^-7 and 1 + 2^-6 (even); × (1 - 2^-9) a tie between 1 - 2^-8 and 1.0 (even).
    for (coef, want) in
        [(1.0 + 2f64.powi(-8), 0x3f80u16), (1.0 + 3.0 * 2f64.powi(-8), 0x3f82), (1.0 - 2f64.powi(-9), 0x3f80)]
    {
        let mut v = [0x3f80u16, 0xbf80];
        scale_in_place(&mut [HostBufMut::Bf16(&mut v)], coef).unwrap();
        assert_eq!(v, [want, want | 0x8000], "coef {coef}");
    }
    // f16: 1.0 × (1 + 2^-11) ties to 1.0; × (1 + 3·2^-11) ties up to 1 + 2^-9; subnormal results.
    let mut v = [0x3c00u16];
    scale_in_place(&mut [HostBufMut::F16(&mut v)], 1.0 + 2f64.powi(-11)).unwrap();
    assert_eq!(v, [0x3c00]);
    let mut v = [0x3c00u16];
    scale_in_place(&mut [HostBufMut::F16(&mut v)], 1.0 + 3.0 * 2f64.powi(-11)).unwrap();
    assert_eq!(v, [0x3c02]);
    let mut v = [0x0400u16, 0x0003, 0x7bff];
    scale_in_place(&mut [HostBufMut::F16(&mut v)], 0.5).unwrap();
    assert_eq!(v, [0x0200, 0x0002, 0x77ff]); // 2^-15 (subnormal), 1.5·2^-24 → 2·2^-24 (even), 32752
    // f32 and f64.
    let mut f = [3.0f32, -1.5];
    let mut d = [3.0f64, -1.5];
    scale_in_place(&mut [HostBufMut::F32(&mut f), HostBufMut::F64(&mut d)], 0.1).unwrap();
    assert_eq!(f, [3.0 * 0.1f32, -1.5 * 0.1f32]);
    assert_eq!(d, [3.0 * 0.1, -1.5 * 0.1]);

    // Threaded scaling touches every element exactly once.
    let orig = random_f32(10, 2_000_003, 1.0);
    let orig_bf: Vec<u16> = orig.iter().map(|&x| f32_to_bf16(x)).collect();
    for threads in [1, 2, 3, 7] {
        let mut a = orig.clone();
        let mut b = orig_bf.clone();
        let mut c = orig[..1000].to_vec();
        scale_in_place_threads(
            &mut [HostBufMut::F32(&mut a), HostBufMut::Bf16(&mut b), HostBufMut::F32(&mut c)],
            0.3,
            threads,
        )
        .unwrap();
        assert!(a.iter().zip(&orig).all(|(x, o)| *x == o * 0.3f32), "threads {threads}");
        assert!(c.iter().zip(&orig).all(|(x, o)| *x == o * 0.3f32), "threads {threads}");
        assert!(
            b.iter().zip(&orig_bf).all(|(x, o)| *x == f32_to_bf16(bf16_to_f32(*o) * 0.3f32)),
            "threads {threads}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The C ABI, called from Rust.

/// FSDPTURBO_CLIP_OPTIONS_INIT.
fn options() -> fsdpturbo_clip_options_t {
    fsdpturbo_clip_options_t {
        struct_size: std::mem::size_of::<fsdpturbo_clip_options_t>(),
        max_norm: 1.0,
        norm_type: 2.0,
        error_if_nonfinite: false,
        accumulate_f64: true,
    }
}

fn grad_f64(data: &mut [f64], dims: &[u32], roles: &[i32]) -> fsdpturbo_grad_t {
    fsdpturbo_grad_t {
        data: std::ptr::null(),
        mut_data: data.as_mut_ptr().cast(),
        numel: data.len(),
        dtype: FSDPTURBO_DTYPE_F64,
        dims: dims.as_ptr(),
        roles: roles.as_ptr(),
        n_dims: dims.len(),
    }
}

#[derive(Default)]
struct Recorder {
    calls: Vec<(usize, Vec<u32>, i32, f64)>,
    /// Multiply sums by this many simulated ranks (each holding the same values).
    ranks: f64,
    fail_on: Option<(usize, i32)>,
}

unsafe extern "C" fn record(
    user: *mut c_void,
    set_index: usize,
    dims: *const u32,
    n_dims: usize,
    op: i32,
    value: *mut f64,
) -> i32 {
    let rec = unsafe { &mut *user.cast::<Recorder>() };
    let dims = unsafe { std::slice::from_raw_parts(dims, n_dims) }.to_vec();
    let v = unsafe { *value };
    rec.calls.push((set_index, dims, op, v));
    if let Some((set, status)) = rec.fail_on {
        if set == set_index {
            return status;
        }
    }
    if op == FSDPTURBO_REDUCE_SUM {
        unsafe { *value = v * rec.ranks };
    }
    0
}

/// fsdpturbo_clip_grad_norm over all of `grads`, reducing through `record` into `rec`.
fn clip_recorded(
    opts: &fsdpturbo_clip_options_t,
    grads: &[fsdpturbo_grad_t],
    rec: &mut Recorder,
    total: &mut f64,
) -> i32 {
    fsdpturbo_clip_grad_norm(
        opts,
        grads.as_ptr(),
        grads.len(),
        Some(record),
        (rec as *mut Recorder).cast(),
        total,
    )
}

#[test]
fn c_abi_calls_reduce_once_per_set_with_its_dims_and_op() {
    let shard = [FSDPTURBO_DIM_SHARD, FSDPTURBO_DIM_SHARD];
    let rep_shard = [FSDPTURBO_DIM_REPLICATE, FSDPTURBO_DIM_SHARD];
    let mut a = vec![3.0f64, 4.0]; // set [1, 3]
    let mut b = vec![12.0f64]; // set [0]
    let mut c = vec![1.0f64, 2.0]; // plain: no collective
    let mut d: Vec<f64> = vec![]; // set [1, 3], empty here
    let grads = [
        grad_f64(&mut a, &[3, 1], &shard),
        grad_f64(&mut b, &[2, 0], &rep_shard),
        grad_f64(&mut c, &[], &[]),
        grad_f64(&mut d, &[1, 3], &shard),
    ];
    let mut rec = Recorder { ranks: 2.0, ..Recorder::default() };
    let opts = fsdpturbo_clip_options_t { max_norm: 100.0, ..options() };
    let mut total = -1.0;
    let status = clip_recorded(&opts, &grads, &mut rec, &mut total);
    assert_eq!(status, FSDPTURBO_OK, "{}", last_error());
    assert_eq!(
        rec.calls,
        vec![(0, vec![1, 3], FSDPTURBO_REDUCE_SUM, 25.0), (1, vec![0], FSDPTURBO_REDUCE_SUM, 144.0)]
    );
    assert_eq!(total, (2.0 * 25.0 + 2.0 * 144.0 + 5.0f64).sqrt());
    assert_eq!((a.clone(), b.clone(), c.clone()), (vec![3.0, 4.0], vec![12.0], vec![1.0, 2.0]));

    // p = inf: MAX, and the clip scales every gradient.
    let mut rec = Recorder::default();
    let opts = fsdpturbo_clip_options_t { max_norm: 6.0, norm_type: f64::INFINITY, ..options() };
    let status = clip_recorded(&opts, &grads, &mut rec, &mut total);
    assert_eq!(status, FSDPTURBO_OK, "{}", last_error());
    assert_eq!(
        rec.calls.iter().map(|c| (c.0, c.2, c.3)).collect::<Vec<_>>(),
        vec![(0, FSDPTURBO_REDUCE_MAX, 4.0), (1, FSDPTURBO_REDUCE_MAX, 12.0)]
    );
    assert_eq!(total, 12.0);
    let coef = 6.0 / (12.0 + 1e-6);
    assert_eq!((b[0], c[1]), (12.0 * coef, 2.0 * coef));
}

#[test]
fn c_abi_callback_errors_propagate_with_the_set() {
    let shard = [FSDPTURBO_DIM_SHARD];
    let mut a = vec![30.0f64];
    let mut b = vec![40.0f64];
    let grads = [grad_f64(&mut a, &[5], &shard), grad_f64(&mut b, &[6], &shard)];
    let mut rec = Recorder { ranks: 1.0, fail_on: Some((1, 42)), ..Recorder::default() };
    let mut total = -1.0;
    let status = clip_recorded(&options(), &grads, &mut rec, &mut total);
    assert_eq!(status, 42);
    let msg = last_error();
    assert!(msg.contains("status 42 for set 1 (mesh dims [6], op SUM)"), "{msg}");
    assert_eq!(rec.calls.len(), 2);
    assert_eq!((a[0], b[0], total), (30.0, 40.0, -1.0));
}

#[test]
fn c_abi_rejects_nulls_bad_integers_and_bad_structs() {
    let shard = [FSDPTURBO_DIM_SHARD];
    let mut a = vec![3.0f64, 4.0];
    let good = grad_f64(&mut a, &[0], &shard);
    let mut rec = Recorder { ranks: 1.0, ..Recorder::default() };
    let user = (&mut rec as *mut Recorder).cast::<c_void>();
    let mut total = 0.0;
    let call = |opts: *const fsdpturbo_clip_options_t,
                grads: &[fsdpturbo_grad_t],
                reduce: fsdpturbo_reduce_fn,
                out: *mut f64| {
        let status = fsdpturbo_clip_grad_norm(opts, grads.as_ptr(), grads.len(), reduce, user, out);
        (status, last_error())
    };
    let g = |f: &dyn Fn(&mut fsdpturbo_grad_t)| {
        let mut g = fsdpturbo_grad_t { ..good };
        f(&mut g);
        g
    };

    let (s, m) = call(std::ptr::null(), &[g(&|_| {})], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_NULL_ARGUMENT, "{m}");
    let (s, m) = call(&options(), &[g(&|_| {})], Some(record), std::ptr::null_mut());
    assert_eq!(s, FSDPTURBO_ERR_NULL_ARGUMENT, "{m}");
    assert!(m.contains("out_total_norm"), "{m}");
    let s = fsdpturbo_clip_grad_norm(&options(), std::ptr::null(), 1, Some(record), user, &mut total);
    assert_eq!(s, FSDPTURBO_ERR_NULL_ARGUMENT);
    let (s, m) = call(&options(), &[g(&|g| g.mut_data = std::ptr::null_mut())], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_NULL_ARGUMENT, "{m}");
    assert_eq!(
        m,
        "argument `grads[0].mut_data` is NULL but numel is 2; NULL is accepted only when numel is 0"
    );
    let (s, m) = call(&options(), &[g(&|g| g.dims = std::ptr::null())], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_NULL_ARGUMENT, "{m}");
    let (s, m) = call(&options(), &[g(&|_| {})], None, &mut total);
    assert_eq!(s, FSDPTURBO_ERR_NULL_ARGUMENT, "{m}");
    assert_eq!(m, "argument `reduce` is NULL but set 0 (mesh dims [0]) needs a collective");

    let (s, m) = call(&options(), &[g(&|g| g.dtype = 7)], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("grads[0].dtype") && m.contains("is 7"), "{m}");
    let bad_role = [5i32];
    let (s, m) = call(&options(), &[g(&|g| g.roles = bad_role.as_ptr())], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("grads[0].roles[0]") && m.contains("is 5"), "{m}");
    let partial = [FSDPTURBO_DIM_PARTIAL];
    let (s, m) = call(&options(), &[g(&|g| g.roles = partial.as_ptr())], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("gradient 0: the gradient is Partial on mesh dim 0"), "{m}");
    for p in [0.0, -2.0, f64::NAN] {
        let (s, m) = call(
            &fsdpturbo_clip_options_t { norm_type: p, ..options() },
            &[g(&|_| {})],
            Some(record),
            &mut total,
        );
        assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
        assert!(m.starts_with("options.norm_type: norm_type must be"), "{m}");
    }
    let (s, m) = call(
        &fsdpturbo_clip_options_t { max_norm: -1.0, ..options() },
        &[g(&|_| {})],
        Some(record),
        &mut total,
    );
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT, "{m}");

    // A struct_size below v1 is rejected; a larger one (a newer header) is accepted.
    let small = fsdpturbo_clip_options_t { struct_size: 16, ..options() };
    let (s, m) = call(&small, &[g(&|_| {})], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_STRUCT_SIZE);
    assert_eq!(
        m,
        "argument `options` (fsdpturbo_clip_options_t) has struct_size 16; this library accepts 32 (the \
         first version's size) or more (a newer header's): initialise it with FSDPTURBO_CLIP_OPTIONS_INIT"
    );
    #[repr(C)]
    struct Newer {
        v1: fsdpturbo_clip_options_t,
        extra: [u64; 4],
    }
    let newer = Newer {
        v1: fsdpturbo_clip_options_t {
            struct_size: std::mem::size_of::<Newer>(),
            max_norm: 10.0,
            ..options()
        },
        extra: [u64::MAX; 4],
    };
    let (s, m) = call(&newer.v1, &[g(&|_| {})], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_OK, "{m}");
    assert_eq!(total, 5.0);

    // A bool field holding a byte other than 0 or 1.
    let mut raw = [0u64; 8];
    let opts = options();
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&opts as *const fsdpturbo_clip_options_t).cast::<u8>(),
            raw.as_mut_ptr().cast::<u8>(),
            std::mem::size_of::<fsdpturbo_clip_options_t>(),
        );
        *raw.as_mut_ptr().cast::<u8>().add(std::mem::offset_of!(fsdpturbo_clip_options_t, accumulate_f64)) =
            2;
    }
    let (s, m) = call(raw.as_ptr().cast(), &[g(&|_| {})], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("options.accumulate_f64") && m.contains("byte 2"), "{m}");

    // Misaligned, overlapping and read/write-mismatched data.
    let mut words = [0u64; 4];
    let misaligned = unsafe { words.as_mut_ptr().cast::<u8>().add(2) };
    let (s, m) = call(
        &options(),
        &[g(&|g| {
            g.mut_data = misaligned.cast();
            g.dtype = FSDPTURBO_DTYPE_F32
        })],
        Some(record),
        &mut total,
    );
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("not aligned"), "{m}");
    let second = g(&|g| g.mut_data = unsafe { g.mut_data.cast::<f64>().add(1) }.cast());
    let (s, m) = call(&options(), &[g(&|_| {}), g(&|g| g.numel = 1), second], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("overlap"), "{m}");
    let other = [1.0f64, 2.0];
    let (s, m) = call(&options(), &[g(&|g| g.data = other.as_ptr().cast())], Some(record), &mut total);
    assert_eq!(s, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(m.contains("grads[0].data` must be NULL or equal to `mut_data`"), "{m}");
    assert!(rec.calls.len() == 1, "only the newer-struct call reached reduce: {:?}", rec.calls);
    assert_eq!(a, vec![3.0, 4.0]);

    // Without any set that needs a collective, reduce may be NULL.
    let plain = g(&|g| g.n_dims = 0);
    let (s, m) = call(&fsdpturbo_clip_options_t { max_norm: 10.0, ..options() }, &[plain], None, &mut total);
    assert_eq!(s, FSDPTURBO_OK, "{m}");
    assert_eq!(total, 5.0);
}

#[test]
fn c_abi_nonfinite_total_is_written_and_optionally_an_error() {
    let mut a = vec![3.0f64, f64::INFINITY];
    let grads = [grad_f64(&mut a, &[], &[])];
    for error_if_nonfinite in [false, true] {
        let mut total = 0.0;
        let opts = fsdpturbo_clip_options_t { error_if_nonfinite, ..options() };
        let s = fsdpturbo_clip_grad_norm(&opts, grads.as_ptr(), 1, None, std::ptr::null_mut(), &mut total);
        let want = if error_if_nonfinite { FSDPTURBO_ERR_INVALID_ARGUMENT } else { FSDPTURBO_OK };
        assert_eq!(s, want);
        if error_if_nonfinite {
            assert!(last_error().contains("non-finite (inf)"), "{}", last_error());
        }
        assert_eq!(total, f64::INFINITY);
    }
    assert_eq!(a, vec![3.0, f64::INFINITY]);
}

#[test]
fn c_abi_bf16_clip_and_local_power_sum() {
    let xs = random_f32(12, 3000, 2.0);
    let mut bf: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
    let hf: Vec<u16> = xs.iter().map(|&x| f32_to_f16(x)).collect();
    let want_bf = local_power_sum(&[HostBuf::Bf16(&bf)], NormType::P(2.0), true).unwrap();
    let want_all =
        local_power_sum(&[HostBuf::Bf16(&bf), HostBuf::F16(&hf), HostBuf::F32(&xs)], NormType::P(3.5), false)
            .unwrap();

    let list = [
        fsdpturbo_grad_t {
            data: bf.as_ptr().cast(),
            mut_data: std::ptr::null_mut(),
            numel: bf.len(),
            dtype: FSDPTURBO_DTYPE_BF16,
            dims: std::ptr::null(),
            roles: std::ptr::null(),
            n_dims: 0,
        },
        fsdpturbo_grad_t {
            data: hf.as_ptr().cast(),
            mut_data: std::ptr::null_mut(),
            numel: hf.len(),
            dtype: FSDPTURBO_DTYPE_F16,
            dims: std::ptr::null(),
            roles: std::ptr::null(),
            n_dims: 0,
        },
        fsdpturbo_grad_t {
            data: std::ptr::null(),
            mut_data: xs.as_ptr().cast_mut().cast(),
            numel: xs.len(),
            dtype: FSDPTURBO_DTYPE_F32,
            dims: std::ptr::null(),
            roles: std::ptr::null(),
            n_dims: 0,
        },
    ];
    let mut out = 0.0;
    assert_eq!(fsdpturbo_local_power_sum(list.as_ptr(), 3, 3.5, false, &mut out), FSDPTURBO_OK);
    assert_eq!(out, want_all);
    assert_eq!(fsdpturbo_local_power_sum(list.as_ptr(), 0, 2.0, true, &mut out), FSDPTURBO_OK);
    assert_eq!(out, 0.0);
    assert_eq!(
        fsdpturbo_local_power_sum(list.as_ptr(), 3, 0.0, true, &mut out),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        fsdpturbo_local_power_sum(list.as_ptr(), 3, 2.0, true, std::ptr::null_mut()),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    let bad = [fsdpturbo_grad_t { dtype: -1, ..list[0] }];
    assert_eq!(
        fsdpturbo_local_power_sum(bad.as_ptr(), 1, 2.0, true, &mut out),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    let null = [fsdpturbo_grad_t { data: std::ptr::null(), ..list[0] }];
    assert_eq!(fsdpturbo_local_power_sum(null.as_ptr(), 1, 2.0, true, &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);

    // Clip the bf16 gradient, sharded over 4 simulated identical ranks.
    let orig = bf.clone();
    let dims = [9u32];
    let roles = [FSDPTURBO_DIM_SHARD];
    let grads = [fsdpturbo_grad_t {
        data: std::ptr::null(),
        mut_data: bf.as_mut_ptr().cast(),
        dims: dims.as_ptr(),
        roles: roles.as_ptr(),
        n_dims: 1,
        ..list[0]
    }];
    let mut rec = Recorder { ranks: 4.0, ..Recorder::default() };
    let mut total = 0.0;
    let s = fsdpturbo_clip_grad_norm(
        &options(),
        grads.as_ptr(),
        1,
        Some(record),
        (&mut rec as *mut Recorder).cast(),
        &mut total,
    );
    assert_eq!(s, FSDPTURBO_OK, "{}", last_error());
    assert_eq!(total, (4.0 * want_bf).sqrt());
    let coef = (1.0 / (total + 1e-6)) as f32;
    assert!(bf.iter().zip(&orig).all(|(b, o)| *b == f32_to_bf16(bf16_to_f32(*o) * coef)));
    assert_ne!(bf, orig);
}

/// The reduction plan through the C ABI (`fsdpturbo_norm_plan`): the example of
/// `plans_batch_identical_sets_in_first_seen_order`, equal to `norm_plan`, with data fields
/// ignored, short buffers and the errors.
#[test]
fn c_abi_norm_plan_is_the_cores_plan() {
    use DimRole::*;
    let (s, r) = (FSDPTURBO_DIM_SHARD, FSDPTURBO_DIM_REPLICATE);
    let layouts: [(&[u32], &[i32]); 6] =
        [(&[3], &[s]), (&[0, 1], &[s, s]), (&[], &[]), (&[1, 0], &[s, s]), (&[2, 3], &[r, s]), (&[1], &[r])];
    let grads: Vec<fsdpturbo_grad_t> = layouts
        .iter()
        .map(|(dims, roles)| fsdpturbo_grad_t {
            data: std::ptr::null(),
            mut_data: std::ptr::null_mut(),
            numel: 7, // ignored: no data is read
            dtype: -5,
            dims: dims.as_ptr(),
            roles: roles.as_ptr(),
            n_dims: dims.len(),
        })
        .collect();
    let core = norm_plan(&[
        GradLayout::new(&[(3, Shard)]),
        GradLayout::new(&[(0, Shard), (1, Shard)]),
        GradLayout::plain(),
        GradLayout::new(&[(1, Shard), (0, Shard)]),
        GradLayout::new(&[(2, Replicate), (3, Shard)]),
        GradLayout::new(&[(1, Replicate)]),
    ])
    .unwrap();

    let (mut grad_set, mut ends, mut dims) = ([usize::MAX; 6], [0usize; 6], [0u32; 8]);
    let (mut n_sets, mut n_dims) = (0usize, 0usize);
    let status = fsdpturbo_norm_plan(
        grads.as_ptr(),
        grads.len(),
        grad_set.as_mut_ptr(),
        ends.as_mut_ptr(),
        ends.len(),
        &mut n_sets,
        dims.as_mut_ptr(),
        dims.len(),
        &mut n_dims,
    );
    assert_eq!(status, FSDPTURBO_OK, "{}", last_error());
    assert_eq!(grad_set.to_vec(), core.grad_set);
    let mut start = 0;
    let sets: Vec<Vec<u32>> = ends[..n_sets]
        .iter()
        .map(|&end| {
            let set = dims[start..end].to_vec();
            start = end;
            set
        })
        .collect();
    assert_eq!(sets, core.sets);
    assert_eq!((n_sets, n_dims), (3, 3));

    // Too short: the lengths are reported and nothing else is written.
    let mut few = [usize::MAX; 2];
    let mut grad_set = [usize::MAX; 6];
    let status = fsdpturbo_norm_plan(
        grads.as_ptr(),
        grads.len(),
        grad_set.as_mut_ptr(),
        few.as_mut_ptr(),
        few.len(),
        &mut n_sets,
        dims.as_mut_ptr(),
        dims.len(),
        &mut n_dims,
    );
    assert_eq!(status, FSDPTURBO_ERR_BUFFER_TOO_SMALL);
    assert_eq!((n_sets, n_dims, few, grad_set), (3, 3, [usize::MAX; 2], [usize::MAX; 6]));

    // An empty list is an empty plan; NULL buffers are fine then.
    let status = fsdpturbo_norm_plan(
        std::ptr::null(),
        0,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        0,
        &mut n_sets,
        std::ptr::null_mut(),
        0,
        &mut n_dims,
    );
    assert_eq!((status, n_sets, n_dims), (FSDPTURBO_OK as i32, 0, 0));

    // Partial, a repeated dim and an unknown role are errors naming the gradient.
    for (bad_dims, bad_roles, needle) in [
        ([4u32, 5], [s, FSDPTURBO_DIM_PARTIAL], "gradient 1: the gradient is Partial on mesh dim 5"),
        ([4, 4], [s, r], "gradient 1: mesh dim 4 appears twice"),
        ([4, 5], [s, 7], "`grads[1].roles[1]` is 7"),
    ] {
        let bad = [
            fsdpturbo_grad_t { ..grads[0] },
            fsdpturbo_grad_t { dims: bad_dims.as_ptr(), roles: bad_roles.as_ptr(), n_dims: 2, ..grads[0] },
        ];
        let status = fsdpturbo_norm_plan(
            bad.as_ptr(),
            2,
            grad_set.as_mut_ptr(),
            ends.as_mut_ptr(),
            ends.len(),
            &mut n_sets,
            dims.as_mut_ptr(),
            8,
            &mut n_dims,
        );
        assert_eq!(status, FSDPTURBO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains(needle), "{}", last_error());
    }
}
